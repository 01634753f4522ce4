"""Every architecture end to end from a Hugging Face directory, against transformers.

Tiny random llama (with biases), qwen2 (q/k/v bias, untied head), qwen3 (QK-norm, head_dim 32)
and phi3 (fused qkv and gate-up) models, their norms randomized too, are saved with
save_pretrained; the engine loads the directory (config.json, safetensors, tokenizer.json) and
its greedy tokens must equal transformers' generate() on the same weights.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.3,  # spread logits well apart, so greedy has no near-ties
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, attention_bias=True, mlp_bias=True, tie_word_embeddings=True, rope_theta=10000.0
    ),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False),
    # QK-norm, and a head_dim other than hidden / heads (64 / 4)
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
    # fused qkv_proj and gate_up_proj in the checkpoint; a sliding window on every layer,
    # shorter than the longer prompts
    "phi3": lambda: transformers.Phi3Config(
        **COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        sliding_window=16),
}
PROMPTS = [[5, 17, 300, 42], list(range(100, 190)), [7] * 3, list(range(20, 60, 2))]


@pytest.fixture(params=sorted(CONFIGS))
def hf_dir(request, tmp_path, tokenizer):
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at ones: spread them, so a swapped one shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer._tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path, model, request.param


def test_hf_directory_greedy_matches_transformers(hf_dir):
    from pagedserve.engine.llm import LLM

    path, hf_model, architecture = hf_dir
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64,
              max_num_seqs=8)
    model = llm.engine.executor.worker.model_runner.model
    assert model.config.architecture == architecture
    assert (model.model.layers[0].self_attn.q_norm is not None) == (architecture == "qwen3")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs):
        with torch.inference_mode():
            expected = hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=12, min_new_tokens=12, do_sample=False,
            )[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == expected
    llm.engine.assert_idle()
