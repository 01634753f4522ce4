"""PrometheusStatLogger driven by synthetic SchedulerStats and DELTA RequestOutputs (no model);
every check reads the text exposition, as a Prometheus scrape would."""

from __future__ import annotations

import asyncio
import logging
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.core.stats import SchedulerStats, SpecDecodingStats
from pagedserve.logging_stat_logger import LoggingStatLogger
from pagedserve.metrics import PrometheusStatLogger, build_1_2_5_buckets
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

MODEL = "tiny"


def scrape(stat_logger: PrometheusStatLogger) -> dict[tuple, float]:
    """(sample name, sorted labels but model_name and engine) -> value; asserts every sample has
    our model label, and vLLM's engine label exactly on the `vllm:` ones."""
    samples = {}
    for family in text_string_to_metric_families(stat_logger.render().decode()):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL, sample
            assert labels.pop("engine", None) == ("0" if sample.name.startswith("vllm:")
                                                  else None), sample
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
    return samples[(f"vllm:{name}_count",)], samples[(f"vllm:{name}_sum",)]


def test_gauges_and_counters_follow_scheduler_stats():
    stat_logger = PrometheusStatLogger(MODEL)
    stat_logger.record_step(stats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25,
                                  prefix_cache_queries=100, prefix_cache_hits=32,
                                  num_prompt_tokens_computed=68, num_generation_tokens=3), 1.0)
    stat_logger.record_step(stats(num_running_reqs=1, kv_cache_usage=0.5,
                                  prefix_cache_queries=150, prefix_cache_hits=64, num_preemptions=1,
                                  num_prompt_tokens_computed=86, num_generation_tokens=7), 2.0)
    samples = scrape(stat_logger)
    assert samples[("vllm:num_requests_running",)] == 1
    assert samples[("vllm:num_requests_waiting",)] == 0
    assert samples[("vllm:kv_cache_usage_perc",)] == 0.5
    assert samples[("pagedserve:prompt_tokens_computed_total",)] == 86
    assert samples[("vllm:generation_tokens_total",)] == 7
    assert samples[("vllm:prefix_cache_queries_total",)] == 150
    assert samples[("vllm:prefix_cache_hits_total",)] == 64
    assert samples[("vllm:num_preemptions_total",)] == 1
    for reason in ("stop", "length", "abort"):  # present before any request finishes
        assert samples[("vllm:request_success_total", ("finished_reason", reason))] == 0

    # Same stats again: nothing new. Then a restarted engine's small counters count in full.
    stat_logger.record_step(stats(num_prompt_tokens_computed=86, num_generation_tokens=7), 3.0)
    assert scrape(stat_logger)[("pagedserve:prompt_tokens_computed_total",)] == 86
    stat_logger.record_step(stats(num_prompt_tokens_computed=5, num_generation_tokens=1), 4.0)
    samples = scrape(stat_logger)
    assert samples[("pagedserve:prompt_tokens_computed_total",)] == 91
    assert samples[("vllm:generation_tokens_total",)] == 8
    # One observation per step that computed tokens: 68 + 3, 18 + 4, (none), 5 + 1 (restart).
    assert histogram(samples, "iteration_tokens_total") == (3, 71 + 22 + 6)
    assert samples[("vllm:iteration_tokens_total_bucket", ("le", "16.0"))] == 1
    assert samples[("vllm:iteration_tokens_total_bucket", ("le", "32.0"))] == 2


def test_spec_decode_counters_follow_scheduler_stats():
    stat_logger = PrometheusStatLogger(MODEL, num_speculative_tokens=3)
    samples = scrape(stat_logger)  # present, at 0, before any draft
    assert samples[("vllm:spec_decode_num_drafts_total",)] == 0
    assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                    ("position", "2"))] == 0
    spec = SpecDecodingStats()
    spec.observe(3, 2)
    spec.observe(3, 0)
    stat_logger.record_step(stats(spec_decoding=spec.copy()), 1.0)
    spec.observe(2, 2)
    stat_logger.record_step(stats(spec_decoding=spec.copy()), 2.0)
    samples = scrape(stat_logger)
    assert samples[("vllm:spec_decode_num_drafts_total",)] == 3
    assert samples[("vllm:spec_decode_num_draft_tokens_total",)] == 8
    assert samples[("vllm:spec_decode_num_accepted_tokens_total",)] == 4
    accepted = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total",
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
    metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, max_tokens=4)
    # | queue 0.5 | prefill 0.5 | 1 token | +0.2: 2 tokens | +0.3: 1 token, finished |
    metrics.first_token_time = metrics.last_token_time = 101.0
    stat_logger.record_output(output("a", metrics, {0: [7]}, prompt_len=12), now=101.0)
    assert stat_logger.num_tracked_requests == 1
    samples = scrape(stat_logger)
    assert histogram(samples, "time_to_first_token_seconds") == (1, 1.0)  # at the first token
    assert histogram(samples, "inter_token_latency_seconds") == (0, 0)
    assert samples[("vllm:prompt_tokens_total",)] == 12  # its prefill is done

    metrics.last_token_time = 101.2
    stat_logger.record_output(output("a", metrics, {0: [8, 9]}, prompt_len=12), now=101.2)
    metrics.last_token_time, metrics.finished_time = 101.5, 101.6
    stat_logger.record_output(output("a", metrics, {0: [10]}, {0: "length"}, prompt_len=12),
                              now=101.5)
    assert stat_logger.num_tracked_requests == 0  # per-request state dropped on finish

    samples = scrape(stat_logger)
    count, total = histogram(samples, "inter_token_latency_seconds")
    assert count == 3 and total == pytest.approx(0.1 + 0.1 + 0.3)
    assert samples[("vllm:inter_token_latency_seconds_bucket", ("le", "0.075"))] == 0
    assert samples[("vllm:inter_token_latency_seconds_bucket", ("le", "0.15"))] == 2
    assert histogram(samples, "time_to_first_token_seconds") == (1, 1.0)  # not observed twice
    count, total = histogram(samples, "request_time_per_output_token_seconds")
    assert count == 1 and total == pytest.approx(0.5 / 3)
    for name, seconds in [("e2e_request_latency", 1.6), ("request_queue_time", 0.5),
                          ("request_prefill_time", 0.5), ("request_decode_time", 0.5),
                          ("request_inference_time", 1.0)]:
        count, total = histogram(samples, f"{name}_seconds")
        assert count == 1 and total == pytest.approx(seconds), name
    assert samples[("vllm:prompt_tokens_total",)] == 12  # once per request
    assert histogram(samples, "request_prompt_tokens") == (1, 12)
    assert histogram(samples, "request_prefill_kv_computed_tokens") == (1, 12)  # none cached
    assert histogram(samples, "request_generation_tokens") == (1, 4)
    assert histogram(samples, "request_max_num_generation_tokens") == (1, 4)
    assert histogram(samples, "request_params_n") == (1, 1)
    assert histogram(samples, "request_params_max_tokens") == (1, 4)
    assert samples[("vllm:request_generation_tokens_bucket", ("le", "5.0"))] == 1
    assert samples[("vllm:request_success_total", ("finished_reason", "length"))] == 1
    assert samples[("vllm:request_success_total", ("finished_reason", "stop"))] == 0


def test_parallel_sequences_keep_separate_inter_token_clocks():
    stat_logger = PrometheusStatLogger(MODEL)
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=1.0,
                             last_token_time=1.0, n=2)
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
    assert histogram(samples, "request_max_num_generation_tokens") == (1, 3)  # sequence 1
    assert histogram(samples, "request_params_n") == (1, 2)
    assert samples[("vllm:prompt_tokens_total",)] == 10  # once, not once per sequence
    # The longest sequence (3 tokens over 1.0 s) sets TPOT; sequence 0's reason labels it.
    assert histogram(samples, "request_time_per_output_token_seconds") == (1, 0.5)
    assert samples[("vllm:request_success_total", ("finished_reason", "stop"))] == 1
    assert stat_logger.num_tracked_requests == 0


def test_abort_before_first_token():
    stat_logger = PrometheusStatLogger(MODEL)
    metrics = RequestMetrics(arrival_time=5.0, finished_time=6.0)
    stat_logger.record_output(output("x", metrics, {0: []}, {0: "abort"}), now=6.0)
    samples = scrape(stat_logger)
    assert samples[("vllm:request_success_total", ("finished_reason", "abort"))] == 1
    assert histogram(samples, "time_to_first_token_seconds") == (0, 0)
    assert histogram(samples, "e2e_request_latency_seconds") == (1, 1.0)
    assert histogram(samples, "request_prefill_time_seconds") == (0, 0)
    assert histogram(samples, "request_decode_time_seconds") == (0, 0)
    assert histogram(samples, "request_inference_time_seconds") == (0, 0)
    assert histogram(samples, "request_prefill_kv_computed_tokens") == (0, 0)
    assert samples[("vllm:prompt_tokens_total",)] == 0  # never prefilled
    assert stat_logger.num_tracked_requests == 0


def test_loggers_own_their_registries_and_serve_asgi():
    first, second = PrometheusStatLogger(MODEL), PrometheusStatLogger(MODEL)
    first.record_step(stats(num_generation_tokens=3), 0.0)
    assert scrape(second)[("vllm:generation_tokens_total",)] == 0

    async def get_metrics() -> httpx.Response:
        transport = httpx.ASGITransport(app=first.make_asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/")

    response = asyncio.run(get_metrics())
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    served = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
              for family in text_string_to_metric_families(response.text)
              for sample in family.samples}
    assert served[("vllm:generation_tokens_total",
                   (("engine", "0"), ("model_name", "tiny")))] == 3


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
    num_stopped = samples[("vllm:request_success_total", ("finished_reason", "stop"))]
    assert num_stopped == num_requests
    assert samples[("vllm:generation_tokens_total",)] == 2 * num_requests
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


def test_logging_stat_logger_line(caplog):
    """vLLM's periodic line from a scripted run: figures over each interval, one INFO line when
    the engine goes idle, then silence until work comes back."""
    stat_logger = LoggingStatLogger(interval_s=10.0)
    caplog.set_level(logging.INFO, logger="pagedserve.logging_stat_logger")

    def lines() -> list[str]:
        found = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        caplog.clear()
        return found

    busy = dict(num_running_reqs=8, num_waiting_reqs=2, kv_cache_usage=0.41,
                prefix_cache_queries=1000, prefix_cache_hits=632,
                num_prompt_tokens_computed=5123, num_generation_tokens=881)
    stat_logger.record_step(stats(), 100.0)         # starts the first interval
    stat_logger.record_step(stats(**busy), 105.0)   # counters grow mid-interval
    stat_logger.record_step(stats(**busy), 109.9)
    assert lines() == []
    stat_logger.record_step(stats(**busy), 110.0)
    assert lines() == [
        "Engine 000: Avg prompt throughput: 512.3 tokens/s, Avg generation throughput: 88.1 "
        "tokens/s, Running: 8 reqs, Waiting: 2 reqs, KV cache usage: 41.0%, "
        "Prefix cache hit rate: 63.2%"]

    # Next interval: 100 more tokens, a preemption, then the batch drains. Another 1000 tokens
    # looked up with 368 hits: the hit rate covers both steps, (632 + 368) / 2000.
    done = dict(busy, num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0,
                num_generation_tokens=981, num_preemptions=1, prefix_cache_queries=2000,
                prefix_cache_hits=1000)
    stat_logger.record_step(stats(**done), 121.0)   # an idle poll, one second late
    assert lines() == [
        "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 9.1 "
        "tokens/s, Running: 0 reqs, Waiting: 0 reqs, Preemptions: 1, KV cache usage: 0.0%, "
        "Prefix cache hit rate: 50.0%"]
    for now in range(122, 131):                     # the idle engine polls every second
        stat_logger.record_step(stats(**done), float(now))
    assert lines() == []
    stat_logger.record_step(stats(**done), 131.0)   # one idle line (the last one was busy)
    assert lines() == [
        "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 "
        "tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, "
        "Prefix cache hit rate: 50.0%"]
    for now in range(132, 162):                     # then silence (DEBUG only)
        stat_logger.record_step(stats(**done), float(now))
    assert lines() == []
    # A request that waits without running is not idle: it is logged.
    stat_logger.record_step(stats(**dict(done, num_waiting_reqs=1)), 172.0)
    assert lines() == [
        "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 "
        "tokens/s, Running: 0 reqs, Waiting: 1 reqs, KV cache usage: 0.0%, "
        "Prefix cache hit rate: 50.0%"]


def test_logging_stat_logger_spec_decoding_line(caplog):
    stat_logger = LoggingStatLogger(interval_s=5.0)
    caplog.set_level(logging.INFO, logger="pagedserve.logging_stat_logger")
    spec = SpecDecodingStats()
    spec.observe(3, 3)
    stat_logger.record_step(stats(spec_decoding=spec.copy()), 0.0)  # before the interval
    spec.observe(3, 2)
    spec.observe(3, 0)
    stat_logger.record_step(stats(num_generation_tokens=5, spec_decoding=spec.copy()), 5.0)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[1] == (
        "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted throughput: 0.40 tokens/s, "
        "Drafted throughput: 1.20 tokens/s, Accepted: 2 tokens, Drafted: 6 tokens, Per-position "
        "acceptance rate: 0.500, 0.500, 0.000, Avg Draft acceptance rate: 33.3%")


def test_log_stats_flags():
    import argparse

    from pagedserve.entrypoints.data_parallel import replica_flags
    from pagedserve.entrypoints.openai.api_server import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    defaults = parser.parse_args([])
    assert (defaults.disable_log_stats, defaults.log_stats_interval) == (False, 10.0)
    args = parser.parse_args(["--disable-log-stats", "--log-stats-interval", "2.5"])
    assert (args.disable_log_stats, args.log_stats_interval) == (True, 2.5)
    flags = replica_flags(args)  # -dp replicas log (or not) the same way
    assert "--disable-log-stats" in flags and flags[flags.index("--log-stats-interval") + 1] \
        == "2.5"
    with pytest.raises(ValueError):
        LoggingStatLogger(interval_s=0)
