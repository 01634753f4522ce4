"""Tool calls in generated text -> OpenAI tool calls, whole or as stream deltas.

Three text formats, one per tool_choice:
  auto      Hermes/Qwen style: free text, then `<tool_call>{"name": ..., "arguments": {...}}
            </tool_call>` blocks (the format the tool system prompt asks for).
  required  a JSON array of call objects, [{"name": ..., "arguments": {...}}, ...], which a
            grammar forces the model to write.
  named     the arguments object alone, which a grammar forces; the name is the request's.

Each parser reads the text so far into `ParsedOutput` (content plus possibly partial calls). The
final response and the stream use the same parse, and a call's `arguments` is the exact JSON
text the model wrote, so the streamed argument fragments concatenate to the final arguments.
Pure Python, no engine.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS_RE = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass
class PartialCall:
    name: str | None
    """None until the name's closing quote has been generated."""
    arguments: str
    """The arguments' JSON text so far (all of it once `complete`)."""
    complete: bool
    """The arguments value is closed (more text cannot extend it)."""

    def is_valid(self) -> bool:
        """A finished call worth returning: a name and an arguments object that parses."""
        if self.name is None or not self.complete:
            return False
        try:
            return isinstance(json.loads(self.arguments), dict)
        except ValueError:
            return False


@dataclass
class ParsedOutput:
    content: str
    """Text that is not a tool call (when streaming, held back where a call might begin)."""
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser(Protocol):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """`final`: the text is complete; otherwise it may grow."""


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value starting at text[start], or None if the text ends first.

    Only brackets and strings are tracked: it finds the end, it does not validate.
    """
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first not in "{[":
        # A number or literal ends at the first delimiter; at the end of the text it may grow.
        match = re.compile(r"[^,\s\]}]*").match(text, start)
        end = match.end()
        return end if end < len(text) else None
    depth, index = 0, start
    while index < len(text):
        char = text[index]
        if char == '"':
            string_end = _string_end(text, index)
            if string_end is None:
                return None
            index = string_end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    return None


def _string_end(text: str, start: int) -> int | None:
    index = start + 1
    while index < len(text):
        if text[index] == "\\":
            index += 2
            continue
        if text[index] == '"':
            return index + 1
        index += 1
    return None


def parse_call_object(body: str, final: bool) -> PartialCall:
    """A (possibly partial) `{"name": ..., "arguments": ...}` object's name and arguments."""
    arguments, complete = "", False
    arguments_span = (len(body), len(body))
    arguments_match = _ARGUMENTS_RE.search(body)
    if arguments_match is not None:
        start = arguments_match.end()
        end = json_value_end(body, start)
        arguments_span = (start, len(body) if end is None else end)
        if end is not None:
            arguments, complete = body[start:end], True
        else:
            arguments = body[start:].rstrip() if final else body[start:]
    # The name key outside the arguments: {"arguments": {"name": ...}, "name": ...} happens.
    name = None
    name_match = _NAME_RE.search(body)
    if name_match is not None and arguments_span[0] <= name_match.start() < arguments_span[1]:
        name_match = _NAME_RE.search(body, arguments_span[1])
    if name_match is not None:
        try:
            name = json.loads(f'"{name_match.group(1)}"')
        except ValueError:
            name = None
    return PartialCall(name, arguments, complete)


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class HermesToolParser:
    """tool_choice "auto": content, then `<tool_call>...</tool_call>` blocks."""

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        """tool_names: the functions offered; a call to any other makes the output plain text
        (nothing a client could dispatch). None accepts any name."""
        self.tool_names = tool_names

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = text.find(TOOL_CALL_START)
        if start < 0:
            if final:
                return ParsedOutput(text)
            # "<tool" might be the start of a call: hold it back until it is not.
            return ParsedOutput(text[: len(text) - _held_back(text, TOOL_CALL_START)])
        calls = []
        for segment in text[start + len(TOOL_CALL_START):].split(TOOL_CALL_START):
            end = segment.find(TOOL_CALL_END)
            closed = end >= 0
            body = segment[:end] if closed else segment
            if not closed and not final:
                body = body[: len(body) - _held_back(body, TOOL_CALL_END)]
            call = parse_call_object(body, final or closed)
            if (not final and call.name is not None and self.tool_names is not None
                    and call.name not in self.tool_names):
                break  # the final parse will call this text: stream no call for it
            calls.append(call)
        content = text[:start]
        if final and not all(call.is_valid() and (self.tool_names is None
                                                  or call.name in self.tool_names)
                             for call in calls):
            # Not the format we asked for: it is text after all.
            return ParsedOutput(text)
        return ParsedOutput(content, calls)


class JsonArrayToolParser:
    """tool_choice "required": `[{"name": ..., "arguments": {...}}, ...]`."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        calls = []
        index = text.find("[")
        if index < 0:
            return ParsedOutput("" if not final else text)
        index += 1
        while index < len(text):
            while index < len(text) and text[index] in " \t\r\n,":
                index += 1
            if index >= len(text) or text[index] != "{":
                break
            end = json_value_end(text, index)
            calls.append(parse_call_object(text[index:end] if end else text[index:],
                                           final or end is not None))
            if end is None:
                break
            index = end
        if final and (not calls or not all(call.is_valid() for call in calls)):
            return ParsedOutput(text)
        return ParsedOutput("", calls)


class NamedFunctionParser:
    """tool_choice naming a function: the text is that function's arguments object."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = len(text) - len(text.lstrip())
        end = json_value_end(text, start)
        arguments = text[start:end] if end is not None else text[start:]
        call = PartialCall(self.name, arguments.rstrip() if final else arguments,
                           end is not None)
        if final and not call.is_valid():
            return ParsedOutput(text)
        return ParsedOutput("", [call])


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class StreamDelta:
    content: str
    tool_calls: list[ToolCallDelta]
    num_calls: int
    """Calls in the text so far (on the final update: what the full response reports)."""


class ToolCallStreamer:
    """Turns the growing text of one choice into content and tool-call deltas: a call's id and
    name first (once the name is complete), then each new piece of its arguments."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._num_content_sent = 0
        self._ids: list[str] = []
        self._num_arguments_sent: list[int] = []

    @property
    def num_calls_sent(self) -> int:
        return len(self._ids)

    def update(self, new_text: str, final: bool) -> StreamDelta:
        self.text += new_text
        parsed = self.parser.parse(self.text, final)
        content = parsed.content[self._num_content_sent:]
        self._num_content_sent = max(self._num_content_sent, len(parsed.content))
        deltas = []
        for index, call in enumerate(parsed.calls):
            if index >= len(self._ids):
                if call.name is None:
                    break  # calls go out in order: wait for this name
                self._ids.append(new_tool_call_id())
                self._num_arguments_sent.append(0)
                deltas.append(ToolCallDelta(index, self._ids[index], call.name))
            new_arguments = call.arguments[self._num_arguments_sent[index]:]
            if new_arguments:
                self._num_arguments_sent[index] = len(call.arguments)
                if deltas and deltas[-1].index == index:
                    deltas[-1].arguments = new_arguments
                else:
                    deltas.append(ToolCallDelta(index, arguments=new_arguments))
        return StreamDelta(content, deltas, len(parsed.calls))
