"""RedisStore: KV payloads in a Redis server, a pool shared by every instance pointing at it.

Owns the connection (short timeouts, one quick retry for a connection gone stale) and the
back-off after a fault, so a dead server costs each caller one fast KVStoreError rather than a
timeout per block. Eviction is Redis's own: the operator sets `maxmemory` and
`maxmemory-policy allkeys-lru` on the server (with the default `noeviction` a full server refuses
writes, which the connector counts as skipped saves).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pagedserve.kv_transfer.store import KVStore, KVStoreError

T = TypeVar("T")


class RedisStore(KVStore):
    """Thread-safe: redis-py's client hands each thread its own pooled connection.

    After a connection fault (refused, reset, timed out) every call raises KVStoreError at once
    for retry_interval_s, then the next call tries the server again; redis-py reconnects by
    itself, so the store recovers when the server comes back.
    """

    name = "redis"

    def __init__(self, url: str, *, connect_timeout_s: float = 1.0, timeout_s: float = 2.0,
                 retry_interval_s: float = 1.0, ttl_s: int | None = None) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        if retry_interval_s < 0:
            raise ValueError(f"retry_interval_s must be >= 0, got {retry_interval_s}")
        self._label = f"redis store {_redacted(url)}"  # for messages: no password in the logs
        self.ttl_s = ttl_s
        self.retry_interval_s = retry_interval_s
        """Seconds after a connection fault during which calls fail fast without a round trip."""
        self._failed_at: float | None = None  # time.monotonic() of the last connection fault
        # One immediate retry: a pooled connection to a server that restarted fails once, then
        # reconnects. redis-py's default (3 retries, exponential back-off) would stall callers.
        self._client = redis.Redis.from_url(
            url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1))

    def contains(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []

        def exists():
            pipe = self._client.pipeline(transaction=False)  # one round trip
            for key in keys:
                pipe.exists(key)
            return pipe.execute()

        return [count > 0 for count in self._call(exists)]

    def get(self, key: str) -> bytes | None:
        return self._call(lambda: self._client.get(key))

    def put(self, key: str, value: bytes) -> None:
        self._call(lambda: self._client.set(key, value, ex=self.ttl_s))

    def close(self) -> None:
        self._client.close()

    def _call(self, command: Callable[[], T]) -> T:
        failed_at = self._failed_at
        if failed_at is not None:
            wait_s = failed_at + self.retry_interval_s - time.monotonic()
            if wait_s > 0:
                raise KVStoreError(f"{self._label}: down, next try in {wait_s:.1f}s")
        try:
            result = command()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            self._failed_at = time.monotonic()
            raise KVStoreError(f"{self._label}: {type(e).__name__}: {e}") from e
        except redis.RedisError as e:  # the server answered with an error (e.g. OOM): no back-off
            raise KVStoreError(f"{self._label}: {type(e).__name__}: {e}") from e
        self._failed_at = None
        return result


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=host, query="").geturl()
