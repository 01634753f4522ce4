"""Paged attention with torch's scaled_dot_product_attention, for any device.

KV cache layout per layer: (num_blocks, block_size, num_kv_heads, head_dim) for K and for V.
Decodes are batched: their blocks are gathered into (B, L, Hkv, D) and padded positions masked.
Each prefill chunk attends to its gathered context with a causal mask offset by the context length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention.metadata import AttentionMetadata


def write_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's K/V (T, Hkv, D) at their slots; done for the whole batch before any
    attention reads, so a request may read blocks another request of the same step writes."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
) -> torch.Tensor:
    """q: (T, H, D) -> (T, H, D), reading every request's context from the cache."""
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    num_decodes = meta.num_decodes
    if num_decodes:
        out[:num_decodes] = _decode_attention(q[:num_decodes], key_cache, value_cache, meta)
    for i in range(num_decodes, meta.num_reqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len, context_len = meta.seq_lens[i], meta.context_lens[i]
        k, v = _gather(key_cache, value_cache, meta.block_table[i : i + 1], seq_len)
        q_i = q[start:end].transpose(0, 1)  # (H, Tq, D)
        if context_len == 0:
            o = F.scaled_dot_product_attention(
                q_i, k[0].transpose(0, 1), v[0].transpose(0, 1), is_causal=True, enable_gqa=True
            )
        else:
            # query j sits at position context_len + j and sees keys 0 .. context_len + j
            q_pos = torch.arange(context_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # (Tq, S)
            o = F.scaled_dot_product_attention(
                q_i, k[0].transpose(0, 1), v[0].transpose(0, 1), attn_mask=mask, enable_gqa=True
            )
        out[start:end] = o.transpose(0, 1)
    assert out.shape[1] == num_heads
    return out


def _decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
) -> torch.Tensor:
    """q: (B, H, D), one query per request at the end of its sequence."""
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    max_len = max(meta.seq_lens[:num_decodes])
    k, v = _gather(key_cache, value_cache, meta.block_table[:num_decodes], max_len)  # (B, L, Hkv, D)
    positions = torch.arange(k.shape[1], device=q.device)
    mask = positions[None, :] < meta.decode_seq_lens[:, None]  # (B, L)
    # The G = H / Hkv query heads sharing a KV head sit at the same position, so they can be
    # that head's G "query tokens": plain multi-head SDPA, no GQA expansion (6x faster in bf16
    # on CPU than enable_gqa with a single query).
    o = F.scaled_dot_product_attention(
        q.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim),  # (B, Hkv, G, D)
        k.transpose(1, 2),  # (B, Hkv, L, D)
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
    )
    return o.reshape(num_decodes, num_heads, head_dim)


def _gather(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, max_blocks) block ids -> K, V of the first seq_len positions: (B, L, Hkv, D), L >= seq_len."""
    num_reqs = block_table.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_blocks = -(-seq_len // block_size)
    ids = block_table[:, :num_blocks].flatten()
    # index_select on the block dimension: ~8x faster on CPU than advanced indexing.
    k = key_cache.index_select(0, ids).view(num_reqs, -1, num_kv_heads, head_dim)
    v = value_cache.index_select(0, ids).view(num_reqs, -1, num_kv_heads, head_dim)
    return k[:, :seq_len], v[:, :seq_len]
