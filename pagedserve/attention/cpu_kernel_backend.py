"""Paged attention by the compiled CPU kernels (csrc/cpu_ops.cpp): `CpuKernelAttentionBackend`.

The kernels read the cache in place: decodes and short chunks (a sequence's at most
KERNEL_MAX_TOKENS queries of a step) through `paged_attention`, longer prefill chunks through
`prefill_attention`: bf16 on AVX512-BF16 (2-3x the torch paths), fp32 on AVX2 + FMA
(csrc/prefill_attention_f32.h; 1.36-3.8x the torch paths on AMD EPYC Zen 3,
`pagedserve bench attention`; a quantized cache dequantized once per chunk). Where a step's
shape is not theirs the torch functions of attention/paged.py run, exactly as that backend
would: queries whose heads are not dense, prefill chunks whose dtype, cache or head_dim the
prefill kernels do not take, and layers with a sliding window in steps where the window hides
some key (the kernels know no windows; while every sequence of the step fits in the window, it
changes nothing and the kernels serve).

A quantized cache (int8 / fp8 codes, fp16 scales: attention/kv_cache.py) goes to the same kernels:
its scales ride along as the last arguments (`*scales`, empty for a plain cache), the kernels
quantize on write and dequantize each key and value row as they load it.
"""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.kv_cache import KVCache
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.paged import (
    TorchAttentionBackend,
    gathered_prefill_attention,
    token_rows_and_lens,
    write_kv_index_copy,
)

KERNEL_MAX_TOKENS = 32
"""Sequences with at most this many query tokens in a step (decodes and short chunks, e.g.
speculative verification) go to the compiled kernel; it reads each key once per token, so longer
prefill chunks stay on the flash kernel or the blocked matmuls."""
PREFILL_KERNEL_HEAD_DIMS = (64, 128, 256)
"""The head sizes the bf16 flash prefill kernel takes (csrc/cpu_ops.cpp prefill_attention)."""


class CpuKernelAttentionBackend(AttentionBackend):
    """For CPU tensors in fp32 or bf16 (create_attention_backend checks that once)."""

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels
        self._torch = TorchAttentionBackend()
        """For queries the kernels do not take (heads not dense)."""

    def write_kv(
        self, kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> None:
        head_dim = kv_cache[0].shape[3]
        if all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (k, v)):
            # one call instead of two copies (and, quantized, the ~8 ops of quantize_kv)
            key_cache, value_cache, *scales = kv_cache
            self.kernels.write_kv(key_cache, value_cache, k, v, slot_mapping, *scales)
            return
        write_kv_index_copy(kv_cache, k, v, slot_mapping)

    def forward(
        self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
        scale: float | None = None, sliding_window: int | None = None,
    ) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        window_cuts = sliding_window is not None and max(meta.seq_lens) > sliding_window
        if window_cuts or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            # the kernels know no windows and want dense heads
            return self._torch.forward(q, kv_cache, meta, scale, sliding_window)
        if q.shape[0] <= KERNEL_MAX_TOKENS:
            return self._paged_attention(q, kv_cache, meta, scale)
        # Each sequence goes to the kernel its own query count picks, whatever else the step
        # holds: the short-step kernel and the prefill paths sum in different orders, and a
        # sequence must get the same bits alone as batched (batch invariance: feature-on-vs-off
        # equality, and activations quantized downstream, rest on it).
        short_tokens, long_requests = self._split_by_query_count(meta)
        if not long_requests:
            return self._paged_attention(q, kv_cache, meta, scale)
        if len(long_requests) == 1 and not short_tokens.numel():  # one prompt fills the step
            return self._prefill(q, kv_cache, meta, long_requests[0], scale)
        out = torch.empty_like(q)
        if short_tokens.numel():
            out.index_copy_(0, short_tokens, self._paged_attention(
                q.index_select(0, short_tokens), kv_cache, meta, scale, short_tokens))
        for i in long_requests:
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(q[start:end], kv_cache, meta, i, scale)
        return out

    def _prefill(
        self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, i: int, scale: float,
    ) -> torch.Tensor:
        """Request i's prefill chunk q: the prefill kernel where it serves, else the torch
        path's blocked matmuls / SDPA."""
        if not self._prefill_kernel_serves(q, kv_cache):
            return gathered_prefill_attention(q, kv_cache, meta, i, scale)
        key_cache, value_cache, *scales = kv_cache
        return self.kernels.prefill_attention(
            q, key_cache, value_cache, meta.block_table[i], meta.context_lens[i], scale, *scales)

    @staticmethod
    def _split_by_query_count(meta: AttentionMetadata) -> tuple[torch.Tensor, list[int]]:
        """The step's query tokens of sequences with at most KERNEL_MAX_TOKENS of them (decodes,
        short chunks, speculative verification), and the other sequences' indices; once per
        step (every layer asks)."""
        cached = meta.backend_state.get("split_by_query_count")
        if cached is None:
            short, long_requests = [], []
            for i in range(meta.num_reqs):
                start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
                if end - start <= KERNEL_MAX_TOKENS:
                    short.extend(range(start, end))
                else:
                    long_requests.append(i)
            cached = torch.tensor(short, dtype=torch.long), long_requests
            meta.backend_state["split_by_query_count"] = cached
        return cached

    def _paged_attention(
        self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The kernel (csrc/cpu_ops.cpp paged_attention) for the step's query tokens `tokens`
        (None: its first q.shape[0]), whose queries q holds: reads the cache in place, no
        gathered copy; fp32 throughout."""
        rows, lens = token_rows_and_lens(meta)
        if tokens is None:
            rows, lens = rows[: q.shape[0]], lens[: q.shape[0]]
        else:
            rows, lens = rows.index_select(0, tokens), lens.index_select(0, tokens)
        key_cache, value_cache, *scales = kv_cache
        return self.kernels.paged_attention(
            q, key_cache, value_cache, meta.block_table, rows, lens, scale, *scales,
        )

    def _prefill_kernel_serves(self, q: torch.Tensor, kv_cache: KVCache) -> bool:
        """bf16 with head_dim 64, 128 or 256 (AVX512-BF16; a quantized cache is dequantized to bf16
        as its tiles are laid out), or fp32 on an fp32 or a quantized cache with head_dim a
        multiple of 8 (AVX2 + FMA; a quantized cache is dequantized to fp32 once per chunk)."""
        if q.dtype == torch.bfloat16:
            return (q.shape[-1] in PREFILL_KERNEL_HEAD_DIMS
                    and self.kernels.prefill_attention_supported())
        key_cache, _, *scales = kv_cache
        return (
            q.dtype == torch.float32 and (bool(scales) or key_cache.dtype == torch.float32)
            and q.shape[-1] % 8 == 0 and self.kernels.prefill_attention_f32_supported()
        )
