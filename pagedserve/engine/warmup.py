"""Start-up warm-up: a few steps of throwaway requests, so that the one-time costs of the first
steps (oneDNN primitives and AMX code, the kernels' first calls, the allocator's first growth) are
paid before the server answers /health, not by the first request.

The steps go straight to the executor, below the scheduler: the scheduler's KV blocks, the prefix
cache, the events and the metrics never see them. They write junk KV into blocks no request holds
(every block stays free; the prefix cache only trusts blocks it hashed itself), and the last step
tells the runner to forget the requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.executor import Executor
from pagedserve.sampling_params import SamplingParams

WARMUP_REQUEST_PREFIX = "pagedserve-warmup-"


@dataclass(frozen=True)
class WarmupPlan:
    """Two requests, so both sampling paths and batched decodes run: a long prompt (the prefill
    path) decoded greedily, and a short one (the small-step path) sampled with top-p."""

    long_prompt_len: int = 48
    short_prompt_len: int = 5
    num_decode_steps: int = 3
    """Decode steps of both requests together, after each has been prefilled alone."""


def warm_up(executor: Executor, config: EngineConfig, num_blocks: int,
            plan: WarmupPlan = WarmupPlan()) -> str:
    """Run `plan`'s steps on the executor; returns what ran, for the start-up log ("" when the
    pool or the step budget is too small for it, which only tests' tiny engines are)."""
    block_size = config.cache.block_size
    vocab_size = config.model.vocab_size
    num_groups = config.model.kv_cache_layout(config.cache.hybrid_kv_cache).num_groups
    long_len = min(plan.long_prompt_len, config.scheduler.max_num_batched_tokens,
                   config.scheduler.max_model_len - plan.num_decode_steps - 1)
    prompt_lens = (long_len, min(plan.short_prompt_len, long_len))
    blocks_needed = [-(-(n + plan.num_decode_steps + 1) // block_size) for n in prompt_lens]
    if long_len < 2 or sum(blocks_needed) > num_blocks - 1:  # block 0 is the null block
        return ""
    req_ids = [f"{WARMUP_REQUEST_PREFIX}{i}" for i in range(len(prompt_lens))]
    params = [SamplingParams(temperature=0.0, max_tokens=plan.num_decode_steps + 1),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=0,
                             max_tokens=plan.num_decode_steps + 1)]
    first_block = 1
    last_tokens: dict[str, int] = {}
    num_computed: dict[str, int] = {}
    for req_id, prompt_len, num_req_blocks, sampling in zip(req_ids, prompt_lens, blocks_needed,
                                                            params):
        # Spread over the vocabulary, deterministic: junk text, real embedding rows.
        token_ids = [(7919 * i + 13) % vocab_size for i in range(prompt_len)]
        # every KV cache group in the same blocks: the KV is junk either way
        new = NewRequestData(req_id, token_ids, prompt_len, sampling,
                             (list(range(first_block, first_block + num_req_blocks)),)
                             * num_groups, 0)
        first_block += num_req_blocks
        output = executor.execute_model(SchedulerOutput(
            [new], CachedRequestData(), {req_id: prompt_len}, prompt_len, set(),
            num_prefill_requests=1, num_prefill_tokens=prompt_len))
        last_tokens[req_id] = output.sampled_token_ids[req_id][-1]
        num_computed[req_id] = prompt_len
    for _ in range(plan.num_decode_steps):  # both requests decode together
        cached = CachedRequestData(
            req_ids=list(req_ids), new_block_ids=[([],) * num_groups for _ in req_ids],
            num_computed_tokens=[num_computed[r] for r in req_ids],
            new_token_ids=[[last_tokens[r]] for r in req_ids])
        output = executor.execute_model(SchedulerOutput(
            [], cached, {r: 1 for r in req_ids}, len(req_ids), set()))
        for req_id in req_ids:
            last_tokens[req_id] = output.sampled_token_ids[req_id][-1]
            num_computed[req_id] += 1
    executor.execute_model(SchedulerOutput.empty(set(req_ids)))  # the runner forgets them
    return (f"prefills of {prompt_lens[0]} and {prompt_lens[1]} tokens, "
            f"{plan.num_decode_steps} decode steps of batch {len(req_ids)}")
