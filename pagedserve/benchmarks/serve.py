"""Online serving benchmark: streamed requests to any OpenAI-compatible server.

Measures from the client side TTFT, inter-token latency, TPOT, end-to-end latency, throughput
and goodput. Knows nothing of pagedserve's engine, so it measures vLLM or llama.cpp's server
just as well.

    pagedserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagedserve.benchmarks.datasets import (
    add_dataset_args,
    make_text_prompts,
    make_workload,
    validate_dataset_args,
)

COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"
DEFAULT_VOCAB_SIZE = 32000
"""Random token ids stay below this without a tokenizer: Llama-2-size and larger vocabularies
all have ordinary tokens there."""


@dataclass
class RequestInput:
    prompt: str | list[int]
    """Text, or token ids (only sent to /v1/completions)."""
    prompt_len: int | None
    """Prompt tokens as counted here; None for text that no tokenizer here counted."""


@dataclass
class RequestResult:
    """One streamed request as the client saw it; times in seconds."""

    success: bool = False
    status: int | None = None
    """HTTP status; None when no response arrived."""
    error: str | None = None
    start_time: float = 0.0
    """When it was sent, since the benchmark started."""
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    """Gaps between consecutive content chunks."""
    latency: float | None = None
    """Sent to end of stream."""
    prompt_len: int | None = None
    output_tokens: int = 0
    output_tokens_source: str | None = None
    """"usage" (the server's count), "tokenizer" (ours, over the text) or "chunks" (a guess)."""
    num_cached_tokens: int | None = None
    """usage.prompt_tokens_details.cached_tokens, where the server reports it."""
    num_kv_tier_cached_tokens: int | None = None
    """usage.prompt_tokens_details.kv_tier_cached_tokens (pagedserve's): the part of
    cached_tokens that came from a KV tier rather than the device's pool."""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.latency is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--base-url", default="http://127.0.0.1:8000",
                       help="server root, without /v1")
    group.add_argument("--endpoint", choices=(COMPLETIONS, CHAT_COMPLETIONS), default=COMPLETIONS)
    group.add_argument("--model", default=None,
                       help="model name to request (default: the first id from GET /v1/models)")
    group.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                       help="send vLLM's ignore_eos, so every request generates exactly "
                            "--output-len tokens; --no-ignore-eos for servers that reject "
                            "unknown fields")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--extra-body", type=json.loads, default=None,
                       help='JSON merged into every request body, e.g. \'{"top_k": 1}\'')
    group.add_argument("--timeout", type=float, default=600.0,
                       help="seconds any one connect or read may wait")
    add_dataset_args(parser)
    group = parser.add_argument_group("prompts")
    group.add_argument("--tokenizer-model", default=None,
                       help="path or short name of a model whose tokenizer builds text prompts "
                            "and counts tokens the server does not report; without it, "
                            "/v1/completions gets token id lists and chat gets random words")
    group.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                       help="without --tokenizer-model: random token ids stay below this")
    group.add_argument("--seed", type=int, default=None,
                       help="prompt and arrival seed (default: fresh each run, so no server "
                            "cache carries over between runs)")
    group = parser.add_argument_group("load and output")
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="Poisson arrivals per second (default inf: all at once)")
    group.add_argument("--max-concurrency", type=int, default=None,
                       help="at most this many requests in flight")
    group.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound")
    group.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT bound")
    group.add_argument("--output-json", default=None, help="write config, metrics and requests")
    group.add_argument("--disable-progress", action="store_true", help="no progress bar")


def validate_args(args: argparse.Namespace) -> None:
    validate_dataset_args(args)
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")


# ---- prompts --------------------------------------------------------------------------------


def load_tokenizer(name_or_path: str):
    # NOTE: the model loader imports torch; only --tokenizer-model pays for that.
    from pagedserve.models.loader import resolve_model_path
    from pagedserve.tokenizer import Tokenizer

    return Tokenizer.from_path(resolve_model_path(name_or_path))


def make_requests(args: argparse.Namespace, seed: int, tokenizer) -> list[RequestInput]:
    """Token id prompts for /v1/completions; text (decoded by the tokenizer, else random words)
    where a tokenizer is given or the endpoint is chat."""
    if tokenizer is not None:
        workload = make_workload(args, tokenizer.vocab_size, seed)
        texts = [tokenizer.decode(ids) for ids in workload.prompt_token_ids]
        # The server re-tokenizes the text: count what it will see, not the ids we drew.
        return [RequestInput(text, len(tokenizer.encode(text))) for text in texts]
    if args.endpoint == COMPLETIONS:
        workload = make_workload(args, args.vocab_size, seed)
        return [RequestInput(ids, len(ids)) for ids in workload.prompt_token_ids]
    return [RequestInput(text, None) for text in make_text_prompts(args, seed)]


def make_body(args: argparse.Namespace, model: str, request: RequestInput) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == CHAT_COMPLETIONS:
        assert isinstance(request.prompt, str), "chat prompts are text"
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_body or {})
    return body


# ---- one request ----------------------------------------------------------------------------


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style ({"error": {"message"}}), FastAPI ({"detail"}) or plain
    error body."""
    text = body.decode(errors="replace").strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text[:300]
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            return str(error.get("message") or error.get("detail") or error)[:300]
        return str(error)[:300]
    return text[:300]


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:  # /v1/completions
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], request: RequestInput,
    tokenizer, benchmark_start: float,
) -> RequestResult:
    """Stream one request; every failure ends up in the result, none is raised."""
    result = RequestResult(prompt_len=request.prompt_len)
    content_times: list[float] = []
    text_parts: list[str] = []
    usage = None
    start = time.perf_counter()
    result.start_time = start - benchmark_start
    try:
        async with client.stream("POST", url, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = _error_message(await response.aread())
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, "event:" lines, ": keep-alive" comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("error"):  # failed after the 200 was sent
                    result.error = _error_message(json.dumps(chunk).encode())
                    return result
                usage = chunk.get("usage") or usage
                text = "".join(_choice_text(choice) for choice in chunk.get("choices") or [])
                if text:
                    content_times.append(now)
                    text_parts.append(text)
        end = time.perf_counter()
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result

    if not content_times:
        result.error = "the stream ended without content"
        return result
    result.success = True
    result.ttft = content_times[0] - start
    result.itls = [later - earlier for earlier, later in zip(content_times, content_times[1:])]
    result.latency = end - start
    if usage and usage.get("completion_tokens") is not None:
        result.output_tokens, result.output_tokens_source = usage["completion_tokens"], "usage"
    elif tokenizer is not None:
        text = "".join(text_parts)
        result.output_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        result.output_tokens_source = "tokenizer"
    else:
        result.output_tokens, result.output_tokens_source = len(content_times), "chunks"
    if usage:
        if usage.get("prompt_tokens") is not None:
            result.prompt_len = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        result.num_cached_tokens = details.get("cached_tokens")
        result.num_kv_tier_cached_tokens = details.get("kv_tier_cached_tokens")
    return result


# ---- the run --------------------------------------------------------------------------------


class _Progress:
    """tqdm when installed, else a counter on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.num_done, self.enabled, self._bar = total, 0, enabled, None
        if enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="req", file=sys.stderr)

    def update(self) -> None:
        self.num_done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.enabled:
            end = "\n" if self.num_done == self.total else ""
            print(f"\r{self.num_done}/{self.total} requests", end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def fetch_first_model(client: httpx.AsyncClient, base_url: str) -> str:
    url = f"{base_url}/v1/models"
    try:
        response = await client.get(url)
    except httpx.HTTPError as error:
        raise ValueError(f"cannot reach {url}: {type(error).__name__}: {error}") from error
    if response.status_code != 200:
        raise ValueError(f"GET {url} returned {response.status_code}: "
                         f"{_error_message(response.content)}")
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"GET {url} lists no models; pass --model")
    return models[0]["id"]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by parsed CLI args; print a table and return every number."""
    validate_args(args)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    tokenizer = load_tokenizer(args.tokenizer_model) if args.tokenizer_model else None
    requests = make_requests(args, seed, tokenizer)
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    max_connections = args.max_concurrency or len(requests)
    async with httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(args.timeout, pool=None),  # waiting for a free slot is not a failure
        limits=httpx.Limits(max_connections=max_connections,
                            max_keepalive_connections=max_connections),
    ) as client:
        model = args.model or await fetch_first_model(client, base_url)
        bodies = [make_body(args, model, request) for request in requests]
        results, duration, peak_concurrency = await _send_all(
            client, f"{base_url}{args.endpoint}", bodies, requests, args, seed, tokenizer)

    config = {
        "base_url": base_url, "endpoint": args.endpoint, "model": model,
        "dataset": args.dataset, "num_prompts": len(requests), "output_len": args.output_len,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency, "seed": seed, "ignore_eos": args.ignore_eos,
        "temperature": args.temperature, "tokenizer_model": args.tokenizer_model,
        "prompt_format": "token_ids" if isinstance(requests[0].prompt, list) else "text",
        "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.dataset == "doc-qa":
        config.update(num_docs=args.num_docs, doc_len=args.doc_len, question_len=args.question_len)
    else:
        config["input_len"] = args.input_len
    metrics = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    metrics["peak_concurrency"] = peak_concurrency
    result = {
        "config": config,
        "metrics": metrics,
        "errors": error_counts(results),
        "requests": [request_record(r) for r in results],
    }
    print(format_table(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


async def _send_all(
    client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]],
    requests: list[RequestInput], args: argparse.Namespace, seed: int, tokenizer,
) -> tuple[list[RequestResult], float, int]:
    """Send every request on its Poisson arrival; returns (results, duration, peak in flight)."""
    limit = (asyncio.Semaphore(args.max_concurrency) if args.max_concurrency
             else contextlib.nullcontext())
    arrivals = random.Random(f"{seed}:arrivals")
    progress = _Progress(len(requests), enabled=not args.disable_progress)
    num_in_flight = peak_in_flight = 0
    start = time.perf_counter()

    async def limited(body: dict[str, Any], request: RequestInput) -> RequestResult:
        nonlocal num_in_flight, peak_in_flight
        async with limit:
            num_in_flight += 1
            peak_in_flight = max(peak_in_flight, num_in_flight)
            try:
                return await send_request(client, url, body, request, tokenizer, start)
            finally:
                num_in_flight -= 1
                progress.update()

    tasks = []
    for i, (body, request) in enumerate(zip(bodies, requests)):
        if i > 0 and math.isfinite(args.request_rate):
            await asyncio.sleep(arrivals.expovariate(args.request_rate))
        tasks.append(asyncio.create_task(limited(body, request)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    progress.close()
    return list(results), duration, peak_in_flight


def main(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(run(args))


# ---- numbers --------------------------------------------------------------------------------


def safe_div(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, None where the denominator is not positive (a ratio a table
    shows as "-")."""
    return numerator / denominator if denominator > 0 else None


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _distribution_ms(name: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    return {
        f"mean_{name}_ms": 1000 * sum(values) / len(values),
        f"median_{name}_ms": 1000 * percentile(values, 50),
        f"p99_{name}_ms": 1000 * percentile(values, 99),
    }


def meets_slos(result: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not result.success:
        return False
    if slo_ttft_ms is not None and result.ttft * 1000 > slo_ttft_ms:
        return False
    tpot = result.tpot
    # A one-token output has no TPOT: nothing to violate.
    return slo_tpot_ms is None or tpot is None or tpot * 1000 <= slo_tpot_ms


def summarize(
    results: list[RequestResult], duration: float,
    slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
) -> dict[str, Any]:
    """Throughputs over the whole run; latency distributions over successful requests."""
    done = [r for r in results if r.success]
    num_output_tokens = sum(r.output_tokens for r in done)
    # Prompt tokens are unknown only for text prompts to a server that reports no usage.
    prompt_lens = [r.prompt_len for r in done if r.prompt_len is not None]
    num_input_tokens = sum(prompt_lens) if len(prompt_lens) == len(done) else None
    cached = [r.num_cached_tokens for r in done if r.num_cached_tokens is not None]
    tier_cached = [r.num_kv_tier_cached_tokens for r in done
                   if r.num_kv_tier_cached_tokens is not None]
    # Over the requests whose usage reports cached tokens (it reports their prompt tokens too).
    prompt_lens_with_cached = [r.prompt_len for r in done if r.num_cached_tokens is not None]
    hit_rate = None
    if cached and None not in prompt_lens_with_cached and sum(prompt_lens_with_cached) > 0:
        hit_rate = sum(cached) / sum(prompt_lens_with_cached)
    metrics: dict[str, Any] = {
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": num_input_tokens,
        "total_output_tokens": num_output_tokens,
        "total_cached_tokens": sum(cached) if cached else None,
        "total_kv_tier_cached_tokens": sum(tier_cached) if tier_cached else None,
        "prefix_cache_hit_rate": hit_rate,
        "output_tokens_source": sorted({r.output_tokens_source for r in done}),
        "request_throughput": len(done) / duration,
        "output_throughput": num_output_tokens / duration,
        "total_token_throughput": (None if num_input_tokens is None
                                   else (num_input_tokens + num_output_tokens) / duration),
        "goodput": None,
        "num_good_requests": None,
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        num_good = sum(meets_slos(r, slo_ttft_ms, slo_tpot_ms) for r in done)
        metrics["num_good_requests"] = num_good
        metrics["goodput"] = num_good / duration
    metrics.update(_distribution_ms("ttft", [r.ttft for r in done]))
    metrics.update(_distribution_ms("tpot", [r.tpot for r in done if r.tpot is not None]))
    metrics.update(_distribution_ms("itl", [itl for r in done for itl in r.itls]))
    metrics.update(_distribution_ms("e2el", [r.latency for r in done]))
    return metrics


def error_counts(results: list[RequestResult]) -> list[dict[str, Any]]:
    """Distinct (status, error) pairs, most frequent first."""
    counts = Counter((r.status, r.error) for r in results if not r.success)
    return [{"status": status, "error": error, "count": count}
            for (status, error), count in counts.most_common()]


def request_record(result: RequestResult) -> dict[str, Any]:
    return {
        "success": result.success, "status": result.status, "error": result.error,
        "start_s": result.start_time, "ttft_s": result.ttft, "tpot_s": result.tpot,
        "latency_s": result.latency, "itl_s": result.itls, "prompt_len": result.prompt_len,
        "output_tokens": result.output_tokens, "num_cached_tokens": result.num_cached_tokens,
        "num_kv_tier_cached_tokens": result.num_kv_tier_cached_tokens,
    }


def format_table(result: dict[str, Any]) -> str:
    config, metrics = result["config"], result["metrics"]

    def row(label: str, value: Any, fmt: str = "") -> str:
        cell = "-" if value is None else format(value, fmt)
        return f"{label:<40}{cell:>12}"

    lines = [
        f"{' Serving Benchmark Result ':=^52}",
        f"{config['base_url']}{config['endpoint']}  model {config['model']}",
        f"dataset {config['dataset']}  prompts {config['prompt_format']}  "
        f"output len {config['output_len']}  rate {config['request_rate']}  "
        f"max concurrency {config['max_concurrency'] or '-'}  seed {config['seed']}",
        row("Successful requests:", metrics["completed"], "d"),
        row("Failed requests:", metrics["failed"], "d"),
        row("Peak concurrent requests:", metrics["peak_concurrency"], "d"),
        row("Benchmark duration (s):", metrics["duration_s"], ".2f"),
        row("Total input tokens:", metrics["total_input_tokens"], "d"),
        row("Total generated tokens:", metrics["total_output_tokens"], "d"),
    ]
    if metrics["total_cached_tokens"] is not None:
        lines.append(row("Total cached prompt tokens:", metrics["total_cached_tokens"], "d"))
    if metrics["total_kv_tier_cached_tokens"] is not None:
        lines.append(row("  of which from a KV tier:", metrics["total_kv_tier_cached_tokens"], "d"))
    if metrics["prefix_cache_hit_rate"] is not None:
        lines.append(row("Prefix cache hit rate:", metrics["prefix_cache_hit_rate"], ".1%"))
    lines += [
        row("Request throughput (req/s):", metrics["request_throughput"], ".2f"),
        row("Output token throughput (tok/s):", metrics["output_throughput"], ".2f"),
        row("Total token throughput (tok/s):", metrics["total_token_throughput"], ".2f"),
    ]
    if metrics["goodput"] is not None:
        lines.append(row("Request goodput (req/s):", metrics["goodput"], ".2f"))
    if metrics["output_tokens_source"] != ["usage"]:
        sources = ", ".join(metrics["output_tokens_source"]) or "-"
        lines.append(row("Output tokens counted by:", sources))
    for name, title in [("ttft", "Time to First Token"),
                        ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")]:
        lines.append(f"{' ' + title + ' ':-^52}")
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {name.upper()} (ms):"
            lines.append(row(label, metrics[f"{stat}_{name}_ms"], ".2f"))
    for error in result["errors"][:5]:
        lines.append(f"error x{error['count']}: status {error['status']}: {error['error']}")
    lines.append("=" * 52)
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cli_args(parser)
    main(parser.parse_args())
