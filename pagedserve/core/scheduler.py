"""The token-centric scheduler: each step hands out tokens under a budget.

A request has `num_tokens` and `num_computed_tokens`; a step gives it
min(num_tokens - num_computed_tokens, budget left) tokens. Prefill chunks, prefix-cache hits and
decodes are the same arithmetic. Running requests go first (decodes and unfinished prompt chunks),
then waiting requests fill what is left. When blocks run out, the lowest-priority running request
is preempted: its blocks are freed and it is recomputed later.

A KV tier (kv_transfer/) is a prefix hit that arrives later: the connector says how many tokens
past the device pool's hit it can load; the request's blocks are reserved and it waits off the
queues (WAITING_FOR_REMOTE_KVS) until the worker reports the blocks loaded and verified, then
joins the running requests with those tokens computed (it holds blocks: were it to queue behind
a request the pool cannot fit, neither could ever run). A load that fails part-way just leaves
more to compute.

Speculative decoding is the same arithmetic: a request's draft tokens (`spec_token_ids`) count as
tokens to compute, and `update_from_output` moves `num_computed_tokens` back over the rejected ones.

Async scheduling (SchedulerConfig.async_scheduling) schedules step N + 1 before step N's sampled
tokens are back. A step that samples for a request gives it an output placeholder, which counts as
a known token, so the next step may decode it (the runner takes its id from step N's result on the
device); `update_from_output` turns the placeholder into the real token:
    | prompt | outputs known | placeholders (steps in flight) |
                                ^ may be scheduled before it is known
A request whose next step depends on its last token on the host (a grammar) waits for it instead.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedserve.request import Request, RequestStatus
from pagedserve.core.stats import SchedulerStats, SpecDecodingStats
from pagedserve.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler
from pagedserve.observability.events import (
    DraftsVerified,
    EventBus,
    PrefixHit,
    RequestFinished,
    RequestPreempted,
    RequestResumed,
    RequestScheduled,
    TokensGenerated,
)


@dataclass
class _StepPlan:
    """What schedule() has handed out so far in one step."""

    token_budget: int
    max_num_reqs: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    """Request id -> its tokens this step."""
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    """Per running request scheduled, its new blocks' ids per KV cache group."""
    new_reqs: list[NewRequestData] = field(default_factory=list)
    """Requests the runner has not seen yet."""
    preempted: list[Request] = field(default_factory=list)
    step_loras: set[int] = field(default_factory=set)
    """Adapters of the requests scheduled: at most max_loras."""

    def has_room(self) -> bool:
        return self.token_budget > 0 and len(self.num_scheduled) < self.max_num_reqs

    def schedule(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.token_budget -= num_tokens
        if request.lora_int_id is not None:
            self.step_loras.add(request.lora_int_id)

    def unschedule(self, request: Request) -> None:
        """Take back a preempted request's tokens (if it was scheduled earlier in the step)."""
        if request.request_id in self.num_scheduled:
            self.token_budget += self.num_scheduled.pop(request.request_id)
            self.new_block_ids.pop(request.request_id, None)


class Scheduler:
    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
        connector: KVConnectorScheduler | None = None, max_loras: int | None = None,
        events: EventBus | None = None,
        kv_cache_group_windows: tuple[int | None, ...] = (None,),
    ) -> None:
        """connector: the scheduler half of the KV tiers (None: KV lives in the pool only).
        max_loras: distinct LoRA adapters one step may use (None: no adapters).
        events: where request and block events go (observability/events.py).
        kv_cache_group_windows: the sliding window of each KV cache group (KVCacheLayout.windows;
        one global group: every layer keeps every block)."""
        self.config = scheduler_config
        self.events = events or EventBus()
        self.step_index = -1
        """The last schedule()'s step number (counted from 0)."""
        self.max_loras = max_loras
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, self.events,
            kv_cache_group_windows,
        )
        if connector is not None and self.kv_cache_manager.num_groups > 1:
            raise ValueError("KV tiers need one KV cache group (CacheConfig.hybrid_kv_cache off)")
        self.requests: dict[str, Request] = {}
        # Heap of (priority, arrival_time, sequence, request): lower priority value runs first.
        self._waiting: list[tuple[int, float, int, Request]] = []
        self._sequence = itertools.count()
        self.running: list[Request] = []
        self.connector = connector
        self._loading: dict[str, Request] = {}
        """Requests whose blocks a KV tier is loading (aborted ones too, until the load ends:
        their blocks are being written)."""
        self._unknown_to_runner: set[str] = set()
        """Running requests loaded from a tier that the runner has not been sent yet."""
        self._finished_req_ids: set[str] = set()
        """Finished or preempted since the last schedule(); the runner drops their state."""
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.num_generation_tokens = 0
        self.spec_decoding_stats = SpecDecodingStats()

    # ---- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raise ValueError if it could never run on this engine."""
        self.check_request(request)
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def check_request(self, request: Request) -> None:
        """Raise ValueError if `request` could never run on this engine (nothing is queued)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.pooling_params is not None:
            # A pooling request computes its prompt and ends: every prompt token gets KV.
            max_len = request.num_prompt_tokens
            if max_len > self.config.max_model_len:
                raise ValueError(f"prompt has {max_len} tokens; the context length is "
                                 f"{self.config.max_model_len}")
        elif request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the context length is "
                f"{self.config.max_model_len} and at least one token must be generated"
            )
        else:
            # The last sampled token never gets KV: a request holds at most this many tokens' KV.
            max_len = min(request.num_prompt_tokens + request.max_tokens,
                          self.config.max_model_len) - 1
        num_blocks_needed = self.kv_cache_manager.max_blocks_for(max_len)
        num_usable = self.kv_cache_manager.block_pool.num_usable_blocks
        if num_blocks_needed > num_usable:
            raise ValueError(
                f"request needs {num_blocks_needed} KV blocks ({max_len} tokens) but the whole "
                f"KV cache has {num_usable}; lower max_tokens or raise the KV cache memory"
            )

    def _push_waiting(self, request: Request) -> None:
        if request.admission_order < 0:
            request.admission_order = next(self._sequence)
        entry = (request.priority, request.arrival_time, request.admission_order, request)
        heapq.heappush(self._waiting, entry)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self.running or self._loading)

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        # With pipeline stages, a batch takes its share of the unfinished requests, so that the
        # next batch (scheduled while this one is in flight) has requests to run too.
        num_batches = self.config.max_num_batches_in_flight
        max_num_reqs = max(1, -(-(len(self.running) + len(self._waiting)) // num_batches))
        plan = _StepPlan(self.config.max_num_batched_tokens, max_num_reqs)
        self._schedule_running(plan)  # 1. decodes and unfinished prompts, in order
        if not plan.preempted:  # 2. waiting requests, by priority then arrival
            self._schedule_waiting(plan)
        for req_id in self._unknown_to_runner & plan.num_scheduled.keys():
            # first scheduled since its KV tier load: new to the runner
            plan.new_reqs.append(self._new_request_data(self.requests[req_id]))
            self._unknown_to_runner.discard(req_id)
        spec_decode_tokens = self._scheduled_drafts(plan.num_scheduled)
        output = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=self._cached_request_data(plan),
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            finished_req_ids=self._finished_req_ids,
            scheduled_spec_decode_tokens=spec_decode_tokens,
            step_index=self.step_index,
        )
        self._finished_req_ids = set()
        self._advance(output, spec_decode_tokens)
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(
                self.requests, self._connector_block_ids, plan.num_scheduled)
        return output

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Give the running requests their tokens in order, preempting the lowest-priority
        running request while the pool has no blocks for one."""
        req_index = 0
        while req_index < len(self.running) and plan.has_room():
            request = self.running[req_index]
            if not self._lora_fits(request, plan.step_loras):
                req_index += 1  # its adapter waits for a step with a free slot
                continue
            if request.num_output_placeholders and not self._may_decode_placeholder(request):
                req_index += 1  # async scheduling: it waits for its step in flight
                continue
            num_new_tokens = self._num_new_tokens(request, plan.token_budget)
            new_blocks = None
            while num_new_tokens > 0:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                # A request with a step in flight is not preempted, not even by itself: its
                # results are on the way. A request that finds no victim waits; a step that
                # schedules nothing makes the engine wait for the steps in flight, so the next
                # one has every request to choose from (no livelock).
                candidates = [r for r in self.running
                              if not r.num_steps_in_flight or r is request]
                victim = max(candidates, key=self._preemption_order)
                if victim is request and (len(candidates) < len(self.running)
                                          or request.num_steps_in_flight):
                    num_new_tokens = 0  # not now: the steps in flight will free or need blocks
                    break
                victim_index = self.running.index(victim)
                self.running.pop(victim_index)
                if victim_index < req_index:
                    req_index -= 1
                plan.unschedule(victim)  # if it was scheduled earlier in this step
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                if num_new_tokens > 0:  # the request preempted itself: nothing smaller can run
                    break
                req_index += 1
                continue
            plan.schedule(request, num_new_tokens)
            plan.new_block_ids[request.request_id] = tuple(
                [block.block_id for block in blocks] for blocks in new_blocks)
            req_index += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Start waiting requests, by priority then arrival, in what the step has left: from
        their prefix-cache hit, or off the queues while a KV tier loads more of their prefix."""
        skipped: list[Request] = []  # passed over: their adapter finds no slot this step
        while (
            self._waiting
            and plan.has_room()
            and len(self.running) + len(self._loading) < self.config.max_num_seqs
        ):
            request = self._waiting[0][3]
            if not self._lora_fits(request, plan.step_loras):
                skipped.append(heapq.heappop(self._waiting)[3])
                continue
            computed_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            if self._start_load(request, computed_blocks, num_hit_tokens):
                continue
            num_new_tokens = request.num_tokens - num_hit_tokens
            if self.config.long_prefill_token_threshold:
                num_new_tokens = min(num_new_tokens, self.config.long_prefill_token_threshold)
            if num_new_tokens > plan.token_budget and not self.config.enable_chunked_prefill:
                break
            num_new_tokens = min(num_new_tokens, plan.token_budget)
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, computed_blocks
            )
            if new_blocks is None:
                break
            heapq.heappop(self._waiting)
            if self.events.enabled:
                self._emit_admitted(request, num_hit_tokens)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.times.first_scheduled is None:
                request.times.first_scheduled = time.monotonic()
            self.running.append(request)
            plan.schedule(request, num_new_tokens)
            plan.new_reqs.append(self._new_request_data(request))
        for request in skipped:
            self._push_waiting(request)

    def _new_request_data(self, request: Request) -> NewRequestData:
        """What the runner needs of a request it has not seen, with its blocks so far."""
        return NewRequestData(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            lora_int_id=request.lora_int_id,
            pooling_params=request.pooling_params,
        )

    def _cached_request_data(self, plan: _StepPlan) -> CachedRequestData:
        """The diffs of the scheduled requests the runner already holds: new blocks and the
        tokens it has not seen."""
        cached_reqs = CachedRequestData()
        new_req_ids = {data.req_id for data in plan.new_reqs}
        for req_id, block_ids in plan.new_block_ids.items():
            if req_id in new_req_ids:
                continue
            request = self.requests[req_id]
            cached_reqs.req_ids.append(req_id)
            cached_reqs.new_block_ids.append(block_ids)
            cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
            # | prompt ... | outputs computed | outputs sampled, not computed | drafts |
            #                                 ^ num_computed_tokens            ^ num_tokens
            first_new = max(request.num_computed_tokens, request.num_prompt_tokens)
            cached_reqs.new_token_ids.append(request.all_token_ids[first_new:request.num_tokens])
        return cached_reqs

    def _scheduled_drafts(self, num_scheduled: dict[str, int]) -> dict[str, list[int]]:
        """Draft tokens are the tail of what is scheduled; the budget may have cut some off.
            | computed | known tokens not computed | drafts scheduled | drafts cut off |
        (Output placeholders, with async scheduling, are known tokens here: never drafts.)"""
        spec_decode_tokens: dict[str, list[int]] = {}
        for req_id, num_tokens in num_scheduled.items():
            request = self.requests[req_id]
            num_spec = (request.num_computed_tokens + num_tokens - request.num_tokens
                        - request.num_output_placeholders)
            if num_spec > 0:
                spec_decode_tokens[req_id] = request.spec_token_ids[:num_spec]
        return spec_decode_tokens

    def _advance(self, output: SchedulerOutput, spec_decode_tokens: dict[str, list[int]]) -> None:
        """Count the step's tokens as computed now, at scheduling: the next schedule() may run
        before this step's results are back (async scheduling), and must not hand out the same
        tokens."""
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            # Prefill computes known tokens (a prompt chunk, or recomputation after a
            # preemption); decode computes the last sampled token (and drafts).
            is_prefill = request.num_computed_tokens < request.num_tokens - 1
            if is_prefill:
                output.num_prefill_requests += 1
                output.num_prefill_tokens += num_tokens
            if self.events.enabled:
                self.events.emit(RequestScheduled(
                    req_id, self.step_index, num_tokens, request.num_computed_tokens,
                    "prefill" if is_prefill else "decode",
                    len(spec_decode_tokens.get(req_id, ()))))
            num_prompt_left = request.num_prompt_tokens - request.num_computed_tokens
            self.num_prompt_tokens_computed += max(0, min(num_tokens, num_prompt_left))
            request.num_computed_tokens += num_tokens
            request.num_steps_in_flight += 1
            if self._samples_with_placeholder(request):
                request.num_output_placeholders += 1

    def _connector_block_ids(self, req_id: str) -> list[int]:
        """A KV tier's view of a request's blocks: the one group's (tiers move whole blocks of
        every layer, so they run with one KV cache group: CacheConfig.hybrid_kv_cache)."""
        return self.kv_cache_manager.get_block_ids(req_id)[0]

    def _emit_admitted(self, request: Request, num_hit_tokens: int) -> None:
        """A waiting request is about to run: its prefix hit, and its resumption."""
        if request.status == RequestStatus.PREEMPTED:
            self.events.emit(RequestResumed(request.request_id, self.step_index,
                                            request.num_tokens - num_hit_tokens))
        if num_hit_tokens:
            self.events.emit(PrefixHit(request.request_id, self.step_index, num_hit_tokens,
                                       "device"))

    def _start_load(self, request: Request, computed_blocks, num_hit_tokens: int) -> bool:
        """If a KV tier has more of the request's prefix and the connector will load it, reserve
        the blocks and park the request until the load is done. False: schedule it as usual
        (also when the pool is short now: it then computes what the tier had)."""
        if self.connector is None or request.needs_every_prompt_position:
            return False
        num_external = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        if not num_external:
            return False
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_external, computed_blocks, delay_cache_blocks=True)
        if new_blocks is None:
            return False
        heapq.heappop(self._waiting)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit_tokens
        if request.times.first_scheduled is None:
            request.times.first_scheduled = time.monotonic()
        self._loading[request.request_id] = request
        self.connector.update_state_after_alloc(
            request, self._connector_block_ids(request.request_id), num_external)
        return True

    def _finish_loads(self, output: KVConnectorOutput) -> None:
        """Requests whose tier load ended: the verified leading blocks count as computed and
        join the prefix index; the request runs from there."""
        self.connector.update_connector_output(output)
        for req_id, num_blocks in output.finished_loads.items():
            request = self._loading.pop(req_id)
            # The last prompt token is always computed (its logits are needed): a P/D decode
            # loads the prompt's last block but counts it only up to that token.
            num_loaded = min(num_blocks * self.block_size,
                             request.num_tokens - 1 - request.num_computed_tokens)
            num_asked = min(len(self.kv_cache_manager.req_to_blocks[req_id][0]) * self.block_size,
                            request.num_tokens - 1)
            self.connector.record_load_result(
                num_loaded, max(0, num_asked - request.num_computed_tokens - num_loaded))
            if request.is_finished:  # aborted while loading
                self.kv_cache_manager.free(request)
                continue
            request.num_computed_tokens += num_loaded
            request.num_tier_cached_tokens = num_loaded
            sources = self.connector.load_sources(req_id, num_loaded)
            if num_loaded and self.events.enabled:
                for source, num_tokens in sources.items():
                    self.events.emit(PrefixHit(req_id, self.step_index, num_tokens, source))
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._unknown_to_runner.add(req_id)

    @staticmethod
    def _preemption_order(request: Request) -> tuple[int, float, int]:
        """The running request with the largest key is preempted first: lowest priority, then
        latest arrival, then latest admission (n > 1 copies share priority and arrival)."""
        return (request.priority, request.arrival_time, request.admission_order)

    def _lora_fits(self, request: Request, step_loras: set[int]) -> bool:
        """Whether the request's adapter (if any) may join the step's adapters."""
        lora_id = request.lora_int_id
        return (lora_id is None or lora_id in step_loras
                or self.max_loras is not None and len(step_loras) < self.max_loras)

    def _samples_with_placeholder(self, request: Request) -> bool:
        """Async scheduling, after `request` was scheduled: whether this step samples for it
        (its scheduled tokens reach the end of what it has, placeholders included), so that its
        output stands as a placeholder until the step's results are back."""
        return (self.config.async_scheduling and request.pooling_params is None
                and request.num_computed_tokens
                >= request.num_tokens + request.num_output_placeholders)

    def _may_decode_placeholder(self, request: Request) -> bool:
        """Async scheduling: whether a request whose last token is a placeholder (its step is in
        flight) may decode it now. Not past max_tokens or max_model_len (placeholders count as
        outputs), and not under a grammar: its state, and so the bitmask of the next step,
        needs the token itself."""
        if request.constraint is not None:
            return False
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        num_tokens = request.num_tokens + request.num_output_placeholders
        return num_outputs < request.max_tokens and num_tokens < self.config.max_model_len

    def _num_new_tokens(self, request: Request, token_budget: int) -> int:
        # | computed | known, not computed | placeholders (async) | drafts |
        num_new_tokens = (request.num_tokens_with_spec + request.num_output_placeholders
                          - request.num_computed_tokens)
        if self.config.long_prefill_token_threshold:
            num_new_tokens = min(num_new_tokens, self.config.long_prefill_token_threshold)
        return min(num_new_tokens, token_budget)

    def _preempt(self, request: Request) -> None:
        assert not request.num_steps_in_flight, "a request with a step in flight is preempted"
        if self.events.enabled:
            self.events.emit(RequestPreempted(request.request_id, self.step_index,
                                              time.monotonic(), request.num_computed_tokens))
        self._unknown_to_runner.discard(request.request_id)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # proposed again once it samples after recomputation
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._finished_req_ids.add(request.request_id)
        self._push_waiting(request)

    # ---- results ----------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        if runner_output.kv_connector_output is not None and self.connector is not None:
            self._finish_loads(runner_output.kv_connector_output)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is not None:
                request.num_steps_in_flight -= 1
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            pooled = runner_output.pooled_outputs.get(req_id)
            if pooled is not None:  # a pooling request's prompt is done: so is the request
                outputs.append(self._finish_pooling(request, pooled))
                continue
            new_token_ids = runner_output.sampled_token_ids.get(req_id, [])
            new_logprobs = runner_output.logprobs.get(req_id)
            if new_token_ids and self.config.async_scheduling:
                # The token a placeholder stood for (one: async scheduling runs no drafts).
                assert request.num_output_placeholders > 0, f"{req_id}: no placeholder"
                request.num_output_placeholders -= 1
            scheduled_spec = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if scheduled_spec:
                # KV was computed for every draft; the slots of rejected ones are overwritten
                # later. Their blocks stay with the request but were never hashed (drafts are
                # not in all_token_ids), so no other request can hit their stale KV.
                assert new_token_ids, f"{req_id} verified drafts but sampled nothing"
                num_accepted = len(new_token_ids) - 1
                request.num_computed_tokens -= len(scheduled_spec) - num_accepted
                self.spec_decoding_stats.observe(len(scheduled_spec), num_accepted)
                if self.events.enabled:
                    self.events.emit(DraftsVerified(req_id, scheduler_output.step_index,
                                                    len(scheduled_spec), num_accepted))
            stopped = False
            for num_accepted, token_id in enumerate(new_token_ids, start=1):
                request.append_output_token_ids([token_id])
                if request.constraint is not None:
                    # The runner masked every token the grammar forbids, so this only fails on
                    # a bug; a failed grammar reports itself terminated and check_stop ends it.
                    request.constraint.accept_tokens([token_id])
                if request.check_stop(self.config.max_model_len):
                    stopped = True
                    new_token_ids = new_token_ids[:num_accepted]
                    if new_logprobs is not None:
                        new_logprobs = new_logprobs[:num_accepted]
                    break
            if not stopped:
                request.spec_token_ids = self._cap_spec_tokens(
                    request, runner_output.spec_token_ids.get(req_id, [])
                )
            if new_token_ids:
                self.num_generation_tokens += len(new_token_ids)
                first = request.times.first_token is None
                if first:
                    request.times.first_token = now
                request.times.last_token = now
                if self.events.enabled:
                    self.events.emit(TokensGenerated(req_id, scheduler_output.step_index, now,
                                                     len(new_token_ids), first))
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if not new_token_ids and prompt_logprobs is None and not stopped:
                continue
            if stopped:
                self._free_request(request)
            outputs.append(
                EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    num_tier_cached_tokens=request.num_tier_cached_tokens,
                    first_scheduled_time=request.times.first_scheduled,
                )
            )
        return outputs

    def _finish_pooling(self, request: Request, pooled: list[float]) -> EngineCoreOutput:
        """Finish a pooling request with its vector; its blocks go back to the pool now (full
        ones stay in the prefix-cache index, like any finished request's)."""
        request.status = RequestStatus.FINISHED_STOPPED
        self._free_request(request)
        return EngineCoreOutput(
            req_id=request.request_id, new_token_ids=[], finish_reason="stop",
            num_cached_tokens=request.num_cached_tokens,
            num_tier_cached_tokens=request.num_tier_cached_tokens,
            first_scheduled_time=request.times.first_scheduled, pooled_output=pooled)

    def _cap_spec_tokens(self, request: Request, spec_token_ids: list[int]) -> list[int]:
        """Keep only drafts that could all be accepted: verifying k drafts yields up to k + 1
        tokens, which must fit in max_tokens and max_model_len."""
        if not spec_token_ids:
            return []
        max_num_spec = min(
            request.max_tokens - request.num_output_tokens,
            self.config.max_model_len - request.num_tokens,
        ) - 1
        spec_token_ids = spec_token_ids[: max(max_num_spec, 0)]
        if request.constraint is not None and spec_token_ids:
            # A draft the grammar forbids would be rejected anyway; do not spend compute on it.
            spec_token_ids = spec_token_ids[: request.constraint.num_valid_prefix(spec_token_ids)]
        return spec_token_ids

    def finish_requests(
        self, req_ids: list[str], status: RequestStatus, stop_reason: int | str | None = None
    ) -> list[Request]:
        """Finish requests from outside the step (abort, or a stop string found in the text)."""
        assert status.is_finished
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # Its blocks are being written: they are freed when the load ends.
                request.status = status
                request.stop_reason = stop_reason
                request.times.finished = time.monotonic()
                self._emit_finished(request)
                self._finished_req_ids.add(req_id)
                del self.requests[req_id]
                if self.connector is not None:
                    self.connector.request_finished(request)
                finished.append(request)
                continue
            else:
                self._waiting = [entry for entry in self._waiting if entry[3] is not request]
                heapq.heapify(self._waiting)
            request.status = status
            request.stop_reason = stop_reason
            self._free_request(request)
            finished.append(request)
        return finished

    def take_finished_req_ids(self) -> set[str]:
        """Hand over the ids finished or preempted since the last schedule() now, instead of in
        the next SchedulerOutput: when the engine goes idle there is no next step, and the
        runner should not hold their state (draft KV) until one comes."""
        finished, self._finished_req_ids = self._finished_req_ids, set()
        return finished

    def _free_request(self, request: Request) -> None:
        assert request.is_finished
        if request in self.running:
            self.running.remove(request)
        self._unknown_to_runner.discard(request.request_id)
        self.kv_cache_manager.free(request)
        if self.connector is not None:
            self.connector.request_finished(request)
        request.times.finished = time.monotonic()
        self._emit_finished(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _emit_finished(self, request: Request) -> None:
        if self.events.enabled:
            self.events.emit(RequestFinished(request.request_id, request.times.finished,
                                             request.status.finish_reason,
                                             request.num_output_tokens))

    # ---- introspection ----------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self._waiting) + sum(
                not r.is_finished for r in self._loading.values()),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generation_tokens=self.num_generation_tokens,
            spec_decoding=self.spec_decoding_stats.copy(),
            kv_tier=self.connector.get_stats() if self.connector is not None else None,
        )

    def check_integrity(self) -> None:
        """Raise if requests, queues and block tables disagree."""
        self.kv_cache_manager.check_integrity()
        waiting = [entry[3] for entry in self._waiting]
        for request in waiting:
            if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise RuntimeError(f"{request.request_id} is waiting with status {request.status}")
            if request.request_id in self.kv_cache_manager.req_to_blocks:
                raise RuntimeError(f"waiting request {request.request_id} holds blocks")
            if request.num_steps_in_flight or request.num_output_placeholders:
                raise RuntimeError(f"waiting request {request.request_id} has a step in flight")
        if self._unknown_to_runner - {r.request_id for r in self.running}:
            raise RuntimeError("a request loaded from a tier is not running")
        for req_id, request in self._loading.items():
            if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS and not request.is_finished:
                raise RuntimeError(f"{req_id} is loading with status {request.status}")
            if req_id not in self.kv_cache_manager.req_to_blocks:
                raise RuntimeError(f"{req_id} is loading into no blocks")
        for request in self.running:
            if request.status != RequestStatus.RUNNING:
                raise RuntimeError(f"{request.request_id} is running with status {request.status}")
            num_placeholders = request.num_output_placeholders
            if request.num_computed_tokens > request.num_tokens_with_spec + num_placeholders:
                raise RuntimeError(
                    f"{request.request_id} computed {request.num_computed_tokens} tokens of "
                    f"{request.num_tokens} + {len(request.spec_token_ids)} drafts + "
                    f"{num_placeholders} placeholders"
                )
            if num_placeholders:  # each one is a sampling step in flight, within the limits
                if (num_placeholders > request.num_steps_in_flight
                        or not self.config.async_scheduling or request.spec_token_ids
                        or request.num_output_tokens + num_placeholders > request.max_tokens
                        or request.num_tokens + num_placeholders > self.config.max_model_len):
                    raise RuntimeError(
                        f"{request.request_id} has {num_placeholders} output placeholders, "
                        f"{request.num_steps_in_flight} steps in flight, "
                        f"{request.num_output_tokens} of {request.max_tokens} outputs and "
                        f"{request.num_tokens} tokens")
            # (A pooling request's prompt may fill the context: it generates nothing.)
            if (request.num_tokens_with_spec >= self.config.max_model_len
                    and request.pooling_params is None):
                raise RuntimeError(f"{request.request_id} has drafts past max_model_len")
            num_indexed = self.kv_cache_manager.num_cached_blocks.get(request.request_id, 0)
            if num_indexed > request.num_tokens // self.block_size:
                raise RuntimeError(
                    f"{request.request_id} has {num_indexed} blocks in the prefix-cache index but "
                    f"only {request.num_tokens} final tokens (draft tokens must not be indexed)"
                )
            tables = self.kv_cache_manager.req_to_blocks.get(request.request_id, ([],))
            num_blocks = len(tables[0])  # every group's table has the same length
            if num_blocks < cdiv(request.num_computed_tokens, self.block_size):
                raise RuntimeError(
                    f"{request.request_id} computed {request.num_computed_tokens} tokens "
                    f"but holds only {num_blocks} blocks"
                )
        loading = {r for r, req in self._loading.items() if not req.is_finished}
        live = ({r.request_id for r in waiting} | {r.request_id for r in self.running} | loading)
        if (len(live) != len(waiting) + len(self.running) + len(loading)
                or live != set(self.requests)):
            raise RuntimeError(f"queues {sorted(live)} != requests {sorted(self.requests)}")
        holders = {r.request_id for r in self.running} | set(self._loading)
        if set(self.kv_cache_manager.req_to_blocks) - holders:
            raise RuntimeError("a request that is neither running nor loading holds blocks")
