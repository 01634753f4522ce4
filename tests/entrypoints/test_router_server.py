"""`pagedserve router` over two real pagedserve workers, every process started the way the README
starts it: cache_aware keeps a document's questions on one worker (usage's cached_tokens shows the
reuse) where round_robin splits them; an overloaded worker gets fewer new requests; a worker
killed in the middle of a load fails at most the requests it held."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.utils import MODEL_NAME
from tests.processes import ServedProcess, free_port, metric

pytestmark = pytest.mark.slow

WORDS = (Path(__file__).parents[1] / "data" / "declaration_of_independence.txt").read_text().split()
QUESTIONS = ["Who wrote this?", "What year is it from?", "Name one grievance.",
             "Summarize it in one line."]


def document(seed: int, num_words: int = 180) -> str:
    """A distinct document per seed (the declaration's words, shuffled)."""
    words = list(WORDS)
    random.Random(seed).shuffle(words)
    return f"Document {seed}: " + " ".join(words[:num_words])


def doc_qa(seeds: list[int]) -> list[tuple[int, str]]:
    """(document seed, prompt), the documents interleaved: one question on each, then the next."""
    return [(seed, f"{document(seed)}\n\nQuestion: {q}\nAnswer:")
            for q in QUESTIONS for seed in seeds]


def worker_args(port: int) -> list[str]:
    return ["serve", MODEL_NAME, "--port", str(port), "--kv-cache-memory", "128MiB",
            "--max-model-len", "2048", "--num-threads", "1", "--log-level", "warning"]


def start_workers(logs: Path, names: list[str]) -> list[ServedProcess]:
    workers = []
    for name in names:
        port = free_port()
        workers.append(ServedProcess(worker_args(port), logs / f"{name}.log",
                                     f"http://127.0.0.1:{port}"))
    return workers


@contextlib.contextmanager
def router_process(logs: Path, name: str, workers: list[ServedProcess],
                   *args: str) -> Iterator[ServedProcess]:
    """A router over `workers`, once it has every one of them in rotation."""
    port = free_port()
    command = ["router", "--port", str(port), "--log-level", "warning", *args]
    for worker in workers:
        command += ["--worker", worker.base_url]
    with ServedProcess(command, logs / f"{name}.log", f"http://127.0.0.1:{port}") as router:
        deadline = time.monotonic() + 60
        while not all(w["healthy"] for w in
                      httpx.get(router.base_url + "/list_workers", timeout=10).json()):
            assert time.monotonic() < deadline, "the router never had every worker healthy"
            time.sleep(0.1)
        yield router


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    workers = start_workers(logs, ["w0", "w1"])
    try:
        for worker in workers:
            worker.start()
        yield logs, workers
    finally:
        for worker in workers:
            worker.stop()


def complete(base_url: str, prompt: str, max_tokens: int = 4) -> dict:
    response = httpx.post(base_url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def requests_per_worker(router: ServedProcess, workers: list[ServedProcess]) -> list[float]:
    return [metric(router.base_url, "pagedserve_router:requests_total", worker=w.base_url)
            for w in workers]


def run_doc_qa(router: ServedProcess, seeds: list[int]) -> int:
    """Send the doc-QA load one request at a time; the cached prompt tokens over all of it."""
    return sum(complete(router.base_url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
               for _, prompt in doc_qa(seeds))


def test_cache_aware_keeps_a_documents_questions_together(two_workers):
    logs, workers = two_workers
    # Three documents on two workers: round_robin sends each document's questions to both.
    with router_process(logs, "cache-aware", workers) as router:
        cache_aware_cached = run_doc_qa(router, [1, 2, 3])
        assert metric(router.base_url, "pagedserve_router:affinity_hits_total") >= 9
        assert min(requests_per_worker(router, workers)) > 0  # the documents were spread
    with router_process(logs, "round-robin", workers, "--policy", "round_robin") as router:
        round_robin_cached = run_doc_qa(router, [4, 5, 6])  # fresh documents: no reuse between
        assert requests_per_worker(router, workers) == [6, 6]
    # cache_aware: each document's first question computes it, the other three reuse it.
    # round_robin: its first two questions compute it (one per worker), two reuse it.
    assert cache_aware_cached > 1.3 * round_robin_cached, (cache_aware_cached, round_robin_cached)


def test_overloaded_worker_gets_fewer_new_requests(two_workers):
    logs, workers = two_workers
    with router_process(logs, "overload", workers, "--balance-abs-threshold", "4",
                        "--health-check-interval", "0.5") as router:
        # The document's first question makes one worker its home.
        prompts = [prompt for _, prompt in doc_qa([7])]
        complete(router.base_url, prompts[0])
        home = max(range(2), key=lambda i: requests_per_worker(router, workers)[i])
        # Overload it behind the router's back: long streams sent to it directly, held open.
        body = json.dumps({"model": MODEL_NAME, "prompt": "Tell me a long story.",
                           "max_tokens": 1500, "ignore_eos": True, "stream": True}).encode()
        host, port = workers[home].base_url.removeprefix("http://").split(":")
        sockets = []
        try:
            for _ in range(12):
                sock = socket.create_connection((host, int(port)), timeout=60)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: w\r\n"
                             b"Content-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
                sockets.append(sock)
            wait_for_polled_load(router, workers[home], at_least=8)
            before = requests_per_worker(router, workers)
            for prompt in prompts[1:]:  # affinity says home; its load says the other worker
                complete(router.base_url, prompt)
            after = requests_per_worker(router, workers)
        finally:
            for sock in sockets:
                sock.close()  # the worker aborts the streams
    new = [a - b for a, b in zip(after, before)]
    assert new[home] == 0 and new[1 - home] == len(prompts) - 1, new


def wait_for_polled_load(router: ServedProcess, worker: ServedProcess, at_least: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        listed = httpx.get(router.base_url + "/list_workers", timeout=10).json()
        load = next(w["load"] for w in listed if w["url"] == worker.base_url)
        if load is not None and load["num_running"] + load["num_waiting"] >= at_least:
            return
        assert time.monotonic() < deadline, f"the router never saw the load: {listed}"
        time.sleep(0.2)


def test_killed_worker_fails_only_what_it_held(tmp_path):
    workers = start_workers(tmp_path, ["k0", "k1"])
    num_requests, concurrency, kill_after = 28, 8, 10
    results: list[tuple[float, bool]] = []  # (start time, succeeded)
    lock = threading.Lock()
    kill_time: list[float] = []
    try:
        for worker in workers:
            worker.start()
        with router_process(tmp_path, "router", workers, "--policy", "round_robin") as router:
            prompts = iter([f"Request {i}: {document(100 + i, 40)}" for i in range(num_requests)])

            def client() -> None:
                with httpx.Client(timeout=120) as http:
                    while True:
                        with lock:
                            prompt = next(prompts, None)
                        if prompt is None:
                            return
                        start = time.monotonic()
                        try:
                            ok = http.post(router.base_url + "/v1/completions", json={
                                "model": MODEL_NAME, "prompt": prompt, "max_tokens": 16,
                                "temperature": 0}).status_code == 200
                        except httpx.HTTPError:
                            ok = False
                        with lock:
                            results.append((start, ok))
                            if len(results) == kill_after:
                                os.kill(workers[1].pid, signal.SIGKILL)
                                workers[1].process.wait()
                                kill_time.append(time.monotonic())

            threads = [threading.Thread(target=client) for _ in range(concurrency)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert httpx.get(router.base_url + "/health", timeout=10).status_code == 200
    finally:
        for worker in workers:
            worker.stop()
    assert len(results) == num_requests and kill_time
    failed = [start for start, ok in results if not ok]
    assert len(failed) <= concurrency  # at most what the killed worker held
    assert all(start < kill_time[0] for start in failed)  # every later request succeeded
