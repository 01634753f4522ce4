"""The server runs the real Gemma-3-270M GGUF with the chat template we ship for it (its file
has none), driven by the official openai client."""

from __future__ import annotations

import pytest

from tests.entrypoints.utils import API_KEY, serving

GEMMA3_NAME = "gemma3-270m"


@pytest.fixture(scope="module")
def server():
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.openai.api_server import ServerConfig, build_app
    from pagedserve.models.loader import resolve_model_path

    try:
        resolve_model_path(GEMMA3_NAME)
    except ValueError as e:  # its packages are not installed
        pytest.skip(str(e))
    config = EngineArgs(model=GEMMA3_NAME, kv_cache_memory="64MiB",
                        max_model_len=1024).create_engine_config()
    async_llm = AsyncLLM(LLMEngine(config))
    app = build_app(async_llm, ServerConfig(served_model_name=GEMMA3_NAME, api_key=API_KEY,
                                            log_level="warning"))
    with serving(app, async_llm) as handle:
        yield handle
        handle.wait_until_idle()


@pytest.mark.slow
def test_gemma3_chat_uses_its_template(server):
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What colour is the sky on a clear day?"}]
    response = server.openai().chat.completions.create(
        model=GEMMA3_NAME, messages=messages, max_tokens=8, temperature=0)
    # The prompt is Gemma's turns, as the engine's tokenizer renders and encodes them.
    tokenizer = server.async_llm.engine.tokenizer
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.startswith("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat colour")
    assert rendered.endswith("<end_of_turn>\n<start_of_turn>model\n")
    assert response.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content.strip()
    assert "<end_of_turn>" not in choice.message.content
