"""A server restarted on the same disk tier answers the second question on a document with most of
its prompt loaded from disk: usage says so (kv_tier_cached_tokens), /metrics says so, and the
answer is the one the first server gave. Each server is a process of its own (stopped by SIGTERM,
which writes the saves still queued), started the way the README starts one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.utils import MODEL_NAME
from tests.processes import free_port

pytestmark = pytest.mark.slow

DOC = (Path(__file__).parents[1] / "data" / "declaration_of_independence.txt").read_text()[:1500]
PROMPTS = [f"{DOC}\n\nQuestion: {q}\nAnswer:" for q in ("Who wrote this?", "What year is it?")]


def start_server(tmp_path: Path, kv_path: Path, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = {"kv_connector": "DiskConnector",
              "kv_connector_extra_config": {"path": str(kv_path), "max_bytes": "1GiB",
                                            "load_policy": "always"}}
    log = open(tmp_path / f"{name}.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.entrypoints.openai.api_server", MODEL_NAME,
         "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "256MiB",
         "--max-model-len", "2048", "--log-level", "warning",
         "--kv-transfer-config", json.dumps(config)],
        stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2],
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise AssertionError(f"server exited: {(tmp_path / f'{name}.log').read_text()[-3000:]}")
        if time.monotonic() > deadline:
            stop(process)
            raise AssertionError("server did not become healthy")
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return process, base_url
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def stop(process: subprocess.Popen) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


def complete(base_url: str, prompt: str) -> dict:
    response = httpx.post(base_url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def metric(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def test_restarted_server_answers_from_the_disk_tier(tmp_path):
    kv_path = tmp_path / "kv"
    processes = []
    try:
        first, url = start_server(tmp_path, kv_path, "first")
        processes.append(first)
        complete(url, PROMPTS[0])
        answer = complete(url, PROMPTS[1])  # the document from the device pool
        assert answer["usage"]["prompt_tokens_details"]["kv_tier_cached_tokens"] == 0
        assert metric(url, "pagedserve:kv_tier_blocks_saved_total") > 0
        assert stop(first) == 0

        second, url = start_server(tmp_path, kv_path, "second")
        processes.append(second)
        again = complete(url, PROMPTS[1])
        usage = again["usage"]
        assert usage["prompt_tokens_details"]["kv_tier_cached_tokens"] >= usage["prompt_tokens"] // 2
        assert usage["prompt_tokens_details"]["cached_tokens"] >= \
            usage["prompt_tokens_details"]["kv_tier_cached_tokens"]
        assert metric(url, "pagedserve:kv_tier_loaded_tokens_total") > 0
        assert again["choices"][0]["text"] == answer["choices"][0]["text"]
        assert stop(second) == 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
