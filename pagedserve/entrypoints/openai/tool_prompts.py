"""Tools into the prompt, and tool_choice into a constraint and a parser.

A chat template that renders `tools` itself (Qwen2.5's) gets the tools and the tool turns in
the HF convention. One that does not (SmolLM2's ChatML) gets a system message describing the
tools and asking for Hermes-style `<tool_call>` blocks; earlier calls are written back in that
format and tool results as `<tool_response>` user turns, so the model sees its own convention.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedserve.entrypoints.openai import protocol as p
from pagedserve.entrypoints.openai.tool_parsers import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    HermesToolParser,
    JsonArrayToolParser,
    NamedFunctionParser,
    ToolParser,
)
from pagedserve.sampling_params import StructuredOutputsParams

MAX_PARALLEL_TOOL_CALLS = 8
"""Most calls a tool_choice="required" answer may hold (its grammar's array bound)."""

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def closed_schema(schema: Any) -> Any:
    """A copy of a JSON schema whose objects with listed properties allow no others.

    The outputs it allows all validate against the original; forced tool calls use it so that a
    small model cannot wander off into invented properties until it runs out of tokens (OpenAI's
    strict mode demands the same of the schema itself).
    """
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_schema(value) if key not in ("enum", "const", "default", "examples")
              else value for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def tools_system_prompt(tools: list[p.ChatTool]) -> str:
    lines = "\n".join(json.dumps(tool.model_dump(by_alias=True, exclude_none=True),
                                 ensure_ascii=False) for tool in tools)
    return (
        "You are a function calling AI model. You may call one or more functions to assist "
        "with the user query. The functions are listed within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call a function, reply with a JSON object holding the function name and its "
        f"arguments within {TOOL_CALL_START}{TOOL_CALL_END} XML tags:\n"
        f'{TOOL_CALL_START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
        f"{TOOL_CALL_END}"
    )


def _arguments_value(arguments: str) -> Any:
    """Arguments JSON text as a value (templates serialize it themselves); raw text if broken."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def template_messages(messages: list[p.ChatMessage], tools: list[p.ChatTool] | None,
                      template_has_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages for the chat template, its `tools` argument)."""
    if template_has_tools:
        conversation = []
        for message in messages:
            entry: dict[str, Any] = {
                "role": "system" if message.role == "developer" else message.role,
                "content": message.text(),
            }
            if message.tool_calls:
                entry["tool_calls"] = [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.function.name,
                                  "arguments": _arguments_value(call.function.arguments)}}
                    for call in message.tool_calls]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            conversation.append(entry)
        tool_dicts = ([tool.model_dump(by_alias=True, exclude_none=True) for tool in tools]
                      if tools else None)
        return conversation, tool_dicts

    conversation = []
    for message in messages:
        role, content = message.role, message.text()
        if role == "developer":
            role = "system"
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if message.tool_calls:
            calls = [
                f"{TOOL_CALL_START}\n"
                + json.dumps({"name": call.function.name,
                              "arguments": _arguments_value(call.function.arguments)},
                             ensure_ascii=False)
                + f"\n{TOOL_CALL_END}"
                for call in message.tool_calls]
            content = "\n".join(([content] if content else []) + calls)
        conversation.append({"role": role, "content": content})
    if tools:
        prompt = tools_system_prompt(tools)
        if conversation and conversation[0]["role"] == "system":
            conversation[0]["content"] = f"{conversation[0]['content']}\n\n{prompt}"
        else:
            conversation.insert(0, {"role": "system", "content": prompt})
    return conversation, None


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request handles tools."""

    tools_in_prompt: list[p.ChatTool] | None
    parser: ToolParser | None
    """None: no tool calls are parsed (no tools, or tool_choice "none")."""
    constraint: StructuredOutputsParams | None
    """Forces a call (tool_choice "required" or a named function)."""


def plan_tools(request: p.ChatCompletionRequest) -> ToolPlan:
    """ValueError names what is wrong with tools / tool_choice."""
    tools = request.tools or []
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise ValueError("tool_choice needs tools")
        return ToolPlan(None, None, None)
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools must have distinct function names")
    if choice == "none":
        return ToolPlan(None, None, None)
    if choice == "auto":
        return ToolPlan(tools, HermesToolParser(frozenset(names)), None)
    if choice == "required":
        call_schemas = [{
            "type": "object",
            "properties": {"name": {"const": tool.function.name},
                           "arguments": closed_schema(tool.function.parameters or _ANY_OBJECT)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        } for tool in tools]
        max_calls = MAX_PARALLEL_TOOL_CALLS if request.parallel_tool_calls else 1
        schema = {"type": "array", "minItems": 1, "maxItems": max_calls,
                  "items": call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}}
        return ToolPlan(tools, JsonArrayToolParser(), StructuredOutputsParams(json=schema))
    assert isinstance(choice, p.NamedToolChoice)
    name = choice.function.name
    tool = next((tool for tool in tools if tool.function.name == name), None)
    if tool is None:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    return ToolPlan([tool], NamedFunctionParser(name),
                    StructuredOutputsParams(json=closed_schema(tool.function.parameters
                                                               or _ANY_OBJECT)))
