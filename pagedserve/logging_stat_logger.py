"""vLLM's periodic stats line: one INFO line per interval with the engine's throughput, queue,
KV cache usage and prefix cache hit rate, made of `SchedulerStats` counters alone (the Prometheus
exporter beside it is metrics.py).
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from pagedserve.core.stats import SchedulerStats, SpecDecodingStats, counter_growth
from pagedserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


class LoggingStatLogger:
    """vLLM's periodic stats line (its V1 `LoggingStatLogger`), one INFO line per interval:

        Engine 000: Avg prompt throughput: 512.3 tokens/s, Avg generation throughput: 88.1
        tokens/s, Running: 8 reqs, Waiting: 2 reqs, KV cache usage: 41.0%, Prefix cache hit
        rate: 63.2%

    ("Preemptions: N" joins when the interval had some, and a "SpecDecoding metrics:" line
    follows when it verified drafts.) Prompt throughput counts prompt tokens computed, as vLLM's
    does (cache hits excluded). Like vLLM's, an idle interval after an idle one logs at DEBUG, so
    an idle server writes one idle line and then nothing; unlike vLLM's, requests held (running
    or waiting) with no throughput still log, since a stuck queue is worth a line.

    Driven only by `record_step`'s `now` (no timer): the first call after `interval_s` has passed
    since the last line writes the next one, so tests script `now`.
    """

    HIT_RATE_WINDOW_STEPS = 1000
    """The prefix cache hit rate covers the last this many steps that looked the cache up (vLLM:
    its last 1000 requests)."""

    def __init__(self, interval_s: float = 10.0, engine_index: int = 0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.engine_index = engine_index
        self._lock = threading.Lock()
        self._last_log_time: float | None = None
        self._last_stats: SchedulerStats | None = None
        self._at_last_log: SchedulerStats | None = None
        """The stats of the step the last line was computed from: interval counts are growths."""
        self._last_throughputs = (0.0, 0.0)
        self._hit_window: deque[tuple[int, int]] = deque(maxlen=self.HIT_RATE_WINDOW_STEPS)
        """(queries, hits) of each recent step that looked the prefix cache up."""

    def record_step(self, stats: SchedulerStats, now: float) -> None:
        with self._lock:
            if self._last_log_time is None:  # the first call starts the first interval
                self._last_log_time, self._at_last_log = now, self._snapshot(stats)
            previous = self._last_stats
            queries = counter_growth(stats.prefix_cache_queries,
                                     previous.prefix_cache_queries if previous else 0)
            if queries > 0:
                hits = counter_growth(stats.prefix_cache_hits,
                                      previous.prefix_cache_hits if previous else 0)
                self._hit_window.append((queries, hits))
            self._last_stats = self._snapshot(stats)
            if now - self._last_log_time >= self.interval_s:
                self._log(now)

    def record_output(self, output: RequestOutput, now: float) -> None:
        """Nothing per request: the line is made of scheduler counters."""

    @staticmethod
    def _snapshot(stats: SchedulerStats) -> SchedulerStats:
        """The counters read later: the engine may reuse or grow its stats objects."""
        return SchedulerStats(
            num_running_reqs=stats.num_running_reqs, num_waiting_reqs=stats.num_waiting_reqs,
            kv_cache_usage=stats.kv_cache_usage, prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits, num_preemptions=stats.num_preemptions,
            num_prompt_tokens_computed=stats.num_prompt_tokens_computed,
            num_generation_tokens=stats.num_generation_tokens,
            spec_decoding=stats.spec_decoding.copy())

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = sum(q for q, _ in self._hit_window)
        return sum(h for _, h in self._hit_window) / queries if queries else 0.0

    def _log(self, now: float) -> None:
        stats, start = self._last_stats, self._at_last_log
        elapsed = now - self._last_log_time
        prompt_throughput = counter_growth(stats.num_prompt_tokens_computed,
                                           start.num_prompt_tokens_computed) / elapsed
        generation_throughput = counter_growth(stats.num_generation_tokens,
                                               start.num_generation_tokens) / elapsed
        num_preemptions = counter_growth(stats.num_preemptions, start.num_preemptions)
        idle = not any((prompt_throughput, generation_throughput, *self._last_throughputs,
                        stats.num_running_reqs, stats.num_waiting_reqs))
        log = logger.debug if idle else logger.info
        parts = ["Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f tokens/s",
                 "Running: %d reqs", "Waiting: %d reqs"]
        values: list[float] = [prompt_throughput, generation_throughput,
                               stats.num_running_reqs, stats.num_waiting_reqs]
        if num_preemptions > 0:
            parts.append("Preemptions: %d")
            values.append(num_preemptions)
        parts += ["KV cache usage: %.1f%%", "Prefix cache hit rate: %.1f%%"]
        values += [stats.kv_cache_usage * 100, self.prefix_cache_hit_rate * 100]
        log(f"Engine {self.engine_index:03d}: " + ", ".join(parts), *values)
        self._log_spec_decoding(log, stats.spec_decoding, start.spec_decoding, elapsed)
        self._last_log_time, self._at_last_log = now, stats
        self._last_throughputs = (prompt_throughput, generation_throughput)

    @staticmethod
    def _log_spec_decoding(log, now: SpecDecodingStats, start: SpecDecodingStats,
                           elapsed: float) -> None:
        """vLLM's SpecDecoding line, over the interval's drafts."""
        if now.num_drafts < start.num_drafts:
            start = SpecDecodingStats()  # a new engine's counters
        num_drafts = now.num_drafts - start.num_drafts
        if num_drafts == 0:
            return
        num_draft_tokens = now.num_draft_tokens - start.num_draft_tokens
        num_accepted = now.num_accepted_tokens - start.num_accepted_tokens
        before = start.num_accepted_tokens_per_pos
        per_pos = [(accepted - (before[pos] if pos < len(before) else 0)) / num_drafts
                   for pos, accepted in enumerate(now.num_accepted_tokens_per_pos)]
        log("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f "
            "tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d "
            "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + num_accepted / num_drafts, num_accepted / elapsed, num_draft_tokens / elapsed,
            num_accepted, num_draft_tokens, ", ".join(f"{rate:.3f}" for rate in per_pos),
            100 * num_accepted / num_draft_tokens if num_draft_tokens else float("nan"))
