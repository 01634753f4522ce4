"""Where a KV tier keeps its blocks: bytes by key, behind one small interface.

A store knows nothing about models, blocks or tokens: the connector (kv_transfer/connector.py)
encodes each block into one self-checking payload (kv_transfer/block_codec.py) and names it by a
key that carries the model, the KV layout and the chained block hash. So a store may lose,
truncate or corrupt a value and the worst outcome is a recompute.

Every method may raise KVStoreError on an I/O fault (a dead server, a full or read-only disk). The
connector counts the fault and treats it as a miss (get/contains) or a skipped save (put); it never
reaches a request.

  DiskStore    kv_transfer/disk_store.py: one file per key, size-bounded LRU (the embedded default)
  RedisStore   kv_transfer/redis_store.py: a pool shared by every instance that points at it
  MemoryStore  here: host memory, size-bounded LRU (HostOffloadConnector, and tests)
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict


class KVStoreError(Exception):
    """An I/O fault of a store (not a miss: a missing key is None / False)."""


class KVStore(ABC):
    name: str = "store"
    """Short label for metrics and logs (disk, redis, host)."""

    @abstractmethod
    def contains(self, keys: list[str]) -> list[bool]:
        """Whether each key is (probably) present. A True may still miss on get (evicted since,
        or corrupt): callers must handle that."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value, or None if absent."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> None:
        """Store a value (replacing any under the key); may evict others to stay in bounds."""

    def close(self) -> None:
        """Release connections and handles; the store is not used after."""


class MemoryStore(KVStore):
    """Values in this process's memory, least recently used evicted past max_bytes. Thread-safe."""

    name = "host"

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def contains(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: str, value: bytes) -> None:
        with self._lock:
            old = self._values.pop(key, None)
            if old is not None:
                self.num_bytes -= len(old)
            if len(value) > self.max_bytes:
                return  # could never fit: not stored (and the old value is gone), like an eviction
            while self._values and self.num_bytes + len(value) > self.max_bytes:
                _, evicted = self._values.popitem(last=False)
                self.num_bytes -= len(evicted)
            self._values[key] = value
            self.num_bytes += len(value)
