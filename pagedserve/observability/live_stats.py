"""Live aggregate stats for the dashboard: a short time series of the engine's load and latency.

`LiveStats` is a StatLogger (engine/async_llm.py): the engine thread feeds it every step's
SchedulerStats and every DELTA output; it keeps one point per ~1 s bucket for the last few
minutes (token throughput from the counters' growth, running/waiting requests, KV usage, prefix
hit rate) plus TTFT and inter-token latency percentiles over a recent window. HTTP handlers read
`snapshot()`. Bounded memory, one lock; knows nothing about HTTP.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pagedserve.core.stats import SchedulerStats
from pagedserve.observability.timeline import nearest_rank_percentile
from pagedserve.outputs import RequestOutput

_COUNTERS = {
    "prompt_tokens": "num_prompt_tokens_computed",
    "generation_tokens": "num_generation_tokens",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "preemptions": "num_preemptions",
    "finished_requests": None,  # counted from outputs, not from SchedulerStats
}
_QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
_MAX_TRACKED_REQUESTS = 10_000
"""Requests whose first token / last output time we remember; the oldest go first (a request
whose final output never comes must not leak)."""


@dataclass
class _Bucket:
    """What happened since the last point: counter growth and the peak of each gauge."""

    start: float
    growth: dict[str, int]
    max_running: int = 0
    max_waiting: int = 0
    max_kv_cache_usage: float = 0.0


@dataclass
class _RequestClock:
    ttft_recorded: bool = False
    last_output_times: dict[int, float] = field(default_factory=dict)
    """Completion index -> when its last tokens arrived (monotonic)."""


class LiveStats:
    """A StatLogger with a ring of per-second points. `record_*` run on the engine thread,
    `snapshot()` on any other; both take the same lock and do O(1) work per call except a bucket
    close (about once a second), which sorts at most `max_latency_samples` floats twice."""

    def __init__(self, *, window_s: float = 300.0, bucket_s: float = 1.0,
                 latency_window_s: float = 30.0, max_latency_samples: int = 4096) -> None:
        if bucket_s <= 0 or window_s < bucket_s:
            raise ValueError(f"need 0 < bucket_s <= window_s, got {bucket_s=}, {window_s=}")
        if latency_window_s <= 0 or max_latency_samples < 1:
            raise ValueError("latency_window_s must be > 0 and max_latency_samples >= 1")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.latency_window_s = latency_window_s
        self._lock = threading.Lock()
        self._points: deque[dict] = deque(maxlen=math.ceil(window_s / bucket_s))
        self._bucket: _Bucket | None = None
        self._last_counters: dict[str, int] | None = None
        self._last_stats: SchedulerStats | None = None
        # (monotonic time, seconds); the oldest drop out by age at each bucket close, or by count
        self._ttft_samples: deque[tuple[float, float]] = deque(maxlen=max_latency_samples)
        self._itl_samples: deque[tuple[float, float]] = deque(maxlen=max_latency_samples)
        self._requests: OrderedDict[str, _RequestClock] = OrderedDict()
        self._num_finished = 0
        self._wall_offset = time.time() - time.monotonic()

    # ---- the engine thread ------------------------------------------------------------------

    def record_step(self, stats: SchedulerStats, now: float) -> None:
        with self._lock:
            counters = {name: getattr(stats, field) for name, field in _COUNTERS.items()
                        if field is not None}
            counters["finished_requests"] = self._num_finished
            if self._bucket is None:
                self._bucket = _Bucket(now, dict.fromkeys(_COUNTERS, 0))
            else:
                assert self._last_counters is not None
                for name, value in counters.items():
                    last = self._last_counters[name]
                    # NOTE: a smaller value means a new engine behind this logger: all of it is new.
                    self._bucket.growth[name] += value - last if value >= last else value
            self._last_counters = counters
            self._last_stats = stats
            bucket = self._bucket
            bucket.max_running = max(bucket.max_running, stats.num_running_reqs)
            bucket.max_waiting = max(bucket.max_waiting, stats.num_waiting_reqs)
            bucket.max_kv_cache_usage = max(bucket.max_kv_cache_usage, stats.kv_cache_usage)
            if now - bucket.start >= self.bucket_s:
                self._points.append(self._close(bucket, now))
                self._bucket = _Bucket(now, dict.fromkeys(_COUNTERS, 0))

    def record_output(self, output: RequestOutput, now: float) -> None:
        """One DELTA output: its first token gives a TTFT sample, the gap since the previous
        output of the same sequence an ITL sample per new token."""
        with self._lock:
            clock = self._requests.get(output.request_id)
            if clock is None:
                clock = self._requests[output.request_id] = _RequestClock()
                while len(self._requests) > _MAX_TRACKED_REQUESTS:
                    self._requests.popitem(last=False)
            ttft = output.metrics.time_to_first_token
            if ttft is not None and not clock.ttft_recorded:
                self._ttft_samples.append((now, ttft))
                clock.ttft_recorded = True
            for completion in output.outputs:
                num_new_tokens = len(completion.token_ids)
                if num_new_tokens == 0:
                    continue
                last = clock.last_output_times.get(completion.index)
                if last is not None:
                    # A multi-token output (spec decode) spreads its gap over its tokens.
                    per_token = (now - last) / num_new_tokens
                    self._itl_samples.extend([(now, per_token)] * num_new_tokens)
                clock.last_output_times[completion.index] = now
            if output.finished:
                del self._requests[output.request_id]
                self._num_finished += 1

    def _close(self, bucket: _Bucket, now: float) -> dict:
        """The point for [bucket.start, now]; rates over its real length (a long step makes a
        long bucket, not a gap and a spike)."""
        duration = now - bucket.start
        growth = bucket.growth
        queries = growth["prefix_cache_queries"]
        point = {
            "t": round(now + self._wall_offset, 3),
            "duration_s": round(duration, 4),
            "prompt_tokens_per_s": round(growth["prompt_tokens"] / duration, 3),
            "generation_tokens_per_s": round(growth["generation_tokens"] / duration, 3),
            "num_running": bucket.max_running,
            "num_waiting": bucket.max_waiting,
            "kv_cache_usage": round(bucket.max_kv_cache_usage, 4),
            "prefix_cache_hit_rate": (round(growth["prefix_cache_hits"] / queries, 4)
                                      if queries else None),
            "num_preemptions": growth["preemptions"],
            "num_finished_requests": growth["finished_requests"],
        }
        horizon = now - self.latency_window_s
        for name, samples in (("ttft", self._ttft_samples), ("itl", self._itl_samples)):
            while samples and samples[0][0] < horizon:
                samples.popleft()
            ordered = sorted(value for _, value in samples)
            for label, q in _QUANTILES:
                point[f"{name}_{label}_s"] = (round(nearest_rank_percentile(ordered, q), 6)
                                              if ordered else None)
            point[f"num_{name}_samples"] = len(ordered)
        return point

    # ---- readers ----------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """JSON-ready: the points (oldest first) and the latest gauges and totals."""
        with self._lock:
            points = list(self._points)
            stats = self._last_stats
            counters = dict(self._last_counters or {})
        latest = None
        if stats is not None:
            latest = {"num_running": stats.num_running_reqs,
                      "num_waiting": stats.num_waiting_reqs,
                      "kv_cache_usage": round(stats.kv_cache_usage, 4),
                      "totals": counters}
        return {"object": "stats.live", "now": round(time.time(), 3),
                "bucket_s": self.bucket_s, "window_s": self.window_s,
                "latency_window_s": self.latency_window_s, "points": points, "latest": latest}

    @property
    def num_tracked_requests(self) -> int:
        """Requests seen and not finished; for leak checks."""
        with self._lock:
            return len(self._requests)


