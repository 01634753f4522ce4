"""Responses passed through from a worker: the upstream's error type, the watch for a client
that leaves (which closes the upstream request, so the worker aborts the generation and frees its
KV), and the event stream relayed event by event. Knows nothing of the pool or the policies.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.entrypoints.openai.errors import APIError


class UpstreamError(APIError):
    """A worker failed (502) or none is there (503)."""

    def __init__(self, message: str, code: str = "upstream_error", status_code: int = 502) -> None:
        super().__init__(status_code, message, code=code)


async def until_disconnect(receive: Receive, work: Awaitable[Any]) -> Any:
    """Await `work`, unless the client disconnects first: then cancel it (which closes its
    upstream requests) and return None. The request body must have been read."""
    work = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        # The body has been read, so the next message is http.disconnect.
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(wait_for_disconnect())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
    return None if work.cancelled() else work.result()


def sse_error(error: APIError) -> bytes:
    return f"data: {json.dumps(error.body())}\n\n".encode()


def _end_of_last_event(data: bytes) -> int:
    """The offset just past the last complete SSE event in `data` (0 if none)."""
    ends = [index + len(separator) for separator in (b"\n\n", b"\r\n\r\n")
            if (index := data.rfind(separator)) >= 0]
    return max(ends, default=0)


class ProxiedStream(StreamingResponse):
    """A worker's event stream relayed event by event (each as soon as its blank line arrives),
    so that a worker dying mid-stream leaves no half event: the client gets one error event
    instead, and `on_error` is called. When either side ends, the upstream is closed and
    `on_close` called (exactly once)."""

    def __init__(self, upstream: httpx.Response, worker_label: str,
                 on_error: Callable[[Exception], None], on_close: Callable[[], None]) -> None:
        super().__init__(self._events(), status_code=upstream.status_code,
                         media_type=upstream.headers.get("content-type", "text/event-stream"),
                         headers={"Cache-Control": "no-cache"})
        self.upstream = upstream
        self.worker_label = worker_label
        self.on_error = on_error
        self.on_close = on_close

    async def _events(self) -> AsyncIterator[bytes]:
        pending = b""
        try:
            async for chunk in self.upstream.aiter_bytes():
                pending += chunk
                end = _end_of_last_event(pending)
                if end:
                    yield pending[:end]
                    pending = pending[end:]
        except httpx.TransportError as error:
            self.on_error(error)
            yield sse_error(UpstreamError(f"worker {self.worker_label} failed mid-stream",
                                          code="upstream_stream_error"))
            return
        if pending:
            yield pending

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(receive, self.stream_response(send))
        except OSError:
            pass  # the client went away in the middle of a send
        finally:
            try:
                await self.upstream.aclose()
            finally:
                self.on_close()
