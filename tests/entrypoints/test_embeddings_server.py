"""POST /v1/embeddings through the official openai client, on the package's shared server (the
default model, fp32, last-token pooling): shape and norm, dimensions, base64, a batch against the
same inputs one by one, similar sentences closer than unrelated ones, embeddings while a greedy
completion streams (its output unchanged, every block free after), and OpenAI-style 400s.
"""

from __future__ import annotations

import asyncio
import base64
import threading

import httpx
import numpy as np
import pytest

from tests.entrypoints.utils import API_KEY, MAX_MODEL_LEN, MODEL_NAME

HIDDEN_SIZE = 576
"""SmolLM2-135M's embedding size."""
SENTENCES = ["The cat sat on the mat.", "How do I bake bread at home?",
             "Photosynthesis converts sunlight into chemical energy.", "def add(a, b): return a + b"]
BATCH_TOLERANCE = 1e-5
"""fp32 is not batch-invariant either: a batch's matmuls see more rows, which changes the
kernels' blocking and so the summation order. Measured: up to 4e-7 apart on these normalized
vectors (components around 1e-2); 1e-5 leaves room for other CPUs' kernels."""
PAIRS = [  # (anchor, a paraphrase, an unrelated sentence)
    ("The cat sat on the mat.", "A cat was sitting on the rug.",
     "The stock market fell sharply today."),
    ("How do I bake bread at home?", "What is a good recipe for homemade bread?",
     "The train to Paris leaves at noon."),
    ("The weather is sunny and warm today.", "It is a bright, hot day outside.",
     "Python is a programming language."),
    ("The soup needs more salt.", "This dish is too bland; add some salt.",
     "The rocket launched into orbit last night."),
]


def vectors(response) -> np.ndarray:
    assert [item.index for item in response.data] == list(range(len(response.data)))
    return np.array([item.embedding for item in response.data], dtype=np.float32)


def test_shape_norm_usage_and_base64(server, tokenizer):
    client = server.openai()
    # The client asks for base64 by default and decodes it; ask for floats explicitly too.
    as_base64 = client.embeddings.create(model=MODEL_NAME, input=SENTENCES)
    as_floats = client.embeddings.create(model=MODEL_NAME, input=SENTENCES,
                                         encoding_format="float")
    floats = vectors(as_floats)
    assert floats.shape == (len(SENTENCES), HIDDEN_SIZE)
    np.testing.assert_allclose(np.linalg.norm(floats, axis=1), 1.0, atol=1e-5)
    # base64 carries the same float32 values, bit for bit.
    np.testing.assert_array_equal(vectors(as_base64), floats)
    num_tokens = sum(len(tokenizer.encode(text)) for text in SENTENCES)
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == num_tokens
    assert as_floats.model == MODEL_NAME and as_floats.object == "list"
    # The raw body: the base64 string is little-endian float32 (one input alone, both ways).
    raw = httpx.post(server.base_url + "/v1/embeddings", headers=_auth(), json={
        "model": MODEL_NAME, "input": SENTENCES[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    alone = client.embeddings.create(model=MODEL_NAME, input=SENTENCES[0],
                                     encoding_format="float")
    np.testing.assert_array_equal(decoded, vectors(alone)[0])
    assert raw["data"][0]["object"] == "embedding" and raw["id"].startswith("embd-")


def test_dimensions_truncate_then_normalize(server):
    client = server.openai()
    full = vectors(client.embeddings.create(model=MODEL_NAME, input=SENTENCES[:2]))
    short = vectors(client.embeddings.create(model=MODEL_NAME, input=SENTENCES[:2],
                                             dimensions=64))
    assert short.shape == (2, 64)
    expected = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-6)


def test_a_batch_equals_its_inputs_one_by_one(server, tokenizer):
    client = server.openai()
    token_ids = [tokenizer.encode(text) for text in SENTENCES]
    batch = vectors(client.embeddings.create(model=MODEL_NAME, input=token_ids))
    alone = np.concatenate([vectors(client.embeddings.create(model=MODEL_NAME, input=ids))
                            for ids in token_ids])
    np.testing.assert_allclose(batch, alone, atol=BATCH_TOLERANCE, rtol=0)


def test_similar_sentences_score_higher_than_unrelated_ones(server):
    client = server.openai()
    for anchor, similar, unrelated in PAIRS:
        a, s, u = vectors(client.embeddings.create(model=MODEL_NAME,
                                                   input=[anchor, similar, unrelated]))
        assert a @ s > a @ u, (anchor, float(a @ s), float(a @ u))


def test_embeddings_while_a_completion_streams_leave_it_unchanged(server):
    """Embeddings sent while a greedy completion streams run in the same engine steps; the
    completion's text equals its text alone, and every KV block is free afterwards."""
    request = dict(model=MODEL_NAME, prompt="Once upon a time, in a small village,",
                   max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    client = server.async_openai()
    scheduled: dict[int, set[str]] = {}
    lock = threading.Lock()

    def record(events) -> None:  # runs on the engine thread
        with lock:
            for event in events:
                if type(event).__name__ == "RequestScheduled":
                    scheduled.setdefault(event.step, set()).add(event.req_id)

    async def run() -> tuple[str, str, int]:
        alone = (await client.completions.create(**request)).choices[0].text
        stream = await client.completions.create(**request, stream=True)
        chunks = [await anext(stream)]  # the completion is running now

        async def consume() -> None:
            async for chunk in stream:
                chunks.append(chunk)

        consumer = asyncio.create_task(consume())
        num_embedded = 0
        while not consumer.done():  # keep embedding for as long as it generates
            response = await client.embeddings.create(model=MODEL_NAME, input=SENTENCES)
            assert len(response.data) == len(SENTENCES)
            num_embedded += 1
        await consumer
        return alone, "".join(c.choices[0].text for c in chunks), num_embedded

    unsubscribe = server.async_llm.engine.events.subscribe(record)
    try:
        alone, streamed, num_embedded = asyncio.run(run())
    finally:
        unsubscribe()
    assert num_embedded >= 1
    # The feature acted: some step computed an embedding input beside the completion.
    assert any(any(r.startswith("cmpl-") for r in ids) and any(r.startswith("embd-") for r in ids)
               for ids in scheduled.values())
    assert streamed == alone
    server.wait_until_idle()  # no request left, every KV block free


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": 5}, "input"),
    ({"input": [1] * (MAX_MODEL_LEN + 1)}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": HIDDEN_SIZE + 1}, "dimensions"),
    ({"input": "hi", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
])
def test_bad_requests_get_openai_400s(server, body, param):
    response = httpx.post(server.base_url + "/v1/embeddings", headers=_auth(),
                          json={"model": MODEL_NAME, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_unknown_model_is_404_and_truncation_keeps_the_last_tokens(server, tokenizer):
    response = httpx.post(server.base_url + "/v1/embeddings", headers=_auth(),
                          json={"model": "nope", "input": "hi"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    client = server.openai()
    ids = tokenizer.encode(SENTENCES[2])
    truncated = vectors(client.embeddings.create(
        model=MODEL_NAME, input=ids, extra_body={"truncate_prompt_tokens": 4}))
    tail = vectors(client.embeddings.create(model=MODEL_NAME, input=ids[-4:]))
    np.testing.assert_allclose(truncated, tail, atol=BATCH_TOLERANCE, rtol=0)


def _auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_pooling_type_mean_from_the_flag(server):
    """--pooling-type mean reaches the endpoint; mean vectors are unit-norm and not the last
    token's (the engine tests check both against transformers)."""
    import argparse

    from pagedserve.entrypoints.openai.api_server import ServerConfig, add_cli_args
    from pagedserve.entrypoints.openai.protocol_embeddings import EmbeddingRequest
    from pagedserve.entrypoints.openai.serving_embeddings import EmbeddingServing

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    config = ServerConfig.from_cli_args(parser.parse_args(["--pooling-type", "mean"]))
    assert config.pooling_type == "mean"
    mean_serving = EmbeddingServing(server.app.state.embeddings.serving, config.pooling_type)
    request = EmbeddingRequest(input=SENTENCES[:2], encoding_format="float")
    mean = np.array([d.embedding for d in asyncio.run(mean_serving.create_embedding(request)).data])
    last = vectors(server.openai().embeddings.create(model=MODEL_NAME, input=SENTENCES[:2]))
    np.testing.assert_allclose(np.linalg.norm(mean, axis=1), 1.0, atol=1e-5)
    assert np.abs(mean - last).max() > 1e-2
