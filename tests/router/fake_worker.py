"""A fake OpenAI-compatible worker for the router's tests, and ServerThread, which serves any ASGI
app with uvicorn on a loopback port in a thread (stop() joins it).

    with FakeWorker("a") as worker:              # answers "from a"
        worker.gate_open = False                 # completions now wait until it is True again
        ... worker.requests, worker.num_disconnects

Its behaviour attributes may be changed while it runs; what it saw is read from the test thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tests.processes import free_port


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:`port` in a daemon thread with its own event loop;
    `after_serve` (a coroutine function) runs in that loop once the server has stopped."""

    def __init__(self, app: Any, port: int | None = None,
                 after_serve: Callable[[], Awaitable[None]] | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                   log_level="critical",
                                                   timeout_graceful_shutdown=5))
        self.after_serve = after_serve
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            await self.server.serve()
        finally:
            if self.after_serve is not None:
                await self.after_serve()

    def start(self, timeout_s: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float = 20.0) -> Any:
        """Run `coroutine` in the server's event loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 20.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the server on port {self.port} did not stop"


class _Die(Exception):
    """Raised mid-stream: uvicorn then closes the connection without ending the response."""


@dataclass
class ReceivedRequest:
    path: str
    body: dict
    headers: dict[str, str]


class FakeWorker:
    """Answers completions and chat (stream or not) with its name, /v1/models, /health, /load
    and /metrics; counts requests and the clients that left before the answer was complete."""

    def __init__(self, name: str, port: int | None = None) -> None:
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # behaviour
        self.fail_status: int | None = None
        """Answer completions with this status (and an OpenAI-style error body)."""
        self.gate_open = True
        """While False, completions wait (before answering) until it opens or the client leaves."""
        self.num_chunks = 3
        self.chunk_interval_s = 0.0
        self.die_after_chunks: int | None = None
        """Close the connection mid-stream after this many events."""
        self.health_status = 200
        self.load: dict | None = None
        """GET /load's JSON; None: 404, like a server without /load."""
        self.metrics_text: str | None = None
        """GET /metrics's text; None: 404."""
        self.timelines: dict[str, dict] = {}
        """Request id -> what GET /v1/requests/{id}/timeline answers (and /v1/requests lists)."""
        # what it saw
        self.requests: list[ReceivedRequest] = []
        self.num_disconnects = 0
        self.num_health_checks = 0
        self._server: ServerThread | None = None

    def start(self) -> FakeWorker:
        self._server = ServerThread(self._build_app(), self.port).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> FakeWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            self.num_health_checks += 1
            return Response(status_code=self.health_status)

        @app.get("/load")
        async def load() -> Response:
            if self.load is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse(self.load)

        @app.get("/metrics")
        async def metrics() -> Response:
            if self.metrics_text is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return PlainTextResponse(self.metrics_text)

        @app.get("/v1/requests/{request_id}/timeline")
        async def timeline(request_id: str) -> Response:
            if request_id not in self.timelines:
                return JSONResponse({"error": {"message": "no timeline"}}, status_code=404)
            return JSONResponse(self.timelines[request_id])

        @app.get("/v1/requests")
        async def recent_requests(limit: int = 50) -> dict:
            return {"object": "list", "data": list(self.timelines.values())[:limit]}

        @app.get("/debug/memory")
        async def memory() -> dict:
            return {"object": "memory.breakdown", "components": {"kv_pool": self.port}}

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "fake", "object": "model",
                                                "owned_by": self.name}]}

        @app.get("/version")
        async def version() -> dict:
            return {"version": self.name}

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict:
            body = await request.json()
            self.requests.append(ReceivedRequest(request.url.path, body, dict(request.headers)))
            return {"tokens": [len(body.get("prompt", ""))], "worker": self.name}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._generate(request)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self._generate(request)

        return app

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(ReceivedRequest(request.url.path, body, dict(request.headers)))
        if self.fail_status is not None:
            return JSONResponse({"error": {"message": f"{self.name} fails", "type": "server_error",
                                           "param": None, "code": None}},
                                status_code=self.fail_status)
        while not self.gate_open:
            if await request.is_disconnected():
                self.num_disconnects += 1
                return Response(status_code=499)
            await asyncio.sleep(0.01)
        chat = request.url.path.endswith("/chat/completions")
        if body.get("stream"):
            return StreamingResponse(self._events(chat), media_type="text/event-stream")
        text = f"from {self.name}"
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text})
        return JSONResponse({"id": "fake", "object": "chat.completion" if chat else
                             "text_completion", "model": "fake", "worker": self.name,
                             "choices": [{**choice, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                       "total_tokens": 2}})

    async def _events(self, chat: bool) -> AsyncIterator[str]:
        finished = False
        try:
            for index in range(self.num_chunks):
                if index == self.die_after_chunks:
                    finished = True  # it dies; the client did not leave
                    raise _Die()
                delta = f"{self.name}:{index}"
                choice = {"index": 0, "delta": {"content": delta}} if chat else {"index": 0,
                                                                                  "text": delta}
                yield f"data: {json.dumps({'worker': self.name, 'choices': [choice]})}\n\n"
                if self.chunk_interval_s:
                    await asyncio.sleep(self.chunk_interval_s)
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self.num_disconnects += 1
