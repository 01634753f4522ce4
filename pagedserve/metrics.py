"""Prometheus metrics for a serving engine, named like vLLM's (`pagedserve:` prefix).

The engine thread feeds `record_step` (scheduler stats after every step) and `record_output`
(every DELTA RequestOutput); the HTTP server exposes `make_asgi_app()` or `render()` at /metrics.
Knows nothing of the engine's internals beyond `SchedulerStats` and `RequestOutput`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.core.stats import SchedulerStats, SpecDecodingStats
from pagedserve.outputs import RequestOutput

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
"""The Content-Type of `render()`'s bytes."""

# vLLM's buckets (seconds). Inter-token buckets also get sub-10 ms steps: a small model on a GPU
# decodes faster than vLLM's first bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                       0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
GRAMMAR_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                           2.5, 5.0, 10.0, 30.0)
GRAMMAR_MASK_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                        0.1, 0.25, 0.5, 1.0)
FINISH_REASONS = ("stop", "length", "abort")
"""Pre-created `request_success_total` series, so they read 0 rather than being absent."""

# SchedulerStats counter field -> our counter's name (exposed with a `_total` suffix).
_STATS_COUNTERS = {
    "num_prompt_tokens_computed": "prompt_tokens",
    "num_generation_tokens": "generation_tokens",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
}


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including max_value (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass
class _RequestState:
    """What DELTA outputs do not repeat, kept from a request's first output to its last."""

    last_output_times: dict[int, float] = field(default_factory=dict)
    """Sequence index -> when its previous tokens arrived (for inter-token latency)."""
    num_tokens: dict[int, int] = field(default_factory=dict)
    """Sequence index -> tokens generated so far."""
    ttft_observed: bool = False


class _SpecDecodeMetrics:
    """Speculative decoding's counters, named like vLLM's `vllm:spec_decode_*`. Rates are ratios
    of counters (acceptance rate = accepted / draft tokens; at position i = accepted_per_pos /
    draft_tokens_per_pos); the mean accepted length since start is also a gauge."""

    def __init__(self, model_name: str, registry: CollectorRegistry, num_positions: int) -> None:
        labels = {"model_name": model_name}

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedserve:spec_decode_{name}", doc, ["model_name"],
                           registry=registry).labels(**labels)

        def per_pos_counter(name: str, doc: str) -> list[Counter]:
            family = Counter(f"pagedserve:spec_decode_{name}", doc, ["model_name", "position"],
                             registry=registry)
            return [family.labels(model_name=model_name, position=str(pos))
                    for pos in range(num_positions)]

        self.num_drafts = counter("num_drafts", "Draft runs verified (one per request per step).")
        self.num_draft_tokens = counter("num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("num_accepted_tokens", "Draft tokens accepted.")
        self.num_draft_tokens_per_pos = per_pos_counter(
            "num_draft_tokens_per_pos", "Draft runs with a token at this position (from 0).")
        self.num_accepted_tokens_per_pos = per_pos_counter(
            "num_accepted_tokens_per_pos", "Draft runs whose token at this position was accepted.")
        self.mean_acceptance_length = Gauge(
            "pagedserve:spec_decode_mean_acceptance_length",
            "Tokens gained per verifying step since start: 1 + accepted / drafts.",
            ["model_name"], registry=registry).labels(**labels)
        self._last = SpecDecodingStats()

    def record(self, stats: SpecDecodingStats) -> None:
        """Advance every counter by its growth since the last call (a drop: a new engine)."""
        last = self._last if stats.num_drafts >= self._last.num_drafts else SpecDecodingStats()
        self.num_drafts.inc(stats.num_drafts - last.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens - last.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens - last.num_accepted_tokens)
        for counters, now, before in (
            (self.num_draft_tokens_per_pos, stats.num_draft_tokens_per_pos,
             last.num_draft_tokens_per_pos),
            (self.num_accepted_tokens_per_pos, stats.num_accepted_tokens_per_pos,
             last.num_accepted_tokens_per_pos),
        ):
            for pos, counter in enumerate(counters):
                value = now[pos] if pos < len(now) else 0
                counter.inc(value - (before[pos] if pos < len(before) else 0))
        self.mean_acceptance_length.set(stats.mean_acceptance_length)
        self._last = stats.copy()


class _KVTierMetrics:
    """The KV tiers' counters (kv_transfer/): lookups, hits per tier, the cost model's decisions,
    transfers (blocks, bytes, seconds) and faults per tier. Each follows its KVTierStats total."""

    _TIER_FIELDS = {
        "blocks_loaded": "KV blocks loaded from the tier and verified.",
        "bytes_loaded": "Bytes loaded from the tier.",
        "load_seconds": "Time spent loading blocks from the tier (summed over loader threads).",
        "blocks_saved": "KV blocks written to the tier.",
        "bytes_saved": "Bytes written to the tier.",
        "save_seconds": "Time spent writing blocks to the tier.",
    }

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self.model_name = model_name

        def family(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"pagedserve:kv_tier_{name}", doc, ["model_name", *labels],
                           registry=registry)

        self.lookup_tokens = family("lookup_tokens", "Prompt tokens past the device pool's hit "
                                    "looked up in the KV tiers.")
        self.hit_tokens = family("hit_tokens", "Prompt tokens found in a KV tier (the first in "
                                 "search order that had them).", ("tier",))
        self.decisions = family("decisions", "Tier hits the cost model loaded (load) or left to "
                                "recompute (recompute).", ("decision",))
        self.loaded_tokens = family("loaded_tokens", "Prompt tokens loaded from KV tiers and used.")
        self.load_failed_tokens = family("load_failed_tokens", "Prompt tokens a load job could "
                                         "not deliver (fault, corrupt or missing): recomputed.")
        self.load_fallbacks = family("load_fallbacks", "Load jobs (transfers) that failed or "
                                     "timed out part-way: the rest of the prompt was recomputed.")
        self.saves_dropped = family("saves_dropped", "Block saves dropped because the writer "
                                    "fell behind.")
        self.tier_families = {name: family(name, doc, ("tier",))
                              for name, doc in self._TIER_FIELDS.items()}
        self.faults = family("faults", "KV tier faults, by kind: io_error (the store failed), "
                             "missing, corrupt (checksum, truncation), foreign (another block's "
                             "or layout's KV).", ("tier", "kind"))
        for decision in ("load", "recompute"):
            self.decisions.labels(model_name=model_name, decision=decision)
        self._last: dict[tuple, float] = {}

    def _follow(self, family: Counter, total: float, **labels: str) -> None:
        key = (id(family), *sorted(labels.items()))
        last = self._last.get(key, 0)
        family.labels(model_name=self.model_name, **labels).inc(
            total - last if total >= last else total)  # smaller: a new engine's counters
        self._last[key] = total

    def record(self, stats) -> None:
        self._follow(self.lookup_tokens, stats.lookup_tokens)
        self._follow(self.loaded_tokens, stats.loaded_tokens)
        self._follow(self.load_failed_tokens, stats.load_failed_tokens)
        self._follow(self.load_fallbacks, stats.load_fallbacks)
        self._follow(self.saves_dropped, stats.num_saves_dropped)
        for decision, count in stats.decisions.items():
            self._follow(self.decisions, count, decision=decision)
        for tier, count in stats.hit_tokens.items():
            self._follow(self.hit_tokens, count, tier=tier)
        for tier, counters in stats.tiers.items():
            for name, family in self.tier_families.items():
                self._follow(family, getattr(counters, name), tier=tier)
            for kind, count in counters.faults.items():
                self._follow(self.faults, count, tier=tier, kind=kind)


class PrometheusStatLogger:
    """One engine's metrics in one registry. `record_*` may run on any one thread while another
    renders; prometheus_client's metrics are thread-safe and our own state is under a lock."""

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        *,
        max_model_len: int = 131072,
        num_speculative_tokens: int | None = None,
    ) -> None:
        """`registry`: default, a fresh one owned by this logger. `max_model_len` bounds the
        token-count histograms' buckets. `num_speculative_tokens`: the engine speculates, so
        export its acceptance counters (one per-position series per draft position)."""
        self.model_name = model_name
        self.registry = CollectorRegistry() if registry is None else registry
        self._lock = threading.Lock()
        self._requests: dict[str, _RequestState] = {}
        self._last_counter_values = dict.fromkeys(_STATS_COUNTERS, 0)
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedserve:{name}", doc, ["model_name"], registry=self.registry
                         ).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedserve:{name}", doc, ["model_name"], registry=self.registry
                           ).labels(**labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"pagedserve:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc",
                                         "Fraction of KV cache blocks in use (1 = 100%).")
        counter_docs = {
            "prompt_tokens": "Prompt tokens computed by prefill (prefix-cache hits excluded).",
            "generation_tokens": "Generated tokens.",
            "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
            "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
            "num_preemptions": "Requests preempted (their KV freed, to be recomputed).",
        }
        self._counters = {field_name: counter(name, counter_docs[name])
                          for field_name, name in _STATS_COUNTERS.items()}
        request_success = Counter("pagedserve:request_success", "Finished requests.",
                                  ["model_name", "finished_reason"], registry=self.registry)
        self._request_success = request_success
        for reason in FINISH_REASONS:
            request_success.labels(model_name=model_name, finished_reason=reason)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between a sequence's consecutive outputs per token in the later one.",
            INTER_TOKEN_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1).", INTER_TOKEN_BUCKETS)
        latency_histograms = {
            "e2e_request_latency": "Arrival to finish.",
            "request_queue_time": "Arrival to first scheduled.",
            "request_prefill_time": "First scheduled to first token.",
            "request_decode_time": "First token to last token.",
        }
        self._latency = {name: histogram(f"{name}_seconds", doc, REQUEST_LATENCY_BUCKETS)
                         for name, doc in latency_histograms.items()}
        self.structured_output_requests = counter(
            "structured_output_requests", "Sequences that ran with a structured output constraint "
            "(JSON schema, regex, choice, grammar or a forced tool call).")
        self.grammar_compile_failures = counter(
            "grammar_compile_failures", "Requests failed because their grammar did not compile "
            "or ran past the compile budget.")
        self.grammar_compile_time = histogram(
            "grammar_compile_time_seconds", "Time to compile one structured output grammar "
            "(cache misses only).", GRAMMAR_COMPILE_BUCKETS)
        self.grammar_mask_time = histogram(
            "grammar_mask_time_seconds", "Per engine step with constrained rows: time to fill "
            "their token bitmasks.", GRAMMAR_MASK_BUCKETS)
        self._structured_seen = {"requests": 0, "failures": 0, "compiles": 0, "masks": 0}
        self._kv_tier: _KVTierMetrics | None = None
        self._spec_decode: _SpecDecodeMetrics | None = None
        if num_speculative_tokens is not None:
            self._spec_decode = _SpecDecodeMetrics(
                model_name, self.registry, num_speculative_tokens)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", token_buckets)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request (all sequences).",
            token_buckets)

    # ---- engine thread ------------------------------------------------------------------------

    def record_step(self, stats: SchedulerStats, now: float) -> None:
        """Set the gauges; advance each counter by its SchedulerStats counter's growth."""
        del now  # gauges are read at scrape time; counters need no timestamp
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        with self._lock:
            for field_name, counter in self._counters.items():
                value = getattr(stats, field_name)
                last = self._last_counter_values[field_name]
                # NOTE: a smaller value means the stats counters restarted from zero (a new engine
                # behind this logger); Prometheus counts that as a reset, so all of it is new.
                counter.inc(value - last if value >= last else value)
                self._last_counter_values[field_name] = value
            if self._spec_decode is not None:
                self._spec_decode.record(stats.spec_decoding)
            self._record_structured_output(stats.structured_output)
            if stats.kv_tier is not None:
                if self._kv_tier is None:
                    self._kv_tier = _KVTierMetrics(self.model_name, self.registry)
                self._kv_tier.record(stats.kv_tier)

    def _record_structured_output(self, stats) -> None:
        """Counters grow by their totals' growth; each timing is observed once (by number)."""
        seen = self._structured_seen

        def grow(key: str, total: int) -> int:
            new = total - seen[key] if total >= seen[key] else total  # restarted engine
            seen[key] = total
            return new

        self.structured_output_requests.inc(grow("requests", stats.num_constrained_requests))
        self.grammar_compile_failures.inc(grow("failures", stats.num_compile_failures))
        for histogram, key, total, recent in (
                (self.grammar_compile_time, "compiles", stats.num_compiles,
                 stats.recent_compile_seconds),
                (self.grammar_mask_time, "masks", stats.num_mask_steps,
                 stats.recent_mask_seconds)):
            num_new = min(grow(key, total), len(recent))
            for seconds in recent[len(recent) - num_new:]:
                histogram.observe(seconds)

    def record_output(self, output: RequestOutput, now: float) -> None:
        """Account one DELTA output: each CompletionOutput's token_ids are only its new tokens."""
        with self._lock:
            state = self._requests.get(output.request_id)
            if state is None:
                state = self._requests[output.request_id] = _RequestState()
            for completion in output.outputs:
                num_new_tokens = len(completion.token_ids)
                if num_new_tokens == 0:
                    continue  # e.g. a finished sibling sequence repeated with nothing new
                index = completion.index
                last_time = state.last_output_times.get(index)
                if last_time is not None:
                    # A multi-token output (spec decode) spreads its gap over its tokens.
                    per_token = (now - last_time) / num_new_tokens
                    for _ in range(num_new_tokens):
                        self.inter_token_latency.observe(per_token)
                state.last_output_times[index] = now
                state.num_tokens[index] = state.num_tokens.get(index, 0) + num_new_tokens
            ttft = output.metrics.time_to_first_token
            if not state.ttft_observed and ttft is not None:
                self.time_to_first_token.observe(ttft)
                state.ttft_observed = True
            if output.finished:
                del self._requests[output.request_id]
                self._record_finished(output, state)

    def _record_finished(self, output: RequestOutput, state: _RequestState) -> None:
        """Per-request histograms, once timestamps are complete. With n > 1 sequences the request
        counts once: its finish reason is sequence 0's, its TPOT uses the longest sequence."""
        metrics = output.metrics
        reasons = {completion.index: completion.finish_reason for completion in output.outputs}
        reason = reasons.get(0) or next((r for r in reasons.values() if r is not None), "abort")
        self._request_success.labels(model_name=self.model_name, finished_reason=reason).inc()
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(sum(state.num_tokens.values()))
        finished_time = metrics.finished_time
        if finished_time is not None:
            self._latency["e2e_request_latency"].observe(finished_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self._latency["request_queue_time"].observe(metrics.queue_time)
        first_token, last_token = metrics.first_token_time, metrics.last_token_time
        if first_token is None:
            return  # aborted before its first token: no prefill or decode to time
        if metrics.first_scheduled_time is not None:
            self._latency["request_prefill_time"].observe(
                first_token - metrics.first_scheduled_time)
        decode_end = last_token if last_token is not None else finished_time
        if decode_end is not None:
            self._latency["request_decode_time"].observe(decode_end - first_token)
        num_seq_tokens = max(state.num_tokens.values(), default=0)
        if num_seq_tokens > 1 and last_token is not None:
            self.request_time_per_output_token.observe(
                (last_token - first_token) / (num_seq_tokens - 1))

    @property
    def num_tracked_requests(self) -> int:
        """Requests with per-request state (seen, not yet finished); for leak checks."""
        with self._lock:
            return len(self._requests)

    # ---- HTTP side ----------------------------------------------------------------------------

    def make_asgi_app(self):
        """An ASGI app serving this registry (mount it at /metrics)."""
        return prometheus_client.make_asgi_app(self.registry)

    def render(self) -> bytes:
        """The text exposition format; serve it with Content-Type `CONTENT_TYPE`."""
        return prometheus_client.generate_latest(self.registry)
