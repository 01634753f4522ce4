"""The slow, obviously correct attention the fast paths are tested against.

Token by token through the block table, one request at a time, fp64 softmax. It reads plain
(key_cache, value_cache); a quantized layer cache is dequantized first
(kv_cache.dequantize_kv_cache).
"""

from __future__ import annotations

import math

import torch

from pagedserve.attention.metadata import AttentionMetadata


def reference_paged_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """scale, sliding_window: as in AttentionBackend.forward."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, _, block_size, _ = key_cache.shape  # (Hkv, num_blocks, block_size, D)
    group = num_heads // num_kv_heads
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    block_table = meta.block_table.tolist()
    for i in range(meta.num_reqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len, context_len = meta.seq_lens[i], meta.context_lens[i]
        keys = torch.stack(
            [key_cache[:, block_table[i][p // block_size], p % block_size] for p in range(seq_len)]
        ).double()  # (S, Hkv, D)
        values = torch.stack(
            [value_cache[:, block_table[i][p // block_size], p % block_size]
             for p in range(seq_len)]
        ).double()
        for j in range(end - start):
            position = context_len + j
            # keys first..position: all earlier ones, or the last sliding_window of them
            first = 0 if sliding_window is None else max(0, position + 1 - sliding_window)
            for h in range(num_heads):
                kv_head = h // group
                query = q[start + j, h].double()
                scores = keys[first : position + 1, kv_head] @ query * scale
                weights = torch.softmax(scores, dim=0)
                out[start + j, h] = (weights @ values[first : position + 1, kv_head]).to(q.dtype)
    return out
