"""Triton kernels for the paged KV cache, and their launch wrappers: `write_kv` stores a step's
K/V (quantizing it for an int8 / fp8 cache), `paged_attention` attends decodes, fresh prompts and
prefill chunks with earlier context in one varlen launch, reading K/V in place through the block
table (attention/kv_cache.py has the layout and the quantization these match). A quantized
cache is dequantized inside the products: scores and probabilities are scaled per key, which is
code * scale in exact arithmetic (the torch path rounds code * scale to the compute dtype first,
so bf16 results differ from it within that rounding).

Both run inside CUDA graphs: the wrappers derive every launch parameter (grid, tiles, splits)
from tensor shapes alone and never read a tensor's contents on the host; each program finds its
request on the device. Under TRITON_INTERPRET=1 (the CPU tests) the same kernels run in numpy.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedserve.attention.kv_cache import QUANT_MAX, SCALE_MAX, SCALE_MIN

_TORCH_TO_TRITON = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
                    torch.float16: tl.float16}

_ROUND_MAGIC = tl.constexpr(12582912.0)
"""1.5 * 2**23: for |x| < 2**22, (x + this) - this is x rounded half to even by the fp32 adder
itself. libdevice.rint would say it plainly, but the interpreter has no libdevice."""
_SCALE_MIN = tl.constexpr(SCALE_MIN)
_SCALE_MAX = tl.constexpr(SCALE_MAX)
_LOG2E = 1.4426950408889634


_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether @triton.jit below made interpreted kernels: it reads the variable as it decorates."""


# ---- write_kv ---------------------------------------------------------------------------------

@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded half to even onto the e4m3 grid, as torch's cast rounds, so
    the cast after it is exact. The GPU's cast would round alike, but triton 3.6's interpreter
    gets the carry wrong (31.5 -> 16): this keeps one code path, checked on the CPU too."""
    bits = x.to(tl.int32, bitcast=True)
    # the grid step at |x|: 3 mantissa bits below its exponent; a fixed 2**-9 under the
    # smallest normal (2**-6)
    step_exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    # (|x| + c) - c with c = 1.5 * 2**(step_exponent + 23): the fp32 adder rounds |x| to a
    # multiple of the step, half to even
    c = (((step_exponent + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (tl.abs(x) + c) - c
    sign = bits & -2147483648  # as a bit: -x is 0 - x, which makes -0.0 of 0.0
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_token_heads(
    x_ptr, stride_x_h, cache_ptr, scale_cache_ptr, cache_offsets, scale_offsets, heads, dims,
    mask, head_mask, QUANTIZED: tl.constexpr, IS_INT8: tl.constexpr, IS_FP16: tl.constexpr,
    QMAX: tl.constexpr,
):
    """One token's (heads, dims) tile of K or V into its cache slot: as it is, or as codes with
    one fp16 scale per head, computed as kv_cache.quantize_kv computes them."""
    x = tl.load(x_ptr + heads[:, None] * stride_x_h + dims[None, :], mask=mask, other=0.0)
    if QUANTIZED:
        x = x.to(tl.float32)
        absmax = tl.max(tl.abs(x), axis=1)
        # div_rn: IEEE division, as torch's on the CPU; `/` may compile to an approximate one.
        scale = tl.minimum(tl.maximum(tl.div_rn(absmax, QMAX), _SCALE_MIN), _SCALE_MAX)
        scale = scale.to(tl.float16)
        scaled = tl.div_rn(x, scale.to(tl.float32)[:, None])
        scaled = tl.minimum(tl.maximum(scaled, -QMAX), QMAX)
        if IS_INT8:
            codes = ((scaled + _ROUND_MAGIC) - _ROUND_MAGIC).to(tl.int8)
        elif IS_FP16:
            codes = scaled.to(tl.float16)  # round to nearest even, as torch's cast
        else:
            codes = _round_to_e4m3(scaled).to(tl.float8e4nv)
        tl.store(cache_ptr + cache_offsets, codes, mask=mask)
        tl.store(scale_cache_ptr + scale_offsets, scale, mask=head_mask)
    else:
        tl.store(cache_ptr + cache_offsets, x, mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr,
    slot_mapping_ptr,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_c_h, stride_c_b, stride_c_t, stride_s_h, stride_s_b,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    QUANTIZED: tl.constexpr, IS_INT8: tl.constexpr, IS_FP16: tl.constexpr,
    QMAX: tl.constexpr,
):
    """One program per token: all its KV heads at once."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # a padded row of a captured step
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    head_mask = heads < NUM_KV_HEADS
    mask = head_mask[:, None] & (dims < HEAD_DIM)[None, :]
    # int64: a layer's cache may pass 2**31 elements
    cache_offsets = (heads.to(tl.int64)[:, None] * stride_c_h + block * stride_c_b
                     + offset * stride_c_t + dims[None, :])
    scale_offsets = heads.to(tl.int64) * stride_s_h + block * stride_s_b + offset
    _store_token_heads(k_ptr + token * stride_k_t, stride_k_h, key_cache_ptr, key_scale_ptr,
                       cache_offsets, scale_offsets, heads, dims, mask, head_mask,
                       QUANTIZED, IS_INT8, IS_FP16, QMAX)
    _store_token_heads(v_ptr + token * stride_v_t, stride_v_h, value_cache_ptr, value_scale_ptr,
                       cache_offsets, scale_offsets, heads, dims, mask, head_mask,
                       QUANTIZED, IS_INT8, IS_FP16, QMAX)


def write_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor, key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """k, v: (T, Hkv, D) into the (Hkv, num_blocks, block_size, D) caches at slot_mapping (T,)
    (slot = block_id * block_size + offset; a slot < 0 writes nothing). With key_scale and
    value_scale ((Hkv, num_blocks, block_size) fp16) the caches hold int8 / fp8 codes: each
    (token, head) row is quantized as kv_cache.quantize_kv does, to the same bits."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _, _, block_size, _ = key_cache.shape
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1
    assert k.stride(2) == 1 and v.stride(2) == 1
    quantized = key_scale is not None
    if quantized:
        assert value_scale is not None and key_scale.stride() == value_scale.stride()
        assert key_scale.stride(2) == 1
        qmax = QUANT_MAX[key_cache.dtype]
    else:
        key_scale = value_scale = key_cache  # never read
        qmax = 1.0
    dim_pad = triton.next_power_of_2(head_dim)
    heads_pad = triton.next_power_of_2(num_kv_heads)
    _write_kv_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, key_scale, value_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key_scale.stride(0), key_scale.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_PAD=heads_pad, DIM_PAD=dim_pad, QUANTIZED=quantized,
        IS_INT8=key_cache.dtype == torch.int8,
        IS_FP16=quantized and key_cache.dtype == torch.float16, QMAX=qmax,
        num_warps=4 if heads_pad * dim_pad >= 4096 else 2,
    )


# ---- paged_attention --------------------------------------------------------------------------

@triton.jit
def _find_request(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The request whose query blocks include global block q_block. Request i's blocks start
    at query_start_loc[i] // BLOCK_Q + i (a strictly increasing sequence: each request gets
    at least ceil(q_len / BLOCK_Q) numbers, padded ones with q_len 0 one), so binary-search the
    last i whose start is <= q_block."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_kv_tile(
    cache_ptr, block_ids, in_block, dims, key_valid, stride_c_b, stride_c_t,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TRANSPOSED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """A tile of keys' (TRANSPOSED: (DIM_PAD, TILE_N)) or values' ((TILE_N, DIM_PAD)) vectors,
    read in place from their blocks (cache_ptr: at the KV head's first block); invalid keys
    read as 0. A quantized cache's codes convert exactly (int8 within +-127, e4m3 within bf16
    and fp16): the caller applies the scales."""
    rows = block_ids * stride_c_b + in_block * stride_c_t  # int64, as block_ids are
    if TRANSPOSED:
        offsets = rows[None, :] + dims[:, None]
        mask = key_valid[None, :]
        if DIM_PAD != HEAD_DIM:
            mask = mask & (dims < HEAD_DIM)[:, None]
    else:
        offsets = rows[:, None] + dims[None, :]
        mask = key_valid[:, None]
        if DIM_PAD != HEAD_DIM:
            mask = mask & (dims < HEAD_DIM)[None, :]
    return tl.load(cache_ptr + offsets, mask=mask, other=0.0).to(DOT_DTYPE)


@triton.jit
def _paged_attention_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr, out_ptr,
    split_acc_ptr, split_max_ptr, split_sum_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    num_seqs, num_heads, scale_log2, sliding_window,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_h, stride_c_b, stride_c_t, stride_s_h, stride_s_b, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, QUANTIZED: tl.constexpr,
    USE_WINDOW: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (q_block, kv_head, split): up to BLOCK_Q query tokens of one request times the
    GROUP query heads that share kv_head, as the BLOCK_M rows of its score tiles
    (row r: token r // GROUP, head kv_head * GROUP + r % GROUP), against the keys they see.
    With NUM_SPLITS > 1 the keys are split in NUM_SPLITS runs of tiles, one per program, whose
    unnormalized results _merge_splits_kernel merges."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_request(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:  # a spare block (or a padded request): nothing to do
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    row_query = q_block_local * BLOCK_Q + rows // GROUP  # within the request's chunk
    row_head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (row_query < q_len)
    row_pos = context_len + row_query  # position in the sequence
    row_token = (q_start + row_query).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    row_mask = row_valid[:, None]
    if DIM_PAD != HEAD_DIM:
        row_mask = row_mask & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                + dims[None, :], mask=row_mask, other=0.0).to(DOT_DTYPE)

    # | before the window | keys [kv_begin, kv_end) some row of the block sees | later keys |
    # (the blocks before kv_begin may have been let go of: never read them)
    first_pos = context_len + q_block_local * BLOCK_Q
    kv_end = context_len + tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, q_len)
    if USE_WINDOW:
        kv_begin = tl.maximum(first_pos - sliding_window + 1, 0)
    else:
        kv_begin = 0
    tile_begin = kv_begin // TILE_N
    tile_end = tl.cdiv(kv_end, TILE_N)
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tile_end - tile_begin, NUM_SPLITS)
        tile_begin = tile_begin + split * tiles_per_split
        tile_end = tl.minimum(tile_begin + tiles_per_split, tile_end)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)  # log2 units, scale included
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    key_offsets = tl.arange(0, TILE_N)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    kv_head_64 = kv_head.to(tl.int64)  # a layer's cache may pass 2**31 elements
    key_head_ptr = key_cache_ptr + kv_head_64 * stride_c_h
    value_head_ptr = value_cache_ptr + kv_head_64 * stride_c_h
    key_scale_head_ptr = key_scale_ptr + kv_head_64 * stride_s_h
    value_scale_head_ptr = value_scale_ptr + kv_head_64 * stride_s_h
    for tile in range(tile_begin, tile_end):
        key_pos = tile * TILE_N + key_offsets
        key_valid = key_pos < kv_end
        if USE_WINDOW:
            key_valid = key_valid & (key_pos >= kv_begin)
        block_ids = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        in_block = key_pos % BLOCK_SIZE
        k = _load_kv_tile(key_head_ptr, block_ids, in_block, dims, key_valid,
                          stride_c_b, stride_c_t, HEAD_DIM, DIM_PAD, True, DOT_DTYPE)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION)  # (BLOCK_M, TILE_N)
        if QUANTIZED:
            # q . (code * scale) = (q . code) * scale: one product per score, not per element
            key_scale = tl.load(key_scale_head_ptr + block_ids * stride_s_b + in_block,
                                mask=key_valid, other=0.0).to(tl.float32)
            scores = scores * (key_scale * scale_log2)[None, :]
        else:
            scores = scores * scale_log2
        visible = key_valid[None, :] & (key_pos[None, :] <= row_pos[:, None])
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > row_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # a row that has seen no key yet keeps -inf: subtract 0 instead (exp2(-inf) = 0)
        new_max_safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.math.exp2(scores - new_max_safe[:, None])
        rescale = tl.math.exp2(row_max - new_max_safe)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        v = _load_kv_tile(value_head_ptr, block_ids, in_block, dims, key_valid,
                          stride_c_b, stride_c_t, HEAD_DIM, DIM_PAD, False, DOT_DTYPE)
        weights = probs
        if QUANTIZED:  # likewise: p @ (code * scale) = (p * scale) @ code
            value_scale = tl.load(value_scale_head_ptr + block_ids * stride_s_b + in_block,
                                  mask=key_valid, other=0.0).to(tl.float32)
            weights = probs * value_scale[None, :]
        acc = acc * rescale[:, None]
        # the weights in the compute dtype, as a matmul in that dtype would take them
        acc = tl.dot(weights.to(COMPUTE_DTYPE).to(DOT_DTYPE), v, acc,
                     input_precision=DOT_PRECISION)
        row_max = new_max

    if NUM_SPLITS == 1:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(out_ptr + row_token[:, None] * stride_o_t + row_head[:, None] * stride_o_h
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        # (T, H, NUM_SPLITS) rows; a split that saw no key stores -inf, 0 and zeros
        split_row = (row_token * num_heads + row_head) * NUM_SPLITS + split
        tl.store(split_acc_ptr + split_row[:, None] * DIM_PAD + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(split_max_ptr + split_row, row_max, mask=row_valid)
        tl.store(split_sum_ptr + split_row, row_sum, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr, split_acc_ptr, split_max_ptr, split_sum_ptr, query_start_loc_ptr, num_seqs,
    num_heads, stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Program (token, head): the softmax-weighted sum of its splits' partial results."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):  # a padded token: no split wrote it
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < NUM_SPLITS
    dims = tl.arange(0, DIM_PAD)
    split_rows = (token.to(tl.int64) * num_heads + head) * NUM_SPLITS + splits
    split_max = tl.load(split_max_ptr + split_rows, mask=split_mask, other=float("-inf"))
    split_sum = tl.load(split_sum_ptr + split_rows, mask=split_mask, other=0.0)
    total_max = tl.max(split_max, axis=0)  # finite: every query sees at least itself
    weights = tl.math.exp2(split_max - total_max)
    total_sum = tl.sum(split_sum * weights, axis=0)
    acc = tl.load(split_acc_ptr + split_rows[:, None] * DIM_PAD + dims[None, :],
                  mask=split_mask[:, None], other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0) / total_sum
    mask = dims < HEAD_DIM
    tl.store(out_ptr + token.to(tl.int64) * stride_o_t + head * stride_o_h + dims,
             out.to(out_ptr.dtype.element_ty), mask=mask)


MAX_KV_SPLITS = 16
SPLIT_WORKSPACE_BYTES = 64 << 20
"""The split-KV partial results of one launch stay below this (they are fp32 per split)."""


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: as an H200, so the CPU tests take the GPU's paths
    return torch.cuda.get_device_properties(device).multi_processor_count


def _attention_config(
    num_tokens: int, num_seqs: int, group: int, head_dim: int, dtype: torch.dtype,
    quantized: bool,
) -> dict[str, int]:
    """Tile sizes from the step's shapes, as measured best on an H200 (bf16 decodes then read
    the cache at ~3.7 TB/s; fresh 2,048-token prompts run as fast as torch's flash SDPA at
    head_dim 64, 1.2x faster at 256, 1.25x slower at 128). Decode-like steps (few query tokens
    per request): 16 rows per program (the least tl.dot takes), so a decode wastes little;
    steps of mostly long chunks: 64 or 128 rows, for that much reuse of each K/V tile."""
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    prefill_like = num_tokens >= 64 * max(num_seqs, 1)
    num_stages = 2
    if not prefill_like:
        block_m, num_warps = 16, 4
        tile_n = 64 if dim_pad <= 128 else 32
    elif dtype == torch.float32:
        # ieee fp32 products run on the FMA units: smaller tiles, fewer registers
        block_m, tile_n, num_warps = 64, 32, 4 if dim_pad <= 128 else 8
    elif dim_pad > 128:
        block_m, tile_n, num_warps = 128, 64, 8  # 2.1x faster than 64 x 32 at head_dim 256
    else:
        block_m, tile_n, num_warps = 64, 64, 4
        num_stages = 3 if dim_pad == 128 else 2
    if quantized and (not prefill_like or dim_pad <= 128 and dtype != torch.float32):
        # codes pass through registers to be converted: longer tiles keep more loads in
        # flight (int8 / fp8 decodes 1.2-1.4x faster than at 64, chunks 1.4-2x)
        tile_n, num_stages = 128, 2
    block_m = max(block_m, triton.next_power_of_2(group))
    return dict(DIM_PAD=dim_pad, BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n,
                num_warps=num_warps, num_stages=num_stages)


def _num_kv_splits(
    num_tokens: int, num_seqs: int, num_kv_heads: int, num_heads: int, block_q: int,
    dim_pad: int, max_tiles: int, device: torch.device,
) -> int:
    """Splits of each request's keys: more than one only where the programs with queries
    (at most one per token) fill less than one wave of the GPU, e.g. a few long decodes."""
    busy_programs = min(num_tokens, num_tokens // block_q + num_seqs) * num_kv_heads
    num_sms = _num_sms(device)
    if busy_programs >= num_sms:
        return 1
    splits = min(MAX_KV_SPLITS, triton.next_power_of_2(-(-2 * num_sms // busy_programs)),
                 triton.next_power_of_2(max_tiles))
    bytes_per_split = num_tokens * num_heads * (dim_pad + 2) * 4
    while splits > 1 and splits * bytes_per_split > SPLIT_WORKSPACE_BYTES:
        splits //= 2
    return splits


def paged_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    scale: float, sliding_window: int | None = None, key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None, num_kv_splits: int | None = None,
) -> torch.Tensor:
    """q: (T, H, D) -> out (T, H, D), each query attending causally to its request's keys.

    query_start_loc (B+1,) int32: request i's query tokens are [query_start_loc[i],
    query_start_loc[i+1]), at positions seq_len_i - q_len_i .. seq_len_i - 1; seq_lens (B,)
    int32; block_table (B, max_blocks) int64. Requests of q_len 0 (padding) do nothing; rows
    of tokens past query_start_loc[B] are left unwritten. sliding_window w: a query at p sees
    keys > p - w only. key_scale / value_scale: the fp16 scales of an int8 / fp8 cache.
    num_kv_splits: None chooses from the shapes (tests force it).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert q.stride(2) == 1 and out.stride(2) == 1 and block_table.stride(1) == 1
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1
    group = num_heads // num_kv_heads
    quantized = key_scale is not None
    config = _attention_config(num_tokens, num_seqs, group, head_dim, q.dtype, quantized)
    block_q, tile_n, dim_pad = config["BLOCK_Q"], config["TILE_N"], config["DIM_PAD"]
    num_q_blocks = num_tokens // block_q + num_seqs  # covers every request: see _find_request
    if num_kv_splits is None:
        max_tiles = -(-block_table.shape[1] * block_size // tile_n)
        num_kv_splits = _num_kv_splits(num_tokens, num_seqs, num_kv_heads, num_heads, block_q,
                                       dim_pad, max_tiles, q.device)
    if not quantized:
        key_scale = value_scale = key_cache  # never read
    compute_dtype = _TORCH_TO_TRITON[q.dtype]
    # The interpreter multiplies bf16 operands as their raw bits: give it the same (exactly
    # representable) values in fp32.
    dot_dtype = (tl.float32 if q.dtype == torch.bfloat16 and _INTERPRETED
                 else compute_dtype)
    if num_kv_splits > 1:
        split_acc = torch.empty(num_tokens, num_heads, num_kv_splits, dim_pad,
                                dtype=torch.float32, device=q.device)
        split_stats = torch.empty(2, num_tokens, num_heads, num_kv_splits, dtype=torch.float32,
                                  device=q.device)
        split_max, split_sum = split_stats[0], split_stats[1]
    else:
        split_acc = split_max = split_sum = out  # never read
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_kv_splits)](
        q, key_cache, value_cache, key_scale, value_scale, out,
        split_acc, split_max, split_sum,
        query_start_loc, seq_lens, block_table,
        num_seqs, num_heads, scale * _LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key_scale.stride(0), key_scale.stride(1), block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        NUM_SPLITS=num_kv_splits, QUANTIZED=quantized, USE_WINDOW=sliding_window is not None,
        COMPUTE_DTYPE=compute_dtype, DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **config,
    )
    if num_kv_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, split_acc, split_max, split_sum, query_start_loc, num_seqs, num_heads,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_kv_splits,
            SPLITS_PAD=triton.next_power_of_2(num_kv_splits),
            num_warps=4 if dim_pad >= 256 else 2,
        )
    return out
