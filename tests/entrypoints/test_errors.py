"""Every bad request gets its exact status and an OpenAI error body (no traceback, no path, no
pydantic dump), while a good request streaming alongside completes unchanged and no block leaks."""

from __future__ import annotations

import dataclasses
import json
import threading

import httpx
import pytest

from tests.entrypoints.utils import API_KEY, MAX_BODY_BYTES, MAX_MODEL_LEN, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
GOOD_REQUEST = dict(model=MODEL_NAME, prompt="A long story about a dragon:", max_tokens=40,
                    temperature=0, ignore_eos=True)


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, **fields}


@dataclasses.dataclass
class Case:
    name: str
    path: str
    body: dict | list | str | bytes | None
    status: int
    param: str | None = None
    code: str | None = None
    method: str = "POST"
    headers: dict = dataclasses.field(default_factory=lambda: dict(AUTH))


CASES = [
    # The body itself.
    Case("invalid_json", COMPLETIONS, b'{"prompt": "x",', 400),
    Case("body_not_object", COMPLETIONS, [completion()], 400),
    Case("body_is_string", CHAT, "hello", 400),
    Case("deeply_nested_json", COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400),
    Case("body_not_utf8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400),
    Case("body_too_large", COMPLETIONS, completion(prompt="x" * MAX_BODY_BYTES), 413,
         code="request_too_large"),
    # Prompts.
    Case("missing_prompt", COMPLETIONS, {"model": MODEL_NAME}, 400, "prompt"),
    Case("prompt_wrong_type", COMPLETIONS, completion(prompt=5), 400, "prompt"),
    Case("empty_prompt", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    Case("token_id_negative", COMPLETIONS, completion(prompt=[1, -1]), 400, "prompt"),
    Case("token_id_huge", COMPLETIONS, completion(prompt=[10**9]), 400, "prompt"),
    Case("token_id_bool", COMPLETIONS, completion(prompt=[True]), 400, "prompt"),
    Case("too_many_prompts", COMPLETIONS, completion(prompt=["a"] * 65), 400, "prompt"),
    Case("prompt_longer_than_context", COMPLETIONS,
         completion(prompt=[1] * MAX_MODEL_LEN), 400, "prompt"),
    # Sampling parameters.
    Case("temperature_nan", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400,
         "temperature"),
    Case("temperature_infinity", COMPLETIONS, b'{"prompt": "x", "temperature": Infinity}', 400,
         "temperature"),
    Case("temperature_string", COMPLETIONS, completion(temperature="hot"), 400, "temperature"),
    Case("temperature_negative", COMPLETIONS, completion(temperature=-1), 400, "temperature"),
    Case("top_p_zero", COMPLETIONS, completion(top_p=0), 400, "top_p"),
    Case("presence_penalty_out_of_range", COMPLETIONS, completion(presence_penalty=5), 400,
         "presence_penalty"),
    Case("repetition_penalty_zero", COMPLETIONS, completion(repetition_penalty=0), 400,
         "repetition_penalty"),
    Case("n_huge", COMPLETIONS, completion(n=10**6), 400, "n"),
    Case("n_17", CHAT, chat(n=17), 400, "n"),
    Case("n_string", COMPLETIONS, completion(n="2"), 400, "n"),
    Case("n_times_prompts", COMPLETIONS, completion(prompt=["a"] * 8, n=16), 400, "n"),
    Case("max_tokens_huge", COMPLETIONS, completion(max_tokens=10**12), 400, "max_tokens"),
    Case("max_tokens_past_context", COMPLETIONS, completion(max_tokens=MAX_MODEL_LEN), 400,
         "max_tokens"),
    Case("max_completion_tokens_past_context", CHAT, chat(max_completion_tokens=MAX_MODEL_LEN),
         400, "max_completion_tokens"),
    Case("max_tokens_zero", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    Case("min_tokens_above_max_tokens", COMPLETIONS, completion(min_tokens=8), 400,
         "min_tokens"),
    Case("logprobs_21", COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    Case("top_logprobs_21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    Case("top_logprobs_without_logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    Case("stop_17_strings", COMPLETIONS, completion(stop=[f"s{i}" for i in range(17)]), 400,
         "stop"),
    Case("stop_empty_string", COMPLETIONS, completion(stop=""), 400, "stop"),
    Case("stop_token_id_out_of_vocab", COMPLETIONS, completion(stop_token_ids=[10**9]), 400,
         "stop_token_ids"),
    Case("logit_bias_301_entries", COMPLETIONS,
         completion(logit_bias={str(i): 1 for i in range(301)}), 400, "logit_bias"),
    Case("logit_bias_key_not_a_token", COMPLETIONS, completion(logit_bias={"abc": 1}), 400,
         "logit_bias"),
    Case("logit_bias_key_out_of_vocab", COMPLETIONS, completion(logit_bias={"999999999": 1}), 400,
         "logit_bias"),
    Case("logit_bias_value_out_of_range", COMPLETIONS, completion(logit_bias={"5": 1000}), 400,
         "logit_bias"),
    Case("seed_string", COMPLETIONS, completion(seed="42"), 400, "seed"),
    Case("priority_float", COMPLETIONS, completion(priority=1.5), 400, "priority"),
    Case("stream_options_without_stream", COMPLETIONS,
         completion(stream_options={"include_usage": True}), 400, "stream_options"),
    Case("suffix_unsupported", COMPLETIONS, completion(suffix="x"), 400, "suffix"),
    # Chat messages.
    Case("empty_messages", CHAT, chat(messages=[]), 400, "messages"),
    Case("unknown_role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
         "messages"),
    Case("messages_not_a_list", CHAT, chat(messages="hi"), 400, "messages"),
    Case("content_wrong_type", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400,
         "messages"),
    Case("content_part_image", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages"),
    # Model, routes, other endpoints.
    Case("unknown_model", COMPLETIONS, completion(model="gpt-4"), 404, "model",
         "model_not_found"),
    Case("unknown_model_chat", CHAT, chat(model="gpt-4"), 404, "model", "model_not_found"),
    Case("unknown_model_retrieve", "/v1/models/gpt-4", None, 404, "model", "model_not_found",
         method="GET"),
    Case("unknown_route", "/v1/nothing", None, 404, code="not_found", method="GET"),
    Case("wrong_method", COMPLETIONS, None, 405, code="method_not_allowed", method="GET"),
    Case("detokenize_bad_token", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    Case("tokenize_neither_prompt_nor_messages", "/tokenize", {}, 400, "prompt"),
]

ROUTES = [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL_NAME}"), ("POST", COMPLETIONS),
          ("POST", CHAT), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
          ("GET", "/version"), ("GET", "/docs"), ("GET", "/v1/nothing")]
for method, path in ROUTES:
    body = completion() if path == COMPLETIONS else chat() if path == CHAT else None
    for label, headers in [("missing_key", {}),
                           ("wrong_key", {"Authorization": "Bearer wrong-key"}),
                           ("wrong_scheme", {"Authorization": f"Basic {API_KEY}"})]:
        CASES.append(Case(f"{label}{path.replace('/', '_')}", path, body, 401,
                          code="invalid_api_key", method=method, headers=headers))


def send(http: httpx.Client, case: Case) -> httpx.Response:
    if isinstance(case.body, bytes):
        content = case.body
    elif case.body is None:
        content = None
    else:
        content = json.dumps(case.body).encode()
    return http.request(case.method, case.path, content=content,
                        headers={"Content-Type": "application/json", **case.headers})


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def good_request(server, http):
    """A greedy stream started before the bad requests; join() -> (its text, expected text)."""
    expected = http.post(COMPLETIONS, json=GOOD_REQUEST, headers=AUTH).json()["choices"][0]["text"]
    pieces: list[str] = []

    def run() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            with client.stream("POST", COMPLETIONS, json={**GOOD_REQUEST, "stream": True},
                               headers=AUTH) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        pieces.extend(c["text"] for c in json.loads(line[6:])["choices"])

    thread = threading.Thread(target=run)
    thread.start()

    def join() -> tuple[str, str]:
        thread.join(timeout=60)
        return "".join(pieces), expected

    return join


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_bad_request(http, good_request, case):
    assert len(CASES) >= 25
    response = send(http, case)
    assert response.status_code == case.status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("server_error" if case.status >= 500 else "invalid_request_error")
    if case.param is not None:
        assert error["param"] == case.param, error
    if case.code is not None:
        assert error["code"] == case.code, error
    for leak in ("Traceback", ".py", "/work", "pydantic", "input_value", "errors.pydantic.dev"):
        assert leak not in response.text, response.text


def test_health_needs_no_key(http):
    assert http.get("/health").status_code == 200


def test_overloaded_server_answers_503(server, http):
    state = server.app.state.server
    config = state.config
    state.config = dataclasses.replace(config, max_num_waiting=0)  # any queue counts as full
    try:
        for path, body in [(COMPLETIONS, completion()), (CHAT, chat())]:
            response = http.post(path, json=body, headers=AUTH)
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "overloaded"
        assert http.get("/v1/models", headers=AUTH).status_code == 200
    finally:
        state.config = config


def test_body_too_large_without_content_length(http):
    def chunks():  # chunked transfer encoding: the size is only known while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 1):
            yield b"x" * 65536
        yield b'"}'

    response = http.post(COMPLETIONS, content=chunks(), headers=AUTH)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_good_request_unchanged_and_no_leak(server, good_request):
    text, expected = good_request()
    assert text == expected
    server.wait_until_idle(timeout=60.0)  # a hang guard: the request is done
