"""Rotary position embedding in the rotate-half (GPT-NeoX / HF) layout, from a cos/sin cache."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from pagedserve.kernels import cpu_ops, triton_ops


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, dtype: torch.dtype,
                 kernels: ModuleType | None) -> None:
        """kernels: the compiled CPU kernels (kernels/cpu_ops.py) or None: no in-place rotation."""
        super().__init__()
        self.kernels = kernels
        self.gpu_kernels = triton_ops.for_new_layer()
        """The in-place Triton rotation on cuda (kernels/triton_ops.py), or None."""
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.register_buffer("cos_cache", emb.cos().to(dtype), persistent=False)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin | sin]: the sign moves onto the table, the
        # same products (IEEE negation is exact), two fewer ops per call.
        sin = emb.sin()
        sin[:, : head_dim // 2] *= -1
        self.register_buffer("signed_sin_cache", sin.to(dtype), persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, D) (q and k side by side, as one view), positions: (T,)."""
        cos, signed_sin = self._lookup(positions)
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

    def rotate_in_place(self, positions: torch.Tensor, qkv: torch.Tensor, heads: int) -> bool:
        """Rotate the first `heads` heads of each row of qkv (T, width) in place by the compiled
        kernel; False (nothing done) where it does not serve, and forward() is the way."""
        head_dim = self.cos_cache.shape[-1]
        gpu = self.gpu_kernels
        if gpu is not None and gpu.rotary_serves(qkv, head_dim):
            gpu.rotary_inplace(qkv, heads, head_dim, positions, self.cos_cache,
                               self.signed_sin_cache)
            return True
        ops = self.kernels
        if ops is None or not cpu_ops.serves(qkv) or qkv.dim() != 2 or qkv.stride(1) != 1:
            return False
        ops.rotary_inplace(qkv, heads, head_dim, positions, self.cos_cache, self.signed_sin_cache)
        return True

    def _lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, 1, D) of a step's positions: looked up by the first layer, reused by the
        others (every layer of a step passes the same positions tensor)."""
        if positions is not self._positions:
            self._positions = positions
            self._cos_sin = (
                self.cos_cache[positions].unsqueeze(1),
                self.signed_sin_cache[positions].unsqueeze(1),
            )
        return self._cos_sin

