"""The server's profiler routes (vLLM's POST /start_profile and /stop_profile) and its OTLP
tracer: one span per finished request to --otlp-traces-endpoint.

build_app calls add_profiler_routes and attach_request_tracer (over the server's TimelineStore);
everything else about profiling lives in the engine (LLMEngine.start_profile), about spans in
observability/tracing.py.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.responses import JSONResponse, Response

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.errors import bad_request
from pagedserve.observability.timeline import TimelineStore


def add_profiler_routes(app: FastAPI, async_llm: AsyncLLM) -> None:
    """POST /start_profile and /stop_profile, only when the engine has a profiler directory
    (--profiler-dir or VLLM_TORCH_PROFILER_DIR; otherwise they are 404s). Starting twice or
    stopping a profiler that is not running is a 400; requests go on meanwhile."""
    if async_llm.engine.config.profiler is None:
        return

    @app.post("/start_profile")
    async def start_profile() -> Response:
        try:
            await async_llm.start_profile()
        except ValueError as error:
            raise bad_request(str(error)) from None
        return Response(status_code=200)

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        """Writing the traces takes a while (seconds per thousand steps); the engine's steps
        wait meanwhile."""
        try:
            paths = await async_llm.stop_profile()
        except ValueError as error:
            raise bad_request(str(error)) from None
        return JSONResponse({"traces": paths})


def attach_request_tracer(timelines: TimelineStore, endpoint: str, model_name: str):
    """Export a span per request that `timelines` sees finish to `endpoint`
    (observability/tracing.py). Returns the tracer (call its shutdown() to flush at exit);
    ValueError if OpenTelemetry is missing."""
    from pagedserve.observability.tracing import attach_tracer

    return attach_tracer(timelines, endpoint, model_name)
