"""POST /v1/responses (OpenAI's Responses API, text only) and the bounded store behind
`previous_response_id` and GET/DELETE /v1/responses/{id}.

A Responses request is turned into a chat completion request (its input items become messages)
that OpenAIServing checks, templates and starts; this module only translates: input items to
messages, engine outputs to a Response object or to the Responses stream events. Knows nothing of
HTTP: api_server.py registers the routes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from pagedserve.engine.async_llm import EngineDeadError, EngineDrainingError
from pagedserve.entrypoints.openai import protocol as p
from pagedserve.entrypoints.openai.errors import APIError, bad_request
from pagedserve.entrypoints.openai.generation import EventStream, Generation
from pagedserve.entrypoints.openai.response_formats import Choice, Usage
from pagedserve.entrypoints.openai.serving import OpenAIServing, engine_error

DEFAULT_STORE_SIZE = 1024
"""Responses kept for previous_response_id and GET /v1/responses/{id} (least recently used
ones are dropped first)."""

_INPUT_ROLES = ("user", "system", "developer", "assistant")
_INPUT_PART_TYPES = ("input_text", "output_text")
"""Content parts a message may carry: text in, and text an earlier response gave back."""

_CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                "response_format": "text.format"}
"""A chat request's field names as the Responses request spells them (for error `param`s)."""


# ---- the request ------------------------------------------------------------------------------


class InputTextPart(p.RequestModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(p.RequestModel):
    """A message item of `input`: {"role", "content"}, with or without "type": "message"."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class TextFormat(p.RequestModel):
    """`text.format`: plain text, any JSON object, or JSON fitting a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(p.RequestModel):
    format: TextFormat | None = None


class ResponsesRequest(p.RequestModel):
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    """A system message put first; not carried on to responses that name this one as
    previous_response_id (as OpenAI does)."""
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    """Ignored."""
    text: TextConfig | None = None
    parallel_tool_calls: bool = True
    # Fields of OpenAI's that this server refuses when they ask for something (see _UNSUPPORTED).
    background: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    truncation: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _check_items(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise ValueError("input must not be empty")
            return value
        # Here rather than in the item models: one message naming the item or part, instead of
        # pydantic's failed union members.
        if not isinstance(value, list) or not value:
            raise ValueError("input must be a string or a non-empty list of messages")
        for index, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind != "message":
                raise ValueError(f"input[{index}] of type {kind!r} is not supported: this "
                                 "server takes messages ({'role': ..., 'content': ...}) only")
            if item.get("role") not in _INPUT_ROLES:
                raise ValueError(f"input[{index}].role must be one of {', '.join(_INPUT_ROLES)}")
            content = item.get("content")
            if not isinstance(content, (str, list)):
                raise ValueError(f"input[{index}].content must be a string or a list of "
                                 "'input_text' parts")
            for part_index, part in enumerate(content if isinstance(content, list) else ()):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _INPUT_PART_TYPES:
                    raise ValueError(f"input[{index}].content[{part_index}] of type {kind!r} is "
                                     "not supported: this server takes text only "
                                     "('input_text' parts)")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"input[{index}].content[{part_index}].text must be a "
                                     "string")
        return value


_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "background": bool,
    "tools": bool,
    "tool_choice": lambda value: value not in (None, "auto", "none"),
    "reasoning": lambda value: value is not None,
    "include": bool,
    "conversation": lambda value: value is not None,
    "prompt": lambda value: value is not None,
    "top_logprobs": bool,
    "truncation": lambda value: value not in (None, "disabled"),
}
"""Field -> whether its value asks for something this server does not do (a 400 naming it)."""


# ---- the response -----------------------------------------------------------------------------


class OutputText(p.ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)


class OutputMessage(p.ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(p.ResponseModel):
    cached_tokens: int = 0


class OutputTokensDetails(p.ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(p.ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(p.ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(p.ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str = "none"
    tools: list = Field(default_factory=list)
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False
    usage: ResponseUsage | None = None
    user: str | None = None


class DeletedResponse(p.ResponseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# ---- the store --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: tuple[p.ChatMessage, ...]
    """Every message of the chain up to and including this response's reply, without any
    instructions: what a request naming it as previous_response_id continues."""


class ResponseStore:
    """The most recently used `max_size` stored responses, by id (a least-recently-used map)."""

    def __init__(self, max_size: int = DEFAULT_STORE_SIZE) -> None:
        if max_size < 1:
            raise ValueError(f"--responses-store-size must be >= 1, got {max_size}")
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


def _not_found(response_id: str, param: str) -> APIError:
    shown = response_id if len(response_id) <= 100 else response_id[:100] + "..."
    return APIError(404, f"Response with id '{shown}' not found.", param=param,
                    code="response_not_found")


# ---- the service ------------------------------------------------------------------------------


@dataclass
class _Turn:
    """One response being generated: what it started from and what came out so far."""

    request: ResponsesRequest
    response: ResponseObject
    history: tuple[p.ChatMessage, ...]
    """The previous responses' conversation and this request's input (no instructions)."""
    usage: Usage
    choice: Choice
    item_id: str


class ResponsesServing:
    """/v1/responses over an OpenAIServing. Each public coroutine raises APIError for bad
    requests."""

    def __init__(self, serving: OpenAIServing, store_size: int = DEFAULT_STORE_SIZE) -> None:
        self.serving = serving
        self.store = ResponseStore(store_size)

    def retrieve(self, response_id: str) -> ResponseObject:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return entry.response

    def delete(self, response_id: str) -> DeletedResponse:
        if not self.store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return DeletedResponse(id=response_id)

    async def create_response(self, request: ResponsesRequest) -> ResponseObject | EventStream:
        """The finished response, or (stream=True) its events once generation runs."""
        self.serving.unknown_fields.check(request)
        for name, unsupported in _UNSUPPORTED.items():
            if unsupported(getattr(request, name)):
                raise bad_request(f"{name} is not supported by this server", name)
        history = self._previous_conversation(request.previous_response_id)
        history += tuple(_input_messages(request.input))
        instructions = ((p.ChatMessage(role="system", content=request.instructions),)
                        if request.instructions else ())
        chat_request = self._chat_request(request, instructions + history)
        response = self._new_response(request, chat_request)
        try:
            prompt, params, _ = await self.serving.prepare_chat_completion(chat_request)
            generation = await self.serving.start_generation(chat_request, [prompt], params,
                                                             response.id)
        except APIError as error:
            error.param = _CHAT_PARAMS.get(error.param, error.param)
            raise
        turn = _Turn(request, response, history, Usage([len(prompt.token_ids)]), Choice(),
                     item_id=f"msg_{uuid.uuid4().hex}")
        if request.stream:
            return EventStream(self._stream(turn, generation), generation)
        try:
            async for _, output in generation.outputs():
                turn.usage.add(0, output)
                turn.choice.add(output.outputs[0])
        except (EngineDrainingError, EngineDeadError) as error:
            raise engine_error(error) from None
        finally:
            await generation.aclose()
        return self._finish(turn)

    def _new_response(self, request: ResponsesRequest,
                      chat_request: p.ChatCompletionRequest) -> ResponseObject:
        """The response as it starts: in progress, no output yet."""
        text_format = request.text.format.type if request.text and request.text.format else "text"
        return ResponseObject(
            id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()), status="in_progress",
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            model=self.serving.response_model(chat_request),
            parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id, store=request.store,
            temperature=request.temperature, top_p=request.top_p,
            text={"format": {"type": text_format}}, metadata=request.metadata or {},
            user=request.user)

    def _previous_conversation(self, response_id: str | None) -> tuple[p.ChatMessage, ...]:
        if response_id is None:
            return ()
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, "previous_response_id")
        return entry.conversation

    def _chat_request(self, request: ResponsesRequest,
                      messages: tuple[p.ChatMessage, ...]) -> p.ChatCompletionRequest:
        response_format = None
        if request.text is not None and request.text.format is not None:
            text_format = request.text.format
            response_format = p.ResponseFormat(
                type=text_format.type,
                json_schema=(p.JsonSchemaFormat(name=text_format.name,
                                                description=text_format.description,
                                                schema=text_format.schema_,
                                                strict=text_format.strict)
                             if text_format.type == "json_schema" else None))
        return p.ChatCompletionRequest(
            model=request.model, messages=list(messages),
            max_completion_tokens=request.max_output_tokens, temperature=request.temperature,
            top_p=request.top_p, stream=request.stream, response_format=response_format)

    def _finish(self, turn: _Turn) -> ResponseObject:
        """The finished response, stored unless the request said store=false."""
        text = "".join(turn.choice.text_parts)
        truncated = turn.choice.finish_reason == "length"
        usage = turn.usage.info()
        response = turn.response.model_copy(update=dict(
            status="incomplete" if truncated else "completed",
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if truncated else None,
            output=[self._message(turn, text, "incomplete" if truncated else "completed")],
            usage=ResponseUsage(
                input_tokens=usage.prompt_tokens,
                input_tokens_details=InputTokensDetails(
                    cached_tokens=usage.prompt_tokens_details.cached_tokens),
                output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens)))
        if turn.request.store:
            reply = p.ChatMessage(role="assistant", content=text)
            self.store.put(StoredResponse(response, turn.history + (reply,)))
        return response

    @staticmethod
    def _message(turn: _Turn, text: str, status: str) -> OutputMessage:
        content = [OutputText(text=text)] if status != "in_progress" else []
        return OutputMessage(id=turn.item_id, status=status, content=content)

    async def _stream(self, turn: _Turn, generation: Generation) -> AsyncIterator[str]:
        """OpenAI's event sequence: created, in_progress, output_item.added,
        content_part.added, output_text.delta..., output_text.done, content_part.done,
        output_item.done, then completed (or incomplete at max_output_tokens)."""
        events = _EventNumbering()
        item = dict(output_index=0, item_id=turn.item_id)
        part = dict(item, content_index=0)
        try:
            yield events.sse("response.created", response=turn.response)
            yield events.sse("response.in_progress", response=turn.response)
            yield events.sse("response.output_item.added", output_index=0,
                             item=self._message(turn, "", "in_progress"))
            yield events.sse("response.content_part.added", **part, part=OutputText(text=""))
            async for _, output in generation.outputs():
                turn.usage.add(0, output)
                completion = output.outputs[0]
                turn.choice.add(completion)
                if completion.text:
                    yield events.sse("response.output_text.delta", **part,
                                     delta=completion.text, logprobs=[])
            response = self._finish(turn)
            message = response.output[0]
            yield events.sse("response.output_text.done", **part, text=message.content[0].text,
                             logprobs=[])
            yield events.sse("response.content_part.done", **part, part=message.content[0])
            yield events.sse("response.output_item.done", output_index=0, item=message)
            final = ("response.completed" if response.status == "completed"
                     else "response.incomplete")
            yield events.sse(final, response=response)
        except (EngineDrainingError, EngineDeadError) as error:
            api_error = engine_error(error)
            yield events.sse("error", code=api_error.code, message=api_error.message,
                             param=api_error.param)
        finally:
            await generation.aclose()


class _EventNumbering:
    """Numbers the events of one stream (sequence_number counts from 0) and frames them as SSE
    with an `event:` line, as OpenAI does."""

    def __init__(self) -> None:
        self.next_number = 0

    def sse(self, event_type: str, **fields: Any) -> str:
        payload = {"type": event_type, "sequence_number": self.next_number}
        for name, value in fields.items():
            payload[name] = value.model_dump() if isinstance(value, BaseModel) else value
        self.next_number += 1
        return f"event: {event_type}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _input_messages(items: str | list[InputMessage]) -> list[p.ChatMessage]:
    if isinstance(items, str):
        return [p.ChatMessage(role="user", content=items)]
    return [p.ChatMessage(role=item.role, content=item.text()) for item in items]
