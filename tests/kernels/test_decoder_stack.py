"""The compiled decoder stack against the Python modules on the real model (bf16, packed GGUF).

Both run the same kernels in the same order, so greedy tokens and their logprobs must be equal
exactly, not merely close: decode steps of one and of several requests, and speculative
verification steps (several tokens per request, still within FUSED_MAX_TOKENS).
"""

from __future__ import annotations

import pytest

import pagedserve.models.llama as llama_module
from pagedserve.kernels import cpu_ops
from pagedserve.sampling_params import SamplingParams
from tests.prompts import PARITY_PROMPTS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_ops.load() is None, reason="the compiled CPU kernels are unavailable"),
]


def _generate(llm, prompts, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)
    outputs = llm.generate(prompts, params)
    return [
        (out.outputs[0].token_ids, [
            pos[token].logprob for pos, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)
        ])
        for out in outputs
    ]


@pytest.mark.parametrize("num_prompts", [1, 4])
def test_stack_equals_modules(make_llm, monkeypatch, num_prompts):
    # no prefix caching: the second run must compute its prompts exactly as the first did
    llm = make_llm(dtype="bfloat16", enable_prefix_caching=False)
    calls = []
    real_run = llama_module.run_decoder_stack
    monkeypatch.setattr(llama_module, "run_decoder_stack",
                        lambda *args: calls.append(args[1].shape[0]) or real_run(*args))
    prompts = PARITY_PROMPTS[:num_prompts]
    fused = _generate(llm, prompts)
    assert calls and max(calls) <= llama_module.FUSED_MAX_TOKENS  # the stack ran the decodes
    monkeypatch.setattr(llama_module, "FUSED_MAX_TOKENS", 0)
    calls.clear()
    plain = _generate(llm, prompts)
    assert not calls
    assert fused == plain  # (make_llm checks every block is free and every queue empty)


def test_stack_equals_modules_in_speculative_steps(make_llm, monkeypatch):
    llm = make_llm(dtype="bfloat16", enable_prefix_caching=False,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    calls = []
    real_run = llama_module.run_decoder_stack
    monkeypatch.setattr(llama_module, "run_decoder_stack",
                        lambda *args: calls.append(args[1].shape[0]) or real_run(*args))
    prompt = "<|im_start|>user\nRepeat after me: one two three one two three one two three" \
             "<|im_end|>\n<|im_start|>assistant\n"
    fused = _generate(llm, [prompt], max_tokens=40)
    assert any(n > 1 for n in calls)  # verification steps (1 + drafts tokens) ran fused
    monkeypatch.setattr(llama_module, "FUSED_MAX_TOKENS", 0)
    assert _generate(llm, [prompt], max_tokens=40) == fused
