"""The scheduler driven by a fake model runner: batching, chunking, priorities, preemption, stops.

The fake runner keeps per-request state exactly as the real one does (from scheduled_new_reqs,
scheduled_cached_reqs and finished_req_ids) and a paged KV cache whose slots hold a rolling hash
of the sequence up to that position, as real KV depends on the whole prefix. A request samples a
token from what it reads back through its block table, and the read is checked. So a request's
output must be the same whatever the batch, the chunking, the cache hits or the preemptions, and a
wrong block table, a lost write or a stale prefix-cache hit fails loudly.

With `num_speculative_tokens`, the fake runner also proposes random drafts (each the fake model's
true next token with probability `draft_accuracy`, else random), writes their KV, accepts them
while they match what the fake model samples, and rolls back the rest: so outputs must still equal
the plain run, and KV left behind by a rejected draft is caught if it is ever read.
"""

from __future__ import annotations

import collections
import random
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams

VOCAB_SIZE = 1000


def kv_value(previous: int, position: int, token_id: int) -> int:
    """The fake KV of one position: it depends on every token up to it, like a real layer's."""
    return hash((previous, position, token_id))


def fake_next_token(kv_values: list[int], layer_windows: tuple[int | None, ...] = (None,)) -> int:
    """The fake model's next token: each of its layers sees the last `window` positions' KV (None:
    all of them)."""
    seen = [kv_values[-window:] if window else kv_values for window in layer_windows]
    return hash(tuple(value for layer in seen for value in layer)) % VOCAB_SIZE


@dataclass
class RunnerRequestState:
    token_ids: list[int]
    block_ids: tuple[list[int], ...]
    """One block table per KV cache group."""
    num_computed_tokens: int
    expected_kv: list[int] = field(default_factory=list)
    """kv_value of each position of token_ids so far: what the cache must hold."""

    def expected_kv_upto(self, num_tokens: int) -> list[int]:
        for position in range(len(self.expected_kv), num_tokens):
            previous = self.expected_kv[-1] if self.expected_kv else 0
            self.expected_kv.append(kv_value(previous, position, self.token_ids[position]))
        return self.expected_kv[:num_tokens]


class FakeModelRunner:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_speculative_tokens: int = 0,
        draft_accuracy: float = 0.7,
        spec_seed: int = 0,
        layer_windows: tuple[int | None, ...] = (None,),
        layer_groups: tuple[int, ...] = (0,),
    ) -> None:
        """layer_windows: the fake model's layers' sliding windows (None: global); layer_groups:
        per layer, the KV cache group whose block table it reads and writes."""
        self.layer_windows = layer_windows
        self.layer_groups = layer_groups
        self.block_size = block_size
        self.kv_cache: list[int | None] = [None] * (num_blocks * block_size)
        self.requests: dict[str, RunnerRequestState] = {}
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_accuracy = draft_accuracy
        self.spec_rng = random.Random(spec_seed)

    def _slot(self, state: RunnerRequestState, position: int, group: int = 0) -> int:
        block_id = state.block_ids[group][position // self.block_size]
        assert block_id != 0, "the null block is read or written"
        return block_id * self.block_size + position % self.block_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for data in scheduler_output.scheduled_new_reqs:
            assert data.req_id not in self.requests, f"{data.req_id} sent as new twice"
            self.requests[data.req_id] = RunnerRequestState(
                list(data.token_ids), tuple(list(ids) for ids in data.block_ids),
                data.num_computed_tokens
            )
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[req_id]
            assert state.num_computed_tokens == num_computed, (req_id, state.num_computed_tokens)
            for table, new_ids in zip(state.block_ids, new_block_ids, strict=True):
                table.extend(new_ids)

        # Like a forward pass: every scheduled token's KV is written before anything is read.
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        draft_kv: dict[str, list[int]] = {}
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[req_id]
            end = state.num_computed_tokens + num_tokens
            drafts = spec_tokens.get(req_id, [])
            if drafts:
                assert end == len(state.token_ids) + len(drafts), f"{req_id}: drafts not the tail"
            else:
                assert end <= len(state.token_ids), f"{req_id} scheduled past its known tokens"
            assert all(end <= len(table) * self.block_size for table in state.block_ids), (
                f"{req_id} has too few blocks")
            expected = list(state.expected_kv_upto(min(end, len(state.token_ids))))
            for position, token_id in enumerate(drafts, start=len(state.token_ids)):
                expected.append(kv_value(expected[-1], position, token_id))
            draft_kv[req_id] = expected[len(state.token_ids) :]
            for position in range(state.num_computed_tokens, end):
                for group in set(self.layer_groups):
                    self.kv_cache[self._slot(state, position, group)] = expected[position]

        output = ModelRunnerOutput()
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[req_id]
            state.num_computed_tokens += num_tokens
            drafts = spec_tokens.get(req_id, [])
            if state.num_computed_tokens < len(state.token_ids):
                continue  # a prompt chunk that does not reach the end samples nothing
            seq_len = len(state.token_ids)
            expected = state.expected_kv_upto(seq_len) + draft_kv[req_id]
            # Each layer reads what its window sees from the first query that samples on.
            for window, group in zip(self.layer_windows, self.layer_groups):
                first = max(0, seq_len - window) if window else 0
                bad = [p for p in range(first, seq_len + len(drafts))
                       if self.kv_cache[self._slot(state, p, group)] != expected[p]]
                assert not bad, f"{req_id} reads wrong KV at positions {bad} (group {group})"
            # Greedy verification: accept drafts while they match what the model samples.
            sampled = []
            for num_accepted in range(len(drafts) + 1):
                sampled.append(fake_next_token(expected[: seq_len + num_accepted],
                                               self.layer_windows))
                if num_accepted == len(drafts) or sampled[-1] != drafts[num_accepted]:
                    break
            state.token_ids.extend(sampled)
            state.num_computed_tokens -= len(drafts) + 1 - len(sampled)
            output.sampled_token_ids[req_id] = sampled
            if self.num_speculative_tokens:
                output.spec_token_ids[req_id] = self._propose(state)
        return output

    def _propose(self, state: RunnerRequestState) -> list[int]:
        """0..num_speculative_tokens drafts, each the true next token or a random one."""
        rng = self.spec_rng
        kv = list(state.expected_kv_upto(len(state.token_ids)))
        drafts = []
        for _ in range(rng.randint(0, self.num_speculative_tokens)):
            token_id = fake_next_token(kv, self.layer_windows)
            if rng.random() >= self.draft_accuracy:
                token_id = rng.randrange(VOCAB_SIZE)
            kv.append(kv_value(kv[-1], len(kv), token_id))
            drafts.append(token_id)
        return drafts


class Harness:
    """A scheduler and a fake runner in lockstep; collects each request's outputs. With
    `async_scheduling=True` (a SchedulerConfig field) it steps as the engine then does: step
    N + 1 is scheduled and run before step N's results are applied (the fake runner, like the
    device, knows every token it sampled)."""

    def __init__(
        self,
        num_blocks: int = 256,
        block_size: int = 4,
        enable_prefix_caching: bool = True,
        num_speculative_tokens: int = 0,
        spec_seed: int = 0,
        layer_windows: tuple[int | None, ...] = (None,),
        hybrid: bool = True,
        **scheduler_kwargs,
    ) -> None:
        """layer_windows: the fake model's layers' sliding windows; hybrid: a KV cache group
        per layer (else one group that keeps every block, each layer masking its window)."""
        scheduler_kwargs.setdefault("max_model_len", 1024)
        scheduler_kwargs.setdefault("max_num_seqs", 16)
        group_windows = layer_windows if hybrid else (None,)
        self.scheduler = Scheduler(
            SchedulerConfig(**scheduler_kwargs),
            CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
            num_blocks=num_blocks,
            kv_cache_group_windows=group_windows,
        )
        self.runner = FakeModelRunner(
            num_blocks, block_size, num_speculative_tokens, spec_seed=spec_seed,
            layer_windows=layer_windows,
            layer_groups=tuple(range(len(layer_windows))) if hybrid else (0,) * len(layer_windows),
        )
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.finish_reasons: dict[str, str] = {}
        self.stop_reasons: dict[str, int | str | None] = {}
        self.num_cached_tokens: dict[str, int] = {}
        self.history: list[SchedulerOutput] = []
        self.sampled: list[dict[str, list[int]]] = []
        """The runner's sampled tokens of each step, parallel to history."""
        self.in_flight: collections.deque[tuple[SchedulerOutput, ModelRunnerOutput]] = (
            collections.deque())
        """Async scheduling: steps run whose results are not applied yet (at most one between
        steps)."""
        self.num_overlapped_steps = 0
        """Async scheduling: steps scheduled while another step's results were not applied."""

    @property
    def pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def step(self) -> SchedulerOutput:
        """Schedule and run a step; apply its results (async scheduling: the previous step's,
        as LLMEngine._step_with_batch_queue does). Returns the step scheduled."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        self.history.append(scheduler_output)
        self.sampled.append(runner_output.sampled_token_ids)
        if self.scheduler.config.async_scheduling:
            if self.in_flight and not scheduler_output.is_empty:
                self.num_overlapped_steps += 1
            if not scheduler_output.is_empty or not self.in_flight:
                self.in_flight.append((scheduler_output, runner_output))
            if len(self.in_flight) < 2 and not scheduler_output.is_empty:
                self.scheduler.check_integrity()
                return scheduler_output  # launched; its results are applied in the next step
            self._apply(*self.in_flight.popleft())
        else:
            self._apply(scheduler_output, runner_output)
        return scheduler_output

    def _apply(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        for out in self.scheduler.update_from_output(scheduler_output, runner_output):
            self.outputs[out.req_id].extend(out.new_token_ids)
            self.num_cached_tokens[out.req_id] = out.num_cached_tokens
            if out.finished:
                self.finish_reasons[out.req_id] = out.finish_reason
                self.stop_reasons[out.req_id] = out.stop_reason
        self.scheduler.check_integrity()

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.in_flight)

    def run(self, max_steps: int = 2000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.has_work():
                break
            self.step()
        assert not self.has_work(), f"not done in {max_steps} steps"
        self.assert_idle()
        return dict(self.outputs)

    def assert_idle(self) -> None:
        self.scheduler.check_integrity()
        assert not self.in_flight
        assert not self.scheduler.requests and not self.scheduler.running
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks
        # One more (empty) step hands the runner the last finished ids: it keeps no state.
        assert self.step().is_empty
        assert not self.runner.requests

    def scheduled(self, req_id: str) -> list[int]:
        """Tokens scheduled for req_id in each step so far (0 when not scheduled)."""
        return [out.num_scheduled_tokens.get(req_id, 0) for out in self.history]


def make_request(
    req_id: str,
    prompt: list[int],
    max_tokens: int = 8,
    *,
    priority: int = 0,
    arrival_time: float = 0.0,
    cache_salt: str | None = None,
    eos_token_ids: tuple[int, ...] = (),
    **params,
) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=frozenset(eos_token_ids),
        priority=priority,
        cache_salt=cache_salt,
        arrival_time=arrival_time,
    )


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % VOCAB_SIZE for i in range(length)]


def run_alone(request: Request, max_model_len: int = 1024,
              layer_windows: tuple[int | None, ...] = (None,)) -> tuple[list[int], str]:
    """The reference: the same request alone, on a big pool, no chunking, no prefix cache, one
    KV cache group that keeps every block (windowed layers read only their window)."""
    harness = Harness(
        num_blocks=1024,
        enable_prefix_caching=False,
        max_model_len=max_model_len,
        max_num_batched_tokens=4096,
        layer_windows=layer_windows,
        hybrid=False,
    )
    params = request.sampling_params.clone()
    harness.add(
        Request(request.request_id, list(request.prompt_token_ids), params,
                eos_token_ids=request.eos_token_ids, cache_salt=request.cache_salt)
    )
    outputs = harness.run()
    return outputs[request.request_id], harness.finish_reasons[request.request_id]


def assert_same_as_alone(harness: Harness, requests: list[Request]) -> None:
    max_model_len = harness.scheduler.config.max_model_len
    for request in requests:
        reference, finish_reason = run_alone(request, max_model_len)
        assert harness.outputs[request.request_id] == reference, request.request_id
        assert harness.finish_reasons[request.request_id] == finish_reason, request.request_id


# ---- the fake model itself ---------------------------------------------------------------------


def test_fake_runner_detects_a_corrupted_kv_cache():
    harness = Harness()
    harness.add(make_request("a", prompt_of(10), max_tokens=4))
    harness.step()
    harness.step()
    slot = harness.runner.requests["a"].block_ids[0][0] * 4
    harness.runner.kv_cache[slot] = 12345
    with pytest.raises(AssertionError, match="wrong KV at positions \\[0\\]"):
        harness.step()


def test_control_plane_imports_no_torch():
    code = (
        "import sys\n"
        "import pagedserve.core.scheduler, pagedserve.core.kv_cache_manager, pagedserve.config\n"
        "assert 'torch' not in sys.modules, 'core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- continuous batching ----------------------------------------------------------------------


def test_continuous_batching_join_and_leave():
    harness = Harness()
    a = make_request("a", prompt_of(6, 1), max_tokens=10)
    b = make_request("b", prompt_of(5, 2), max_tokens=3)
    harness.add(a)
    harness.step()
    harness.step()
    assert len(harness.outputs["a"]) == 2

    harness.add(b)  # joins while a decodes
    out = harness.step()
    assert [d.req_id for d in out.scheduled_new_reqs] == ["b"]
    assert out.scheduled_cached_reqs.req_ids == ["a"]
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}
    harness.step()
    harness.step()
    assert harness.finish_reasons == {"b": "length"}  # b leaves, a goes on
    out = harness.step()
    assert out.finished_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    harness.run()
    assert harness.finish_reasons == {"a": "length", "b": "length"}
    assert len(harness.outputs["a"]) == 10 and len(harness.outputs["b"]) == 3
    assert harness.scheduler.stats().num_generation_tokens == 13
    assert_same_as_alone(harness, [a, b])


def test_decodes_are_scheduled_before_prefills():
    harness = Harness(max_num_batched_tokens=8, max_num_seqs=8)
    a = make_request("a", prompt_of(3, 1), max_tokens=20, arrival_time=0)
    b = make_request("b", prompt_of(4, 2), max_tokens=20, arrival_time=1)
    harness.add(a, b)
    harness.step()
    c = make_request("c", prompt_of(20, 3), max_tokens=2, arrival_time=2)
    harness.add(c)
    out = harness.step()
    # The decodes take their token first, the new prompt gets what is left of the budget.
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 6)]
    # c's unfinished prompt is now a running request: it goes after the decodes but before any
    # newcomer.
    harness.add(make_request("d", prompt_of(5, 4), max_tokens=2, arrival_time=3))
    out = harness.step()
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 6)]
    harness.run()
    assert_same_as_alone(harness, [a, b, c])


# ---- chunked prefill --------------------------------------------------------------------------


def test_long_prompt_is_chunked_across_steps():
    harness = Harness(max_num_batched_tokens=16, max_num_seqs=4)
    request = make_request("long", prompt_of(40), max_tokens=4)
    harness.add(request)
    harness.run()
    assert harness.scheduled("long")[:6] == [16, 16, 8, 1, 1, 1]
    # Mid-prompt chunks sample nothing: the first token comes with the last chunk.
    samples = ["long" in sampled for sampled in harness.sampled[:6]]
    assert samples == [False, False, True, True, True, True]
    assert harness.scheduler.stats().num_prompt_tokens_computed == 40
    assert_same_as_alone(harness, [request])


def test_budget_is_shared_and_the_remainder_chunked():
    harness = Harness(max_num_batched_tokens=20, max_num_seqs=4)
    a = make_request("a", prompt_of(15, 1), max_tokens=3, arrival_time=0)
    b = make_request("b", prompt_of(15, 2), max_tokens=3, arrival_time=1)
    harness.add(a, b)
    out = harness.step()
    assert out.num_scheduled_tokens == {"a": 15, "b": 5}
    assert harness.outputs["a"] and "b" not in harness.outputs
    out = harness.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}
    harness.run()
    assert all(sum(out.num_scheduled_tokens.values()) <= 20 for out in harness.history)
    assert_same_as_alone(harness, [a, b])


def test_long_prefill_threshold_chunks_several_prompts_in_one_step():
    harness = Harness(max_num_batched_tokens=32, max_num_seqs=4, long_prefill_token_threshold=8)
    requests = [make_request(f"r{i}", prompt_of(20, i), max_tokens=3, arrival_time=i)
                for i in range(3)]
    harness.add(*requests)
    out = harness.step()
    assert out.num_scheduled_tokens == {"r0": 8, "r1": 8, "r2": 8}
    out = harness.step()
    assert out.num_scheduled_tokens == {"r0": 8, "r1": 8, "r2": 8}
    out = harness.step()
    assert out.num_scheduled_tokens == {"r0": 4, "r1": 4, "r2": 4}
    harness.run()
    assert_same_as_alone(harness, requests)


def test_chunked_prefill_disabled_waits_for_a_step_with_room():
    kwargs = dict(max_num_batched_tokens=32, max_model_len=32, max_num_seqs=4)
    requests = [make_request(f"r{i}", prompt_of(20, i), max_tokens=4, arrival_time=i)
                for i in range(2)]

    chunked = Harness(**kwargs)
    chunked.add(*requests)
    assert chunked.step().num_scheduled_tokens == {"r0": 20, "r1": 12}

    requests = [make_request(r.request_id, r.prompt_token_ids, max_tokens=4, arrival_time=i)
                for i, r in enumerate(requests)]
    harness = Harness(enable_chunked_prefill=False, **kwargs)
    harness.add(*requests)
    assert harness.step().num_scheduled_tokens == {"r0": 20}  # r1 does not fit: it waits
    assert harness.step().num_scheduled_tokens == {"r0": 1, "r1": 20}
    harness.run()
    assert_same_as_alone(harness, requests)


def test_max_num_seqs_is_respected():
    harness = Harness(max_num_seqs=2, max_num_batched_tokens=64)
    requests = [make_request(f"r{i}", prompt_of(5 + i, i), max_tokens=3 + i, arrival_time=i)
                for i in range(5)]
    harness.add(*requests)
    harness.run()
    assert max(len(out.num_scheduled_tokens) for out in harness.history) == 2
    assert_same_as_alone(harness, requests)


# ---- priorities and preemption ----------------------------------------------------------------


def test_waiting_requests_run_by_priority_then_arrival():
    harness = Harness(max_num_seqs=1)
    specs = [("p1-early", 1, 0.0), ("p0-late", 0, 2.0), ("p1-late", 1, 3.0), ("p0-early", 0, 1.0),
             ("p0-tie-a", 0, 5.0), ("p0-tie-b", 0, 5.0), ("p-neg", -1, 9.0)]
    for req_id, priority, arrival_time in specs:
        harness.add(make_request(req_id, prompt_of(4), max_tokens=2, priority=priority,
                                 arrival_time=arrival_time))
    harness.run()
    first_scheduled = []
    for out in harness.history:
        first_scheduled += [data.req_id for data in out.scheduled_new_reqs]
    # Lower value first; equal priorities by arrival time, then by order of add_request.
    assert first_scheduled == [
        "p-neg", "p0-early", "p0-late", "p0-tie-a", "p0-tie-b", "p1-early", "p1-late",
    ]


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_preemption_requeues_and_recomputes_with_same_output(enable_prefix_caching):
    # 8 usable blocks of 4 tokens; each request grows to 12 + 11 = 23 tokens of KV (6 blocks).
    harness = Harness(num_blocks=9, enable_prefix_caching=enable_prefix_caching)
    a = make_request("a", prompt_of(12, 1), max_tokens=12, arrival_time=0)
    b = make_request("b", prompt_of(12, 2), max_tokens=12, arrival_time=1)
    harness.add(a, b)
    harness.run()

    assert harness.scheduler.stats().num_preemptions > 0
    assert b.num_preemptions > 0 and a.num_preemptions == 0  # the later arrival is the victim
    new_b = [out for out in harness.history if any(d.req_id == "b" for d in out.scheduled_new_reqs)]
    assert len(new_b) == 1 + b.num_preemptions  # sent as new again after each preemption
    resumed = next(d for d in new_b[1].scheduled_new_reqs if d.req_id == "b")
    assert len(resumed.token_ids) > 12  # its outputs so far are part of the recomputation
    preempted_at = [out for out in harness.history if "b" in out.finished_req_ids]
    assert preempted_at  # the runner was told to drop b's state
    if not enable_prefix_caching:
        assert harness.scheduler.stats().num_prompt_tokens_computed > 24
    assert_same_as_alone(harness, [a, b])


def test_preemption_victim_is_the_lowest_priority():
    harness = Harness(num_blocks=9)
    low = make_request("low", prompt_of(12, 1), max_tokens=12, priority=1, arrival_time=0)
    high = make_request("high", prompt_of(12, 2), max_tokens=12, priority=0, arrival_time=1)
    harness.add(low)
    harness.step()  # low runs first: it is alone
    harness.add(high)
    harness.run()
    assert low.num_preemptions > 0 and high.num_preemptions == 0
    assert_same_as_alone(harness, [low, high])


def test_victim_scheduled_earlier_in_the_step_is_unscheduled_and_its_blocks_not_hit():
    # 8 usable blocks of 4 tokens; prompts are chunked 8 tokens (2 blocks) at a time.
    harness = Harness(num_blocks=9, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    low = make_request("low", prompt_of(24, 1), max_tokens=4, priority=1, arrival_time=0)
    high = make_request("high", prompt_of(4, 2), max_tokens=10, arrival_time=1)
    short = make_request("short", prompt_of(3, 3), max_tokens=2, arrival_time=2)
    harness.add(low)
    assert harness.step().num_scheduled_tokens == {"low": 8}
    harness.add(high, short)
    assert harness.step().num_scheduled_tokens == {"low": 8, "high": 4, "short": 3}
    assert harness.pool.num_free_blocks == 2

    # low takes the last 2 blocks for its last chunk (positions 16..23); then high needs a block
    # for its first decode and low, the lowest priority, is preempted after it was scheduled.
    out = harness.step()
    assert out.num_scheduled_tokens == {"high": 1, "short": 1}  # low's 8 tokens given back
    assert "low" in out.finished_req_ids and low.status == RequestStatus.PREEMPTED
    assert low.num_computed_tokens == 0 and harness.scheduler.num_preemptions == 1

    # short finished, freeing a block: low comes back. Its blocks for positions 16..23 were
    # indexed when scheduled but never computed: only the 16 computed tokens may be hit.
    out = harness.step()
    (resumed,) = out.scheduled_new_reqs
    assert resumed.req_id == "low"
    assert resumed.num_computed_tokens == 16
    harness.run()
    assert_same_as_alone(harness, [low, high, short])


# ---- admission errors and aborts -------------------------------------------------------------


def test_request_that_can_never_fit_is_rejected_without_state():
    harness = Harness(num_blocks=5, max_model_len=64)  # 4 usable blocks of 4 tokens
    with pytest.raises(ValueError, match="context length"):
        harness.add(make_request("long-prompt", prompt_of(64), max_tokens=1))
    with pytest.raises(ValueError, match="KV blocks"):
        # 18 tokens, of which 17 get KV (the last sampled token never does): 5 blocks
        harness.add(make_request("too-many-blocks", prompt_of(10), max_tokens=8))
    harness.add(make_request("dup", prompt_of(3), max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        harness.add(make_request("dup", prompt_of(5), max_tokens=2))
    assert list(harness.scheduler.requests) == ["dup"]
    assert harness.scheduler.num_waiting == 1
    harness.scheduler.check_integrity()

    exactly_fits = make_request("fits", prompt_of(10), max_tokens=7)  # 16 KV tokens = 4 blocks
    harness.add(exactly_fits)
    harness.run()
    assert len(harness.outputs["fits"]) == 7
    assert_same_as_alone(harness, [exactly_fits])


def test_abort_waiting_running_and_preempted_requests_frees_blocks():
    harness = Harness(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=8)
    decoding = make_request("decoding", prompt_of(6, 1), max_tokens=20, arrival_time=0)
    prefilling = make_request("prefilling", prompt_of(30, 2), max_tokens=20, arrival_time=1)
    waiting = make_request("waiting", prompt_of(5, 3), max_tokens=20, arrival_time=2)
    harness.add(decoding, prefilling, waiting)
    harness.step()
    harness.step()
    assert harness.outputs["decoding"]
    assert 0 < prefilling.num_computed_tokens < 30  # mid-prompt
    assert waiting.status == RequestStatus.WAITING
    assert harness.pool.num_free_blocks < harness.pool.num_usable_blocks

    finished = harness.scheduler.finish_requests(
        ["decoding", "prefilling", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED
    )
    assert [r.request_id for r in finished] == ["decoding", "prefilling", "waiting"]
    assert all(r.status.finish_reason == "abort" for r in finished)
    assert harness.pool.num_free_blocks == harness.pool.num_usable_blocks
    harness.scheduler.check_integrity()
    assert not harness.scheduler.has_unfinished_requests()
    out = harness.step()
    assert out.finished_req_ids == {"decoding", "prefilling", "waiting"}
    assert not harness.runner.requests

    # A preempted request (waiting again) aborts the same way.
    small = Harness(num_blocks=9)
    a = make_request("a", prompt_of(12, 1), max_tokens=12, arrival_time=0)
    b = make_request("b", prompt_of(12, 2), max_tokens=12, arrival_time=1)
    small.add(a, b)
    while b.status != RequestStatus.PREEMPTED:
        small.step()
    small.scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    small.run()
    assert "b" not in small.finish_reasons
    assert_same_as_alone(small, [a])


def test_new_request_after_abort_is_unaffected():
    harness = Harness(num_blocks=12)
    victim = make_request("victim", prompt_of(9, 1), max_tokens=10)
    harness.add(victim)
    harness.step()
    harness.step()
    harness.scheduler.finish_requests(["victim"], RequestStatus.FINISHED_ABORTED)
    # Same prompt: it may hit the aborted request's cached blocks, which hold valid KV.
    again = make_request("again", prompt_of(9, 1), max_tokens=10)
    harness.add(again)
    harness.run()
    assert harness.num_cached_tokens["again"] == 8
    assert_same_as_alone(harness, [again])


# ---- stopping ---------------------------------------------------------------------------------


def _first_new_token(tokens: list[int], start: int) -> int:
    """Index >= start of a token that does not occur before it."""
    for index in range(start, len(tokens)):
        if tokens[index] not in tokens[:index]:
            return index
    raise AssertionError("no fresh token")


def test_eos_and_stop_token_ids_finish_the_request():
    prompt = prompt_of(7, 5)
    reference, _ = run_alone(make_request("ref", prompt, max_tokens=12))
    k = _first_new_token(reference, 3)
    stop_token = reference[k]

    harness = Harness()
    eos = make_request("eos", prompt, max_tokens=12, eos_token_ids=(stop_token,))
    stop = make_request("stop", prompt, max_tokens=12, stop_token_ids=[stop_token])
    ignore = make_request("ignore", prompt, max_tokens=12, eos_token_ids=(stop_token,),
                          ignore_eos=True)
    late = make_request("late", prompt, max_tokens=12, eos_token_ids=(stop_token,),
                        min_tokens=k + 2)
    harness.add(eos, stop, ignore, late)
    harness.run()
    assert harness.outputs["eos"] == reference[: k + 1]
    assert (harness.finish_reasons["eos"], harness.stop_reasons["eos"]) == ("stop", None)
    assert harness.outputs["stop"] == reference[: k + 1]
    assert (harness.finish_reasons["stop"], harness.stop_reasons["stop"]) == ("stop", stop_token)
    assert harness.outputs["ignore"] == reference
    assert harness.finish_reasons["ignore"] == "length"
    # min_tokens: the eos at index k is ignored; it ends the request only at a later occurrence.
    later = [j for j in range(k + 1, len(reference)) if reference[j] == stop_token]
    end = later[0] + 1 if later else len(reference)
    assert harness.outputs["late"] == reference[:end]


def test_max_tokens_and_max_model_len_cap_the_length():
    harness = Harness(max_model_len=20)
    by_max_tokens = make_request("max_tokens", prompt_of(5, 1), max_tokens=4)
    by_context = make_request("context", prompt_of(15, 2), max_tokens=100)
    harness.add(by_max_tokens, by_context)
    harness.run()
    assert len(harness.outputs["max_tokens"]) == 4
    assert len(harness.outputs["context"]) == 5  # 15 + 5 = max_model_len
    assert harness.finish_reasons == {"max_tokens": "length", "context": "length"}
    assert_same_as_alone(harness, [by_max_tokens, by_context])


# ---- prefix caching through the scheduler -----------------------------------------------------


def test_doc_qa_shares_the_document_prefix():
    block_size = 16
    harness = Harness(
        num_blocks=200, block_size=block_size, max_num_batched_tokens=2048, max_model_len=2048
    )
    document = prompt_of(1000, 11)
    a = make_request("a", document + prompt_of(20, 12), max_tokens=5)
    harness.add(a)
    harness.run()
    before = harness.scheduler.stats()
    assert before.num_prompt_tokens_computed == 1020

    b = make_request("b", document + prompt_of(25, 13), max_tokens=5)
    harness.add(b)
    harness.run()
    after = harness.scheduler.stats()
    num_cached = harness.num_cached_tokens["b"]
    assert num_cached >= (1000 // block_size) * block_size
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed == (
        1025 - num_cached
    )
    assert after.prefix_cache_hits - before.prefix_cache_hits == num_cached
    assert after.prefix_cache_queries - before.prefix_cache_queries == 1025
    assert_same_as_alone(harness, [a, b])


def test_same_prompt_requests_hit_blocks_scheduled_in_the_same_step():
    # The engine turns n > 1 into n requests with one prompt: later ones hit the first one's
    # blocks in the very step that computes them.
    harness = Harness(num_blocks=64)
    prompt = prompt_of(18, 21)
    requests = [make_request(f"{i}_req", prompt, max_tokens=6, arrival_time=0) for i in range(3)]
    harness.add(*requests)
    out = harness.step()
    assert out.num_scheduled_tokens == {"0_req": 18, "1_req": 2, "2_req": 2}
    table = harness.scheduler.kv_cache_manager.req_to_blocks
    shared = table["0_req"][0][:4]
    assert all(table[r.request_id][0][:4] == shared for r in requests)
    assert [block.ref_cnt for block in shared] == [3, 3, 3, 3]
    harness.run()
    assert [harness.num_cached_tokens[r.request_id] for r in requests] == [0, 16, 16]
    reference, _ = run_alone(requests[0])
    assert all(harness.outputs[r.request_id] == reference for r in requests)


def test_cache_salt_isolates_prefix_hits():
    harness = Harness(num_blocks=64)
    prompt = prompt_of(18, 31)
    harness.add(make_request("plain", prompt, max_tokens=3))
    harness.run()
    harness.add(make_request("salted", prompt, max_tokens=3, cache_salt="tenant"))
    harness.run()
    harness.add(make_request("salted-again", prompt, max_tokens=3, cache_salt="tenant"))
    harness.run()
    assert harness.num_cached_tokens == {"plain": 0, "salted": 0, "salted-again": 16}
    assert harness.outputs["plain"] == harness.outputs["salted"] == harness.outputs["salted-again"]
