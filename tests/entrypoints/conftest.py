"""One real server for the in-process entrypoint tests: the default model behind AsyncLLM and
uvicorn in a background thread, on a free loopback port, with an API key.

Shared by the modules of this directory (loading the model is most of their run time); on
teardown it must hold no request and no KV block.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.entrypoints.utils import (
    API_KEY,
    MAX_BODY_BYTES,
    MAX_MODEL_LEN,
    MODEL_NAME,
    ServerHandle,
    free_port,
)


@pytest.fixture(scope="package")
def server(model_path, tokenizer):
    import uvicorn

    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.openai.api_server import ServerConfig, build_app
    from pagedserve.metrics import PrometheusStatLogger

    config = EngineArgs(model=model_path, dtype="float32", kv_cache_memory="256MiB",
                        max_model_len=MAX_MODEL_LEN).create_engine_config()
    stat_logger = PrometheusStatLogger(MODEL_NAME, max_model_len=MAX_MODEL_LEN)
    async_llm = AsyncLLM(LLMEngine(config, tokenizer=tokenizer), [stat_logger])
    server_config = ServerConfig(served_model_name=MODEL_NAME, api_key=API_KEY,
                                 max_request_body_bytes=MAX_BODY_BYTES, log_level="warning")
    app = build_app(async_llm, server_config)
    port = free_port()
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                   log_level="warning"))
    thread = threading.Thread(target=uvicorn_server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uvicorn_server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    handle = ServerHandle(f"http://127.0.0.1:{port}", app, async_llm, stat_logger)
    try:
        yield handle
        handle.wait_until_idle()
    finally:
        uvicorn_server.should_exit = True
        thread.join(timeout=30)
        asyncio.run(async_llm.shutdown(drain_timeout=0))
