"""How tools and tool turns reach a chat template, and what each tool_choice constrains."""

from __future__ import annotations

import json

import pytest

from pagedserve.entrypoints.openai import protocol as p
from pagedserve.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    JsonArrayToolParser,
    NamedFunctionParser,
)
from pagedserve.entrypoints.openai.tool_prompts import closed_schema, plan_tools, template_messages

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}}},
        "required": ["city"]}}}
TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def request(**fields) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate({"messages": TURNS, **fields})


def test_template_without_tools_gets_a_system_prompt_and_hermes_turns():
    req = request(tools=[TOOL])
    conversation, template_tools = template_messages(req.messages, req.tools, False)
    assert template_tools is None
    system = conversation[0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in system["content"] and "<tool_call>" in system["content"]
    assert conversation[2] == {"role": "assistant", "content":
                               '<tool_call>\n{"name": "get_weather", "arguments": '
                               '{"city": "Paris"}}\n</tool_call>'}
    assert conversation[3] == {"role": "user",
                               "content": "<tool_response>\nsunny\n</tool_response>"}
    assert all(isinstance(m["content"], str) for m in conversation)


def test_template_with_tools_gets_them_natively():
    req = request(tools=[TOOL])
    conversation, template_tools = template_messages(req.messages, req.tools, True)
    assert template_tools == [TOOL]
    assert conversation[2]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                            "arguments": {"city": "Paris"}}
    assert conversation[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_tool_choice_plans():
    assert plan_tools(request()).parser is None
    auto = plan_tools(request(tools=[TOOL]))
    assert isinstance(auto.parser, HermesToolParser) and auto.constraint is None
    none = plan_tools(request(tools=[TOOL], tool_choice="none"))
    assert none.parser is None and none.tools_in_prompt is None
    required = plan_tools(request(tools=[TOOL], tool_choice="required",
                                  parallel_tool_calls=False))
    assert isinstance(required.parser, JsonArrayToolParser)
    schema = required.constraint.json
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {
        "const": "get_weather"}
    named = plan_tools(request(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    assert isinstance(named.parser, NamedFunctionParser)
    assert named.constraint.json == closed_schema(TOOL["function"]["parameters"])
    with pytest.raises(ValueError, match="not among the tools"):
        plan_tools(request(tools=[TOOL], tool_choice={"type": "function",
                                                      "function": {"name": "other"}}))


def test_closed_schema_closes_every_object_with_properties():
    closed = closed_schema(TOOL["function"]["parameters"])
    assert closed["additionalProperties"] is False
    assert closed["properties"]["where"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["city"]
    open_schema = {"type": "object", "properties": {}, "additionalProperties": True}
    assert closed_schema(open_schema) == open_schema
    assert json.dumps(TOOL["function"]["parameters"]).count("additionalProperties") == 0
