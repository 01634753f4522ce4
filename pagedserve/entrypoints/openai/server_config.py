"""The HTTP server's configuration: `ServerConfig` (frozen, checked before the model loads) and
the `serve` flags that fill it (`add_cli_args`; the engine's own flags come from EngineArgs)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from pagedserve.engine.arg_utils import EngineArgs, parse_size
from pagedserve.entrypoints import vllm_flags
from pagedserve.entrypoints.openai.frontend_options import FrontendOptions, load_chat_template
from pagedserve.entrypoints.openai.serving_lora import (
    LoRAModule,
    parse_lora_module,
    runtime_updates_from_env,
)
from pagedserve.entrypoints.openai.serving_responses import (
    DEFAULT_STORE_SIZE as DEFAULT_RESPONSES_STORE_SIZE,
)
from pagedserve.models.loader import DEFAULT_MODEL
from pagedserve.observability.timeline import DEFAULT_HISTORY as DEFAULT_TIMELINE_HISTORY
from pagedserve.pooling_params import POOLING_TYPES, PoolingParams
from pagedserve.router.config import POLICY_NAMES


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
