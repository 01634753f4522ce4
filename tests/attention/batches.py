"""Random steps for the attention tests: scattered block tables, as a busy pool hands them out."""

from __future__ import annotations

import random


def scattered_block_tables(query_lens: list[int], context_lens: list[int], block_size: int,
                           seed: int) -> tuple[int, list[list[int]], list[int]]:
    """Blocks for each request's context + query, drawn in shuffled order from a pool just large
    enough (block 0 is the null block, never handed out). Returns (pool size in blocks, block
    table per request, the cache slot of each query token in batch order)."""
    rng = random.Random(seed)
    num_blocks = 2 + sum(-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens))
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    block_tables, slots = [], []
    for q_len, context_len in zip(query_lens, context_lens):
        blocks = [free.pop() for _ in range(-(-(q_len + context_len) // block_size))]
        block_tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size
                  for p in range(context_len, context_len + q_len)]
    return num_blocks, block_tables, slots
