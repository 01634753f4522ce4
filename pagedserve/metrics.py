"""Prometheus metrics of a serving engine (the periodic stats log line: logging_stat_logger.py).

A metric vLLM also has is served under vLLM's name, type and labels (`vllm:` prefix, labels
`model_name` and `engine`), so vLLM's dashboards and alerts work unchanged; the ones vLLM lacks
(structured output, KV tiers, our extra speculative-decoding series, prompt tokens computed) keep
the `pagedserve:` prefix and the `model_name` label. Names, types, labels and buckets were checked
against vllm-project/vllm `vllm/v1/metrics/loggers.py` and `vllm/v1/spec_decode/metrics.py` (V1
engine, 0.10-0.11 era), and the dashboard's queries against its Prometheus/Grafana example
`examples/observability/prometheus_grafana/grafana.json` at commit 4b5c627c23e6 (see
tests/test_metrics_vllm_names.py).

The engine thread feeds `record_step` (scheduler stats after every step, and about once a second
while idle) and `record_output` (every DELTA RequestOutput); the HTTP server exposes
`make_asgi_app()` or `render()` at /metrics. Knows nothing of the engine's internals beyond
`SchedulerStats` and `RequestOutput`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.core.stats import SchedulerStats, SpecDecodingStats, counter_growth
from pagedserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
"""The Content-Type of `render()`'s bytes."""

VLLM_LABELS = ("model_name", "engine")
"""vLLM's labels on every `vllm:` metric. `engine` is the engine core's index: always "0" here
(one engine per server process; the -dp front tells replicas apart with `replica`)."""
ENGINE_INDEX = "0"

# vLLM's buckets (seconds). Inter-token buckets also get sub-10 ms steps: a small model on a GPU
# decodes faster than vLLM's first bucket (every vLLM boundary is kept, so its queries still work).
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
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")
"""Pre-created `request_success_total` series, so they read 0 rather than being absent."""

# SchedulerStats counter field -> (our counter's full name without `_total`, its help).
_STATS_COUNTERS = {
    "num_prompt_tokens_computed": (
        "pagedserve:prompt_tokens_computed",
        "Prompt tokens computed by prefill (prefix-cache and KV-tier hits excluded, prompts "
        "recomputed after a preemption counted again)."),
    "num_generation_tokens": ("vllm:generation_tokens", "Number of generation tokens processed."),
    "prefix_cache_queries": ("vllm:prefix_cache_queries",
                             "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits",
                          "Prefix cache hits, in terms of number of cached tokens."),
    "num_preemptions": ("vllm:num_preemptions",
                        "Cumulative number of preemption from the engine."),
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
    """Speculative decoding's counters: vLLM's `vllm:spec_decode_*` four, plus our draft tokens
    per position and mean acceptance length. Rates are ratios of counters (acceptance rate =
    accepted / draft tokens; at position i = accepted_per_pos / draft_tokens_per_pos, or vLLM's
    accepted_per_pos / drafts); the mean accepted length since start is also a gauge."""

    def __init__(self, model_name: str, registry: CollectorRegistry, num_positions: int) -> None:
        labels = {"model_name": model_name, "engine": ENGINE_INDEX}

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"vllm:spec_decode_{name}", doc, VLLM_LABELS,
                           registry=registry).labels(**labels)

        def per_pos_counter(full_name: str, doc: str, label_names: tuple[str, ...],
                            **label_values: str) -> list[Counter]:
            family = Counter(full_name, doc, [*label_names, "position"], registry=registry)
            return [family.labels(**label_values, position=str(pos))
                    for pos in range(num_positions)]

        self.num_drafts = counter("num_drafts", "Number of spec decoding drafts (one per request "
                                  "per verifying step).")
        self.num_draft_tokens = counter("num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("num_accepted_tokens", "Number of accepted tokens.")
        self.num_draft_tokens_per_pos = per_pos_counter(
            "pagedserve:spec_decode_num_draft_tokens_per_pos",
            "Draft runs with a token at this position (from 0).", ("model_name",),
            model_name=model_name)
        self.num_accepted_tokens_per_pos = per_pos_counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            VLLM_LABELS, **labels)
        self.mean_acceptance_length = Gauge(
            "pagedserve:spec_decode_mean_acceptance_length",
            "Tokens gained per verifying step since start: 1 + accepted / drafts.",
            ["model_name"], registry=registry).labels(model_name=model_name)
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


class _FollowedCounters:
    """Prometheus counters that follow running totals kept elsewhere (each grows by its
    total's growth since the last record)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._last: dict[tuple, float] = {}

    def _follow(self, family: Counter, total: float, **labels: str) -> None:
        key = (id(family), *sorted(labels.items()))
        family.labels(model_name=self.model_name, **labels).inc(
            counter_growth(total, self._last.get(key, 0)))
        self._last[key] = total


class _CudaGraphMetrics(_FollowedCounters):
    """CUDA graph replays, their padding, and the steps run eagerly by reason
    (worker/cuda_graph.py), following the engine's CudaGraphCounters."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        super().__init__(model_name)
        self.replays = Counter("pagedserve:cuda_graph_replays", "Engine steps run by replaying "
                               "a captured CUDA graph.", ["model_name"], registry=registry)
        self.padded_tokens = Counter(
            "pagedserve:cuda_graph_padded_tokens", "Padding tokens computed by CUDA graph "
            "replays (each step's tokens rounded up to a captured size).", ["model_name"],
            registry=registry)
        self.eager_steps = Counter(
            "pagedserve:cuda_graph_eager_steps", "Engine steps run eagerly although CUDA graphs "
            "are captured, by reason: tokens (more than the largest graph), lora, kv_transfer.",
            ["model_name", "reason"], registry=registry)

    def record(self, counters) -> None:
        self._follow(self.replays, counters.replays)
        self._follow(self.padded_tokens, counters.padded_tokens)
        for reason, count in counters.eager_steps.items():
            self._follow(self.eager_steps, count, reason=reason)


class _KVTierMetrics(_FollowedCounters):
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
        super().__init__(model_name)

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

        def labelled(cls, full_name: str, doc: str, **kwargs):
            """One series: vLLM's labels on a `vllm:` metric, `model_name` on ours."""
            labels = {"model_name": model_name}
            if full_name.startswith("vllm:"):
                labels["engine"] = ENGINE_INDEX
            return cls(full_name, doc, list(labels), registry=self.registry,
                       **kwargs).labels(**labels)

        def vllm_metric(cls, name: str, doc: str, **kwargs):
            return labelled(cls, f"vllm:{name}", doc, **kwargs)

        def own_metric(cls, name: str, doc: str, **kwargs):
            return labelled(cls, f"pagedserve:{name}", doc, **kwargs)

        # ---- scheduler state and counters (SchedulerStats) ----
        self.num_requests_running = vllm_metric(
            Gauge, "num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = vllm_metric(
            Gauge, "num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = vllm_metric(
            Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._counters = {field_name: labelled(Counter, name, doc)
                          for field_name, (name, doc) in _STATS_COUNTERS.items()}
        self.iteration_tokens = vllm_metric(
            Histogram, "iteration_tokens_total", "Histogram of number of tokens per engine_step "
            "(prompt tokens computed + tokens generated).", buckets=ITERATION_TOKEN_BUCKETS)
        # ---- per request (RequestOutput) ----
        self.prompt_tokens = vllm_metric(
            Counter, "prompt_tokens", "Number of prefill tokens processed (a request's whole "
            "prompt, prefix-cache hits included, counted once when its first token comes).")
        request_success = Counter("vllm:request_success",
                                  "Count of successfully processed requests.",
                                  [*VLLM_LABELS, "finished_reason"], registry=self.registry)
        self._request_success = request_success
        for reason in FINISH_REASONS:
            request_success.labels(model_name=model_name, engine=ENGINE_INDEX,
                                   finished_reason=reason)

        self.time_to_first_token = vllm_metric(
            Histogram, "time_to_first_token_seconds",
            "Histogram of time to first token in seconds (arrival to first token).",
            buckets=TTFT_BUCKETS)
        self.inter_token_latency = vllm_metric(
            Histogram, "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (a sequence's gap between outputs, per "
            "token of the later one).", buckets=INTER_TOKEN_BUCKETS)
        self.request_time_per_output_token = vllm_metric(
            Histogram, "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request: (last token - first "
            "token) / (output tokens - 1).", buckets=INTER_TOKEN_BUCKETS)
        latency_histograms = {
            "e2e_request_latency": "Histogram of e2e request latency in seconds.",
            "request_queue_time": "Histogram of time spent in WAITING phase for request "
                                  "(arrival to first scheduled).",
            "request_inference_time": "Histogram of time spent in RUNNING phase for request "
                                      "(first scheduled to last token: prefill + decode).",
            "request_prefill_time": "Histogram of time spent in PREFILL phase for request "
                                    "(first scheduled to first token).",
            "request_decode_time": "Histogram of time spent in DECODE phase for request "
                                   "(first token to last token).",
        }
        self._latency = {name: vllm_metric(Histogram, f"{name}_seconds", doc,
                                           buckets=REQUEST_LATENCY_BUCKETS)
                         for name, doc in latency_histograms.items()}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = vllm_metric(
            Histogram, "request_prompt_tokens", "Number of prefill tokens processed (prompt "
            "tokens per finished request).", buckets=token_buckets)
        self.request_generation_tokens = vllm_metric(
            Histogram, "request_generation_tokens", "Number of generation tokens processed "
            "(per finished request, all sequences).", buckets=token_buckets)
        self.request_max_num_generation_tokens = vllm_metric(
            Histogram, "request_max_num_generation_tokens", "Histogram of maximum number of "
            "requested generation tokens (per finished request: its longest sequence).",
            buckets=token_buckets)
        self.request_prefill_kv_computed_tokens = vllm_metric(
            Histogram, "request_prefill_kv_computed_tokens", "Histogram of new KV tokens "
            "computed during prefill (excluding cached tokens).", buckets=token_buckets)
        self.request_params_n = vllm_metric(
            Histogram, "request_params_n", "Histogram of the n request parameter.",
            buckets=REQUEST_N_BUCKETS)
        self.request_params_max_tokens = vllm_metric(
            Histogram, "request_params_max_tokens", "Histogram of the max_tokens request "
            "parameter (as run: the engine's default when the request set none).",
            buckets=token_buckets)
        # ---- ours: structured output, KV tiers, speculative decoding extras ----
        self.structured_output_requests = own_metric(
            Counter, "structured_output_requests", "Sequences that ran with a structured output "
            "constraint (JSON schema, regex, choice, grammar or a forced tool call).")
        self.grammar_compile_failures = own_metric(
            Counter, "grammar_compile_failures", "Requests failed because their grammar did not "
            "compile or ran past the compile budget.")
        self.grammar_compile_time = own_metric(
            Histogram, "grammar_compile_time_seconds", "Time to compile one structured output "
            "grammar (cache misses only).", buckets=GRAMMAR_COMPILE_BUCKETS)
        self.grammar_mask_time = own_metric(
            Histogram, "grammar_mask_time_seconds", "Per engine step with constrained rows: time "
            "to fill their token bitmasks.", buckets=GRAMMAR_MASK_BUCKETS)
        self._structured_seen = {"requests": 0, "failures": 0, "compiles": 0, "masks": 0}
        self._kv_tier: _KVTierMetrics | None = None
        self._cuda_graphs: _CudaGraphMetrics | None = None
        self._spec_decode: _SpecDecodeMetrics | None = None
        if num_speculative_tokens is not None:
            self._spec_decode = _SpecDecodeMetrics(
                model_name, self.registry, num_speculative_tokens)

    # ---- engine thread ------------------------------------------------------------------------

    def record_step(self, stats: SchedulerStats, now: float) -> None:
        """Set the gauges; advance each counter by its SchedulerStats counter's growth."""
        del now  # gauges are read at scrape time; counters need no timestamp
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        with self._lock:
            growth = {}
            for field_name, counter in self._counters.items():
                value = getattr(stats, field_name)
                growth[field_name] = counter_growth(value, self._last_counter_values[field_name])
                counter.inc(growth[field_name])
                self._last_counter_values[field_name] = value
            # One call per engine step (the idle thread's calls add nothing): the step's tokens.
            step_tokens = growth["num_prompt_tokens_computed"] + growth["num_generation_tokens"]
            if step_tokens > 0:
                self.iteration_tokens.observe(step_tokens)
            if self._spec_decode is not None:
                self._spec_decode.record(stats.spec_decoding)
            self._record_structured_output(stats.structured_output)
            if stats.kv_tier is not None:
                if self._kv_tier is None:
                    self._kv_tier = _KVTierMetrics(self.model_name, self.registry)
                self._kv_tier.record(stats.kv_tier)
            if stats.cuda_graphs is not None:
                if self._cuda_graphs is None:
                    self._cuda_graphs = _CudaGraphMetrics(self.model_name, self.registry)
                self._cuda_graphs.record(stats.cuda_graphs)

    def _record_structured_output(self, stats) -> None:
        """Counters grow by their totals' growth; each timing is observed once (by number)."""
        seen = self._structured_seen

        def grow(key: str, total: int) -> int:
            new = counter_growth(total, seen[key])
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
                self.prompt_tokens.inc(len(output.prompt_token_ids))  # its prefill is done
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
        self._request_success.labels(model_name=self.model_name, engine=ENGINE_INDEX,
                                     finished_reason=reason).inc()
        num_prompt_tokens = len(output.prompt_token_ids)
        num_seq_tokens = max(state.num_tokens.values(), default=0)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(sum(state.num_tokens.values()))
        self.request_max_num_generation_tokens.observe(num_seq_tokens)
        self.request_params_n.observe(metrics.n)
        if metrics.max_tokens is not None:
            self.request_params_max_tokens.observe(metrics.max_tokens)
        finished_time = metrics.finished_time
        if finished_time is not None:
            self._latency["e2e_request_latency"].observe(finished_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self._latency["request_queue_time"].observe(metrics.queue_time)
        first_token, last_token = metrics.first_token_time, metrics.last_token_time
        if first_token is None:
            return  # aborted before its first token: no prefill or decode to time
        self.request_prefill_kv_computed_tokens.observe(
            max(num_prompt_tokens - output.num_cached_tokens, 0))
        decode_end = last_token if last_token is not None else finished_time
        if metrics.first_scheduled_time is not None:
            self._latency["request_prefill_time"].observe(
                first_token - metrics.first_scheduled_time)
            if decode_end is not None:
                self._latency["request_inference_time"].observe(
                    decode_end - metrics.first_scheduled_time)
        if decode_end is not None:
            self._latency["request_decode_time"].observe(decode_end - first_token)
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
