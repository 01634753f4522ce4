"""The compiled CPU kernels (csrc/cpu_ops.cpp) against their plain-torch references.

quant_linear is checked against a torch transcription of its own arithmetic (activations
quantized per 32-element group, then exact sums) to fp32 rounding, and against the dequantized
fp32 matmul within the activation quantization's error. Its fp32 mode (activation_bits 32) must
reproduce the dequantized weights bit for bit, stay within fp32 summation error of the fp64
product, and give a row the same bits in any batch. The elementwise kernels of Llama's block
must equal the Python modules they stand in for, bit for bit, since the decoder stack's equality
rests on it; Gemma's norm and GELU (no decoder stack) stay within the ulps their tests state.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_ops
from pagedserve.layers import quantized
from pagedserve.layers.activation import gelu_tanh_and_mul, silu_and_mul
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.quantized import (
    GQT,
    GroupQuantizedWeight,
    decode_gguf_blocks,
    quantize_weight,
)
from pagedserve.layers.rotary import RotaryEmbedding
from tests.layers.test_quantized import synthetic_blocks

ops = cpu_ops.load()
pytestmark = pytest.mark.skipif(ops is None, reason="the compiled CPU kernels are unavailable")


def reference_quant_linear(x: torch.Tensor, weight, activation_bits: int) -> torch.Tensor:
    """The kernel's arithmetic in torch: x quantized per 32-group to int16/int8 levels, times the
    dequantized weights (the code part and the min part both take the quantized x)."""
    levels = 32767 if activation_bits == 16 else 127
    m, k = x.shape
    xg = x.double().view(m, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    scale = (amax / levels).float().double()
    inv = torch.where(amax > 0, (levels / amax.float()).double(), torch.zeros_like(amax))
    xq = (xg.float() * inv.float()).double().round().clamp(-levels, levels) * scale
    return (xq.view(m, k) @ weight.dequantize().double().t()).float()


@pytest.mark.parametrize("activation_bits", [16, 8])
@pytest.mark.parametrize("qtype", [GQT.Q4_0, GQT.Q4_1, GQT.Q4_K, GQT.Q5_0, GQT.Q5_K, GQT.Q8_0],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 21])
@pytest.mark.parametrize("k", [256, 576])  # 8 and 18 groups: a row's groups are quantized 16 at a time
def test_quant_linear_follows_its_arithmetic(qtype, rows, activation_bits, k):
    n = 40  # the last 16-column block is partly padding
    weight = decode_gguf_blocks(synthetic_blocks(qtype, n, k, seed=rows), qtype, (n, k))
    layer = GroupQuantizedWeight(weight, ops, activation_bits=activation_bits)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, 32:64] = 0  # an all-zero group: scale 0, codes 0
    y = layer(x)
    expected = reference_quant_linear(x, weight, activation_bits)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    exact = x @ weight.dequantize().t()
    error = ((y - exact).abs().max() / exact.abs().max()).item()
    assert error < (1e-4 if activation_bits == 16 else 3e-2), error


def reference_outlier_quant_linear(x: torch.Tensor, weight, activation_bits: int,
                                   channels: torch.Tensor) -> torch.Tensor:
    """The kernel with outlier channels, in torch: those channels zeroed before the rest is
    quantized as reference_quant_linear does, then multiplied exactly by their weights rounded
    to fp16 (layers/outliers.py)."""
    rest = x.clone()
    rest[:, channels] = 0
    outlier_weights = weight.dequantize()[:, channels].half().double()
    return (reference_quant_linear(rest, weight, activation_bits).double()
            + x[:, channels].double() @ outlier_weights.t()).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation_bits", [16, 8])
@pytest.mark.parametrize("qtype", [GQT.Q4_1, GQT.Q4_K, GQT.Q5_K, GQT.Q8_0], ids=lambda t: t.name)
def test_quant_linear_multiplies_outlier_channels_exactly(qtype, activation_bits, dtype):
    """A few huge input channels (as a layer's massive activations) ruin int8's resolution for
    the rest of their groups; taken out and multiplied exactly, the product follows its torch
    reference, lands nearer the exact product, and gives a row the same bits in any batch."""
    n, k, rows = 40, 288, 21
    weight = decode_gguf_blocks(synthetic_blocks(qtype, n, k, seed=3), qtype, (n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    channels = torch.tensor([3, 40, 41, 200])
    x[:, channels] *= 60.0
    x = x.to(dtype).float()  # the values a bf16 layer would see
    plain = GroupQuantizedWeight(weight, ops, dtype, activation_bits)
    layer = GroupQuantizedWeight(weight, ops, dtype, activation_bits)
    layer.set_outlier_channels(torch.tensor([200, 3, 41, 40]))  # any order: kept ascending
    assert layer.outlier_channels.tolist() == [3, 40, 41, 200]
    y = layer(x.to(dtype)).float()
    expected = reference_outlier_quant_linear(x, weight, activation_bits, channels)
    scale = expected.abs().max().item()
    tolerance = 1e-5 if dtype == torch.float32 else 2.0**-8  # bf16: the output's one rounding
    torch.testing.assert_close(y, expected, rtol=tolerance, atol=tolerance * scale)
    if activation_bits == 8:
        exact = x @ weight.dequantize().t()
        error, plain_error = ((y - exact).abs().max().item(),
                              (plain(x.to(dtype)).float() - exact).abs().max().item())
        assert error < plain_error / 4, (error, plain_error)
    for part in (slice(0, 1), slice(4, 13)):
        assert torch.equal(layer(x[part].to(dtype)), layer(x.to(dtype))[part])
    layer.set_outlier_channels(None)
    assert torch.equal(layer(x.to(dtype)), plain(x.to(dtype)))


def test_quant_linear_refuses_bad_outlier_channels():
    weight = quantize_weight(torch.randn(40, 64), "int4")
    layer = GroupQuantizedWeight(weight, ops, torch.float32, 8)
    layer.set_outlier_channels(torch.tensor([1, 2]))
    x = torch.randn(2, 64)
    args = (x, layer.codes, layer.scales, layer.mins, layer.out_features, layer.bits, 8, None)
    with pytest.raises(RuntimeError, match="ascending and within K"):
        ops.quant_linear(*args, torch.tensor([2, 1]), layer.outlier_weights)
    with pytest.raises(RuntimeError, match="ascending and within K"):
        ops.quant_linear(*args, torch.tensor([1, 64]), layer.outlier_weights)
    with pytest.raises(RuntimeError, match="fp16"):
        ops.quant_linear(*args, layer.outlier_channels, layer.outlier_weights.float())
    with pytest.raises(RuntimeError, match="quantized activations"):
        ops.quant_linear(x, layer.codes, layer.scales, layer.mins, layer.out_features,
                         layer.bits, 32, None, layer.outlier_channels, layer.outlier_weights)


def test_quant_linear_bf16_rounds_once_and_adds_nothing_for_zero_rows():
    weight = quantize_weight(torch.randn(64, 96), "int4")
    layer = GroupQuantizedWeight(weight, ops)
    x = torch.randn(5, 96).bfloat16()
    assert torch.equal(layer(x).float(), layer(x.float()).bfloat16().float())
    assert torch.equal(layer(torch.zeros(2, 96)), torch.zeros(2, 64))


def _exact_layer(qtype, n: int, k: int, seed: int) -> tuple[GroupQuantizedWeight, torch.Tensor]:
    """A GroupQuantizedWeight in fp32 mode and its dequantized weight (the slow reference)."""
    weight = decode_gguf_blocks(synthetic_blocks(qtype, n, k, seed=seed), qtype, (n, k))
    layer = GroupQuantizedWeight(weight, ops, torch.float32)
    assert layer.activation_bits == quantized.EXACT_ACTIVATION_BITS
    return layer, weight.dequantize()


# 40 columns: a pair of 16-column blocks and a padded one; K = 288: a slice of 8 groups and one
# of 1; K = 576: SmolLM2's hidden size.
@pytest.mark.parametrize("qtype", [GQT.Q4_0, GQT.Q4_1, GQT.Q4_K, GQT.Q5_0, GQT.Q5_K, GQT.Q8_0],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("k", [288, 576])
def test_fp32_quant_linear_is_the_dense_product(qtype, k):
    n = 40
    layer, dense = _exact_layer(qtype, n, k, seed=k)
    # One-hot rows read the weights back: exact, the dense model's values bit for bit.
    columns = torch.tensor([0, 1, 17, 31, 32, k - 1])
    assert torch.equal(layer(torch.eye(k)[columns]), dense[:, columns].t())
    # Any rows: within fp32 summation error of the fp64 product (|error| <= k u sum |w x|).
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(k))
    y = layer(x).double()
    exact = x.double() @ dense.double().t()
    bound = k * 2.0**-24 * (x.double().abs() @ dense.double().abs().t())
    assert ((y - exact).abs() <= bound).all()


# A row's bits may not depend on its batch. The batch sizes also choose the kernel: on AVX2 without
# VNNI, int16 runs 8 or more rows on the widened-code panel and fewer by vnni_block; 5-bit codes
# (Q5_1) on a chunk of 128 rows are widened to bytes once per block (kBytePanelMinRows) and fewer
# rows unpack them per tile.
@pytest.mark.parametrize("activation_bits", [quantized.EXACT_ACTIVATION_BITS, 16, 8])
@pytest.mark.parametrize("qtype", [GQT.Q4_1, GQT.Q4_K, GQT.Q5_1, GQT.Q8_0], ids=lambda t: t.name)
def test_quant_linear_gives_a_row_the_same_bits_in_any_batch(qtype, activation_bits):
    n, k = 48, 576
    weight = decode_gguf_blocks(synthetic_blocks(qtype, n, k, seed=1), qtype, (n, k))
    layer = GroupQuantizedWeight(weight, ops, torch.float32, activation_bits)
    x = torch.randn(133, k, generator=torch.Generator().manual_seed(1))  # > one 128-row chunk
    batch = layer(x)
    for rows in (slice(0, 1), slice(5, 8), slice(20, 29), slice(61, 130), slice(132, 133)):
        assert torch.equal(layer(x[rows]), batch[rows])


def test_fp32_quant_linear_takes_bf16_and_rounds_once():
    layer, _ = _exact_layer(GQT.Q8_0, 40, 288, seed=2)
    x = torch.randn(5, 288).bfloat16()
    assert torch.equal(layer(x), layer(x.float()).bfloat16())


@pytest.mark.parametrize("qtype", [GQT.Q4_0, GQT.Q4_1, GQT.Q4_K, GQT.Q5_0, GQT.Q5_1, GQT.Q5_K,
                                   GQT.Q8_0], ids=lambda t: t.name)
def test_loading_kernels_equal_their_references(qtype):
    """pack_codes lays the codes out as vnni_layout's torch reshapes do; dequantize_codes gives
    back GGUFQuantWeight.dequantize's values: fp32 bit for bit, bf16 rounded once from them."""
    n, k = 40, 288  # 40: the last 16-column block is partly padding
    weight = decode_gguf_blocks(synthetic_blocks(qtype, n, k, seed=7), qtype, (n, k))
    compiled, reference = quantized.vnni_layout(weight, ops), quantized.vnni_layout(weight)
    assert compiled[3] == reference[3]
    for ours, theirs in zip(compiled[:3], reference[:3]):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    layer = GroupQuantizedWeight(weight, ops)
    dense = weight.dequantize()
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((n, k), float("nan"), dtype=dtype)
        layer.dequantize_into(out)
        assert torch.equal(out, dense.to(dtype))


@pytest.mark.parametrize("qtype", [GQT.Q4_1, GQT.Q4_K, GQT.Q5_K, GQT.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("n", [40, 3640], ids=["one panel", "two panels"])
def test_dense_product_on_the_codes_is_the_dense_layer(qtype, n):
    """In bf16, dequantize_linear (weights dequantized per call, a panel of rows at a time)
    gives F.linear on the dense weights bit for bit, with and without a bias: a bf16 layer keeps
    no dense copy for large batches. 3,640 rows x 576 is past one panel (2^21 weights). fp32
    (not served this way: its layers multiply exactly on the codes) is bitwise in one panel; MKL
    may sum a narrower panel in another order."""
    k = 576
    weight = decode_gguf_blocks(synthetic_blocks(qtype, n, k, seed=11), qtype, (n, k))
    generator = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        layer = GroupQuantizedWeight(weight, ops, dtype)
        dense = weight.dequantize().to(dtype)
        bias = torch.randn(n, generator=generator).to(dtype)
        for rows in (9, 33, 200):
            x = torch.randn(rows, k, generator=generator).to(dtype)
            for b in (None, bias):
                ours, theirs = layer.dense_product(x, b), F.linear(x, dense, b)
                if dtype == torch.bfloat16 or n == 40:
                    assert torch.equal(ours, theirs)
                else:  # each within fp32 summation error (k u sum |w x|) of the exact product
                    bound = 2 * k * 2.0**-24 * (x.abs() @ dense.abs().t()).double() + 1e-30
                    assert ((ours - theirs).double().abs() <= bound).all()


@pytest.mark.parametrize("qtype", [GQT.Q4_0, GQT.Q5_0, GQT.Q8_0], ids=lambda t: t.name)
def test_lookup_on_the_codes_is_the_dense_embedding(qtype):
    n, k = 40, 288
    weight = decode_gguf_blocks(synthetic_blocks(qtype, n, k, seed=5), qtype, (n, k))
    ids = torch.tensor([[0, 39, 17], [16, 15, 0]])
    for dtype in (torch.bfloat16, torch.float32):
        table = GroupQuantizedWeight(weight, ops, dtype)
        assert torch.equal(table.lookup(ids), F.embedding(ids, weight.dequantize().to(dtype)))
    with pytest.raises(RuntimeError, match="embedding id 40 is out of range"):
        table.lookup(torch.tensor([3, 40]))


def test_add_rms_norm_equals_the_module_path():
    """bf16 at SmolLM2's width, fixed inputs. The kernel adds the squares in another order than
    torch's fp32 reduction (the fp32 norms differ in an ulp in about a fifth of rows); a bf16
    value flips only where it sits within that ulp of a rounding edge: none here, nor in 1,600
    random rows at this width, but a few per 10^4 values at some other widths (256, 896)."""
    generator = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5, ops)
    norm.weight.data = torch.randn(576, generator=generator).bfloat16()
    x = torch.randn(7, 576, generator=generator).bfloat16()
    residual = torch.randn(7, 576, generator=generator).bfloat16()
    fused = norm(x, residual), norm(x)
    norm.kernels = None  # the torch path
    plain = norm(x, residual), norm(x)
    for (a, b), (c, d) in zip(fused, plain):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_gelu_tanh_and_mul_equals_torch():
    """Gemma's gating. Both sides round tanh(u) to fp32 before 1 + tanh(u), which cancels for
    negative gates: they may differ by a few ulps of 1 there, times 0.5 * gate * up. bf16: within
    1e-5, and torch's bits wherever |torch's| > 1e-4; fp32: within 4e-7 |gate * up| plus an ulp
    or two of the result. Gates past exp's range (+-200) included."""
    gate_up = torch.randn(64, 2 * 2048, generator=torch.Generator().manual_seed(3)) * 4
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, -30.0, 30.0])
    for dtype in (torch.bfloat16, torch.float32):
        ours = gelu_tanh_and_mul(gate_up.to(dtype), ops)
        theirs = gelu_tanh_and_mul(gate_up.to(dtype), None)
        assert ours.dtype == dtype
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        if dtype == torch.float32:
            gate, up = gate_up.chunk(2, dim=-1)
            bound = 4e-7 * (gate * up).abs() + 2.5e-7 * theirs.abs()
            assert ((ours - theirs).abs() <= bound).all()
        if dtype == torch.bfloat16:
            visible = theirs.float().abs() > 1e-4
            assert visible.float().mean() > 0.8  # most values: the gates are N(0, 16)
            assert torch.equal(ours[visible], theirs[visible])


def test_gemma_norm_matches_the_torch_path():
    """add_rms_norm's unit_offset form (Gemma: (1 + weight) in fp32, rounded once) against
    GemmaRMSNorm's torch path, with and without the residual add. The sums of squares add in
    another order than torch's reduction, so the fp32 results differ by a few ulps (AVX2 adds
    80 squares per lane where AVX-512 adds 40: 3.9e-7 relative measured on Zen 3; the 3e-7 bound
    held on Zen 4) and a bf16 value can round the other way where the fp32 one sits within an
    ulp of a rounding edge (about 1 in 10^4): bf16 within one ulp there and equal elsewhere; the
    residual sums exact."""
    from pagedserve.models.gemma3 import GemmaRMSNorm

    generator = torch.Generator().manual_seed(11)
    norm = GemmaRMSNorm(640, 1e-6, ops)
    norm.weight.data = torch.randn(640, generator=generator) * 0.5
    for dtype in (torch.bfloat16, torch.float32):
        norm.to(dtype)
        x = (torch.randn(33, 640, generator=generator) * 5).to(dtype)
        residual = torch.randn(33, 640, generator=generator).to(dtype)
        norm.kernels = ops
        fused = norm(x, residual), norm(x)
        norm.kernels = None
        plain = norm(x, residual), norm(x)
        for (a, b), (c, d) in zip(fused, plain):
            assert torch.equal(b, d)
            if dtype == torch.bfloat16:
                assert (a != c).float().mean() < 1e-3
                torch.testing.assert_close(a, c, rtol=2**-7, atol=0)
            else:
                torch.testing.assert_close(a, c, rtol=6e-7, atol=1e-7)  # ~5 ulps


@pytest.mark.parametrize("gemma", [False, True], ids=["llama_form", "gemma_form"])
def test_qk_norm_in_place_equals_the_split_path(gemma):
    """rms_norm_heads_inplace (QK-norm of Qwen3 and Gemma 3 on the qkv projection's own rows)
    against the modules' split -> norm -> cat with the same kernels: q and k heads normed with
    their own weights, v untouched, bit for bit."""
    from pagedserve.models.gemma3 import GemmaRMSNorm

    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, d = 4, 2, 256
    make = (lambda: GemmaRMSNorm(d, 1e-6, ops)) if gemma else (lambda: RMSNorm(d, 1e-6, ops))
    q_norm, k_norm = make(), make()
    q_norm.weight.data = torch.randn(d, generator=generator).bfloat16()
    k_norm.weight.data = torch.randn(d, generator=generator).bfloat16()
    qkv = torch.randn(7, (heads + 2 * kv_heads) * d, generator=generator).bfloat16() * 3
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    expected = torch.cat([q_norm(q.reshape(-1, d))[0].view(7, -1),
                          k_norm(k.reshape(-1, d))[0].view(7, -1), v], dim=1)
    ops.rms_norm_heads_inplace(qkv, heads, kv_heads, q_norm.weight, k_norm.weight, 1e-6, gemma)
    assert torch.equal(qkv, expected)


@pytest.mark.skipif(ops is None or not ops.dense_rows_supported(),
                    reason="dense_rows needs AVX512-BF16 (this CPU or build lacks it)")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_dense_rows_matches_torch_linear(rows):
    """dense_rows (a few bf16 rows times dense bf16 weights) against F.linear and the fp64
    product: no further from the exact product than torch's bf16 linear (both sum in fp32 and
    round once), K with a 32-element tail past the 64-element steps, with and without bias."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 608, generator=generator).bfloat16()
    w = torch.randn(200, 608, generator=generator).bfloat16()
    bias = torch.randn(200, generator=generator).bfloat16()
    for b in (None, bias):
        ours, theirs = ops.dense_rows(x, w, b), F.linear(x, w, b)
        exact = x.double() @ w.double().t() + (0 if b is None else b.double())
        ulp = exact.abs().clamp_min(1e-3) * 2**-8  # a bf16 ulp (2^-7 relative) covers both
        assert ((ours.double() - exact).abs() <= ulp).all()
        assert ((theirs.double() - exact).abs() <= ulp).all()
        assert (ours != theirs).float().mean() < 0.01
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        ops.dense_rows(torch.randn(5, 608).bfloat16(), w)


def test_silu_and_mul_equals_torch():
    """bf16: torch's bits; fp32: within a few ulps (the kernel's exp is a polynomial). Gates
    far past exp's range (+-200) included."""
    gate_up = torch.randn(5, 2 * 1536) * 4
    gate_up[0, :2] = torch.tensor([-200.0, 200.0])
    assert torch.equal(silu_and_mul(gate_up.bfloat16(), ops),
                       silu_and_mul(gate_up.bfloat16(), None))
    torch.testing.assert_close(silu_and_mul(gate_up, ops), silu_and_mul(gate_up, None),
                               rtol=2e-6, atol=1e-30)


GATED = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


@pytest.mark.parametrize("activation", sorted(GATED))
@pytest.mark.parametrize("activation_bits", [16, 8])
@pytest.mark.parametrize("qtype", [GQT.Q4_1, GQT.Q5_0, GQT.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_product_equals_the_two_steps(qtype, activation_bits, dtype, activation):
    """quant_linear_gated = silu_and_mul (gelu_tanh_and_mul) of quant_linear(...) bit for bit:
    the gate and up values rounded as the product stores them, then the activation kernel's
    arithmetic. Row counts across the row tiles (8) and chunks (128), outlier channels in one
    gate and one up column block, and gates past exp's range."""
    f, k = 48, 256  # 3 column blocks per half
    weight = decode_gguf_blocks(synthetic_blocks(qtype, 2 * f, k, seed=7), qtype, (2 * f, k))
    layer = GroupQuantizedWeight(weight, ops, dtype, activation_bits)
    assert layer.serves_gated_product
    for outliers in (None, torch.tensor([5, 130])):
        layer.set_outlier_channels(outliers)
        for rows in (1, 9, 130):
            x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3)
            x[0, :4] = torch.tensor([400.0, -400.0, 0.0, 1e-3])
            x = x.to(dtype)
            two_steps = GATED[activation](layer(x), ops)
            assert torch.equal(layer.gated_product(x, activation), two_steps), (outliers, rows)
    with pytest.raises(RuntimeError, match="n / 2 a multiple of 16"):
        narrow = GroupQuantizedWeight(
            decode_gguf_blocks(synthetic_blocks(qtype, 40, k, seed=1), qtype, (40, k)), ops,
            dtype, activation_bits)
        narrow.gated_product(torch.randn(2, k).to(dtype), activation)
    with pytest.raises(RuntimeError, match="silu or gelu_tanh"):
        layer.gated_product(torch.randn(2, k).to(dtype), "relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_equals_torch_argmax(dtype):
    """The same index as torch.argmax(dim=-1) in every case that has a rule: ties (the first),
    NaN (the first NaN wins, before or after the maximum), infinities, -0 beside 0, rows
    shorter than a vector, rows with a tail past the last whole vector, rows of a wider tensor,
    and an empty batch."""
    nan, inf = float("nan"), float("inf")
    special = [[1.0, nan, 2.0], [nan, nan], [-inf, -inf], [3.0, 5.0, 5.0, 1.0], [inf, inf, 2.0],
               [-inf, nan, inf], [0.0, -0.0], [-0.0, 0.0], [7.0]]
    for row in special:
        for repeats in (1, 20):  # within one vector, and across several (and a tail)
            x = torch.tensor([row * repeats], dtype=dtype)
            assert ops.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist(), (row, repeats)
    late_nan = torch.randn(2, 1000)
    late_nan[0, 900] = nan  # after many whole vectors: the vector walk stops and the tail finds it
    late_nan[1, 999] = nan
    generator = torch.Generator().manual_seed(0)
    cases = [late_nan, torch.randn(0, 64)]
    for vocab in (1, 15, 16, 17, 49152, 49153):
        cases.append(torch.randn(33, vocab, generator=generator))
    ties = torch.randint(0, 3, (16, 100), generator=generator).float()  # many equal maxima
    cases += [ties, torch.randn(8, 300, generator=generator)[:, 10:250]]  # rows of a wider tensor
    for x in cases:
        x = x.to(dtype)
        assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_matches_forward(dtype):
    """Same math as RotaryEmbedding.forward; the kernel computes in fp32 and rounds once, the
    torch ops round after each product and the sum in bf16: equal in fp32, within those
    roundings in bf16 (each at most 2^-9 of a value up to sqrt(2) max|x|: bound 2^-6 max|x|;
    over 300 seeds the largest error was 2^-6.9 max|x|)."""
    heads, kv_heads, head_dim = 9, 3, 64
    rotary = RotaryEmbedding(head_dim, 2048, 10000.0, dtype, ops)
    positions = torch.tensor([0, 5, 1999, 17])
    qkv = torch.randn(4, (heads + 2 * kv_heads) * head_dim,
                      generator=torch.Generator().manual_seed(0)).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(4, heads + kv_heads, head_dim)
    largest = qk.float().abs().max().item()
    expected = rotary(positions, qk).float()
    assert rotary.rotate_in_place(positions, qkv, heads + kv_heads)
    actual = qkv[:, : (heads + kv_heads) * head_dim].view(4, heads + kv_heads, head_dim).float()
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=2**-6 * largest)


def test_write_kv_equals_index_copy():
    from pagedserve.attention.paged import write_kv_index_copy

    key, value = torch.randn(3, 10, 4, 16), torch.randn(3, 10, 4, 16)
    caches = [key, value, key.clone(), value.clone()]
    k, v = torch.randn(5, 3, 16), torch.randn(5, 3, 16)
    slots = torch.tensor([7, 0, 39, 12, 13])
    write_kv_index_copy((caches[0], caches[1]), k, v, slots)
    ops.write_kv(caches[2], caches[3], k, v, slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv(caches[2], caches[3], k, v, torch.tensor([0, 1, 2, 3, 40]))


def test_bench_matmul_times_every_mode_on_the_same_weights(capsys, tmp_path):
    """`pagedserve bench matmul` runs each mode at each row count and prints a row per case
    (its figures are timings, so only their presence is checked here)."""
    from pagedserve.benchmarks import matmul
    from pagedserve.entrypoints.cli import build_parser

    records = matmul.measure([(40, 64)], [1, 9], "int4", iterations=2)
    assert [(r["n"], r["k"], r["rows"]) for r in records] == [(40, 64, 1), (40, 64, 9)]
    assert all(set(r["ms"]) == {"dense", *matmul.MODES} for r in records)
    assert all(ms > 0 for r in records for ms in r["ms"].values())
    # this build as its own baseline (a copy: one file loads once per process), so the bits agree
    baseline = tmp_path / Path(ops.__file__).name
    shutil.copy(ops.__file__, baseline)
    args = build_parser().parse_args(["bench", "matmul", "--shapes", "16x32", "--rows", "3,9",
                                      "--qtype", "int8", "--iterations", "1",
                                      "--outlier-channels", "4",
                                      "--baseline-kernels", str(baseline)])
    assert args.func(args) == 0
    table = capsys.readouterr().out.splitlines()
    assert "int8 codes" in table[0] and "4 outlier channels" in table[0]
    assert "base int16 / int16" in table[1] and "base int8 / int8" in table[1]
    assert [line.split()[:4] for line in table[2:]] == [["16", "x", "32", "3"],
                                                        ["16", "x", "32", "9"]]


def test_bench_peak_reports_each_instruction_kind_of_this_build(capsys):
    """`pagedserve bench peak` times the instruction kinds this build has (int8 and bf16 dot
    products where AVX-512 VNNI / BF16 were compiled in, the fp32 FMA wherever AVX2 or AVX-512
    was) and the read bandwidth; its figures are timings, so only their presence is checked."""
    from pagedserve.benchmarks import peak
    from pagedserve.entrypoints.cli import build_parser

    kinds = ops.peak_kinds()
    build = set(ops.BUILD_ISA.split())
    assert ("int8" in kinds) == ("avx512_vnni" in build)
    assert ("bf16" in kinds) == ("avx512_bf16" in build)
    assert kinds.get("fp32") in ({16} if "avx512f" in build else {8} if "avx2" in build else {None})
    peaks = peak.compute_peaks(iterations=1000, repeats=1)
    assert set(peaks) == set(kinds) and all(gops > 0 for gops in peaks.values())
    with pytest.raises(RuntimeError, match="no peak loop for 'int4'"):
        ops.peak_seconds("int4", 10)
    args = build_parser().parse_args(["bench", "peak", "--iterations", "1000", "--repeats", "1"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(kinds) and "read bandwidth" in lines[-1]
