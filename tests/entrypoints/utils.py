"""Constants and helpers shared by the entrypoint tests and their conftest."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tests.processes import free_port

API_KEY = "test-key"
MODEL_NAME = "smollm2-135m"
MAX_MODEL_LEN = 2048
MAX_BODY_BYTES = 1 << 20


@dataclass
class ServerHandle:
    base_url: str
    """http://127.0.0.1:PORT (the OpenAI client's base_url is base_url + "/v1")."""
    app: object
    async_llm: object
    stat_logger: object

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=API_KEY, **kwargs)

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=API_KEY, **kwargs)

    def wait_until_idle(self, timeout: float = 10.0) -> None:
        """Wait for the engine to hold no request, then check that every block is free."""
        deadline = time.monotonic() + timeout
        while self.async_llm.num_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.async_llm.num_unfinished_requests() == 0, "requests still in the engine"
        self.async_llm.check_idle()


@contextlib.contextmanager
def serving(app, async_llm, stat_logger=None) -> Iterator[ServerHandle]:
    """`app` under uvicorn in a background thread on a free loopback port; on exit the server
    stops and `async_llm` shuts down (aborting whatever still runs)."""
    import uvicorn

    port = free_port()
    try:
        with uvicorn_thread(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning")):
            yield ServerHandle(f"http://127.0.0.1:{port}", app, async_llm, stat_logger)
    finally:
        asyncio.run(async_llm.shutdown(drain_timeout=0))


@contextlib.contextmanager
def uvicorn_thread(config) -> Iterator[None]:
    """uvicorn with `config` (a uvicorn.Config) in a background thread, listening on entry,
    stopped and joined on exit."""
    import uvicorn

    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive()
