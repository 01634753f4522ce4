"""The HTTP server: FastAPI routes over OpenAIServing, a gate in front of them (API key, drain,
declared body size), responses that abort generation the moment the client disconnects, and the
uvicorn runner whose first SIGTERM drains the engine before the process exits.

`pagedserve serve` calls add_cli_args() and run_server(); `python -m` runs main().
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.routing import get_route_path
from starlette.types import ASGIApp, Receive, Scope, Send

import pagedserve
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.async_llm import AsyncLLM, load_engine
from pagedserve.engine.llm_engine import EngineBusyError
from pagedserve.executor import ExecutorError
from pagedserve.executor.multiproc import run_headless
from pagedserve.entrypoints import vllm_flags
from pagedserve.entrypoints.openai import protocol as p
from pagedserve.entrypoints.openai.auth import check_api_key, header
from pagedserve.entrypoints.openai.dashboard import DASHBOARD_PATH, add_dashboard_routes
from pagedserve.entrypoints.openai.errors import (
    APIError,
    add_exception_handlers,
    bad_request,
    from_validation_error,
)
from pagedserve.entrypoints.openai.generation import EventStream
from pagedserve.entrypoints.openai.observability_routes import (
    add_profiler_routes,
    attach_request_tracer,
)
from pagedserve.entrypoints.openai.request_fields import GenerationDefaults
from pagedserve.entrypoints.openai.server_config import ServerConfig, add_cli_args, model_arg
from pagedserve.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from pagedserve.entrypoints.openai.serving import OpenAIServing
from pagedserve.entrypoints.openai.serving_embeddings import EmbeddingServing
from pagedserve.entrypoints.openai.serving_lora import LoRAServing
from pagedserve.entrypoints.openai.serving_responses import ResponsesRequest, ResponsesServing
from pagedserve.entrypoints.openai.debug_routes import MemoryGauges, add_debug_routes
from pagedserve.logging_stat_logger import LoggingStatLogger
from pagedserve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pagedserve.metrics import PrometheusStatLogger
from pagedserve.observability.live_stats import LiveStats
from pagedserve.observability.startup import log_listening
from pagedserve.observability.timeline import TimelineStore

logger = logging.getLogger(__name__)

_UNAUTHENTICATED_PATHS = frozenset({"/health", "/load", DASHBOARD_PATH})
"""Polled by load balancers and the data-parallel router, which hold no key; the dashboard page
(no data in it: its own calls send the key)."""
_CONNECTION_CLOSE_TIMEOUT = 5.0
"""Seconds uvicorn waits for open connections after the engine has drained."""
_MAX_DISCARDED_BODY_BYTES = 64 << 20
"""An over-limit body is read and dropped up to this size (so the client sees the 413)."""

RequestT = TypeVar("RequestT", bound=BaseModel)


@dataclass
class ServerState:
    """What changes while the server runs. Tests may swap `config` on a live app."""

    config: ServerConfig
    draining: bool = False


# ---- the gate: runs before routing ------------------------------------------------------------


class _RequestGate:
    """Rejects a request before any route runs: bad or missing API key (401), server draining
    (503), declared body over the limit (413)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check(scope)
        if error is None:
            await self.app(scope, receive, send)
            return
        if error.status_code == 413:
            # NOTE: an HTTP/1.1 client sends the whole body before reading the response; closing
            # on it would turn the 413 into a connection reset.
            await _discard_body(receive)
        headers = {"WWW-Authenticate": "Bearer"} if error.status_code == 401 else None
        await error.response(headers)(scope, receive, send)

    def _check(self, scope: Scope) -> APIError | None:
        config, path = self.state.config, get_route_path(scope)  # without --root-path's prefix
        if config.api_key is not None and path not in _UNAUTHENTICATED_PATHS:
            error = check_api_key(scope, config.api_key)
            if error is not None:
                return error
        if self.state.draining and path not in ("/health", "/load", "/metrics"):
            return APIError(503, "the server is shutting down", code="shutting_down")
        content_length = header(scope, b"content-length")
        if content_length is not None:
            if not content_length.isdigit():
                return bad_request("invalid Content-Length header")
            if int(content_length) > config.max_request_body_bytes:
                return _body_too_large(config.max_request_body_bytes)
        return None


def _body_too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than the server's limit of {limit} bytes",
                    code="request_too_large")


async def _discard_body(receive: Receive) -> None:
    num_bytes = 0
    while num_bytes <= _MAX_DISCARDED_BODY_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        num_bytes += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


# ---- disconnects ------------------------------------------------------------------------------


class _Disconnected:
    """Returned by _until_disconnect when the client left first."""


_DISCONNECTED = _Disconnected()


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body has been read, so the next message the server sends is http.disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(receive: Receive, awaitable: Awaitable[Any]) -> Any:
    """Await `awaitable`, unless the client disconnects first: then cancel it (which aborts its
    engine requests at once) and return _DISCONNECTED."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        work_was_done = work.done()
        if not work_was_done:
            work.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
    if not work_was_done:
        return _DISCONNECTED
    return work.result()


class _EventStreamResponse(StreamingResponse):
    """Server-sent events that stop (and abort the engine requests) as soon as the client
    disconnects, and always close their EventStream."""

    media_type = "text/event-stream"

    def __init__(self, events: EventStream) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _until_disconnect(receive, self.stream_response(send))
        except OSError:
            pass  # the client went away in the middle of a send
        finally:
            await self.events.aclose()


# ---- the app ----------------------------------------------------------------------------------


def build_app(
    async_llm: AsyncLLM,
    args: ServerConfig | argparse.Namespace,
    stat_logger: PrometheusStatLogger | None = None,
    timelines: TimelineStore | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `async_llm` (which the caller owns and shuts down).

    `stat_logger`: whose registry /metrics serves; default, the PrometheusStatLogger among
    `async_llm.stat_loggers`, else prometheus_client's global registry.
    `timelines`: the store the timeline routes read; default, a new one subscribed to the
    engine's events.
    """
    config = args if isinstance(args, ServerConfig) else ServerConfig.from_cli_args(args)
    if stat_logger is None:
        stat_logger = next((s for s in async_llm.stat_loggers
                            if isinstance(s, PrometheusStatLogger)), None)
    lora = (LoRAServing(async_llm, config.served_model_name, config.lora_dir)
            if async_llm.engine.lora_registry is not None else None)
    if timelines is None:
        timelines = TimelineStore(config.timeline_history)
        async_llm.engine.events.subscribe(timelines.on_events)
    generation_defaults = GenerationDefaults.load(config.generation_config,
                                                  async_llm.engine.config.model_path)
    generation_defaults.log(config.generation_config)
    serving = OpenAIServing(async_llm, config.served_model_name, lora, timelines,
                            config.frontend, strict_requests=config.strict_requests,
                            generation_defaults=generation_defaults)
    state = ServerState(config)
    docs = {} if not config.disable_fastapi_docs else {"docs_url": None, "redoc_url": None,
                                                        "openapi_url": None}
    app = FastAPI(title="pagedserve", version=pagedserve.__version__, **docs)
    app.state.server = state
    app.state.lora = lora
    app.state.timelines = timelines
    app.add_middleware(_RequestGate, state=state)
    if config.cors_allowed_origins is not None:
        # Added after the gate, so it runs first: a browser's preflight carries no API key.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_allowed_origins),
                           allow_methods=list(config.cors_allowed_methods),
                           allow_headers=list(config.cors_allowed_headers),
                           allow_credentials=config.cors_allow_credentials)
    add_exception_handlers(app)

    async def read_request(raw_request: Request, model: type[RequestT]) -> RequestT:
        data = await _read_json(raw_request, state.config.max_request_body_bytes)
        if state.config.enable_log_requests and isinstance(data, dict):
            _log_request(raw_request, data, state.config.max_log_len)
        try:
            return model.model_validate(data)
        except ValidationError as error:
            raise from_validation_error(error) from None

    def check_capacity() -> None:
        num_waiting = async_llm.num_waiting_requests()
        if num_waiting >= state.config.max_num_waiting:
            raise APIError(503, f"the server is overloaded ({num_waiting} requests waiting); "
                           "retry later", code="overloaded")

    async def respond(raw_request: Request, work: Awaitable[BaseModel | EventStream]) -> Response:
        result = await _until_disconnect(raw_request.receive, work)
        if result is _DISCONNECTED:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed"
        if isinstance(result, EventStream):
            return _EventStreamResponse(result)
        return Response(result.model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        if async_llm.errored:  # 503: a load balancer takes this replica out at once
            raise APIError(503, "the engine has failed", code="engine_dead")
        if state.draining or async_llm.is_draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        return Response(status_code=200)

    @app.get("/load")
    async def load() -> dict:
        """What the data-parallel router weighs when it picks a replica."""
        stats = async_llm.get_stats()
        return {"num_running": stats.num_running_reqs, "num_waiting": stats.num_waiting_reqs,
                "kv_cache_usage": stats.kv_cache_usage}

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedserve.__version__}

    memory_gauges = (MemoryGauges(config.served_model_name, stat_logger.registry)
                     if stat_logger is not None else None)

    @app.get("/metrics")
    async def metrics() -> Response:
        if stat_logger is not None:
            await memory_gauges.refresh(async_llm)
            return Response(stat_logger.render(), media_type=METRICS_CONTENT_TYPE)
        return Response(prometheus_client.generate_latest(),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return Response(serving.models().model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        return Response(serving.model_card(model_id).model_dump_json(),
                        media_type="application/json")

    if lora is not None and config.enable_lora_runtime_updates:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(raw_request: Request) -> Response:
            request = await read_request(raw_request, p.LoadLoRAAdapterRequest)
            await lora.load(request.lora_name, request.lora_path)
            return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.",
                            media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(raw_request: Request) -> Response:
            request = await read_request(raw_request, p.UnloadLoRAAdapterRequest)
            await lora.unload(request.lora_name)
            return Response(f"Success: LoRA adapter '{request.lora_name}' removed "
                            f"successfully.", media_type="text/plain")

    @app.post("/v1/completions")
    async def create_completion(raw_request: Request) -> Response:
        check_capacity()
        request = await read_request(raw_request, p.CompletionRequest)
        return await respond(raw_request, serving.create_completion(request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request) -> Response:
        check_capacity()
        request = await read_request(raw_request, p.ChatCompletionRequest)
        return await respond(raw_request, serving.create_chat_completion(request))

    embeddings = EmbeddingServing(serving, config.pooling_type)
    app.state.embeddings = embeddings

    @app.post("/v1/embeddings")
    async def create_embedding(raw_request: Request) -> Response:
        check_capacity()
        request = await read_request(raw_request, EmbeddingRequest)
        return await respond(raw_request, embeddings.create_embedding(request))

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> Response:
        request = await read_request(raw_request, p.TokenizeRequest)
        return await respond(raw_request, serving.tokenize(request))

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> Response:
        request = await read_request(raw_request, p.DetokenizeRequest)
        return await respond(raw_request, serving.detokenize(request))

    responses = ResponsesServing(serving, config.responses_store_size)

    @app.post("/v1/responses")
    async def create_response(raw_request: Request) -> Response:
        check_capacity()
        request = await read_request(raw_request, ResponsesRequest)
        return await respond(raw_request, responses.create_response(request))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return Response(responses.retrieve(response_id).model_dump_json(),
                        media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return Response(responses.delete(response_id).model_dump_json(),
                        media_type="application/json")

    _add_lifecycle_routes(app, async_llm, read_request)
    add_dashboard_routes(app, async_llm)  # its LiveStats: the one among async_llm.stat_loggers
    add_debug_routes(app, async_llm, timelines)
    add_profiler_routes(app, async_llm)
    app.state.tracer = (attach_request_tracer(timelines, config.otlp_traces_endpoint,
                                              config.served_model_name)
                        if config.otlp_traces_endpoint else None)
    return app


def _add_lifecycle_routes(app: FastAPI, async_llm: AsyncLLM,
                          read_request: Callable[..., Awaitable[BaseModel]]) -> None:
    """Admin routes (vLLM's and SGLang's names), behind the API key like every other route.
    Each needs an idle engine: 400 `engine_busy` while requests are in flight (the caller drains
    or aborts them first; nothing waits). /sleep, /wake_up and /is_sleeping exist only with
    --enable-sleep-mode; while asleep, generation requests get 503 `engine_sleeping`."""

    async def lifecycle_call(call: Awaitable[Any]) -> Any:
        try:
            return await call
        except EngineBusyError as error:
            raise APIError(400, str(error), code="engine_busy") from None
        except ValueError as error:
            raise bad_request(str(error)) from None

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not await async_llm.reset_prefix_cache():
            raise APIError(400, "cannot reset the prefix cache while requests hold KV blocks",
                           code="engine_busy")
        return Response(status_code=200)

    async def update_weights(raw_request: Request) -> Response:
        request = await read_request(raw_request, p.UpdateWeightsRequest)
        await lifecycle_call(async_llm.update_weights(request.model_path))
        response = p.UpdateWeightsResponse(
            success=True, message=f"serving the weights of {request.model_path}")
        return Response(response.model_dump_json(), media_type="application/json")

    app.post("/update_weights")(update_weights)
    app.post("/update_weights_from_disk")(update_weights)  # SGLang's name for the same call

    if not async_llm.engine.config.enable_sleep_mode:
        return

    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        await lifecycle_call(async_llm.sleep(level))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up() -> Response:
        await lifecycle_call(async_llm.wake_up())
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": async_llm.is_sleeping}


def _log_request(raw_request: Request, body: dict, max_log_len: int | None) -> None:
    text = json.dumps(body, ensure_ascii=False)
    if max_log_len is not None and len(text) > max_log_len:
        text = text[:max_log_len] + "..."
    logger.info("request %s %s: %s", raw_request.method, raw_request.url.path, text)


async def _read_json(raw_request: Request, max_num_bytes: int) -> dict:
    """The body as a JSON object; the limit also holds for bodies without a Content-Length."""
    body = bytearray()
    num_bytes = 0
    try:
        async for chunk in raw_request.stream():
            num_bytes += len(chunk)
            if num_bytes > max_num_bytes:
                if num_bytes > _MAX_DISCARDED_BODY_BYTES:
                    break
                continue  # keep reading (and dropping) so that the client gets the 413
            body += chunk
    except ClientDisconnect:
        raise bad_request("the client disconnected while sending the body") from None
    if num_bytes > max_num_bytes:
        raise _body_too_large(max_num_bytes)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


# ---- running ----------------------------------------------------------------------------------


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM/SIGINT runs `drain` and only then exits
    (the listener stays open meanwhile, so new requests get a 503, not a refused connection).
    A second signal exits at once, without waiting for open connections."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None  # a reference keeps the task alive
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            log_listening(f"http://{self.config.host}:{self.config.port}")

    def handle_exit(self, sig: int, frame) -> None:
        # NOTE: this runs inside a signal handler, between two bytecodes of the loop's thread.
        if self._loop is None or not self.started:
            super().handle_exit(sig, frame)  # still starting: uvicorn's own behaviour
        elif self._drain_requested:
            self.should_exit = self.force_exit = True
        else:
            self._drain_requested = True
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True


class _QuietForcedExit(logging.Filter):
    """A second Ctrl-C exits at once: the tasks still running when the event loop closes (the
    ASGI lifespan's, a response still streaming) are cancelled, and uvicorn logs each
    cancellation as an error with its traceback (the lifespan's as text starlette formatted).
    Expected after a forced exit, so dropped: the drain's log line has said what was cut short.
    Installed for the rest of the process, since that happens after serve() returns."""

    def __init__(self, server: uvicorn.Server) -> None:
        super().__init__()
        self._server = server

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._server.force_exit:
            return True
        if record.exc_info is not None and isinstance(record.exc_info[1],
                                                      asyncio.CancelledError):
            return False
        message = record.getMessage()
        return not (message.startswith("Traceback")
                    and message.rstrip().endswith("CancelledError"))


def uvicorn_config(app: FastAPI, config: ServerConfig) -> uvicorn.Config:
    """The listener: address, TLS, root path, uvicorn's logging."""
    return uvicorn.Config(
        app, host=config.host, port=config.port, root_path=config.root_path,
        log_level=config.uvicorn_log_level or config.log_level,
        access_log=not config.disable_uvicorn_access_log,
        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
        ssl_ca_certs=config.ssl_ca_certs, ssl_cert_reqs=config.ssl_cert_reqs,
        timeout_graceful_shutdown=_CONNECTION_CLOSE_TIMEOUT)


async def serve_app(app: FastAPI, async_llm: AsyncLLM, config: ServerConfig) -> bool:
    """Serve until SIGTERM/SIGINT, drain the engine, then stop it. Returns False if a second
    signal cut the drain short."""
    state: ServerState = app.state.server
    drained = False

    async def drain() -> None:
        nonlocal drained
        state.draining = True
        logger.info("shutting down: %d requests get up to %.0f s to finish",
                    async_llm.num_unfinished_requests(), config.shutdown_timeout)
        await async_llm.shutdown(drain_timeout=config.shutdown_timeout)
        drained = True

    lora: LoRAServing | None = app.state.lora
    try:
        for module in config.lora_modules:  # start-up adapters: the operator's own paths
            if lora is None:
                raise ValueError("--lora-modules needs --enable-lora")
            try:
                await lora.load(module.name, module.path, module.base_model_name, confine=False)
            except APIError as error:
                raise ValueError(f"--lora-modules {module.name}: {error.message}") from None
    except BaseException:
        await async_llm.shutdown(drain_timeout=0)
        raise
    server = _DrainingServer(uvicorn_config(app, config), drain)

    async def exit_when_engine_dies() -> None:
        while not async_llm.errored:
            await asyncio.sleep(0.1)
        # A grace period: open streams get their error event, health checks see the 503.
        logger.error("the engine failed: the server exits in %.0f s", ENGINE_DEAD_EXIT_DELAY_S)
        await asyncio.sleep(ENGINE_DEAD_EXIT_DELAY_S)
        server.should_exit = True

    watchdog = asyncio.create_task(exit_when_engine_dies())
    logging.getLogger("uvicorn.error").addFilter(_QuietForcedExit(server))
    try:
        await server.serve()
    finally:
        watchdog.cancel()
        if not drained:
            # Forced exit (or a failed start): abort everything and stop the engine thread.
            state.draining = True
            await async_llm.shutdown(drain_timeout=0)
        if app.state.tracer is not None:  # every request has finished: export their spans
            await asyncio.to_thread(app.state.tracer.shutdown)
    return not server.force_exit and not async_llm.errored


ENGINE_DEAD_EXIT_DELAY_S = 2.0
"""After the engine fails (a worker died), the server answers 503 this long, then exits 1."""


def run_server(args: argparse.Namespace) -> int:
    """Load the engine named by `args` and serve it; returns the exit code."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    vllm_flags.warn_ignored(args)
    args.model = model_arg(args)  # the CLI's edge: the rest reads args.model
    if args.data_parallel_size != 1:
        from pagedserve.entrypoints.data_parallel import run_data_parallel

        return run_data_parallel(args)
    engine_args = EngineArgs.from_cli_args(args)
    if args.lora_modules or args.enable_lora_runtime_updates:
        engine_args.enable_lora = True
    if args.headless:
        return run_headless(engine_args.create_parallel_config())
    config = ServerConfig.from_cli_args(args)
    log_stats = [] if args.disable_log_stats else [LoggingStatLogger(args.log_stats_interval)]
    # Loaded and warmed up (before the server listens: /health is 200 only once it is done) in a
    # thread of its own: this one must run no torch parallel region (see load_engine).
    engine = load_engine(engine_args)
    speculative = engine.config.speculative
    stat_logger = PrometheusStatLogger(
        config.served_model_name, max_model_len=engine.config.scheduler.max_model_len,
        num_speculative_tokens=speculative.num_speculative_tokens if speculative else None)
    async_llm = AsyncLLM(engine, [stat_logger, LiveStats(), *log_stats])
    app = build_app(async_llm, config, stat_logger)
    # As vLLM does: the hundreds of thousands of objects alive after start-up (the model's
    # modules, the tokenizer) live as long as the server, so take them out of the cyclic
    # collector's full passes, which each step's short-lived objects would otherwise trigger
    # over and over (measured: about 2% of a batch-1 decode step).
    gc.collect()
    gc.freeze()
    clean = asyncio.run(serve_app(app, async_llm, config))
    return 0 if clean else 1


def main(argv: list[str] | None = None) -> int:
    parser = vllm_flags.OneLineErrorParser(prog="pagedserve serve", allow_abbrev=False,
                                           description="An OpenAI-compatible HTTP server.")
    add_cli_args(parser)
    args = vllm_flags.parse_args_or_exit(parser, argv)
    try:
        return run_server(args)
    except (ValueError, ExecutorError) as error:  # bad flags, or workers that failed to start
        print(f"pagedserve serve: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
