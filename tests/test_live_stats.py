"""LiveStats (observability/live_stats.py) fed scripted SchedulerStats and outputs at scripted
times: throughput from the counters' growth, gauges, hit rate, latency percentiles, bounds."""

from __future__ import annotations

import threading

import pytest

from pagedserve.core.stats import SchedulerStats
from pagedserve.observability.live_stats import LiveStats
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput


def stats(*, running=0, waiting=0, kv=0.0, queries=0, hits=0, preemptions=0, prompt=0,
          generation=0) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=kv,
                          prefix_cache_queries=queries, prefix_cache_hits=hits,
                          num_preemptions=preemptions, num_prompt_tokens_computed=prompt,
                          num_generation_tokens=generation)


def output(request_id: str, num_tokens: int, *, arrival: float, first_token: float | None,
           finished: bool = False, index: int = 0) -> RequestOutput:
    completion = CompletionOutput(index, "x" * num_tokens, list(range(num_tokens)), None, None,
                                  "length" if finished else None)
    return RequestOutput(request_id, None, [1, 2, 3], None, [completion], finished, 0,
                         RequestMetrics(arrival, first_token_time=first_token))


def test_one_point_per_bucket_with_rates_from_counter_growth():
    live = LiveStats(bucket_s=1.0)
    live.record_step(stats(prompt=100, generation=10), now=10.0)  # the baseline: no growth yet
    live.record_step(stats(running=3, waiting=2, kv=0.5, prompt=300, generation=20), now=10.5)
    live.record_step(stats(running=2, waiting=0, kv=0.25, prompt=300, generation=40), now=11.0)
    [point] = live.snapshot()["points"]
    assert point["duration_s"] == 1.0
    assert point["prompt_tokens_per_s"] == 200.0
    assert point["generation_tokens_per_s"] == 30.0
    # gauges: the peak within the bucket
    assert (point["num_running"], point["num_waiting"], point["kv_cache_usage"]) == (3, 2, 0.5)
    assert point["prefix_cache_hit_rate"] is None  # no lookups in this bucket
    snapshot = live.snapshot()
    assert snapshot["latest"]["num_running"] == 2
    assert snapshot["latest"]["totals"]["prompt_tokens"] == 300


def test_a_long_step_makes_a_long_bucket_not_a_spike():
    live = LiveStats(bucket_s=1.0)
    live.record_step(stats(), now=0.0)
    live.record_step(stats(generation=30), now=3.0)  # one 3 s step
    [point] = live.snapshot()["points"]
    assert point["duration_s"] == 3.0 and point["generation_tokens_per_s"] == 10.0


def test_prefix_hit_rate_and_preemptions_per_bucket():
    live = LiveStats(bucket_s=1.0)
    live.record_step(stats(queries=100, hits=50), now=0.0)
    live.record_step(stats(queries=200, hits=125, preemptions=2), now=1.0)
    live.record_step(stats(queries=200, hits=125, preemptions=2), now=2.0)
    first, second = live.snapshot()["points"]
    assert first["prefix_cache_hit_rate"] == 0.75 and first["num_preemptions"] == 2
    assert second["prefix_cache_hit_rate"] is None and second["num_preemptions"] == 0


def test_counters_that_restart_count_as_new():
    live = LiveStats(bucket_s=1.0)
    live.record_step(stats(generation=1000), now=0.0)
    live.record_step(stats(generation=5), now=1.0)  # a new engine behind the same logger
    assert live.snapshot()["points"][0]["generation_tokens_per_s"] == 5.0


def test_the_ring_keeps_the_last_window():
    live = LiveStats(window_s=10.0, bucket_s=1.0)
    for second in range(31):
        live.record_step(stats(generation=second), now=float(second))
    points = live.snapshot()["points"]
    assert len(points) == 10
    assert points[-1]["t"] - points[0]["t"] == pytest.approx(9.0, abs=1e-3)


def test_ttft_and_itl_percentiles_over_the_recent_window():
    live = LiveStats(bucket_s=1.0, latency_window_s=5.0)
    live.record_step(stats(), now=0.0)
    # a: TTFT 0.2 s, then outputs 0.1 s apart; b: TTFT 0.4 s, then one 2-token output 0.3 s later
    live.record_output(output("a", 1, arrival=0.0, first_token=0.2), now=0.2)
    live.record_output(output("a", 1, arrival=0.0, first_token=0.2), now=0.3)
    live.record_output(output("a", 1, arrival=0.0, first_token=0.2, finished=True), now=0.4)
    live.record_output(output("b", 1, arrival=0.1, first_token=0.5), now=0.5)
    live.record_output(output("b", 2, arrival=0.1, first_token=0.5, finished=True), now=0.8)
    live.record_step(stats(), now=1.0)
    [point] = live.snapshot()["points"]
    assert point["num_ttft_samples"] == 2
    assert point["ttft_p50_s"] == pytest.approx(0.2) and point["ttft_p99_s"] == pytest.approx(0.4)
    assert point["num_itl_samples"] == 4  # 0.1, 0.1, 0.15, 0.15
    assert point["itl_p50_s"] == pytest.approx(0.1) and point["itl_p90_s"] == pytest.approx(0.15)
    assert point["num_finished_requests"] == 2
    assert live.num_tracked_requests == 0
    # past the latency window the samples age out: percentiles become null, not stale
    live.record_step(stats(), now=7.0)
    last = live.snapshot()["points"][-1]
    assert last["ttft_p50_s"] is None and last["itl_p99_s"] is None


def test_the_first_output_without_a_token_gives_no_ttft():
    live = LiveStats()
    live.record_output(output("a", 0, arrival=0.0, first_token=None), now=0.1)
    live.record_output(output("a", 1, arrival=0.0, first_token=0.3), now=0.3)
    live.record_output(output("a", 1, arrival=0.0, first_token=0.3), now=0.4)
    assert [v for _, v in live._ttft_samples] == [pytest.approx(0.3)]
    assert len(live._itl_samples) == 1


def test_latency_samples_are_bounded():
    live = LiveStats(max_latency_samples=8)
    for i in range(100):
        live.record_output(output(f"r{i}", 1, arrival=0.0, first_token=0.1), now=0.1)
    assert len(live._ttft_samples) == 8
    assert live.num_tracked_requests == 100  # still live; bounded by _MAX_TRACKED_REQUESTS


def test_rejects_bad_windows():
    with pytest.raises(ValueError):
        LiveStats(bucket_s=0)
    with pytest.raises(ValueError):
        LiveStats(window_s=0.5, bucket_s=1.0)


def test_readers_and_the_engine_thread_run_at_once():
    live = LiveStats(bucket_s=0.001)
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            live.snapshot()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(2000):
            live.record_step(stats(generation=i), now=i * 0.001)
            live.record_output(output(f"r{i % 7}", 1, arrival=0.0, first_token=0.0,
                                      finished=i % 7 == 6), now=i * 0.001)
    finally:
        stop.set()
        reader.join()
    assert live.snapshot()["points"]
