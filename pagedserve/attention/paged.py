"""Paged attention from plain torch matmuls, for any device: `TorchAttentionBackend`.

KV cache layout per layer, for K and for V: (num_kv_heads, num_blocks, block_size, head_dim),
head-major, so gathering a request's blocks (index_select on dim 1) directly yields each KV head's
keys as one contiguous (positions, head_dim) matrix: the operand a batched matmul wants.
Decodes are batched: their blocks are gathered into (Hkv, B, L, D) and padded positions masked.
Each prefill chunk attends to its gathered context with a causal mask offset by the context length.
A layer with a sliding window reads only the blocks its window reaches (from the block of the
earliest position a query still sees) and masks the rest of them: the blocks before may have been
let go of by its KV cache group (core/kv_cache_groups.py) and now hold another request's KV.

On the CPU the compiled kernels are faster (attention/cpu_kernel_backend.py, which falls back to
the functions here where they do not serve); this backend serves other devices and dtypes, runs
when the kernels are off, and is the reference the kernels are tested against.

A quantized cache (int8 / fp8 codes with per-(head, token) scales, attention/kv_cache.py) is
quantized as it is written and dequantized to the compute dtype right after the gather, so the
attention math below is the same for both kinds.

torch's SDPA serves fresh prompts (causal, no context). Elsewhere plain matmuls: on this CPU
(torch 2.13) SDPA's flash kernel costs ~13 us per (request, head) for a one-token query (the
matmuls are ~3x faster for a batch of decodes), and a prefill chunk with context needs an
explicit mask, which makes SDPA ~1.4x slower than the blocked matmuls. The G = H / Hkv query
heads that share a KV head are stacked as rows of one matmul, so K/V are never expanded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.kv_cache import KVCache, dequantize_kv, quantize_kv
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.kv_cache_groups import first_needed_block, window_blocks


class TorchAttentionBackend(AttentionBackend):
    """Plain torch: index_copy into the cache, batched matmuls for decodes, SDPA / blocked
    matmuls per prefill chunk."""

    def write_kv(
        self, kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> None:
        write_kv_index_copy(kv_cache, k, v, slot_mapping)

    def forward(
        self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
        scale: float | None = None, sliding_window: int | None = None,
    ) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        num_decodes = meta.num_decodes
        if num_decodes == meta.num_reqs:  # a pure decode step: no copy into a shared output
            return decode_attention(q, kv_cache, meta, scale, sliding_window)
        out = torch.empty_like(q)
        if num_decodes:
            out[:num_decodes] = decode_attention(q[:num_decodes], kv_cache, meta, scale,
                                                 sliding_window)
        for i in range(num_decodes, meta.num_reqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = gathered_prefill_attention(q[start:end], kv_cache, meta, i, scale,
                                                        sliding_window)
        return out


def write_kv_index_copy(
    kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """k, v: (T, Hkv, D) into their slots of the (Hkv, num_blocks, block_size, D) caches; into a
    quantized cache as codes, with each (token, head)'s scale at the same slot of the scales."""
    key_cache, value_cache, *scale_caches = kv_cache
    num_kv_heads, _, _, head_dim = key_cache.shape
    if scale_caches:
        (k, k_scale), (v, v_scale) = quantize_kv(k, key_cache.dtype), quantize_kv(v, key_cache.dtype)
        for scale_cache, scale in zip(scale_caches, (k_scale, v_scale)):  # (T, Hkv) each
            scale_cache.view(num_kv_heads, -1).index_copy_(1, slot_mapping, scale.t())
    for cache, x in ((key_cache, k), (value_cache, v)):
        _as_copyable(cache).view(num_kv_heads, -1, head_dim).index_copy_(
            1, slot_mapping, _as_copyable(x).transpose(0, 1))


def _as_copyable(t: torch.Tensor) -> torch.Tensor:
    """fp8 as its bytes: torch 2.13 has no index_copy_ for float8 on the CPU."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def gathered_prefill_attention(
    q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, req_index: int,
    scale: float | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """Request req_index's prefill chunk q (Tq, H, D) over its gathered context -> (Tq, H, D).
    scale, sliding_window: as in AttentionBackend.forward."""
    context_len, block_size = meta.context_lens[req_index], kv_cache[0].shape[2]
    # The chunk's first query sees back to context_len - window + 1: no block before that one.
    first_block = first_needed_block(context_len, sliding_window, block_size)
    k, v = _gather(kv_cache, meta.block_table[req_index], meta.seq_lens[req_index], q.dtype,
                   first_block)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _prefill_attention(q, k, v, context_len, scale, sliding_window,
                              first_block * block_size)


PREFILL_QUERY_BLOCK = 128
"""Query rows per score matrix in prefill attention: bounds the (G * block, S) fp32 scores."""


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float,
    sliding_window: int | None = None, key_offset: int = 0,
) -> torch.Tensor:
    """One request's prefill chunk. q: (Tq, H, D) at positions context_len .. context_len + Tq;
    k, v: (Hkv, S, D), positions key_offset .. context_len + Tq (key_offset > 0 only where the
    window has passed the positions before it) -> (Tq, H, D).

    A fresh prompt (no context) that its window (if any) does not cut goes to torch's SDPA flash
    kernel with is_causal (its causal mask is aligned top-left, right only without context).
    Otherwise plain matmuls over query blocks: block b only reads keys from the first its window
    lets in up to its last query; scores and softmax in fp32 (bf16 scores would round logits).
    SDPA with an explicit mask measured ~1.4x slower.
    """
    num_keys = key_offset + k.shape[1]  # positions 0 .. num_keys, the first key_offset not read
    window_cuts = sliding_window is not None and num_keys > sliding_window
    if context_len == 0 and not window_cuts:
        # 4-D: torch 2.13 sends 3-D inputs to its slow math path (5x slower at 2,048 tokens).
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], is_causal=True, enable_gqa=True,
            scale=scale,
        )[0].transpose(0, 1)
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    # out of place: for fp32, q.float() is q itself, the caller's tensor
    q32 = (q.float() * scale).view(num_queries, num_kv_heads, group, head_dim)
    q32 = q32.permute(1, 2, 0, 3)  # (Hkv, G, Tq, D)
    k32 = k.float().transpose(1, 2)  # (Hkv, D, S)
    v32 = v.float()  # (Hkv, S, D)
    out = torch.empty(num_kv_heads, group, num_queries, head_dim, device=q.device)
    key_positions = torch.arange(num_keys, device=q.device)
    for q_start in range(0, num_queries, PREFILL_QUERY_BLOCK):
        q_end = min(num_queries, q_start + PREFILL_QUERY_BLOCK)
        rows = q_end - q_start
        # | outside every row's window | keys [kv_start, kv_end) this block reads | later keys |
        kv_end = context_len + q_end
        kv_start = (max(key_offset, context_len + q_start - sliding_window + 1) if window_cuts
                    else key_offset)
        num_read = kv_end - kv_start
        scores = torch.bmm(
            q32[:, :, q_start:q_end].reshape(num_kv_heads, group * rows, head_dim),
            k32[:, :, kv_start - key_offset : kv_end - key_offset],
        ).view(num_kv_heads, group, rows, num_read)
        query_positions = key_positions[context_len + q_start : kv_end, None]  # (rows, 1)
        read_positions = key_positions[None, kv_start:kv_end]  # (1, num_read)
        outside = read_positions > query_positions  # causal
        if window_cuts:
            outside |= read_positions <= query_positions - sliding_window
        scores.masked_fill_(outside, float("-inf"))
        probs = scores.softmax(dim=-1).view(num_kv_heads, group * rows, num_read)
        out[:, :, q_start:q_end] = torch.bmm(
            probs, v32[:, kv_start - key_offset : kv_end - key_offset]).view(
            num_kv_heads, group, rows, head_dim
        )
    return out.permute(2, 0, 1, 3).reshape(num_queries, num_heads, head_dim).to(q.dtype)


@dataclass
class _DecodePlan:
    """What every layer's decode attention needs from the step's metadata, built once per step."""

    block_ids: torch.Tensor
    """(Hkv * B * num_blocks,) rows of the cache viewed as (Hkv * num_blocks, block_size, D):
    every KV head's copy of the decodes' blocks, for one dim-0 index_select per cache."""
    bias: torch.Tensor
    """(Hkv * B, G, L) additive mask: 0 where a gathered position is in the sequence (and in the
    window, if any), else -inf."""
    padded_len: int
    """L: num_blocks * block_size (a windowed layer's: the blocks its window reaches)."""


def _head_major_rows(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Block ids -> their rows in a cache viewed as (Hkv * num_blocks, ...), head by head.

    index_select on dim 0 copies whole contiguous blocks; on dim 1 of the 4-D cache it takes a
    generic strided path that measured 2x slower."""
    offsets = torch.arange(num_kv_heads, device=block_ids.device) * num_blocks
    return (offsets[:, None] + block_ids[None, :]).flatten()


def _decode_plan(
    meta: AttentionMetadata, block_size: int, num_kv_heads: int, num_cache_blocks: int,
    group: int, dtype: torch.dtype, sliding_window: int | None,
) -> _DecodePlan:
    # One plan per window size in a step: layers with the same window share it.
    plan_key = "decode_plan" if sliding_window is None else f"decode_plan/window={sliding_window}"
    plan = meta.backend_state.get(plan_key)
    if plan is None:
        num_decodes = meta.num_decodes
        num_blocks = -(-max(meta.seq_lens[:num_decodes]) // block_size)
        device = meta.block_table.device
        seq_lens = meta.decode_seq_lens[:, None]
        if sliding_window is None or num_blocks <= window_blocks(sliding_window, block_size):
            table = meta.block_table[:num_decodes, :num_blocks]  # (B, num_blocks)
            positions = torch.arange(num_blocks * block_size, device=device)[None, :]
        else:
            # Each request's window: the blocks from the one holding its earliest visible
            # position (seq_len - window), as many as a window can straddle. Near the end of a
            # shorter table the run starts earlier (and the extra blocks are masked).
            num_blocks = window_blocks(sliding_window, block_size)
            first = ((meta.decode_seq_lens - sliding_window).clamp_(min=0) // block_size).clamp_(
                max=meta.block_table.shape[1] - num_blocks)
            block_index = first[:, None] + torch.arange(num_blocks, device=device)  # (B, nb)
            table = meta.block_table[:num_decodes].gather(1, block_index)
            positions = ((block_index * block_size)[:, :, None]
                         + torch.arange(block_size, device=device)).flatten(1)  # (B, L)
        padded_len = num_blocks * block_size
        outside = positions >= seq_lens  # (B, L)
        if sliding_window is not None:  # the query sits at seq_len - 1
            outside |= positions <= seq_lens - 1 - sliding_window
        bias = torch.zeros(num_decodes, padded_len, dtype=dtype, device=outside.device)
        bias.masked_fill_(outside, float("-inf"))
        plan = _DecodePlan(
            block_ids=_head_major_rows(table.flatten(), num_kv_heads, num_cache_blocks),
            bias=bias[None, :, None, :].expand(num_kv_heads, -1, group, -1)
            .reshape(num_kv_heads * num_decodes, group, padded_len),
            padded_len=padded_len,
        )
        meta.backend_state[plan_key] = plan
    return plan


def decode_attention(
    q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: (B, H, D), one query per request at the end of its sequence. scale, sliding_window: as
    in AttentionBackend.forward.

    Scores are computed in the compute dtype (no fp32 output for bf16 matmuls on the CPU);
    softmax accumulates in fp32 internally.
    """
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads, num_cache_blocks, block_size, _ = kv_cache[0].shape
    group = num_heads // num_kv_heads
    plan = _decode_plan(meta, block_size, num_kv_heads, num_cache_blocks, group, q.dtype,
                        sliding_window)
    batch_shape = (num_kv_heads * num_decodes, plan.padded_len, head_dim)
    k, v = _gather_blocks(kv_cache, plan.block_ids, q.dtype)
    k, v = k.view(batch_shape), v.view(batch_shape)  # (Hkv * B, L, D)
    # (B, H, D) -> (Hkv * B, G, D): a request's G query heads of one KV head as G rows
    q_rows = q.view(num_decodes, num_kv_heads, group, head_dim).transpose(0, 1)
    q_rows = q_rows.reshape(num_kv_heads * num_decodes, group, head_dim)
    scale = head_dim**-0.5 if scale is None else scale
    scores = torch.baddbmm(plan.bias, q_rows, k.transpose(1, 2), alpha=scale)
    o = torch.bmm(scores.softmax(dim=-1), v)  # (Hkv * B, G, D)
    return o.view(num_kv_heads, num_decodes, group, head_dim).transpose(0, 1).reshape(
        num_decodes, num_heads, head_dim
    )


def token_rows_and_lens(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token of the step: its request's row of the block table, and how many cached
    positions it sees (its position + 1: causal within its own chunk). Built once per step."""
    cached = meta.backend_state.get("token_rows_and_lens")
    if cached is None:
        rows, lens = [], []
        for i, (context_len, seq_len) in enumerate(zip(meta.context_lens, meta.seq_lens)):
            rows += [i] * (seq_len - context_len)
            lens += range(context_len + 1, seq_len + 1)
        cached = torch.tensor(rows), torch.tensor(lens)
        meta.backend_state["token_rows_and_lens"] = cached
    return cached


def _gather(
    kv_cache: KVCache, block_ids: torch.Tensor, seq_len: int, dtype: torch.dtype,
    first_block: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's (max_blocks,) block ids -> its K, V at positions first_block * block_size ..
    seq_len: (Hkv, that many, D) each, in dtype."""
    num_kv_heads, num_cache_blocks, block_size, head_dim = kv_cache[0].shape
    ids = _head_major_rows(block_ids[first_block : -(-seq_len // block_size)], num_kv_heads,
                           num_cache_blocks)
    k, v = _gather_blocks(kv_cache, ids, dtype)
    num_positions = seq_len - first_block * block_size
    return (k.view(num_kv_heads, -1, head_dim)[:, :num_positions],
            v.view(num_kv_heads, -1, head_dim)[:, :num_positions])


def _gather_blocks(
    kv_cache: KVCache, rows: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the caches viewed as (Hkv * num_blocks, block_size, D) (see _head_major_rows) ->
    K, V: (len(rows), block_size, D) each, dequantized to dtype where the cache is quantized."""
    key_cache, value_cache, *scale_caches = kv_cache
    _, _, block_size, head_dim = key_cache.shape
    # index_select on the block dimension: ~8x faster on CPU than advanced indexing.
    k = key_cache.view(-1, block_size, head_dim).index_select(0, rows)
    v = value_cache.view(-1, block_size, head_dim).index_select(0, rows)
    if not scale_caches:
        return k, v
    k_scale, v_scale = (s.view(-1, block_size).index_select(0, rows) for s in scale_caches)
    return dequantize_kv(k, k_scale, dtype), dequantize_kv(v, v_scale, dtype)
