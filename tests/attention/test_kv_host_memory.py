"""PrefaultedHostMemory: the KV pool carved from memory faulted in beside the weight loading
equals a torch.zeros pool (shapes, dtypes, zeros, one storage per tensor), and the memory goes
back to the system with the last tensor."""

from __future__ import annotations

import gc

import pytest
import torch

from pagedserve.attention.kv_cache import KVCacheSpec, PrefaultedHostMemory
from pagedserve.observability.memory import rss_bytes, tensors_bytes


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_carved_pool_equals_an_allocated_one(cache_dtype):
    spec = KVCacheSpec.create(cache_dtype, torch.bfloat16, num_layers=3, num_kv_heads=2,
                              head_dim=64, block_size=16)
    num_blocks = 40
    expected = spec.allocate(num_blocks, "cpu")
    carved = spec.allocate(num_blocks, "cpu",
                           PrefaultedHostMemory(spec.bytes_per_block * num_blocks + 4096))
    for want_layer, got_layer in zip(expected, carved, strict=True):
        for want, got in zip(want_layer, got_layer, strict=True):
            assert (got.shape, got.dtype, got.is_contiguous()) == (want.shape, want.dtype, True)
            assert got.data_ptr() % 64 == 0 and not got.view(torch.uint8).any()
    # one storage per tensor, of its own size: the memory report counts the pool exactly
    assert tensors_bytes(carved) == tensors_bytes(expected) == spec.bytes_per_block * num_blocks
    carved[0][0].fill_(1)  # tensors do not overlap
    assert all(not t.view(torch.uint8).any() for layer in carved for t in layer
               if t is not carved[0][0])


def test_a_pool_that_does_not_fit_or_leaves_most_unused_is_allocated_apart():
    spec = KVCacheSpec.create("auto", torch.float32, 2, 2, 64, 16)
    pool_bytes = spec.bytes_per_block * 10
    for memory_bytes in (pool_bytes // 2, pool_bytes * 4):
        memory = PrefaultedHostMemory(memory_bytes)
        pool = spec.allocate(10, "cpu", memory)
        assert tensors_bytes(pool) == pool_bytes
        assert memory.carve([((1,), torch.uint8)]) is None  # used once: the memory is gone


@pytest.mark.skipif(rss_bytes() is None, reason="reads /proc/self/status (Linux only)")
def test_the_memory_is_resident_once_carved_and_freed_with_the_last_tensor():
    size = 256 << 20
    spec = KVCacheSpec.create("auto", torch.float32, 1, 1, 64, 16)
    num_blocks = size // spec.bytes_per_block
    before = rss_bytes()
    pool = spec.allocate(num_blocks, "cpu", PrefaultedHostMemory(size))
    assert rss_bytes() - before > 0.9 * size  # faulted in, as torch.zeros would be
    del pool
    gc.collect()
    assert rss_bytes() - before < 0.1 * size
