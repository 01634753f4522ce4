"""`pagedserve run-batch` as a user runs it (a subprocess on the default model): 50 mixed lines
(chat, completions, responses, embeddings), good and bad, give 50 output lines in input order
with a per-line error where one is due."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.entrypoints.utils import MODEL_NAME

MAX_TOKENS = 4


def batch_lines() -> tuple[list[str], list[str]]:
    """(input lines, what each should give: "ok", "http_400", or a line error code)."""
    lines, expected = [], []

    def add(entry: dict | str, outcome: str) -> None:
        lines.append(entry if isinstance(entry, str) else json.dumps(entry))
        expected.append(outcome)

    for index in range(44):
        kind = index % 4
        if kind == 3:
            url, body = "/v1/embeddings", {"input": f"The number {index}."}
        elif kind == 0:
            url, body = "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"Say the number {index}."}],
                "max_tokens": MAX_TOKENS}
        elif kind == 1:
            url, body = "/v1/completions", {"prompt": f"{index} plus one is",
                                            "max_tokens": MAX_TOKENS}
        else:
            url, body = "/v1/responses", {"input": f"Say the number {index}.",
                                          "max_output_tokens": MAX_TOKENS}
        add({"custom_id": f"req-{index}", "method": "POST", "url": url,
             "body": {"model": MODEL_NAME, "temperature": 0, **body}}, "ok")
    # Bad lines, spread through the file (a run must not stop at them).
    bad = [
        ('{"custom_id": "broken", "method": "POST", ', "invalid_json"),
        ({"custom_id": "bad-url", "method": "POST", "url": "/v1/images", "body": {}},
         "invalid_url"),
        ({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}, "missing_field"),
        ({"custom_id": "bad-max-tokens", "method": "POST", "url": "/v1/chat/completions",
          "body": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": -1}}, "http_400"),
        ({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}},
         "invalid_method"),
        ({"custom_id": "unknown-model", "method": "POST", "url": "/v1/completions",
          "body": {"model": "gpt-5", "prompt": "hi", "max_tokens": 1}}, "http_404"),
    ]
    for position, (entry, outcome) in zip((3, 10, 17, 25, 33, 49), bad):
        lines.insert(position, entry if isinstance(entry, str) else json.dumps(entry))
        expected.insert(position, outcome)
    return lines, expected


def test_run_batch_mixed_file(tmp_path):
    lines, expected = batch_lines()
    assert len(lines) == 50
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    input_path.write_text("\n".join(lines) + "\n")
    process = subprocess.run(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "run-batch", "-i", str(input_path),
         "-o", str(output_path), "--model", MODEL_NAME, "--max-model-len", "512"],
        capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    assert "50 lines, 44 succeeded, 6 failed" in process.stderr
    assert "50/50" in process.stderr  # the progress bar reached the end
    outputs = [json.loads(line) for line in output_path.read_text().splitlines()]
    assert len(outputs) == 50
    assert len({output["id"] for output in outputs}) == 50
    for line, outcome, output in zip(lines, expected, outputs):
        if outcome == "ok":
            entry = json.loads(line)
            assert output["custom_id"] == entry["custom_id"]  # in input order
            assert output["error"] is None
            response = output["response"]
            assert response["status_code"] == 200, response
            body = response["body"]
            assert response["request_id"] == body["id"]
            if entry["url"] == "/v1/chat/completions":
                assert body["object"] == "chat.completion"
                assert body["choices"][0]["message"]["content"]
            elif entry["url"] == "/v1/completions":
                assert body["object"] == "text_completion" and body["choices"][0]["text"]
            elif entry["url"] == "/v1/embeddings":
                assert body["object"] == "list" and len(body["data"]) == 1
                assert abs(sum(x * x for x in body["data"][0]["embedding"]) - 1.0) < 1e-3
                continue
            else:
                assert body["object"] == "response" and body["output"][0]["content"][0]["text"]
            usage = body["usage"]
            assert 1 <= usage.get("completion_tokens", usage.get("output_tokens", 0)) <= MAX_TOKENS
        elif outcome.startswith("http_"):
            assert output["error"] is None
            assert output["response"]["status_code"] == int(outcome.removeprefix("http_"))
            assert output["response"]["body"]["error"]["message"]
        else:
            assert output["response"] is None
            assert output["error"]["code"] == outcome and output["error"]["message"]
    assert outputs[3]["custom_id"] is None  # the broken line has none to give
    assert outputs[25]["response"]["body"]["error"]["param"] == "max_tokens"
    assert "/v1/images" in outputs[10]["error"]["message"]


def test_fields_a_batch_cannot_serve_are_refused_per_line():
    import asyncio

    from pagedserve.entrypoints.openai.serving_responses import ResponsesRequest
    from pagedserve.entrypoints.run_batch import Endpoint, run_line

    async def never_called(request):
        raise AssertionError("a refused line reached the endpoint")

    urls = {"/v1/responses": Endpoint(ResponsesRequest, never_called,
                                      refused=("stream", "previous_response_id"))}
    for field, value in (("stream", True), ("previous_response_id", "resp_1")):
        line = json.dumps({"custom_id": field, "method": "POST", "url": "/v1/responses",
                           "body": {"input": "hi", field: value}})
        output = asyncio.run(run_line(line, urls))
        assert output["custom_id"] == field and output["error"] is None
        assert output["response"]["status_code"] == 400
        assert output["response"]["body"]["error"]["param"] == field
