"""Tool calling through the official `openai` client on the real default model: forced calls
(tool_choice "required" or a named function) always validate, "auto" parses the calls the model
chooses to make, streamed deltas reassemble into the non-streamed call, and a full round trip
(call, tool result, answer) works. Absurd tool lists are refused with a 400."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.entrypoints.utils import MODEL_NAME

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                  "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SAMPLING = dict(model=MODEL_NAME, temperature=0.8)


def _assert_valid_calls(message, allowed_names=tuple(SCHEMAS)) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed_names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_gives_valid_calls(server):
    async def run():
        async with server.async_openai() as aclient:
            return await asyncio.gather(*[
                aclient.chat.completions.create(messages=ASK, tools=TOOLS,
                                                tool_choice="required", max_tokens=400,
                                                **SAMPLING)
                for _ in range(10)])

    responses = asyncio.run(run())
    for response in responses:
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        _assert_valid_calls(choice.message)


def test_named_function_gives_valid_arguments(client):
    response = client.chat.completions.create(
        messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=TOOLS, n=8, seed=1,
        tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=60,
        **SAMPLING)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        assert [call.function.name for call in choice.message.tool_calls] == ["add"]
        _assert_valid_calls(choice.message, ("add",))


def test_no_parallel_calls_means_one_call(client):
    response = client.chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=4,
        seed=2, max_tokens=100, **SAMPLING)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _assert_valid_calls(choice.message)


# An earlier turn in which the assistant called a tool: the 135M model imitates its format
# (on its own it hardly ever calls a tool).
FEW_SHOT = [
    {"role": "user", "content": "What is the weather like in Paris today?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "user", "content": "What is the weather like in London today?"},
]


def test_auto_parses_the_calls_the_model_makes(client):
    response = client.chat.completions.create(messages=FEW_SHOT, tools=TOOLS, n=8, seed=3,
                                              max_tokens=60, **SAMPLING)
    called = [choice for choice in response.choices if choice.finish_reason == "tool_calls"]
    assert called, [choice.message.content for choice in response.choices]
    for choice in called:
        # Unconstrained, so only the format is guaranteed: a known name, an arguments object.
        for call in choice.message.tool_calls:
            assert call.function.name in SCHEMAS and call.id.startswith("call_")
            assert isinstance(json.loads(call.function.arguments), dict)
        assert "<tool_call>" not in (choice.message.content or "")
    for choice in response.choices:
        if choice.finish_reason != "tool_calls":
            assert not choice.message.tool_calls


def test_none_never_calls(client):
    response = client.chat.completions.create(messages=FEW_SHOT, tools=TOOLS, tool_choice="none",
                                              n=4, seed=3, max_tokens=40, **SAMPLING)
    for choice in response.choices:
        assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")


def _reassemble(chunks):
    calls, content, finish_reason = {}, "", None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                if delta.id is not None:
                    assert delta.index not in calls
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return content, [calls[index] for index in sorted(calls)], finish_reason


@pytest.mark.parametrize("messages,tool_choice", [
    (ASK, "required"),
    (ASK, {"type": "function", "function": {"name": "get_weather"}}),
    (FEW_SHOT, "auto"),
])
def test_streamed_calls_equal_non_streamed(client, messages, tool_choice):
    # One call keeps it short; several calls in one stream are covered by test_tool_parsers.
    params = dict(messages=messages, tools=TOOLS, tool_choice=tool_choice, seed=4,
                  max_tokens=150, parallel_tool_calls=False, **SAMPLING)
    full = client.chat.completions.create(**params).choices[0]
    content, calls, finish_reason = _reassemble(
        client.chat.completions.create(stream=True, **params))
    assert finish_reason == full.finish_reason
    assert calls == [{"name": call.function.name, "arguments": call.function.arguments}
                     for call in full.message.tool_calls or ()]
    assert content == (full.message.content or "")
    if tool_choice != "auto":
        assert calls


def test_round_trip(client):
    first = client.chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice={"type": "function",
                                                 "function": {"name": "get_weather"}},
        max_tokens=60, temperature=0, model=MODEL_NAME).choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    final = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=40, temperature=0, model=MODEL_NAME)
    answer = final.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    # The tool's result reached the model: with a different result the answer changes.
    other = list(messages[:-1]) + [dict(messages[-1], content=json.dumps(
        {"temperature": -5, "sky": "snowing heavily"}))]
    other_answer = client.chat.completions.create(
        messages=other, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0,
        model=MODEL_NAME).choices[0].message.content
    assert other_answer != answer.message.content


# ---- bad tool requests -------------------------------------------------------------------------


@pytest.mark.parametrize("fields,message", [
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(10_000)]},
     "at most 128 tools"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "description": "x" * 300_000}}]}, "characters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "distinct"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object",
                                    "properties": {"a": {"type": "bogus"}}}}}],
      "tool_choice": "required"}, "bogus"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "only one"),
])
def test_bad_tools_are_400(http, fields, message):
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": ASK, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text[:500]
    assert message in response.json()["error"]["message"], response.json()
