"""The OTLP tracer over a hand-made event stream (no model, no network): a request that was
preempted and resumed becomes one span from arrival to finish with vLLM's gen_ai attributes,
the timeline's events (preempted and resumed included) at their times, and the pagedserve.*
summary; a listener that fails does not stop the timeline store."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.observability.events import (
    EventBus,
    RequestFinished,
    RequestPreempted,
    RequestQueued,
    RequestResumed,
    RequestScheduled,
    StepFinished,
    TokensGenerated,
)
from pagedserve.observability.timeline import TimelineStore

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind  # noqa: E402

from pagedserve.observability.tracing import attach_tracer  # noqa: E402

T0 = 1000.0


def step(index: int, start: float, end: float) -> StepFinished:
    """A one-request step; its parts' timings (zero) do not matter to a timeline."""
    parts = {f.name: 0.0 for f in dataclasses.fields(StepFinished) if f.name.endswith("_s")}
    return StepFinished(step=index, start=T0 + start, end=T0 + end, num_requests=1,
                        num_prefill_requests=0, num_decode_requests=1, num_prefill_tokens=0,
                        num_decode_tokens=1, num_preempted=0, **parts)


def preempted_request() -> list[list]:
    """Batches of events, as the engine publishes them: prefill, one decode, preempted,
    recomputed, one more decode, finished by length."""
    return [
        [RequestQueued("r", "r", T0, 20, 3, None, 0.5, 0.8, 1)],
        [RequestScheduled("r", 0, 20, 0, "prefill"), step(0, 0.1, 0.2),
         TokensGenerated("r", 0, T0 + 0.2, 1, True)],
        [RequestScheduled("r", 1, 1, 20, "decode"), step(1, 0.2, 0.3),
         TokensGenerated("r", 1, T0 + 0.3, 1, False)],
        [RequestPreempted("r", 2, T0 + 0.35, 21)],
        [RequestResumed("r", 3, 21), RequestScheduled("r", 3, 21, 0, "prefill"),
         step(3, 0.5, 0.6), TokensGenerated("r", 3, T0 + 0.6, 1, False),
         RequestFinished("r", T0 + 0.6, "length", 3)],
    ]


@pytest.fixture
def traced():
    bus, store, exporter = EventBus(), TimelineStore(), InMemorySpanExporter()
    bus.subscribe(store.on_events)
    tracer = attach_tracer(store, "http://unused.invalid/v1/traces", "tiny", exporter)
    yield bus, store, tracer, exporter
    tracer.shutdown()


def publish(bus: EventBus, batches: list[list]) -> None:
    for batch in batches:
        for event in batch:
            bus.emit(event)
        bus.publish()


def test_a_preempted_request_as_one_span(traced):
    bus, store, tracer, exporter = traced
    publish(bus, preempted_request())
    assert tracer.force_flush()
    (span,) = exporter.get_finished_spans()
    wall_arrival = store.get("r")["arrival_time"]
    assert span.name == "llm_request" and span.kind == SpanKind.SERVER
    assert span.resource.attributes["service.name"] == "pagedserve"
    assert span.start_time == pytest.approx(wall_arrival * 1e9, abs=1e3)
    assert (span.end_time - span.start_time) / 1e9 == pytest.approx(0.6, abs=1e-6)
    a = span.attributes
    assert a["gen_ai.request.id"] == "r" and a["gen_ai.response.model"] == "tiny"
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"],
            a["gen_ai.request.n"], a["gen_ai.request.max_tokens"]) == (0.5, 0.8, 1, 3)
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (20, 3)
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(0.1)
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(0.2)
    assert a["gen_ai.latency.e2e"] == pytest.approx(0.6)
    assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(0.1)
    assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(0.4)
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(0.5)
    assert a["pagedserve.num_preemptions"] == 1
    assert a["pagedserve.num_recomputed_tokens"] == 21
    assert a["pagedserve.num_prefill_chunks"] == 2 and a["pagedserve.num_decode_steps"] == 1
    assert a["pagedserve.ttft_explanation"].startswith("TTFT 0.200 s")
    assert "pagedserve.lora_name" not in a  # None values are left out
    events = [(e.name, (e.timestamp - span.start_time) / 1e9) for e in span.events]
    assert [name for name, _ in events] == ["queued", "first_token", "preempted", "resumed",
                                            "finished"]
    assert [t for _, t in events] == pytest.approx([0.0, 0.2, 0.35, 0.5, 0.6], abs=1e-6)
    assert span.events[2].attributes["num_tokens_lost"] == 21


def test_a_failing_span_does_not_stop_the_timelines(traced, monkeypatch):
    bus, store, tracer, exporter = traced
    monkeypatch.setattr(tracer, "_record", lambda timeline: 1 / 0)
    publish(bus, preempted_request())
    assert store.get("r")["state"] == "finished"
    assert bus.enabled  # the store is still subscribed
    assert tracer.force_flush() and not exporter.get_finished_spans()
