"""The server's window on its requests: timelines by response id (inline with return_timeline,
streamed or not), the recent requests, and the memory breakdown with its gauges."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.utils import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _get(server, path: str, **kwargs) -> httpx.Response:
    return httpx.get(server.base_url + path, headers=AUTH, timeout=30, **kwargs)


def test_a_completions_timeline_inline_and_by_response_id(server):
    client = server.openai()
    completion = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "return_timeline": True})
    inline = completion.model_extra["timeline"]
    assert inline["request_id"] == completion.id and inline["state"] == "finished"
    assert inline["num_output_tokens"] == completion.usage.completion_tokens == 6
    assert inline["num_prompt_tokens"] == completion.usage.prompt_tokens
    summary = inline["summary"]
    assert summary["ttft_s"] > 0 and summary["e2e_s"] >= summary["ttft_s"]
    assert summary["explanation"].startswith("TTFT")
    fetched = _get(server, f"/v1/requests/{completion.id}/timeline")
    assert fetched.status_code == 200 and fetched.json() == inline
    server.wait_until_idle()


def test_a_plain_response_carries_no_timeline(server):
    response = httpx.post(server.base_url + "/v1/completions", headers=AUTH, timeout=30,
                          json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200 and "timeline" not in response.json()
    server.wait_until_idle()


def test_a_stream_ends_with_the_timeline(server):
    client = server.openai()
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_timeline": True})
    chunks = list(stream)
    last = chunks[-1]
    assert last.usage.completion_tokens == 5
    timeline = last.model_extra["timeline"]
    assert timeline["request_id"] == last.id and timeline["finish_reason"] == "length"
    assert all("timeline" not in (chunk.model_extra or {}) for chunk in chunks[:-1])
    assert [e["type"] for e in timeline["events"]][-2:] == ["first_token", "finished"] or \
        timeline["events"][-1]["type"] == "finished"
    server.wait_until_idle()


def test_recent_requests_list_and_errors(server):
    client = server.openai()
    ids = [client.completions.create(model=MODEL_NAME, prompt=f"Count to {i}:", max_tokens=2,
                                     temperature=0).id for i in range(3)]
    listed = _get(server, "/v1/requests", params={"limit": 3}).json()
    assert listed["object"] == "list" and len(listed["data"]) == 3
    arrivals = [t["arrival_time"] for t in listed["data"]]
    assert arrivals == sorted(arrivals, reverse=True)  # newest first
    engine_ids = {_get(server, f"/v1/requests/{i}/timeline").json()["engine_request_id"]
                  for i in ids}
    assert engine_ids == {t["request_id"] for t in listed["data"]}
    missing = _get(server, "/v1/requests/cmpl-nobody/timeline")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "request_not_found"
    assert _get(server, "/v1/requests", params={"limit": 0}).status_code == 400
    assert httpx.get(server.base_url + "/v1/requests", timeout=30).status_code == 401
    server.wait_until_idle()


def test_memory_breakdown_and_gauges(server):
    breakdown = _get(server, "/debug/memory").json()
    components = breakdown["components"]
    assert components["kv_pool"] == 256 << 20 or 0 < components["kv_pool"] <= 256 << 20
    assert components["weights_dense"] + components.get("weights_packed", 0) > 50 << 20
    pool = breakdown["kv_pool"]
    assert pool["used_blocks"] + pool["cached_free_blocks"] + pool["free_blocks"] \
        == pool["num_blocks"] - 1
    assert pool["bytes_per_block"] * pool["num_blocks"] == components["kv_pool"]
    capacity = breakdown["capacity"]
    assert capacity[0]["context_len"] == 512 and capacity[-1]["context_len"] == 2048
    assert capacity[0]["max_requests"] == (pool["num_blocks"] - 1) // 32
    assert breakdown["process"]["rss_bytes"] > components["kv_pool"]
    metrics = _get(server, "/metrics").text
    line = next(line for line in metrics.splitlines()
                if line.startswith("pagedserve:memory_bytes{") and 'component="kv_pool"' in line)
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(components["kv_pool"])
