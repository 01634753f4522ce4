"""Attention over the paged KV cache: one metadata type, backends behind one interface
(attention/backend.py), chosen once per model, and a slow reference (attention/reference.py)."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.cpu_kernel_backend import CpuKernelAttentionBackend
from pagedserve.attention.metadata import AttentionMetadata, forward_context, get_forward_context
from pagedserve.attention.paged import TorchAttentionBackend

__all__ = [
    "AttentionBackend", "AttentionMetadata", "create_attention_backend", "forward_context",
    "get_forward_context",
]


def create_attention_backend(
    device: torch.device | str, dtype: torch.dtype, kernels: ModuleType | None
) -> AttentionBackend:
    """The compiled CPU kernels' backend for CPU fp32/bf16 when `kernels` (kernels/cpu_ops.py,
    None: off) is given, else plain torch (any device, the reference). Either reads KV caches of
    every --kv-cache-dtype: the model, and so this choice, is independent of the cache kind (a
    loaded model serves engines with different caches, and a self-draft's compute-dtype cache
    beside its target's quantized one)."""
    if (kernels is not None and torch.device(device).type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)):
        return CpuKernelAttentionBackend(kernels)
    return TorchAttentionBackend()
