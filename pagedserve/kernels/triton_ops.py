"""Fused elementwise kernels for cuda, in Triton: the residual add with RMSNorm, SiLU-and-mul, and
the rotary embedding applied in place. Each replaces a chain of torch ops (three to six kernels,
each reading and writing the whole tensor) with one pass.

They round where torch's ops round, so the results match the torch paths they replace
(layers/norm.py, layers/activation.py, layers/rotary.py) to the last bit in the usual case: every
intermediate torch keeps in the compute dtype is rounded to it here too, and the arithmetic is
fp32 as in torch's CUDA kernels. Transcendentals (exp, rsqrt) may differ from CUDA's libm by an
ulp of fp32, which rounding to bf16 almost always hides; tests bound the rest.

The kernels themselves live in kernels/triton_elementwise.py, imported on first launch. The
layers call these only for cuda tensors when the model was built with gpu_kernels on
(kernels/cpu_ops.py KernelConfig); `available()` says whether Triton can be imported at all. The
CPU runs them only in tests, under the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from types import ModuleType

import torch


@functools.cache
def available() -> bool:
    """Whether triton can be imported (not imported here: a CPU server never needs it)."""
    return importlib.util.find_spec("triton") is not None


def for_new_layer() -> ModuleType | None:
    """This module, for a layer being built on cuda whose KernelConfig (kernels/cpu_ops.py)
    keeps gpu_kernels on and where Triton imports; None: the layer runs torch's ops."""
    from pagedserve.kernels import cpu_ops

    if (torch.get_default_device().type != "cuda" or not cpu_ops.build_config().gpu_kernels
            or not available()):
        return None
    return sys.modules[__name__]


def serves(x: torch.Tensor) -> bool:
    """Whether these kernels take `x`: a contiguous cuda tensor (or any tensor under the
    interpreter, for tests) in a float dtype."""
    return (x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.is_contiguous()
            and (x.is_cuda or _interpreting()) and available())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels() -> ModuleType:
    from pagedserve.kernels import triton_elementwise

    return triton_elementwise


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, hidden): (norm(x + residual) * weight, x + residual); residual None: x is it."""
    num_rows, hidden = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    _kernels().add_rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out, residual_out, hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=_next_power_of_2(hidden),
        num_warps=_warps(hidden))
    return out, residual_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2F) -> (T, F): silu(gate) * up."""
    num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _next_power_of_2(width))
    _kernels().silu_and_mul_kernel[(num_rows, -(-width // block))](
        gate_up, out, width, BLOCK=block, num_warps=4)
    return out


def rotary_serves(qkv: torch.Tensor, head_dim: int) -> bool:
    """Rows of heads side by side, each head's halves a power of two wide (tl.arange)."""
    half = head_dim // 2
    return serves(qkv) and qkv.dim() == 2 and half >= 1 and half & (half - 1) == 0


def rotary_inplace(qkv: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor,
                   cos_cache: torch.Tensor, signed_sin_cache: torch.Tensor) -> None:
    """Rotate the first `num_heads` heads (of head_dim) of each row of qkv (T, width), in place:
    the rotate-half layout, as RotaryEmbedding.forward computes it (rotary_serves first)."""
    num_tokens = qkv.shape[0]
    heads_block = min(16, _next_power_of_2(num_heads))
    _kernels().rotary_kernel[(num_tokens, -(-num_heads // heads_block))](
        qkv, positions, cos_cache, signed_sin_cache, qkv.stride(0), num_heads,
        HEAD_DIM=head_dim, HALF=head_dim // 2, HEADS_BLOCK=heads_block, num_warps=4,
        # torch rounds each product and then their sum; compiled Triton would contract them into
        # one FMA (measured on an H200: results one ulp off torch's). The interpreter ignores it.
        enable_fp_fusion=False)


def _warps(width: int) -> int:
    return 1 if width <= 512 else 4 if width <= 4096 else 8
