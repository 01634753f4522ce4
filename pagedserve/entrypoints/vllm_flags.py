"""vLLM's `vllm serve` flags and what `pagedserve serve` does with each: the one table.

SAME and MAPPED flags are registered by their owners (EngineArgs, server_config.add_cli_args);
IGNORED ones are registered here, accepted and logged once at start-up; UNSUPPORTED ones (and
flags nobody knows) end the command with one line naming the flag, exit code 2.
docs/vllm_compatibility.md holds this table as rendered by `render_markdown()`; a test keeps them
equal (regenerate: `python -m pagedserve.entrypoints.vllm_flags`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from enum import Enum

logger = logging.getLogger(__name__)

DOCS_PATH = "docs/vllm_compatibility.md"


class Support(Enum):
    SAME = "same"
    """Accepted, and does what vLLM's does."""
    MAPPED = "mapped"
    """Accepted; does the nearest thing pagedserve has (the note says what)."""
    IGNORED = "accepted, ignored"
    """Accepted so that vLLM command lines run; has no effect here (the note says why)."""
    UNSUPPORTED = "unsupported"
    """Refused with a one-line error."""


@dataclass(frozen=True)
class VLLMFlag:
    name: str
    """The long spelling, e.g. "--max-model-len"."""
    support: Support
    note: str = ""
    """What pagedserve does with it (the docs table's last column)."""
    example: tuple[str, ...] = ()
    """Value(s) a test passes after the flag; () for a switch. Also shapes an IGNORED flag:
    a switch (with its --no- form) or one value."""
    short: str | None = None
    """vLLM's short form, e.g. "-tp"."""


_S, _M, _I, _U = Support.SAME, Support.MAPPED, Support.IGNORED, Support.UNSUPPORTED

VLLM_SERVE_FLAGS: tuple[VLLMFlag, ...] = (
    # ---- the model ----
    VLLMFlag("--model", _S, "also the positional MODEL (which wins); a short name, a GGUF file "
             "or an HF directory", ("smollm2-135m",)),
    VLLMFlag("--served-model-name", _S, "one or more names; requests may use any, /v1/models "
             "lists each, metrics carry the first", ("a", "b")),
    VLLMFlag("--tokenizer", _M, "must name the model itself (the tokenizer is read from the "
             "model's GGUF file or directory); anything else is an error", ("smollm2-135m",)),
    VLLMFlag("--dtype", _M, "auto (the default): bfloat16 on cuda and on CPUs with AVX512-BF16 "
             "or AMX-BF16, else float32; float and float32: float32; half and float16: float16 "
             "(cuda only)", ("float32",)),
    VLLMFlag("--seed", _S, "seeds the engine's sampling stream", ("1",)),
    VLLMFlag("--max-model-len", _S, "default: the model's context; 4096, 32k or 32K as in "
             "vLLM", ("32k",)),
    VLLMFlag("--quantization", _M, "auto (GGUF weights kept packed), none, int4, int8 "
             "(quantize on load); gguf means auto; vLLM's GPU methods (awq, gptq, fp8, ...) "
             "are refused", ("int8",), short="-q"),
    VLLMFlag("--trust-remote-code", _I, "pagedserve never runs code shipped with a model; its "
             "architectures are built in"),
    VLLMFlag("--enforce-eager", _S, "cuda: no CUDA graphs, every step eager (the CPU "
             "captures none)"),
    VLLMFlag("--cuda-graph-sizes", _S, "cuda: the step sizes (tokens) captured; default 1 2 4 "
             "8 16 ... up to min(2 x max-num-seqs, 512)", ("1", "2", "4", "8")),
    VLLMFlag("--max-logprobs", _M, "a request asking for more (logprobs, top_logprobs) gets a "
             "400; at most 20 (the engine's cap), default 20", ("5",)),
    VLLMFlag("--enable-sleep-mode", _S, "POST /sleep, /wake_up, GET /is_sleeping"),
    VLLMFlag("--device", _S, "cpu, or cuda", ("cpu",)),
    VLLMFlag("--disable-cascade-attn", _I, "pagedserve has no cascade attention"),
    VLLMFlag("--max-seq-len-to-capture", _I, "CUDA graphs serve every sequence length "
             "(attention reads the paged cache in place)", ("8192",)),
    VLLMFlag("--task", _U, "pagedserve serves generation models only"),
    VLLMFlag("--runner", _U, "pagedserve serves generation models only"),
    VLLMFlag("--tokenizer-mode", _U, "one tokenizer implementation (HF tokenizers)"),
    VLLMFlag("--revision", _U, "pagedserve does not download models"),
    VLLMFlag("--code-revision", _U, "pagedserve does not download models"),
    VLLMFlag("--tokenizer-revision", _U, "pagedserve does not download models"),
    VLLMFlag("--download-dir", _U, "pagedserve does not download models"),
    VLLMFlag("--hf-token", _U, "pagedserve does not download models"),
    VLLMFlag("--load-format", _U, "GGUF and safetensors are detected from the files"),
    VLLMFlag("--config-format", _U, "the format is detected from the files"),
    VLLMFlag("--hf-config-path", _U, ""),
    VLLMFlag("--hf-overrides", _U, ""),
    VLLMFlag("--model-impl", _U, "one implementation per architecture"),
    VLLMFlag("--skip-tokenizer-init", _U, ""),
    VLLMFlag("--enable-prompt-embeds", _U, ""),
    VLLMFlag("--logprobs-mode", _U, "logprobs are always of the processed distribution"),
    VLLMFlag("--disable-sliding-window", _U, ""),
    VLLMFlag("--logits-processors", _U, "loading code by name is not supported"),
    VLLMFlag("--override-pooler-config", _U, ""),
    VLLMFlag("--pooler-config", _U, ""),
    VLLMFlag("--limit-mm-per-prompt", _U, "text-only models"),
    VLLMFlag("--mm-processor-kwargs", _U, "text-only models"),
    VLLMFlag("--allowed-local-media-path", _U, "text-only models"),
    VLLMFlag("--reasoning-parser", _U, ""),
    VLLMFlag("--structured-outputs-config", _U, "structured outputs always use llguidance"),
    VLLMFlag("--guided-decoding-backend", _I, "structured outputs always use llguidance",
             ("xgrammar",)),
    VLLMFlag("--compilation-config", _U, "no torch.compile on the CPU path", short="-O"),
    VLLMFlag("--additional-config", _U, ""),
    # ---- memory and KV cache ----
    VLLMFlag("--kv-cache-memory-bytes", _S, "the KV pool's size; also our --kv-cache-memory, "
             "which takes sizes like 4GiB (default 2GiB)", ("64MiB",)),
    VLLMFlag("--gpu-memory-utilization", _M, "on cuda: the pool gets this fraction of device "
             "memory minus what the weights take (an explicit --kv-cache-memory-bytes wins); on "
             "the CPU: ignored with a warning (size the pool with --kv-cache-memory-bytes)",
             ("0.5",)),
    VLLMFlag("--block-size", _S, "tokens per KV block (a power of two; default 16)", ("32",)),
    VLLMFlag("--kv-cache-dtype", _M, "auto (the compute dtype; fp16 on an fp32 CPU engine), "
             "fp32, fp16, int8, fp8 (e4m3; fp8_e4m3 is the same)", ("fp8_e4m3",)),
    VLLMFlag("--num-gpu-blocks-override", _S, "fixes the block count", ("64",)),
    VLLMFlag("--enable-prefix-caching", _S, "default on; --no-enable-prefix-caching"),
    VLLMFlag("--disable-hybrid-kv-cache-manager", _S, "one block table for every layer: "
             "windowed layers keep every block (so it is with KV tiers and pipeline stages)"),
    VLLMFlag("--prefix-caching-hash-algo", _I, "one block hash (see core/block_hash.py)",
             ("sha256",)),
    VLLMFlag("--swap-space", _I, "a preempted request recomputes its KV; there is no device "
             "memory to swap out of", ("4",)),
    VLLMFlag("--cpu-offload-gb", _U, "the weights live in host memory already"),
    VLLMFlag("--calculate-kv-scales", _U, "fp8/int8 KV scales are computed per block"),
    VLLMFlag("--kv-offloading-size", _U, "use --kv-transfer-config's tiers"),
    VLLMFlag("--kv-offloading-backend", _U, "use --kv-transfer-config's tiers"),
    VLLMFlag("--kv-transfer-config", _M, "pagedserve's KV tiers (DiskConnector, ...) in vLLM's "
             "keys", ('{"kv_connector": "DiskConnector", '
                      '"kv_connector_extra_config": {"path": "/tmp/kv"}}',)),
    VLLMFlag("--kv-events-config", _U, ""),
    # ---- scheduling ----
    VLLMFlag("--max-num-seqs", _S, "default 256", ("8",)),
    VLLMFlag("--max-num-batched-tokens", _S, "default 2048", ("512",)),
    VLLMFlag("--enable-chunked-prefill", _S, "default on; --no-enable-chunked-prefill"),
    VLLMFlag("--long-prefill-token-threshold", _S, "", ("256",)),
    VLLMFlag("--scheduling-policy", _I, "a request's priority always orders the queue (equal "
             "priorities: first come, first served)", ("priority",)),
    VLLMFlag("--max-num-partial-prefills", _U, ""),
    VLLMFlag("--max-long-partial-prefills", _U, ""),
    VLLMFlag("--async-scheduling", _S, "schedules step N + 1 while step N runs on the device, "
             "the same tokens; default on for cuda, off on the CPU (no overlap there); refused "
             "with speculative decoding, tensor or pipeline parallelism, or KV tiers"),
    VLLMFlag("--scheduler-cls", _U, "loading code by name is not supported"),
    VLLMFlag("--speculative-config", _S, "ngram and draft_model methods (JSON)",
             ('{"method": "ngram", "num_speculative_tokens": 2}',)),
    # ---- parallelism ----
    VLLMFlag("--tensor-parallel-size", _S, "processes on this machine (or --nnodes)", ("1",),
             short="-tp"),
    VLLMFlag("--pipeline-parallel-size", _S, "", ("1",), short="-pp"),
    VLLMFlag("--data-parallel-size", _S, "engine replicas behind one server", ("1",),
             short="-dp"),
    VLLMFlag("--distributed-executor-backend", _M, "mp and uni: pagedserve's processes (one "
             "process when -tp and -pp are 1); ray is refused", ("mp",)),
    VLLMFlag("--nnodes", _S, "", ("1",)),
    VLLMFlag("--node-rank", _S, "", ("0",)),
    VLLMFlag("--master-addr", _S, "", ("127.0.0.1",)),
    VLLMFlag("--master-port", _S, "", ("0",)),
    VLLMFlag("--headless", _S, "workers of a multi-node engine, no API"),
    VLLMFlag("--disable-custom-all-reduce", _I, "collectives are torch.distributed's (gloo on "
             "the CPU)"),
    VLLMFlag("--max-parallel-loading-workers", _I, "each rank loads its own shard", ("2",)),
    VLLMFlag("--enable-expert-parallel", _U, ""),
    VLLMFlag("--data-parallel-rank", _U, ""),
    VLLMFlag("--data-parallel-address", _U, ""),
    VLLMFlag("--data-parallel-rpc-port", _U, ""),
    VLLMFlag("--data-parallel-backend", _U, ""),
    VLLMFlag("--api-server-count", _U, "one API server process"),
    VLLMFlag("--worker-cls", _U, "loading code by name is not supported"),
    VLLMFlag("--ray-workers-use-nsight", _U, ""),
    # ---- LoRA ----
    VLLMFlag("--enable-lora", _S, ""),
    VLLMFlag("--max-loras", _S, "", ("2",)),
    VLLMFlag("--max-lora-rank", _S, "", ("8",)),
    VLLMFlag("--max-cpu-loras", _S, "", ("2",)),
    VLLMFlag("--lora-modules", _S, "name=path or vLLM's JSON; implies --enable-lora",
             ("adapter=/tmp/adapter",)),
    VLLMFlag("--lora-dtype", _U, ""),
    VLLMFlag("--fully-sharded-loras", _U, ""),
    VLLMFlag("--enable-lora-bias", _U, ""),
    # ---- the HTTP server ----
    VLLMFlag("--host", _S, "default 127.0.0.1 (vLLM: all interfaces)", ("127.0.0.1",)),
    VLLMFlag("--port", _S, "", ("8001",)),
    VLLMFlag("--api-key", _M, "one key (vLLM takes several); also $PAGEDSERVE_API_KEY",
             ("k",)),
    VLLMFlag("--root-path", _S, "FastAPI's root_path, behind a path-routing proxy", ("/llm",)),
    VLLMFlag("--allowed-origins", _M, "JSON list; CORS is off unless this is given (vLLM "
             'allows every origin by default)', ('["http://localhost:3000"]',)),
    VLLMFlag("--allowed-methods", _S, 'JSON list (default ["*"])', ('["GET", "POST"]',)),
    VLLMFlag("--allowed-headers", _S, 'JSON list (default ["*"])', ('["Authorization"]',)),
    VLLMFlag("--allow-credentials", _S, ""),
    VLLMFlag("--ssl-keyfile", _S, "serves HTTPS with --ssl-certfile", ("/tmp/key.pem",)),
    VLLMFlag("--ssl-certfile", _S, "", ("/tmp/cert.pem",)),
    VLLMFlag("--ssl-ca-certs", _S, "", ("/tmp/ca.pem",)),
    VLLMFlag("--ssl-cert-reqs", _S, "0: no client certificate, 1: optional, 2: required",
             ("0",)),
    VLLMFlag("--enable-ssl-refresh", _U, ""),
    VLLMFlag("--ssl-ciphers", _U, ""),
    VLLMFlag("--uvicorn-log-level", _S, "default: --log-level", ("warning",)),
    VLLMFlag("--disable-uvicorn-access-log", _S, ""),
    VLLMFlag("--disable-fastapi-docs", _S, "no /docs, /redoc, /openapi.json"),
    VLLMFlag("--uds", _U, ""),
    VLLMFlag("--middleware", _U, "loading code by name is not supported"),
    VLLMFlag("--enable-request-id-headers", _U, ""),
    VLLMFlag("--disable-frontend-multiprocessing", _I, "the server and the engine share one "
             "process"),
    VLLMFlag("--h11-max-incomplete-event-size", _U, ""),
    VLLMFlag("--h11-max-header-count", _U, ""),
    VLLMFlag("--config", _U, "pass the flags themselves"),
    # ---- chat and responses ----
    VLLMFlag("--chat-template", _S, "a file, or the template inline; sandboxed like the "
             "model's", ("{{ messages[0]['content'] }}",)),
    VLLMFlag("--trust-request-chat-template", _S, "without it, a request's own chat_template "
             "gets a 400"),
    VLLMFlag("--default-chat-template-kwargs", _S, "JSON object; a request's "
             "chat_template_kwargs win", ('{"enable_thinking": false}',)),
    VLLMFlag("--chat-template-content-format", _U, "message content is always rendered as a "
             "string"),
    VLLMFlag("--response-role", _U, ""),
    VLLMFlag("--return-tokens-as-token-ids", _S, "logprob tokens read token_id:N"),
    VLLMFlag("--generation-config", _S, "auto (default): the model's generation_config.json "
             "sampling defaults (an HF directory's; none for GGUF); vllm: none; or a folder "
             "holding one. Request values win", ("vllm",)),
    VLLMFlag("--enable-auto-tool-choice", _I, 'tool_choice "auto" is always available'),
    VLLMFlag("--tool-call-parser", _I, "tool calls are always parsed from Hermes-style "
             "<tool_call> blocks, which the prompt asks for", ("hermes",)),
    VLLMFlag("--tool-parser-plugin", _U, "loading code by name is not supported"),
    VLLMFlag("--exclude-tools-when-tool-choice-none", _U, ""),
    VLLMFlag("--tool-server", _U, ""),
    VLLMFlag("--enable-prompt-tokens-details", _I, "usage.prompt_tokens_details.cached_tokens "
             "is always returned"),
    VLLMFlag("--enable-force-include-usage", _U, ""),
    VLLMFlag("--enable-server-load-tracking", _U, "GET /load serves the load"),
    VLLMFlag("--enable-tokenizer-info-endpoint", _U, ""),
    # ---- logging and metrics ----
    VLLMFlag("--disable-log-stats", _S, "no periodic throughput line"),
    VLLMFlag("--enable-log-requests", _M, "logs each request's route and JSON body at INFO "
             "(off by default, as in vLLM)"),
    VLLMFlag("--disable-log-requests", _S, "the default already (vLLM's older spelling)"),
    VLLMFlag("--max-log-len", _S, "characters of a logged request body", ("200",)),
    VLLMFlag("--enable-log-outputs", _U, ""),
    VLLMFlag("--log-config-file", _U, ""),
    VLLMFlag("--otlp-traces-endpoint", _S, "needs pagedserve[otlp]",
             ("http://localhost:4318/v1/traces",)),
    VLLMFlag("--collect-detailed-traces", _U, ""),
    VLLMFlag("--show-hidden-metrics-for-version", _U, ""),
)

_BY_NAME = {flag.name: flag for flag in VLLM_SERVE_FLAGS}
_BY_NAME.update({flag.short: flag for flag in VLLM_SERVE_FLAGS if flag.short})


def lookup(option: str) -> VLLMFlag | None:
    """The vLLM flag `option` spells ("--x", "--x=1", "--no-x", or a short form), or None."""
    name = option.split("=", 1)[0]
    flag = _BY_NAME.get(name)
    if flag is None and name.startswith("--no-"):
        flag = _BY_NAME.get("--" + name[len("--no-"):])
    return flag


# ---- accepted, ignored --------------------------------------------------------------------------


def _ignored_dest(flag: VLLMFlag) -> str:
    return "vllm_ignored_" + flag.name[2:].replace("-", "_")


def add_ignored_args(parser: argparse.ArgumentParser) -> None:
    """Register the IGNORED flags, so that vLLM command lines parse (warn_ignored reports them)."""
    group = parser.add_argument_group("vLLM flags accepted and ignored",
                                      f"see {DOCS_PATH}")
    for flag in VLLM_SERVE_FLAGS:
        if flag.support is not Support.IGNORED:
            continue
        names = [flag.name] + ([flag.short] if flag.short else [])
        if flag.example:
            group.add_argument(*names, dest=_ignored_dest(flag), default=None,
                               help=argparse.SUPPRESS)
        else:
            group.add_argument(*names, dest=_ignored_dest(flag), default=None,
                               action=argparse.BooleanOptionalAction, help=argparse.SUPPRESS)


def warn_ignored(args: argparse.Namespace) -> list[str]:
    """Log one warning per IGNORED flag given; returns their names."""
    given = []
    for flag in VLLM_SERVE_FLAGS:
        if flag.support is Support.IGNORED and getattr(args, _ignored_dest(flag), None) is not None:
            logger.warning("vLLM flag %s is accepted and ignored: %s", flag.name, flag.note)
            given.append(flag.name)
    return given


# ---- refused ------------------------------------------------------------------------------------


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump); subcommands inherit it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_args_or_exit(parser: argparse.ArgumentParser, argv: list[str] | None
                       ) -> argparse.Namespace:
    """parse_args, except that an argument no parser took ends the command with one line
    naming it (a vLLM flag pagedserve lacks says so), exit code 2."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        prog = parser.prog
        command = getattr(args, "command", None)
        if command:
            prog = f"{prog} {command}"
        parser.exit(2, unknown_argument_message(prog, extras) + "\n")
    return args


def unknown_argument_message(prog: str, extras: list[str]) -> str:
    """One line for the first argument the parser did not take: a vLLM flag pagedserve lacks,
    a flag nobody knows, or a stray value."""
    option = next((arg for arg in extras if arg.startswith("-") and arg != "-"), None)
    if option is None:
        return f"{prog}: error: unexpected argument {extras[0]!r}"
    name = option.split("=", 1)[0]
    flag = lookup(option)
    if flag is not None:
        return f"{prog}: vLLM flag {name} is not supported by pagedserve (see {DOCS_PATH})"
    return f"{prog}: error: unknown flag {name} (see {prog} --help)"


# ---- the docs table -----------------------------------------------------------------------------

TABLE_BEGIN = "<!-- BEGIN vllm_flags table: generated by python -m pagedserve.entrypoints.vllm_flags -->"
TABLE_END = "<!-- END vllm_flags table -->"


def render_markdown() -> str:
    """The docs table, between its markers."""
    lines = [TABLE_BEGIN, "", "| vLLM flag | pagedserve | what it does here |", "|---|---|---|"]
    for flag in VLLM_SERVE_FLAGS:
        name = f"`{flag.name}`" + (f" / `{flag.short}`" if flag.short else "")
        note = flag.note.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        lines.append(f"| {name} | {flag.support.value} | {note} |")
    lines += ["", TABLE_END]
    return "\n".join(lines)


def _rewrite_docs(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, end = text.index(TABLE_BEGIN), text.index(TABLE_END) + len(TABLE_END)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[:start] + render_markdown() + text[end:])


if __name__ == "__main__":
    _rewrite_docs(DOCS_PATH)
