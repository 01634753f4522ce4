"""SIGTERM drains the server: in-flight requests finish (or, past --shutdown-timeout, end with
finish_reason "abort"), new requests get 503 meanwhile, and the process exits with code 0.

Runs `python -m pagedserve.entrypoints.openai.api_server` as a subprocess: signals need a process
of their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.utils import MODEL_NAME
from tests.processes import free_port

SHUTDOWN_TIMEOUT_S = 3
SHORT_TOKENS = 16
LONG_TOKENS = 1500
"""Far more than fits in the drain window: this request must be aborted."""


@pytest.fixture
def server_process(request, tmp_path: Path):
    shutdown_timeout = getattr(request, "param", SHUTDOWN_TIMEOUT_S)
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.entrypoints.openai.api_server", MODEL_NAME,
             "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "256MiB",
             "--max-model-len", "2048", "--shutdown-timeout", str(shutdown_timeout),
             "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2],
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"server exited: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "server did not become healthy"
            try:
                if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield process, base_url, log_path
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_until_draining(base_url: str) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(base_url + "/health").status_code != 503:
        assert time.monotonic() < deadline, "the server never started draining"
        time.sleep(0.01)


def test_sigterm_drains_then_exits_cleanly(server_process):
    process, base_url, log_path = server_process
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    results: dict[str, dict] = {}
    first_chunk = {name: threading.Event() for name in ("short", "long")}

    def stream(name: str, max_tokens: int) -> None:
        chunks = client.completions.create(
            model=MODEL_NAME, prompt=f"A {name} story:", max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        finish_reason, usage = None, None
        for chunk in chunks:
            first_chunk[name].set()
            usage = chunk.usage or usage
            for choice in chunk.choices:
                finish_reason = choice.finish_reason or finish_reason
        results[name] = {"finish_reason": finish_reason, "tokens": usage.completion_tokens}

    threads = [threading.Thread(target=stream, args=("short", SHORT_TOKENS)),
               threading.Thread(target=stream, args=("long", LONG_TOKENS))]
    for thread in threads:
        thread.start()
    for event in first_chunk.values():
        assert event.wait(timeout=60), "a stream never started"

    process.send_signal(signal.SIGTERM)
    # While draining, the listener stays open: /health and new requests get a clean 503.
    wait_until_draining(base_url)
    with pytest.raises(openai.APIStatusError) as error:
        client.completions.create(model=MODEL_NAME, prompt="new", max_tokens=2)
    assert error.value.status_code == 503
    assert error.value.response.json()["error"]["code"] == "shutting_down"
    assert "long" not in results, "the drain window closed before the checks ran"

    for thread in threads:
        thread.join(timeout=30)
    assert results["short"] == {"finish_reason": "length", "tokens": SHORT_TOKENS}
    assert results["long"]["finish_reason"] == "abort"
    assert 0 < results["long"]["tokens"] < LONG_TOKENS
    assert process.wait(timeout=30) == 0, log_path.read_text()[-3000:]


@pytest.mark.parametrize("server_process", [600], indirect=True)
def test_a_second_ctrl_c_exits_at_once_without_a_traceback(server_process):
    """The first SIGINT drains; the second cuts the drain short (exit code 1). uvicorn then
    skips the ASGI lifespan's shutdown, whose cancelled task it would log as a traceback. (A
    drain window of 600 s: however loaded the machine, the second signal comes within it.)"""
    process, base_url, log_path = server_process
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    started = threading.Event()

    def stream() -> None:
        try:
            for _ in client.completions.create(
                    model=MODEL_NAME, prompt="A long story:", max_tokens=LONG_TOKENS,
                    temperature=0, stream=True, extra_body={"ignore_eos": True}):
                started.set()
        except (openai.APIError, httpx.HTTPError):
            pass  # the forced exit may cut the stream off

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(timeout=60), "the stream never started"
    process.send_signal(signal.SIGINT)
    wait_until_draining(base_url)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 1
    thread.join(timeout=30)
    log = log_path.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
