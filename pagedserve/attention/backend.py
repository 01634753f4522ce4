"""The interface every attention backend implements: store a step's K/V, attend over the cache.

A backend is chosen once per model from the device, the compute dtype and the kernel flag
(`create_attention_backend` in attention/__init__.py) and held by every Attention layer; it keeps
no per-step state of its own (what a step shares across layers lives in meta.backend_state).

  TorchAttentionBackend      attention/paged.py: plain torch matmuls, any device; the fast
                             reference the kernels are tested against.
  CpuKernelAttentionBackend  attention/cpu_kernel_backend.py: the compiled CPU kernels
                             (csrc/cpu_ops.cpp), falling back to the torch paths per step shape.

attention/reference.py stays the slow token-by-token reference for both.

Both take a layer's cache as the KVCache tuple (attention/kv_cache.py): (key, value) in the compute
dtype, or int8 / fp8 codes with their scales, which they quantize on write and dequantize on
read. The tuple says which, so one model serves caches of either kind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedserve.attention.kv_cache import KVCache
from pagedserve.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    @abstractmethod
    def write_kv(
        self, kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> None:
        """Store this step's K/V (T, Hkv, D) at their slots; done for the whole batch before any
        attention reads, so a request may read blocks another request of the same step writes."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
        scale: float | None = None, sliding_window: int | None = None,
    ) -> torch.Tensor:
        """q: (T, H, D) -> (T, H, D), reading every request's context from the cache.

        scale: of the scores (None: head_dim ** -0.5). sliding_window: a query at position p
        sees only keys at positions > p - sliding_window (itself included, HF's convention);
        None: every earlier position. Both are per layer (Attention holds them)."""
