"""--compare-events of `bench throughput`: what observing the engine's event stream costs, as a
throughput ratio (the batch run with and without a timeline store subscribed, alternated) and
measured directly (time in the subscribers plus the events emitted times one emit's cost)."""

from __future__ import annotations

import time
from typing import Any

from pagedserve.benchmarks.datasets import Workload
from pagedserve.engine.llm import LLM
from pagedserve.observability.events import EventBus, RequestScheduled
from pagedserve.observability.timeline import TimelineStore


def compare_events(llm: LLM, workload: Workload, rounds: int) -> dict[str, Any]:
    """--compare-events: the cost of observing the event stream. Each round runs the batch
    without a subscriber and with a TimelineStore subscribed (the server's consumer), in
    alternating order so that neither side always runs first; the ratio is per round.

    On a noisy machine the ratio's spread can exceed the cost, so the cost is also measured
    directly: the time spent in the subscribers (EventBus.publish_seconds) plus the events
    emitted times what building and queueing one costs (timed here, on this machine), as a
    share of the observed runs' wall time."""
    from pagedserve.benchmarks.throughput import run_pagedserve

    bus = llm.engine.events
    runs: dict[str, list[float]] = {"off": [], "on": []}
    ratios, num_identical, num_compared = [], 0, 0
    on_elapsed, publish_before, emitted_before = 0.0, bus.publish_seconds, bus.num_published
    for index in range(rounds):
        round_ids = {}
        for mode in (("off", "on") if index % 2 == 0 else ("on", "off")):
            unsubscribe = None
            if mode == "on":
                store = TimelineStore()
                unsubscribe = llm.engine.events.subscribe(store.on_events)
            metrics, round_ids[mode] = run_pagedserve(llm, workload)
            if mode == "on":
                on_elapsed += metrics["elapsed_s"]
            if unsubscribe is not None:
                unsubscribe()
                assert len(store.recent(1)) == 1, "the timeline store saw no request"
            runs[mode].append(metrics["output_tokens_per_s"])
        ratios.append(runs["on"][-1] / runs["off"][-1])
        num_identical += sum(a == b for a, b in zip(round_ids["off"], round_ids["on"]))
        num_compared += len(round_ids["off"])
    ordered = sorted(ratios)
    num_emitted = bus.num_published - emitted_before
    emit_seconds = num_emitted * _seconds_per_emitted_event()
    subscriber_seconds = bus.publish_seconds - publish_before
    return {"rounds": rounds, "num_events": num_emitted,
            "subscriber_seconds": subscriber_seconds, "emit_seconds_estimate": emit_seconds,
            "measured_cost_share": (subscriber_seconds + emit_seconds) / on_elapsed,
            "output_tokens_per_s_off": runs["off"],
            "output_tokens_per_s_on": runs["on"], "ratio_on_to_off_per_round": ratios,
            "median_ratio_on_to_off": ordered[len(ordered) // 2],
            "num_outputs_identical": num_identical, "num_outputs_compared": num_compared}


def _seconds_per_emitted_event() -> float:
    """What one emit costs on an enabled bus: build a RequestScheduled (the commonest event)
    behind the `enabled` check and queue it; the best of three batches."""
    bus = EventBus()
    bus.subscribe(lambda events: None)
    num_events = 20000
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for step in range(num_events):
            if bus.enabled:
                bus.emit(RequestScheduled("req-0", step, 1, 100, "decode", 0))
        best = min(best, time.perf_counter() - start)
        bus.publish()
    return best / num_events


def format_events_comparison(events: dict[str, Any]) -> str:
    per_round = ", ".join(f"{ratio:.3f}" for ratio in events["ratio_on_to_off_per_round"])
    return (f"event stream observed vs not, {events['rounds']} rounds: output tok/s ratio "
            f"median {events['median_ratio_on_to_off']:.3f} (per round: {per_round}); "
            f"outputs identical {events['num_outputs_identical']}/"
            f"{events['num_outputs_compared']}\n"
            f"  measured cost: {events['num_events']} events, "
            f"{1000 * events['subscriber_seconds']:.1f} ms in subscribers + "
            f"{1000 * events['emit_seconds_estimate']:.1f} ms emitting = "
            f"{100 * events['measured_cost_share']:.2f}% of the observed runs' wall time")
