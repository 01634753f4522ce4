"""The start-up warm-up (engine/warmup.py): it runs real steps on the executor, then leaves no
trace: every block free, the runner holding no request, the counters untouched, and its tokens
never a prefix-cache hit."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.engine.warmup import WARMUP_REQUEST_PREFIX, WarmupPlan
from pagedserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def test_warm_up_runs_steps_and_leaves_no_trace(make_llm):
    llm = make_llm(enable_prefix_caching=True, block_size=16)
    engine = llm.engine
    steps = []
    execute_model = engine.executor.execute_model

    def recording(scheduler_output):
        output = execute_model(scheduler_output)
        steps.append((scheduler_output, output))
        return output

    engine.executor.execute_model = recording
    stats_before = dataclasses.asdict(engine.get_stats())
    engine.warm_up()
    engine.executor.execute_model = execute_model

    plan = WarmupPlan()
    # It acted: two prefills, the batched decodes (each sampling a token for both requests),
    # and the step that releases them.
    assert len(steps) == 2 + plan.num_decode_steps + 1
    decodes = [output for _, output in steps[2:-1]]
    assert all(len(output.sampled_token_ids) == 2 for output in decodes)
    assert all(req_id.startswith(WARMUP_REQUEST_PREFIX) for req_id in decodes[0].sampled_token_ids)
    assert steps[-1][0].finished_req_ids == set(decodes[0].sampled_token_ids)
    # No trace: blocks free and the runner idle (assert_idle), counters as before.
    engine.assert_idle()
    assert dataclasses.asdict(engine.get_stats()) == stats_before

    # The warm-up's own prompt computes in full: its junk KV is never a cache hit.
    warmup_prompt = steps[0][0].scheduled_new_reqs[0].token_ids
    assert len(warmup_prompt) == plan.long_prompt_len
    [output] = llm.generate([{"prompt_token_ids": warmup_prompt}],
                            SamplingParams(temperature=0.0, max_tokens=2))
    assert output.num_cached_tokens == 0
    assert engine.get_stats().prefix_cache_hits == 0


def test_warm_up_skips_a_pool_too_small_for_it(make_llm):
    llm = make_llm(num_gpu_blocks_override=3, block_size=16, max_model_len=32)
    llm.engine.warm_up()  # needs more than 2 usable blocks: skipped, not a failure
    llm.engine.assert_idle()
