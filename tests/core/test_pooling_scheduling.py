"""Pooling requests in the scheduler, with hand-made runner outputs (no model, no torch): chunked
like any prompt, finished by their vector with every block freed, prefix-cache hits for last
pooling only, and a prompt allowed to fill the context."""

from __future__ import annotations

import pytest

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.outputs import ModelRunnerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.pooling_params import PoolingParams
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
PROMPT = list(range(1, 41))  # 40 tokens: 10 full blocks


def make_scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                     max_model_len=MAX_MODEL_LEN),
                     CacheConfig(block_size=BLOCK_SIZE), num_blocks=40)


def pooling_request(req_id: str, pooling_type: str = "last",
                    prompt: list[int] = PROMPT) -> Request:
    return Request(req_id, list(prompt), None, pooling_params=PoolingParams(pooling_type))


def run_to_completion(scheduler: Scheduler, req_id: str) -> tuple[list[int], list]:
    """Step until `req_id` finishes; the runner pools it once its prompt is scheduled whole.
    Returns the tokens scheduled per step and the finishing outputs."""
    scheduled, request = [], scheduler.requests[req_id]
    while True:
        output = scheduler.schedule()
        scheduled.append(output.num_scheduled_tokens[req_id])
        done = request.num_computed_tokens == request.num_prompt_tokens
        runner_output = ModelRunnerOutput(pooled_outputs={req_id: [0.6, 0.8]} if done else {})
        outputs = scheduler.update_from_output(output, runner_output)
        scheduler.check_integrity()
        if done:
            return scheduled, outputs
        assert outputs == []  # nothing to say mid-prompt


def test_a_pooling_request_is_chunked_then_finished_by_its_vector():
    scheduler = make_scheduler()
    scheduler.add_request(pooling_request("embed"))
    scheduled, [output] = run_to_completion(scheduler, "embed")
    assert scheduled == [16, 16, 8]
    assert output.pooled_output == [0.6, 0.8] and output.new_token_ids == []
    assert output.finish_reason == "stop"
    assert not scheduler.has_unfinished_requests() and not scheduler.requests
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks  # freed at once
    assert scheduler.take_finished_req_ids() == {"embed"}  # the runner drops its state


def test_last_pooling_reuses_the_prefix_cache_and_mean_pooling_never_does():
    scheduler = make_scheduler()
    scheduler.add_request(pooling_request("first"))
    run_to_completion(scheduler, "first")  # its 10 full blocks stay indexed
    scheduler.add_request(pooling_request("last", "last"))
    scheduled, _ = run_to_completion(scheduler, "last")
    assert scheduled == [4]  # 36 tokens hit; the last block is recomputed for its last token
    scheduler.add_request(pooling_request("mean", "mean"))
    scheduled, _ = run_to_completion(scheduler, "mean")
    assert scheduled == [16, 16, 8]  # every position's hidden state is needed


def test_a_pooling_prompt_may_fill_the_context_a_generation_prompt_may_not():
    scheduler = make_scheduler()
    full = list(range(1, MAX_MODEL_LEN + 1))
    scheduler.add_request(pooling_request("fits", prompt=full))
    scheduled, [output] = run_to_completion(scheduler, "fits")
    assert sum(scheduled) == MAX_MODEL_LEN and output.pooled_output is not None
    with pytest.raises(ValueError, match="context length is 64"):
        scheduler.add_request(pooling_request("too-long", prompt=full + [1]))
    with pytest.raises(ValueError, match="at least one token must be generated"):
        scheduler.add_request(Request("gen", full, SamplingParams(max_tokens=1)))


def test_an_aborted_pooling_request_frees_its_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(pooling_request("embed", "mean"))
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput())
    [request] = scheduler.finish_requests(["embed"], RequestStatus.FINISHED_ABORTED)
    assert request.status == RequestStatus.FINISHED_ABORTED
    scheduler.check_integrity()
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
