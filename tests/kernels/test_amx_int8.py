"""The int8 matmul on AMX tiles (csrc/amx_int8.h) against the VNNI kernel, bit for bit.

The kernel runs on a tile layer with two forms: the instructions themselves, and a model of what
the instruction set reference says they do. The model runs everywhere the kernel compiles
(AVX512-VNNI builds), so the tiles' layout, shapes and epilogue are tested on CPUs without AMX;
the model's one instruction is tested against torch's integer matmul, and on a CPU with AMX the
hardware against the model and the whole product on the hardware.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_ops
from pagedserve.layers.quantized import GQT, GroupQuantizedWeight, decode_gguf_blocks
from tests.layers.test_quantized import synthetic_blocks

ops = cpu_ops.load()
HAS_TILE_KERNEL = ops is not None and "avx512_vnni" in ops.BUILD_ISA.split()
pytestmark = pytest.mark.skipif(
    not HAS_TILE_KERNEL,
    reason="the tiles' kernel is built with AVX512-VNNI only (its epilogue and activation "
           "layout); this build has none")


def amx_unavailable() -> str:
    """Why the AMX hardware cannot run here ("" where it can), leaving the tiles as they were."""
    before = ops.int8_tiles()
    reason = ops.set_int8_tiles("amx")
    assert ops.set_int8_tiles(before) == ""
    return reason


@pytest.fixture
def use_tiles():
    """use_tiles(mode) for the test; the process's own choice (cpu_ops.load) is restored after."""
    before = ops.int8_tiles()

    def use(mode: str) -> None:
        assert ops.set_int8_tiles(mode) == "", mode
        assert ops.int8_tiles() == mode

    yield use
    assert ops.set_int8_tiles(before) == ""


def vnni_order(b: torch.Tensor) -> torch.Tensor:
    """(8, 64) bytes in VNNI order, b[k // 4][4 n + k % 4] -> the (32, 16) matrix they hold."""
    return b.view(8, 16, 4).permute(0, 2, 1).reshape(32, 16)


@pytest.mark.parametrize("seed", range(4))
def test_the_tile_model_is_the_instruction(seed):
    """TDPBSUD as the kernel configures it: signed bytes (16 x 32) times unsigned bytes (32 x 16
    in VNNI order) summed into int32, the extreme codes included."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (16, 32), dtype=torch.int8, generator=generator)
    b = torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=generator)
    a[0], b[0] = -128, 255
    expected = a.int() @ vnni_order(b).int()
    assert torch.equal(ops.int8_tile_product(a, b, False), expected)
    reason = amx_unavailable()
    if not reason:
        assert torch.equal(ops.int8_tile_product(a, b, True), expected)
    else:
        with pytest.raises(RuntimeError, match="int8_tile_product"):
            ops.int8_tile_product(a, b, True)


def test_the_amx_hardware_gives_the_vnni_kernels_bits(use_tiles):
    reason = amx_unavailable()
    if reason:
        pytest.skip(f"no AMX tiles to run here: {reason}")
    use_tiles("amx")
    check_tiles_against_vnni(GQT.Q4_1, torch.bfloat16, use_tiles, "amx")


def check_tiles_against_vnni(qtype, dtype, use_tiles, mode: str, k: int = 288) -> None:
    """Every output bit of the int8 product on `mode`'s tiles equals the VNNI kernel's: row counts
    below a tile (the VNNI kernel alone), a tile, a padded tile, several chunks of rows; with
    a bias, outlier channels and the gated form."""
    n = 64  # 4 column blocks, 2 per half of the gated form
    weight = decode_gguf_blocks(synthetic_blocks(qtype, n, k, seed=11), qtype, (n, k))
    layer = GroupQuantizedWeight(weight, ops, dtype, 8)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(dtype)
    for outliers in (None, torch.tensor([7, 100, 101, 250])):
        layer.set_outlier_channels(outliers)
        for rows in (15, 16, 17, 40, 130, 300):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
            x[0, :32] = 0  # an all-zero group: scale 0, codes 0
            x[-1, 64:68] = torch.tensor([300.0, -300.0, 1e-3, 0.0])
            x = x.to(dtype)
            args = (x, layer.codes, layer.scales, layer.mins, n, layer.bits, 8)
            extras = (layer.outlier_channels, layer.outlier_weights)
            use_tiles("off")
            plain = ops.quant_linear(*args, None, *extras)
            biased = ops.quant_linear(*args, bias, *extras)
            gated = ops.quant_linear_gated(*args, "silu", *extras)
            use_tiles(mode)
            counted = ops.int8_tile_product_count()
            assert torch.equal(ops.quant_linear(*args, None, *extras), plain), (outliers, rows)
            assert torch.equal(ops.quant_linear(*args, bias, *extras), biased), (outliers, rows)
            assert torch.equal(ops.quant_linear_gated(*args, "silu", *extras), gated), rows
            on_tiles = ops.int8_tile_product_count() - counted
            assert on_tiles == (3 if rows >= 16 else 0), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", [GQT.Q4_1, GQT.Q4_K, GQT.Q5_0, GQT.Q8_0], ids=lambda t: t.name)
def test_the_tile_model_gives_the_vnni_kernels_bits(qtype, dtype, use_tiles):
    check_tiles_against_vnni(qtype, dtype, use_tiles, "model")


def test_tiles_refuse_unknown_modes_and_int16_never_takes_them(use_tiles):
    with pytest.raises(RuntimeError, match="amx, model or off"):
        ops.set_int8_tiles("tmul")
    use_tiles("model")
    k = 64
    weight = decode_gguf_blocks(synthetic_blocks(GQT.Q4_1, 32, k, seed=2), GQT.Q4_1, (32, k))
    layer = GroupQuantizedWeight(weight, ops, torch.float32, 16)
    counted = ops.int8_tile_product_count()
    layer(torch.randn(40, k))
    assert ops.int8_tile_product_count() == counted


def test_the_loader_says_which_tiles_serve(monkeypatch):
    """cpu_ops.load turns the tiles on where the hardware runs them and its check passes, and
    keeps them off with PAGEDSERVE_AMX=0; its start-up line says which, and why not."""
    before = ops.int8_tiles()
    try:
        monkeypatch.setenv("PAGEDSERVE_AMX", "0")
        assert cpu_ops.choose_int8_tiles(ops) == "int8 tiles off (PAGEDSERVE_AMX=0)"
        assert ops.int8_tiles() == "off"
        monkeypatch.delenv("PAGEDSERVE_AMX")
        said = cpu_ops.choose_int8_tiles(ops)
        reason = amx_unavailable()
        if reason:
            assert said == f"no AMX tiles: {reason}" and ops.int8_tiles() == "off"
        else:
            assert said == "int8 matmuls of 16+ rows on AMX tiles" and ops.int8_tiles() == "amx"
    finally:
        assert ops.set_int8_tiles(before) == ""


def test_the_default_model_on_tiles_gives_the_same_tokens_and_logprobs(make_llm, tokenizer,
                                                                        use_tiles):
    """The real default model in bf16 (int8 activations in its layers and head): a prompt of 40
    tokens prefilled on the tiles (the model form here, the hardware on AMX machines), then its
    decode steps on the VNNI kernel; greedy tokens and every logprob equal the run without."""
    from pagedserve.sampling_params import SamplingParams

    prompt = ("The Declaration of Independence was adopted by the Continental Congress on July 4, "
              "1776, and it says that all men are created equal, that")
    ids = tokenizer.encode(prompt)
    assert len(ids) >= 32
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                            detokenize=False)
    llm = make_llm(dtype="bfloat16", activation_quantization="int8")
    runs = {}
    for mode in ("off", amx_mode()):
        use_tiles(mode)
        counted = ops.int8_tile_product_count()
        out = llm.generate([{"prompt_token_ids": ids}], greedy)[0].outputs[0]
        runs[mode] = (out.token_ids, [sorted((t, p.logprob) for t, p in pos.items())
                                      for pos in out.logprobs])
        on_tiles = ops.int8_tile_product_count() - counted
        assert (on_tiles > 0) == (mode != "off"), (mode, on_tiles)
    assert runs["off"] == runs[amx_mode()]


def amx_mode() -> str:
    """The hardware where it runs, else the model."""
    return "model" if amx_unavailable() else "amx"
