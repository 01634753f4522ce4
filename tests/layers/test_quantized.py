"""GGUF codes kept packed: exact against gguf's own dequantize, close to a dense bf16 matmul.

Synthetic blocks cover every packable type (random bytes with finite fp16 scales, so every code,
6-bit scale and sign occurs); the real SmolLM2 file covers Q4_1 and Q8_0 as shipped.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_ops
from pagedserve.layers.linear import PACKED_MAX_ROWS, Linear, MergedLinear
from pagedserve.layers.quantized import (
    GQT,
    PACKABLE_TYPES,
    GGUFQuantWeight,
    GroupQuantizedWeight,
    Int4PackedWeight,
    as_int4_halves,
    concat_rows,
    decode_gguf_blocks,
    int4_scales_and_zeros,
    quantize_weight,
)

# Byte offsets of the fp16 fields in each block: d (and m / dmin).
_FP16_FIELDS = {GQT.Q4_0: (0,), GQT.Q4_1: (0, 2), GQT.Q4_K: (0, 2), GQT.Q8_0: (0,),
                GQT.Q5_0: (0,), GQT.Q5_1: (0, 2), GQT.Q5_K: (0, 2)}


def synthetic_blocks(qtype: GQT, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes [n, k / block * bytes] of a random matrix of `qtype`."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // block_size, type_size), dtype=np.uint8)
    for offset in _FP16_FIELDS[qtype]:
        values = (rng.standard_normal(len(blocks)) * 0.02).astype(np.float16)
        blocks[:, offset : offset + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def _kernel_weight(packed: Int4PackedWeight, k: int) -> torch.Tensor:
    """W [N, K] read back through the int4 kernel itself: identity activations, fp32 scales."""
    x = torch.eye(k)
    if packed.duplicate_input:  # Q8_0, 5-bit: [x, x] against [W_hi, W_lo]
        x = x.repeat(1, 2)
    w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, packed.packed, 32, packed.scales_and_zeros.float()
    )
    return w_t.t()


@pytest.mark.parametrize("qtype", PACKABLE_TYPES, ids=lambda t: t.name)
def test_codes_reproduce_gguf_dequantize_exactly(qtype):
    n, k = 48, 512
    data = synthetic_blocks(qtype, n, k)
    weight = decode_gguf_blocks(data, qtype, (n, k))
    reference = gguf.quants.dequantize(data, qtype)
    assert reference.shape == (n, k)
    np.testing.assert_array_equal(weight.dequantize().numpy(), reference)
    rows = torch.tensor([5, 0, 47, 5])
    np.testing.assert_array_equal(weight.dequantize(rows).numpy(), reference[rows.numpy()])


@pytest.mark.parametrize("qtype", [GQT.Q8_0, GQT.Q5_0, GQT.Q5_1, GQT.Q5_K], ids=lambda t: t.name)
def test_int4_halves_are_exact(qtype):
    n, k = 16, 256
    weight = decode_gguf_blocks(synthetic_blocks(qtype, n, k), qtype, (n, k))
    split = as_int4_halves(weight).dequantize()  # [N, 2K]: W = W_hi + W_lo
    assert split.shape == (n, 2 * k)
    assert torch.equal(split[:, :k] + split[:, k:], weight.dequantize())


@pytest.mark.parametrize("qtype", PACKABLE_TYPES, ids=lambda t: t.name)
def test_packing_layout_through_the_kernel(qtype):
    """The packed codes, read by the kernel in fp32, give W within an ulp or two.

    (The kernel computes (code - 8) * scale + zero with zero = min + 8 * scale; rounding zero to
    fp32 can move a value by an ulp relative to gguf's scale * code + min.)
    """
    n, k = 64, 256
    data = synthetic_blocks(qtype, n, k, seed=1)
    weight = decode_gguf_blocks(data, qtype, (n, k))
    packed = Int4PackedWeight(weight, torch.bfloat16)
    # Rebuild the scales in fp32 (the module keeps them in bf16, the kernel's dtype).
    source = weight if weight.bits == 4 else as_int4_halves(weight)
    packed.scales_and_zeros = int4_scales_and_zeros(source.scales, source.mins, torch.float32)
    reference = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    torch.testing.assert_close(_kernel_weight(packed, k), reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", PACKABLE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 7, 32])
def test_int4_matmul_close_to_dense_bf16(qtype, batch):
    """bf16 kernel vs dense bf16 F.linear of the dequantized weight, both against fp32.

    Tolerance: the kernel's relative error (its bf16 scales and zeros) stays within 2x the dense
    bf16 path's (bf16 weights), and both under 1% of the output norm.
    """
    n, k = 96, 576
    torch.manual_seed(0)
    data = synthetic_blocks(qtype, n, k, seed=2)
    weight = decode_gguf_blocks(data, qtype, (n, k))
    dense = weight.dequantize()
    x = torch.randn(batch, k).to(torch.bfloat16)
    exact = x.float() @ dense.t()
    ours = Int4PackedWeight(weight, torch.bfloat16)(x).float()
    dense_bf16 = torch.nn.functional.linear(x, dense.to(torch.bfloat16)).float()
    ours_error = (ours - exact).norm() / exact.norm()
    dense_error = (dense_bf16 - exact).norm() / exact.norm()
    assert ours_error < 1e-2 and dense_error < 1e-2, (ours_error, dense_error)
    assert ours_error < 2 * dense_error + 1e-3, (ours_error, dense_error)


def _loaded_linear(layer: Linear, shards: dict, dtype: torch.dtype) -> Linear:
    for shard_id, weight in shards.items():
        if isinstance(layer, MergedLinear):
            layer.weight_loader(layer.weight, weight, shard_id)
        else:
            from pagedserve.layers.linear import default_weight_loader

            default_weight_loader(layer.weight, weight)
    layer.process_weights_after_loading(dtype)
    return layer.to(dtype)


@pytest.mark.parametrize("shards,form", [
    ((GQT.Q4_K, GQT.Q5_0, GQT.Q5_K), 5),  # 4-bit codes join 5-bit ones as they are
    ((GQT.Q5_0, GQT.Q5_0, GQT.Q8_0), 8),  # Qwen2.5's and Gemma 3's QKV: symmetric Q5_0 as Q8_0
    ((GQT.Q4_0, GQT.Q8_0), 8),
    ((GQT.Q5_1, GQT.Q8_0), None),  # an asymmetric shard beside Q8_0: no exact common form
    ((GQT.Q4_K, GQT.Q8_0), None),
], ids=lambda v: "-".join(t.name for t in v) if isinstance(v, tuple) else str(v))
def test_merged_shards_meet_in_the_widest_exact_form(shards, form):
    k = 256
    weights = [decode_gguf_blocks(synthetic_blocks(t, 32, k, seed=i), t, (32, k))
               for i, t in enumerate(shards)]
    merged = concat_rows(weights)
    if form is None:
        assert merged is None
        return
    assert merged.bits == form
    if form == 8:
        assert merged.qtype == GQT.Q8_0 and merged.codes.dtype == torch.int8
    # the same values, bit for bit
    assert torch.equal(merged.dequantize(), torch.cat([w.dequantize() for w in weights]))


def test_merged_layer_packs_same_type_shards_and_falls_back_on_mixed():
    k = 256
    q = decode_gguf_blocks(synthetic_blocks(GQT.Q4_1, 64, k, 3), GQT.Q4_1, (64, k))
    kk = decode_gguf_blocks(synthetic_blocks(GQT.Q4_K, 32, k, 4), GQT.Q4_K, (32, k))
    v8 = decode_gguf_blocks(synthetic_blocks(GQT.Q8_0, 32, k, 5), GQT.Q8_0, (32, k))
    dense = torch.cat([q.dequantize(), kk.dequantize(), v8.dequantize()])
    x = torch.randn(3, k).to(torch.bfloat16)

    four_bit = MergedLinear(k, {"q": 64, "k": 32, "v": 32})
    _loaded_linear(four_bit, {"q": q, "k": kk, "v": kk}, torch.bfloat16)
    assert four_bit.packed is not None
    # Few rows go to the packed kernel, more rows to the dense bf16 matrix's product.
    four_bit_dense = torch.cat([q.dequantize(), kk.dequantize(), kk.dequantize()]).bfloat16()
    few = x[:PACKED_MAX_ROWS]
    many = torch.randn(PACKED_MAX_ROWS + 1, k).to(torch.bfloat16)
    torch.testing.assert_close(four_bit(few), four_bit.packed(few))
    if isinstance(four_bit.packed, GroupQuantizedWeight):  # the compiled kernels: codes alone
        assert four_bit.weight is None
        # int8 activations (bf16's default) run every row count on the codes; int16 and exact
        # ones run the dense product above PACKED_MAX_ROWS, bitwise the dense layer's
        int8 = four_bit.packed.activation_bits == 8
        assert four_bit.dense_above_max_rows == (not int8)
        expected = four_bit.packed(many) if int8 else F.linear(many, four_bit_dense)
        assert torch.equal(four_bit(many), expected)
    else:  # torch's int4 kernel: the dense copy is kept beside the codes
        assert torch.equal(four_bit.weight, four_bit_dense)
        torch.testing.assert_close(four_bit(many), many @ four_bit.weight.t())
    packed_many, dense_many = four_bit.packed(many).float(), four_bit(many).float()
    assert (packed_many - dense_many).norm() < 1e-2 * dense_many.norm()  # bf16 rounding only

    mixed = MergedLinear(k, {"q": 64, "k": 32, "v": 32})
    _loaded_linear(mixed, {"q": q, "k": kk, "v": v8}, torch.bfloat16)
    assert mixed.packed is None
    assert torch.equal(mixed.weight, dense.to(torch.bfloat16))  # dequantized, then rounded
    ops = cpu_ops.load()
    if ops is not None and ops.dense_rows_supported():  # up to 4 rows on the weights' stream
        assert mixed.dense_rows_kernels is ops
        assert torch.equal(mixed(x), ops.dense_rows(x, mixed.weight))
        assert torch.equal(mixed(many[:5]), F.linear(many[:5], mixed.weight))
    q_out, _, _ = mixed.forward_split(x)
    packed_q = four_bit.forward_split(x)[0].float()  # (int8 activations where the kernels serve)
    assert (q_out.float() - packed_q).norm() < 2e-2 * packed_q.norm()

    fp32 = _loaded_linear(MergedLinear(k, {"q": 64, "k": 32, "v": 32}),
                          {"q": q, "k": kk, "v": v8}, torch.float32)
    assert fp32.packed is None and torch.equal(fp32.weight, dense)


@pytest.mark.skipif(cpu_ops.load() is None, reason="the compiled CPU kernels are unavailable")
def test_fp32_layer_keeps_only_its_codes_and_multiplies_exactly():
    k = 256
    q = decode_gguf_blocks(synthetic_blocks(GQT.Q4_1, 64, k, 3), GQT.Q4_1, (64, k))
    kk = decode_gguf_blocks(synthetic_blocks(GQT.Q4_K, 32, k, 4), GQT.Q4_K, (32, k))
    dense = torch.cat([q.dequantize(), kk.dequantize(), kk.dequantize()])
    with cpu_ops.building_with(cpu_ops.KernelConfig(activation_quantization="none")):
        layer = _loaded_linear(MergedLinear(k, {"q": 64, "k": 32, "v": 32}),
                               {"q": q, "k": kk, "v": kk}, torch.float32)
    if not cpu_ops.load().exact_linear_vectorized():
        assert layer.packed is None and torch.equal(layer.weight, dense)  # dense is faster
        return
    assert layer.weight is None and isinstance(layer.packed, GroupQuantizedWeight)
    assert torch.equal(layer(torch.eye(k)), dense.t())  # the dense model's weights, exactly
    x = torch.randn(PACKED_MAX_ROWS + 5, k)  # every row count runs on the codes
    # Any fp32 summation order is within k * 2^-24 * sum |x_i w_i| of the exact dot product
    # (the kernel's order is not MKL's: on some CPUs they differ by ~1e-4 relative where the
    # terms cancel, so a plain rtol against x @ W^T is not a bound).
    exact = x.double() @ dense.double().t()
    bound = k * 2.0**-24 * (x.double().abs() @ dense.double().abs().t())
    assert ((layer(x).double() - exact).abs() <= bound).all()
    assert ((x @ dense.t()).double() - exact).abs().le(bound).all()  # the bound holds for MKL


@pytest.mark.skipif(cpu_ops.load() is None, reason="the compiled CPU kernels are unavailable")
@pytest.mark.parametrize("mode,bits", [("auto", 8), ("int16", 16), ("int8", 8)])
def test_fp32_layer_quantizes_its_activations_as_configured(mode, bits):
    """fp32 layers on the codes take int8 activations by default (where the integer kernel is
    vectorized), int16 on request: within that quantization's error of the exact product, and a
    row's result the same bits in any batch."""
    k = 256
    weight = decode_gguf_blocks(synthetic_blocks(GQT.Q4_1, 48, k, 5), GQT.Q4_1, (48, k))
    with cpu_ops.building_with(cpu_ops.KernelConfig(activation_quantization=mode)):
        layer = _loaded_linear(Linear(k, 48), {None: weight}, torch.float32)
    if mode == "auto" and not cpu_ops.load().integer_linear_vectorized():
        assert layer.packed.activation_bits == 32  # the exact mode is faster then
        return
    assert layer.weight is None and layer.packed.activation_bits == bits
    x = torch.randn(PACKED_MAX_ROWS + 5, k, generator=torch.Generator().manual_seed(0))
    y = layer(x)
    exact = x @ weight.dequantize().t()
    error = ((y - exact).abs().max() / exact.abs().max()).item()
    assert error < (1e-4 if bits == 16 else 3e-2), error
    assert torch.equal(layer(x[7:8]), y[7:8]) and torch.equal(layer(x[:3]), y[:3])


def test_real_model_tensors_exact(model_path):
    """Every Q4_1 / Q8_0 matrix of the shipped SmolLM2 file (211 of them, about a second)."""
    from pagedserve.models.gguf_header import read_gguf_header, tensor_data

    header = read_gguf_header(model_path)
    file_data = np.memmap(model_path, mode="r")
    seen = set()
    for tensor in header.tensors:
        if tensor.tensor_type not in PACKABLE_TYPES:
            continue
        seen.add(tensor.tensor_type)
        data = tensor_data(file_data, header.byte_order, tensor)
        weight = decode_gguf_blocks(data, tensor.tensor_type, tuple(reversed(tensor.shape)))
        assert isinstance(weight, GGUFQuantWeight)
        reference = gguf.quants.dequantize(data, tensor.tensor_type)
        np.testing.assert_array_equal(weight.dequantize().numpy(), reference)
    assert seen == {GQT.Q4_1, GQT.Q8_0}


def test_quantization_option_keeps_cuda_dense():
    from pagedserve.config import DeviceConfig

    assert DeviceConfig(dtype="bfloat16", quantization="auto").keeps_weights_packed
    assert DeviceConfig(dtype="float32", quantization="auto").keeps_weights_packed
    assert not DeviceConfig(dtype="float32", quantization="none").keeps_weights_packed
    assert not DeviceConfig(dtype="bfloat16", quantization="none").keeps_weights_packed
    assert not DeviceConfig(device="cuda", quantization="auto").keeps_weights_packed
    assert DeviceConfig(dtype="bfloat16", quantization="int8").quantize_on_load == "int8"
    assert DeviceConfig(dtype="bfloat16", quantization="int4").quantize_on_load == "int4"
    assert DeviceConfig(dtype="float32", quantization="int4").quantize_on_load is None
    assert DeviceConfig(dtype="bfloat16", quantization="auto").quantize_on_load is None
    with pytest.raises(ValueError, match="quantization"):
        DeviceConfig(quantization="int3")


def test_activation_quantization_modes():
    from pagedserve.config import DeviceConfig
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.layers.quantized import activation_bits_for

    class Build:  # a kernels module, as far as activation_bits_for asks
        def __init__(self, vectorized: bool) -> None:
            self.integer_linear_vectorized = lambda: vectorized

    for dtype in (torch.float32, torch.bfloat16):
        for build in (Build(True), Build(False)):
            assert activation_bits_for("none", dtype, build) == 32
            assert activation_bits_for("int16", dtype, build, head=True) == 16
            assert activation_bits_for("int8", dtype, build) == 8
        assert (activation_bits_for("auto", dtype, Build(True)),
                activation_bits_for("auto", dtype, Build(True), head=True)) == (8, 8)
        # MoE experts: no outlier channels reach them, so bf16 keeps int16 there
        expert_bits = 8 if dtype == torch.float32 else 16
        assert activation_bits_for("auto", dtype, Build(True), expert=True) == expert_bits
        assert activation_bits_for("int8", dtype, Build(True), expert=True) == 8
    # fp32 keeps the exact mode where the integer kernel would run its portable loops
    assert activation_bits_for("auto", torch.float32, Build(False), head=True) == 32
    assert activation_bits_for("auto", torch.bfloat16, Build(False), head=True) == 8
    with pytest.raises(ValueError, match="activation quantization"):
        activation_bits_for("int4", torch.float32, Build(True))
    with pytest.raises(ValueError, match="activation_quantization must be one of"):
        DeviceConfig(activation_quantization="fp8")
    config = EngineArgs(activation_quantization="int8").create_engine_config()
    assert config.device.activation_quantization == "int8"


@pytest.mark.parametrize("scheme,levels", [("int4", 15), ("int5", 31), ("int8", 254)])
def test_quantize_on_load_error_is_at_most_half_a_step(scheme, levels):
    torch.manual_seed(0)
    weight = torch.randn(64, 128) * torch.logspace(-3, 1, 64)[:, None]  # rows of many scales
    weight[3, :32] = 0.5  # a constant group: scale 0 must not divide by zero
    codes = quantize_weight(weight, scheme)
    groups = weight.view(64, 4, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / levels if scheme != "int8" else (
        groups.abs().amax(-1) / 127
    )
    error = (codes.dequantize() - weight).abs().view(64, 4, 32)
    assert (error <= step[..., None] / 2 + 1e-6).all()
    assert torch.equal(codes.dequantize()[3, :32], weight[3, :32]) or scheme == "int8"
    assert quantize_weight(torch.randn(8, 48), scheme) is None  # K not a multiple of 32
    # and the int4 kernel reproduces it (bf16 scales): a layer quantized on load
    layer = Linear(128, 64)
    layer.weight.data.copy_(weight)
    layer.process_weights_after_loading(torch.bfloat16, scheme)
    assert layer.weight is None and layer.packed is not None
    x = torch.randn(PACKED_MAX_ROWS + 4, 128).to(torch.bfloat16)  # past the limit: packed still
    expected = x.float() @ codes.dequantize().t()
    assert (layer(x).float() - expected).norm() < 2e-2 * expected.norm()
