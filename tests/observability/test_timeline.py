"""Per-request timelines from the event stream: their parts add up and agree with the request's
metrics, a preemption and a prefix hit show where they happened, and the ring is bounded."""

from __future__ import annotations

import pytest

from pagedserve.observability.timeline import TimelineStore
from pagedserve.outputs import OutputKind
from pagedserve.sampling_params import SamplingParams
from tests.prompts import source_text

BOUND_S = 0.05
"""Two clocks read a few statements apart (the engine's step start, the scheduler's timestamp):
they agree to well within this, whatever the load."""


def _observed(llm, history: int = 100) -> TimelineStore:
    store = TimelineStore(history)
    llm.engine.events.subscribe(store.on_events)
    return store


def _run(engine, requests) -> dict:
    """Run to completion; the final RequestOutput of each request id."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params,
                           output_kind=OutputKind.FINAL_ONLY)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def test_timeline_parts_add_up_and_agree_with_the_metrics(make_llm):
    llm = make_llm(max_num_batched_tokens=48, max_num_seqs=4)
    store = _observed(llm)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    finals = _run(llm.engine, [(f"r{i}", list(range(900 + 40 * i, 960 + 40 * i)), params)
                               for i in range(3)])
    for request_id, output in finals.items():
        timeline = store.get(request_id)
        summary, metrics = timeline["summary"], output.metrics
        assert timeline["state"] == "finished" and timeline["finish_reason"] == "length"
        assert timeline["num_output_tokens"] == 8
        parts = summary["queue_s"] + summary["prefill_s"] + summary["decode_s"]
        assert parts == pytest.approx(summary["e2e_s"], abs=BOUND_S)
        assert summary["e2e_s"] == pytest.approx(metrics.finished_time - metrics.arrival_time,
                                                 abs=BOUND_S)
        assert summary["queue_s"] == pytest.approx(metrics.queue_time, abs=BOUND_S)
        assert summary["ttft_s"] == pytest.approx(metrics.time_to_first_token, abs=BOUND_S)
        assert summary["decode_s"] == pytest.approx(
            metrics.last_token_time - metrics.first_token_time, abs=BOUND_S)
        breakdown = summary["ttft_breakdown"]
        assert sum(breakdown.values()) == pytest.approx(summary["ttft_s"], abs=BOUND_S)
        assert breakdown["in_steps_s"] > 0
        # 60-token prompts in 48-token budgets: two prefill chunks, then 7 decode steps.
        kinds = [segment["kind"] for segment in timeline["segments"]]
        assert kinds == ["queued", "prefill", "prefill", "decode"], kinds
        assert [s["num_tokens"] for s in timeline["segments"][1:]] == [
            timeline["segments"][1]["num_tokens"], 60 - timeline["segments"][1]["num_tokens"], 7]
        assert summary["num_decode_steps"] == 7 and timeline["itl"]["count"] == 7
        starts = [s["start"] for s in timeline["segments"]]
        assert starts == sorted(starts) and all(s["end"] >= s["start"] for s in
                                                timeline["segments"])
        assert [e["type"] for e in timeline["events"]] == ["queued", "first_token", "finished"]
    assert store.num_live == 0 and store.num_pending_steps == 0


def test_a_forced_preemption_shows_in_the_preempted_requests_timeline(make_llm):
    llm = make_llm(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256,
                   num_gpu_blocks_override=6)
    store = _observed(llm)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _run(llm.engine, [("c", list(range(3000, 3030)), params),
                      ("d", list(range(4000, 4030)), params)])
    assert llm.engine.get_stats().num_preemptions == 1
    kept = store.get("c")["summary"]
    assert kept["num_preemptions"] == 0
    timeline = store.get("d")
    summary = timeline["summary"]
    assert summary["num_preemptions"] == 1 and summary["num_recomputed_tokens"] == 17
    preempted = [s for s in timeline["segments"] if s["kind"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["num_tokens_lost"] == 32
    assert preempted[0]["end"] > preempted[0]["start"]
    resumed = next(e for e in timeline["events"] if e["type"] == "resumed")
    assert resumed["num_tokens_to_recompute"] == 17 and resumed["num_tokens_from_cache"] == 16
    assert "preempted 1x, 17 tokens recomputed" in summary["explanation"]
    # After it, a prefill (the recomputation) and a decode run: the timeline tells the story.
    kinds = [s["kind"] for s in timeline["segments"]]
    assert kinds[kinds.index("preempted"):] == ["preempted", "prefill", "decode"]
    assert summary["cached_tokens"] == {}  # nothing was cached at its first admission


def test_the_second_doc_qa_question_shows_the_prefix_hit(make_llm, tokenizer):
    llm = make_llm()
    store = _observed(llm)
    document = tokenizer.encode(source_text(4000))
    assert len(document) >= 1000
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    questions = ["\n\nSummarize the code above.", "\n\nWhat are the risks in this code?"]
    finals = {}
    for index, question in enumerate(questions):
        finals.update(_run(llm.engine, [(f"q{index}", document + tokenizer.encode(question),
                                         params)]))
    first, second = store.get("q0")["summary"], store.get("q1")["summary"]
    assert first["cached_tokens"] == {}
    num_hit = second["cached_tokens"]["device"]
    assert num_hit == finals["q1"].num_cached_tokens >= len(document) // 16 * 16
    hit = next(e for e in store.get("q1")["events"] if e["type"] == "prefix_hit")
    assert hit["num_tokens"] == num_hit and hit["source"] == "device"
    assert f"cached {num_hit} tokens from device" in second["explanation"]
    prefill = [s for s in store.get("q1")["segments"] if s["kind"] == "prefill"]
    assert prefill[0]["num_computed_tokens"] == num_hit


def test_the_ring_is_bounded_and_finds_requests_by_alias_and_sequence(make_llm):
    llm = make_llm()
    store = _observed(llm, history=3)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, n=2)
    store.add_alias("cmpl-outside", ["x0"])
    _run(llm.engine, [("x0", list(range(100, 120)), params)])
    both = store.get("cmpl-outside")
    assert both["request_id"] == "cmpl-outside" and len(both["sequences"]) == 2
    assert {t["sequence_id"] for t in both["sequences"]} == {"0_x0", "1_x0"}
    assert store.get("1_x0")["sequence_id"] == "1_x0"
    single = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    _run(llm.engine, [(f"y{i}", list(range(200 + i, 220 + i)), single) for i in range(2)])
    # 4 sequences finished, 3 kept: the oldest (one of x0's) is gone.
    assert len(store.recent(10)) == 3
    assert len(store.get("x0").get("sequences", [None])) == 1
    assert store.get("y0") is not None and store.get("y1") is not None
    assert store.get("never-seen") is None
    assert store.num_live == 0


def test_a_live_request_has_a_timeline_with_open_segments(make_llm):
    llm = make_llm(max_num_batched_tokens=32, max_num_seqs=4)
    store = _observed(llm)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("live", {"prompt_token_ids": list(range(300, 340))}, params)
    assert store.get("live")["state"] == "waiting"
    engine.step()  # the first 32-token chunk
    timeline = store.get("live")
    assert timeline["state"] == "running" and timeline["summary"]["ttft_s"] is None
    assert timeline["summary"]["explanation"] == "waiting for its first token"
    assert [s["kind"] for s in store.recent(5)[0]["segments"]] == ["queued", "prefill"]
    engine.abort_request("live")
    assert store.get("live")["finish_reason"] == "abort" and store.num_live == 0
