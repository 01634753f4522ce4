"""`pagedserve serve -dp 2`, started the README's way: two plain `serve` replicas on loopback
behind the router. The same greedy tokens as one engine; a mixed load reaches both replicas (their
metrics labelled replica="0"/"1" at the front); a replica killed under load leaves the rotation
while the other serves on; SIGTERM, or the last replica's death, stops the front and leaves no
process behind; a replica that cannot start fails the front with exit code 2. With an API key the
front checks it (the replicas, on loopback, need none); /load, which the router polls, needs no
key.

Replicas are found as the front's child processes (/proc), their ports in their command lines.
"""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.utils import MODEL_NAME
from tests.processes import ServedProcess, child_pids, free_port, metric

pytestmark = pytest.mark.slow

COMMON_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
                "--log-level", "warning"]
DP_FLAGS = ["-dp", "2", "--num-threads", "1"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "The three primary colors are"]
SHARED_PREFIX = ("You are a careful assistant. Answer in one short sentence, without any "
                 "preamble, and never repeat the question. Question: ")


def serve(args: list[str], log_path: Path) -> ServedProcess:
    port = free_port()
    return ServedProcess(["serve", MODEL_NAME, *COMMON_FLAGS, *args, "--port", str(port)],
                         log_path, f"http://127.0.0.1:{port}")


def complete(base_url: str, prompt: str, max_tokens: int = 12) -> str:
    response = httpx.post(base_url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def complete_all(base_url: str, prompts: list[str], concurrency: int = 8) -> list[str]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda prompt: complete(base_url, prompt, max_tokens=8), prompts))


def mixed_prompts(num_prompts: int, tag: str) -> list[str]:
    """Two thirds distinct, one third sharing a long prefix."""
    return [SHARED_PREFIX + f"what is {i} times {i}? ({tag})" if i % 3 == 0
            else f"Request {tag}-{i}: write a word that rhymes with number {i}."
            for i in range(num_prompts)]



def replicas(front: ServedProcess) -> dict[str, int]:
    """The front's replica processes: base URL -> pid."""
    found = {}
    for pid in child_pids(front.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "serve" in argv and "--port" in argv:
            found[f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"] = pid
    return found


def is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"  # exited; its parent has not reaped it yet


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference_texts(tmp_path_factory) -> list[str]:
    """PROMPTS answered by one plain engine (stopped before the replicas start: 2 cores)."""
    with serve([], tmp_path_factory.mktemp("one") / "serve.log") as server:
        return [complete(server.base_url, prompt) for prompt in PROMPTS]


@contextmanager
def dp_front(log_path: Path):
    """A `serve -dp 2` front, healthy; on exit it is stopped, and so (by pid) is any replica
    that outlived it, whatever the test asserted."""
    with serve(DP_FLAGS, log_path) as front:
        pids = list(replicas(front).values())
        try:
            yield front
        finally:
            front.stop()
            kill_survivors(pids)


def kill_survivors(pids: list[int]) -> None:
    for pid in pids:
        if not is_gone(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def front(tmp_path_factory, reference_texts):
    with dp_front(tmp_path_factory.mktemp("dp") / "front.log") as front:
        yield front


def test_load_answers_without_the_api_key(server):
    """The router polls a replica's /load (like /health) without a key."""
    response = httpx.get(server.base_url + "/load", timeout=10)
    assert response.status_code == 200
    assert set(response.json()) == {"num_running", "num_waiting", "kv_cache_usage"}
    assert httpx.get(server.base_url + "/metrics", timeout=10).status_code == 401


def test_replicas_are_plain_serve_processes_on_loopback(front):
    found = replicas(front)
    assert len(found) == 2, found
    for url, pid in found.items():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        assert argv[argv.index("serve") + 1] == MODEL_NAME
        assert "-dp" not in argv and "--data-parallel-size" not in argv
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--num-threads") + 1] == "1"
        assert argv[argv.index("--kv-cache-memory") + 1] == "256MiB"
        load = httpx.get(url + "/load", timeout=10).json()
        assert load == {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
    assert httpx.get(front.base_url + "/health", timeout=10).status_code == 200


def test_tokenize_embeddings_and_version_pass_through_the_front(front):
    tokens = httpx.post(front.base_url + "/tokenize", timeout=30,
                        json={"model": MODEL_NAME, "prompt": PROMPTS[0]}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(front.base_url + "/detokenize", timeout=30,
                      json={"model": MODEL_NAME, "tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith(PROMPTS[0])
    assert "version" in httpx.get(front.base_url + "/version", timeout=30).json()
    embedding = httpx.post(front.base_url + "/v1/embeddings", timeout=30,
                           json={"model": MODEL_NAME, "input": PROMPTS[0]}).json()
    assert len(embedding["data"][0]["embedding"]) == 576  # SmolLM2-135M's hidden size


def test_dp2_gives_the_same_greedy_tokens_as_one_engine(front, reference_texts):
    assert [complete(front.base_url, prompt) for prompt in PROMPTS] == reference_texts
    for url in replicas(front):  # whichever replica the router picked, both agree
        assert [complete(url, prompt) for prompt in PROMPTS] == reference_texts


def test_a_mixed_load_reaches_both_replicas(front):
    def counts() -> dict[str, tuple[float, float]]:
        """Per replica: requests its engine finished, requests the router sent it."""
        return {label: (metric(front.base_url, "vllm:request_success_total", replica=label),
                        metric(front.base_url, "pagedserve_router:requests_total", worker=label))
                for label in ("0", "1")}

    before = counts()
    texts = complete_all(front.base_url, mixed_prompts(24, "mixed"))
    assert len(texts) == 24
    after = counts()
    for label in ("0", "1"):
        assert after[label][0] > before[label][0] and after[label][1] > before[label][1], after


def test_a_killed_replica_leaves_the_rotation_then_sigterm_stops_the_rest(front):
    found = replicas(front)
    killed_url, survivor_url = sorted(found)
    killed_pid, survivor_pid = found[killed_url], found[survivor_url]
    with ThreadPoolExecutor(1) as pool:
        # Requests in flight on the killed replica may fail; the others must not.
        load = pool.submit(lambda: [_try_complete(front.base_url, p)
                                    for p in mixed_prompts(8, "during")])
        time.sleep(0.5)
        os.kill(killed_pid, signal.SIGKILL)
        load.result()
    # The front reaps the process (it then leaves the router) within a poll interval.
    wait_until(lambda: killed_pid not in child_pids(front.pid), 10, "the front did not reap it")
    complete_all(front.base_url, mixed_prompts(8, "after"))  # each asserts a 200
    assert httpx.get(front.base_url + "/health", timeout=10).status_code == 200
    assert front.stop() == 0, front.log_tail()
    assert is_gone(killed_pid) and is_gone(survivor_pid)


def _try_complete(base_url: str, prompt: str) -> int:
    try:
        return httpx.post(base_url + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 8}).status_code
    except httpx.TransportError:
        return 0


def test_the_front_checks_the_api_key_then_exits_1_when_every_replica_has_died(tmp_path):
    """One front with --api-key for both checks (each front costs two model loads)."""
    front = serve([*DP_FLAGS, "--api-key", "k"], tmp_path / "front.log")
    with front:
        pids = list(replicas(front).values())
        assert len(pids) == 2
        try:
            url = front.base_url + "/v1/completions"
            body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
            assert httpx.post(url, json=body, timeout=60).status_code == 401
            assert httpx.post(url, json=body, timeout=60,
                              headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(front.base_url + "/add_worker", timeout=10).status_code == 401
            assert httpx.post(url, json=body, timeout=60,
                              headers={"Authorization": "Bearer k"}).status_code == 200
            assert httpx.get(front.base_url + "/health", timeout=10).status_code == 200

            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            front.process.wait(timeout=60)
            assert front.process.returncode == 1, front.log_tail()
            assert "every replica has exited" in front.log_tail()
        finally:
            front.stop()
            kill_survivors(pids)
    assert all(is_gone(pid) for pid in pids)


def test_a_replica_that_cannot_start_fails_the_front_with_exit_2(tmp_path):
    # Past the model's context: each replica refuses it at start-up, before loading weights.
    front = serve([*DP_FLAGS, "--max-model-len", "1000000", "--log-level", "info"],
                  tmp_path / "front.log")
    with pytest.raises(AssertionError, match="exited with 2"):
        front.start()
    log = front.log_tail(100_000)
    assert "while starting" in log and "[replica " in log, log[-3000:]
    pids = [int(pid) for pid in re.findall(r"replica \d: pid (\d+)", log)]
    assert len(pids) == 2, log[-3000:]
    try:
        wait_until(lambda: all(is_gone(pid) for pid in pids), 30, "a replica outlived the front")
    finally:
        kill_survivors(pids)
