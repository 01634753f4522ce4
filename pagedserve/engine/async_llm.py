"""Serves many concurrent callers from one engine.

The engine steps in one background thread; everything that touches it (adding, aborting, stepping)
runs there, fed through a command queue. Callers on an asyncio loop await a per-request queue of
DELTA outputs. torch releases the GIL inside its kernels, so the HTTP side runs while the model
computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import torch

from pagedserve.core.stats import SchedulerStats
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm_engine import EngineSleepingError, LLMEngine, PromptType
from pagedserve.executor import ExecutorError
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import OutputKind, PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

_IDLE_POLL_SECONDS = 1.0
"""How often an idle engine thread reports stats (gauges stay fresh)."""

SMALL_BATCH_MAX_REQUESTS = 8
"""Decode steps of at most this many requests may leave one CPU to the HTTP side
(SmallStepThreads measures whether that pays)."""


class SmallStepThreads:
    """How many threads small decode steps get: all the engine's, or one fewer, whichever runs
    them faster here, measured while serving.

    The event loop (SSE, JSON) runs in this process and the clients often on the same machine;
    when they take a core, torch's OpenMP workers stall at every parallel region of the step. A
    small decode step is bound by memory and op dispatch, so a core left to the HTTP side may
    cost it less than the stalls do, or more: it depends on the CPU and the kernels. Measured
    served at one stream: on an AVX-512 machine with the compiled decoder stack 11.4 ms per token
    on 2 threads and 6.8 ms on 1; on a 2-core AMD EPYC Zen 3 with the AVX2 integer kernels 1 thread
    lost (10.8 ms against ~9.5 ms; at 8 streams 120 output tok/s against ~140). So the two counts
    take turns for `trial_steps` small steps each, and the one with the lower median step time
    serves the next `retrial_steps` small steps; then they are measured again (the load may have
    changed). Big steps (many decodes, or a prompt waiting to be prefilled) are compute-bound
    and always take every thread.
    """

    def __init__(self, full_threads: int, trial_steps: int = 24, retrial_steps: int = 4096) -> None:
        self.candidates = (full_threads, full_threads - 1) if full_threads > 1 else (full_threads,)
        self.trial_steps = trial_steps
        self.retrial_steps = retrial_steps
        self.chosen: int | None = None if len(self.candidates) > 1 else full_threads
        self._times: dict[int, list[float]] = {count: [] for count in self.candidates}
        self._served = 0

    def next(self) -> int:
        """The thread count for the next small step."""
        if self.chosen is not None:
            return self.chosen
        return min(self.candidates, key=lambda count: len(self._times[count]))  # take turns

    def record(self, threads: int, seconds: float) -> None:
        """A small step ran on `threads` threads in `seconds`."""
        if len(self.candidates) == 1:
            return
        if self.chosen is not None:
            self._served += 1
            if self._served >= self.retrial_steps:
                self.chosen, self._served = None, 0
                self._times = {count: [] for count in self.candidates}
            return
        self._times[threads].append(seconds)
        if all(len(times) >= self.trial_steps for times in self._times.values()):
            medians = {count: sorted(times)[len(times) // 2] for count, times in self._times.items()}
            self.chosen = min(self.candidates, key=lambda count: medians[count])
            logger.debug("small decode steps: %d threads (median step %s)", self.chosen,
                         {count: f"{1e3 * t:.2f} ms" for count, t in medians.items()})


def load_engine(engine_args: EngineArgs, warm_up: bool = True) -> LLMEngine:
    """Build (and warm up) the engine an AsyncLLM will run, in a thread that exits afterwards.

    OpenMP (libgomp, torch's CPU threads) keeps a pool of worker threads per thread that ever
    ran a parallel region, until that thread exits, and when the pools hold more threads than
    the machine has CPUs it makes every worker sleep at once after each region instead of
    spinning. Loading in the caller's thread (the server's event loop, alive for good) left
    such a pool beside the engine thread's: each of a decode step's ~200 parallel regions then
    woke its worker from sleep. Measured in one process on a 2-core AMD EPYC Zen 3, a batch-1
    decode step took 7.9-8.5 ms, and 9.1-13.9 ms once another live thread had run one parallel
    region. The loading thread's pool goes with it, so the engine thread's is the only one."""

    def build() -> LLMEngine:
        engine = LLMEngine.from_engine_args(engine_args)
        if warm_up:
            engine.warm_up()
        return engine

    # Leaving the block joins the pool's one thread; result() re-raises a loading error here.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-load") as pool:
        return pool.submit(build).result()


class StatLogger(Protocol):
    """Called from the engine thread; must be thread-safe and quick."""

    def record_step(self, stats: SchedulerStats, now: float) -> None: ...

    def record_output(self, output: RequestOutput, now: float) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine loop crashed; no request can be served any more."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine, stat_loggers: list[StatLogger] | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.config.model
        self.max_model_len = engine.config.scheduler.max_model_len
        self.stat_loggers = list(stat_loggers or [])
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # request id -> (the caller's loop, its output queue); touched by the engine thread only
        self._consumers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.get_stats()
        self._num_unfinished = 0
        self._stop = False
        self.is_draining = False
        self.errored = False
        self._full_threads = torch.get_num_threads()
        self._small_step_threads = SmallStepThreads(self._full_threads)
        self._threads = self._full_threads
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, stat_loggers: list[StatLogger] | None = None
    ) -> AsyncLLM:
        return cls(load_engine(engine_args, warm_up=False), stat_loggers)

    # ---- the caller's side ------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield DELTA outputs until the request finishes.

        Raises ValueError for bad input before anything is yielded. Stopping the iteration early
        (the client went away) aborts the request and frees its blocks.
        """
        stream = self._run_request(prompt, params, request_id, priority, cache_salt,
                                   lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()  # now, not at garbage collection: it aborts the request

    async def encode(
        self,
        prompt: PromptType,
        params: PoolingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's name: yield the pooling request's one output (finished, with its vector) once
        its prompt is computed. Bad input raises ValueError; stopping early aborts it."""
        stream = self._run_request(prompt, params, request_id, priority, None, lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def _run_request(
        self, prompt: PromptType, params: SamplingParams | PoolingParams, request_id: str | None,
        priority: int, cache_salt: str | None, lora_request: LoRARequest | None,
    ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        if self.errored:
            raise EngineDeadError("the engine loop has failed")
        if self.is_draining:
            raise EngineDrainingError("the server is shutting down")
        if self.engine.is_sleeping:  # the engine checks again in add_request (it may fall asleep)
            raise EngineSleepingError("the engine is sleeping: wake it up first")
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def add() -> None:
            self.engine.add_request(
                request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                output_kind=OutputKind.DELTA, lora_request=lora_request,
            )
            self._consumers[request_id] = (loop, outputs)
            # Counted now, not at the stats refresh after the next step: that step hands the
            # first token out before the refresh, and a drain that starts in between (a
            # SIGTERM on seeing the token) would find nothing unfinished and stop at once.
            self._num_unfinished += 1

        finished = False
        try:
            # Inside the try: a caller cancelled while the add is in flight still aborts it
            # (aborting an id the engine never saw is a no-op).
            await self._call(add)
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    # Failed before any token (its grammar did not compile, its adapter did
                    # not load): bad input.
                    raise ValueError(item.error)
                yield item
        finally:
            if not finished:
                self._submit(lambda: self._abort(request_id))

    # ---- lifecycle: sleep mode, prefix cache, weights (run in the engine thread) -------------

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    async def sleep(self, level: int = 1) -> None:
        """LLMEngine.sleep: EngineBusyError while requests are in flight (no waiting)."""
        await self._call(lambda: self.engine.sleep(level))

    async def wake_up(self) -> None:
        await self._call(self.engine.wake_up)

    async def reset_prefix_cache(self) -> bool:
        """False while requests hold blocks."""
        return await self._call(self.engine.reset_prefix_cache)

    async def update_weights(self, model_path: str) -> None:
        """LLMEngine.update_weights. The engine thread loads the file (seconds for a real
        model); HTTP requests are still answered meanwhile, new generations wait in line."""
        await self._call(lambda: self.engine.update_weights(model_path))

    async def start_profile(self) -> None:
        """LLMEngine.start_profile, in the engine thread (where the model runs, in one
        process): ValueError if profiling is off or already running."""
        await self._call(self.engine.start_profile)

    async def stop_profile(self) -> list[str]:
        """Stop the profiler; the paths of the traces written, one per rank."""
        return await self._call(self.engine.stop_profile)

    def validate_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError saying what is wrong unless the constraint compiles. Thread-safe and
        off the engine thread: the server checks a request before it is queued."""
        self.engine.structured_output_manager.validate(params)

    async def add_lora(self, lora_request: LoRARequest, lora_dir: str | None = None) -> None:
        """Check an adapter (off the engine thread), register it and load it into the workers
        while steps go on; raises ValueError (nothing kept) if it cannot be served. lora_dir:
        its files must lie inside (no traversal, no symlink out)."""
        registry = self.engine.lora_registry
        if registry is None:
            raise ValueError("this engine serves no LoRA adapters (start it with --enable-lora)")
        peft = await asyncio.to_thread(registry.inspect, lora_request, lora_dir)
        load = await self._call(lambda: self.engine.start_adding_lora(lora_request, peft))
        if load is not None:
            await asyncio.wait([asyncio.wrap_future(load)])
        await self._call(lambda: self.engine.finish_adding_lora(lora_request.lora_name))

    async def remove_lora(self, lora_name: str) -> None:
        """Forget an adapter; ValueError if unknown or still used by a request."""
        await self._call(lambda: self.engine.remove_lora_by_name(lora_name))

    async def memory_breakdown(self) -> dict:
        """LLMEngine.memory_breakdown, read between steps (the block pool changes in them)."""
        return await self._call(self.engine.memory_breakdown)

    async def expert_load(self) -> dict[int, list[int]]:
        """LLMEngine.expert_load, read between steps."""
        return await self._call(self.engine.expert_load)

    async def abort(self, request_id: str) -> None:
        await self._call(lambda: self._abort(request_id))

    def get_stats(self) -> SchedulerStats:
        return self._stats

    def num_unfinished_requests(self) -> int:
        return self._num_unfinished

    def num_waiting_requests(self) -> int:
        return self._stats.num_waiting_reqs

    def check_idle(self) -> None:
        """Raise unless the engine holds no request and no block (run in the engine thread)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(lambda: future.set_result(self.engine.assert_idle()), future)
        future.result(timeout=30)

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Refuse new requests, let running ones finish for up to drain_timeout seconds, abort
        the rest (their callers see finish_reason "abort"), then stop the engine thread."""
        if self._stop:
            return
        self.is_draining = True
        deadline = None if drain_timeout is None else time.monotonic() + drain_timeout
        while (self._num_unfinished and not self.errored
               and (deadline is None or time.monotonic() < deadline)):
            await asyncio.sleep(0.05)
        if not self.errored:
            try:
                await self._call(self._abort_all)
            except EngineDeadError:
                pass
        self._stop = True
        self._submit(lambda: None)  # wake the thread so it sees _stop
        await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self.engine.shutdown)  # stops the worker processes, if any

    # ---- plumbing ---------------------------------------------------------------------------

    def _submit(
        self, command: Callable[[], Any], future: concurrent.futures.Future | None = None
    ) -> None:
        """Queue `command` for the engine thread. Its exception goes to `future` (or the log);
        it never stops the loop."""

        def guarded() -> None:
            try:
                command()
            except Exception as error:
                if future is None:
                    logger.exception("engine command failed")
                elif not future.done():
                    future.set_exception(error)

        self._commands.put(guarded)

    async def _call(self, command: Callable[[], Any]) -> Any:
        """Run `command` in the engine thread and return its result; its exception is re-raised
        here."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def wrapped() -> None:
            future.set_result(command())

        self._submit(wrapped, future)
        waiting = asyncio.wrap_future(future)
        while not future.done():
            # A dead engine thread runs nothing more: do not wait for it forever.
            await asyncio.wait([waiting], timeout=_IDLE_POLL_SECONDS)
            if not future.done() and self.errored:
                waiting.cancel()
                raise EngineDeadError("the engine loop has failed")
        return await waiting

    def _abort(self, request_id: str) -> None:
        self._deliver_all(self.engine.abort_request(request_id))
        self._consumers.pop(request_id, None)

    def _abort_all(self) -> None:
        self._deliver_all(self.engine.abort_request(self.engine.request_ids))

    def _deliver_all(self, outputs: list[RequestOutput | PoolingRequestOutput]) -> None:
        """Hand outputs to their callers: one wake-up per event loop per step, not per output
        (at 32 streams this keeps the HTTP side's share of the two cores down)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        now = time.monotonic()
        for output in outputs:
            consumer = self._consumers.get(output.request_id)
            if consumer is not None:
                loop, queue_ = consumer
                batches.setdefault(loop, []).append((queue_, output))
                if output.finished:
                    del self._consumers[output.request_id]
            if isinstance(output, PoolingRequestOutput):
                continue  # the per-request stats are generation's (TTFT, ITL, tokens out)
            for stat_logger in self.stat_loggers:
                stat_logger.record_output(output, now)
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_POLL_SECONDS) if block else None
            while True:
                if command is not None:
                    command()
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _pick_threads(self) -> bool:
        """Set torch's thread count for the next step; True when it is a small decode step
        (SmallStepThreads picks its count)."""
        scheduler = self.engine.scheduler
        small = (scheduler.num_waiting == 0
                 and len(scheduler.running) <= SMALL_BATCH_MAX_REQUESTS)
        wanted = self._small_step_threads.next() if small else self._full_threads
        if wanted != self._threads:
            torch.set_num_threads(wanted)
            self._threads = wanted
        return small

    def _run(self) -> None:
        try:
            while not self._stop:
                self._run_commands(block=not self.engine.has_unfinished_requests())
                if self.engine.executor.is_failed:  # a worker died while nothing was running
                    raise ExecutorError("the data plane failed; see the log for which worker")
                if self.engine.has_unfinished_requests():
                    small = self._pick_threads()
                    started = time.perf_counter()
                    outputs = self.engine.step()
                    if small:
                        self._small_step_threads.record(self._threads,
                                                        time.perf_counter() - started)
                    self._deliver_all(outputs)
                self._stats = self.engine.get_stats()
                self._num_unfinished = self._stats.num_running_reqs + self._stats.num_waiting_reqs
                now = time.monotonic()
                for stat_logger in self.stat_loggers:
                    stat_logger.record_step(self._stats, now)
        except BaseException as error:
            logger.exception("engine loop failed")
            self.errored = True
            dead = EngineDeadError(f"the engine loop failed: {error!r}")
            for loop, outputs in self._consumers.values():
                loop.call_soon_threadsafe(outputs.put_nowait, dead)
            self._consumers.clear()


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)
