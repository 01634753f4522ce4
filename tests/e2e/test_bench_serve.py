"""`bench serve` against a fake OpenAI-compatible server in the same event loop: it streams fixed
chunks after fixed delays, so the benchmark's TTFT, ITL, token counts, goodput and error counts
have known right answers. No model is loaded (except the one tokenizer test)."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field

import pytest

from pagedserve.benchmarks import serve

FIRST_DELAY_S = 0.1
ITL_S = 0.02


@dataclass
class FakeServer:
    """Streams `max_tokens` one-token chunks: the first after first_delay_s, then one per itl_s."""

    first_delay_s: float = FIRST_DELAY_S
    itl_s: float = ITL_S
    fail_every: int = 0
    """Every fail_every-th request (in arrival order) gets a 500; 0 = none."""
    send_usage: bool = True
    prompt_tokens_details: dict | None = None
    """Sent as usage.prompt_tokens_details when given."""
    chunk_text: str = " tok"
    bodies: list[dict] = field(default_factory=list)
    num_in_flight: int = 0
    peak_in_flight: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, _ = (await reader.readline()).decode().split(" ", 2)
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, value = line.decode().split(":", 1)
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            if method == "GET" and path == "/v1/models":
                await self._respond(writer, 200, {"object": "list", "data": [{"id": "fake"}]})
            elif method == "POST" and path in (serve.COMPLETIONS, serve.CHAT_COMPLETIONS):
                await self._complete(writer, path, json.loads(body))
            else:
                await self._respond(writer, 404, {"detail": "Not Found"})
        finally:
            writer.close()

    async def _respond(self, writer: asyncio.StreamWriter, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()

    async def _complete(self, writer: asyncio.StreamWriter, path: str, request: dict) -> None:
        self.bodies.append(request)
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            error = {"message": "fake overload", "type": "InternalServerError", "code": 500}
            await self._respond(writer, 500, {"error": error})
            return
        self.num_in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.num_in_flight)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")

        async def event(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            message = f"data: {data}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(message), message))
            await writer.drain()

        chat = path == serve.CHAT_COMPLETIONS
        if chat:  # like vLLM: a role-only chunk that must not count as the first token
            await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        num_tokens = request["max_tokens"]
        for i in range(num_tokens):
            await asyncio.sleep(self.first_delay_s if i == 0 else self.itl_s)
            finish_reason = "length" if i == num_tokens - 1 else None
            choice = ({"index": 0, "delta": {"content": self.chunk_text}} if chat
                      else {"index": 0, "text": self.chunk_text})
            await event({"choices": [dict(choice, finish_reason=finish_reason)]})
        if self.send_usage and request.get("stream_options", {}).get("include_usage"):
            prompt = request["messages"][0]["content"] if chat else request["prompt"]
            num_prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_tokens,
                     "total_tokens": num_prompt_tokens + num_tokens}
            if self.prompt_tokens_details is not None:
                usage["prompt_tokens_details"] = self.prompt_tokens_details
            await event({"choices": [], "usage": usage})
        await event("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        self.num_in_flight -= 1


def parse_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args(["--disable-progress", *flags])


def bench(fake: FakeServer, *flags: str) -> dict:
    """serve.run() against `fake` on a free loopback port; returns its result dict."""

    async def scenario() -> dict:
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await serve.run(parse_args("--base-url", f"http://127.0.0.1:{port}", *flags))

    return asyncio.run(scenario())


def test_completions_latencies_tokens_and_errors(tmp_path, capsys):
    fake = FakeServer(fail_every=4)
    output_json = tmp_path / "result.json"
    result = bench(fake, "--num-prompts", "8", "--input-len", "16", "--output-len", "6",
                   "--seed", "1", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100",
                   "--output-json", str(output_json))
    metrics = result["metrics"]
    assert result["config"]["model"] == "fake"  # from GET /v1/models
    assert (metrics["num_requests"], metrics["completed"], metrics["failed"]) == (8, 6, 2)
    assert result["errors"] == [{"status": 500, "error": "fake overload", "count": 2}]
    assert metrics["total_output_tokens"] == 6 * 6
    assert metrics["total_input_tokens"] == 6 * 16
    assert metrics["output_tokens_source"] == ["usage"]
    # Client-side timings sit at the fake's delays, plus scheduling noise on a busy machine.
    assert 1000 * FIRST_DELAY_S <= metrics["median_ttft_ms"] < 1000 * FIRST_DELAY_S + 60
    assert 1000 * ITL_S * 0.9 <= metrics["median_itl_ms"] < 1000 * ITL_S + 15
    assert 1000 * ITL_S * 0.9 <= metrics["mean_tpot_ms"] < 1000 * ITL_S + 15
    assert metrics["p99_ttft_ms"] >= metrics["median_ttft_ms"]
    expected_latency_ms = 1000 * (FIRST_DELAY_S + 5 * ITL_S)
    assert expected_latency_ms <= metrics["median_e2el_ms"] < expected_latency_ms + 80
    # All at once: every request in flight together, the run as long as about one request.
    assert metrics["peak_concurrency"] == 8
    assert metrics["duration_s"] < 2 * expected_latency_ms / 1000
    duration = metrics["duration_s"]
    assert metrics["request_throughput"] == pytest.approx(6 / duration)
    assert metrics["output_throughput"] == pytest.approx(36 / duration)
    assert metrics["total_token_throughput"] == pytest.approx((36 + 96) / duration)
    assert metrics["num_good_requests"] == 6
    assert metrics["goodput"] == pytest.approx(metrics["request_throughput"])

    # What was sent: unique random token-id prompts, fixed length, vLLM's ignore_eos, usage asked.
    prompts = [body["prompt"] for body in fake.bodies]
    assert all(len(p) == 16 and all(isinstance(i, int) for i in p) for p in prompts)
    assert len({tuple(p) for p in prompts}) == 8
    for body in fake.bodies:
        assert body["model"] == "fake" and body["max_tokens"] == 6 and body["stream"] is True
        assert body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}

    saved = json.loads(output_json.read_text())
    assert saved["metrics"] == metrics and saved["config"]["seed"] == 1
    assert len(saved["requests"]) == 8
    ok = [r for r in saved["requests"] if r["success"]]
    assert all(len(r["itl_s"]) == 5 and r["output_tokens"] == 6 for r in ok)
    table = capsys.readouterr().out
    assert "Successful requests:" in table and "error x2: status 500: fake overload" in table


def test_cached_tokens_kv_tier_share_and_hit_rate(capsys):
    fake = FakeServer(first_delay_s=0, itl_s=0,
                      prompt_tokens_details={"cached_tokens": 12, "kv_tier_cached_tokens": 4})
    result = bench(fake, "--num-prompts", "3", "--input-len", "16", "--output-len", "2")
    metrics = result["metrics"]
    assert metrics["total_cached_tokens"] == 3 * 12
    assert metrics["total_kv_tier_cached_tokens"] == 3 * 4
    assert metrics["prefix_cache_hit_rate"] == pytest.approx(12 / 16)
    assert all(r["num_kv_tier_cached_tokens"] == 4 for r in result["requests"])
    table = capsys.readouterr().out
    assert "of which from a KV tier:" in table and "75.0%" in table

    # A server without KV tiers (vLLM's usage): no tier line, the hit rate still.
    result = bench(FakeServer(first_delay_s=0, itl_s=0,
                              prompt_tokens_details={"cached_tokens": 0}),
                   "--num-prompts", "2", "--input-len", "16", "--output-len", "2")
    assert result["metrics"]["total_kv_tier_cached_tokens"] is None
    assert result["metrics"]["prefix_cache_hit_rate"] == 0
    assert "KV tier" not in capsys.readouterr().out


@pytest.mark.parametrize("slo_flags", [("--slo-ttft-ms", "50"), ("--slo-tpot-ms", "5"),
                                       ("--slo-ttft-ms", "1000", "--slo-tpot-ms", "5")])
def test_goodput_excludes_requests_that_miss_an_slo(slo_flags):
    result = bench(FakeServer(), "--num-prompts", "4", "--output-len", "4", *slo_flags)
    metrics = result["metrics"]
    assert metrics["completed"] == 4
    assert metrics["num_good_requests"] == 0 and metrics["goodput"] == 0


def test_chat_doc_qa_counts_chunks_without_usage():
    fake = FakeServer(send_usage=False)
    result = bench(fake, "--endpoint", "/v1/chat/completions", "--dataset", "doc-qa",
                   "--num-docs", "2", "--doc-len", "40", "--questions-per-doc", "3",
                   "--question-len", "5", "--output-len", "5")
    metrics = result["metrics"]
    assert metrics["completed"] == 6
    assert metrics["output_tokens_source"] == ["chunks"]
    assert metrics["total_output_tokens"] == 6 * 5
    assert metrics["total_input_tokens"] is None  # text prompts, no usage, no tokenizer
    assert metrics["total_token_throughput"] is None
    # The role-only first chunk arrives at once; TTFT waits for content.
    assert metrics["median_ttft_ms"] >= 1000 * FIRST_DELAY_S
    # Interleaved: requests 0, 2, 4 share document 0; 1, 3, 5 document 1.
    texts = [body["messages"][0]["content"].split() for body in fake.bodies]
    assert all(len(words) == 45 for words in texts)
    docs = [tuple(words[:40]) for words in sorted(texts)]
    assert len(set(docs)) == 2 and len(set(tuple(words) for words in texts)) == 6


def test_max_concurrency_and_poisson_arrivals():
    fake = FakeServer(first_delay_s=0.05, itl_s=0.01)
    result = bench(fake, "--num-prompts", "6", "--output-len", "3", "--max-concurrency", "2",
                   "--request-rate", "200", "--no-ignore-eos", "--extra-body", '{"top_k": 1}')
    metrics = result["metrics"]
    assert metrics["completed"] == 6
    assert fake.peak_in_flight <= 2 and metrics["peak_concurrency"] <= 2
    assert metrics["duration_s"] >= 3 * (0.05 + 2 * 0.01)  # three waves of two
    assert result["config"]["request_rate"] == 200 and result["config"]["max_concurrency"] == 2
    assert all("ignore_eos" not in body and body["top_k"] == 1 for body in fake.bodies)


def test_seed_fixes_prompts_and_each_unseeded_run_differs():
    def prompts(*flags: str) -> list:
        args = parse_args("--num-prompts", "4", "--input-len", "8", *flags)
        return [request.prompt for request in serve.make_requests(args, args.seed, None)]

    assert prompts("--seed", "3") == prompts("--seed", "3") != prompts("--seed", "4")
    # run() draws a fresh seed when none is given, and records it.
    seeds = [bench(FakeServer(first_delay_s=0, itl_s=0), "--num-prompts", "1",
                   "--output-len", "1")["config"]["seed"] for _ in range(2)]
    assert seeds[0] != seeds[1]


def test_unreachable_server():
    async def closed_port() -> int:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        return port

    base_url = f"http://127.0.0.1:{asyncio.run(closed_port())}"
    with pytest.raises(ValueError, match="cannot reach"):
        serve.main(parse_args("--base-url", base_url, "--num-prompts", "2"))
    result = serve.main(parse_args("--base-url", base_url, "--model", "m", "--num-prompts", "2"))
    assert result["metrics"]["failed"] == 2
    [error] = result["errors"]
    assert error["status"] is None and error["error"].startswith("ConnectError")


def test_tokenizer_model_builds_text_prompts_and_counts_tokens(model_path):
    fake = FakeServer(send_usage=False, chunk_text=" the")
    result = bench(fake, "--tokenizer-model", model_path, "--num-prompts", "3",
                   "--input-len", "20", "--output-len", "4")
    metrics = result["metrics"]
    assert result["config"]["prompt_format"] == "text"
    assert all(isinstance(body["prompt"], str) for body in fake.bodies)
    assert metrics["output_tokens_source"] == ["tokenizer"]
    assert metrics["total_output_tokens"] == 3 * 4  # " the" is one token
    # Re-tokenizing decoded random ids need not give back 20 tokens, but it gives about that.
    assert 3 * 10 <= metrics["total_input_tokens"] <= 3 * 40
