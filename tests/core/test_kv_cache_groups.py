"""KV cache groups: which layers share a block table, and a windowed group letting go of blocks."""

from __future__ import annotations

from pagedserve.core.kv_cache_groups import KVCacheLayout, first_needed_block, window_blocks
from pagedserve.core.kv_cache_manager import KVCacheManager
from tests.core.test_scheduler import make_request

GEMMA3_270M_WINDOWS = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
"""Gemma-3-270M: 18 layers, every sixth global, the others with a 512-token window."""


def test_gemma3_layers_form_six_groups_of_three_sharing_three_slots():
    layout = KVCacheLayout.for_layers(GEMMA3_270M_WINDOWS)
    assert layout.windows == (None, 512, 512, 512, 512, 512)
    assert [group.layers for group in layout.groups] == [
        (5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert layout.layers_per_block == 3
    slots, groups = layout.layer_slots(), layout.layer_groups()
    assert slots[5] == slots[0] == slots[3] == 0 and slots[17] == slots[16] == 2
    assert groups[5] == 0 and groups[0] == 1 and groups[16] == 5
    # every (group, slot) pair is one layer's: no two layers write the same pages
    assert len({(groups[i], slots[i]) for i in range(18)}) == 18


def test_sizes_that_do_not_divide_leave_a_smaller_last_group():
    windows = [None if i % 7 == 6 else 64 for i in range(26)]  # 3 global, 23 windowed
    layout = KVCacheLayout.for_layers(windows)
    assert [len(group.layers) for group in layout.groups] == [3, 3, 3, 3, 3, 3, 3, 3, 2]
    assert layout.layers_per_block == 3 and layout.num_layers == 26


def test_one_kind_of_layer_is_one_group_and_off_keeps_every_block():
    assert KVCacheLayout.for_layers([None] * 4).windows == (None,)
    assert KVCacheLayout.for_layers([32] * 4).windows == (32,)  # Mistral-style: window-only
    off = KVCacheLayout.for_layers(GEMMA3_270M_WINDOWS, per_layer_group=False)
    assert off.windows == (None,) and off.layers_per_block == 18
    assert KVCacheLayout.for_layers([32] * 4, per_layer_group=False).windows == (None,)


def test_first_needed_block_and_window_blocks():
    # window 8, blocks of 4: a query at 40 sees 33..40, so blocks 0..7 (positions < 32) go
    assert first_needed_block(40, 8, 4) == 8
    assert first_needed_block(7, 8, 4) == 0 and first_needed_block(40, None, 4) == 0
    assert window_blocks(8, 4) == 3  # 7 earlier positions + the query can straddle 3 blocks


def run_prompt(manager: KVCacheManager, req_id: str, prompt: list[int], num_decodes: int = 0):
    request = make_request(req_id, prompt, max_tokens=num_decodes + 1)
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens
    for token in range(num_decodes):
        request.append_output_token_ids([token])
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    return request, num_hit_tokens


def test_a_windowed_group_lets_go_of_blocks_its_window_has_passed():
    manager = KVCacheManager(num_blocks=64, block_size=4, group_windows=(None, 8))
    request, _ = run_prompt(manager, "a", list(range(100, 140)), num_decodes=1)  # 41 tokens
    global_blocks, windowed_blocks = manager.req_to_blocks["a"]
    assert len(global_blocks) == len(windowed_blocks) == 11
    null = manager.null_block
    # the decode computed position 40: its window reaches back to 33, in block 8
    assert windowed_blocks[:8] == [null] * 8 and null not in windowed_blocks[8:]
    assert null not in global_blocks
    assert manager.num_window_freed_blocks == 8
    assert manager.block_pool.num_free_blocks == 63 - 11 - 3
    manager.check_integrity()
    manager.free(request)
    assert manager.block_pool.num_free_blocks == 63
    manager.check_integrity()


def test_a_windowed_hit_needs_only_the_window_blocks_before_the_prefix_end():
    manager = KVCacheManager(num_blocks=64, block_size=4, group_windows=(None, 8))
    prompt = list(range(100, 141))  # 41 tokens: at most 10 blocks (40 tokens) can hit
    first, _ = run_prompt(manager, "a", prompt)
    manager.free(first)
    pool = manager.block_pool
    # Evict the windowed group's first 8 blocks: the hit at 40 tokens needs only blocks 8, 9.
    for index in range(8):
        block = pool.get_cached_block(first.block_hashes[index], 1)
        pool.touch([block])
        pool.uncache_blocks([block])
        pool.free_blocks([block])
    (global_hits, windowed_hits), num_hit_tokens = manager.get_computed_blocks(
        make_request("b", prompt))
    assert num_hit_tokens == 40
    assert windowed_hits[:8] == [manager.null_block] * 8
    assert [b.block_hash for b in windowed_hits[8:]] == [
        pool.get_cached_block(h, 1).block_hash for h in first.block_hashes[8:10]]
    # Without block 9 of the windowed group, the longest hit ends where that group still has
    # its window's blocks: at 9 blocks it needs 7 and 8, of which 7 is gone; at 8 none remains.
    block_9 = pool.get_cached_block(first.block_hashes[9], 1)
    pool.touch([block_9])
    pool.uncache_blocks([block_9])
    pool.free_blocks([block_9])
    _, num_hit_tokens = manager.get_computed_blocks(make_request("c", prompt))
    assert num_hit_tokens == 0
    # The global group alone would still hit every block.
    assert all(pool.get_cached_block(h, 0) is not None for h in first.block_hashes[:10])
    manager.check_integrity()


def test_max_blocks_for_counts_a_windowed_group_at_its_window():
    manager = KVCacheManager(num_blocks=64, block_size=4, group_windows=(None, 8, 8))
    assert manager.max_blocks_for(40) == 10 + 2 * (window_blocks(8, 4) + 1)
    assert manager.max_blocks_for(6) == 2 * 3
