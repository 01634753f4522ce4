"""Gemma 3 against transformers: a tiny random model whose window is shorter than the prompts,
and the real Gemma-3-270M GGUF (slow) on the same dequantized weights, both in fp32."""

from __future__ import annotations

import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from tests.engine.tiny_models import GEMMA3_SLIDING_WINDOW, write_tiny_gemma3

transformers = pytest.importorskip("transformers")

PROMPTS = [list(range(100, 130)), [5, 17, 300, 42] * 10, [7] * 3, list(range(20, 60)),
           list(range(400, 421))]
"""Mostly longer than the window (8): the windowed layer masks, the global one does not."""


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        return hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
        )[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory, tokenizer):
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), tokenizer)


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_tiny_gemma3_greedy_matches_transformers(tiny_gemma3, cpu_kernels):
    from pagedserve.engine.llm import LLM

    path, hf_model = tiny_gemma3
    assert max(map(len, PROMPTS)) > GEMMA3_SLIDING_WINDOW
    llm = LLM(model=path, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=128,
              max_num_seqs=8, cpu_kernels=cpu_kernels)
    model = llm.engine.executor.worker.model_runner.model
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [
        GEMMA3_SLIDING_WINDOW, None]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 12)
    llm.engine.assert_idle()
