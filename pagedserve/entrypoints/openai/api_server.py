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
import os
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
from pagedserve.engine.arg_utils import EngineArgs, parse_size
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.llm_engine import EngineBusyError, LLMEngine
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
from pagedserve.entrypoints.openai.frontend_options import FrontendOptions, load_chat_template
from pagedserve.entrypoints.openai.generation import EventStream
from pagedserve.entrypoints.openai.observability_routes import (
    add_profiler_routes,
    attach_request_tracer,
)
from pagedserve.entrypoints.openai.request_fields import GenerationDefaults
from pagedserve.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from pagedserve.entrypoints.openai.serving import OpenAIServing
from pagedserve.entrypoints.openai.serving_embeddings import EmbeddingServing
from pagedserve.entrypoints.openai.serving_lora import (
    LoRAModule,
    LoRAServing,
    parse_lora_module,
    runtime_updates_from_env,
)
from pagedserve.entrypoints.openai.serving_responses import (
    DEFAULT_STORE_SIZE as DEFAULT_RESPONSES_STORE_SIZE,
)
from pagedserve.entrypoints.openai.serving_responses import ResponsesRequest, ResponsesServing
from pagedserve.entrypoints.openai.debug_routes import MemoryGauges, add_debug_routes
from pagedserve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pagedserve.metrics import LoggingStatLogger, PrometheusStatLogger
from pagedserve.models.loader import DEFAULT_MODEL
from pagedserve.observability.live_stats import LiveStats
from pagedserve.observability.startup import log_listening
from pagedserve.observability.timeline import DEFAULT_HISTORY as DEFAULT_TIMELINE_HISTORY
from pagedserve.observability.timeline import TimelineStore
from pagedserve.pooling_params import POOLING_TYPES, PoolingParams
from pagedserve.router.config import POLICY_NAMES

logger = logging.getLogger(__name__)

_UNAUTHENTICATED_PATHS = frozenset({"/health", "/load", DASHBOARD_PATH})
"""Polled by load balancers and the data-parallel router, which hold no key; the dashboard page
(no data in it: its own calls send the key)."""
_CONNECTION_CLOSE_TIMEOUT = 5.0
"""Seconds uvicorn waits for open connections after the engine has drained."""
_MAX_DISCARDED_BODY_BYTES = 64 << 20
"""An over-limit body is read and dropped up to this size (so the client sees the 413)."""

RequestT = TypeVar("RequestT", bound=BaseModel)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = DEFAULT_MODEL
    """The model's name in /v1/models and metrics; requests may use it (or omit it), or one of
    frontend.served_model_aliases."""
    api_key: str | None = None
    """If set, every route but /health and /load needs `Authorization: Bearer <api_key>`."""
    max_num_waiting: int = 512
    """New generation requests get 503 while this many requests wait in the engine's queue."""
    max_request_body_bytes: int = 8 << 20
    shutdown_timeout: float = 30.0
    """On SIGTERM, seconds running requests get to finish before the rest are aborted."""
    log_level: str = "info"
    lora_modules: tuple[LoRAModule, ...] = ()
    """LoRA adapters loaded at start-up, each served under its name (entrypoints/openai/
    serving_lora.py)."""
    lora_dir: str | None = None
    """The directory runtime adapter loads must come from."""
    enable_lora_runtime_updates: bool = False
    """Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    timeline_history: int = DEFAULT_TIMELINE_HISTORY
    """Finished requests whose timelines GET /v1/requests/{id}/timeline still answers."""
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE
    """Responses /v1/responses keeps for previous_response_id and GET (least recently used
    dropped first)."""
    otlp_traces_endpoint: str | None = None
    """Export an OpenTelemetry span per finished request here (OTLP/HTTP protobuf)."""
    frontend: FrontendOptions = FrontendOptions()
    """The chat template, logprobs cap and token spelling (frontend_options.py)."""
    enable_log_requests: bool = False
    """Log each request's route and JSON body at INFO (vLLM: off by default too)."""
    max_log_len: int | None = None
    """Characters of a logged body (None: all)."""
    root_path: str = ""
    """The prefix a path-routing proxy in front strips (ASGI's root_path, set by uvicorn):
    requests arrive without it, links and the OpenAPI schema carry it."""
    cors_allowed_origins: tuple[str, ...] | None = None
    """CORS is on exactly when this is set (vLLM's default is every origin; ours is off)."""
    cors_allowed_methods: tuple[str, ...] = ("*",)
    cors_allowed_headers: tuple[str, ...] = ("*",)
    cors_allow_credentials: bool = False
    ssl_keyfile: str | None = None
    """With ssl_certfile: serve HTTPS."""
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    """Client certificates: 0 none, 1 optional, 2 required (the ssl module's CERT_*)."""
    uvicorn_log_level: str | None = None
    """uvicorn's own log level; None: log_level."""
    disable_uvicorn_access_log: bool = False
    disable_fastapi_docs: bool = False
    """No /docs, /redoc and /openapi.json."""
    strict_requests: bool = False
    """Unknown request fields are a 400 naming them (default: a warning once per name)."""
    generation_config: str = "auto"
    """Sampling defaults: `auto` (the model's generation_config.json), `vllm` (none), or a
    folder holding a generation_config.json (request_fields.GenerationDefaults)."""
    pooling_type: str = "last"
    """How /v1/embeddings pools the final hidden states: "last" (token) or "mean"."""

    def __post_init__(self) -> None:
        if self.max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be >= 0, got {self.max_num_waiting}")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be >= 1")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
        if self.timeline_history < 1:
            raise ValueError(f"--timeline-history must be >= 1, got {self.timeline_history}")
        if self.responses_store_size < 1:
            raise ValueError("--responses-store-size must be >= 1, got "
                             f"{self.responses_store_size}")
        if self.enable_lora_runtime_updates and self.lora_dir is None:
            raise ValueError("--enable-lora-runtime-updates needs --lora-dir: the one directory "
                             "adapters may be loaded from at run time")
        PoolingParams(self.pooling_type)  # ValueError for an unknown type, before any load
        if self.otlp_traces_endpoint is not None:
            from pagedserve.observability.tracing import check_endpoint

            check_endpoint(self.otlp_traces_endpoint)  # before the model loads
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"--{name.replace('_', '-')} {path!r}: no such file")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"--root-path must start with / and not end with one, got "
                             f"{self.root_path!r}")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerConfig:
        names = args.served_model_name or [model_arg(args)]
        return cls(
            host=args.host,
            port=args.port,
            served_model_name=names[0],
            api_key=args.api_key,
            max_num_waiting=args.max_num_waiting,
            max_request_body_bytes=args.max_request_body_bytes,
            shutdown_timeout=args.shutdown_timeout,
            log_level=args.log_level,
            lora_modules=tuple(parse_lora_module(v) for v in args.lora_modules or ()),
            lora_dir=args.lora_dir,
            enable_lora_runtime_updates=(args.enable_lora_runtime_updates
                                         or runtime_updates_from_env()),
            timeline_history=args.timeline_history,
            responses_store_size=args.responses_store_size,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            frontend=FrontendOptions(
                served_model_aliases=tuple(names[1:]),
                chat_template=load_chat_template(args.chat_template),
                trust_request_chat_template=args.trust_request_chat_template,
                default_chat_template_kwargs=args.default_chat_template_kwargs or {},
                max_logprobs=args.max_logprobs,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            ),
            enable_log_requests=args.enable_log_requests and not args.disable_log_requests,
            max_log_len=args.max_log_len,
            root_path=args.root_path or "",
            cors_allowed_origins=(tuple(args.allowed_origins)
                                  if args.allowed_origins is not None else None),
            cors_allowed_methods=tuple(args.allowed_methods),
            cors_allowed_headers=tuple(args.allowed_headers),
            cors_allow_credentials=args.allow_credentials,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
            uvicorn_log_level=args.uvicorn_log_level,
            disable_uvicorn_access_log=args.disable_uvicorn_access_log,
            disable_fastapi_docs=args.disable_fastapi_docs,
            strict_requests=args.strict_requests,
            generation_config=args.generation_config,
            pooling_type=args.pooling_type,
        )


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
    engine = LLMEngine.from_engine_args(engine_args)
    engine.warm_up()  # before the server listens: /health is 200 only once it is done
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


def model_arg(args: argparse.Namespace) -> str:
    """The model to serve: the positional MODEL, else --model."""
    return getattr(args, "model_tag", None) or args.model


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`[MODEL]`, the engine's flags, and the server's."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help=f"a short model name, GGUF file or HF directory ({DEFAULT_MODEL}); "
                             "wins over --model, as in vLLM")
    EngineArgs.add_cli_args(parser)  # --model among them
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=ServerConfig.host)
    group.add_argument("--port", type=int, default=ServerConfig.port)
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model's names for clients; the first is the one /v1/models "
                            "lists (default: MODEL as given)")
    group.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on every route but /health "
                            "and /load (default: $PAGEDSERVE_API_KEY)")
    group.add_argument("--max-num-waiting", type=int, default=ServerConfig.max_num_waiting,
                       help="answer 503 while this many requests wait for the engine")
    group.add_argument("--max-request-body-bytes", type=parse_size,
                       default=ServerConfig.max_request_body_bytes, help="e.g. 8MiB; larger: 413")
    group.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout,
                       help="seconds running requests get to finish after SIGTERM")
    group.add_argument("--headless", action="store_true",
                       help="run only this node's workers of a multi-node engine (node 1 and "
                            "later: --nnodes, --node-rank, --master-addr, --master-port); no API")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine replicas (processes, each its own KV pool) behind this "
                            "server, which routes each request to one of them")
    group.add_argument("--dp-policy", choices=POLICY_NAMES, default="cache_aware",
                       help="how a replica is picked (with -dp > 1); cache_aware: the one "
                            "holding the longest prefix of the prompt, unless load is uneven")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) to serve, each under its name as "
                            "`model`; also vLLM's JSON form {\"name\": ..., \"path\": ...}; "
                            "implies --enable-lora")
    group.add_argument("--lora-dir", default=None,
                       help="the only directory /v1/load_lora_adapter may load from")
    group.add_argument("--enable-lora-runtime-updates", action="store_true",
                       help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true); needs --lora-dir")
    group.add_argument("--timeline-history", type=int, default=ServerConfig.timeline_history,
                       help="finished requests whose timelines GET /v1/requests/{id}/timeline "
                            "keeps (a ring; live requests are always kept)")
    group.add_argument("--responses-store-size", type=int,
                       default=ServerConfig.responses_store_size,
                       help="responses /v1/responses keeps for previous_response_id and GET "
                            "/v1/responses/{id} (the least recently used are dropped)")
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="export an OpenTelemetry span per finished request over OTLP/HTTP, "
                            "e.g. http://localhost:4318/v1/traces (needs pagedserve[otlp])")
    group.add_argument("--strict-requests", action="store_true",
                       help="refuse (400) requests with fields the server does not know; "
                            "default: serve them and log each unknown name once")
    group.add_argument("--generation-config", default=ServerConfig.generation_config,
                       metavar="auto|vllm|FOLDER",
                       help="sampling defaults for fields a request leaves out: 'auto' reads "
                            "the model's generation_config.json, 'vllm' ignores it, or a folder "
                            "holding one (vLLM's flag)")
    group.add_argument("--pooling-type", choices=POOLING_TYPES, default=ServerConfig.pooling_type,
                       help="how /v1/embeddings pools the final hidden states: the last "
                            "token's (vLLM's default for decoder models) or their mean")
    group.add_argument("--log-level", default=ServerConfig.log_level,
                       choices=["critical", "error", "warning", "info", "debug"])
    group.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic 'Engine 000: Avg prompt throughput ...' log line")
    group.add_argument("--log-stats-interval", type=float, default=10.0,
                       help="seconds between those lines (10)")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each request's route and JSON body at INFO")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="the default; wins over --enable-log-requests (vLLM's older flag)")
    group.add_argument("--max-log-len", type=int, default=None,
                       help="characters of a logged request body (default: all)")
    group.add_argument("--uvicorn-log-level", default=None,
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (default: --log-level)")
    group.add_argument("--disable-uvicorn-access-log", action="store_true")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="no /docs, /redoc, /openapi.json")
    group.add_argument("--distributed-executor-backend", choices=["mp", "uni"], default=None,
                       help="vLLM's; pagedserve always runs its own worker processes")
    _add_http_args(parser.add_argument_group("HTTP: path, CORS, TLS"))
    _add_chat_args(parser.add_argument_group("chat and logprobs"))
    vllm_flags.add_ignored_args(parser)


def _json_string_list(value: str) -> list[str]:
    """vLLM's form of --allowed-origins & co: a JSON list of strings."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not a JSON list: {value!r}") from None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {value!r}")
    return items


def _json_object(value: str) -> dict:
    try:
        obj = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not a JSON object: {value!r}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {value!r}")
    return obj


def _add_http_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--root-path", default=None,
                       help="the path prefix a path-routing proxy in front strips, e.g. /llm")
    group.add_argument("--allowed-origins", type=_json_string_list, default=None,
                       help='CORS, off unless given: a JSON list, e.g. \'["https://app.example"]\' '
                            "or '[\"*\"]'")
    group.add_argument("--allowed-methods", type=_json_string_list,
                       default=list(ServerConfig.cors_allowed_methods), help='CORS (["*"])')
    group.add_argument("--allowed-headers", type=_json_string_list,
                       default=list(ServerConfig.cors_allowed_headers), help='CORS (["*"])')
    group.add_argument("--allow-credentials", action="store_true", help="CORS")
    group.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key ...")
    group.add_argument("--ssl-certfile", default=None, help="... and this certificate")
    group.add_argument("--ssl-ca-certs", default=None, help="CA certificates for clients")
    group.add_argument("--ssl-cert-reqs", type=int, default=0,
                       help="client certificates: 0 none, 1 optional, 2 required")


def _add_chat_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--chat-template", default=None,
                       help="a Jinja file, or the template inline, replacing the model's")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="render a request's own chat_template (else: 400)")
    group.add_argument("--default-chat-template-kwargs", type=_json_object, default=None,
                       help='JSON object passed to every render, e.g. \'{"enable_thinking": '
                            "false}'; a request's chat_template_kwargs win")
    group.add_argument("--max-logprobs", type=int, default=FrontendOptions.max_logprobs,
                       help="most logprobs / top_logprobs a request may ask for")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprob tokens read token_id:N")


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
