"""Tool-call parsers on crafted text: whole outputs, and streams split at every character whose
deltas must reassemble into exactly the calls of the whole output."""

from __future__ import annotations

import json

import pytest

from pagedserve.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    JsonArrayToolParser,
    NamedFunctionParser,
    ToolCallStreamer,
    json_value_end,
)

HERMES_TWO_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"note": "a } and a \\" inside"}}\n</tool_call>\n<tool_call>\n{"arguments": {"a": 1, '
    '"b": [2, {"name": "nested"}]}, "name": "add"}\n</tool_call>')


def test_hermes_content_and_calls():
    parsed = HermesToolParser().parse(HERMES_TWO_CALLS, final=True)
    assert parsed.content == "Let me check.\n"
    assert [call.name for call in parsed.calls] == ["get_weather", "add"]
    assert json.loads(parsed.calls[0].arguments) == {"city": "Paris",
                                                     "note": 'a } and a " inside'}
    # "name" inside the arguments is not the function's name.
    assert json.loads(parsed.calls[1].arguments) == {"a": 1, "b": [2, {"name": "nested"}]}
    assert all(call.is_valid() for call in parsed.calls)


@pytest.mark.parametrize("text", [
    "Just text, no calls.",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1\n</tool_call>",  # broken JSON
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",                        # no name
    "I would use <tool_call but never do.",
])
def test_hermes_text_that_is_not_a_call_stays_content(text):
    parsed = HermesToolParser().parse(text, final=True)
    assert parsed.calls == [] and parsed.content == text


def _stream(parser, text: str, step: int):
    streamer = ToolCallStreamer(parser)
    content, calls = "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for number, piece in enumerate(pieces):
        delta = streamer.update(piece, final=number == len(pieces) - 1)
        content += delta.content
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index not in calls, "a call's id and name are sent once"
                assert call.name is not None
                calls[call.index] = {"id": call.id, "name": call.name, "arguments": ""}
            calls[call.index]["arguments"] += call.arguments or ""
    return content, [calls[index] for index in sorted(calls)]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser,text", [
    (HermesToolParser(), HERMES_TWO_CALLS),
    (HermesToolParser(), "No tools needed: the answer is 4."),
    # A call to a function that was not offered is text, streamed or not.
    (HermesToolParser(frozenset({"add"})), HERMES_TWO_CALLS),
    (JsonArrayToolParser(),
     '[{"arguments": {"city": "Paris"}, "name": "get_weather"},\n {"name": "add", '
     '"arguments": {"a": 1, "b": 2}}]'),
    (NamedFunctionParser("get_weather"), ' {"city": "Paris", "unit": "celsius"}'),
])
def test_streamed_deltas_reassemble_the_final_parse(parser, text, step):
    final = parser.parse(text, final=True)
    content, calls = _stream(parser, text, step)
    assert content == final.content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.name, call.arguments) for call in final.calls]
    assert len({c["id"] for c in calls}) == len(calls)
    assert content or calls
    assert all(c["id"].startswith("call_") for c in calls)


def test_hermes_stream_holds_back_a_possible_tag():
    streamer = ToolCallStreamer(HermesToolParser())
    assert streamer.update("Sure <tool", final=False).content == "Sure "
    delta = streamer.update("_call>\n{\"name\": \"f\", ", final=False)
    assert delta.content == "" and delta.tool_calls[0].name == "f"


def test_json_array_and_named_reject_broken_output():
    assert JsonArrayToolParser().parse('[{"name": "f", "arguments": {"a": ', True).calls == []
    assert NamedFunctionParser("f").parse('{"a": 1', True).calls == []
    assert NamedFunctionParser("f").parse('[1, 2]', True).calls == []


def test_json_value_end():
    text = '{"a": "}", "b": [1, {"c": "\\"]"}]} tail'
    assert text[:json_value_end(text, 0)] == '{"a": "}", "b": [1, {"c": "\\"]"}]}'
    assert json_value_end('{"a": [1, 2', 0) is None
    assert json_value_end('12, 3', 0) == 2 and json_value_end('12', 0) is None
    assert json_value_end('"x\\"y" ', 0) == 6
