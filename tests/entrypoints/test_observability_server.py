"""The server's profiler routes (POST /start_profile, /stop_profile) and its OTLP traces
(--otlp-traces-endpoint).

A real uvicorn server over a tiny random Llama with a profiler directory and an OTLP endpoint:
an in-process OTLP/HTTP receiver on loopback (POST /v1/traces, protobuf) collects the spans. The
profiler writes a Chrome trace with aten ops and the engine's step ranges; starting twice or
stopping when stopped is a 400 and the server keeps serving. Every finished request arrives as
one span whose token counts equal the response's usage, with the timeline's events. Spans are
flushed explicitly (the tracer's force_flush), never waited for. After each test the engine
holds no request and no block.
"""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.engine.tiny_models import write_tiny_llama
from tests.entrypoints.utils import API_KEY, serving

pytest.importorskip("transformers")
trace_service_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2")

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = list(range(100, 140))  # 2 full blocks: prefix-cached after a request
STEP_RANGES = {"pagedserve::schedule", "pagedserve::execute_model", "pagedserve::update",
               "pagedserve::worker.execute_model"}


# ---- an OTLP/HTTP receiver ----------------------------------------------------------------------


class OTLPReceiver:
    """Accepts POST /v1/traces (OTLP/HTTP protobuf, maybe gzipped) on a loopback port and keeps
    every span, each with its resource's attributes."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict, object]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver",
                                        daemon=True)
        self._thread.start()

    def _add(self, request) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = attributes_of(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope_spans.spans)

    def take(self) -> list[tuple[dict, object]]:
        with self._lock:
            spans, self.spans = self.spans, []
        return spans

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()


def attributes_of(key_values) -> dict:
    values = {}
    for kv in key_values:
        kind = kv.value.WhichOneof("value")
        value = getattr(kv.value, kind)
        if kind == "array_value":
            value = [getattr(v, v.WhichOneof("value")) for v in value.values]
        values[kv.key] = value
    return values


# ---- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), tokenizer, seed=0)


@pytest.fixture(scope="module")
def receiver():
    receiver = OTLPReceiver()
    yield receiver
    receiver.stop()


def make_async_llm(model_path: str, **engine_args):
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine

    config = EngineArgs(model=model_path, dtype="float32", kv_cache_memory="16MiB",
                        **engine_args).create_engine_config()
    return AsyncLLM(LLMEngine(config))


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def server(tiny_dir, receiver, trace_dir):
    from pagedserve.entrypoints.openai.api_server import ServerConfig, build_app

    async_llm = make_async_llm(tiny_dir, profiler_dir=str(trace_dir))
    app = build_app(async_llm, ServerConfig(served_model_name="tiny", api_key=API_KEY,
                                            log_level="warning",
                                            otlp_traces_endpoint=receiver.url))
    try:
        with serving(app, async_llm) as handle:
            yield handle
    finally:
        app.state.tracer.shutdown()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client
        assert not server.async_llm.engine.is_profiling, "a test left the profiler running"
        server.wait_until_idle()


def complete(client: httpx.Client, max_tokens: int = 4, **extra) -> httpx.Response:
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                    "max_tokens": max_tokens, "temperature": 0,
                                                    "ignore_eos": True, **extra})
    assert response.status_code == 200, response.text
    return response


def assert_error(response: httpx.Response, status: int, message_part: str) -> None:
    assert response.status_code == status, response.text
    assert message_part in response.json()["error"]["message"], response.text


# ---- the profiler -------------------------------------------------------------------------------


def test_profile_over_http(server, client, trace_dir):
    assert_error(client.post("/stop_profile"), 400, "not running")
    assert httpx.post(server.base_url + "/start_profile").status_code == 401  # needs the key

    assert client.post("/start_profile").status_code == 200
    assert_error(client.post("/start_profile"), 400, "already running")
    for max_tokens in (3, 5):
        complete(client, max_tokens)
    response = client.post("/stop_profile")
    assert response.status_code == 200, response.text
    (path,) = response.json()["traces"]
    assert Path(path).parent == trace_dir and path.endswith(".pt.trace.json")
    assert "rank0" in Path(path).name
    names = {event.get("name") for event in json.loads(Path(path).read_text())["traceEvents"]}
    assert any(name.startswith("aten::") for name in names if name)
    assert STEP_RANGES <= names

    assert_error(client.post("/stop_profile"), 400, "not running")
    complete(client)  # still serving


def test_profile_routes_exist_only_with_a_profiler_dir(tiny_dir, monkeypatch):
    from pagedserve.entrypoints.openai.api_server import ServerConfig, build_app

    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    async_llm = make_async_llm(tiny_dir)
    app = build_app(async_llm, ServerConfig(served_model_name="tiny", log_level="warning"))
    with serving(app, async_llm) as handle:
        for path in ("/start_profile", "/stop_profile"):
            assert httpx.post(handle.base_url + path).status_code == 404
        assert app.state.tracer is None
        handle.wait_until_idle()


# ---- OTLP traces --------------------------------------------------------------------------------


def test_one_span_per_request(server, client, receiver):
    tracer = server.app.state.tracer
    assert tracer.force_flush()
    receiver.take()  # the other tests' spans

    first = complete(client, 3).json()
    second = complete(client, 5, temperature=0.7, top_p=0.9, seed=1).json()  # prefix-cached
    openai_client = server.openai(max_retries=0)
    chunks = openai_client.completions.create(  # the tiny model has no chat template
        model="tiny", prompt=list(range(200, 220)), max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    third_usage = [chunk.usage for chunk in chunks if chunk.usage][-1]
    server.wait_until_idle()
    assert tracer.force_flush()  # a request's span is queued before its response is sent
    spans = receiver.take()
    assert len(spans) == 3

    by_tokens = {}
    for resource, span in spans:
        assert resource["service.name"] == "pagedserve"
        assert span.name == "llm_request"
        assert span.kind == span.SPAN_KIND_SERVER
        attributes = attributes_of(span.attributes)
        by_tokens[attributes["gen_ai.usage.completion_tokens"]] = (span, attributes)
    usages = {3: first["usage"], 5: second["usage"],
              7: {"prompt_tokens": third_usage.prompt_tokens,
                  "completion_tokens": third_usage.completion_tokens}}
    assert sorted(by_tokens) == [3, 5, 7]

    for num_tokens, usage in usages.items():
        span, attributes = by_tokens[num_tokens]
        assert attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
        assert attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
        assert attributes["gen_ai.request.max_tokens"] == num_tokens
        assert attributes["gen_ai.request.n"] == 1
        assert attributes["gen_ai.response.model"] == "tiny"
        assert attributes["gen_ai.response.finish_reasons"] == ["length"]
        assert attributes["gen_ai.request.id"].startswith("cmpl-")
        ttft = attributes["gen_ai.latency.time_to_first_token"]
        e2e = attributes["gen_ai.latency.e2e"]
        assert 0 < ttft <= e2e
        assert 0 <= attributes["gen_ai.latency.time_in_queue"] <= ttft
        assert attributes["gen_ai.latency.time_in_model_decode"] >= 0
        assert attributes["pagedserve.ttft_explanation"].startswith("TTFT")
        assert attributes["pagedserve.num_prefill_chunks"] == 1
        assert attributes["pagedserve.num_decode_steps"] == num_tokens - 1
        assert attributes["pagedserve.num_preemptions"] == 0
        # The span runs from arrival to finish; its events lie inside, in order.
        assert abs((span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 - e2e) < 1e-5
        event_times = [event.time_unix_nano for event in span.events]
        assert event_times == sorted(event_times)
        assert span.start_time_unix_nano <= event_times[0]
        assert event_times[-1] <= span.end_time_unix_nano
        names = [event.name for event in span.events]
        assert names[0] == "queued" and names[-1] == "finished"
        assert "first_token" in names
        queued = attributes_of(span.events[0].attributes)
        assert queued["num_prompt_tokens"] == usage["prompt_tokens"]
        first_token = span.events[names.index("first_token")]
        assert abs((first_token.time_unix_nano - span.start_time_unix_nano) / 1e9 - ttft) < 1e-5
        assert attributes_of(span.events[-1].attributes)["reason"] == "length"

    first_attributes, second_attributes = by_tokens[3][1], by_tokens[5][1]
    assert first_attributes["gen_ai.request.temperature"] == 0
    assert second_attributes["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert second_attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    # The second request found the first one's prompt blocks in the prefix cache.
    assert second_attributes["pagedserve.cached_tokens"] >= 32
    assert second_attributes["pagedserve.cached_tokens.device"] >= 32
    hit = next(e for e in by_tokens[5][0].events if e.name == "prefix_hit")
    assert attributes_of(hit.attributes)["source"] == "device"


def test_a_bad_endpoint_or_missing_packages_fail_at_startup(monkeypatch):
    import sys

    from pagedserve.entrypoints.openai.api_server import ServerConfig

    with pytest.raises(ValueError, match="http"):
        ServerConfig(otlp_traces_endpoint="localhost:4318")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with pytest.raises(ValueError, match="pip install opentelemetry-sdk==1.45.2 "
                                         "opentelemetry-exporter-otlp-proto-http==1.45.2"):
        ServerConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")
