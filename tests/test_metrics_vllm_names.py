"""Every metric vLLM's Grafana dashboard queries is on our /metrics, with vLLM's type and labels.

A tiny random Llama serves a few requests through AsyncLLM (the server's engine thread, the real
stat-logger calls); the registry is then parsed as Prometheus would scrape it.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.tiny_models import write_tiny_llama

pytest.importorskip("transformers")

MODEL = "tiny"
VLLM_LABELS = {"model_name", "engine"}

# (family name as the text format's TYPE line gives it, type, labels besides `le`). Every
# `vllm:` metric in the PromQL of vLLM's published dashboard, vllm-project/vllm
# examples/observability/prometheus_grafana/grafana.json at commit
# 4b5c627c23e6690b8987100d1cbf78e34ac14bf9 (earlier at examples/online_serving/...); types and
# labels from vllm/v1/metrics/loggers.py of the same era (labels model_name and engine).
DASHBOARD_METRICS = [
    ("vllm:e2e_request_latency_seconds", "histogram", VLLM_LABELS),
    ("vllm:prompt_tokens", "counter", VLLM_LABELS),
    ("vllm:generation_tokens", "counter", VLLM_LABELS),
    ("vllm:inter_token_latency_seconds", "histogram", VLLM_LABELS),
    ("vllm:num_requests_running", "gauge", VLLM_LABELS),
    ("vllm:num_requests_waiting", "gauge", VLLM_LABELS),
    ("vllm:time_to_first_token_seconds", "histogram", VLLM_LABELS),
    ("vllm:kv_cache_usage_perc", "gauge", VLLM_LABELS),
    ("vllm:request_prompt_tokens", "histogram", VLLM_LABELS),
    ("vllm:request_generation_tokens", "histogram", VLLM_LABELS),
    ("vllm:request_success", "counter", VLLM_LABELS | {"finished_reason"}),
    ("vllm:request_queue_time_seconds", "histogram", VLLM_LABELS),
    ("vllm:request_prefill_time_seconds", "histogram", VLLM_LABELS),
    ("vllm:request_decode_time_seconds", "histogram", VLLM_LABELS),
    ("vllm:request_max_num_generation_tokens", "histogram", VLLM_LABELS),
]

# Further vLLM metrics we serve under its names (not queried by that dashboard).
OTHER_VLLM_METRICS = [
    ("vllm:prefix_cache_queries", "counter", VLLM_LABELS),
    ("vllm:prefix_cache_hits", "counter", VLLM_LABELS),
    ("vllm:num_preemptions", "counter", VLLM_LABELS),
    ("vllm:iteration_tokens_total", "histogram", VLLM_LABELS),
    ("vllm:request_time_per_output_token_seconds", "histogram", VLLM_LABELS),
    ("vllm:request_inference_time_seconds", "histogram", VLLM_LABELS),
    ("vllm:request_prefill_kv_computed_tokens", "histogram", VLLM_LABELS),
    ("vllm:request_params_n", "histogram", VLLM_LABELS),
    ("vllm:request_params_max_tokens", "histogram", VLLM_LABELS),
]

# vLLM's bucket boundaries where a dashboard panel reads `le` directly (the heatmaps) or the
# quantiles should match vLLM's: each must be one of ours.
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                         0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                                         160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                                         0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                                         20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                                         960.0, 1920.0, 7680.0],
    # max_model_len 256: vLLM's build_1_2_5_buckets(256).
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200],
    "vllm:request_generation_tokens": [1, 2, 5, 10, 20, 50, 100, 200],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                    16384],
}

PROMPTS = [list(range(100, 140)), list(range(100, 140)), list(range(200, 230))]
"""The second repeats the first: a prefix-cache hit of two 16-token blocks."""
MAX_TOKENS = [6, 6, 4]


@pytest.fixture(scope="module")
def scraped(tmp_path_factory, tokenizer):
    """(families by name, the stat logger) after three finished requests, one with n=2."""
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.metrics import PrometheusStatLogger
    from pagedserve.sampling_params import SamplingParams

    path = tmp_path_factory.mktemp("tiny")
    config = EngineArgs(model=write_tiny_llama(path, tokenizer, seed=0), dtype="float32",
                        kv_cache_memory="16MiB", max_model_len=256).create_engine_config()
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=256)
    async_llm = AsyncLLM(LLMEngine(config), [stat_logger])

    async def run_all() -> list[int]:
        async def run(prompt, max_tokens, n) -> int:
            params = SamplingParams(max_tokens=max_tokens, n=n, temperature=0 if n == 1 else 1,
                                    ignore_eos=True, seed=0)
            return sum([len(c.token_ids) async for out in async_llm.generate(prompt, params)
                        for c in out.outputs])
        counts = [await run(PROMPTS[0], MAX_TOKENS[0], 1)]  # first: its blocks get cached
        counts += await asyncio.gather(run(PROMPTS[1], MAX_TOKENS[1], 1),
                                       run(PROMPTS[2], MAX_TOKENS[2], 2))
        return counts

    try:
        generated = asyncio.run(run_all())
        assert generated == [6, 6, 8]
        asyncio.run(async_llm.shutdown(drain_timeout=10))  # the loop's last record_step ran
    finally:
        asyncio.run(async_llm.shutdown(drain_timeout=0))
    families = {family.name: family
                for family in text_string_to_metric_families(stat_logger.render().decode())}
    return families, stat_logger


@pytest.mark.parametrize("name,kind,labels", DASHBOARD_METRICS + OTHER_VLLM_METRICS,
                         ids=[m[0] for m in DASHBOARD_METRICS + OTHER_VLLM_METRICS])
def test_vllm_metric_has_vllms_type_and_labels(scraped, name, kind, labels):
    families, _ = scraped
    assert name in families, f"{name} missing from /metrics"
    family = families[name]
    assert family.type == kind
    samples = [s for s in family.samples if not s.name.endswith("_created")]
    assert samples
    for sample in samples:
        assert set(sample.labels) - {"le"} == labels, sample
        assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"


def test_dashboard_values_follow_the_run(scraped):
    """Real values, not just presence: what three requests (6, 6 and 2 x 4 tokens) must give."""
    families, stat_logger = scraped

    def value(name: str, sample_name: str | None = None, **labels) -> float:
        return sum(s.value for s in families[name].samples
                   if s.name == (sample_name or name)
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    assert stat_logger.num_tracked_requests == 0
    assert value("vllm:num_requests_running") == 0 and value("vllm:num_requests_waiting") == 0
    assert value("vllm:request_success", "vllm:request_success_total",
                 finished_reason="length") == 3
    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 40 + 40 + 30
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == 6 + 6 + 8
    assert value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") >= 32
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_max_num_generation_tokens", "vllm:request_params_n",
                 "vllm:request_params_max_tokens"):
        assert value(name, name + "_count") == 3, name
    assert value("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == 110
    assert value("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 20
    assert value("vllm:request_max_num_generation_tokens",
                 "vllm:request_max_num_generation_tokens_sum") == 6 + 6 + 4
    assert value("vllm:request_params_n", "vllm:request_params_n_sum") == 1 + 1 + 2
    assert value("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 16
    # Each request's tokens after its first are inter-token gaps: 5 + 5 + 2 x 3.
    assert value("vllm:inter_token_latency_seconds",
                 "vllm:inter_token_latency_seconds_count") == 16
    # The repeated prompt computed less than its 40 tokens.
    assert value("vllm:request_prefill_kv_computed_tokens",
                 "vllm:request_prefill_kv_computed_tokens_sum") <= 110 - 32
    # Inference time is prefill + decode, request by request, so also in sum.
    inference = value("vllm:request_inference_time_seconds",
                      "vllm:request_inference_time_seconds_sum")
    assert inference == pytest.approx(
        value("vllm:request_prefill_time_seconds", "vllm:request_prefill_time_seconds_sum")
        + value("vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_sum"))
    assert inference > 0
    # Every step's tokens: all prompt tokens computed plus all generated ones.
    computed = value("pagedserve:prompt_tokens_computed",
                     "pagedserve:prompt_tokens_computed_total")
    assert value("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum") == \
        computed + 20


@pytest.mark.parametrize("name", list(VLLM_BUCKETS))
def test_vllm_bucket_boundaries_are_kept(scraped, name):
    families, _ = scraped
    ours = {float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")}
    assert set(map(float, VLLM_BUCKETS[name])) <= ours
