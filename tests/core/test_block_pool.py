"""BlockPool: allocation order, reference counts, the free queue as LRU, the prefix-cache index.

Pure Python, exact expectations: block ids, free-queue order and index contents are all observable.
"""

from __future__ import annotations

import pytest

from pagedserve.core.block_hash import extend_block_hashes, hash_block_tokens
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams


def free_queue_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue()]


def make_request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=4))


# ---- allocation and reference counts -------------------------------------------------------


def test_allocation_order_and_free_order_is_eviction_order():
    pool = BlockPool(num_blocks=5)
    assert pool.num_usable_blocks == 4
    assert free_queue_ids(pool) == [1, 2, 3, 4]  # block 0 is the reserved null block
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (1, 2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)
    assert pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(0.5)

    pool.free_blocks([b, a])  # tail first: evicted first
    assert free_queue_ids(pool) == [3, 4, 2, 1]
    assert [blk.block_id for blk in pool.get_new_blocks(4)] == [3, 4, 2, 1]
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_null_block_is_never_handed_out():
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(3)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3]
    with pytest.raises(AssertionError):
        pool.get_new_blocks(1)  # the caller must check num_free_blocks first
    assert pool.blocks[0].ref_cnt == 0
    pool.check_integrity()
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=1)


def test_ref_counts_with_touch_and_free():
    pool = BlockPool(num_blocks=4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert block.block_id not in free_queue_ids(pool)  # still held by one user
    pool.check_integrity()

    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert free_queue_ids(pool) == [2, 3, 1]  # joined the tail
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])

    pool.touch([block])  # touching a free block takes it out of the free queue
    assert block.ref_cnt == 1
    assert free_queue_ids(pool) == [2, 3]
    pool.check_integrity()


# ---- the prefix-cache index -----------------------------------------------------------------


def test_cached_block_survives_free_and_is_hit_until_reallocated():
    pool = BlockPool(num_blocks=4)  # usable: 1, 2, 3
    block_hash = hash_block_tokens(None, [1, 2, 3, 4])
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [block_hash], num_cached_blocks=0, num_full_blocks=1)
    assert block.block_hash == block_hash
    pool.free_blocks([block])
    assert free_queue_ids(pool) == [2, 3, 1]
    # Free, but its content and hash are kept: a later request can take it back (a hit).
    assert pool.get_cached_block(block_hash) is block
    pool.touch([pool.get_cached_block(block_hash)])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([block])

    # Blocks 2 and 3 are ahead of it in the free queue: allocating them keeps the hit alive.
    others = pool.get_new_blocks(2)
    assert [b.block_id for b in others] == [2, 3]
    assert pool.get_cached_block(block_hash) is block
    pool.check_integrity()


def test_eviction_removes_the_hash():
    pool = BlockPool(num_blocks=3)
    block_hash = hash_block_tokens(None, [7, 7])
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [block_hash], 0, 1)
    pool.free_blocks([block])
    pool.get_new_blocks(1)  # block 2: the cached block 1 survives
    assert pool.get_cached_block(block_hash) is block

    (reused,) = pool.get_new_blocks(1)  # only block 1 is left: reallocating it evicts it
    assert reused is block
    assert block.block_hash is None
    assert pool.get_cached_block(block_hash) is None
    pool.check_integrity()


def test_cache_full_blocks_keeps_the_first_block_with_a_given_hash():
    pool = BlockPool(num_blocks=4)
    block_hash = hash_block_tokens(None, [5, 6])
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [block_hash], 0, 1)
    pool.cache_full_blocks([second], [block_hash], 0, 1)  # same content, computed twice
    assert pool.get_cached_block(block_hash) is first
    assert second.block_hash is None  # stays private to its request
    pool.free_blocks([second, first])
    pool.check_integrity()


def test_chain_tail_is_evicted_first_when_a_request_is_freed():
    block_size = 4
    manager = KVCacheManager(num_blocks=6, block_size=block_size)  # 5 usable blocks
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks and 1 partial
    request = make_request("a", prompt)
    assert manager.allocate_slots(request, len(prompt)) is not None
    request.num_computed_tokens = len(prompt)  # the step ran
    block_ids = manager.get_block_ids("a")[0]
    assert block_ids == [1, 2, 3, 4]
    assert [manager.block_pool.blocks[i].block_hash is not None for i in block_ids] == [
        True, True, True, False,
    ]

    manager.free(request)
    # The never-used block 5 first, then the request's blocks from its tail to its head.
    assert free_queue_ids(manager.block_pool) == [5, 4, 3, 2, 1]

    # Allocating 3 blocks takes 5, 4 (uncached partial) and 3 (the chain's tail): the prefix
    # blocks 1 and 2 stay hittable.
    manager.block_pool.get_new_blocks(3)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, block_size)
    assert manager.block_pool.get_cached_block(hashes[2]) is None
    assert manager.block_pool.get_cached_block(hashes[0]).block_id == 1
    assert manager.block_pool.get_cached_block(hashes[1]).block_id == 2
    (hits,), num_hit_tokens = manager.get_computed_blocks(make_request("b", prompt))
    assert [b.block_id for b in hits] == [1, 2]
    assert num_hit_tokens == 8
    manager.block_pool.check_integrity()


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    request = make_request("a", prompt)
    manager.allocate_slots(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    pool = manager.block_pool
    assert len(pool._cached) == 2

    assert manager.reset_prefix_cache() is False  # a request still holds blocks
    assert len(pool._cached) == 2
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert not pool._cached
    assert all(block.block_hash is None for block in pool.blocks)
    assert manager.get_computed_blocks(make_request("b", prompt)) == (([],), 0)
    pool.check_integrity()


# ---- integrity checks -----------------------------------------------------------------------


def _pool_with_cached_and_held_blocks() -> tuple[BlockPool, list]:
    pool = BlockPool(num_blocks=6)
    blocks = pool.get_new_blocks(3)
    hashes = [hash_block_tokens(None, [i]) for i in range(3)]
    pool.cache_full_blocks(blocks, hashes, 0, 3)
    pool.free_blocks([blocks[2]])  # cached and free
    pool.check_integrity()
    return pool, blocks


def _ref_cnt_of_free_block(pool, blocks):
    blocks[2].ref_cnt = 1  # in the free queue but claims a user


def _ref_cnt_of_held_block_zero(pool, blocks):
    blocks[0].ref_cnt = 0  # held but not in the free queue


def _negative_ref_cnt(pool, blocks):
    blocks[1].ref_cnt = -1


def _null_block_handed_out(pool, blocks):
    pool.blocks[0].ref_cnt = 1


def _hash_without_index_entry(pool, blocks):
    del pool._cached[blocks[1].block_hash]


def _index_points_at_other_block(pool, blocks):
    pool._cached[blocks[0].block_hash] = blocks[1]


def _held_block_in_free_queue(pool, blocks):
    pool._free[blocks[0].block_id] = blocks[0]


@pytest.mark.parametrize(
    "corrupt",
    [
        _ref_cnt_of_free_block,
        _ref_cnt_of_held_block_zero,
        _negative_ref_cnt,
        _null_block_handed_out,
        _hash_without_index_entry,
        _index_points_at_other_block,
        _held_block_in_free_queue,
    ],
)
def test_check_integrity_catches_corruption(corrupt):
    pool, blocks = _pool_with_cached_and_held_blocks()
    corrupt(pool, blocks)
    with pytest.raises(RuntimeError):
        pool.check_integrity()


def test_manager_check_integrity_catches_ref_cnt_not_matching_block_tables():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(6)))
    manager.allocate_slots(request, 6)
    manager.check_integrity()
    block = manager.req_to_blocks["a"][0][0]
    manager.block_pool.touch([block])  # a reference no block table accounts for
    manager.block_pool.check_integrity()  # the pool alone cannot see it
    with pytest.raises(RuntimeError, match="block tables"):
        manager.check_integrity()
