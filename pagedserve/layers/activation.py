"""SiLU-gated activation over a merged gate-up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2F) -> (T, F): silu(gate) * up."""
    ops = cpu_ops.for_tensor(gate_up)
    if ops is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
