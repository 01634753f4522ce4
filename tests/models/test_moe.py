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
from tests.models.gguf_writing import add_byte_vocabulary, add_shape_metadata, quantized_round_trip

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
        **COMMON, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[1]),
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
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
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
        assert len(counts) == moe.num_experts
        assert sum(counts) == num_tokens * moe.num_experts_per_tok
        assert sum(1 for c in counts if c) > moe.num_experts_per_tok  # the router spread them


@pytest.mark.parametrize("hf_moe", ["mixtral"], indirect=True)
def test_tensor_parallel_equals_one_process(hf_moe):
    """TP=2 (worker processes; every expert's intermediate dimension split): the same greedy
    tokens, and the same expert load, counted once although both ranks route every token."""
    _, path, _ = hf_moe
    llm = _llm(path, enable_prefix_caching=False)
    expected = _greedy(llm)
    expected_load = llm.engine.expert_load()
    llm_tp = _llm(path, enable_prefix_caching=False, tensor_parallel_size=2)
    try:
        assert _greedy(llm_tp) == expected
        assert llm_tp.engine.expert_load() == expected_load
    finally:
        llm_tp.engine.shutdown()


def test_lora_on_an_moe_model_is_refused_at_start_up(hf_moe):
    from pagedserve.engine.arg_utils import EngineArgs

    architecture, path, _ = hf_moe
    with pytest.raises(ValueError, match=f"mixture-of-experts model \\({architecture}\\)"):
        EngineArgs(model=str(path), enable_lora=True).create_engine_config()


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


# ---- GGUF: expert tensors stacked per layer, quantized ---------------------------------------

GGUF_ARCHITECTURES = {"mixtral": "llama", "qwen2_moe": "qwen2moe"}
"""Ours -> llama.cpp's: a Mixtral GGUF says "llama" and carries expert tensors."""
_GGUF_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def write_moe_gguf(path, architecture: str, hf_model, expert_qtype: str = "Q8_0"
                   ) -> dict[str, torch.Tensor]:
    """`hf_model` (transformers' names and stacked experts) as llama.cpp writes it: q/k rows
    permuted for "llama", the stacked experts in `expert_qtype`, a byte-level vocabulary.
    Returns the weights it holds, dequantized, under transformers' names (the reference)."""
    import gguf

    config = hf_model.config
    gguf_arch = GGUF_ARCHITECTURES[architecture]
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    add_shape_metadata(writer, config)
    writer.add_vocab_size(config.vocab_size)
    add_byte_vocabulary(writer, config.vocab_size)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if architecture == "mixtral":
        writer.add_expert_count(config.num_local_experts)
        writer.add_feed_forward_length(config.intermediate_size)
    else:
        writer.add_expert_count(config.num_experts)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    reference = {}
    head_dim = config.hidden_size // config.num_attention_heads

    def permute(weight, num_heads):  # llama.cpp's converter: the inverse of _unpermute_rope_rows
        rows = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
        return rows.swapaxes(1, 2).reshape(weight.shape)

    for name, weight in hf_model.state_dict().items():
        weight = weight.detach().float().contiguous()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight",
                         "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
            writer.add_tensor(gguf_name, weight.numpy())
            reference[name] = weight
            continue
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if module == "mlp.experts":  # gate_up_proj (E, 2I, H) or down_proj (E, H, I)
            halves = ({"ffn_gate_exps": weight.chunk(2, dim=1)[0],
                       "ffn_up_exps": weight.chunk(2, dim=1)[1]} if kind == "gate_up_proj"
                      else {"ffn_down_exps": weight})
            values = []
            for gguf_module, half in halves.items():
                qtype = gguf.GGMLQuantizationType[expert_qtype]
                codes, dequantized = quantized_round_trip(half.contiguous().numpy(), qtype)
                writer.add_tensor(f"blk.{layer}.{gguf_module}.weight", codes, raw_dtype=qtype)
                values.append(torch.from_numpy(dequantized.copy()))
            reference[name] = torch.cat(values, dim=1)
            continue
        reference[name] = weight
        if gguf_arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = (config.num_attention_heads if module == "self_attn.q_proj"
                     else config.num_key_value_heads)
            weight = permute(weight, heads)
        if module == "mlp.shared_expert_gate":
            weight = weight.reshape(-1)  # llama.cpp keeps this (1, H) gate as (H,)
        writer.add_tensor(f"blk.{layer}.{_GGUF_BLOCK_NAMES[module]}.{kind}", weight.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


@pytest.mark.parametrize("architecture", sorted(GGUF_ARCHITECTURES))
def test_gguf_experts_load_like_the_hf_weights(tmp_path, architecture):
    """A GGUF's stacked, quantized expert tensors load (dequantized, split per expert) into the
    same model as transformers' weights of the same values: equal logits."""
    from pagedserve.models import get_model_class
    from pagedserve.models.gguf_loader import iter_gguf_weights, load_gguf_config
    from tests.distributed.tiny_llama import build_model, run_steps

    torch.manual_seed(2)
    hf_config = CONFIGS[architecture]()
    hf_config.mlp_only_layers = []  # llama.cpp's Qwen2-MoE has experts in every layer
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    path = tmp_path / "moe.gguf"
    reference_weights = write_moe_gguf(path, architecture, hf_model)

    config = load_gguf_config(str(path))
    assert config.architecture == architecture
    assert config.moe.num_experts == (hf_config.num_local_experts if architecture == "mixtral"
                                      else hf_config.num_experts)
    assert config.moe.norm_topk_prob == (architecture == "mixtral")
    assert config.qkv_bias == (architecture == "qwen2_moe")
    from_gguf = get_model_class(config.architecture)(config, torch.float32)
    from_gguf.load_weights(iter_gguf_weights(str(path), torch.float32))
    from_gguf.eval()
    expected = run_steps(build_model(config, reference_weights))
    np.testing.assert_array_equal(run_steps(from_gguf), expected)


@pytest.mark.parametrize("expert_qtype", ["Q8_0", "Q4_0", "Q5_0"])
def test_gguf_experts_run_on_their_codes(tmp_path, expert_qtype):
    """Served from a GGUF in fp32 (--quantization auto), every expert multiplies by its codes,
    exactly (the dequantized values, fp32 sums), with no stacked dense copy kept: the greedy
    tokens and the expert load equal those of the same file dequantized (--quantization none),
    both with exact activations (--activation-quantization none)."""
    from pagedserve.engine.llm import LLM
    from pagedserve.kernels import cpu_ops
    from pagedserve.layers.moe import FusedExperts

    ops = cpu_ops.load()
    if ops is None or not ops.exact_linear_vectorized():
        pytest.skip("fp32 runs on codes only with the compiled kernels' vectorized exact path "
                    "(this build has none): the experts stay dense")
    torch.manual_seed(3)
    hf_model = transformers.AutoModelForCausalLM.from_config(CONFIGS["mixtral"](),
                                                             dtype=torch.float32)
    path = tmp_path / "moe.gguf"
    write_moe_gguf(path, "mixtral", hf_model, expert_qtype)
    tokens, expert_load = {}, {}
    for quantization in ("auto", "none"):
        llm = _llm(path, quantization=quantization, enable_prefix_caching=False,
                   activation_quantization="none")
        model = llm.engine.executor.worker.model_runner.model
        experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
        assert len(experts) == 2
        for module in experts:
            packed = quantization == "auto"
            assert (module.packed_gate_up is not None) == packed
            assert (module.gate_up_proj is None) == packed and (module.down_proj is None) == packed
        tokens[quantization] = _greedy(llm)
        expert_load[quantization] = llm.engine.expert_load()
    assert all(sum(counts) for counts in expert_load["auto"].values())  # the experts ran
    assert expert_load["auto"] == expert_load["none"]
    assert tokens["auto"] == tokens["none"]


@pytest.mark.parametrize("expert_qtype", ["Q4_0", "Q8_0"])
def test_packed_experts_in_bf16_track_the_dense_experts(expert_qtype):
    """bf16: experts on their codes (the int16-activation kernel, or torch's int4 one) against
    the same values stacked dense, on the same routed rows: one row per expert (decode) and many
    (prefill). Within bf16's rounding of the outputs; the routing is the caller's, so equal."""
    import gguf

    from pagedserve.layers.moe import FusedExperts
    from pagedserve.layers.quantized import decode_gguf_blocks

    torch.manual_seed(4)
    num_experts, hidden, intermediate = 4, 64, 64
    qtype = gguf.GGMLQuantizationType[expert_qtype]
    codes = {}
    for expert in range(num_experts):
        for shard, shape in (("gate", (intermediate, hidden)), ("up", (intermediate, hidden)),
                             ("down", (hidden, intermediate))):
            raw, _ = quantized_round_trip(torch.randn(shape).mul(0.2).numpy(), qtype)
            codes[expert, shard] = decode_gguf_blocks(raw, qtype, shape)
    modules = {}
    for form, dtype in (("codes", torch.bfloat16), ("dense", torch.bfloat16),
                        ("fp32 reference", torch.float32)):
        module = FusedExperts(num_experts, hidden, intermediate, kernels=None)
        for (expert, shard), weight in codes.items():
            module.load("experts", shard, weight if form == "codes" else weight.dequantize(),
                        expert)
        module.process_weights_after_loading(dtype)
        modules[form] = module.to(dtype)
    assert modules["codes"].packed_gate_up is not None and modules["codes"].gate_up_proj is None
    assert modules["dense"].packed_gate_up is None
    for num_tokens in (1, 3, 48):
        hidden_states = torch.randn(num_tokens, hidden).to(torch.bfloat16)
        weights = torch.rand(num_tokens, 2).softmax(-1)
        expert_ids = torch.stack([torch.randperm(num_experts)[:2] for _ in range(num_tokens)])
        counts = torch.bincount(expert_ids.flatten(), minlength=num_experts).tolist()
        reference = modules["fp32 reference"](hidden_states.float(), weights, expert_ids, counts)
        errors = {form: (modules[form](hidden_states, weights, expert_ids, counts).float()
                         - reference).abs().max().item() for form in ("codes", "dense")}
        # As close to the exact values as dense bf16 is (both round each matmul's output to
        # bf16), give or take one bf16 step of the largest output.
        one_step = reference.abs().max().item() * 2**-8
        assert errors["codes"] <= errors["dense"] + one_step, (num_tokens, errors)


def test_debug_experts_route_reports_the_engine_expert_load():
    import asyncio

    from fastapi import FastAPI

    from pagedserve.entrypoints.openai.debug_routes import add_debug_routes
    from pagedserve.observability.timeline import TimelineStore

    class FakeAsyncLLM:
        async def expert_load(self) -> dict[int, list[int]]:
            return {0: [3, 1, 0, 4], 2: [2, 2, 2, 2]}

    app = FastAPI()
    add_debug_routes(app, FakeAsyncLLM(), TimelineStore())
    route = next(r for r in app.routes if getattr(r, "path", None) == "/debug/experts")
    body = json.loads(asyncio.run(route.endpoint()).body)
    assert body == {"object": "expert_load", "layers": [
        {"layer": 0, "expert_tokens": [3, 1, 0, 4]}, {"layer": 2, "expert_tokens": [2, 2, 2, 2]}]}
