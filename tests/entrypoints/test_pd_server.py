"""Prefill/decode disaggregation as a user runs it: a prefill server (kv_producer), a decode server
(kv_consumer) joined by TcpConnector, and `pagedserve router --pd` in front, each a process started
the way the README starts it. The client sees one ordinary response; the decode server computed
one prompt token a request; a client that leaves mid-transfer leaves no block held on either side.
(The transfer-failure fallback is shown engine to engine in tests/kv_transfer/test_pd.py.)"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.utils import MODEL_NAME
from tests.kv_transfer.test_tiers import DOC
from tests.processes import ServedProcess, free_port, metric
from tests.shared_engines import SUITE_ACTIVATION_QUANTIZATION

pytestmark = pytest.mark.slow

PROMPTS = [f"{DOC[:1200]}\n\nQuestion: {q}\nAnswer:"
           for q in ("Who wrote this?", "What year is it from?")] + ["The capital of France is"]
MAX_TOKENS = 8
LOAD_DELAY_S = 0.1
"""Per block on the decode side: the abort test's prompt (about 60 blocks) takes seconds to move,
long enough for its client to leave in the middle."""
LONG_DOC = (Path(__file__).parents[1] / "data" / "declaration_of_independence.txt"
            ).read_text()[2000:6000]


def server_args(port: int, kv_port: int, role: str, **options) -> list[str]:
    config = {"kv_connector": "TcpConnector", "kv_role": role,
              "kv_connector_extra_config": {"port": kv_port, **options}}
    # int16 activations, as the one engine compared with (tests/shared_engines.py): the decode
    # instance computes the last prompt token alone, in another summation order
    return ["serve", MODEL_NAME, "--port", str(port), "--dtype", "float32",
            "--activation-quantization", SUITE_ACTIVATION_QUANTIZATION,
            "--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--num-threads", "1",
            "--log-level", "warning", "--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    kv_port, prefill_port, decode_port, router_port = (free_port() for _ in range(4))
    urls = [f"http://127.0.0.1:{p}" for p in (prefill_port, decode_port, router_port)]
    prefill = ServedProcess(server_args(prefill_port, kv_port, "kv_producer"),
                            logs / "prefill.log", urls[0])
    decode = ServedProcess(server_args(decode_port, kv_port, "kv_consumer",
                                       debug_load_delay_s=LOAD_DELAY_S),
                           logs / "decode.log", urls[1])
    router = ServedProcess(["router", "--pd", "--prefill", urls[0], "--decode", urls[1],
                            "--port", str(router_port), "--log-level", "warning"],
                           logs / "router.log", urls[2])
    with prefill, decode, router:
        yield prefill, decode, router


def complete(base_url: str, prompt: str, **extra) -> dict:
    response = httpx.post(base_url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        **extra})
    assert response.status_code == 200, response.text
    return response.json()


def wait_until_idle(base_url: str, timeout_s: float = 60.0) -> None:
    """Until the server holds no request and no block (its gauges follow within a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = [metric(base_url, name) for name in (
            "vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc")]
        if held == [0, 0, 0]:
            return
        assert time.monotonic() < deadline, f"{base_url} still holds requests or blocks: {held}"
        time.sleep(0.2)


def test_pd_answers_like_one_engine_and_decode_computes_one_prompt_token(pd, make_llm):
    from pagedserve.sampling_params import SamplingParams

    prefill, decode, router = pd
    computed_before = metric(decode.base_url, "pagedserve:prompt_tokens_computed_total")
    answers = [complete(router.base_url, prompt) for prompt in PROMPTS]
    streamed = httpx.post(router.base_url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    wait_until_idle(decode.base_url)

    # The transfer acted: the decode server loaded all of each prompt but its last token.
    usages = [a["usage"] for a in answers]
    assert metric(decode.base_url, "pagedserve:prompt_tokens_computed_total") - computed_before == \
        len(PROMPTS) + 1
    # (What it had in its own prefix cache already, the second question's document, it did
    # not load again.)
    assert metric(decode.base_url, "pagedserve:kv_tier_loaded_tokens_total") >= \
        usages[0]["prompt_tokens"] - 1 + usages[2]["prompt_tokens"] - 1
    assert metric(decode.base_url, "pagedserve:kv_tier_load_fallbacks_total") == 0
    assert metric(router.base_url, "pagedserve_router:pd_fallbacks_total") == 0
    # One ordinary response: the decode's usage, the whole completion.
    assert all(u["completion_tokens"] == MAX_TOKENS for u in usages)
    assert all(u["prompt_tokens_details"]["cached_tokens"] >= u["prompt_tokens"] - 1
               for u in usages)
    events = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == \
        answers[0]["choices"][0]["text"]
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS

    llm = make_llm()
    expected = [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]
    assert [a["choices"][0]["text"] for a in answers] == expected
    wait_until_idle(prefill.base_url)


def test_client_leaving_mid_transfer_leaves_no_block_held(pd):
    prefill, decode, router = pd
    prompt = f"{LONG_DOC}\n\nQuestion: What is this about?\nAnswer:"
    loaded_before = metric(decode.base_url, "pagedserve:kv_tier_decisions_total", decision="load")
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 64,
                       "temperature": 0}).encode()
    host, port = router.base_url.removeprefix("http://").split(":")
    # A raw connection, so that the test decides when the client leaves: once the decode
    # server has started loading the prompt's KV (its load takes several seconds).
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 120
        while metric(decode.base_url, "pagedserve:kv_tier_decisions_total",
                     decision="load") == loaded_before:
            assert time.monotonic() < deadline, "the decode server never started the load"
            time.sleep(0.05)
    wait_until_idle(decode.base_url)
    wait_until_idle(prefill.base_url)
    assert metric(decode.base_url, "vllm:request_success_total",
                  finished_reason="abort") >= 1
    # Both still serve.
    assert complete(router.base_url, "Hello")["usage"]["completion_tokens"] == MAX_TOKENS
