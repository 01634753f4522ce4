"""The engine against Hugging Face transformers on the real default model (fp32, same weights).

Greedy tokens must match; where they diverge, each side's token must be in the other's top-5.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from tests.prompts import PARITY_PROMPTS

NUM_NEW_TOKENS = 32
TOP_N = 5


@pytest.fixture(scope="module")
def hf_model(model_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
    )
    return model.eval()


def hf_greedy(hf_model, prompt_ids: list[int]) -> tuple[list[int], list[set[int]]]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            max_new_tokens=NUM_NEW_TOKENS,
            min_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    top = [set(step[0].topk(TOP_N).indices.tolist()) for step in out.logits]
    return tokens, top


def test_greedy_matches_transformers(make_llm, tokenizer, hf_model):
    prompt_ids = [tokenizer.encode(p) for p in PARITY_PROMPTS]
    lengths = sorted(len(ids) for ids in prompt_ids)
    assert lengths[0] <= 6 and lengths[-1] >= 1400 and lengths[-1] <= 1500, lengths
    llm = make_llm()
    params = SamplingParams(
        temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS, logprobs=TOP_N
    )
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)

    num_diverged = 0
    for ids, output in zip(prompt_ids, outputs):
        ours = output.outputs[0].token_ids
        theirs, their_top = hf_greedy(hf_model, ids)
        assert len(ours) == len(theirs) == NUM_NEW_TOKENS
        if ours == theirs:
            continue
        num_diverged += 1
        # Past the first difference the contexts differ; judge that position only.
        pos = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        our_top = set(output.outputs[0].logprobs[pos])
        assert theirs[pos] in our_top, f"HF token {theirs[pos]} not in our top-{TOP_N} at {pos}"
        assert ours[pos] in their_top[pos], f"our token {ours[pos]} not in HF top-{TOP_N} at {pos}"
    print(f"\n{num_diverged} of {len(prompt_ids)} prompts diverged from transformers")
    assert num_diverged == 0
