"""Gated activations over a merged gate-up projection: SiLU (Llama) and GELU-tanh (Gemma)."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_ops


def silu_and_mul(gate_up: torch.Tensor, kernels: ModuleType | None) -> torch.Tensor:
    """(T, 2F) -> (T, F): silu(gate) * up. kernels: the compiled CPU kernels (kernels/cpu_ops.py)
    or None for the torch path."""
    if (kernels is not None and cpu_ops.serves(gate_up) and gate_up.dim() == 2
            and gate_up.is_contiguous()):
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor, kernels: ModuleType | None) -> torch.Tensor:
    """(T, 2F) -> (T, F): gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh gating). kernels: as
    silu_and_mul's (the kernel follows torch's steps with its own tanh, csrc/cpu_ops.cpp Gate)."""
    if (kernels is not None and cpu_ops.serves(gate_up) and gate_up.dim() == 2
            and gate_up.is_contiguous()):
        return kernels.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
