"""The real Q4_K_M files (Qwen2.5-Coder-0.5B, Gemma-3-270M) hold their weights once: most of their
matrices are Q5_0, kept as 5-bit codes (layers/quantized.py), so their weights stay within 1.3x
the GGUF's tensor bytes (as 8-bit codes they took 1.55x and 1.52x of them with the rotary
tables, layers/rotary.py, which are not weights). Their Q6_K matrices stay dense in bf16 (the
codes' layout has one scale per 32 elements, Q6_K one per 16): that is what is left above 1x.
Both models come from optional packages; without them the tests skip."""

from __future__ import annotations

import gguf
import pytest

from pagedserve.observability.memory import model_bytes
from pagedserve.sampling_params import SamplingParams

MODELS = ("qwen2.5-coder-0.5b", "gemma3-270m")


def _path(name: str) -> str:
    from pagedserve.models.loader import resolve_model_path

    try:
        return resolve_model_path(name)
    except ValueError as e:  # its packages are not installed
        pytest.skip(str(e))


def _model(llm):
    return llm.engine.executor.worker.model_runner.model


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_k_quant_model_holds_its_weights_once(name):
    from pagedserve.engine.llm import LLM

    path = _path(name)
    llm = LLM(model=name, max_model_len=256, kv_cache_memory="16MiB")
    model = _model(llm)
    layer = model.model.layers[0]
    mlp = layer.mlp
    # Q5_0 gate and up projections: 5-bit codes alone; the Q6_K down projection: dense; Q5_0 q
    # and k beside a Q8_0 v: one 8-bit matrix
    assert mlp.gate_up_proj.weight is None and mlp.gate_up_proj.packed.bits == 5
    assert mlp.down_proj.packed is None and mlp.down_proj.weight is not None
    assert layer.self_attn.qkv_proj.weight is None and layer.self_attn.qkv_proj.packed.bits == 8
    parts = model_bytes(model)
    gguf_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    weights = parts["weights_packed"] + parts["weights_dense"]
    assert weights <= 1.3 * gguf_bytes, (parts, gguf_bytes)
    llm.engine.assert_idle()


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_k_quant_model_exact_mode_is_the_dense_model(name):
    """fp32 on the codes (5-bit, 8-bit and 4-bit) with exact activations computes the dense
    model's products up to summation order: the same greedy tokens as the dequantized model."""
    from pagedserve.engine.llm import LLM

    _path(name)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": ids} for ids in ([2, 651, 6722, 315, 9625, 374],
                                                     [2, 7985, 264, 729, 429, 12341])]
    outputs = {}
    for quantization in ("auto", "none"):
        llm = LLM(model=name, dtype="float32", quantization=quantization,
                  activation_quantization="none", max_model_len=256, kv_cache_memory="16MiB")
        if quantization == "auto":
            assert _model(llm).model.layers[0].mlp.gate_up_proj.packed.bits == 5
        outputs[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.assert_idle()
        del llm
    assert outputs["auto"] == outputs["none"]
