"""Mixture-of-experts models (Mixtral, Qwen2-MoE): exactness against a dense model, greedy parity
with transformers, the expert load statistics.

The exactness check needs no checkpoint: a dense tiny Llama's FFN is split along its intermediate
dimension into E experts and routed to all of them with weight exactly 1 (see split_into_experts);
the MoE model's logits must equal the dense model's up to the summation order of the FFN.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    initializer_range=0.3,  # spread logits well apart, so greedy has no near-ties
)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    # layer 1 keeps a dense MLP (mlp_only_layers); norm_topk_prob off, as in Qwen1.5-MoE
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1]),
}
PROMPTS = [[5, 17, 300, 42], list(range(100, 160)), [7] * 3]
MAX_TOKENS = 8
NUM_EXPERTS = 4


def _llm(path, **kwargs):
    from pagedserve.engine.llm import LLM

    return LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB",
               max_num_batched_tokens=64, max_num_seqs=8, **kwargs)


def _greedy(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.assert_idle()
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_moe(request, tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer._tokenizer.save(str(path / "tokenizer.json"))
    return request.param, path, model


def test_greedy_matches_transformers_and_counts_routed_tokens(hf_moe):
    architecture, path, hf_model = hf_moe
    llm = _llm(path, enable_prefix_caching=False)  # every prompt token runs the model once
    engine = llm.engine
    assert engine.config.model.architecture == architecture
    assert not any(sum(counts) for counts in engine.expert_load().values())  # nothing routed yet
    tokens = _greedy(llm)
    for prompt, output in zip(PROMPTS, tokens):
        with torch.inference_mode():
            expected = hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
            )[0, len(prompt):].tolist()
        assert output == expected

    moe = engine.config.model.moe
    load = engine.expert_load()
    sparse_layers = [i for i in range(2) if i not in moe.dense_layers]
    assert sorted(load) == sparse_layers and sparse_layers  # qwen2_moe: layer 1 is dense
    # each prompt token once, then each output token but the last is fed back
    num_tokens = sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)
    for counts in load.values():
        assert len(counts) == moe.num_experts and sum(counts) == num_tokens * moe.num_experts_per_tok
        assert sum(1 for c in counts if c) > moe.num_experts_per_tok  # the router spread them


def test_int4_bf16_runs_the_modules_not_the_decoder_stack(hf_moe):
    """Quantized on load, a Llama's layers would run as one compiled DecoderStack call; the MoE
    block is not in it, so build_decoder_stack declines and the modules run."""
    from pagedserve.engine.llm import LLM

    _, path, _ = hf_moe
    llm = LLM(model=str(path), dtype="bfloat16", quantization="int4", kv_cache_memory="16MiB",
              max_num_batched_tokens=64, max_num_seqs=8)
    tokens = _greedy(llm, PROMPTS[:1], max_tokens=4)
    assert len(tokens[0]) == 4
    model = llm.engine.executor.worker.model.model
    assert model.fused_decoder_layers and model._stack is None  # asked, and declined


# ---- exactness: a dense FFN split into experts ----------------------------------------------


def split_into_experts(dense: dict[str, torch.Tensor], num_layers: int,
                       num_experts: int) -> dict[str, torch.Tensor]:
    """Mixtral weights computing exactly the dense Llama's FFN (up to summation order).

    Expert e holds rows [e * I/E, (e + 1) * I/E) of gate and up and the same columns of down:
    the dense FFN is the sum of the E experts' outputs. A zero router gives every expert
    probability exactly 1/E (E a power of two); top_k = E selects them all, and Mixtral's
    renormalization leaves 1/E. down is stored times E, so each expert's output times 1/E is
    its unscaled output: scaling by a power of two is exact in floating point."""
    split = {name: w for name, w in dense.items() if ".mlp." not in name}
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}"
        gate, up, down = (dense[f"{prefix}.mlp.{name}.weight"]
                          for name in ("gate_proj", "up_proj", "down_proj"))
        width = gate.shape[0] // num_experts
        hidden_size = gate.shape[1]
        moe = f"{prefix}.block_sparse_moe"
        split[f"{moe}.gate.weight"] = torch.zeros(num_experts, hidden_size)
        for e in range(num_experts):
            rows = slice(e * width, (e + 1) * width)
            split[f"{moe}.experts.{e}.w1.weight"] = gate[rows].clone()
            split[f"{moe}.experts.{e}.w3.weight"] = up[rows].clone()
            split[f"{moe}.experts.{e}.w2.weight"] = down[:, rows] * num_experts
    return split


@pytest.fixture(scope="module")
def dense_and_split(tmp_path_factory, tokenizer):
    """A dense tiny Llama directory and its split-FFN Mixtral twin (same tokenizer)."""
    torch.manual_seed(1)
    dense_config = transformers.LlamaConfig(**COMMON, intermediate_size=128,
                                            tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(dense_config, dtype=torch.float32)
    dense_dir = tmp_path_factory.mktemp("dense")
    model.save_pretrained(dense_dir, safe_serialization=True)
    tokenizer._tokenizer.save(str(dense_dir / "tokenizer.json"))

    split_dir = tmp_path_factory.mktemp("split")
    moe_config = transformers.MixtralConfig(
        **COMMON, intermediate_size=128 // NUM_EXPERTS, num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=NUM_EXPERTS, tie_word_embeddings=False,
        rope_theta=dense_config.rope_parameters["rope_theta"],
        architectures=["MixtralForCausalLM"])
    moe_config.save_pretrained(split_dir)
    dense_weights = load_file(str(dense_dir / "model.safetensors"))
    save_file(split_into_experts(dense_weights, COMMON["num_hidden_layers"], NUM_EXPERTS),
              str(split_dir / "model.safetensors"))
    tokenizer._tokenizer.save(str(split_dir / "tokenizer.json"))
    return dense_dir, split_dir


def test_split_ffn_moe_equals_the_dense_model(dense_and_split):
    from pagedserve.models.loader import load_model_config
    from tests.distributed.tiny_llama import PROMPTS as STEP_PROMPTS
    from tests.distributed.tiny_llama import build_model, run_steps

    dense_dir, split_dir = dense_and_split
    rope = [json.loads((d / "config.json").read_text())["rope_parameters"]["rope_theta"]
            for d in (dense_dir, split_dir)]
    assert rope[0] == rope[1]
    models = [build_model(load_model_config(str(d)), load_file(str(d / "model.safetensors")))
              for d in (dense_dir, split_dir)]
    assert models[1].config.moe.num_experts_per_tok == NUM_EXPERTS
    dense_logits, moe_logits = (run_steps(model) for model in models)
    # every token went to every expert: the router acted, in both steps (prefill and decode)
    num_tokens = sum(len(p) for p in STEP_PROMPTS) + len(STEP_PROMPTS)
    assert models[1].expert_load() == {layer: [num_tokens] * NUM_EXPERTS for layer in range(2)}
    np.testing.assert_allclose(moe_logits, dense_logits, rtol=1e-5, atol=2e-5)  # (|logit| < 10)
    assert (moe_logits.argmax(-1) == dense_logits.argmax(-1)).all()

    dense_tokens = _greedy(_llm(dense_dir), max_tokens=12)
    assert _greedy(_llm(split_dir), max_tokens=12) == dense_tokens
