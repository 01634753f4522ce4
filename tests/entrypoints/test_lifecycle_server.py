"""The server's lifecycle routes: POST /sleep?level=, /wake_up, GET /is_sleeping (with
--enable-sleep-mode only), POST /reset_prefix_cache and /update_weights (/update_weights_from_disk).

A real uvicorn server over a tiny random Llama, with an API key: every admin route needs it;
while asleep a generation request gets 503 `engine_sleeping`; a lifecycle call while a request is
in flight gets 400 `engine_busy`; after a wake or a weight update the greedy text equals an
engine's that never slept or that loaded the new weights. After each test the engine is awake,
serves the first model's weights and holds no request and no block.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tests.engine.tiny_models import write_tiny_llama
from tests.entrypoints.utils import API_KEY, ServerHandle, serving

pytest.importorskip("transformers")

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = list(range(100, 150))  # 3 full blocks: prefix-cached after a request
ADMIN_ROUTES = [("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                ("POST", "/reset_prefix_cache"), ("POST", "/update_weights"),
                ("POST", "/update_weights_from_disk")]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    dirs = {}
    for name, seed, num_layers in (("a", 0, 2), ("b", 1, 2), ("deeper", 2, 3)):
        (root / name).mkdir()
        dirs[name] = write_tiny_llama(root / name, tokenizer, seed, num_layers)
    return dirs


def make_async_llm(model_path: str, **engine_args):
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine

    config = EngineArgs(model=model_path, dtype="float32", kv_cache_memory="16MiB",
                        **engine_args).create_engine_config()
    return AsyncLLM(LLMEngine(config))


@pytest.fixture(scope="module")
def server(tiny_dirs):
    from pagedserve.entrypoints.openai.api_server import ServerConfig, build_app

    async_llm = make_async_llm(tiny_dirs["a"], enable_sleep_mode=True)
    app = build_app(async_llm, ServerConfig(served_model_name="tiny", api_key=API_KEY,
                                            log_level="warning"))
    with serving(app, async_llm) as handle:
        yield handle


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client
        left_asleep = server.async_llm.is_sleeping
        if left_asleep:  # wake it so one failure does not fail every later test too
            client.post("/wake_up").raise_for_status()
        server.wait_until_idle()
        assert not left_asleep, "a test left the engine asleep"


@pytest.fixture(scope="module")
def expected_text(tiny_dirs) -> dict[str, str]:
    """Greedy text of PROMPT from offline engines that never slept, per model."""
    from pagedserve.engine.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    texts = {}
    for name in ("a", "b"):
        llm = LLM(model=tiny_dirs[name], dtype="float32", kv_cache_memory="16MiB")
        texts[name] = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].text
        llm.engine.shutdown()
    assert texts["a"] != texts["b"]
    return texts


def complete(client: httpx.Client) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True})


def num_cached_blocks(server: ServerHandle) -> int:
    pool = server.async_llm.engine.scheduler.kv_cache_manager.block_pool
    return sum(block.block_hash is not None for block in pool.blocks)


def assert_error(response: httpx.Response, status: int, error_type: str, code: str | None,
                 message_part: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == error_type and error["code"] == code, error
    assert message_part in error["message"], error


# ---- the API key --------------------------------------------------------------------------------


@pytest.mark.parametrize("method, path", ADMIN_ROUTES)
def test_admin_routes_need_the_api_key(server, client, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.request(method, server.base_url + path, headers=headers, json={})
        assert_error(response, 401, "invalid_request_error", "invalid_api_key")
    assert not server.async_llm.is_sleeping


# ---- sleep and wake -----------------------------------------------------------------------------


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_over_http(server, client, expected_text, level):
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert complete(client).json()["choices"][0]["text"] == expected_text["a"]
    assert num_cached_blocks(server) > 0

    assert client.post("/sleep", params={"level": level}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    assert num_cached_blocks(server) == 0
    assert server.async_llm.engine.sleep_level == level
    assert_error(complete(client), 503, "server_error", "engine_sleeping", "/wake_up")
    stream = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                   "max_tokens": 2, "stream": True})
    assert_error(stream, 503, "server_error", "engine_sleeping")
    assert client.post("/tokenize", json={"prompt": "Hi"}).status_code == 200  # no model needed
    assert client.get("/v1/models").status_code == 200
    assert client.post("/sleep", params={"level": level}).status_code == 200  # again: a no-op

    assert client.post("/wake_up").status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert client.post("/wake_up").status_code == 200  # awake: a no-op
    assert complete(client).json()["choices"][0]["text"] == expected_text["a"]


@pytest.mark.parametrize("level", ["0", "3", "deep"])
def test_a_bad_sleep_level_is_a_400(client, level):
    assert_error(client.post("/sleep", params={"level": level}), 400, "invalid_request_error",
                 None, "level")


def test_sleep_while_a_request_is_in_flight_is_refused(server, client):
    """The engine thread is held while a completion and then /sleep queue behind it, so the
    sleep meets the request in flight for certain."""
    async_llm = server.async_llm
    gate = threading.Event()
    holding = threading.Event()

    def hold_engine_thread() -> None:
        holding.set()
        gate.wait()

    async_llm._submit(hold_engine_thread)
    # The queue counts below start from empty only once the engine thread has taken the gate.
    assert holding.wait(timeout=30)
    responses: dict[str, httpx.Response] = {}

    def post(name: str, path: str, **kwargs) -> threading.Thread:
        def run() -> None:
            responses[name] = client.post(path, **kwargs)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    def wait_for_queued(num_commands: int) -> None:
        deadline = time.monotonic() + 30
        while async_llm._commands.qsize() < num_commands:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    threads = [post("completion", "/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})]
    wait_for_queued(1)
    threads.append(post("sleep", "/sleep", params={"level": 1}))
    wait_for_queued(2)
    gate.set()
    for thread in threads:
        thread.join(timeout=30)
    assert responses["completion"].status_code == 200
    assert_error(responses["sleep"], 400, "invalid_request_error", "engine_busy",
                 "requests are in flight")
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}


# ---- prefix cache and weights -------------------------------------------------------------------


def test_reset_prefix_cache(server, client):
    complete(client)
    assert num_cached_blocks(server) > 0
    response = client.post("/reset_prefix_cache")
    assert response.status_code == 200
    assert num_cached_blocks(server) == 0


def test_update_weights_serves_the_new_model_then_the_old_one(server, client, tiny_dirs,
                                                               expected_text):
    assert complete(client).json()["choices"][0]["text"] == expected_text["a"]
    response = client.post("/update_weights", json={"model_path": tiny_dirs["b"]})
    assert response.status_code == 200, response.text
    assert response.json()["success"] is True
    assert num_cached_blocks(server) == 0
    assert complete(client).json()["choices"][0]["text"] == expected_text["b"]
    response = client.post("/update_weights_from_disk", json={"model_path": tiny_dirs["a"]})
    assert response.status_code == 200, response.text
    assert complete(client).json()["choices"][0]["text"] == expected_text["a"]


def test_update_weights_refusals_keep_the_weights(client, tiny_dirs, expected_text, tmp_path):
    cases = [
        ({"model_path": tiny_dirs["deeper"]}, "num_hidden_layers 3 (serving 2)"),
        ({"model_path": str(tmp_path / "missing")}, "cannot read a model"),
        ({"model_path": tiny_dirs["b"], "abort_all_requests": True}, "abort_all_requests"),
        ({}, "model_path"),
        ({"model_path": 5}, "model_path"),
    ]
    for body, message_part in cases:
        assert_error(client.post("/update_weights", json=body), 400, "invalid_request_error",
                     None, message_part)
    assert client.post("/sleep", params={"level": 1}).status_code == 200
    assert_error(client.post("/update_weights", json={"model_path": tiny_dirs["b"]}), 400,
                 "invalid_request_error", None, "sleeping")
    assert client.post("/wake_up").status_code == 200
    assert complete(client).json()["choices"][0]["text"] == expected_text["a"]


# ---- without sleep mode -------------------------------------------------------------------------


def test_sleep_routes_exist_only_with_sleep_mode(tiny_dirs):
    from pagedserve.entrypoints.openai.api_server import ServerConfig, build_app

    async_llm = make_async_llm(tiny_dirs["a"])
    app = build_app(async_llm, ServerConfig(served_model_name="tiny", log_level="warning"))

    async def statuses() -> dict[str, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return {path: (await client.request(method, path)).status_code
                    for method, path in [("POST", "/sleep"), ("POST", "/wake_up"),
                                         ("GET", "/is_sleeping"), ("POST", "/reset_prefix_cache")]}

    try:
        assert asyncio.run(statuses()) == {"/sleep": 404, "/wake_up": 404, "/is_sleeping": 404,
                                           "/reset_prefix_cache": 200}
    finally:
        asyncio.run(async_llm.shutdown(drain_timeout=0))
