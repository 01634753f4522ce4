"""LoRA adapters on the server, on the real default model (bf16, its GGUF weights packed):
/v1/models, `model` picking an adapter, runtime load/unload confined to --lora-dir, the bad
inputs each a 4xx with nothing kept, unloading in use refused without breaking the stream, and
the admin routes behind the API key. One test starts a real `pagedserve serve --lora-modules`.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from tests.entrypoints.utils import API_KEY, serving
from tests.lora.helpers import write_random_adapter
from tests.processes import ServedProcess, free_port

MODEL_NAME = "smollm2"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory, model_path):
    from pagedserve.models.loader import load_model_config

    root = tmp_path_factory.mktemp("loras")
    config = load_model_config(model_path)
    write_random_adapter(root / "qv", config, 8, ["q_proj", "v_proj"], seed=1, scale=0.08)
    write_random_adapter(root / "mlp", config, 16, ["gate_proj", "up_proj", "down_proj"],
                         seed=2, scale=0.05)
    write_random_adapter(root / "big", config, 32, ["q_proj"], seed=3)
    outside = tmp_path_factory.mktemp("outside")
    write_random_adapter(outside / "adapter", config, 8, ["q_proj"], seed=4)
    os.symlink(outside / "adapter", root / "escape")
    return root, outside


@pytest.fixture(scope="module")
def server(lora_root, model_path, tokenizer):
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.openai.api_server import ServerConfig, build_app

    root, _ = lora_root
    config = EngineArgs(model=model_path, kv_cache_memory="128MiB", max_model_len=1024,
                        enable_lora=True, max_loras=2, max_lora_rank=16).create_engine_config()
    async_llm = AsyncLLM(LLMEngine(config, tokenizer=tokenizer))
    app = build_app(async_llm, ServerConfig(
        served_model_name=MODEL_NAME, api_key=API_KEY, log_level="warning",
        lora_dir=str(root), enable_lora_runtime_updates=True))
    # What `serve --lora-modules qv=...` does before it listens.
    asyncio.run(app.state.lora.load("qv", str(root / "qv"), confine=False))
    with serving(app, async_llm) as handle:
        yield handle
        handle.wait_until_idle()


def _complete(server, model: str, max_tokens: int = 12) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", headers=HEADERS, timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})


def _models(server) -> dict[str, dict]:
    """id -> card, less `created` (the time of the listing)."""
    data = httpx.get(server.base_url + "/v1/models", headers=HEADERS).json()["data"]
    return {card["id"]: {k: v for k, v in card.items() if k != "created"} for card in data}


def _load(server, name: str, path: str) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/load_lora_adapter", headers=HEADERS, timeout=60,
                      json={"lora_name": name, "lora_path": path})


def _unload(server, name: str) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/unload_lora_adapter", headers=HEADERS, timeout=60,
                      json={"lora_name": name})


def test_adapters_are_models_and_change_the_output(server):
    models = _models(server)
    assert set(models) == {MODEL_NAME, "qv"}
    assert models["qv"]["parent"] == MODEL_NAME and models["qv"]["root"].endswith("qv")
    base = _complete(server, MODEL_NAME).json()
    adapted = _complete(server, "qv").json()
    assert adapted["model"] == "qv"
    assert adapted["choices"][0]["text"] != base["choices"][0]["text"]
    assert _complete(server, MODEL_NAME).json()["choices"] == base["choices"]  # base unchanged
    missing = _complete(server, "nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_runtime_load_and_unload(server):
    assert _load(server, "mlp", "mlp").status_code == 200
    assert "mlp" in _models(server)
    text = _complete(server, "mlp").json()["choices"][0]["text"]
    assert text != _complete(server, "qv").json()["choices"][0]["text"]
    again = _load(server, "mlp", "mlp")
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert _unload(server, "mlp").status_code == 200
    assert "mlp" not in _models(server) and _complete(server, "mlp").status_code == 404
    assert _unload(server, "mlp").status_code == 404


@pytest.mark.parametrize("path, message", [
    ("missing", "no adapter directory"),
    ("../outside/adapter", "outside the LoRA directory"),
    ("escape", "outside the LoRA directory"),
    ("big", "exceeds max_lora_rank 16"),
])
def test_bad_loads_are_400_and_keep_nothing(server, path, message):
    before = _models(server)
    response = _load(server, "bad", path)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert _models(server) == before
    assert server.async_llm.engine.lora_registry.get("bad") is None


def test_unloading_in_use_is_refused_and_the_stream_goes_on(server):
    assert _load(server, "mlp", "mlp").status_code == 200
    with httpx.stream("POST", server.base_url + "/v1/completions", headers=HEADERS, timeout=120,
                      json={"model": "mlp", "prompt": PROMPT, "max_tokens": 24,
                            "temperature": 0, "stream": True, "ignore_eos": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        refused = _unload(server, "mlp")
        assert refused.status_code == 400 and "in use" in refused.json()["error"]["message"]
        rest = [line for line in lines if line.startswith("data: ")]
    assert first and rest[-1] == "data: [DONE]"
    server.wait_until_idle()
    assert _unload(server, "mlp").status_code == 200


def test_admin_routes_need_the_api_key(server):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        response = httpx.post(server.base_url + path, json={"lora_name": "x", "lora_path": "qv"})
        assert response.status_code == 401


def test_serve_with_lora_modules(lora_root, model_path, tmp_path):
    """The real command line: adapters from --lora-modules, no runtime updates unless asked."""
    root, _ = lora_root
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with ServedProcess(["serve", model_path, "--port", str(port), "--served-model-name",
                        MODEL_NAME, "--kv-cache-memory", "64MiB", "--max-model-len", "512",
                        "--lora-modules", f"qv={root / 'qv'}",
                        f'{{"name": "mlp", "path": "{root / "mlp"}"}}'],
                       tmp_path / "serve.log", base_url):
        data = httpx.get(base_url + "/v1/models").json()["data"]
        assert [card["id"] for card in data] == [MODEL_NAME, "qv", "mlp"]
        response = httpx.post(base_url + "/v1/completions", timeout=120, json={
            "model": "mlp", "prompt": PROMPT, "max_tokens": 4})
        assert response.status_code == 200 and response.json()["model"] == "mlp"
        assert httpx.post(base_url + "/v1/load_lora_adapter",
                          json={"lora_name": "x", "lora_path": "qv"}).status_code == 404
