"""The router served on a loopback port in front of fake workers (tests/router/fake_worker.py):
policies end to end, health checks, retries, streams, disconnects, the pool API, metrics, P/D.

Nothing waits a fixed time for something to happen: tests poll for a condition with a generous
deadline. Health polls run every hour unless a test wants them, so that only the test decides
when a worker is checked (router.check_health() run in the router's loop).
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.router import Router, RouterConfig, build_app
from pagedserve.router.metrics import merge_metrics
from tests.processes import ServedProcess, free_port, metric
from tests.router.fake_worker import FakeWorker, ServerThread

DEADLINE_S = 20.0
DOC_A = "Document A. " + "The quick brown fox jumps over the lazy dog. " * 30
DOC_B = "Document B. " + "Lorem ipsum dolor sit amet, consectetur adipiscing. " * 30


def wait_for(condition: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class RouterUnderTest:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.server = ServerThread(build_app(router), after_serve=router.close).start()
        self.url = self.server.url
        self.client = httpx.Client(base_url=self.url, timeout=DEADLINE_S, trust_env=False)

    def complete(self, prompt: str = "hi", **body) -> httpx.Response:
        return self.client.post("/v1/completions", json={"prompt": prompt, **body})

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.url, f"pagedserve_router:{name}", **labels)

    def workers(self) -> dict[str, dict]:
        return {worker["url"]: worker for worker in self.client.get("/list_workers").json()}

    def check_health(self) -> None:
        self.server.run(self.router.check_health())

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """function(*args) in the router's event loop, which owns its state."""
        async def call() -> Any:
            return function(*args)

        return self.server.run(call())

    def stop(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture
def start_worker() -> Iterator[Callable[..., FakeWorker]]:
    started: list[FakeWorker] = []

    def start(name: str) -> FakeWorker:
        started.append(FakeWorker(name).start())
        return started[-1]

    start.started = started  # type: ignore[attr-defined]
    yield start
    for worker in started:
        worker.gate_open = True
        worker.stop()


@pytest.fixture
def start_router() -> Iterator[Callable[..., RouterUnderTest]]:
    started: list[RouterUnderTest] = []

    def start(workers=(), labels=None, prefill=(), decode=(), **config) -> RouterUnderTest:
        config.setdefault("health_check_interval_s", 3600.0)
        router = Router(RouterConfig(**config), [w.url for w in workers], labels,
                        prefill_urls=[w.url for w in prefill], decode_urls=[w.url for w in decode])
        started.append(RouterUnderTest(router))
        return started[-1]

    yield start
    for router in started:
        router.stop()
        assert not router.router._tasks and router.router._client is None  # all closed


@pytest.fixture
def pool(start_worker) -> Iterator[ThreadPoolExecutor]:
    """Threads for requests that workers hold; a failed test's are let go before the join."""
    with ThreadPoolExecutor(8) as executor:
        yield executor
        for worker in start_worker.started:
            worker.gate_open = True


def served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["worker"]


def sse_data(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


# ---- policies end to end ----


def test_round_robin_alternates_and_forwards_authorization(start_worker, start_router):
    a, b = start_worker("a"), start_worker("b")
    router = start_router([a, b], policy="round_robin")
    names = [served_by(router.complete(max_tokens=4)) for _ in range(4)]
    assert names == ["a", "b", "a", "b"]
    response = router.client.post("/v1/chat/completions", headers={"Authorization": "Bearer k"},
                                  json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.json()["choices"][0]["message"]["content"] == "from a"
    assert a.requests[-1].headers["authorization"] == "Bearer k"
    assert a.requests[-1].body == {"messages": [{"role": "user", "content": "hi"}]}
    assert router.metric("requests_total", worker=a.url) == 3
    assert router.metric("requests_total", worker=b.url) == 2


def test_api_key_guards_every_route_but_health(start_worker, start_router):
    a = start_worker("a")
    router = start_router([a], api_key="k")
    router.check_health()
    assert router.client.post("/v1/completions", json={"prompt": "hi"}).status_code == 401
    for path in ("/list_workers", "/metrics", "/v1/models"):
        assert router.client.get(path).status_code == 401
    assert router.client.post(f"/add_worker?url={a.url}x").status_code == 401
    assert router.client.get("/health").status_code == 200
    response = router.client.post("/v1/completions", headers={"Authorization": "Bearer k"},
                                  json={"prompt": "hi"})
    assert response.status_code == 200 and a.requests[-1].headers["authorization"] == "Bearer k"


def test_tokenize_and_version_pass_through_without_a_prefill(start_worker, start_router):
    prefill, decode = start_worker("p"), start_worker("d")
    router = start_router(pd=True, prefill=[prefill], decode=[decode])
    router.check_health()
    response = router.client.post("/tokenize", json={"prompt": "hello"})
    assert response.json() == {"tokens": [5], "worker": "d"}
    assert router.client.get("/version").json() == {"version": "d"}
    assert prefill.num_requests == 0  # nothing to prefill: the decode side answers alone


def test_cache_aware_keeps_prefixes_together_and_spreads_distinct_ones(start_worker, start_router):
    a, b = start_worker("a"), start_worker("b")
    router = start_router([a, b], policy="cache_aware")
    first = served_by(router.complete(DOC_A + "Question 1?"))
    assert [served_by(router.complete(DOC_A + f"Question {i}?")) for i in (2, 3)] == [first] * 2
    assert router.metric("affinity_hits_total") == 2
    other = served_by(router.complete(DOC_B + "Question 1?"))
    assert other != first
    assert served_by(router.complete(DOC_B + "Question 2?")) == other
    assert router.metric("affinity_hits_total") == 3
    chat = [{"role": "system", "content": DOC_A}, {"role": "user", "content": "Question 1?"}]
    chat_first = served_by(router.client.post("/v1/chat/completions", json={"messages": chat}))
    chat[1]["content"] = "Question 2?"
    chat_next = served_by(router.client.post("/v1/chat/completions", json={"messages": chat}))
    assert chat_next == chat_first
    assert router.metric("affinity_hits_total") == 4


def start_held_requests(router: RouterUnderTest, pool: ThreadPoolExecutor, prompts: list[str],
                        workers: list[FakeWorker]) -> list[Future]:
    """Send each prompt once the previous one has reached one of `workers` (which holds it)."""
    futures = []
    for prompt in prompts:
        num_received = sum(worker.num_requests for worker in workers)
        futures.append(pool.submit(router.complete, prompt))
        wait_for(lambda: sum(worker.num_requests for worker in workers) > num_received,
                 "the request to reach its worker")
    return futures


def test_cache_aware_sends_new_requests_away_from_an_overloaded_worker(start_worker,
                                                                       start_router, pool):
    a, b = start_worker("a"), start_worker("b")
    a.gate_open = b.gate_open = False
    router = start_router([a, b], policy="cache_aware", balance_abs_threshold=2)
    # Loads (a, b): (0,0) (1,0) (2,0) go by affinity to a; at (3,0), 3 - 0 > 2: b.
    futures = start_held_requests(router, pool, [DOC_A + f"Q{i}" for i in range(4)], [a, b])
    assert (a.num_requests, b.num_requests) == (3, 1)
    assert router.workers()[a.url]["in_flight"] == 3
    a.gate_open = b.gate_open = True
    assert sorted(served_by(f.result()) for f in futures) == ["a", "a", "a", "b"]


def test_least_load_avoids_a_worker_with_requests_in_flight(start_worker, start_router, pool):
    a, b = start_worker("a"), start_worker("b")
    a.gate_open = False
    router = start_router([a, b], policy="least_load")
    held = start_held_requests(router, pool, ["first"], [a, b])
    assert a.num_requests == 1  # a tie: the first worker
    assert [served_by(router.complete(f"next {i}")) for i in range(3)] == ["b"] * 3
    a.gate_open = True
    assert served_by(held[0].result()) == "a"


def test_least_load_uses_polled_load_to_break_ties(start_worker, start_router):
    a, b = start_worker("a"), start_worker("b")
    a.load = {"num_running": 7, "num_waiting": 2, "kv_cache_usage": 0.5}
    b.load = {"num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.1}
    router = start_router([a, b], policy="least_load")
    assert [served_by(router.complete()) for _ in range(3)] == ["b"] * 3
    assert router.workers()[a.url]["load"] == a.load


# ---- failures ----


def test_dead_worker_is_retried_elsewhere_skipped_and_back_after_restart(start_worker,
                                                                         start_router):
    a, b = start_worker("a"), start_worker("b")
    router = start_router([a, b], policy="round_robin")
    assert served_by(router.complete()) == "a"
    b.stop()
    assert served_by(router.complete()) == "a"  # b's turn: connection refused, retried on a
    assert router.metric("retries_total") == 1
    assert router.workers()[b.url]["healthy"] is False  # at once, no health poll needed
    assert router.metric("worker_healthy", worker=b.url) == 0
    assert [served_by(router.complete()) for _ in range(2)] == ["a", "a"]  # skipped
    b.start()
    router.check_health()
    assert router.workers()[b.url]["healthy"] is True
    assert sorted(served_by(router.complete()) for _ in range(2)) == ["a", "b"]
    assert router.metric("retries_total") == 1


def test_health_poll_takes_workers_out_and_back(start_worker, start_router):
    a = start_worker("a")
    a.health_status = 503
    router = start_router([a], health_check_interval_s=0.05)
    assert router.client.get("/health").status_code == 503
    assert router.client.get("/health").json()["error"]["code"] == "no_healthy_workers"
    response = router.complete()
    assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"
    a.health_status = 200
    wait_for(lambda: router.client.get("/health").status_code == 200, "a to be healthy")
    assert served_by(router.complete()) == "a"
    a.health_status = 500
    wait_for(lambda: router.client.get("/health").status_code == 503, "a to be unhealthy")
    assert a.num_requests == 1


def test_503_is_retried_once_and_4xx_passed_through(start_worker, start_router):
    a, b = start_worker("a"), start_worker("b")
    router = start_router([a, b], policy="round_robin")
    a.fail_status = 503
    assert served_by(router.complete()) == "b"  # a's 503, retried on b
    assert router.metric("retries_total") == 1
    b.fail_status = 503
    response = router.complete()  # both fail: the last worker's answer, as it was
    assert response.status_code == 503 and response.json()["error"]["message"] == "b fails"
    assert router.metric("retries_total") == 2
    a.fail_status = b.fail_status = 400
    response = router.complete()
    assert response.status_code == 400 and "fails" in response.json()["error"]["message"]
    assert router.metric("retries_total") == 2
    assert router.workers()[a.url]["healthy"]  # a status is no reason to leave rotation


def test_all_workers_unreachable_gives_a_502(start_worker, start_router):
    a = start_worker("a")
    router = start_router([a])
    a.stop()
    response = router.complete()
    assert response.status_code == 502
    assert response.json()["error"]["type"] == "server_error"
    assert router.workers()[a.url]["in_flight"] == 0


def test_stream_passes_through_and_mid_stream_failure_ends_with_an_error_event(start_worker,
                                                                             start_router):
    a = start_worker("a")
    router = start_router([a])
    response = router.complete(stream=True)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert sse_data(response.text)[-1] == "[DONE]"
    assert [json.loads(d)["choices"][0]["text"] for d in sse_data(response.text)[:-1]] == [
        "a:0", "a:1", "a:2"]
    a.die_after_chunks = 2
    response = router.complete(stream=True)
    assert response.status_code == 200
    events = sse_data(response.text)
    assert [json.loads(d)["choices"][0]["text"] for d in events[:2]] == ["a:0", "a:1"]
    assert json.loads(events[2])["error"]["code"] == "upstream_stream_error"
    assert len(events) == 3
    assert router.metric("stream_errors_total") == 1
    assert router.metric("retries_total") == 0  # bytes were sent: never retried
    assert router.workers()[a.url]["in_flight"] == 0


def test_client_leaving_a_stream_closes_the_upstream(start_worker, start_router):
    a = start_worker("a")
    a.num_chunks, a.chunk_interval_s = 100_000, 0.01
    router = start_router([a])
    with router.client.stream("POST", "/v1/completions",
                              json={"prompt": "hi", "stream": True}) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    wait_for(lambda: a.num_disconnects == 1, "the worker to see its client leave")
    wait_for(lambda: router.workers()[a.url]["in_flight"] == 0, "the router to free the slot")


def send_raw_request(port: int, path: str, body: dict) -> socket.socket:
    """An HTTP request on a bare socket, so that a test can close it while the answer is due."""
    sock = socket.create_connection(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_client_leaving_before_the_answer_closes_the_upstream(start_worker, start_router):
    a = start_worker("a")
    a.gate_open = False
    router = start_router([a])
    sock = send_raw_request(router.server.port, "/v1/completions", {"prompt": "hi"})
    wait_for(lambda: a.num_requests == 1, "the request to reach the worker")
    sock.close()
    wait_for(lambda: a.num_disconnects == 1, "the worker to see its client leave")
    wait_for(lambda: router.workers()[a.url]["in_flight"] == 0, "the router to free the slot")


# ---- the pool at run time ----


def test_add_remove_and_list_workers(start_worker, start_router, pool):
    a, b = start_worker("a"), start_worker("b")
    router = start_router([a], policy="round_robin")
    assert list(router.workers()) == [a.url]
    response = router.client.post("/add_worker", params={"url": b.url + "/", "label": "b"})
    assert response.status_code == 200 and response.json() == {"added": b.url}
    wait_for(lambda: router.workers()[b.url]["healthy"], "the added worker's first check")
    assert router.workers()[b.url] == {"url": b.url, "label": "b", "role": "regular",
                                       "healthy": True, "in_flight": 0, "load": None}
    assert sorted(served_by(router.complete()) for _ in range(2)) == ["a", "b"]
    assert router.metric("requests_total", worker="b") == 1
    assert router.client.post("/add_worker", params={"url": b.url}).status_code == 400
    assert router.client.post("/add_worker", params={"url": "ftp://x"}).status_code == 400
    assert router.client.post("/add_worker").json()["error"]["param"] == "url"

    a.gate_open = False
    held = start_held_requests(router, pool, ["held"], [a, b])  # a's turn
    assert a.num_requests == 2
    assert router.client.post("/remove_worker", params={"url": a.url}).status_code == 200
    assert list(router.workers()) == [b.url]
    a.gate_open = True
    assert served_by(held[0].result()) == "a"  # in flight at the removal: it finishes
    assert f'in_flight{{worker="{a.url}"}}' not in router.client.get("/metrics").text
    assert router.client.post("/remove_worker", params={"url": a.url}).status_code == 404
    assert [served_by(router.complete()) for _ in range(2)] == ["b", "b"]


def test_python_api_mark_unhealthy_and_labels(start_worker, start_router):
    a, b = start_worker("a"), start_worker("b")
    router = start_router([a, b], labels=["0", "1"], policy="round_robin")
    router.call(router.router.mark_unhealthy, b.url)
    assert [served_by(router.complete()) for _ in range(2)] == ["a", "a"]
    assert router.metric("worker_healthy", worker="1") == 0
    router.check_health()
    assert router.metric("worker_healthy", worker="1") == 1
    assert router.metric("requests_total", worker="0") == 2
    with pytest.raises(ValueError, match="already"):
        router.call(router.router.add_worker, a.url)
    assert router.call(router.router.remove_worker, "http://127.0.0.1:1") is False


def test_models_come_from_a_healthy_worker(start_worker, start_router):
    a, b = start_worker("a"), start_worker("b")
    router = start_router([a, b])
    router.call(router.router.mark_unhealthy, a.url)
    assert router.client.get("/v1/models").json()["data"][0]["owned_by"] == "b"


def test_timelines_are_found_on_whichever_worker_holds_them(start_worker, start_router):
    a, b = start_worker("a"), start_worker("b")
    a.timelines = {"cmpl-1": {"request_id": "cmpl-1", "arrival_time": 10.0}}
    b.timelines = {"cmpl-2": {"request_id": "cmpl-2", "arrival_time": 20.0},
                   "cmpl-3": {"request_id": "cmpl-3", "arrival_time": 5.0}}
    router = start_router([a, b], labels=["ra", "rb"])
    for request_id, label in (("cmpl-1", "ra"), ("cmpl-2", "rb")):
        response = router.client.get(f"/v1/requests/{request_id}/timeline")
        assert response.status_code == 200
        assert response.json() == {"request_id": request_id, "worker": label,
                                   "arrival_time": response.json()["arrival_time"]}
    missing = router.client.get("/v1/requests/cmpl-9/timeline")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"
    listed = router.client.get("/v1/requests", params={"limit": 2}).json()["data"]
    assert [(t["request_id"], t["worker"]) for t in listed] == [("cmpl-2", "rb"),
                                                                ("cmpl-1", "ra")]
    memory = router.client.get("/debug/memory").json()["data"]
    assert sorted((m["worker"], m["components"]["kv_pool"]) for m in memory) == [
        ("ra", a.port), ("rb", b.port)]


# ---- metrics ----

WORKER_METRICS = """# HELP fake_requests_total Requests.
# TYPE fake_requests_total counter
fake_requests_total{{model_name="m"}} {n}
# HELP fake_running Running requests.
# TYPE fake_running gauge
fake_running {n}
# HELP fake_latency_seconds Latency.
# TYPE fake_latency_seconds histogram
fake_latency_seconds_bucket{{le="1.0"}} {n}
fake_latency_seconds_bucket{{le="+Inf"}} {n}
fake_latency_seconds_count {n}
fake_latency_seconds_sum {n}
"""


def test_worker_metrics_merge_by_family_with_a_label_per_worker(start_worker, start_router):
    a, b = start_worker("a"), start_worker("b")
    a.metrics_text, b.metrics_text = WORKER_METRICS.format(n=1), WORKER_METRICS.format(n=2)
    router = start_router([a, b], labels=["0", "1"], worker_metrics_label="replica")
    text = router.client.get("/metrics").text
    for family in ("fake_requests_total", "fake_running", "fake_latency_seconds"):
        assert text.count(f"# HELP {family} ") == 1 and text.count(f"# TYPE {family} ") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = families["fake_requests"].samples
    assert {(s.labels["replica"], s.labels["model_name"], s.value) for s in requests} == {
        ("0", "m", 1.0), ("1", "m", 2.0)}
    buckets = [s for s in families["fake_latency_seconds"].samples if s.name.endswith("_bucket")]
    assert len(buckets) == 4 and {s.labels["replica"] for s in buckets} == {"0", "1"}
    assert "pagedserve_router:requests" in families  # the router's own metrics are still there
    router.call(router.router.mark_unhealthy, b.url)  # its metrics are left out now
    text = router.client.get("/metrics").text
    assert 'replica="1"' not in text and 'replica="0"' in text


def test_merge_metrics_skips_text_that_does_not_parse():
    merged = merge_metrics([("0", WORKER_METRICS.format(n=1)), ("1", "not {{ metrics")], "r")
    assert merged.decode().count("# TYPE fake_running gauge") == 1
    assert 'r="1"' not in merged.decode()


# ---- P/D ----


def test_pd_prefills_one_token_then_decodes_the_original(start_worker, start_router):
    prefill, decode = start_worker("p"), start_worker("d")
    router = start_router(prefill=[prefill], decode=[decode], pd=True)
    body = {"messages": [{"role": "user", "content": DOC_A}], "max_tokens": 50,
            "max_completion_tokens": 50, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    response = router.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert json.loads(sse_data(response.text)[0])["worker"] == "d"
    assert prefill.requests[0].body == {"messages": body["messages"], "max_tokens": 1,
                                        "max_completion_tokens": 1, "n": 2, "stream": False}
    assert decode.requests[0].body == body
    assert router.metric("pd_fallbacks_total") == 0
    response = router.complete(DOC_A, max_tokens=5)  # not streamed
    assert served_by(response) == "d"
    assert prefill.requests[1].body == {"prompt": DOC_A, "max_tokens": 1, "stream": False}


def test_pd_falls_back_to_decode_when_prefill_fails(start_worker, start_router):
    prefill, decode = start_worker("p"), start_worker("d")
    router = start_router(prefill=[prefill], decode=[decode], pd=True)
    prefill.fail_status = 500
    assert served_by(router.complete(max_tokens=5)) == "d"
    assert router.metric("pd_fallbacks_total") == 1
    prefill.stop()  # a connection error: counted, and the prefill worker leaves rotation
    assert served_by(router.complete(max_tokens=5)) == "d"
    assert router.metric("pd_fallbacks_total") == 2
    assert router.workers()[prefill.url]["healthy"] is False
    assert served_by(router.complete(max_tokens=5)) == "d"  # no prefill worker: still served
    assert router.metric("pd_fallbacks_total") == 3
    assert router.client.get("/health").status_code == 200  # decode workers serve clients


def test_pd_client_leaving_during_prefill_closes_it(start_worker, start_router):
    prefill, decode = start_worker("p"), start_worker("d")
    prefill.gate_open = False
    router = start_router(prefill=[prefill], decode=[decode], pd=True)
    sock = send_raw_request(router.server.port, "/v1/completions", {"prompt": "hi"})
    wait_for(lambda: prefill.num_requests == 1, "the prefill request")
    sock.close()
    wait_for(lambda: prefill.num_disconnects == 1, "the prefill worker to see the client leave")
    assert decode.num_requests == 0
    wait_for(lambda: router.workers()[prefill.url]["in_flight"] == 0, "the slot to be freed")


def test_pd_mode_rejects_regular_workers(start_worker):
    with pytest.raises(ValueError, match="P/D"):
        Router(RouterConfig(pd=True), ["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="P/D"):
        Router(RouterConfig(), prefill_urls=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="role"):
        Router(RouterConfig(pd=True)).add_worker("http://127.0.0.1:1")


# ---- the command ----


def test_router_command_serves_until_sigterm(start_worker, tmp_path):
    a, b = start_worker("a"), start_worker("b")
    port = free_port()
    server = ServedProcess(["router", "--worker", a.url, "--worker", b.url, "--port", str(port),
                            "--policy", "round_robin", "--health-check-interval", "0.2"],
                           tmp_path / "router.log", f"http://127.0.0.1:{port}",
                           start_timeout_s=60)
    with server, httpx.Client(base_url=server.base_url, timeout=DEADLINE_S,
                              trust_env=False) as client:
        names = {served_by(client.post("/v1/completions", json={"prompt": "x"}))
                 for _ in range(2)}
        assert names == {"a", "b"}
        # SIGTERM with a stream open: the stream still ends whole, then the router exits.
        a.num_chunks, a.chunk_interval_s = 50, 0.02
        b.num_chunks, b.chunk_interval_s = 50, 0.02
        with client.stream("POST", "/v1/completions",
                           json={"prompt": "x", "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.process.send_signal(signal.SIGTERM)
            assert [line for line in lines if line][-1] == "data: [DONE]"
        assert server.process.wait(timeout=DEADLINE_S) == 0, server.log_tail()
