"""Paged attention with torch's scaled_dot_product_attention, for any device.

KV cache layout per layer: (num_blocks, block_size, num_kv_heads, head_dim) for K and for V.
Decodes are batched: their blocks are gathered into (B, L, Hkv, D) and padded positions masked.
Each prefill chunk attends to its gathered context with a causal mask offset by the context length
(batched matmuls over query blocks: see _prefill_attention).
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
        k, v = _gather(key_cache, value_cache, meta.block_table[i : i + 1], meta.seq_lens[i])
        out[start:end] = _prefill_attention(q[start:end], k[0], v[0], meta.context_lens[i])
    assert out.shape[1] == num_heads
    return out


PREFILL_QUERY_BLOCK = 128
"""Query rows per score matrix in prefill attention: bounds the (G * block, S) fp32 scores."""


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int
) -> torch.Tensor:
    """One request's prefill chunk. q: (Tq, H, D) at positions context_len .. context_len + Tq;
    k, v: (S, Hkv, D) with S = context_len + Tq -> (Tq, H, D).

    Plain batched matmuls over query blocks, not SDPA: on this CPU torch's SDPA runs GQA prefill
    through its math path (or a slow flash kernel once K/V are expanded), ~5x slower at 2,048
    tokens. The G query heads sharing a KV head are stacked as rows of one matmul (no K/V
    expansion); block b only reads keys up to its last query (causal skip at block granularity).
    Scores and softmax in fp32: bf16 scores would round logits by up to ~0.1.
    """
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    q32 = q.float().mul_(head_dim**-0.5).view(num_queries, num_kv_heads, group, head_dim)
    q32 = q32.permute(1, 2, 0, 3)  # (Hkv, G, Tq, D)
    k32 = k.float().permute(1, 2, 0)  # (Hkv, D, S)
    v32 = v.float().transpose(0, 1)  # (Hkv, S, D)
    out = torch.empty(num_kv_heads, group, num_queries, head_dim, device=q.device)
    key_positions = torch.arange(k.shape[0], device=q.device)
    for q_start in range(0, num_queries, PREFILL_QUERY_BLOCK):
        q_end = min(num_queries, q_start + PREFILL_QUERY_BLOCK)
        rows = q_end - q_start
        kv_end = context_len + q_end
        scores = torch.bmm(
            q32[:, :, q_start:q_end].reshape(num_kv_heads, group * rows, head_dim),
            k32[:, :, :kv_end],
        ).view(num_kv_heads, group, rows, kv_end)
        query_positions = key_positions[context_len + q_start : kv_end, None]  # (rows, 1)
        scores.masked_fill_(key_positions[None, :kv_end] > query_positions, float("-inf"))
        probs = scores.softmax(dim=-1).view(num_kv_heads, group * rows, kv_end)
        out[:, :, q_start:q_end] = torch.bmm(probs, v32[:, :kv_end]).view(
            num_kv_heads, group, rows, head_dim
        )
    return out.permute(2, 0, 1, 3).reshape(num_queries, num_heads, head_dim).to(q.dtype)


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
