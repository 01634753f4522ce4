"""The KV tiers end to end on the real default model (fp32, greedy): each test first shows the
tier acted (tokens loaded, decisions taken, faults counted), then that every output equals an
engine's without tiers. The doc-QA workload: one long document, several questions on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.kv_transfer.redis_server import RedisServer

pytestmark = pytest.mark.slow

DOC = (Path(__file__).parents[1] / "data" / "declaration_of_independence.txt").read_text()[:1500]
OTHER_DOC = (Path(__file__).parents[1] / "data" / "declaration_of_independence.txt"
             ).read_text()[2000:3500]
QUESTIONS = ["Who wrote this?", "What year is it from?", "Name one grievance.",
             "Summarize it in one line."]
MAX_TOKENS = 6


def doc_prompts(doc: str = DOC) -> list[str]:
    return [f"{doc}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS]


def tier_config(connector: str, **options) -> str:
    common = {k: options.pop(k) for k in ("load_policy", "sync_saves", "debug_load_delay_s",
                                          "num_load_threads") if k in options}
    common.setdefault("load_policy", "always")
    common.setdefault("sync_saves", True)  # a block is in the tier once its step is over
    return json.dumps({"kv_connector": connector,
                       "kv_connector_extra_config": {**options, **common}})


def disk_config(path, **options) -> str:
    return tier_config("DiskConnector", path=str(path), max_bytes="1GiB", **options)


def generate(llm, prompts, cache_salt: str | None = None) -> list[list[int]]:
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    if cache_salt is not None:
        prompts = [{"prompt": p, "cache_salt": cache_salt} for p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


_REFERENCE: dict[tuple, list[list[int]]] = {}


@pytest.fixture
def reference(make_llm):
    """Greedy outputs of an engine without tiers, one prompt at a time (cached per prompt)."""

    def outputs(prompts: list[str], cache_salt: str | None = None) -> list[list[int]]:
        missing = [p for p in prompts if (p, cache_salt) not in _REFERENCE]
        if missing:
            llm = make_llm()
            for prompt, out in zip(missing, generate(llm, missing)):
                _REFERENCE[(prompt, cache_salt)] = out
        return [_REFERENCE[(p, cache_salt)] for p in prompts]

    return outputs


def tier_stats(llm):
    return llm.engine.get_stats().kv_tier


def test_evicted_document_is_loaded_back_from_disk(make_llm, reference, tmp_path):
    prompts, others = doc_prompts(), doc_prompts(OTHER_DOC)
    # Room for about one document: the second evicts the first from the device pool.
    llm = make_llm(num_gpu_blocks_override=30, kv_transfer_config=disk_config(tmp_path))
    outputs = [generate(llm, prompts[:1]), generate(llm, others[:1]), generate(llm, prompts[1:2])]
    stats = tier_stats(llm)
    assert stats.loaded_tokens > 0 and stats.tiers["disk"].blocks_loaded > 0
    assert stats.decisions["load"] >= 1 and stats.tiers["disk"].faults == {}
    expected = [reference(prompts[:1]), reference(others[:1]), reference(prompts[1:2])]
    assert outputs == expected


def test_usage_splits_cached_tokens_into_device_and_tier(make_llm, tmp_path):
    from pagedserve.sampling_params import SamplingParams

    from pagedserve.observability.timeline import TimelineStore

    llm = make_llm(kv_transfer_config=disk_config(tmp_path))
    timelines = TimelineStore()
    llm.engine.events.subscribe(timelines.on_events)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    llm.generate(doc_prompts()[:1], params)
    device_hit = llm.generate(doc_prompts()[1:2], params)[0]
    assert device_hit.num_cached_tokens > 0 and device_hit.num_tier_cached_tokens == 0
    assert llm.engine.reset_prefix_cache()
    tier_hit = llm.generate(doc_prompts()[2:3], params)[0]
    assert tier_hit.num_tier_cached_tokens > 0
    assert tier_hit.num_cached_tokens == tier_hit.num_tier_cached_tokens
    # The timelines name the source of each hit: the device pool, then the disk tier.
    cached = {t["request_id"]: t["summary"]["cached_tokens"] for t in timelines.recent(3)}
    assert cached[device_hit.request_id] == {"device": device_hit.num_cached_tokens}
    assert cached[tier_hit.request_id] == {"disk": tier_hit.num_tier_cached_tokens}


def test_preempted_requests_come_back_from_the_tier(make_llm, reference, tmp_path):
    # Without the device prefix cache, a preempted request's KV can only come back from the tier.
    prompts = [doc_prompts()[0], doc_prompts(OTHER_DOC)[0], doc_prompts()[1]]
    llm = make_llm(num_gpu_blocks_override=36, enable_prefix_caching=False,
                   max_num_batched_tokens=256, kv_transfer_config=disk_config(tmp_path))
    outputs = generate(llm, prompts)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_tier.loaded_tokens > 0
    assert outputs == reference(prompts)


def test_restarted_engine_answers_from_the_disk_tier(make_llm, reference, tmp_path):
    prompts = doc_prompts()
    first = make_llm(kv_transfer_config=disk_config(tmp_path, sync_saves=False))
    before = generate(first, prompts[:1])
    first.engine.shutdown()  # writes the saves still queued
    second = make_llm(kv_transfer_config=disk_config(tmp_path, sync_saves=False))
    after = generate(second, prompts[1:2])
    stats = tier_stats(second)
    num_prompt_tokens = len(second.get_tokenizer().encode(prompts[1]))
    assert stats.loaded_tokens >= num_prompt_tokens // 2  # most of the prompt: the document
    assert before + after == reference(prompts[:2])


def _decision_counts(llm) -> dict[str, float]:
    """The cost model's decisions as /metrics shows them."""
    from pagedserve.metrics import PrometheusStatLogger

    logger = PrometheusStatLogger("m")
    logger.record_step(llm.engine.get_stats(), 0.0)
    counts = {}
    for line in logger.render().decode().splitlines():
        if line.startswith("pagedserve:kv_tier_decisions_total{"):
            decision = line.split('decision="')[1].split('"')[0]
            counts[decision] = float(line.rsplit(" ", 1)[1])
    return counts


def test_cost_model_loads_from_a_fast_tier_and_recomputes_for_a_slow_one(
        make_llm, reference, tmp_path):
    prompts = doc_prompts()
    fast = make_llm(kv_transfer_config=disk_config(tmp_path / "fast", load_policy="cost"))
    outputs = generate(fast, prompts[:1])
    assert fast.engine.reset_prefix_cache()
    outputs += generate(fast, prompts[1:2])
    assert _decision_counts(fast) == {"load": 1, "recompute": 0}
    assert tier_stats(fast).loaded_tokens > 0
    # A tier whose every read takes 10x what recomputing a block takes, on this engine's own
    # calibration (so the test holds on a fast machine and a loaded one alike).
    prefill = fast.engine.scheduler.connector.cost_model.prefill
    block_recompute_s = prefill.recompute_seconds(16, len(DOC) // 4)
    slow = make_llm(kv_transfer_config=disk_config(
        tmp_path / "slow", load_policy="cost", debug_load_delay_s=10 * block_recompute_s,
        num_load_threads=1))
    outputs += generate(slow, prompts[:1])
    assert slow.engine.reset_prefix_cache()
    outputs += generate(slow, prompts[1:2])
    assert _decision_counts(slow) == {"load": 0, "recompute": 1}
    assert tier_stats(slow).loaded_tokens == 0 and tier_stats(slow).hit_tokens["disk"] > 0
    assert outputs == reference(prompts[:2]) * 2


def test_corrupt_and_truncated_block_files_are_recomputed(make_llm, reference, tmp_path):
    prompts = doc_prompts()
    llm = make_llm(kv_transfer_config=disk_config(tmp_path))
    outputs = generate(llm, prompts[:1])
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 4096)
    assert len(files) >= 4
    for path in files[::2]:  # flip a byte in the body of every other block
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    for path in files[1::2]:  # cut the others short
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 3)
    assert llm.engine.reset_prefix_cache()
    outputs += generate(llm, prompts[1:2])
    stats = tier_stats(llm)
    assert stats.tiers["disk"].faults.get("corrupt", 0) >= 1
    assert stats.load_failed_tokens > 0
    assert outputs == reference(prompts[:2])


def test_full_or_read_only_disk_loses_nothing(make_llm, reference, tmp_path, monkeypatch):
    import errno

    from pagedserve.kv_transfer import disk_store

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    prompts = doc_prompts()
    llm = make_llm(kv_transfer_config=disk_config(tmp_path))
    monkeypatch.setattr(disk_store.tempfile, "mkstemp", fail)  # every write fails
    outputs = generate(llm, prompts[:2])
    stats = tier_stats(llm)
    assert stats.tiers["disk"].faults.get("io_error", 0) > 0
    assert stats.tiers["disk"].blocks_saved == 0
    assert outputs == reference(prompts[:2])


@pytest.fixture
def redis_server():
    with RedisServer() as server:  # killed by its pid on teardown, pass or fail
        yield server


def redis_config(server, **options) -> str:
    return tier_config("RedisConnector", url=server.url, retry_interval_s=0.0, timeout_s=1.0,
                       connect_timeout_s=0.5, **options)


def test_redis_killed_and_restarted_loses_nothing(make_llm, reference, redis_server):
    prompts = doc_prompts()
    llm = make_llm(kv_transfer_config=redis_config(redis_server))
    outputs = generate(llm, prompts[:1])
    redis_server.stop()
    assert llm.engine.reset_prefix_cache()
    outputs += generate(llm, prompts[1:2])  # lookups and saves fail: computed instead
    stats = tier_stats(llm)
    assert stats.tiers["redis"].faults.get("io_error", 0) > 0
    assert stats.loaded_tokens == 0
    redis_server.start()  # same port, empty
    saved_before = stats.tiers["redis"].blocks_saved
    assert llm.engine.reset_prefix_cache()
    outputs += generate(llm, prompts[2:3])  # reconnected: saves again
    assert llm.engine.reset_prefix_cache()
    outputs += generate(llm, prompts[3:4])  # ...and loads what it saved
    stats = tier_stats(llm)
    assert stats.tiers["redis"].blocks_saved > saved_before
    assert stats.loaded_tokens > 0
    assert outputs == reference(prompts)


def test_two_engines_share_the_redis_pool_and_salts_stay_apart(make_llm, reference,
                                                               redis_server):
    prompts = doc_prompts()
    first = make_llm(kv_transfer_config=redis_config(redis_server))
    second = make_llm(kv_transfer_config=redis_config(redis_server))
    outputs = generate(first, prompts[:1], cache_salt="tenant-a")
    # Another tenant, another engine, the same pool: nothing of tenant a's is found.
    outputs += generate(second, prompts[1:2], cache_salt="tenant-b")
    assert tier_stats(second).lookup_tokens > 0 and tier_stats(second).hit_tokens == {}
    # The same tenant on the other engine: served from the shared pool.
    outputs += generate(second, prompts[2:3], cache_salt="tenant-a")
    assert tier_stats(second).loaded_tokens > 0
    assert outputs == reference(prompts[:3])


def test_abort_while_loading_frees_every_block(make_llm, tmp_path):
    from pagedserve.sampling_params import SamplingParams

    llm = make_llm(kv_transfer_config=disk_config(tmp_path, debug_load_delay_s=0.05))
    generate(llm, doc_prompts()[:1])
    assert llm.engine.reset_prefix_cache()
    engine = llm.engine
    engine.add_request("r", doc_prompts()[1], SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()  # admitted: its blocks are reserved and the load starts
    assert engine.scheduler._loading, "the request should be waiting for its load"
    engine.abort_request("r")
    while engine.has_unfinished_requests():  # the load ends, then its blocks are freed
        engine.step()
    engine.assert_idle()
