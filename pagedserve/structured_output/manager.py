"""The engine's structured output manager: compiles grammars off the engine loop, caches them,
and fills each step's token bitmask for the scheduled constrained requests.

A request whose grammar is not compiled yet waits in the engine (not in the scheduler), so the
loop keeps serving everyone else; a grammar that fails or runs past its time budget fails only the
requests that asked for it. Compiled grammars are llguidance matchers in their initial state,
kept in a bounded LRU cache keyed by (kind, text); each request deep-copies one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from pagedserve.config import StructuredOutputConfig
from pagedserve.core.outputs import GrammarOutput, SchedulerOutput
from pagedserve.request import Request
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_output.stats import RECENT_OBSERVATIONS, StructuredOutputStats
from pagedserve.tokenizer import Tokenizer

GrammarKey = tuple[str, str]
"""(kind, text), from StructuredOutputsParams.spec()."""


class GrammarCompileError(ValueError):
    """A constraint that did not compile or ran past the budget; the message says which."""


@dataclass
class _Timings:
    """Observed durations; compile times arrive from pool threads, hence the lock."""

    recent: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_OBSERVATIONS))
    count: int = 0
    total: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, seconds: float) -> None:
        with self.lock:
            self.recent.append(seconds)
            self.count += 1
            self.total += seconds

    def snapshot(self) -> tuple[int, float, tuple[float, ...]]:
        with self.lock:
            return self.count, self.total, tuple(self.recent)


class StructuredOutputManager:
    """Owned by one engine. Every method but `validate` runs on the engine thread; compiles run
    in a small pool and touch only the cache (under a lock)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 config: StructuredOutputConfig | None = None) -> None:
        self.config = config or StructuredOutputConfig()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._backend = None
        self._backend_lock = threading.Lock()
        self._cache: collections.OrderedDict[GrammarKey, object] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._inflight: dict[GrammarKey, concurrent.futures.Future] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._compile_times = _Timings()
        self._mask_times = _Timings()
        self._num_compile_failures = 0
        self._num_cache_hits = 0
        self.num_constrained_requests = 0

    @property
    def backend(self):
        """Built on first use: it reads the whole vocabulary (~0.2 s), which engines that never
        see a constrained request should not pay."""
        with self._backend_lock:
            if self._backend is None:
                from pagedserve.structured_output.backend import LLGuidanceBackend

                self._backend = LLGuidanceBackend(self._tokenizer, self._vocab_size,
                                                  self._eos_token_ids)
            return self._backend

    # ---- admission ----------------------------------------------------------------------------

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError (GrammarError) saying what is wrong unless the constraint compiles.
        Thread-safe: the API server calls it before a request reaches the engine."""
        if self._cached(params.spec(), touch=False) is not None:
            return
        self.backend.validate(*params.spec())

    def request_grammar(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the compiled grammar; already done on a cache hit. Concurrent requests
        for one constraint share one compile."""
        key = params.spec()
        template = self._cached(key, touch=True)
        if template is not None:
            self._num_cache_hits += 1
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(template)
            return future
        future = self._inflight.get(key)
        if future is None:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.config.num_compile_threads, thread_name_prefix="pagedserve-grammar")
            future = self._pool.submit(self._compile, key)
            self._inflight[key] = future
            future.add_done_callback(lambda _, key=key: self._inflight.pop(key, None))
        return future

    def new_state(self, template):
        """A fresh per-request grammar state from a compiled template."""
        from pagedserve.structured_output.grammar import GrammarState

        self.num_constrained_requests += 1
        return GrammarState(template.deep_copy())

    def compile_failed(self) -> None:
        """Count a request that failed on its grammar (error or timeout)."""
        self._num_compile_failures += 1

    def _compile(self, key: GrammarKey):
        backend = self.backend  # built outside the timing: once per engine, not per grammar
        start = time.perf_counter()
        try:
            template = backend.compile(*key)
        finally:
            self._compile_times.observe(time.perf_counter() - start)
        with self._cache_lock:
            self._cache[key] = template
            self._cache.move_to_end(key)
            while len(self._cache) > self.config.max_cached_grammars:
                self._cache.popitem(last=False)
        return template

    def _cached(self, key: GrammarKey, touch: bool):
        with self._cache_lock:
            template = self._cache.get(key)
            if template is not None and touch:
                self._cache.move_to_end(key)
            return template

    @property
    def num_cached_grammars(self) -> int:
        with self._cache_lock:
            return len(self._cache)

    # ---- each step ----------------------------------------------------------------------------

    def grammar_bitmask(self, requests: dict[str, Request],
                        scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The bitmask rows of the constrained requests that sample this step (None if none).

        A request samples when its every known token has KV after this step (mid-prompt chunks
        do not); one with drafts gets a row per draft position plus the bonus row.
        """
        sampling = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if (request is None or request.constraint is None
                    or request.num_computed_tokens < request.num_tokens):
                continue
            sampling.append((req_id, request.constraint,
                             scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])))
        if not sampling:
            return None
        start = time.perf_counter()
        backend = self.backend
        num_rows = sum(1 + len(drafts) for _, _, drafts in sampling)
        bitmask = np.full((num_rows, backend.num_bitmask_words), -1, dtype=np.int32)
        first_row, row = {}, 0
        for req_id, state, drafts in sampling:
            first_row[req_id] = row
            if drafts:
                state.fill_bitmasks_with_drafts(bitmask, row, backend.num_tokenizer_words, drafts)
            else:
                state.fill_bitmask(bitmask, row, backend.num_tokenizer_words)
            row += 1 + len(drafts)
        # Logits may be wider than the tokenizer (padded embeddings): those ids never decode.
        bitmask[:, backend.num_tokenizer_words:] = 0
        self._mask_times.observe(time.perf_counter() - start)
        return GrammarOutput(first_row, bitmask)

    # ---- introspection ------------------------------------------------------------------------

    def stats(self) -> StructuredOutputStats:
        num_compiles, compile_total, recent_compiles = self._compile_times.snapshot()
        num_mask_steps, mask_total, recent_masks = self._mask_times.snapshot()
        return StructuredOutputStats(
            num_constrained_requests=self.num_constrained_requests,
            num_compiles=num_compiles,
            num_compile_failures=self._num_compile_failures,
            num_cache_hits=self._num_cache_hits,
            compile_seconds_total=compile_total,
            num_mask_steps=num_mask_steps,
            mask_seconds_total=mask_total,
            recent_compile_seconds=recent_compiles,
            recent_mask_seconds=recent_masks,
        )

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
