"""Both architectures end to end from a Hugging Face directory, against transformers.

Tiny random llama (with biases) and qwen2 (q/k/v bias, untied head) models are saved with
save_pretrained; the engine loads the directory (config.json, safetensors, tokenizer.json) and its
greedy tokens must equal transformers' generate() on the same weights.
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
}
PROMPTS = [[5, 17, 300, 42], list(range(100, 190)), [7] * 3, list(range(20, 60, 2))]


@pytest.fixture(params=sorted(CONFIGS))
def hf_dir(request, tmp_path, tokenizer):
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer._tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path, model


def test_hf_directory_greedy_matches_transformers(hf_dir):
    from pagedserve.engine.llm import LLM

    path, hf_model = hf_dir
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64,
              max_num_seqs=8)
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
