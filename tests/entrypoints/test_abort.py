"""Clients that go away: their requests are aborted at once and every KV block comes back, while
the other clients' requests complete untouched."""

from __future__ import annotations

import asyncio
import re
import time

import httpx

from tests.entrypoints.utils import API_KEY, MODEL_NAME

NUM_STREAMS = 40
NUM_CANCELLED = 10
NUM_TOKENS = 16
LONG_MAX_TOKENS = 1500
"""Cancelled requests ask for this many tokens: if an abort were missed, they would still be
running long after the others finished."""


IDLE_TIMEOUT_S = 60.0
"""A hang guard only: a missed abort shows in the abort count (the request would end "length")."""


def num_aborted(server) -> float:
    """Requests that ended with finish_reason "abort", from /metrics."""
    text = httpx.get(server.base_url + "/metrics",
                     headers={"Authorization": f"Bearer {API_KEY}"}).text
    match = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} '
                      r'(\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def wait_for_aborts(server, aborted_before: float, expected: int) -> None:
    """Poll /metrics until `expected` more requests ended "abort" (the server notices a client
    that hung up on its own time; a hang guard bounds the wait)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while num_aborted(server) - aborted_before < expected:
        assert time.monotonic() < deadline, "the abort was never counted"
        time.sleep(0.02)
    assert num_aborted(server) - aborted_before == expected


def metric(text: str, name: str) -> float:
    match = re.search(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_cancelled_streams_are_aborted(server):
    client = server.async_openai()

    async def stream(index: int) -> int | None:
        cancel = index % (NUM_STREAMS // NUM_CANCELLED) == 0
        chunks = await client.completions.create(
            model=MODEL_NAME, prompt=f"Story number {index}:", temperature=0, stream=True,
            max_tokens=LONG_MAX_TOKENS if cancel else NUM_TOKENS,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        num_chunks, usage = 0, None
        async for chunk in chunks:
            num_chunks += 1
            if cancel and num_chunks == 3:
                await chunks.close()  # the client disconnects mid-stream
                return None
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def run_all() -> list[int | None]:
        try:
            return await asyncio.gather(*(stream(i) for i in range(NUM_STREAMS)))
        finally:
            await client.close()

    aborted_before = num_aborted(server)
    results = asyncio.run(run_all())
    assert results.count(None) == NUM_CANCELLED
    assert [r for r in results if r is not None] == [NUM_TOKENS] * (NUM_STREAMS - NUM_CANCELLED)
    # Nothing is left, and the cancelled requests (1500 tokens each) were aborted, not run out.
    server.wait_until_idle(timeout=IDLE_TIMEOUT_S)
    assert num_aborted(server) - aborted_before == NUM_CANCELLED
    deadline = time.monotonic() + IDLE_TIMEOUT_S  # the gauges update on the next idle tick
    while True:
        text = httpx.get(server.base_url + "/metrics",
                         headers={"Authorization": f"Bearer {API_KEY}"}).text
        running = metric(text, "num_requests_running")
        waiting = metric(text, "num_requests_waiting")
        if (running, waiting) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (running, waiting) == (0, 0)
    assert metric(text, "kv_cache_usage_perc") == 0


def test_non_streaming_disconnect_aborts(server):
    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            request = asyncio.create_task(http.post("/v1/completions", json=dict(
                model=MODEL_NAME, prompt="Count to a thousand:", max_tokens=LONG_MAX_TOKENS,
                ignore_eos=True, temperature=0)))
            deadline = time.monotonic() + IDLE_TIMEOUT_S
            while server.async_llm.num_unfinished_requests() == 0:
                assert time.monotonic() < deadline, "the request never reached the engine"
                await asyncio.sleep(0.01)
            request.cancel()  # closes the connection
            try:
                await request
            except asyncio.CancelledError:
                pass

    aborted_before = num_aborted(server)
    asyncio.run(run())
    server.wait_until_idle(timeout=IDLE_TIMEOUT_S)
    assert num_aborted(server) - aborted_before == 1


def test_request_id_reusable_after_abort(server):
    body = dict(model=MODEL_NAME, prompt="Hello", max_tokens=LONG_MAX_TOKENS, ignore_eos=True,
                request_id="reused")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    aborted_before = num_aborted(server)
    with httpx.Client(base_url=server.base_url, headers=headers) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # one event, then hang up
        # The first event may leave before the request reaches the engine: wait for its abort,
        # not for an engine that may not have seen it yet.
        wait_for_aborts(server, aborted_before, 1)
        server.wait_until_idle(timeout=IDLE_TIMEOUT_S)
        result = http.post("/v1/completions", json={**body, "max_tokens": 2})
    assert result.status_code == 200 and result.json()["id"] == "reused"
