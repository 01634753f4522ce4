"""The fused Triton kernels (kernels/triton_ops.py) against the torch paths they replace: the
residual add with RMSNorm, SiLU-and-mul, and the in-place rotary embedding.

On cuda they run compiled; elsewhere under the Triton interpreter (TRITON_INTERPRET=1, set
before triton is imported), so the CPU CI checks the same kernel code. Outputs match to the last
bit where the arithmetic is exact; transcendentals (exp, rsqrt) are bounded by a few ulps.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import ON_CUDA

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from pagedserve.kernels import triton_ops  # noqa: E402
from pagedserve.layers.activation import silu_and_mul  # noqa: E402
from pagedserve.layers.norm import RMSNorm  # noqa: E402
from pagedserve.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if ON_CUDA else "cpu"
INTERPRETED = not ON_CUDA
"""The interpreter converts fp32 to bf16 by truncation, not round-to-nearest-even (triton 3.6):
there, bf16 results may differ by one ulp wherever rounding and truncation part; compiled, they
round as torch does."""
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULPS = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2 if INTERPRETED else 8e-3,
        torch.float16: 1e-3}
"""Relative distance of a few units in the last place: where exp / rsqrt differ from torch's."""


def close_to_the_bit(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Within a few ulps; in bf16 / fp16, where rounding hides an fp32 ulp, nearly all bitwise
    equal. (In fp32 one ulp of a row's rsqrt moves every element of the row.)"""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if dtype == torch.float16 or dtype == torch.bfloat16 and not INTERPRETED:
        equal = (actual == expected).float().mean().item()
        assert equal >= 0.97, f"only {equal:.4f} of the elements are bitwise equal"
    torch.testing.assert_close(actual, expected, rtol=ULPS[dtype], atol=ULPS[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 576, 200])
def test_add_rms_norm_equals_the_module(dtype, with_residual, hidden):
    torch.manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-5, kernels=None).to(DEVICE, dtype)
    norm.weight.data.normal_(1.0, 0.3)
    x = torch.randn(7, hidden, device=DEVICE, dtype=dtype) * 3
    residual = torch.randn_like(x) if with_residual else None
    expected, expected_residual = norm(x, residual)  # the torch path (no kernels on this module)
    out, out_residual = triton_ops.add_rms_norm(x, residual, norm.weight, 1e-5)
    if dtype == torch.bfloat16 and INTERPRETED:
        close_to_the_bit(out_residual, expected_residual, dtype)
    else:
        assert torch.equal(out_residual, expected_residual)  # one rounding of an exact fp32 sum
    close_to_the_bit(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [128, 1536, 100])
def test_silu_and_mul_equals_torch(dtype, width):
    torch.manual_seed(width)
    gate_up = torch.randn(5, 2 * width, device=DEVICE, dtype=dtype) * 4
    close_to_the_bit(triton_ops.silu_and_mul(gate_up), silu_and_mul(gate_up, None), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 256),
                                                               (3, 1, 16)])
def test_rotary_in_place_equals_the_module(dtype, num_heads, num_kv_heads, head_dim):
    torch.manual_seed(head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, dtype, kernels=None).to(DEVICE)
    num_tokens, heads = 6, num_heads + num_kv_heads
    qkv = torch.randn(num_tokens, (heads + num_kv_heads) * head_dim, device=DEVICE, dtype=dtype)
    positions = torch.tensor([0, 1, 17, 300, 4095, 2], device=DEVICE)
    expected = rotary(positions, qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim))
    rotated = qkv.clone()
    assert triton_ops.rotary_serves(rotated, head_dim)
    triton_ops.rotary_inplace(rotated, heads, head_dim, positions, rotary.cos_cache,
                              rotary.signed_sin_cache)
    rotated_qk = rotated[:, : heads * head_dim].view_as(expected)
    if dtype == torch.bfloat16 and INTERPRETED:
        close_to_the_bit(rotated_qk, expected, dtype)
    else:  # compiled, only with FMA contraction off (triton_ops.rotary_inplace)
        assert torch.equal(rotated_qk, expected)
    assert torch.equal(rotated[:, heads * head_dim :], qkv[:, heads * head_dim :])  # v untouched


def test_the_layers_take_the_kernels_only_where_they_were_built_for_cuda():
    from pagedserve.kernels import cpu_ops

    # Built on the CPU (the default device here): torch's ops, whatever the config says.
    if DEVICE == "cpu":
        assert triton_ops.for_new_layer() is None
        assert RMSNorm(8, 1e-5, None).gpu_kernels is None
    with torch.device("cuda" if DEVICE == "cuda" else "meta"), cpu_ops.building_with(
            cpu_ops.KernelConfig(gpu_kernels=False)):
        assert triton_ops.for_new_layer() is None  # --no-gpu-kernels: the torch reference
