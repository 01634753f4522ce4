"""`pagedserve run-batch -i in.jsonl -o out.jsonl`: an OpenAI batch file run in-process.

Every input line, `{"custom_id", "method": "POST", "url", "body"}`, goes to the same serving
objects the HTTP server uses, all of them at once (up to --max-concurrency) so that the engine
batches them. Output lines come in input order, in OpenAI's batch output format:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`, where a
request the API refuses has its 4xx and error body in `response`, and a line that is no request at
all (not JSON, a field missing, an unknown url) has `"response": null` and an `error` object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import IO, Any

from pydantic import BaseModel, ValidationError

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.entrypoints.openai import protocol as p
from pagedserve.entrypoints.openai.errors import APIError, bad_request, from_validation_error
from pagedserve.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from pagedserve.entrypoints.openai.serving import OpenAIServing
from pagedserve.entrypoints.openai.serving_embeddings import EmbeddingServing
from pagedserve.entrypoints.openai.serving_responses import ResponsesRequest, ResponsesServing
from pagedserve.pooling_params import POOLING_TYPES

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENCY = 512
"""Requests handed to the engine at once; the rest wait in this process, not in its queue."""


@dataclass(frozen=True)
class Endpoint:
    request_type: type[p.RequestModel]
    handle: Callable[[Any], Awaitable[BaseModel]]
    refused: tuple[str, ...] = ("stream",)
    """Body fields that make no sense in a batch (a 400 when set): a stream has no reader, and
    lines run concurrently, so one cannot continue another's response."""


class LineError(Exception):
    """A line that is no runnable request: it gets `"response": null` and this error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def endpoints(serving: OpenAIServing, responses: ResponsesServing,
              embeddings: EmbeddingServing) -> dict[str, Endpoint]:
    """The urls a batch line may name, over the serving objects the HTTP server uses."""
    return {
        "/v1/embeddings": Endpoint(EmbeddingRequest, embeddings.create_embedding),
        "/v1/chat/completions": Endpoint(p.ChatCompletionRequest,
                                         serving.create_chat_completion),
        "/v1/completions": Endpoint(p.CompletionRequest, serving.create_completion),
        "/v1/responses": Endpoint(ResponsesRequest, responses.create_response,
                                  refused=("stream", "previous_response_id")),
    }


def parse_line(line: str, urls: dict[str, Endpoint]) -> tuple[Any, Endpoint, dict]:
    """(custom_id, endpoint, body) of one input line; LineError says what is wrong with it.
    A custom_id found before the error is kept on the LineError's output line."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        raise LineError("invalid_json", "the line is not valid JSON") from None
    if not isinstance(entry, dict):
        raise LineError("invalid_request", "the line must be a JSON object")
    for name in ("custom_id", "method", "url", "body"):
        if name not in entry:
            raise LineError("missing_field", f"the line has no {name!r}")
    if entry["method"] != "POST":
        raise LineError("invalid_method", f"method must be 'POST', got {entry['method']!r}")
    endpoint = urls.get(entry["url"]) if isinstance(entry["url"], str) else None
    if endpoint is None:
        raise LineError("invalid_url", f"url {str(entry['url'])[:100]!r} is not supported; "
                        f"use one of {', '.join(urls)}")
    if not isinstance(entry["body"], dict):
        raise LineError("invalid_body", "body must be a JSON object")
    return entry["custom_id"], endpoint, entry["body"]


def _custom_id(line: str) -> Any:
    """The custom_id of a line that failed parse_line, when there is one to name."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return entry.get("custom_id") if isinstance(entry, dict) else None


async def run_line(line: str, urls: dict[str, Endpoint]) -> dict:
    """The output line (as a dict) for one input line; never raises."""
    output: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": None,
                              "response": None, "error": None}
    try:
        output["custom_id"], endpoint, body = parse_line(line, urls)
    except LineError as error:
        output["custom_id"] = _custom_id(line)
        output["error"] = {"code": error.code, "message": error.message}
        return output
    request_id = f"req_{uuid.uuid4().hex}"
    try:
        for name in endpoint.refused:
            if body.get(name):
                raise bad_request(f"{name} is not supported in a batch", name)
        try:
            request = endpoint.request_type.model_validate(body)
        except ValidationError as error:
            raise from_validation_error(error) from None
        result = await endpoint.handle(request)
        status_code, response_body = 200, result.model_dump(mode="json")
        request_id = response_body.get("id", request_id)
    except APIError as error:
        status_code, response_body = error.status_code, error.body()
    except Exception:  # one line's bug must not lose the other lines' results
        logger.exception("unexpected error running the line with custom_id %r",
                         output["custom_id"])
        error = APIError(500, "internal server error", code="internal_error")
        status_code, response_body = error.status_code, error.body()
    output["response"] = {"status_code": status_code, "request_id": request_id,
                          "body": response_body}
    return output


class _Progress:
    """A tqdm bar on stderr when tqdm is installed, else a one-line counter."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, desc="run-batch", unit="req", file=sys.stderr)

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        else:
            end = "\n" if self.done == self.total else ""
            print(f"\rrun-batch: {self.done}/{self.total} requests", end=end, file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def run_lines(lines: list[str], urls: dict[str, Endpoint], output: IO[str],
                    max_concurrency: int = DEFAULT_MAX_CONCURRENCY) -> list[dict]:
    """Run every line concurrently, write the output lines in input order; returns them."""
    slots = asyncio.Semaphore(max_concurrency)
    progress = _Progress(len(lines))

    async def run_one(line: str) -> dict:
        async with slots:
            result = await run_line(line, urls)
        progress.update()
        return result

    tasks = [asyncio.create_task(run_one(line)) for line in lines]
    results = []
    try:
        for task in tasks:  # in input order: a line is written once all before it are
            result = await task
            output.write(json.dumps(result, ensure_ascii=False) + "\n")
            results.append(result)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        progress.close()
        output.flush()
    return results


def _read_lines(path: str) -> list[str]:
    if path == "-":
        text = sys.stdin.read()
    else:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    return [line for line in text.splitlines() if line.strip()]


async def _run(args: argparse.Namespace, lines: list[str], output: IO[str]) -> list[dict]:
    from pagedserve.engine.async_llm import AsyncLLM, load_engine

    async_llm = AsyncLLM(load_engine(EngineArgs.from_cli_args(args), warm_up=False))
    try:
        serving = OpenAIServing(async_llm, args.served_model_name or args.model)
        # Nothing reads stored responses back in a batch: keep the store minimal.
        urls = endpoints(serving, ResponsesServing(serving, store_size=1),
                         EmbeddingServing(serving, args.pooling_type))
        return await run_lines(lines, urls, output, args.max_concurrency)
    finally:
        await async_llm.shutdown(drain_timeout=0)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    lines = _read_lines(args.input_file)  # before the model loads: a bad path fails fast
    if args.output_file == "-":
        results = asyncio.run(_run(args, lines, sys.stdout))
    else:
        with open(args.output_file, "w", encoding="utf-8") as output:
            results = asyncio.run(_run(args, lines, output))
    num_ok = sum(1 for r in results if r["response"] and r["response"]["status_code"] == 200)
    print(f"run-batch: {len(results)} lines, {num_ok} succeeded, {len(results) - num_ok} "
          f"failed", file=sys.stderr)
    return 0


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """-i, -o, the engine's flags (as for `serve`, with --model), and the batch's own."""
    parser.add_argument("-i", "--input-file", required=True,
                        help="the batch file (JSONL, OpenAI's format); '-' for stdin")
    parser.add_argument("-o", "--output-file", required=True,
                        help="where the results go (JSONL, in input order); '-' for stdout")
    EngineArgs.add_cli_args(parser)
    group = parser.add_argument_group("batch")
    group.add_argument("--served-model-name", default=None,
                       help="the model name request bodies may give (default: --model)")
    group.add_argument("--pooling-type", choices=POOLING_TYPES, default="last",
                       help="how /v1/embeddings lines pool the final hidden states")
    group.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                       help="requests handed to the engine at once")
