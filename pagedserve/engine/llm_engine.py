"""The engine: admission (validate, tokenize, fan out n), and the step loop.

Beside it: input_processing.py checks and tokenizes a request's input, admission.py holds
requests back while their grammar compiles or their LoRA adapter loads, startup.py does the
one-time work around the executor at start-up.

step() = schedule -> execute -> update -> detokenize. One request with n > 1 becomes n scheduler
requests that share the prompt's KV blocks through the prefix cache. With pipeline stages or async
scheduling, steps overlap: step N + 1 is scheduled and launched before step N's results are
applied (_step_with_batch_queue).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.stats import CudaGraphCounters, SchedulerStats
from pagedserve.engine.admission import AdmissionGate, HeldRequest
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.input_processing import (
    PromptType,
    checked_sampling_params,
    tokenize_prompt,
)
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.startup import (
    calibrate_outlier_channels,
    check_engine_config,
    create_kv_connector,
    describe_kv_cache_groups,
)
from pagedserve.engine.warmup import warm_up
from pagedserve.executor import Executor
from pagedserve.lora.peft import AdapterError, PeftAdapter
from pagedserve.lora.registry import Adapter, LoRARegistry
from pagedserve.lora.request import LoRARequest
from pagedserve.models.loader import load_model_config, resolve_model_path
from pagedserve.observability import memory
from pagedserve.observability.events import (
    AdmissionWaited,
    EventBus,
    RequestFinished,
    RequestQueued,
    StepFinished,
)
from pagedserve.observability.startup import startup_phase
from pagedserve.outputs import OutputKind, PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.manager import StructuredOutputManager
from pagedserve.tokenizer import Tokenizer
from pagedserve.worker.profiler import step_range

logger = logging.getLogger(__name__)

EngineOutput = RequestOutput | PoolingRequestOutput
"""What step() returns per request: generation's outputs, or a pooling request's one output."""


class EngineSleepingError(RuntimeError):
    """The engine is asleep (sleep mode): no request runs until wake_up."""


class EngineBusyError(ValueError):
    """sleep and update_weights need an idle engine: no request in flight."""


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        """tokenizer, model: already loaded ones to share (tests build many engines over one)."""
        self.config = config
        self._rss_at_start = memory.rss_bytes()
        self._tokenizer_bytes = 0
        """RSS growth while the tokenizer loaded (0 when it was handed in)."""
        if tokenizer is None:
            with startup_phase("tokenizer") as phase:
                tokenizer = Tokenizer.from_path(config.model_path)
                phase.detail = f"{tokenizer.vocab_size} tokens"
            self._tokenizer_bytes = max(0, (memory.rss_bytes() or 0) - (self._rss_at_start or 0))
        self.tokenizer = tokenizer
        # before the weights load: a bad config fails fast
        tier_options = check_engine_config(config, self.tokenizer)
        self.executor = Executor.create(config, model=model)
        with startup_phase("KV pool") as phase:
            num_blocks = self.executor.determine_num_kv_blocks()
            self.executor.initialize_kv_cache(num_blocks)
            kv_dtype = (config.device.dtype if config.cache.cache_dtype == "auto"
                        else config.cache.cache_dtype)  # auto may have chosen fp16 codes
            phase.detail = (f"{num_blocks} blocks of {config.cache.block_size} tokens = "
                            f"{num_blocks * config.cache.block_size} tokens of {kv_dtype} KV"
                            + describe_kv_cache_groups(
                                config.model.kv_cache_layout(config.cache.hybrid_kv_cache)))
        with startup_phase("outliers") as phase:
            phase.detail = calibrate_outlier_channels(self.executor, self.tokenizer, config,
                                                      num_blocks)
        self.events = EventBus()
        """Request, step and block events (observability/events.py); subscribe to observe."""
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks=num_blocks,
                                   connector=create_kv_connector(self.executor, config,
                                                                 tier_options, num_blocks),
                                   max_loras=config.lora.max_loras if config.lora else None,
                                   events=self.events,
                                   kv_cache_group_windows=config.model.kv_cache_layout(
                                       config.cache.hybrid_kv_cache).windows)
        self.lora_registry = (
            LoRARegistry(config.lora, config.model, self.executor.add_lora,
                         self.executor.remove_lora)
            if config.lora is not None else None)
        self._request_adapters: dict[str, int] = {}
        """Request id -> the LoRA adapter it holds until it finishes."""
        self._batch_queue: collections.deque[tuple[SchedulerOutput, Future, float, float]] = (
            collections.deque())
        """Steps in flight, oldest first, each with when its scheduling began and how long it
        took (more than one only with pipeline stages or async scheduling)."""
        self.max_steps_in_flight = self.executor.max_concurrent_batches
        """One per pipeline stage; two with async scheduling (step N + 1 is launched before N's
        results are applied); one otherwise."""
        if config.scheduler.async_scheduling:
            self.max_steps_in_flight = 2
        if self.max_steps_in_flight > 1:
            self.step = self._step_with_batch_queue
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = frozenset(config.model.eos_token_ids)
        self.structured_output_manager = StructuredOutputManager(
            self.tokenizer, config.model.vocab_size, config.model.eos_token_ids,
            config.structured_output,
        )
        self._admission = AdmissionGate(self.structured_output_manager, self.lora_registry)
        """Requests held back while their grammar compiles or their adapter loads."""
        self.cuda_graph_counters: CudaGraphCounters | None = None
        """Steps replayed from CUDA graphs and steps run eagerly, as the runner's outputs say
        (None until a step runs with graphs captured)."""
        self._request_counter = itertools.count()
        self.max_batches_in_flight = 0
        """Most steps seen in flight at once (more than one only with pipeline stages or async
        scheduling)."""
        self.num_overlapped_steps = 0
        """Steps (not empty) scheduled while an earlier step's results were not applied yet."""
        self._sleep_level = 0
        self._profiling = False
        """Between start_profile and stop_profile: steps carry named ranges in the trace."""

    def warm_up(self) -> None:
        """Pay the first steps' one-time costs now (engine/warmup.py), not in the first request;
        the server calls it before it answers /health. Leaves no trace: every KV block stays
        free, the prefix cache and the metrics never see the steps."""
        with startup_phase("warm-up") as phase:
            num_blocks = self.scheduler.kv_cache_manager.block_pool.num_blocks
            phase.detail = (warm_up(self.executor, self.config, num_blocks)
                            or "skipped: the KV pool or step budget is too small")
        self.assert_idle()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    # ---- admission --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request; raises ValueError (nothing queued) if it is invalid, and
        EngineSleepingError while the engine sleeps.
        params: SamplingParams to generate (default), PoolingParams to embed the prompt (the
        request finishes with one PoolingRequestOutput once its prompt is computed).
        lora_request: run with this LoRA adapter (registered and loaded on first use)."""
        if self.sleep_level:
            raise EngineSleepingError("the engine is sleeping: wake it up first")
        vocab_size = self.config.model.vocab_size
        text, prompt_token_ids = tokenize_prompt(prompt, self.tokenizer, vocab_size)
        if isinstance(params, PoolingParams):
            params.validate_for_hidden_size(self.config.model.hidden_size)
        else:
            params = checked_sampling_params(params, len(prompt_token_ids), self.tokenizer,
                                             vocab_size, self.config.scheduler.max_model_len)
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if request_id is None:
            request_id = f"req-{next(self._request_counter)}"
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        adapter = self._adapter_for(lora_request)

        if isinstance(params, PoolingParams):
            seq_params: dict[str, SamplingParams | PoolingParams] = {request_id: params}
        else:
            seq_params = {}
            for index in range(params.n):
                child = params.clone()
                child.n = 1
                if params.seed is not None:
                    child.seed = params.seed + index
                seq_params[request_id if params.n == 1 else f"{index}_{request_id}"] = child
        requests = [
            Request(
                request_id=seq_id,
                prompt_token_ids=prompt_token_ids,
                sampling_params=child if isinstance(child, SamplingParams) else None,
                pooling_params=child if isinstance(child, PoolingParams) else None,
                eos_token_ids=self.eos_token_ids,
                priority=priority,
                cache_salt=cache_salt,
                arrival_time=arrival_time,
                lora_int_id=adapter.lora_int_id if adapter else None,
                lora_digest=adapter.peft.digest if adapter else None,
            )
            for seq_id, child in seq_params.items()
        ]
        for request in requests:
            self.scheduler.check_request(request)
        grammar = None
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            grammar = self.structured_output_manager.request_grammar(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                self.structured_output_manager.compile_failed()
                raise ValueError(str(grammar.exception()))
        self.output_processor.add_request(
            request_id, text, prompt_token_ids, seq_params, output_kind, arrival_time
        )
        if self.events.enabled:
            lora_name = lora_request.lora_name if adapter else None
            for request in requests:
                if request.pooling_params is not None:  # it generates nothing, samples nothing
                    event = RequestQueued(request.request_id, request_id, arrival_time,
                                          request.num_prompt_tokens, 0, lora_name)
                else:
                    event = RequestQueued(
                        request.request_id, request_id, arrival_time, request.num_prompt_tokens,
                        request.max_tokens, lora_name, float(params.temperature),
                        float(params.top_p), params.n)
                self.events.emit(event)
        if adapter is not None:
            self.lora_registry.acquire(adapter)
            self._request_adapters[request_id] = adapter.lora_int_id
        if self._admission.must_hold(grammar, adapter):
            self._admission.hold(request_id, requests, grammar, adapter)
        else:
            self._schedule_requests(requests, grammar)
        self.events.publish()
        return request_id

    def _adapter_for(self, lora_request: LoRARequest | None) -> Adapter | None:
        if lora_request is None:
            return None
        return self._lora_registry().register(lora_request)

    def _schedule_requests(
        self, requests: list[Request], grammar: concurrent.futures.Future | None
    ) -> None:
        for request in requests:
            if grammar is not None:
                request.constraint = self.structured_output_manager.new_state(grammar.result())
            self.scheduler.add_request(request)

    def _admit_ready(self) -> list[EngineOutput]:
        """Hand held requests whose grammar is compiled and whose adapter is loaded to the
        scheduler; fail those whose grammar did not compile or ran past its budget, or whose
        adapter did not load. Returns the failed requests' final outputs."""
        if not self._admission:
            return []
        failed = []
        idle = not self.scheduler.has_unfinished_requests()
        for request_id, held in self._admission.poll(idle).items():
            if held.error is not None:
                self._emit_unscheduled_finished(held, "error")
                output = self.output_processor.fail_request(request_id, held.error)
                if output is not None:
                    failed.append(output)
                continue
            if self.events.enabled:
                for request in held.requests:
                    self.events.emit(AdmissionWaited(
                        request.request_id, held.since, held.until,
                        held.grammar is not None, held.adapter is not None))
            self._schedule_requests(held.requests, held.grammar)
        return self._release_adapters(failed)

    def _emit_unscheduled_finished(self, held: HeldRequest, reason: str) -> None:
        """Requests that end while held back never reach the scheduler, which emits the
        others' RequestFinished."""
        if self.events.enabled:
            now = time.monotonic()
            for request in held.requests:
                self.events.emit(RequestFinished(request.request_id, now, reason, 0))

    def abort_request(self, request_ids: str | Sequence[str]) -> list[EngineOutput]:
        """Abort requests (unknown or finished ids are ignored); returns their final outputs,
        whose unfinished sequences end with finish_reason "abort"."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        final_outputs = []
        for request_id in request_ids:
            held = self._admission.release(request_id)
            if held is not None:
                self._emit_unscheduled_finished(held, "abort")
            seq_ids = self.output_processor.sequence_ids(request_id)
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            output = self.output_processor.abort_request(request_id)
            if output is not None:
                final_outputs.append(output)
        self._release_finished_if_idle()
        self.events.publish()
        return self._release_adapters(final_outputs)

    @property
    def request_ids(self) -> list[str]:
        """Ids of the requests not finished yet."""
        return list(self.output_processor.requests)

    # ---- the loop ---------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        failed_outputs = self._admit_ready()
        start = time.monotonic()
        with step_range("pagedserve::schedule", self._profiling):
            scheduler_output = self._schedule()
        scheduled = time.monotonic()
        with step_range("pagedserve::execute_model", self._profiling):
            runner_output = self.executor.execute_model(scheduler_output)
        executed = time.monotonic()
        with step_range("pagedserve::update", self._profiling):
            outputs = failed_outputs + self._update_from_output(scheduler_output, runner_output)
        if self.events.enabled and not scheduler_output.is_empty:
            self._emit_step(scheduler_output, runner_output, start, scheduled - start, executed)
        self.events.publish()
        return outputs

    def _step_with_batch_queue(self) -> list[EngineOutput]:
        """step() with steps in flight: schedule and launch step N + 1, then wait for step N and
        apply its results.

        Pipeline stages keep up to one batch per stage in flight, so stage 0 computes batch
        i + 1 while stage 1 computes batch i. A request is in one batch at a time (its next
        token is not known before), so the running requests are spread over the batches; a
        prompt's chunks may follow each other down the pipeline.
        Async scheduling keeps two: the device computes step N while the host schedules and
        prepares N + 1, in which a request that samples in N decodes that token, still a
        placeholder (core/scheduler.py; the runner fills it in on the device)."""
        failed_outputs = self._admit_ready()
        queue = self._batch_queue
        if len(queue) < self.max_steps_in_flight:
            start = time.monotonic()
            with step_range("pagedserve::schedule", self._profiling):
                scheduler_output = self._schedule()
            schedule_s = time.monotonic() - start
            if not scheduler_output.is_empty or scheduler_output.finished_req_ids or not queue:
                if queue and not scheduler_output.is_empty:
                    self.num_overlapped_steps += 1
                queue.append((scheduler_output, self.executor.submit(scheduler_output),
                              start, schedule_s))
                self.max_batches_in_flight = max(self.max_batches_in_flight, len(queue))
            # An empty step launches nothing: wait for the oldest (its results may unblock the
            # requests, e.g. one that waits for blocks only the steps in flight can free).
            if not scheduler_output.is_empty and len(queue) < self.max_steps_in_flight:
                self.events.publish()
                return failed_outputs  # fill the pipeline before waiting on its oldest batch
        scheduler_output, future, start, schedule_s = queue.popleft()
        with step_range("pagedserve::execute_model", self._profiling):
            runner_output = future.result()
        executed = time.monotonic()
        with step_range("pagedserve::update", self._profiling):
            outputs = failed_outputs + self._update_from_output(scheduler_output, runner_output)
        if self.events.enabled and not scheduler_output.is_empty:
            self._emit_step(scheduler_output, runner_output, start, schedule_s, executed)
        self.events.publish()
        return outputs

    def _emit_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                   start: float, schedule_s: float, executed: float) -> None:
        timings = runner_output.timings
        num_requests = len(scheduler_output.num_scheduled_tokens)
        end = time.monotonic()
        self.events.emit(StepFinished(
            step=scheduler_output.step_index, start=start, end=end,
            num_requests=num_requests,
            num_prefill_requests=scheduler_output.num_prefill_requests,
            num_decode_requests=num_requests - scheduler_output.num_prefill_requests,
            num_prefill_tokens=scheduler_output.num_prefill_tokens,
            num_decode_tokens=(scheduler_output.total_num_scheduled_tokens
                               - scheduler_output.num_prefill_tokens),
            num_preempted=sum(1 for r in scheduler_output.finished_req_ids
                              if r in self.scheduler.requests),
            schedule_s=schedule_s,
            prepare_s=timings.prepare_s if timings else 0.0,
            forward_s=timings.forward_s if timings else 0.0,
            logits_s=timings.logits_s if timings else 0.0,
            sample_s=timings.sample_s if timings else 0.0,
            output_s=end - executed))

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        scheduler_output.grammar = self.structured_output_manager.grammar_bitmask(
            self.scheduler.requests, scheduler_output)
        return scheduler_output

    def _update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineOutput]:
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._count_cuda_graph_step(scheduler_output, runner_output)
        processed = self.output_processor.process_outputs(core_outputs)
        for seq_id, stop_str in processed.stopped_by_string.items():
            self.scheduler.finish_requests([seq_id], RequestStatus.FINISHED_STOPPED, stop_str)
        self._release_finished_if_idle()
        return self._release_adapters(processed.request_outputs)

    def _count_cuda_graph_step(self, scheduler_output: SchedulerOutput,
                               runner_output: ModelRunnerOutput) -> None:
        size, reason = runner_output.cuda_graph_size, runner_output.eager_reason
        if size is None and reason is None:
            return
        if self.cuda_graph_counters is None:
            self.cuda_graph_counters = CudaGraphCounters()
        if size is not None:
            self.cuda_graph_counters.observe_replay(
                size, scheduler_output.total_num_scheduled_tokens)
        else:
            self.cuda_graph_counters.observe_eager(reason)

    def _release_adapters(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """Let go of the adapters of the requests that finished among `outputs`."""
        if self._request_adapters:
            for output in outputs:
                if output.finished and output.request_id in self._request_adapters:
                    self.lora_registry.release(self._request_adapters.pop(output.request_id))
        return outputs

    def _release_finished_if_idle(self) -> None:
        """Finished requests' runner state (draft KV) normally goes with the next step's
        SchedulerOutput; with nothing left to run there is no next step, so send it now, in an
        empty step of its own."""
        if not self.scheduler.has_unfinished_requests() and not self._batch_queue:
            finished_req_ids = self.scheduler.take_finished_req_ids()
            if finished_req_ids:
                empty = SchedulerOutput.empty(finished_req_ids)
                # Its output can only carry KV tier counters (no request runs): keep them.
                self.scheduler.update_from_output(empty, self.executor.execute_model(empty))

    def has_unfinished_requests(self) -> bool:
        return (bool(self._admission) or bool(self._batch_queue)
                or self.scheduler.has_unfinished_requests())

    @property
    def num_awaiting_grammar(self) -> int:
        """Requests held back while their grammar compiles."""
        return self._admission.num_compiling

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        stats.num_waiting_reqs += len(self._admission)
        stats.structured_output = self.structured_output_manager.stats()
        stats.cuda_graphs = self.cuda_graph_counters
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def expert_load(self) -> dict[int, list[int]]:
        """An MoE model's expert load: layer index -> the (token, expert) pairs each expert of
        the layer has served since start-up (tokens x top_k per layer in all); {} for a dense
        model. Read between steps."""
        return self.executor.expert_load()

    def memory_breakdown(self) -> dict:
        """Where the memory went (observability/memory.py): tensors by part on every rank, the
        tokenizer and the runtime peak by RSS growth, the KV pool's blocks, and how many
        requests of each context length fit."""
        breakdown = memory.combine_breakdown(self._rss_at_start, self._tokenizer_bytes,
                                             self.executor.memory_report(), {})
        pool = self.scheduler.kv_cache_manager.block_pool
        num_free = pool.num_free_blocks
        num_cached_free = pool.num_cached_free_blocks
        kv_bytes = breakdown["components"].get("kv_pool", 0)
        bytes_per_block = kv_bytes // pool.num_blocks if kv_bytes else 0
        breakdown["kv_pool"] = {
            "num_blocks": pool.num_blocks, "block_size": self.config.cache.block_size,
            "bytes_per_block": bytes_per_block,
            "bytes_per_token": bytes_per_block // self.config.cache.block_size,
            "resident_bytes": breakdown["resident_bytes"].get("kv_pool"),
            "used_blocks": pool.num_usable_blocks - num_free,
            "cached_free_blocks": num_cached_free, "free_blocks": num_free - num_cached_free}
        breakdown["grammar_cache"] = {
            "entries": self.structured_output_manager.num_cached_grammars,
            "bytes": None}  # llguidance does not report the size of a compiled grammar
        manager = self.scheduler.kv_cache_manager
        breakdown["kv_pool"]["kv_cache_group_windows"] = list(manager.group_windows)
        breakdown["capacity"] = memory.capacity_report(
            pool.num_blocks, self.config.cache.block_size, self.config.scheduler.max_model_len,
            bytes_per_block, manager.max_blocks_for)
        return breakdown

    # ---- LoRA adapters ----------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter and load it into the workers now (blocking); raises ValueError
        for a bad adapter, leaving nothing registered."""
        load = self.start_adding_lora(lora_request)
        if load is not None:
            concurrent.futures.wait([load])
        self.finish_adding_lora(lora_request.lora_name)
        return True

    def start_adding_lora(self, lora_request: LoRARequest, peft: PeftAdapter | None = None
                          ) -> concurrent.futures.Future | None:
        """Register an adapter and start loading it (the server's half of add_lora: it waits
        for the returned load off the engine thread, then calls finish_adding_lora). peft: the
        adapter already checked (LoRARegistry.inspect). None: no load started, because every
        loaded adapter is in use (it loads when a request needs it)."""
        registry = self._lora_registry()
        return registry.start_load(registry.register(lora_request, peft))

    def finish_adding_lora(self, lora_name: str) -> None:
        """After start_adding_lora's load ended: if it failed, forget the adapter and raise."""
        registry = self._lora_registry()
        registry.poll()
        adapter = registry.get(lora_name)
        if adapter is not None and adapter.load_error is not None and not adapter.loaded:
            error = adapter.load_error
            registry.unregister(lora_name)
            raise AdapterError(f"LoRA adapter {lora_name!r} failed to load: {error}")

    def remove_lora_by_name(self, lora_name: str) -> None:
        """Forget an adapter; AdapterError if unknown or in use."""
        registry = self._lora_registry()
        registry.poll()
        registry.unregister(lora_name)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if it is unknown. Raises ValueError while requests use it."""
        adapter = self._lora_registry().get_by_id(lora_int_id)
        if adapter is None:
            return False
        self.remove_lora_by_name(adapter.name)
        return True

    def list_loras(self) -> set[int]:
        """Ids of the registered adapters."""
        return {a.lora_int_id for a in self._lora_registry().adapters}

    def _lora_registry(self) -> LoRARegistry:
        if self.lora_registry is None:
            raise ValueError("this engine serves no LoRA adapters (start it with enable_lora)")
        return self.lora_registry

    # ---- lifecycle: sleep mode and weight reload --------------------------------------------
    # Each needs an idle engine (EngineBusyError otherwise: the caller drains or aborts first,
    # so no request's KV vanishes under it), and each forgets the prefix cache: its blocks'
    # KV is gone (sleep) or was computed by other weights (update_weights). The KV tiers keep
    # their blocks (they are keyed by token hashes; after update_weights they no longer match
    # the weights, so an engine with tiers refuses update_weights).

    @property
    def sleep_level(self) -> int:
        """0: awake; 1 or 2: asleep at that level (see sleep)."""
        return self._sleep_level

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def sleep(self, level: int = 1) -> None:
        """Free memory while idle (needs enable_sleep_mode). Level 1 frees the KV pool (and a
        draft model's KV) and keeps the weights in host memory; level 2 frees the weights too,
        and wake_up reloads them from the model file. Until wake_up, add_request raises
        EngineSleepingError. Sleeping again at a deeper level frees the rest; at the same or a
        lighter level it does nothing."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._check_idle_for("sleep")
        if level <= self.sleep_level:
            return
        if not self.is_sleeping:
            self._forget_prefix_cache()
        self.executor.sleep(level)
        self._sleep_level = level
        logger.info("sleeping at level %d", level)

    def wake_up(self) -> None:
        """Reallocate the KV pool (empty) and bring the weights back; a no-op when awake."""
        if not self.is_sleeping:
            return
        self.executor.wake_up()
        self._sleep_level = 0
        logger.info("awake")

    def update_weights(self, model_path: str) -> None:
        """Serve the weights of `model_path` from now on: a model file of the same architecture,
        shape and vocabulary (ValueError, old weights kept, if not). Needs an awake, idle engine;
        the prefix cache is forgotten."""
        if self.is_sleeping:
            raise ValueError("the engine is sleeping: wake it up before updating the weights")
        if self.config.kv_transfer is not None:
            raise ValueError("cannot update the weights of an engine with KV tiers: the tiers "
                             "hold KV computed by the current weights")
        self._check_idle_for("update the weights")
        try:
            path = resolve_model_path(model_path)
            new_config = load_model_config(path)
            new_tokenizer = Tokenizer.from_path(path)
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"cannot read a model from {model_path!r}: {error}") from None
        current = self.config.model
        differing = [name for name in current.__dataclass_fields__
                     if name != "name" and getattr(current, name) != getattr(new_config, name)]
        if differing:
            raise ValueError(
                f"{model_path!r} is not the same model shape: " + ", ".join(
                    f"{name} {getattr(new_config, name)!r} (serving {getattr(current, name)!r})"
                    for name in differing))
        if new_tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"{model_path!r} has another vocabulary than the served model")
        self._forget_prefix_cache()
        self.executor.update_weights(path)
        logger.info("serving the weights of %s", path)

    def _check_idle_for(self, action: str) -> None:
        if self.has_unfinished_requests():
            num_requests = len(self.output_processor.requests)
            raise EngineBusyError(f"cannot {action} while requests are in flight "
                                  f"({num_requests}): wait for them to finish or abort them")

    def _forget_prefix_cache(self) -> None:
        reset = self.reset_prefix_cache()
        assert reset, "an idle engine's prefix cache held blocks"  # the caller checked idle

    # ---- the profiler (vLLM's start_profile / stop_profile) -----------------------------------

    @property
    def is_profiling(self) -> bool:
        return self._profiling

    def start_profile(self) -> None:
        """Start torch.profiler on every rank, on the thread that runs its steps (call this on
        the thread that calls step()). ValueError if profiling is off (no profiler_dir) or
        already running; requests may be in flight."""
        if self.config.profiler is None:
            raise ValueError("profiling is off: start the engine with profiler_dir "
                             "(--profiler-dir DIR, or VLLM_TORCH_PROFILER_DIR=DIR)")
        if self._profiling:
            raise ValueError("the profiler is already running: stop it first (stop_profile)")
        self.executor.start_profile()
        self._profiling = True
        logger.info("profiling; traces go to %s", self.config.profiler.trace_dir)

    def stop_profile(self) -> list[str]:
        """Stop the profiler and write one Chrome trace per rank; returns their paths, by rank.
        ValueError if it is not running."""
        if not self._profiling:
            raise ValueError("the profiler is not running: start it first (start_profile)")
        self._profiling = False
        paths = self.executor.stop_profile()
        logger.info("profiler traces written: %s", ", ".join(paths))
        return paths

    def shutdown(self) -> None:
        """Stop the workers (their processes, with more than one rank); safe to call twice."""
        if self.config.scheduler.async_scheduling:
            # Wait for the steps still in flight (one process: their futures resolve here), so
            # none of their kernels or copies runs while the worker lets go of the device.
            while self._batch_queue:
                _, future, _, _ = self._batch_queue.popleft()
                future.exception()
        if self.lora_registry is not None:
            self.lora_registry.shutdown()
        self.executor.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
        self.structured_output_manager.shutdown()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def assert_idle(self) -> None:
        """Raise unless every block is free and every queue empty (tests call this after each run)."""
        self.scheduler.check_integrity()
        pool = self.scheduler.kv_cache_manager.block_pool
        problems = []
        if self.scheduler.has_unfinished_requests():
            problems.append(f"{len(self.scheduler.requests)} requests still queued")
        if self._admission:
            problems.append(f"{len(self._admission)} requests still await their grammar or "
                            f"adapter")
        if self.lora_registry is not None:
            problems += self.lora_registry.check_idle()
        if pool.num_free_blocks != pool.num_usable_blocks:
            problems.append(f"{pool.num_usable_blocks - pool.num_free_blocks} KV blocks still held")
        if self.output_processor.requests:
            problems.append(f"{len(self.output_processor.requests)} output states left")
        if self._batch_queue:
            problems.append(f"{len(self._batch_queue)} steps still in flight")
        problems += self.executor.check_idle()
        if problems:
            raise RuntimeError("engine not idle: " + "; ".join(problems))
