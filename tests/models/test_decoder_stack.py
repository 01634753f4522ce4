"""The compiled decoder stack against the Python modules on the real model (packed GGUF), in the
CPU's compute dtype (`--dtype auto`: bf16 where the CPU multiplies bf16 natively, fp32 elsewhere),
and past the packed row limit in both dtypes.

Both run the same kernels in the same order, so greedy tokens and their logprobs must be equal
exactly, not merely close: decode steps of one and of several requests, batches past
PACKED_MAX_ROWS (where bf16 layers multiply by their weights dequantized from the codes, in the
stack as in the modules; fp32 ones by their codes), and speculative verification steps (several
tokens per request).
"""

from __future__ import annotations

import pytest

from pagedserve.engine.arg_utils import resolve_dtype
from pagedserve.kernels import cpu_ops
from pagedserve.layers import linear as linear_layers
from pagedserve.models.decoder_stack import FUSED_MAX_TOKENS
from pagedserve.sampling_params import SamplingParams
from tests.prompts import CHAT_QUESTIONS, PARITY_PROMPTS, chat_prompt

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_ops.load() is None, reason="the compiled CPU kernels are unavailable"),
]
COMPUTE_DTYPE = resolve_dtype("auto", "cpu")
"""The dtype this CPU serves in. bf16 on a CPU without native bf16 (AVX2 only) runs the same
stack code emulated, minutes per test: there it is checked once, past the packed row limit."""


def _generate(llm, prompts, max_tokens=24, lora_request=None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)
    outputs = llm.generate(prompts, params, lora_request=lora_request)
    return [
        (out.outputs[0].token_ids, [
            pos[token].logprob for pos, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)
        ])
        for out in outputs
    ]


def _modules_only(llm, monkeypatch) -> None:
    """Turn the stack off for `llm`'s model: every step runs the Python modules."""
    model = llm.engine.executor.worker.model_runner.model.model  # the decoder (StagedDecoder)
    assert model.fused_decoder_layers
    monkeypatch.setattr(model, "fused_decoder_layers", False)


@pytest.mark.parametrize("num_prompts", [1, 4])
def test_stack_equals_modules(make_llm, monkeypatch, stack_calls, num_prompts):
    # no prefix caching: the second run must compute its prompts exactly as the first did
    llm = make_llm(dtype=COMPUTE_DTYPE, enable_prefix_caching=False)
    calls = stack_calls
    prompts = PARITY_PROMPTS[:num_prompts]
    fused = _generate(llm, prompts)
    assert calls and max(calls) <= FUSED_MAX_TOKENS  # the stack ran the decodes
    _modules_only(llm, monkeypatch)
    calls.clear()
    plain = _generate(llm, prompts)
    assert not calls
    assert fused == plain  # (make_llm checks every block is free and every queue empty)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_stack_equals_modules_past_the_packed_row_limit(make_llm, monkeypatch, stack_calls,
                                                        dtype):
    """12 decodes at once, past a PACKED_MAX_ROWS lowered to 8 (the stack serves at most
    FUSED_MAX_TOKENS tokens, fewer than the default): a bf16 layer multiplies by its weights
    dequantized from the codes (the dense product; an fp32 one still by its codes exactly),
    inside the stack as in the modules."""
    monkeypatch.setattr(linear_layers, "PACKED_MAX_ROWS", 8)  # read as the stack is built
    llm = make_llm(dtype=dtype, enable_prefix_caching=False)
    # The session's shared model may hold a stack built with the default: build this test's
    # afresh (and give the earlier one back afterwards).
    monkeypatch.setattr(llm.engine.executor.worker.model_runner.model.model, "_stack", False)
    prompts = [chat_prompt(q) for q in CHAT_QUESTIONS[:12]]
    fused = _generate(llm, prompts, max_tokens=6)
    assert max(stack_calls) == len(prompts) > linear_layers.PACKED_MAX_ROWS
    assert len(prompts) <= FUSED_MAX_TOKENS
    _modules_only(llm, monkeypatch)
    stack_calls.clear()
    assert _generate(llm, prompts, max_tokens=6) == fused
    assert not stack_calls


def test_stack_equals_modules_with_lora_adapters(make_llm, model_path, monkeypatch, stack_calls,
                                                 tmp_path):
    """Steps mixing two adapters and the base run the masked LoRA form inside the stack."""
    from pagedserve.lora import LoRARequest
    from pagedserve.models.loader import load_model_config
    from tests.lora.helpers import write_random_adapter

    config = load_model_config(model_path)
    loras = [LoRARequest(f"a{i}", i + 1, write_random_adapter(
        tmp_path / f"a{i}", config, rank, targets, seed=i, scale=0.08))
        for i, (rank, targets) in enumerate([(8, ["q_proj", "v_proj", "down_proj"]),
                                             (16, ["o_proj", "gate_proj", "up_proj"])])]
    llm = make_llm(dtype=COMPUTE_DTYPE, enable_prefix_caching=False, enable_lora=True, max_loras=2)
    for lora in loras:
        llm.add_lora(lora)  # loaded before: both runs take the same steps
    prompts, per_prompt = PARITY_PROMPTS[:4], [loras[0], None, loras[1], loras[0]]
    fused = _generate(llm, prompts, lora_request=per_prompt)
    assert stack_calls and max(stack_calls) <= FUSED_MAX_TOKENS
    assert fused != _generate(llm, prompts)  # the adapters acted
    _modules_only(llm, monkeypatch)
    stack_calls.clear()
    assert _generate(llm, prompts, lora_request=per_prompt) == fused
    assert not stack_calls


def test_stack_equals_modules_in_speculative_steps(make_llm, monkeypatch, stack_calls):
    llm = make_llm(dtype=COMPUTE_DTYPE, enable_prefix_caching=False,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    calls = stack_calls
    prompt = "<|im_start|>user\nRepeat after me: one two three one two three one two three" \
             "<|im_end|>\n<|im_start|>assistant\n"
    fused = _generate(llm, [prompt], max_tokens=40)
    assert any(n > 1 for n in calls)  # verification steps (1 + drafts tokens) ran fused
    _modules_only(llm, monkeypatch)
    assert _generate(llm, [prompt], max_tokens=40) == fused


def _installed_model(name: str) -> str:
    from pagedserve.models.loader import resolve_model_path

    try:
        return resolve_model_path(name)
    except Exception as e:  # not installed
        pytest.skip(f"{name} is not installed: {e}")


def _dense_linears(llm) -> int:
    """How many of the model's projections hold dense weights (no codes the kernel takes)."""
    from pagedserve.layers.linear import Linear

    model = llm.engine.executor.worker.model_runner.model
    return sum(1 for m in model.modules() if isinstance(m, Linear) and m.packed is None
               and m.weight is not None and "embed" not in type(m).__name__.lower())


@pytest.mark.parametrize("quantization", ["auto", "int8"])
def test_stack_equals_modules_on_qwen(monkeypatch, stack_calls, quantization):
    """Qwen2.5 (q/k/v biases, head_dim 64, untied head), when its chunk packages are installed
    (CI lacks them). Its Q4_K_M file keeps some layers in Q6_K, which the codes' layout does not
    hold: those the stack multiplies dense, as Linear does ("auto"); "int8": every weight
    quantized on load."""
    from pagedserve.engine.llm import LLM

    path = _installed_model("qwen2.5-coder-0.5b")
    llm = LLM(model=path, dtype="bfloat16", quantization=quantization,
              enable_prefix_caching=False, kv_cache_memory="256MiB")
    assert (_dense_linears(llm) > 0) == (quantization == "auto")
    prompts = ["<|im_start|>user\nWrite a Python function that adds two numbers.<|im_end|>\n"
               "<|im_start|>assistant\n", "def fibonacci(n):"]
    fused = _generate(llm, prompts)
    assert stack_calls
    _modules_only(llm, monkeypatch)
    assert _generate(llm, prompts) == fused
    llm.engine.assert_idle()


@pytest.fixture(scope="module")
def tiny_gemma3_wide_window(tmp_path_factory, tokenizer):
    """A tiny Gemma 3 whose window (64) holds the prompts and their tokens: the stack serves."""
    from tests.engine.tiny_models import write_tiny_gemma3

    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3_wide"), tokenizer, sliding_window=64)


@pytest.mark.parametrize(("dtype", "quantization"), [
    ("float32", "auto"),  # dense weights (an HF checkpoint): F.linear
    ("bfloat16", "auto"),  # dense weights: dense_rows (AVX512-BF16), else F.linear
    ("bfloat16", "int8"),  # codes, the GELU gating in one pass
])
def test_stack_equals_modules_on_tiny_gemma3(tiny_gemma3_wide_window, monkeypatch, dtype,
                                             quantization):
    """Gemma 3's block in the stack: four norms in Gemma's form, QK-norm, GELU gating, the
    windowed layer's own rotary table and its own KV cache group (block table and slots); the
    same tokens and logprobs as the modules, exactly."""
    from pagedserve.engine.llm import LLM
    from pagedserve.models import llama as llama_module

    metas = []
    real_run = llama_module.run_decoder_stack
    monkeypatch.setattr(llama_module, "run_decoder_stack",
                        lambda *args: metas.append(args[3]) or real_run(*args))
    llm = LLM(model=tiny_gemma3_wide_window[0], dtype=dtype, quantization=quantization,
              kv_cache_memory="16MiB", max_num_seqs=8, enable_prefix_caching=False)
    assert (_dense_linears(llm) > 0) == (quantization == "auto")
    prompts = [{"prompt_token_ids": p} for p in (list(range(100, 130)), [5, 17, 300, 42] * 5,
                                                  [7] * 3, list(range(20, 45)))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)

    def generate():
        outputs = llm.generate(prompts, params)
        return [(o.outputs[0].token_ids,
                 [pos[t].logprob for pos, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outputs]

    fused = generate()
    assert metas and all(meta.other_groups for meta in metas)  # the windowed layer's own group
    _modules_only(llm, monkeypatch)
    metas.clear()
    assert generate() == fused
    assert not metas
    llm.engine.assert_idle()


def test_stack_equals_modules_on_gemma3(monkeypatch, stack_calls):
    """Gemma-3-270M's Q4_K_M file (Q5_0 and Q8_0 codes, Q6_K dense layers), when its chunk
    packages are installed (CI lacks them)."""
    from pagedserve.engine.llm import LLM

    llm = LLM(model=_installed_model("gemma3-270m"), enable_prefix_caching=False,
              kv_cache_memory="256MiB")
    assert _dense_linears(llm) > 0
    prompts = ["The capital of France is", "Once upon a time"]
    fused = _generate(llm, prompts)
    assert stack_calls
    _modules_only(llm, monkeypatch)
    assert _generate(llm, prompts) == fused
    llm.engine.assert_idle()


def test_gated_product_equals_the_two_steps_on_the_model(make_llm, monkeypatch, stack_calls):
    """The MLP's silu(gate) * up in one pass on the codes (quant_linear_gated) in the stack
    and in the modules, against the two steps (gate_up product, then silu_and_mul): the same
    greedy tokens and logprobs, exactly."""
    from pagedserve.layers.quantized import GroupQuantizedWeight

    llm = make_llm(dtype=COMPUTE_DTYPE, enable_prefix_caching=False)
    gated_calls = []
    one_pass = GroupQuantizedWeight.gated_product

    def counted(layer, x, activation):
        gated_calls.append(x.shape[0])
        return one_pass(layer, x, activation)

    monkeypatch.setattr(GroupQuantizedWeight, "gated_product", counted)
    prompts = PARITY_PROMPTS[:3]
    in_stack = _generate(llm, prompts)
    assert stack_calls  # the stack's decodes, gated inside it
    _modules_only(llm, monkeypatch)
    gated_calls.clear()
    in_modules = _generate(llm, prompts)
    assert gated_calls and max(gated_calls) > 1  # prefill and decode rows, one pass each
    monkeypatch.setattr(linear_layers.MergedLinear, "gated_activation",
                        lambda self, x, activation: None)
    gated_calls.clear()
    two_steps = _generate(llm, prompts)
    assert not gated_calls
    assert in_stack == in_modules == two_steps
