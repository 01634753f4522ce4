"""Paged attention by the Triton kernels (kernels/triton_attention.py): `TritonAttentionBackend`.

Chosen on CUDA devices for fp32 / bf16 / fp16 when triton imports and gpu_kernels is on
(create_attention_backend). One launch serves a whole step, decodes and prefill chunks alike,
reading K/V in place through the block table, and quantizing / dequantizing an int8 / fp8 cache
inside the kernels.

NOTE: it must never read host data from the metadata (query_start_loc, seq_lens, context_lens as
lists, num_decodes): a step replayed from a CUDA graph carries the device tensors of the step it
was captured in, refilled in place, and its host lists are stale. Only device tensors and
shapes reach the kernels.
"""

from __future__ import annotations

import importlib.util

import torch

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.kv_cache import KVCache
from pagedserve.attention.metadata import AttentionMetadata


def triton_available() -> bool:
    """Whether triton is importable here (the CPU CI may lack it)."""
    return importlib.util.find_spec("triton") is not None


class TritonAttentionBackend(AttentionBackend):
    """For CUDA tensors in fp32, bf16 or fp16 (create_attention_backend checks that once)."""

    def __init__(self) -> None:
        # imported here: pagedserve.attention must import where triton is not installed
        from pagedserve.kernels import triton_attention

        self._kernels = triton_attention

    def write_kv(
        self, kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> None:
        key_cache, value_cache, *scale_caches = kv_cache
        self._kernels.write_kv(key_cache, value_cache, k, v, slot_mapping, *scale_caches)

    def forward(
        self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
        scale: float | None = None, sliding_window: int | None = None,
    ) -> torch.Tensor:
        if meta.query_start_loc_tensor is None or meta.seq_lens_tensor is None:
            raise ValueError("the Triton backend needs the metadata's device tensors "
                             "(query_start_loc_tensor, seq_lens_tensor)")
        key_cache, value_cache, *scale_caches = kv_cache
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = torch.empty_like(q)
        return self._kernels.paged_attention(
            q, key_cache, value_cache, out, meta.query_start_loc_tensor, meta.seq_lens_tensor,
            meta.block_table, scale, sliding_window, *scale_caches,
        )
