"""Structured outputs through the official `openai` client on the real default model: JSON
schemas of increasing difficulty, regexes and choices always conform at temperature 0.8, and the
same prompts without the constraint do not (so the constraint is what acted)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import pytest

from tests.entrypoints.utils import API_KEY, MODEL_NAME

NUM_SAMPLES = 12
SAMPLING = dict(model=MODEL_NAME, temperature=0.8)


def _object(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


_NAME = {"type": "string", "minLength": 1, "maxLength": 24}
_POINT = _object({"x": {"type": "integer", "minimum": -100, "maximum": 100},
                  "y": {"type": "integer", "minimum": -100, "maximum": 100}})
_TASK = _object({"title": {"type": "string", "minLength": 1, "maxLength": 30},
                 "priority": {"enum": ["low", "medium", "high"]},
                 "done": {"type": "boolean"}})

# (prompt, schema), easiest first. Strings, arrays and numbers' decimals (multipleOf) are bounded
# so that every sample can finish within max_tokens: a sample cut off by the length limit is not
# valid JSON, and a small model at temperature 0.8 will happily write 0.99999... forever. (Binary
# fractions: jsonschema checks multipleOf in floating point, where 32.8 is no multiple of 0.1.)
SCHEMAS = [
    ("Answer as JSON: what is the capital of France?",
     _object({"answer": _NAME})),
    ("Give the age of a person as JSON.",
     _object({"age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("Describe the sky's color as JSON.",
     _object({"color": {"enum": ["red", "green", "blue", "gray"]}, "bright": {"type": "boolean"}})),
    ("Report today's weather as JSON.",
     _object({"temperature": {"type": "number", "minimum": -50, "maximum": 60,
                              "multipleOf": 0.5},
              "unit": {"enum": ["C", "F"]}})),
    ("List some tags for a blog post about cooking as JSON.",
     _object({"tags": {"type": "array", "items": {"type": "string", "minLength": 1,
                                                  "maxLength": 16},
                       "minItems": 1, "maxItems": 3}})),
    ("Describe a person and where they live as JSON.",
     _object({"person": _object({"name": _NAME,
                                 "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
              "city": _NAME})),
    ("List items of a shopping cart with prices as JSON.",
     _object({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                        "items": _object({"name": _NAME,
                                          "price": {"type": "number", "minimum": 0,
                                                    "maximum": 1000, "multipleOf": 0.25}})}})),
    ("Give a book's title, and optionally its year and author, as JSON.",
     _object({"title": _NAME, "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
              "author": _NAME}, required=["title"])),
    ("Give a line segment as JSON.",
     {"$defs": {"point": _POINT},
      **_object({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})}),
    ("Plan a project with a few tasks as JSON.",
     {"$defs": {"task": _TASK},
      **_object({"project": {"type": "string", "pattern": "^[A-Z][a-z]{2,10}$"},
                 "tasks": {"type": "array", "items": {"$ref": "#/$defs/task"},
                           "minItems": 1, "maxItems": 2},
                 "status": {"anyOf": [{"type": "null"},
                                      {"enum": ["planned", "active", "done"]}]}})}),
]


def _conforms(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def _chat_samples(server, prompt: str, num: int, **fields) -> list:
    """`num` concurrent single-choice chat requests; returns their choices."""
    async with server.async_openai() as aclient:
        responses = await asyncio.gather(*[
            aclient.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **SAMPLING, **fields)
            for _ in range(num)])
    return [response.choices[0] for response in responses]


def test_json_schemas_always_validate(server):
    """10 schemas x 12 samples at temperature 0.8, all at once: every output validates."""

    async def run_all():
        return await asyncio.gather(*[
            _chat_samples(server, prompt, NUM_SAMPLES, max_tokens=200, response_format={
                "type": "json_schema",
                "json_schema": {"name": f"schema{index}", "schema": schema, "strict": True}})
            for index, (prompt, schema) in enumerate(SCHEMAS)])

    results = asyncio.run(run_all())
    for (prompt, schema), choices in zip(SCHEMAS, results):
        assert len(choices) == NUM_SAMPLES
        for choice in choices:
            assert choice.finish_reason == "stop", (prompt, choice.message.content)
            assert _conforms(choice.message.content, schema), (prompt, choice.message.content)
        # Sampling at 0.8 really sampled: not one output twelve times.
        assert len({c.message.content for c in choices}) > 1 or len(schema["properties"]) == 1


def test_json_schemas_unconstrained_do_not_conform(server):
    """The same prompts without the constraint: free text that fails its schema at least once
    (the 135M model rarely writes exactly the schema's JSON on its own)."""

    async def run_all():
        return await asyncio.gather(*[_chat_samples(server, prompt, 1, max_tokens=60, seed=0)
                                      for prompt, _ in SCHEMAS])

    results = asyncio.run(run_all())
    failures = [prompt for (prompt, schema), choices in zip(SCHEMAS, results)
                if not _conforms(choices[0].message.content, schema)]
    assert failures, "every unconstrained output already conformed: the test proves nothing"


REGEXES = [
    ("What time is it? Answer as HH:MM.", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("Give a date in ISO format.", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("Write an email address.", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org|net)"),
]


@pytest.mark.parametrize("prompt,regex", REGEXES)
def test_regex_always_matches(client, prompt, regex):
    messages = [{"role": "user", "content": prompt}]
    constrained = client.chat.completions.create(
        messages=messages, n=16, max_tokens=30, seed=1, **SAMPLING,
        extra_body={"structured_outputs": {"regex": regex}})
    for choice in constrained.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch(regex, choice.message.content), choice.message.content
    free = client.chat.completions.create(messages=messages, n=4, max_tokens=30, seed=1,
                                          **SAMPLING)
    assert not all(re.fullmatch(regex, c.message.content) for c in free.choices)


def test_regex_on_completions_and_stream(client):
    regex = r"[0-9]{3}-[0-9]{4}"
    params = dict(prompt="My phone number is", max_tokens=20, seed=2, n=4, **SAMPLING,
                  extra_body={"structured_outputs": {"regex": regex}})
    full = client.completions.create(**params)
    assert all(re.fullmatch(regex, c.text) for c in full.choices)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **params):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    # Seeded: the stream draws the same samples as the full response.
    assert streamed == {c.index: c.text for c in full.choices}


def test_choice_always_picks_one(client):
    options = ["positive", "negative", "neutral"]
    messages = [{"role": "user", "content": "Is 'I loved this film' positive or negative?"}]
    constrained = client.chat.completions.create(
        messages=messages, n=16, max_tokens=10, **SAMPLING,
        extra_body={"structured_outputs": {"choice": options}})
    assert all(c.message.content in options for c in constrained.choices)
    assert all(c.finish_reason == "stop" for c in constrained.choices)
    free = client.chat.completions.create(messages=messages, n=4, max_tokens=10, seed=0,
                                          **SAMPLING)
    assert not all(c.message.content in options for c in free.choices)


def test_grammar_and_json_object(client):
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,2}/'
    result = client.completions.create(
        prompt="Q: What is 6 times 7?\nA:", max_tokens=20, n=4, seed=3, **SAMPLING,
        extra_body={"structured_outputs": {"grammar": grammar}})
    for choice in result.choices:
        assert re.fullmatch(r"The answer is [1-9][0-9]{0,2}\.", choice.text), choice.text
        assert choice.finish_reason == "stop"

    result = client.chat.completions.create(
        messages=[{"role": "user", "content": "Describe a cat in JSON."}],
        response_format={"type": "json_object"}, max_tokens=200, n=4, seed=4, **SAMPLING)
    for choice in result.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # any object may be long; what was written is still an object's prefix
            assert choice.message.content.lstrip().startswith("{")


def test_streamed_json_equals_full(client):
    prompt, schema = SCHEMAS[5]
    params = dict(messages=[{"role": "user", "content": prompt}], max_tokens=200, seed=5,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "p", "schema": schema}}, **SAMPLING)
    full = client.chat.completions.create(**params).choices[0]
    text = "".join(chunk.choices[0].delta.content or ""
                   for chunk in client.chat.completions.create(stream=True, **params)
                   if chunk.choices)
    assert text == full.message.content and _conforms(text, schema)


# ---- bad constraints ------------------------------------------------------------------------


def _chat_body(**fields) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hi"}], **fields}


@pytest.mark.parametrize("fields,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "JSON schema"),
    ({"structured_outputs": {"regex": "[.*"}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs", "empty"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs",
     "missing_rule"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "only one"),
])
def test_invalid_constraint_is_400(http, fields, param, message):
    response = http.post("/v1/chat/completions", json=_chat_body(**fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert message in error["message"], error["message"]
    assert "Traceback" not in error["message"]


def test_pathological_regexes_complete_or_400(http):
    """Backtracking bombs are linear for llguidance's automata: the request completes in time.
    A regex whose automaton would be huge hits the parser's limits and is refused."""
    response = http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "max_tokens": 30,
        "temperature": 0, "structured_outputs": {"regex": "(a+)+b"}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert re.fullmatch(r"a*b?", choice["text"])
    if choice["finish_reason"] == "stop":
        assert re.fullmatch("(a+)+b", choice["text"])
    response = http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": "x", "max_tokens": 4,
        "structured_outputs": {"regex": "(a{1,200}){1,200}(b{1,200}){1,200}[a-z]{5000}"}})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert "invalid regex" in response.json()["error"]["message"]


def test_flood_of_distinct_schemas(server, http):
    """500 distinct schemas: each compiles once, the cache stays within its bound, and a plain
    greedy request gives the same text before and during the flood."""
    engine = server.async_llm.engine
    manager = engine.structured_output_manager
    probe = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 12,
             "temperature": 0}
    before = http.post("/v1/completions", json=probe).json()["choices"][0]["text"]
    compiles_before = manager.stats().num_compiles

    async def flood():
        limit = asyncio.Semaphore(64)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as aclient:
            async def one(index: int):
                schema = {"type": "object", "properties": {f"key{index}": {"type": "integer"}},
                          "required": [f"key{index}"], "additionalProperties": False}
                async with limit:
                    return await aclient.post("/v1/completions", json={
                        "model": MODEL_NAME, "prompt": "{", "max_tokens": 3,
                        "structured_outputs": {"json": schema}})

            probe_during = asyncio.create_task(aclient.post("/v1/completions", json=probe))
            responses = await asyncio.gather(*[one(index) for index in range(500)])
            return responses, await probe_during

    responses, probe_response = asyncio.run(flood())
    assert [r.status_code for r in responses] == [200] * 500
    for response in responses:
        assert response.json()["choices"][0]["text"].lstrip().startswith("{")
    assert probe_response.json()["choices"][0]["text"] == before
    assert manager.num_cached_grammars <= manager.config.max_cached_grammars
    assert manager.stats().num_compiles - compiles_before == 500


def test_metrics_count_constrained_requests(http):
    def value(text: str, name: str) -> float:
        match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    before = http.get("/metrics").text
    response = http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": "Count:", "max_tokens": 8, "n": 2,
        "structured_outputs": {"regex": "[0-9]{1,3} metrics"}})
    assert response.status_code == 200
    after = http.get("/metrics").text
    for _ in range(100):  # the engine thread records after the step that finished the request
        if value(after, "pagedserve:structured_output_requests_total") >= value(
                before, "pagedserve:structured_output_requests_total") + 2:
            break
        time.sleep(0.05)
        after = http.get("/metrics").text
    assert value(after, "pagedserve:structured_output_requests_total") >= value(
        before, "pagedserve:structured_output_requests_total") + 2
    assert value(after, "pagedserve:grammar_compile_time_seconds_count") > value(
        before, "pagedserve:grammar_compile_time_seconds_count")
    assert value(after, "pagedserve:grammar_mask_time_seconds_count") > value(
        before, "pagedserve:grammar_mask_time_seconds_count")
