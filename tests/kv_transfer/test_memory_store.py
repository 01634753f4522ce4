"""MemoryStore: byte-bounded LRU in host memory."""

from __future__ import annotations

from pagedserve.kv_transfer.store import MemoryStore


def test_lru_eviction_by_bytes():
    store = MemoryStore(max_bytes=30)
    for key in "abc":
        store.put(key, key.encode() * 10)
    assert store.get("a") == b"a" * 10  # a is now the most recent: b goes first
    store.put("d", b"d" * 10)
    assert store.contains(list("abcd")) == [True, False, True, True]
    assert store.num_bytes == 30


def test_oversized_put_drops_the_old_value():
    # "Replacing any under the key": a value too big to keep must not leave the old one readable.
    store = MemoryStore(max_bytes=10)
    store.put("k", b"old")
    store.put("k", b"x" * 11)
    assert store.get("k") is None and store.contains(["k"]) == [False]
    assert store.num_bytes == 0
