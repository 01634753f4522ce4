"""Randomized scheduling on a tiny pool: every invariant after every step, outputs as if alone.

Random arrivals, prompt lengths, max_tokens, priorities, cache salts, aborts and shared prefixes
on 23 usable blocks of 4 tokens force chunking, prefix hits and preemptions together. The fake
runner (see test_scheduler.py) checks every KV read, and each request's output must equal what
the fake model gives it alone on a big pool. With speculation on, the fake runner proposes random
drafts (some right, some wrong) and the outputs must still be those of the plain run alone. With
async scheduling, each step is scheduled before the previous one's results are applied (output
placeholders), and the outputs must still be the same. With windowed layers, each layer in its
own KV cache group, the windows let go of blocks as requests run, and the outputs must be those
of one group that keeps every block.
"""

from __future__ import annotations

import random

import pytest

from pagedserve.request import Request, RequestStatus
from tests.core.test_scheduler import Harness, make_request, run_alone

BLOCK_SIZE = 4
NUM_BLOCKS = 24  # 23 usable: a single request may hold at most 92 tokens of KV
MAX_MODEL_LEN = 64
MAX_STEPS = 3000


def random_config(rng: random.Random) -> dict:
    enable_chunked_prefill = rng.random() < 0.8
    max_num_batched_tokens = rng.choice([8, 16, 32]) if enable_chunked_prefill else MAX_MODEL_LEN
    return dict(
        enable_chunked_prefill=enable_chunked_prefill,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=min(rng.choice([4, 8, 16]), max_num_batched_tokens),
        long_prefill_token_threshold=rng.choice([0, 4, 8]),
    )


def random_requests(rng: random.Random, num_requests: int) -> list[tuple[int, Request]]:
    """(arrival step, request) pairs; prompts often extend one of a few shared prefixes."""
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(4, 24))] for _ in range(3)]
    arrivals = []
    for index in range(num_requests):
        prompt = []
        if rng.random() < 0.6:
            prompt = list(rng.choice(prefixes))
        prompt += [rng.randrange(1000) for _ in range(rng.randint(1, 16))]
        prompt = prompt[: MAX_MODEL_LEN - 1]
        stop = {}
        if rng.random() < 0.2:
            stop["stop_token_ids"] = [rng.randrange(1000) for _ in range(50)]
        request = make_request(
            f"req{index}",
            prompt,
            max_tokens=rng.randint(1, 24),
            priority=rng.choice([0, 0, 1, 2]),
            arrival_time=float(index),
            cache_salt=rng.choice([None, None, None, "salt"]),
            **stop,
        )
        arrivals.append((rng.randrange(24), request))
    return sorted(arrivals, key=lambda pair: pair[0])


LAYER_WINDOWS = {"global": (None,), "windowed": (None, 6, 9)}
"""The fake model's layers: all global, or Gemma-3-like, one global layer and two windowed ones,
each in its own KV cache group (their windows let go of blocks, the references keep them)."""


@pytest.mark.parametrize("layers", LAYER_WINDOWS)
@pytest.mark.parametrize("num_speculative_tokens, async_scheduling",
                         [(0, False), (3, False), (0, True)], ids=["plain", "spec", "async"])
@pytest.mark.parametrize("seed", range(8))
def test_random_workload_keeps_invariants_and_outputs(seed, num_speculative_tokens,
                                                      async_scheduling, layers):
    rng = random.Random(seed)
    config = random_config(rng)
    config["async_scheduling"] = async_scheduling
    enable_prefix_caching = seed != 3
    layer_windows = LAYER_WINDOWS[layers]
    harness = Harness(
        num_blocks=NUM_BLOCKS + 3 * (len(layer_windows) - 1),
        block_size=BLOCK_SIZE,
        enable_prefix_caching=enable_prefix_caching,
        max_model_len=MAX_MODEL_LEN,
        num_speculative_tokens=num_speculative_tokens,
        spec_seed=seed,
        layer_windows=layer_windows,
        **config,
    )
    arrivals = random_requests(rng, num_requests=40)
    requests = [request for _, request in arrivals]
    aborted: set[str] = set()

    step = 0
    while arrivals or harness.has_work():
        assert step < MAX_STEPS, f"not finished after {MAX_STEPS} steps"
        while arrivals and arrivals[0][0] <= step:
            harness.add(arrivals.pop(0)[1])
        live = sorted(harness.scheduler.requests)
        if live and rng.random() < 0.05:
            req_id = rng.choice(live)
            harness.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
            aborted.add(req_id)
            harness.scheduler.check_integrity()
        harness.step()  # check_integrity() after every step
        step += 1
    harness.assert_idle()

    stats = harness.scheduler.stats()
    assert stats.num_preemptions > 0
    if len(layer_windows) > 1:
        assert harness.scheduler.kv_cache_manager.num_window_freed_blocks > 0
    if config["enable_chunked_prefill"]:
        num_split_prompts = sum(
            data.num_computed_tokens + out.num_scheduled_tokens[data.req_id] < len(data.token_ids)
            for out in harness.history
            for data in out.scheduled_new_reqs
        )
        assert num_split_prompts > 0
    if enable_prefix_caching:
        assert stats.prefix_cache_hits > 0
    if async_scheduling:
        assert harness.num_overlapped_steps > len(harness.history) // 2
    spec = stats.spec_decoding
    if num_speculative_tokens:
        # Drafts were verified, some accepted and some rejected (so KV was rolled back).
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
        assert any(out.scheduled_spec_decode_tokens for out in harness.history)
    else:
        assert spec.num_drafts == 0
        assert not any(out.scheduled_spec_decode_tokens for out in harness.history)
    assert aborted and len(harness.finish_reasons) == len(requests) - len(aborted)

    for request in requests:
        reference, finish_reason = run_alone(request, MAX_MODEL_LEN, layer_windows)
        if request.request_id in aborted:
            # Aborted midway: whatever it produced is a prefix of its own output.
            produced = harness.outputs.get(request.request_id, [])
            assert produced == reference[: len(produced)], request.request_id
        else:
            assert harness.outputs[request.request_id] == reference, request.request_id
            assert harness.finish_reasons[request.request_id] == finish_reason
