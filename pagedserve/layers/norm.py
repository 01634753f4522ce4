"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import cpu_ops, triton_ops


class RMSNorm(nn.Module):
    unit_offset = False
    """Gemma's form (a subclass's): the zero-centred weight applied as (1 + weight) in fp32 and
    the result rounded once, where Llama's rounds the normed value before its weight."""

    def __init__(self, hidden_size: int, eps: float, kernels: ModuleType | None) -> None:
        """kernels: the compiled CPU kernels (kernels/cpu_ops.py) or None for the torch path."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.kernels = kernels
        self.gpu_kernels = triton_ops.for_new_layer()
        """The fused Triton kernel on cuda (kernels/triton_ops.py), or None."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 whatever the compute dtype, as the HF reference does; torch's fused
        # rms_norm computes x * rsqrt(mean(x^2) + eps) in one op instead of five.
        x32 = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); residual=None means x is the residual."""
        ops = self.kernels
        if ops is not None and cpu_ops.serves(x) and x.dim() == 2 and x.is_contiguous():
            # one call instead of five ops, rounding where they round; its sum of squares adds
            # in another order than torch's (csrc/cpu_ops.cpp add_rms_norm, tests/kernels)
            normed, residual = ops.add_rms_norm(x, residual, self.weight, self.eps,
                                                self.unit_offset)
            return normed, residual
        gpu = self.gpu_kernels
        if (gpu is not None and x.dim() == 2 and gpu.serves(x)
                and (residual is None or residual.is_contiguous())):
            return gpu.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self._norm(x), x
