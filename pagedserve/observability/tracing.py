"""OpenTelemetry traces: one span per finished request, exported over OTLP/HTTP (protobuf).

`attach_tracer(timeline_store, endpoint, model_name)` listens for finished timelines
(timeline.py) and turns each into a span named like vLLM's ("llm_request", kind SERVER) from
the request's arrival to its finish: vLLM's gen_ai.* attributes, the timeline's events as span
events at their times, and its summary under `pagedserve.*`. Spans are handed to a
BatchSpanProcessor, whose own thread exports them: the engine thread never waits on the network.

opentelemetry is imported only here, and only when a tracer is made (--otlp-traces-endpoint).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

SERVICE_NAME = "pagedserve"
SPAN_NAME = "llm_request"
"""vLLM's name for a request's span."""
OTEL_PACKAGES = ("opentelemetry-sdk==1.45.2", "opentelemetry-exporter-otlp-proto-http==1.45.2")
"""What `pip install` needs for --otlp-traces-endpoint (pagedserve's `otlp` extra)."""


class SpanAttributes:
    """vLLM's attribute names (vllm/tracing.py: OpenTelemetry's gen_ai semantic conventions,
    plus the ones vLLM added until the conventions have them)."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def check_endpoint(endpoint: str) -> None:
    """ValueError, naming what is wrong, unless `endpoint` is an http(s) URL and OpenTelemetry
    is installed (the server checks this before it loads the model)."""
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL (OTLP/HTTP, e.g. "
                         f"http://localhost:4318/v1/traces), got {endpoint!r}")
    _import_otel()


def _import_otel() -> dict[str, Any]:
    try:
        from opentelemetry.context import Context
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
    except ImportError as error:
        raise ValueError(
            f"--otlp-traces-endpoint needs OpenTelemetry ({error}): pip install "
            f"{' '.join(OTEL_PACKAGES)} (or pagedserve[otlp])") from None
    return dict(Context=Context, OTLPSpanExporter=OTLPSpanExporter, Resource=Resource,
                TracerProvider=TracerProvider, BatchSpanProcessor=BatchSpanProcessor,
                SpanKind=SpanKind, Status=Status, StatusCode=StatusCode)


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


class RequestTracer:
    """Builds and exports the spans. `record(timeline)` runs on the engine thread: it only
    creates the span and queues it (a full queue drops spans; it never blocks)."""

    def __init__(self, endpoint: str, model_name: str, span_exporter=None) -> None:
        """span_exporter: instead of the OTLP/HTTP exporter to `endpoint` (tests)."""
        otel = _import_otel()
        self._otel = otel
        self.endpoint = endpoint
        self.model_name = model_name
        exporter = span_exporter or otel["OTLPSpanExporter"](endpoint=endpoint)
        self._provider = otel["TracerProvider"](
            resource=otel["Resource"].create({"service.name": SERVICE_NAME}))
        self._provider.add_span_processor(otel["BatchSpanProcessor"](exporter))
        # Our own provider, not the process-wide one: nothing global to reset.
        self._tracer = self._provider.get_tracer("pagedserve")
        self.num_spans = 0
        """Spans handed to the processor so far."""
        self._is_shut_down = False

    def record(self, timeline: dict) -> None:
        """A finished sequence's timeline as a span (TimelineStore finish listener). Never
        raises: the store's other listeners and the engine must go on."""
        try:
            self._record(timeline)
        except Exception:
            logger.exception("could not trace request %s", timeline.get("sequence_id"))

    def _record(self, timeline: dict) -> None:
        otel = self._otel
        arrival = timeline["arrival_time"]
        summary = timeline["summary"]
        end = arrival + (summary["e2e_s"] or 0.0)
        span = self._tracer.start_span(
            SPAN_NAME, context=otel["Context"](), kind=otel["SpanKind"].SERVER,
            attributes=self.attributes(timeline), start_time=_ns(arrival))
        for event in timeline["events"]:
            if event["t"] is None:
                continue
            attributes = {key: value for key, value in event.items()
                          if key not in ("t", "type") and value is not None}
            span.add_event(event["type"], attributes, timestamp=_ns(arrival + event["t"]))
        if timeline["finish_reason"] == "error":
            span.set_status(otel["Status"](otel["StatusCode"].ERROR, "the request failed"))
        span.end(end_time=_ns(end))
        self.num_spans += 1

    def attributes(self, timeline: dict) -> dict[str, Any]:
        """The span's attributes: vLLM's gen_ai.* names, then our summary (pagedserve.*);
        unknown values (None) are left out."""
        a = SpanAttributes
        summary = timeline["summary"]
        sampling = timeline.get("sampling") or {}
        prefill_s, decode_s = summary["prefill_s"], summary["decode_s"]
        attributes = {
            a.GEN_AI_REQUEST_ID: timeline["request_id"],
            a.GEN_AI_REQUEST_MAX_TOKENS: timeline["max_tokens"],
            a.GEN_AI_REQUEST_TEMPERATURE: sampling.get("temperature"),
            a.GEN_AI_REQUEST_TOP_P: sampling.get("top_p"),
            a.GEN_AI_REQUEST_N: sampling.get("n"),
            a.GEN_AI_RESPONSE_MODEL: timeline["lora_name"] or self.model_name,
            a.GEN_AI_RESPONSE_FINISH_REASONS: ([timeline["finish_reason"]]
                                               if timeline["finish_reason"] else None),
            a.GEN_AI_USAGE_PROMPT_TOKENS: timeline["num_prompt_tokens"],
            a.GEN_AI_USAGE_COMPLETION_TOKENS: timeline["num_output_tokens"],
            a.GEN_AI_LATENCY_TIME_IN_QUEUE: summary["queue_s"],
            a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: summary["ttft_s"],
            a.GEN_AI_LATENCY_E2E: summary["e2e_s"],
            a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: prefill_s,
            a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: decode_s,
            a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: (prefill_s + decode_s
                                                       if prefill_s is not None
                                                       and decode_s is not None else None),
            "pagedserve.sequence_id": timeline["sequence_id"],
            "pagedserve.lora_name": timeline["lora_name"],
            "pagedserve.cached_tokens": sum(summary["cached_tokens"].values()),
            "pagedserve.num_preemptions": summary["num_preemptions"],
            "pagedserve.num_recomputed_tokens": summary["num_recomputed_tokens"],
            "pagedserve.num_prefill_chunks": summary["num_prefill_chunks"],
            "pagedserve.num_decode_steps": summary["num_decode_steps"],
            "pagedserve.admission_wait_s": summary["admission_wait_s"],
            "pagedserve.ttft_explanation": summary["explanation"],
        }
        for source, num_tokens in summary["cached_tokens"].items():
            attributes[f"pagedserve.cached_tokens.{source}"] = num_tokens
        for part, seconds in (summary["ttft_breakdown"] or {}).items():
            attributes[f"pagedserve.ttft.{part}"] = seconds
        itl = timeline.get("itl")
        if itl:
            attributes["pagedserve.itl.mean_s"] = itl["mean_s"]
            attributes["pagedserve.itl.p99_s"] = itl["p99_s"]
        return {key: value for key, value in attributes.items() if value is not None}

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Export every span recorded so far; False if that took longer than timeout_s."""
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush, then stop the export thread; safe to call twice."""
        if not self._is_shut_down:
            self._is_shut_down = True
            self._provider.shutdown()


def attach_tracer(timeline_store, endpoint: str, model_name: str,
                  span_exporter=None) -> RequestTracer:
    """A tracer that exports a span for each sequence `timeline_store` sees finish. Raises
    ValueError naming the pip packages if OpenTelemetry is not installed."""
    tracer = RequestTracer(endpoint, model_name, span_exporter)
    timeline_store.add_finish_listener(tracer.record)
    return tracer
