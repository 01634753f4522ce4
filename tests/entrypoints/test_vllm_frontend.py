"""vLLM's frontend behaviour over HTTP: the chat template request fields on the shared server,
then a second app over the same engine built as `pagedserve serve` builds it from vLLM's flags:
TLS, --root-path, CORS, --chat-template, two served names, --max-logprobs and
--return-tokens-as-token-ids."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import ssl
import subprocess

import httpx
import pytest

from tests.entrypoints.utils import API_KEY, MODEL_NAME, uvicorn_thread
from tests.processes import free_port

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]

# vLLM's single-line form: \n escapes, decoded by load_chat_template.
INLINE_TEMPLATE = (r"{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                   r"<|im_end|>\n{% endfor %}{% if greeting %}[{{ greeting }}]{% endif %}"
                   r"{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ORIGIN = "http://app.example"
ROOT = "/llm"


def tokenize_text(client: httpx.Client, path: str = "/tokenize", **fields) -> str:
    """The rendered prompt of `fields` (messages & co), via /tokenize and /detokenize."""
    response = client.post(path, json={"model": MODEL_NAME, **fields}, headers=AUTH)
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    text = client.post(path.replace("/tokenize", "/detokenize"), json={"tokens": tokens},
                       headers=AUTH)
    return text.json()["prompt"]


# ---- the chat template fields, on the shared server (the model's own template) --------------


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(http):
    question = CONVERSATION[:1]
    opened = tokenize_text(http, messages=question)
    unopened = tokenize_text(http, messages=question, add_generation_prompt=False)
    assert opened.endswith("<|im_start|>assistant\n")
    assert opened == unopened + "<|im_start|>assistant\n"


def test_continue_final_message_ends_the_prompt_inside_it(http, server):
    prompt = tokenize_text(http, messages=CONVERSATION, add_generation_prompt=False,
                           continue_final_message=True)
    closed = tokenize_text(http, messages=CONVERSATION, add_generation_prompt=False)
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    assert closed.startswith(prompt) and closed != prompt  # the turn's end was cut off
    # The chat route renders the same prompt: its usage counts the same tokens.
    count = http.post("/tokenize", json={"messages": CONVERSATION, "add_generation_prompt": False,
                                         "continue_final_message": True}, headers=AUTH)
    completion = server.openai().chat.completions.create(
        model=MODEL_NAME, messages=CONVERSATION, max_tokens=2, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert completion.usage.prompt_tokens == count.json()["count"]


@pytest.mark.parametrize("fields, message, param", [
    ({"continue_final_message": True},
     "continue_final_message and add_generation_prompt cannot both be true", None),
    ({"chat_template": "{{ 1 }}"}, "--trust-request-chat-template", "chat_template"),
    ({"chat_template_kwargs": {"messages": []}}, "chat template kwargs may not set messages",
     "messages"),
])
def test_bad_chat_template_fields_get_400(http, fields, message, param):
    for path in ("/v1/chat/completions", "/tokenize"):
        response = http.post(path, json={"model": MODEL_NAME, "messages": CONVERSATION,
                                         "max_tokens": 2, **fields}, headers=AUTH)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"]
        if param is not None:
            assert error["param"] == param


def test_unknown_template_kwargs_pass_through_to_the_template(http):
    # SmolLM2's template reads no such variable: the render is unchanged, and nothing fails.
    assert (tokenize_text(http, messages=CONVERSATION[:1], chat_template_kwargs={"x": 1})
            == tokenize_text(http, messages=CONVERSATION[:1]))


# ---- `pagedserve serve` with vLLM's frontend flags, over the same engine ----------------------


def _self_signed_certificate(directory) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    key, cert = str(directory / "key.pem"), str(directory / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1",
                    "-addext", "basicConstraints=critical,CA:TRUE"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


@contextlib.contextmanager
def _listening(app, config):
    """`app` under the uvicorn config `pagedserve serve` uses; stops the listener only (the
    engine belongs to the shared server)."""
    from pagedserve.entrypoints.openai.api_server import uvicorn_config

    with uvicorn_thread(uvicorn_config(app, config)):
        yield


@pytest.fixture(scope="module")
def vllm_server(server, tmp_path_factory):
    """(base URL, TLS context trusting its certificate) of a TLS server built from vLLM flags.
    The base URL is what a proxy that strips --root-path forwards to."""
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.entrypoints.openai.api_server import ServerConfig, build_app
    from pagedserve.entrypoints.vllm_flags import parse_args_or_exit
    from pagedserve.metrics import PrometheusStatLogger

    key, cert = _self_signed_certificate(tmp_path_factory.mktemp("tls"))
    port = free_port()
    args = parse_args_or_exit(build_parser(), [
        "serve", MODEL_NAME, "--served-model-name", MODEL_NAME, "second-name",
        "--port", str(port), "--api-key", API_KEY, "--uvicorn-log-level", "warning",
        "--root-path", ROOT, "--allowed-origins", f'["{ORIGIN}"]',
        "--ssl-keyfile", key, "--ssl-certfile", cert,
        "--chat-template", INLINE_TEMPLATE, "--trust-request-chat-template",
        "--default-chat-template-kwargs", '{"greeting": "default"}',
        "--max-logprobs", "2", "--return-tokens-as-token-ids",
        "--enable-log-requests", "--max-log-len", "30"])
    config = ServerConfig.from_cli_args(args)
    app = build_app(server.async_llm, config, PrometheusStatLogger(MODEL_NAME),
                    server.app.state.timelines)
    with _listening(app, config):
        yield f"https://127.0.0.1:{port}", ssl.create_default_context(cafile=cert)
    server.wait_until_idle()


@pytest.fixture(scope="module")
def https(vllm_server):
    base_url, tls = vllm_server
    with httpx.Client(base_url=base_url, verify=tls, timeout=60) as client:
        yield client


def test_tls_root_path_and_unauthenticated_health(vllm_server, https):
    base_url, _ = vllm_server
    assert https.get("/health").status_code == 200  # no key: the gate strips the root path uvicorn prepends
    assert https.get("/v1/models").status_code == 401
    # The root path acted: the schema's server (what links resolve against) is the prefix.
    schema = https.get("/openapi.json", headers=AUTH).json()
    assert schema["servers"] == [{"url": ROOT}]
    with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port
        httpx.get(base_url.replace("https://", "http://") + "/health", timeout=10)


def test_both_served_names_answer(vllm_server):
    import openai

    base_url, tls = vllm_server
    with httpx.Client(verify=tls) as http_client:  # closed: no keep-alive delays the shutdown
        client = openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY,
                               http_client=http_client)
        assert [model.id for model in client.models.list().data] == [MODEL_NAME, "second-name"]
        for name in (MODEL_NAME, "second-name"):
            completion = client.completions.create(model=name, prompt="Hello", max_tokens=2)
            assert completion.choices[0].text
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="third-name", prompt="Hello", max_tokens=2)


def test_cors_preflight_answers_the_allowed_origin_only(https):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = https.options("/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200  # answered before the API key gate
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    other = https.options("/v1/chat/completions",
                          headers={"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    simple = https.get("/v1/models", headers={"Origin": ORIGIN, **AUTH})
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == ORIGIN


def test_chat_template_flag_inline_with_default_and_request_kwargs(https):
    user = CONVERSATION[:1]
    expected = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n[default]"
                "<|im_start|>assistant\n")
    assert tokenize_text(https, messages=user) == expected
    assert tokenize_text(https, messages=user, chat_template_kwargs={"greeting": "hi"}) == (
        expected.replace("[default]", "[hi]"))
    # A trusted request's own template wins over --chat-template.
    assert tokenize_text(https, messages=user,
                         chat_template="{{ messages[0]['content'] }}!") == user[0]["content"] + "!"


def test_chat_template_flag_from_a_file(tmp_path):
    from pagedserve.entrypoints.openai.frontend_options import load_chat_template

    path = tmp_path / "chat.jinja"
    path.write_text("{{ messages[0]['content'] }}\n", encoding="utf-8")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}\n"


def test_max_logprobs_and_token_ids(https):
    body = {"model": MODEL_NAME, "messages": CONVERSATION[:1], "max_tokens": 3,
            "temperature": 0, "logprobs": True}
    too_many = https.post("/v1/chat/completions", json={**body, "top_logprobs": 3}, headers=AUTH)
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "top_logprobs"
    assert "at most 2" in too_many.json()["error"]["message"]
    response = https.post("/v1/chat/completions", json={**body, "top_logprobs": 2}, headers=AUTH)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert len(entries) == 3
    token_ids = []
    for entry in entries:
        assert entry["token"].startswith("token_id:")
        token_ids.append(int(entry["token"].removeprefix("token_id:")))
        assert len(entry["top_logprobs"]) == 2
        assert all(top["token"].startswith("token_id:") for top in entry["top_logprobs"])
    # The ids are the generated tokens: they decode to the message's text.
    text = https.post("/detokenize", json={"tokens": token_ids}, headers=AUTH).json()["prompt"]
    assert text == choice["message"]["content"]
    completion = https.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello",
                                                     "max_tokens": 2, "logprobs": 3},
                            headers=AUTH)
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "logprobs"


def test_enable_log_requests_logs_the_body_cut_at_max_log_len(https, caplog):
    body = {"model": MODEL_NAME, "prompt": "a prompt long enough to be cut in the log"}
    with caplog.at_level(logging.INFO, logger="pagedserve.entrypoints.openai.api_server"):
        assert https.post("/tokenize", json=body, headers=AUTH).status_code == 200
    logged = json.dumps(body)[:30] + "..."
    assert f"request POST {ROOT}/tokenize: {logged}" in caplog.text


def test_completion_logprobs_as_token_ids_keep_text_offsets(https):
    def detokenize(ids: list[int]) -> str:
        return https.post("/detokenize", json={"tokens": ids}, headers=AUTH).json()["prompt"]

    response = https.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello",
                                                   "max_tokens": 3, "temperature": 0,
                                                   "logprobs": 2}, headers=AUTH)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    ids = [int(token.removeprefix("token_id:")) for token in logprobs["tokens"]]
    assert detokenize(ids) == choice["text"]
    assert all(key.startswith("token_id:") for top in logprobs["top_logprobs"] for key in top)
    offsets = logprobs["text_offset"]  # count the text, not the token_id:N spelling
    assert [b - a for a, b in zip(offsets, offsets[1:])] == [
        len(detokenize([token_id])) for token_id in ids[:-1]]
