"""Attention over the paged KV cache: one metadata type, backends behind one interface
(attention/backend.py), chosen once per model, and a slow reference (attention/reference.py)."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.cpu_kernel_backend import CpuKernelAttentionBackend
from pagedserve.attention.metadata import AttentionMetadata, forward_context, get_forward_context
from pagedserve.attention.paged import TorchAttentionBackend
from pagedserve.attention.triton_backend import TritonAttentionBackend, triton_available
from pagedserve.kernels import cpu_ops

__all__ = [
    "AttentionBackend", "AttentionMetadata", "create_attention_backend", "forward_context",
    "get_forward_context",
]


def create_attention_backend(
    device: torch.device | str, dtype: torch.dtype, kernels: ModuleType | None
) -> AttentionBackend:
    """The Triton kernels' backend on CUDA for fp32/bf16/fp16 when triton imports and the
    KernelConfig being built under keeps gpu_kernels on (kernels/cpu_ops.py build_config); the
    compiled CPU kernels' backend for CPU fp32/bf16 when `kernels` (kernels/cpu_ops.py, None:
    off) is given; else plain torch (any device, the reference). Each reads KV caches of every
    --kv-cache-dtype: the model, and so this choice, is independent of the cache kind (a loaded
    model serves engines with different caches, and a self-draft's compute-dtype cache beside
    its target's quantized one)."""
    device_type = torch.device(device).type
    if (device_type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and cpu_ops.build_config().gpu_kernels and triton_available()):
        return TritonAttentionBackend()
    if (kernels is not None and device_type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)):
        return CpuKernelAttentionBackend(kernels)
    return TorchAttentionBackend()
