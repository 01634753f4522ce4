"""--generation-config (vLLM's semantics) and --strict-requests: the defaults loaded from a
generation_config.json, and one server over a tiny random HF model that runs with both (auto
defaults from the model's folder, unknown fields refused)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from pagedserve.entrypoints.openai.request_fields import GenerationDefaults
from tests.engine.tiny_models import write_tiny_llama
from tests.entrypoints.utils import API_KEY, serving

PROMPT = list(range(100, 120))  # token ids: the tiny model's vocabulary is 512
GENERATION_CONFIG = {"temperature": 0.0, "top_k": 50, "top_p": 1.0, "max_new_tokens": 3,
                     "repetition_penalty": 1.1, "do_sample": True}


def write_generation_config(folder, config: dict) -> None:
    (folder / "generation_config.json").write_text(json.dumps(config))


# ---- loading the defaults ---------------------------------------------------------------------


def test_auto_reads_the_models_file_and_keeps_only_recommendations(tmp_path):
    write_generation_config(tmp_path, GENERATION_CONFIG)
    defaults = GenerationDefaults.load("auto", str(tmp_path))
    # top_k 50 and top_p 1.0 are transformers' own defaults, not the model creator's choice.
    assert defaults.as_dict() == {"temperature": 0.0, "repetition_penalty": 1.1, "max_tokens": 3}
    assert GenerationDefaults.load("vllm", str(tmp_path)).as_dict() == {}


def test_auto_is_a_no_op_without_a_file_and_for_a_gguf(tmp_path, model_path):
    assert GenerationDefaults.load("auto", str(tmp_path)).as_dict() == {}
    assert GenerationDefaults.load("auto", model_path).as_dict() == {}  # the default GGUF


def test_a_folder_path_is_read_and_must_hold_the_file(tmp_path):
    write_generation_config(tmp_path, {"top_p": 0.5, "min_p": 0.1})
    assert GenerationDefaults.load(str(tmp_path), "unused").as_dict() == {"top_p": 0.5,
                                                                           "min_p": 0.1}
    with pytest.raises(ValueError, match="generation_config.json"):
        GenerationDefaults.load(str(tmp_path / "missing"), "unused")


@pytest.mark.parametrize("config", [{"temperature": -1}, {"top_p": 2.0}, {"max_new_tokens": 0},
                                    {"top_k": "many"}, []])
def test_invalid_values_fail_at_start_up(tmp_path, config):
    write_generation_config(tmp_path, config)
    with pytest.raises(ValueError, match="generation_config.json"):
        GenerationDefaults.load("auto", str(tmp_path))


def test_the_flags_reach_the_server_config():
    import argparse

    from pagedserve.entrypoints.openai.api_server import ServerConfig, add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    config = ServerConfig.from_cli_args(parser.parse_args([]))
    assert (config.generation_config, config.strict_requests) == ("auto", False)
    config = ServerConfig.from_cli_args(parser.parse_args(["--generation-config", "vllm",
                                                           "--strict-requests"]))
    assert (config.generation_config, config.strict_requests) == ("vllm", True)


# ---- one strict server over a tiny model with a generation_config.json -------------------------


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tokenizer):
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.openai.api_server import ServerConfig, build_app

    folder = tmp_path_factory.mktemp("tiny-generation-config")
    write_tiny_llama(folder, tokenizer, seed=0)
    write_generation_config(folder, GENERATION_CONFIG)
    config = EngineArgs(model=str(folder), dtype="float32",
                        kv_cache_memory="16MiB").create_engine_config()
    async_llm = AsyncLLM(LLMEngine(config))
    app = build_app(async_llm, ServerConfig(served_model_name="tiny", api_key=API_KEY,
                                            strict_requests=True, log_level="warning"))
    with serving(app, async_llm) as handle:
        yield handle


@pytest.fixture
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client
        tiny_server.wait_until_idle()


def complete(http, **body) -> dict:
    response = http.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True,
                                                  "return_token_ids": True, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_model_defaults_apply_and_request_values_override_them(http):
    defaulted = complete(http)
    assert defaulted["usage"]["completion_tokens"] == 3  # max_new_tokens, not OpenAI's 16
    assert complete(http, max_tokens=5)["usage"]["completion_tokens"] == 5
    # temperature 0 and repetition_penalty 1.1 by default: the output is the explicit greedy
    # one with that penalty, and an explicit penalty of 1 (off) is honoured over the default.
    explicit = complete(http, temperature=0, repetition_penalty=1.1, max_tokens=3)
    assert defaulted["choices"][0]["token_ids"] == explicit["choices"][0]["token_ids"]
    # The unpenalized greedy output of this prompt repeats its first token (81, measured), so
    # the default penalty changes it: the default acted, and an explicit 1.0 turns it off.
    prompt = [81] + PROMPT
    penalized = complete(http, prompt=prompt)["choices"][0]["token_ids"]
    unpenalized = complete(http, prompt=prompt, repetition_penalty=1.0)["choices"][0]["token_ids"]
    assert unpenalized[0] == 81 and penalized[0] != 81
    assert unpenalized == complete(http, prompt=prompt, temperature=0,
                                   repetition_penalty=1.0)["choices"][0]["token_ids"]


def test_strict_requests_refuse_unknown_fields_naming_them(http, caplog):
    caplog.set_level(logging.WARNING)
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1,
                                                  "frobnicate": True,
                                                  "stream_options": {"x": 1}, "stream": True})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "frobnicate"
    assert "frobnicate" in error["message"] and "stream_options.x" in error["message"]
    # vLLM's known fields pass, and the server keeps serving.
    assert complete(http, max_tokens=1, allowed_token_ids=[5], truncate_prompt_tokens=4,
                    guided_decoding_backend="auto")["usage"]["prompt_tokens"] == 4
    # A bad word the tokenizer spells with ids past this tiny model's 512 is a 400, not a crash.
    response = http.post("/v1/completions", json={"prompt": PROMPT, "bad_words": ["zebra"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "bad_words"
    assert complete(http, max_tokens=1)["usage"]["completion_tokens"] == 1
    assert not [r for r in caplog.records if "frobnicate" in r.getMessage()]
