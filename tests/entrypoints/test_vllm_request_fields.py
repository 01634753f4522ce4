"""vLLM's request fields over HTTP on the default model (the directory's shared server): each one
first shown to act, then checked. allowed_token_ids, bad_words, truncate_prompt_tokens,
prompt_logprobs, return_token_ids, stream_options.continuous_usage_stats, the guided_* aliases of
structured_outputs, and unknown fields (served, warned about once per name)."""

from __future__ import annotations

import json
import logging
import re
import uuid

import httpx
import jsonschema
import pytest

from tests.entrypoints.utils import API_KEY, MAX_MODEL_LEN, MODEL_NAME

GREEDY = dict(model=MODEL_NAME, temperature=0)
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http_client:
        yield http_client


@pytest.fixture(autouse=True)
def idle_after(server):
    yield
    server.wait_until_idle()


def complete(http, **body) -> dict:
    response = http.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, **body})
    assert response.status_code == 200, response.text
    return response.json()


def sse_chunks(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line[len("data: "):] for line in response.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def contains(sequence: list[int], part: list[int]) -> bool:
    return any(sequence[i:i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


# ---- sampling constraints ---------------------------------------------------------------------


def test_allowed_token_ids_restrict_every_sampled_token(http, tokenizer):
    free = complete(http, max_tokens=8, return_token_ids=True)["choices"][0]["token_ids"]
    allowed = sorted({tokenizer.encode(word, add_special_tokens=False)[0]
                      for word in (" the", " a", " big", " city", ".", ",")})
    assert set(free) - set(allowed), "pick an allowed set the free output leaves"
    for temperature in (0, 1.0):
        choice = complete(http, max_tokens=8, temperature=temperature, seed=1,
                          allowed_token_ids=allowed, return_token_ids=True)["choices"][0]
        assert choice["token_ids"] and set(choice["token_ids"]) <= set(allowed)


def test_bad_words_are_never_generated_and_output_matches_until_then(http, tokenizer):
    free = complete(http, max_tokens=12, return_token_ids=True)["choices"][0]
    word = free["text"].split()[0]  # the greedy output's first word, e.g. "Paris"
    sequences = [tokenizer.encode(variant, add_special_tokens=False)
                 for variant in (word, " " + word)]
    start = next(i for i in range(len(free["token_ids"]))
                 if any(free["token_ids"][i:i + len(s)] == s for s in sequences))
    banned = complete(http, max_tokens=12, bad_words=[word],
                      return_token_ids=True)["choices"][0]["token_ids"]
    assert not any(contains(banned, sequence) for sequence in sequences)
    # Identical up to the bad word's last token, which is where the ban first bites.
    last = start + next(len(s) for s in sequences
                        if free["token_ids"][start:start + len(s)] == s) - 1
    assert banned[:last] == free["token_ids"][:last]
    assert banned[last] != free["token_ids"][last]


def test_invalid_allowed_token_ids_and_bad_words_are_400(http):
    for body, param in (({"allowed_token_ids": []}, "allowed_token_ids"),
                        ({"allowed_token_ids": [10 ** 9]}, "allowed_token_ids"),
                        ({"bad_words": [" "]}, "bad_words")):
        response = http.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_truncate_prompt_tokens_keeps_the_last_n(http, tokenizer):
    long_prompt = "one two three four five six seven eight nine ten eleven twelve"
    full = tokenizer.encode(long_prompt)
    body = dict(prompt=long_prompt, max_tokens=2, return_token_ids=True)
    untouched = complete(http, **body)
    assert untouched["usage"]["prompt_tokens"] == len(full)
    response = complete(http, truncate_prompt_tokens=5, **body)
    assert response["usage"]["prompt_tokens"] == 5
    assert response["choices"][0]["prompt_token_ids"] == full[-5:]
    chat = http.post("/v1/chat/completions", json={**GREEDY, "messages": MESSAGES,
                                                   "max_tokens": 2, "truncate_prompt_tokens": 4})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 4
    assert complete(http, truncate_prompt_tokens=-1, **body)["usage"]["prompt_tokens"] == len(full)
    for bad in (0, -2, MAX_MODEL_LEN + 1):
        response = http.post("/v1/completions", json={**GREEDY, **body,
                                                      "truncate_prompt_tokens": bad})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "truncate_prompt_tokens"


# ---- prompt logprobs, token ids, usage --------------------------------------------------------


def test_prompt_logprobs_equal_the_offline_engines(http, tokenizer, make_llm):
    from pagedserve.sampling_params import SamplingParams

    num_top = 2
    choice = complete(http, max_tokens=1, prompt_logprobs=num_top)["choices"][0]
    positions = choice["prompt_logprobs"]
    prompt_ids = tokenizer.encode(PROMPT)
    assert len(positions) == len(prompt_ids) and positions[0] is None
    offline = make_llm().generate([PROMPT], SamplingParams(temperature=0, max_tokens=1,
                                                           prompt_logprobs=num_top))[0]
    for token_id, served, expected in zip(prompt_ids[1:], positions[1:],
                                          offline.prompt_logprobs[1:]):
        assert str(token_id) in served and len(served) <= num_top + 1
        assert {int(k) for k in served} == set(expected)
        for key, entry in served.items():
            assert entry["logprob"] == pytest.approx(expected[int(key)].logprob, abs=1e-4)
            assert entry["rank"] == expected[int(key)].rank


def test_chat_prompt_logprobs_and_token_ids_sit_on_the_response(http, tokenizer):
    response = http.post("/v1/chat/completions", json={
        **GREEDY, "messages": MESSAGES, "max_tokens": 4, "prompt_logprobs": 0,
        "return_token_ids": True}).json()
    prompt_ids = response["prompt_token_ids"]
    assert len(response["prompt_logprobs"]) == len(prompt_ids)
    assert all(list(position) == [str(token_id)] for token_id, position
               in zip(prompt_ids[1:], response["prompt_logprobs"][1:]))
    choice = response["choices"][0]
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) \
        == choice["message"]["content"]


def test_prompt_logprobs_with_stream_is_400(http):
    response = http.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, "stream": True,
                                                  "prompt_logprobs": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"


def test_return_token_ids_match_the_tokenizer_streamed_and_not(http, tokenizer):
    choice = complete(http, max_tokens=6, return_token_ids=True)["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode(PROMPT)
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    assert "token_ids" not in complete(http, max_tokens=2)["choices"][0]  # only when asked

    chunks = sse_chunks(http, "/v1/completions", {**GREEDY, "prompt": PROMPT, "max_tokens": 6,
                                                  "return_token_ids": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]

    chat = http.post("/v1/chat/completions", json={**GREEDY, "messages": MESSAGES,
                                                   "max_tokens": 6, "return_token_ids": True})
    chat = chat.json()
    chunks = sse_chunks(http, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES,
                                                       "max_tokens": 6, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids", [])]
    assert streamed == chat["choices"][0]["token_ids"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
])
def test_continuous_usage_stats_put_usage_on_every_chunk(http, path, body):
    chunks = sse_chunks(http, path, {**GREEDY, **body, "max_tokens": 5, "ignore_eos": True,
                                     "stream_options": {"include_usage": True,
                                                        "continuous_usage_stats": True}})
    assert all(chunk.get("usage") for chunk in chunks)
    completion_tokens = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 5
    assert len(set(completion_tokens)) > 2, "usage did not grow chunk by chunk"
    assert len({chunk["usage"]["prompt_tokens"] for chunk in chunks}) == 1
    plain = sse_chunks(http, path, {**GREEDY, **body, "max_tokens": 5,
                                    "stream_options": {"include_usage": True}})
    assert [bool(chunk.get("usage")) for chunk in plain].count(True) == 1


# ---- the guided_* aliases ---------------------------------------------------------------------

POINT_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                               "y": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_guided_json_through_the_openai_client(client):
    def ask(extra_body: dict) -> str:
        return client.chat.completions.create(
            model=MODEL_NAME, temperature=0.8, seed=3, max_tokens=40,
            messages=[{"role": "user", "content": "Give a point as JSON."}],
            extra_body=extra_body).choices[0].message.content

    def conforms(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), POINT_SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    # Seeded, so the same draws each run: free text does not conform, guided_json does, and
    # without a whitespace pattern this draw has spaces.
    assert not conforms(ask({}))
    guided = ask({"guided_json": POINT_SCHEMA})
    assert conforms(guided) and " " in guided
    for schema in (POINT_SCHEMA, json.dumps(POINT_SCHEMA)):
        text = ask({"guided_json": schema, "guided_decoding_backend": "xgrammar",
                    "guided_whitespace_pattern": ""})
        jsonschema.validate(json.loads(text), POINT_SCHEMA)
        assert text.startswith("{\"") and " " not in text  # the whitespace pattern acted
    response = client.completions.create(
        model=MODEL_NAME, prompt="A point as JSON:", temperature=0.8, seed=3, max_tokens=40,
        extra_body={"structured_outputs": {"json": POINT_SCHEMA, "whitespace_pattern": ""}})
    text = response.choices[0].text
    jsonschema.validate(json.loads(text), POINT_SCHEMA)
    assert " " not in text


def test_guided_choice_and_regex_through_the_openai_client(client):
    choices = ["alpha", "bravo", "charlie"]
    for seed in range(3):
        response = client.completions.create(
            model=MODEL_NAME, prompt="Pick a word:", temperature=1.0, seed=seed, max_tokens=8,
            extra_body={"guided_choice": choices})
        assert response.choices[0].text in choices
    regex = r"[0-9]{3}-[a-z]{2}"
    response = client.completions.create(model=MODEL_NAME, prompt="Code:", temperature=1.0,
                                         seed=0, max_tokens=12, extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, response.choices[0].text)


def test_guided_grammar_and_conflicts(http):
    grammar = 'start: "yes" | "no"'
    choice = complete(http, max_tokens=4, guided_grammar=grammar)["choices"][0]
    assert choice["text"] in ("yes", "no")
    for body in ({"guided_regex": "a+", "guided_choice": ["a"]},
                 {"guided_regex": "a+", "structured_outputs": {"regex": "b+"}}):
        response = http.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, **body})
        assert response.status_code == 400 and "give only one of" in response.text
    broken = http.post("/v1/completions", json={**GREEDY, "prompt": PROMPT,
                                                "guided_regex": "(unclosed"})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "guided_regex"


# ---- unknown fields ---------------------------------------------------------------------------


def test_unknown_fields_are_served_and_warned_about_once_per_name(http, caplog):
    name = f"not_a_field_{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.WARNING, logger="pagedserve.entrypoints.openai.request_fields")
    for _ in range(2):
        body = {name: 1, "messages": [{**MESSAGES[0], name: 2}]}
        response = http.post("/v1/chat/completions", json={**GREEDY, **body, "max_tokens": 2})
        assert response.status_code == 200, response.text
    warnings = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert repr(name) in warnings[0] and repr(f"messages.{name}") in warnings[0]
