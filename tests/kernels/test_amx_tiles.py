"""The AMX tile kernels (csrc/amx_tiles.h) against the AVX-512 kernels they replace: the int8
matmul (amx_int8.h) bit for bit, the bf16 flash prefill (amx_flash.h) to rounding.

The kernels run on a tile layer with two forms: the instructions themselves, and a model of what
the instruction set reference says they do. The model runs everywhere the kernels compile
(AVX512-VNNI and AVX512-BF16 builds), so the tiles' layouts, shapes and epilogues are tested on
CPUs without AMX; the model's instructions are tested against torch's matmuls, and on a CPU with
AMX the hardware against the model and the whole kernels on the hardware.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_ops
from pagedserve.layers.quantized import GQT, GroupQuantizedWeight, decode_gguf_blocks
from tests.layers.test_quantized import synthetic_blocks

ops = cpu_ops.load()
HAS_TILE_KERNELS = ops is not None and {"avx512_vnni", "avx512_bf16"} <= set(ops.BUILD_ISA.split())
pytestmark = pytest.mark.skipif(
    not HAS_TILE_KERNELS,
    reason="the tile kernels are built with AVX512-VNNI and AVX512-BF16 only (the forms whose "
           "epilogues and layouts they share); this build lacks them")


def amx_unavailable() -> str:
    """Why the AMX hardware cannot run here ("" where the CPU and Linux allow it). Where it can,
    the kernels' checks against their AVX-512 forms must pass: set_tiles("amx") says nothing."""
    reason = ops.amx_unavailable_reason()
    if not reason:
        before = ops.tiles()
        assert ops.set_tiles("amx") == ""
        assert ops.set_tiles(before) == ""
    return reason


@pytest.fixture
def use_tiles():
    """use_tiles(mode) for the test; the process's own choice (cpu_ops.load) is restored after."""
    before = ops.tiles()

    def use(mode: str) -> None:
        assert ops.set_tiles(mode) == "", mode
        assert ops.tiles() == mode

    yield use
    assert ops.set_tiles(before) == ""


def vnni_order(b: torch.Tensor) -> torch.Tensor:
    """(8, 64) bytes in VNNI order, b[k // 4][4 n + k % 4] -> the (32, 16) matrix they hold."""
    return b.view(8, 16, 4).permute(0, 2, 1).reshape(32, 16)


def tile_calls(kernel: str) -> int:
    return ops.tile_call_counts()[kernel]


@pytest.mark.parametrize("seed", range(4))
def test_the_tile_model_is_the_int8_instruction(seed):
    """TDPBSUD as the matmul configures it: signed bytes (16 x 32) times unsigned bytes (32 x 16
    in VNNI order) summed into int32, the extreme codes included."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (16, 32), dtype=torch.int8, generator=generator)
    b = torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=generator)
    a[0], b[0] = -128, 255
    expected = a.int() @ vnni_order(b).int()
    assert torch.equal(ops.tile_product(a, b, "int8", False), expected)
    reason = amx_unavailable()
    if not reason:
        assert torch.equal(ops.tile_product(a, b, "int8", True), expected)
    else:
        with pytest.raises(RuntimeError, match="tile_product"):
            ops.tile_product(a, b, "int8", True)


@pytest.mark.parametrize("seed", range(4))
def test_the_tile_model_is_the_bf16_instruction(seed):
    """TDPBF16PS as the flash prefill configures it: bf16 (16 x 32) times bf16 pairs (32 x 16,
    b[k // 2][2n + k % 2]) summed in fp32; each product exact, so the sums are torch's fp64
    product to fp32 rounding. On AMX machines the hardware equals the model to that rounding."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(16, 32, generator=generator).bfloat16()
    b = torch.randn(16, 32, generator=generator).bfloat16()
    a[1, 3] = 1e-40  # a subnormal input counts as zero
    pairs = b.view(16, 16, 2).permute(0, 2, 1).reshape(32, 16)
    expected = a.double().masked_fill(a.double().abs() < 1e-38, 0) @ pairs.double()
    model = ops.tile_product(a, b, "bf16", False)
    torch.testing.assert_close(model.double(), expected, rtol=0, atol=1e-5)
    if not amx_unavailable():
        hardware = ops.tile_product(a, b, "bf16", True)
        torch.testing.assert_close(hardware, model, rtol=0, atol=1e-5)


def test_the_amx_hardware_matmul_gives_the_vnni_kernels_bits(use_tiles):
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
            counted = tile_calls("int8_matmul")
            assert torch.equal(ops.quant_linear(*args, None, *extras), plain), (outliers, rows)
            assert torch.equal(ops.quant_linear(*args, bias, *extras), biased), (outliers, rows)
            assert torch.equal(ops.quant_linear_gated(*args, "silu", *extras), gated), rows
            on_tiles = tile_calls("int8_matmul") - counted
            assert on_tiles == (3 if rows >= 16 else 0), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", [GQT.Q4_1, GQT.Q4_K, GQT.Q5_0, GQT.Q8_0], ids=lambda t: t.name)
def test_the_tile_model_matmul_gives_the_vnni_kernels_bits(qtype, dtype, use_tiles):
    check_tiles_against_vnni(qtype, dtype, use_tiles, "model")


def test_tiles_refuse_unknown_modes_and_int16_never_takes_them(use_tiles):
    with pytest.raises(RuntimeError, match="amx, model or off"):
        ops.set_tiles("tmul")
    use_tiles("model")
    k = 64
    weight = decode_gguf_blocks(synthetic_blocks(GQT.Q4_1, 32, k, seed=2), GQT.Q4_1, (32, k))
    layer = GroupQuantizedWeight(weight, ops, torch.float32, 16)
    counted = tile_calls("int8_matmul")
    layer(torch.randn(40, k))
    assert tile_calls("int8_matmul") == counted


def test_the_loader_says_which_tiles_serve(monkeypatch):
    """cpu_ops.load turns the tiles on where the hardware runs them and its check passes, and
    keeps them off with PAGEDSERVE_AMX=0; its start-up line says which, and why not."""
    before = ops.tiles()
    try:
        monkeypatch.setenv("PAGEDSERVE_AMX", "0")
        assert cpu_ops.choose_tiles(ops) == "AMX tiles off (PAGEDSERVE_AMX=0)"
        assert ops.tiles() == "off"
        monkeypatch.delenv("PAGEDSERVE_AMX")
        said = cpu_ops.choose_tiles(ops)
        reason = amx_unavailable()
        if reason:
            assert said == f"no AMX tiles: {reason}" and ops.tiles() == "off"
        else:
            assert said.startswith("AMX tiles for int8 matmuls") and ops.tiles() == "amx"
    finally:
        assert ops.set_tiles(before) == ""


def test_the_default_model_on_tiles_gives_the_same_tokens_and_logprobs(make_llm, tokenizer,
                                                                        use_tiles):
    """The real default model in bf16 (int8 activations in its layers and head): a prompt of
    17-32 tokens prefilled with its matmuls on the tiles (the model form here, the hardware on
    AMX machines; attention on the decode kernel, which takes chunks of up to 32 queries), then
    its decode steps on the VNNI kernel; greedy tokens and every logprob equal the run without."""
    from pagedserve.sampling_params import SamplingParams

    ids = tokenizer.encode("The Declaration of Independence was adopted by the Continental "
                           "Congress on July 4, 1776, and it says that")
    assert 16 < len(ids) <= 32, len(ids)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                            detokenize=False)
    # no prefix cache: the second run prefills the prompt again
    llm = make_llm(dtype="bfloat16", activation_quantization="int8", enable_prefix_caching=False)
    runs = {}
    for mode in ("off", amx_mode()):
        use_tiles(mode)
        counted = tile_calls("int8_matmul"), tile_calls("flash_prefill")
        out = llm.generate([{"prompt_token_ids": ids}], greedy)[0].outputs[0]
        runs[mode] = (out.token_ids, [sorted((t, p.logprob) for t, p in pos.items())
                                      for pos in out.logprobs])
        assert (tile_calls("int8_matmul") > counted[0]) == (mode != "off"), mode
        assert tile_calls("flash_prefill") == counted[1]
    assert runs["off"] == runs[amx_mode()]


def amx_mode() -> str:
    """The hardware where it runs, else the model."""
    return "model" if amx_unavailable() else "amx"


def reference_prefill(q, key_cache, value_cache, block_ids, context_len, scale, key_scale=None,
                      value_scale=None):
    """One request's chunk (T, H, D) against its cached keys, causal, in fp64."""
    tokens, heads, d = q.shape
    kv_heads, _, block_size, _ = key_cache.shape
    positions = torch.arange(context_len + tokens)
    slots = block_ids[positions // block_size] * block_size + positions % block_size
    keys = key_cache.reshape(kv_heads, -1, d)[:, slots].double()
    values = value_cache.reshape(kv_heads, -1, d)[:, slots].double()
    if key_scale is not None:  # a quantized cache: codes times their row's scale, as bf16
        keys = (keys * key_scale.reshape(kv_heads, -1)[:, slots, None].double()).bfloat16().double()
        values = (values * value_scale.reshape(kv_heads, -1)[:, slots, None].double()
                  ).bfloat16().double()
    group = heads // kv_heads
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = torch.einsum("thd,hsd->hts", q.double(), keys) * scale
    visible = positions[None, :] <= (context_len + torch.arange(tokens))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hts,hsd->thd", scores.softmax(-1), values)


def prefill_case(seed: int, tokens: int, context_len: int, heads: int, kv_heads: int, d: int,
                 kv_dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    block_size = 16
    blocks = (context_len + tokens + block_size - 1) // block_size + 3
    q = torch.randn(tokens, heads, d, generator=generator).bfloat16()
    shape = (kv_heads, blocks, block_size, d)
    block_ids = torch.randperm(blocks, generator=generator)  # scattered, as a pool's
    if kv_dtype == torch.int8:
        caches = [torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)
                  for _ in range(2)]
        scales = [(torch.rand(shape[:3], generator=generator) / 60 + 1e-3).half()
                  for _ in range(2)]
    else:
        caches = [torch.randn(shape, generator=generator).bfloat16() for _ in range(2)]
        scales = [None, None]
    return q, caches[0], caches[1], block_ids, context_len, d**-0.5, scales[0], scales[1]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (14, 2, 64), (4, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("tokens,context_len", [(40, 0), (33, 50), (100, 17)])
def test_the_tile_model_flash_prefill_matches_the_reference(use_tiles, tokens, context_len, heads,
                                                            kv_heads, d, kv_dtype):
    """The flash prefill on the tiles' model: the real models' head shapes (SmolLM2, Qwen 0.5B,
    a 128-dim head, Gemma 3's 256), chunks with a padded last pass of 16 tokens and odd step
    ends, bf16 and int8 caches; within bf16 rounding of the fp64 reference, and as near it as
    the AVX512-BF16 kernel."""
    case = prefill_case(tokens + d, tokens, context_len, heads, kv_heads, d, kv_dtype)
    expected = reference_prefill(*case)
    args = case[:6]
    kwargs = {"key_scale": case[6], "value_scale": case[7]}
    use_tiles("off")
    avx512 = ops.prefill_attention(*args, **kwargs).double()
    use_tiles("model")
    counted = tile_calls("flash_prefill")
    tiled = ops.prefill_attention(*args, **kwargs).double()
    assert tile_calls("flash_prefill") == counted + 1
    torch.testing.assert_close(tiled, expected, rtol=0, atol=2e-2)
    tile_error = (tiled - expected).abs().max().item()
    avx512_error = (avx512 - expected).abs().max().item()
    assert tile_error <= 1.5 * avx512_error + 1e-3, (tile_error, avx512_error)


def test_a_token_gets_the_same_bits_in_any_chunk_on_tiles(use_tiles):
    """A row's result on the tiles depends on its own query and keys alone: the last 20 tokens
    of a 60-token chunk equal themselves computed as a chunk of their own after 40 more cached
    keys (other tile rows, other passes)."""
    use_tiles("model")
    q, key_cache, value_cache, block_ids, context_len, scale, _, _ = prefill_case(
        3, 60, 10, 6, 2, 64)
    whole = ops.prefill_attention(q, key_cache, value_cache, block_ids, context_len, scale)
    tail = ops.prefill_attention(q[40:].contiguous(), key_cache, value_cache, block_ids,
                                 context_len + 40, scale)
    assert torch.equal(whole[40:], tail)


def test_the_amx_hardware_flash_prefill_matches_the_reference(use_tiles):
    reason = amx_unavailable()
    if reason:
        pytest.skip(f"no AMX tiles to run here: {reason}")
    use_tiles("amx")
    case = prefill_case(1, 100, 37, 9, 3, 64)
    tiled = ops.prefill_attention(*case[:6]).double()
    torch.testing.assert_close(tiled, reference_prefill(*case), rtol=0, atol=2e-2)


def test_the_benches_compare_the_tiles_with_this_build_untiled(use_tiles, capsys):
    """`bench matmul --compare-tiles` and `bench attention --compare-tiles` time this build with
    the tiles (the model here) beside a copy of it with them off, and check the matmul's bits;
    their figures are timings, so only their presence is checked."""
    from pagedserve.entrypoints.cli import build_parser

    use_tiles("off")
    parser = build_parser()
    matmul_args = ["bench", "matmul", "--shapes", "32x64", "--rows", "16", "--iterations", "1",
                   "--compare-tiles"]
    with pytest.raises(RuntimeError, match="tiles are off"):
        parser.parse_args(matmul_args).func(parser.parse_args(matmul_args))
    use_tiles("model")
    for argv in (matmul_args, ["bench", "attention", "--dtype", "bfloat16", "--cases", "40+8",
                               "--iterations", "1", "--compare-tiles"]):
        args = parser.parse_args(argv)
        assert args.func(args) == 0
        table = capsys.readouterr().out.splitlines()
        assert "tiles model" in table[0], table
        assert ("base int8 / int8" if argv[1] == "matmul" else "untiled / kernel") in table[1]
        assert len(table) == 3 and table[2].split()[:2] == (["32", "x"] if argv[1] == "matmul"
                                                           else ["40", "8"])


def test_the_default_model_with_flash_prefill_on_tiles_keeps_its_quality(make_llm, tokenizer,
                                                                         use_tiles):
    """The real default model in bf16 over a 120-token text (its attention on the flash prefill,
    on the tiles' model here): its teacher-forced logprobs stay as near the exact fp32 engine's
    as the AVX-512 kernel's do. (The two kernels round differently, and a bf16 model carries any
    such difference on: they differ from each other by about as much as either does from fp32.)"""
    from pagedserve.benchmarks.perplexity import teacher_forced_logprobs

    with open("tests/data/gettysburg_address.txt", encoding="utf-8") as text:
        ids = tokenizer.encode(text.read())[:120]
    exact = teacher_forced_logprobs(
        make_llm(dtype="float32", activation_quantization="none"), [ids], [1])[0]
    llm = make_llm(dtype="bfloat16", enable_prefix_caching=False)
    drift = {}
    for mode in ("off", amx_mode()):
        use_tiles(mode)
        counted = tile_calls("flash_prefill")
        forced = teacher_forced_logprobs(llm, [ids], [1])[0]
        assert (tile_calls("flash_prefill") > counted) == (mode != "off"), mode
        drift[mode] = sum(abs(a - b) for a, b in zip(forced, exact)) / len(exact)
    print(f"\nmean |logprob - exact fp32| over {len(exact)} tokens: {drift}")
    assert drift[amx_mode()] <= 1.5 * drift["off"] + 0.01, drift
