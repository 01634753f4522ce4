"""PrometheusStatLogger driven by synthetic SchedulerStats and DELTA RequestOutputs (no model);
every check reads the text exposition, as a Prometheus scrape would."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.core.stats import SchedulerStats, SpecDecodingStats
from pagedserve.metrics import PrometheusStatLogger, build_1_2_5_buckets
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

MODEL = "tiny"


def scrape(stat_logger: PrometheusStatLogger) -> dict[tuple, float]:
    """(sample name, sorted non-model labels) -> value; asserts every sample has our model label."""
    samples = {}
    for family in text_string_to_metric_families(stat_logger.render().decode()):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL, sample
            samples[(sample.name, *sorted(labels.items()))] = sample.value
    return samples


def stats(**counters) -> SchedulerStats:
    values = dict(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0,
                  prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                  num_prompt_tokens_computed=0, num_generation_tokens=0)
    values.update(counters)
    return SchedulerStats(**values)


def output(request_id: str, metrics: RequestMetrics, new_tokens: dict[int, list[int]],
           finish_reasons: dict[int, str] | None = None, prompt_len: int = 10) -> RequestOutput:
    """A DELTA output: sequence index -> its new token ids."""
    finish_reasons = finish_reasons or {}
    completions = [
        CompletionOutput(index=index, text="", token_ids=ids, cumulative_logprob=None,
                         logprobs=None, finish_reason=finish_reasons.get(index))
        for index, ids in new_tokens.items()
    ]
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[1] * prompt_len,
                         prompt_logprobs=None, outputs=completions,
                         finished=bool(finish_reasons), num_cached_tokens=0, metrics=metrics)


def histogram(samples: dict, name: str) -> tuple[float, float]:
    """(count, sum) of one histogram."""
    return samples[(f"pagedserve:{name}_count",)], samples[(f"pagedserve:{name}_sum",)]


def test_gauges_and_counters_follow_scheduler_stats():
    stat_logger = PrometheusStatLogger(MODEL)
    stat_logger.record_step(stats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25,
                                  prefix_cache_queries=100, prefix_cache_hits=32,
                                  num_prompt_tokens_computed=68, num_generation_tokens=3), 1.0)
    stat_logger.record_step(stats(num_running_reqs=1, kv_cache_usage=0.5,
                                  prefix_cache_queries=150, prefix_cache_hits=64, num_preemptions=1,
                                  num_prompt_tokens_computed=86, num_generation_tokens=7), 2.0)
    samples = scrape(stat_logger)
    assert samples[("pagedserve:num_requests_running",)] == 1
    assert samples[("pagedserve:num_requests_waiting",)] == 0
    assert samples[("pagedserve:kv_cache_usage_perc",)] == 0.5
    assert samples[("pagedserve:prompt_tokens_total",)] == 86
    assert samples[("pagedserve:generation_tokens_total",)] == 7
    assert samples[("pagedserve:prefix_cache_queries_total",)] == 150
    assert samples[("pagedserve:prefix_cache_hits_total",)] == 64
    assert samples[("pagedserve:num_preemptions_total",)] == 1
    for reason in ("stop", "length", "abort"):  # present before any request finishes
        assert samples[("pagedserve:request_success_total", ("finished_reason", reason))] == 0

    # Same stats again: nothing new. Then a restarted engine's small counters count in full.
    stat_logger.record_step(stats(num_prompt_tokens_computed=86, num_generation_tokens=7), 3.0)
    assert scrape(stat_logger)[("pagedserve:prompt_tokens_total",)] == 86
    stat_logger.record_step(stats(num_prompt_tokens_computed=5, num_generation_tokens=1), 4.0)
    samples = scrape(stat_logger)
    assert samples[("pagedserve:prompt_tokens_total",)] == 91
    assert samples[("pagedserve:generation_tokens_total",)] == 8


def test_spec_decode_counters_follow_scheduler_stats():
    stat_logger = PrometheusStatLogger(MODEL, num_speculative_tokens=3)
    samples = scrape(stat_logger)  # present, at 0, before any draft
    assert samples[("pagedserve:spec_decode_num_drafts_total",)] == 0
    assert samples[("pagedserve:spec_decode_num_accepted_tokens_per_pos_total",
                    ("position", "2"))] == 0
    spec = SpecDecodingStats()
    spec.observe(3, 2)
    spec.observe(3, 0)
    stat_logger.record_step(stats(spec_decoding=spec.copy()), 1.0)
    spec.observe(2, 2)
    stat_logger.record_step(stats(spec_decoding=spec.copy()), 2.0)
    samples = scrape(stat_logger)
    assert samples[("pagedserve:spec_decode_num_drafts_total",)] == 3
    assert samples[("pagedserve:spec_decode_num_draft_tokens_total",)] == 8
    assert samples[("pagedserve:spec_decode_num_accepted_tokens_total",)] == 4
    accepted = [samples[("pagedserve:spec_decode_num_accepted_tokens_per_pos_total",
                         ("position", str(pos)))] for pos in range(3)]
    drafted = [samples[("pagedserve:spec_decode_num_draft_tokens_per_pos_total",
                        ("position", str(pos)))] for pos in range(3)]
    assert accepted == [2, 2, 0] and drafted == [3, 3, 2]
    assert samples[("pagedserve:spec_decode_mean_acceptance_length",)] == 1 + 4 / 3
    # Without speculation there is no spec_decode series at all (as in vLLM).
    plain = PrometheusStatLogger(MODEL)
    plain.record_step(stats(), 1.0)
    assert not any("spec_decode" in key[0] for key in scrape(plain))


def test_request_lifecycle_histograms():
    stat_logger = PrometheusStatLogger(MODEL)
    metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5)
    # | queue 0.5 | prefill 0.5 | 1 token | +0.2: 2 tokens | +0.3: 1 token, finished |
    metrics.first_token_time = metrics.last_token_time = 101.0
    stat_logger.record_output(output("a", metrics, {0: [7]}), now=101.0)
    assert stat_logger.num_tracked_requests == 1
    samples = scrape(stat_logger)
    assert histogram(samples, "time_to_first_token_seconds") == (1, 1.0)  # at the first token
    assert histogram(samples, "inter_token_latency_seconds") == (0, 0)

    metrics.last_token_time = 101.2
    stat_logger.record_output(output("a", metrics, {0: [8, 9]}), now=101.2)
    metrics.last_token_time, metrics.finished_time = 101.5, 101.6
    stat_logger.record_output(output("a", metrics, {0: [10]}, {0: "length"}, prompt_len=12),
                              now=101.5)
    assert stat_logger.num_tracked_requests == 0  # per-request state dropped on finish

    samples = scrape(stat_logger)
    count, total = histogram(samples, "inter_token_latency_seconds")
    assert count == 3 and total == pytest.approx(0.1 + 0.1 + 0.3)
    assert samples[("pagedserve:inter_token_latency_seconds_bucket", ("le", "0.075"))] == 0
    assert samples[("pagedserve:inter_token_latency_seconds_bucket", ("le", "0.15"))] == 2
    assert histogram(samples, "time_to_first_token_seconds") == (1, 1.0)  # not observed twice
    count, total = histogram(samples, "request_time_per_output_token_seconds")
    assert count == 1 and total == pytest.approx(0.5 / 3)
    for name, seconds in [("e2e_request_latency", 1.6), ("request_queue_time", 0.5),
                          ("request_prefill_time", 0.5), ("request_decode_time", 0.5)]:
        count, total = histogram(samples, f"{name}_seconds")
        assert count == 1 and total == pytest.approx(seconds), name
    assert histogram(samples, "request_prompt_tokens") == (1, 12)
    assert histogram(samples, "request_generation_tokens") == (1, 4)
    assert samples[("pagedserve:request_generation_tokens_bucket", ("le", "5.0"))] == 1
    assert samples[("pagedserve:request_success_total", ("finished_reason", "length"))] == 1
    assert samples[("pagedserve:request_success_total", ("finished_reason", "stop"))] == 0


def test_parallel_sequences_keep_separate_inter_token_clocks():
    stat_logger = PrometheusStatLogger(MODEL)
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=1.0,
                             last_token_time=1.0)
    stat_logger.record_output(output("n2", metrics, {0: [1], 1: [2]}), now=1.0)
    stat_logger.record_output(output("n2", metrics, {0: [3]}), now=1.5)        # seq 0: 0.5
    stat_logger.record_output(output("n2", metrics, {1: [4]}), now=2.0)        # seq 1: 1.0
    metrics.last_token_time = metrics.finished_time = 2.0
    # Sequence 0 finished earlier and is repeated with no new tokens: no ITL sample for it.
    stat_logger.record_output(output("n2", metrics, {0: [], 1: [5]}, {0: "stop", 1: "length"}),
                              now=2.0)
    samples = scrape(stat_logger)
    count, total = histogram(samples, "inter_token_latency_seconds")
    assert count == 3 and total == pytest.approx(1.5)  # 0.5; 1.0; 0 (seq 1, same step)
    assert histogram(samples, "request_generation_tokens") == (1, 5)
    # The longest sequence (3 tokens over 1.0 s) sets TPOT; sequence 0's reason labels it.
    assert histogram(samples, "request_time_per_output_token_seconds") == (1, 0.5)
    assert samples[("pagedserve:request_success_total", ("finished_reason", "stop"))] == 1
    assert stat_logger.num_tracked_requests == 0


def test_abort_before_first_token():
    stat_logger = PrometheusStatLogger(MODEL)
    metrics = RequestMetrics(arrival_time=5.0, finished_time=6.0)
    stat_logger.record_output(output("x", metrics, {0: []}, {0: "abort"}), now=6.0)
    samples = scrape(stat_logger)
    assert samples[("pagedserve:request_success_total", ("finished_reason", "abort"))] == 1
    assert histogram(samples, "time_to_first_token_seconds") == (0, 0)
    assert histogram(samples, "e2e_request_latency_seconds") == (1, 1.0)
    assert histogram(samples, "request_prefill_time_seconds") == (0, 0)
    assert histogram(samples, "request_decode_time_seconds") == (0, 0)
    assert stat_logger.num_tracked_requests == 0


def test_loggers_own_their_registries_and_serve_asgi():
    first, second = PrometheusStatLogger(MODEL), PrometheusStatLogger(MODEL)
    first.record_step(stats(num_generation_tokens=3), 0.0)
    assert scrape(second)[("pagedserve:generation_tokens_total",)] == 0

    async def get_metrics() -> httpx.Response:
        transport = httpx.ASGITransport(app=first.make_asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/")

    response = asyncio.run(get_metrics())
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert 'pagedserve:generation_tokens_total{model_name="tiny"} 3.0' in response.text


def test_concurrent_recording_and_scraping():
    stat_logger = PrometheusStatLogger(MODEL)
    num_requests, stop = 200, threading.Event()

    def scrape_until_stopped():
        while not stop.is_set():
            scrape(stat_logger)

    scraper = threading.Thread(target=scrape_until_stopped)
    scraper.start()
    try:
        for i in range(num_requests):
            metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0,
                                     first_token_time=1.0, last_token_time=1.0)
            stat_logger.record_output(output(str(i), metrics, {0: [1]}), now=1.0)
            metrics.last_token_time = metrics.finished_time = 2.0
            stat_logger.record_output(output(str(i), metrics, {0: [2]}, {0: "stop"}), now=2.0)
            stat_logger.record_step(stats(num_generation_tokens=2 * (i + 1)), 2.0)
    finally:
        stop.set()
        scraper.join()
    samples = scrape(stat_logger)
    num_stopped = samples[("pagedserve:request_success_total", ("finished_reason", "stop"))]
    assert num_stopped == num_requests
    assert samples[("pagedserve:generation_tokens_total",)] == 2 * num_requests
    assert histogram(samples, "inter_token_latency_seconds") == (num_requests, num_requests)
    assert stat_logger.num_tracked_requests == 0


def test_token_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096)[-1] == 2000


def test_structured_output_metrics():
    from pagedserve.structured_output import StructuredOutputStats

    stat_logger = PrometheusStatLogger(MODEL)
    first = stats()
    first.structured_output = StructuredOutputStats(
        num_constrained_requests=3, num_compiles=2, num_compile_failures=1,
        recent_compile_seconds=(0.002, 0.2), num_mask_steps=3,
        recent_mask_seconds=(0.0001, 0.0002, 0.0003))
    stat_logger.record_step(first, 0.0)
    stat_logger.record_step(first, 1.0)  # nothing new: nothing counted twice
    second = stats()
    second.structured_output = StructuredOutputStats(
        num_constrained_requests=5, num_compiles=3, num_compile_failures=1,
        recent_compile_seconds=(0.002, 0.2, 0.004), num_mask_steps=4,
        recent_mask_seconds=(0.0001, 0.0002, 0.0003, 0.03))
    stat_logger.record_step(second, 2.0)
    samples = scrape(stat_logger)
    assert samples[("pagedserve:structured_output_requests_total",)] == 5
    assert samples[("pagedserve:grammar_compile_failures_total",)] == 1
    assert samples[("pagedserve:grammar_compile_time_seconds_count",)] == 3
    assert samples[("pagedserve:grammar_compile_time_seconds_sum",)] == pytest.approx(0.206)
    assert samples[("pagedserve:grammar_compile_time_seconds_bucket", ("le", "0.0025"))] == 1
    assert samples[("pagedserve:grammar_mask_time_seconds_count",)] == 4
    assert samples[("pagedserve:grammar_mask_time_seconds_sum",)] == pytest.approx(0.0306)
