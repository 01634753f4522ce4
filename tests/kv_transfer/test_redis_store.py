"""RedisStore against a real redis-server: round trip, eviction by the server, faults and
recovery (server killed mid-run, then restarted on the same port), a server that never answers,
threads. Skipped, with the reason, where redis-server is not installed."""

from __future__ import annotations

import socket

import pytest
import redis

from pagedserve.kv_transfer.redis_store import RedisStore
from pagedserve.kv_transfer.store import KVStoreError
from tests.kv_transfer.threads import run_in_threads
from tests.kv_transfer.redis_server import RedisServer

KB = 1024


@pytest.fixture
def server():
    with RedisServer() as server:  # killed by its pid on teardown, pass or fail
        yield server


@pytest.fixture
def make_store():
    stores: list[RedisStore] = []

    def factory(url: str, **kwargs) -> RedisStore:
        stores.append(RedisStore(url, **kwargs))
        return stores[-1]

    yield factory
    for store in stores:
        store.close()


def test_round_trip_and_contains(server, make_store):
    store = make_store(server.url)
    key = "model:abc:" + "0f" * 90
    assert store.get(key) is None
    assert store.contains([]) == []
    assert store.contains([key, "other"]) == [False, False]
    store.put(key, b"\x00\xff" * (1024 * KB))  # 2 MiB, binary
    assert store.get(key) == b"\x00\xff" * (1024 * KB)
    store.put(key, b"v2")
    assert store.get(key) == b"v2"
    assert store.contains([key, "other", key]) == [True, False, True]


def test_instances_share_the_server(server, make_store):
    a, b = make_store(server.url), make_store(server.url)
    a.put("k", b"from a")
    assert b.contains(["k"]) == [True] and b.get("k") == b"from a"


def test_ttl_sets_an_expiry(server, make_store):
    store = make_store(server.url, ttl_s=100)
    store.put("k", b"v")
    with redis.Redis.from_url(server.url) as client:
        assert 0 < client.ttl("k") <= 100


def test_server_evicts_past_maxmemory_with_allkeys_lru(make_store):
    with RedisServer(maxmemory="4mb") as server:
        store = make_store(server.url)
        for i in range(80):  # 8 MB into 4 MB: no write is refused, old ones go
            store.put(f"k{i}", bytes([i]) * (100 * KB))
        present = store.contains([f"k{i}" for i in range(80)])
        assert 0 < sum(present) < 40


def test_full_server_without_eviction_fails_the_put_without_back_off(make_store):
    with RedisServer(maxmemory="2mb", policy="noeviction") as server:
        store = make_store(server.url, retry_interval_s=3600)
        with pytest.raises(KVStoreError, match="OOM|maxmemory"):
            for i in range(60):
                store.put(f"k{i}", bytes([i]) * (100 * KB))
        assert store.get("k0") == bytes([0]) * (100 * KB)  # the server is fine: no back-off


def test_killed_server_is_a_fault_then_recovers_after_back_off(server, make_store):
    store = make_store(server.url, retry_interval_s=3600)
    store.put("k", b"v")
    assert store.get("k") == b"v"

    server.stop()  # SIGKILL mid-run: the pooled connection is now dead
    with pytest.raises(KVStoreError, match="ConnectionError"):
        store.get("k")
    server.restart()  # same port, empty (no persistence)
    # Within the back-off, calls fail at once without touching the server.
    for call in (lambda: store.get("k"), lambda: store.put("k", b"v"),
                 lambda: store.contains(["k"])):
        with pytest.raises(KVStoreError, match="down, next try in"):
            call()

    store.retry_interval_s = 0  # the interval has passed: the same store reconnects by itself
    assert store.get("k") is None  # the restarted server lost it
    store.put("k", b"v2")
    assert store.contains(["k"]) == [True] and store.get("k") == b"v2"


def test_every_call_faults_while_the_server_is_down(server, make_store):
    store = make_store(server.url, retry_interval_s=0)  # no back-off: each call hits the socket
    server.stop()
    for call in (lambda: store.get("k"), lambda: store.put("k", b"v"),
                 lambda: store.contains(["k"])):
        with pytest.raises(KVStoreError, match="ConnectionError"):
            call()
    server.start()
    store.put("k", b"v")
    assert store.get("k") == b"v"


def test_server_that_never_answers_times_out(make_store):
    with socket.socket() as listener:  # accepts connections (kernel backlog), never replies
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        store = make_store(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, retry_interval_s=0)
        with pytest.raises(KVStoreError, match="Timeout"):
            store.get("k")


def test_threads_put_and_get(server, make_store):
    store = make_store(server.url)
    num_threads, num_keys = 4, 20

    def work(t: int) -> None:
        for i in range(num_keys):
            store.put(f"t{t}-k{i}", bytes([t, i]) * KB)
            assert store.get(f"t{t}-k{i}") == bytes([t, i]) * KB
            assert store.contains([f"t{t}-k{j}" for j in range(i + 1)]) == [True] * (i + 1)

    run_in_threads(work, num_threads)
