"""One real server for the in-process entrypoint tests: the default model behind AsyncLLM and
uvicorn in a background thread, on a free loopback port, with an API key.

Shared by the modules of this directory (loading the model is most of their run time); on
teardown it must hold no request and no KV block.
"""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.utils import (
    API_KEY,
    MAX_BODY_BYTES,
    MAX_MODEL_LEN,
    MODEL_NAME,
    serving,
)
from tests.shared_engines import SUITE_ACTIVATION_QUANTIZATION


@pytest.fixture(scope="package")
def server(model_path, tokenizer):
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.openai.api_server import ServerConfig, build_app
    from pagedserve.metrics import PrometheusStatLogger

    # int16 activations (tests/shared_engines.py): the modules compare answers to the same
    # prompt, and whether a request finds its prefix cached (so which kernel computes its last
    # tokens) depends on which modules ran before on this worker
    config = EngineArgs(model=model_path, dtype="float32", kv_cache_memory="256MiB",
                        max_model_len=MAX_MODEL_LEN,
                        activation_quantization=SUITE_ACTIVATION_QUANTIZATION,
                        ).create_engine_config()
    stat_logger = PrometheusStatLogger(MODEL_NAME, max_model_len=MAX_MODEL_LEN)
    async_llm = AsyncLLM(LLMEngine(config, tokenizer=tokenizer), [stat_logger])
    server_config = ServerConfig(served_model_name=MODEL_NAME, api_key=API_KEY,
                                 max_request_body_bytes=MAX_BODY_BYTES, log_level="warning")
    app = build_app(async_llm, server_config)
    with serving(app, async_llm, stat_logger) as handle:
        yield handle
        handle.wait_until_idle()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on the server (a module's own `server` fixture wins)."""
    return server.openai()


@pytest.fixture(scope="module")
def http(server):
    """Plain HTTP with the API key, for what the openai client cannot send."""
    with httpx.Client(base_url=server.base_url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http_client:
        yield http_client
