"""KVCacheManager: chained block hashes, prefix-cache lookups and slot allocation.

Requests here are never run: "computing" a request is allocating its slots, which is also when
the manager indexes its full blocks.
"""

from __future__ import annotations

import pytest

from pagedserve.core.block_hash import extend_block_hashes, hash_block_tokens
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(req_id: str, prompt: list[int], **kwargs) -> Request:
    prompt_logprobs = kwargs.pop("prompt_logprobs", None)
    params = SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs)
    return Request(req_id, list(prompt), params, **kwargs)


def hashes_of(token_ids: list[int], cache_salt: str | None = None) -> list[bytes]:
    block_hashes: list[bytes] = []
    extend_block_hashes(block_hashes, token_ids, BLOCK_SIZE,
                        () if cache_salt is None else ("salt", cache_salt))
    return block_hashes


def admit(manager: KVCacheManager, request: Request):
    """What the scheduler does for a waiting request: look up hits, allocate the rest."""
    (hits,), num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, (hits,))
    if new_blocks is None:
        return hits, num_hit_tokens, None
    request.num_computed_tokens = request.num_tokens
    return hits, num_hit_tokens, new_blocks[0]


# ---- hashes -----------------------------------------------------------------------------------


def test_hash_depends_on_parent_tokens_and_extra_keys():
    tokens = [1, 2, 3, 4]
    root = hash_block_tokens(None, tokens)
    assert hash_block_tokens(None, tuple(tokens)) == root  # list or tuple: same bytes
    assert hash_block_tokens(root, tokens) != root
    assert hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), tokens) != (
        hash_block_tokens(root, tokens)
    )
    assert hash_block_tokens(None, [1, 2, 3, 5]) != root
    assert hash_block_tokens(None, tokens, ("salt", "a")) != root
    assert hash_block_tokens(None, tokens, ("salt", "a")) != hash_block_tokens(
        None, tokens, ("salt", "b")
    )


def test_hash_chain_same_prefix_same_hashes():
    a = hashes_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    b = hashes_of([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0])
    assert len(a) == 3 and len(b) == 3  # only full blocks are hashed
    assert a[:2] == b[:2]
    assert a[2] != b[2]
    # The same tokens in block 1 with another block 0 before them: a different prefix.
    c = hashes_of([0, 2, 3, 4, 5, 6, 7, 8])
    assert c[0] != a[0] and c[1] != a[1]


def test_cache_salt_changes_every_hash_of_the_chain():
    tokens = list(range(12))
    plain, salted, salted_again, other = (
        hashes_of(tokens), hashes_of(tokens, "s1"), hashes_of(tokens, "s1"), hashes_of(tokens, "s2")
    )
    assert salted == salted_again
    for i in range(3):
        assert len({plain[i], salted[i], other[i]}) == 3


def test_extend_block_hashes_is_incremental():
    tokens = list(range(10))
    block_hashes = hashes_of(tokens[:5])
    assert len(block_hashes) == 1
    extend_block_hashes(block_hashes, tokens, BLOCK_SIZE)
    assert block_hashes == hashes_of(tokens)


# ---- prefix-cache lookups ---------------------------------------------------------------------


def test_get_computed_blocks_finds_longest_cached_prefix():
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks
    admit(manager, make_request("a", prompt))

    (hits,), num_hit_tokens = manager.get_computed_blocks(make_request("same", prompt))
    assert num_hit_tokens == 12
    assert [b.block_id for b in hits] == manager.get_block_ids("a")[0][:3]

    diverges_in_block_2 = prompt[:9] + [0] * 5
    (hits,), num_hit_tokens = manager.get_computed_blocks(make_request("b", diverges_in_block_2))
    assert num_hit_tokens == 8 and len(hits) == 2

    diverges_in_block_0 = [0] + prompt[1:]
    assert manager.get_computed_blocks(make_request("c", diverges_in_block_0)) == (([],), 0)
    salted = make_request("d", prompt, cache_salt="tenant-2")
    assert manager.get_computed_blocks(salted) == (([],), 0)
    manager.check_integrity()


def test_last_token_is_always_recomputed_for_a_block_aligned_prompt():
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    prompt = list(range(12))  # exactly 3 blocks, all cached by request a
    admit(manager, make_request("a", prompt))
    assert len(manager.block_pool._cached) == 3

    b = make_request("b", prompt)
    hits, num_hit_tokens, new_blocks = admit(manager, b)
    # Not 12: the last prompt token must run through the model to give the first new token.
    assert num_hit_tokens == 8
    assert len(new_blocks) == 1
    a_ids, b_ids = manager.get_block_ids("a")[0], manager.get_block_ids("b")[0]
    assert b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2]
    # b computed the last block again; the index keeps a's copy, b's stays private.
    assert manager.block_pool.blocks[b_ids[2]].block_hash is None
    manager.check_integrity()


def test_prefix_cache_stats_count_tokens_per_admission():
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    prompt = list(range(10))
    admit(manager, make_request("a", prompt))
    assert (manager.prefix_cache_stats.queries, manager.prefix_cache_stats.hits) == (10, 0)
    admit(manager, make_request("b", prompt + [50, 51, 52]))
    assert (manager.prefix_cache_stats.queries, manager.prefix_cache_stats.hits) == (23, 8)

    # Allocating more slots for a running request is not an admission: no new query.
    c = make_request("c", list(range(3)))
    admit(manager, c)
    c.append_output_token_ids([3])
    manager.allocate_slots(c, 1)
    assert (manager.prefix_cache_stats.queries, manager.prefix_cache_stats.hits) == (26, 8)


def test_caching_disabled_and_prompt_logprobs_get_no_hits():
    prompt = list(range(10))
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE, enable_caching=False)
    admit(manager, make_request("a", prompt))
    assert not manager.block_pool._cached
    assert manager.get_computed_blocks(make_request("b", prompt)) == (([],), 0)

    manager = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    admit(manager, make_request("a", prompt))
    # Prompt logprobs need the logits of every prompt position.
    assert manager.get_computed_blocks(make_request("b", prompt, prompt_logprobs=0)) == (([],), 0)
    assert len(manager.get_computed_blocks(make_request("c", prompt))[0][0]) == 2


def test_blocks_completed_by_decoding_are_cached():
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(manager, a)
    assert len(manager.block_pool._cached) == 1
    # Prefill computed tokens 1..6 and sampled 7; each decode step computes the KV of the
    # previous sampled token.
    a.append_output_token_ids([7])
    manager.allocate_slots(a, 1)  # computes token 7
    a.num_computed_tokens += 1
    assert len(manager.block_pool._cached) == 1
    a.append_output_token_ids([8])
    manager.allocate_slots(a, 1)  # computes token 8: block 1 becomes full
    a.num_computed_tokens += 1
    assert len(manager.block_pool._cached) == 2
    (hits,), num_hit_tokens = manager.get_computed_blocks(make_request("b", list(range(1, 12))))
    assert num_hit_tokens == 8
    assert [b.block_id for b in hits] == manager.get_block_ids("a")[0][:2]


# ---- allocation -------------------------------------------------------------------------------


def test_allocate_slots_returns_none_when_short_and_changes_nothing():
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable blocks
    request = make_request("big", list(range(17)))  # needs 5 blocks
    (hits,), num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, 17, (hits,)) is None
    assert "big" not in manager.req_to_blocks
    assert manager.block_pool.num_free_blocks == 4
    assert (manager.prefix_cache_stats.queries, manager.prefix_cache_stats.hits) == (0, 0)
    manager.check_integrity()

    # A running request that cannot grow keeps the blocks it has.
    small = make_request("small", list(range(8)))
    admit(manager, small)
    other = make_request("other", list(range(50, 58)))
    admit(manager, other)
    assert manager.block_pool.num_free_blocks == 0
    small.append_output_token_ids([99])
    assert manager.allocate_slots(small, 1) is None
    assert len(manager.get_block_ids("small")[0]) == 2
    manager.check_integrity()


def test_hits_in_the_free_queue_are_not_counted_as_free_blocks():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)  # 5 usable blocks
    pool = manager.block_pool
    prefix = list(range(8))
    a = make_request("a", prefix + [8])  # 3 blocks, the first 2 cached
    admit(manager, a)
    admit(manager, make_request("holder", [70, 71]))  # holds 1 block until the end
    manager.free(a)
    assert pool.num_free_blocks == 4  # of which 2 are a's cached prefix

    # 17 tokens = 5 blocks: 2 hits (both free) + 3 new. Only 4 - 2 = 2 blocks stay free once the
    # hits are taken, so this must fail rather than count the hits twice.
    too_big = make_request("too_big", prefix + list(range(200, 209)))
    (hits,), num_hit_tokens = manager.get_computed_blocks(too_big)
    assert num_hit_tokens == 8 and all(block.ref_cnt == 0 for block in hits)
    queue_before = [b.block_id for b in pool.free_queue()]
    assert manager.allocate_slots(too_big, too_big.num_tokens - num_hit_tokens, (hits,)) is None
    assert [b.block_id for b in pool.free_queue()] == queue_before
    assert all(block.ref_cnt == 0 and block.block_hash is not None for block in hits)
    assert manager.prefix_cache_stats.hits == 0
    manager.check_integrity()

    # 16 tokens = 4 blocks: 2 hits + 2 new fits exactly.
    fits = make_request("fits", prefix + list(range(200, 208)))
    hits, num_hit_tokens, new_blocks = admit(manager, fits)
    assert num_hit_tokens == 8 and len(new_blocks) == 2
    assert manager.get_block_ids("fits")[0][:2] == [b.block_id for b in hits]
    assert pool.num_free_blocks == 0
    manager.check_integrity()


def test_requests_with_the_same_prompt_share_blocks():
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    prompt = list(range(300, 310))  # 2 full blocks + 2 tokens
    requests = [make_request(f"r{i}", prompt) for i in range(3)]
    results = [admit(manager, request) for request in requests]
    assert [num_hit_tokens for _, num_hit_tokens, _ in results] == [0, 8, 8]

    tables = [manager.get_block_ids(r.request_id)[0] for r in requests]
    shared = tables[0][:2]
    assert all(table[:2] == shared for table in tables)
    assert [manager.block_pool.blocks[i].ref_cnt for i in shared] == [3, 3]
    assert len({table[2] for table in tables}) == 3  # partial last blocks are private
    assert manager.block_pool.num_free_blocks == 31 - 5
    manager.check_integrity()

    for request in requests:
        manager.free(request)
    assert manager.block_pool.num_free_blocks == 31
    assert [manager.block_pool.blocks[i].ref_cnt for i in shared] == [0, 0]
    manager.check_integrity()


@pytest.mark.parametrize("enable_caching", [True, False])
def test_free_releases_everything(enable_caching):
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_caching=enable_caching)
    requests = [make_request(f"r{i}", list(range(i, i + 9))) for i in range(4)]
    for request in requests:
        admit(manager, request)
    for request in requests:
        manager.free(request)
    assert manager.block_pool.num_free_blocks == manager.block_pool.num_usable_blocks
    assert not manager.req_to_blocks and not manager.num_cached_blocks
    manager.check_integrity()


def test_free_uncaches_blocks_scheduled_but_not_computed():
    # Blocks are indexed when scheduled; a request preempted in that same step (freed with
    # num_computed_tokens from before the step) never computes them.
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(20))
    request = make_request("a", prompt)
    manager.allocate_slots(request, 8)
    request.num_computed_tokens = 8  # the step ran
    manager.allocate_slots(request, 10)  # scheduled 8..17: blocks 2 and 3 are indexed now
    assert len(manager.block_pool._cached) == 4
    manager.free(request)  # preempted before that step ran
    assert len(manager.block_pool._cached) == 2
    (hits,), num_hit_tokens = manager.get_computed_blocks(make_request("b", prompt))
    assert num_hit_tokens == 8
    manager.check_integrity()
