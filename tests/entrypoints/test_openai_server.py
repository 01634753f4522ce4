"""The OpenAI-compatible server driven by the official `openai` client: completions and chat,
streamed and not, n > 1, stop, logprobs, seeds, prefix-cache usage, and the small endpoints."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.entrypoints.utils import MAX_MODEL_LEN, MODEL_NAME
from tests.prompts import source_text

GREEDY = dict(model=MODEL_NAME, temperature=0)
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


def stream_text(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    """(choice index -> text, choice index -> finish_reason, usage) of a completions stream."""
    texts, finish_reasons, usage = {}, {}, None
    for chunk in chunks:
        if chunk.usage is not None:
            assert not chunk.choices, "the usage chunk carries no choices"
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index not in finish_reasons, "a chunk after finish_reason"
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finish_reasons[choice.index] = choice.finish_reason
    return texts, finish_reasons, usage


def chat_stream_text(chunks) -> tuple[dict[int, str], dict[int, str], object, list]:
    texts, finish_reasons, usage, first_deltas = {}, {}, None, {}
    for chunk in chunks:
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index not in finish_reasons, "a chunk after finish_reason"
            first_deltas.setdefault(choice.index, choice.delta)
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finish_reasons[choice.index] = choice.finish_reason
    return texts, finish_reasons, usage, first_deltas


# ---- small endpoints --------------------------------------------------------------------------


def test_models_version_health_metrics(client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].max_model_len == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert http.get("/version").json()["version"]
    assert http.get("/health").status_code == 200
    metrics = http.get("/metrics")
    assert metrics.status_code == 200
    assert "vllm:num_requests_running" in metrics.text


def test_tokenize_detokenize_round_trip(http, tokenizer):
    tokens = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT}).json()
    assert tokens["tokens"] == tokenizer.encode(PROMPT)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens["tokens"]}).json()
    assert text["prompt"] == PROMPT
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)


# ---- completions ------------------------------------------------------------------------------


def test_completion_and_prompt_forms(client, tokenizer):
    text = client.completions.create(prompt=PROMPT, max_tokens=8, **GREEDY)
    choice = text.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert text.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert text.usage.completion_tokens == 8
    assert text.usage.total_tokens == text.usage.prompt_tokens + 8
    # The same prompt as token ids, and in lists: one choice per prompt, in order.
    token_ids = tokenizer.encode(PROMPT)
    assert client.completions.create(prompt=token_ids, max_tokens=8, **GREEDY
                                     ).choices[0].text == choice.text
    other = "def fibonacci(n):"
    many = client.completions.create(prompt=[PROMPT, other], max_tokens=8, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == choice.text
    many_ids = client.completions.create(prompt=[token_ids, tokenizer.encode(other)],
                                         max_tokens=8, **GREEDY)
    assert [c.text for c in many_ids.choices] == [c.text for c in many.choices]
    assert many_ids.usage.completion_tokens == 16


def test_stream_equals_non_stream(client):
    full = client.completions.create(prompt=PROMPT, max_tokens=12, **GREEDY)
    chunks = client.completions.create(prompt=PROMPT, max_tokens=12, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    texts, finish_reasons, usage = stream_text(chunks)
    assert texts == {0: full.choices[0].text} and finish_reasons == {0: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, 12)

    full_chat = client.chat.completions.create(messages=MESSAGES, max_tokens=12, **GREEDY)
    chunks = client.chat.completions.create(messages=MESSAGES, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    texts, finish_reasons, usage, first_deltas = chat_stream_text(chunks)
    assert texts == {0: full_chat.choices[0].message.content}
    assert finish_reasons == {0: full_chat.choices[0].finish_reason}
    assert first_deltas[0].role == "assistant"
    assert usage.completion_tokens == full_chat.usage.completion_tokens


def test_n2_streamed_and_not(client):
    params = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=3)
    full = client.completions.create(**params)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.usage.completion_tokens == 16
    texts, finish_reasons, _ = stream_text(client.completions.create(stream=True, **params))
    # Seeded: the stream repeats the same two samples.
    assert texts == {c.index: c.text for c in full.choices}
    assert finish_reasons == {0: "length", 1: "length"}

    # Sequences that finish at different steps: a finished one is reported once.
    params = dict(params, prompt="Write a list of fruits:", n=4, max_tokens=24, stop=["\n"])
    full = client.completions.create(**params)
    texts, finish_reasons, _ = stream_text(client.completions.create(stream=True, **params))
    assert texts == {c.index: c.text for c in full.choices}
    assert finish_reasons == {c.index: c.finish_reason for c in full.choices}
    assert len({len(text) for text in texts.values()}) > 1, "all finished together"

    chunks = client.chat.completions.create(messages=MESSAGES, max_tokens=6, n=2, stream=True,
                                            model=MODEL_NAME, seed=5)
    texts, finish_reasons, _, first_deltas = chat_stream_text(chunks)
    assert set(texts) == set(finish_reasons) == {0, 1}
    assert all(delta.role == "assistant" for delta in first_deltas.values())


def test_stop_string(client):
    text = client.completions.create(prompt=PROMPT, max_tokens=16, **GREEDY).choices[0].text
    words = text.split()
    stop = words[min(2, len(words) - 1)]
    choice = client.completions.create(prompt=PROMPT, max_tokens=16, stop=[stop], **GREEDY
                                       ).choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.text == text[:text.index(stop)]


def test_completion_logprobs_and_echo(client):
    result = client.completions.create(prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert "".join(logprobs.tokens) == result.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the most likely
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(6)]

    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(prompt=PROMPT, max_tokens=6, logprobs=3, stream=True,
                                           **GREEDY):
        for key, values in streamed.items():
            values.extend(getattr(chunk.choices[0].logprobs, key))
    assert streamed == {key: getattr(logprobs, key) for key in streamed}

    echoed = client.completions.create(prompt=PROMPT, max_tokens=4, logprobs=1, echo=True,
                                       **GREEDY).choices[0]
    texts, _, _ = stream_text(client.completions.create(prompt=PROMPT, max_tokens=4, echo=True,
                                                        stream=True, **GREEDY))
    assert texts == {0: echoed.text}
    assert echoed.text.startswith(PROMPT)
    num_prompt_tokens = result.usage.prompt_tokens
    assert len(echoed.logprobs.tokens) == num_prompt_tokens + 4
    assert echoed.logprobs.token_logprobs[0] is None
    assert all(lp is not None for lp in echoed.logprobs.token_logprobs[1:])


def test_chat_logprobs_and_multi_turn(client, http):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]},
    ]
    result = client.chat.completions.create(messages=messages, max_tokens=5, logprobs=True,
                                            top_logprobs=3, **GREEDY)
    assert result.usage.prompt_tokens == http.post("/tokenize",
                                                   json={"messages": messages}).json()["count"]
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert "".join(entry.token for entry in content) == result.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        top = [t.logprob for t in entry.top_logprobs]
        assert top == sorted(top, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert bytes(entry.bytes).decode() == entry.token


def test_seed_reproducibility(client):
    params = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=1.0)
    first = client.completions.create(seed=1234, **params).choices[0].text
    assert client.completions.create(seed=1234, **params).choices[0].text == first
    assert client.completions.create(seed=4321, **params).choices[0].text != first


def test_cached_tokens_on_repeated_document(client):
    document = source_text(2500) + "\nQuestion: what does this module do?\nAnswer:"
    first = client.completions.create(prompt=document, max_tokens=2, **GREEDY)
    again = client.completions.create(prompt=document, max_tokens=2, **GREEDY)
    num_prompt_tokens = again.usage.prompt_tokens
    assert num_prompt_tokens > 500
    assert first.usage.prompt_tokens_details.cached_tokens < num_prompt_tokens // 2
    assert again.usage.prompt_tokens_details.cached_tokens >= num_prompt_tokens - 16


def test_sampling_extras_are_applied(client, tokenizer):
    forced = tokenizer.encode(" banana")[0]
    result = client.completions.create(
        prompt=PROMPT, max_tokens=4, logit_bias={str(forced): 100}, user="u1",
        presence_penalty=0.5, frequency_penalty=0.5, top_p=0.9,
        extra_body=dict(top_k=5, min_p=0.01, repetition_penalty=1.1, min_tokens=4,
                        ignore_eos=True, stop_token_ids=[0], priority=1, cache_salt="s"),
        **GREEDY)
    assert result.choices[0].text == " banana" * 4


def test_duplicate_client_request_ids(client):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(client.completions.create, prompt=PROMPT, max_tokens=4,
                               extra_body={"request_id": "same-id"}, **GREEDY) for _ in range(2)]
        results = [f.result() for f in futures]
    assert [r.id for r in results] == ["same-id", "same-id"]
    assert results[0].choices[0].text == results[1].choices[0].text


def test_errors_reach_the_client_typed(server, client):
    import openai

    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert error.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(messages=MESSAGES, n=17, **GREEDY)
    assert error.value.param == "n"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong").models.list()
