"""How engine outputs become OpenAI responses: per-choice and usage bookkeeping, and the two
response formats (completions, chat) that `OpenAIServing` streams or collects.

The formats call back into the service only for logprob rendering and the response's model name.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel

from pagedserve.entrypoints.openai import protocol as p
from pagedserve.entrypoints.openai.tool_parsers import (
    ToolCallStreamer,
    ToolParser,
    new_tool_call_id,
)
from pagedserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput

if TYPE_CHECKING:
    from pagedserve.entrypoints.openai.serving import OpenAIServing

MIN_LOGPROB = -9999.0
"""-inf (a token the sampler ruled out) is not valid JSON; vLLM sends this instead."""


@dataclass(frozen=True)
class PromptInput:
    token_ids: list[int]
    text: str | None
    """The prompt as text, when it came as text (echo); None for token-id prompts."""


# ---- per-request bookkeeping ------------------------------------------------------------------


@dataclass
class Choice:
    """One output sequence (choice) accumulated from DELTA outputs."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_chars: int = 0
    """Characters already streamed (completion logprobs' text_offset continues from here)."""
    started: bool = False
    """Whether a chunk was streamed for it yet (echo goes into the first one)."""
    tool_streamer: ToolCallStreamer | None = None
    """Chat with tools, streaming: turns the text so far into content and tool-call deltas."""

    def add(self, completion: CompletionOutput) -> None:
        self.text_parts.append(completion.text)
        self.token_ids.extend(completion.token_ids)
        self.logprobs.extend(completion.logprobs or ())
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason
            self.stop_reason = completion.stop_reason


@dataclass
class Usage:
    num_prompt_tokens: list[int]
    """Per prompt."""
    num_cached_tokens: list[int] = field(default_factory=list)
    num_tier_cached_tokens: list[int] = field(default_factory=list)
    num_completion_tokens: int = 0

    def __post_init__(self) -> None:
        self.num_cached_tokens = [0] * len(self.num_prompt_tokens)
        self.num_tier_cached_tokens = [0] * len(self.num_prompt_tokens)

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        if output.num_cached_tokens > self.num_cached_tokens[prompt_index]:
            self.num_cached_tokens[prompt_index] = output.num_cached_tokens
            self.num_tier_cached_tokens[prompt_index] = output.num_tier_cached_tokens
        self.num_completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def info(self) -> p.UsageInfo:
        num_prompt_tokens = sum(self.num_prompt_tokens)
        return p.UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=self.num_completion_tokens,
            total_tokens=num_prompt_tokens + self.num_completion_tokens,
            prompt_tokens_details=p.PromptTokensDetails(
                cached_tokens=sum(self.num_cached_tokens),
                kv_tier_cached_tokens=sum(self.num_tier_cached_tokens)),
        )


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# ---- the two formats --------------------------------------------------------------------------


class ResponseFormat(Protocol):
    """What differs between completions and chat once outputs flow (see _run)."""

    def initial_chunks(self) -> list[BaseModel]:
        """Chunks streamed before any output (chat: one role delta per choice)."""

    def stream_choice(self, index: int, prompt_index: int, output: RequestOutput,
                      completion: CompletionOutput, choice: Choice) -> BaseModel | None:
        """The streamed choice for one sequence's delta; None when there is nothing to send."""

    def chunk(self, choices: list, usage: p.UsageInfo | None = None) -> BaseModel: ...

    def final_choice(self, index: int, prompt_index: int, choice: Choice,
                     prompt_output: RequestOutput) -> BaseModel: ...

    def response(self, choices: list, usage: p.UsageInfo,
                 prompt_outputs: dict[int, RequestOutput]) -> BaseModel: ...


class CompletionFormat:
    """/v1/completions: text choices, logprobs as parallel lists, optional echo of the prompt."""

    def __init__(self, serving: OpenAIServing, request: p.CompletionRequest, response_id: str,
                 prompts: list[PromptInput]) -> None:
        self.serving = serving
        self.request = request
        self.response_id = response_id
        self.prompts = prompts
        self.created = int(time.time())

    def _prompt_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        if prompt.text is not None:
            return prompt.text
        return self.serving.tokenizer.decode(prompt.token_ids)

    def initial_chunks(self) -> list[BaseModel]:
        return []

    def stream_choice(self, index: int, prompt_index: int, output: RequestOutput,
                      completion: CompletionOutput, choice: Choice) -> p.CompletionChoice | None:
        text, token_ids, positions = completion.text, completion.token_ids, completion.logprobs
        wants_logprobs = self.request.logprobs is not None
        wants_token_ids = bool(self.request.return_token_ids)
        first = not choice.started
        if self.request.echo and first:
            text = self._prompt_text(prompt_index) + text
            if wants_logprobs:
                token_ids = output.prompt_token_ids + token_ids
                positions = list(output.prompt_logprobs or [None]) + list(positions or [])
        if (not text and completion.finish_reason is None
                and not ((wants_logprobs or wants_token_ids) and completion.token_ids)):
            return None
        logprobs = None
        if wants_logprobs:
            logprobs = self.serving.completion_logprobs(token_ids, positions or [],
                                                        choice.num_sent_chars,
                                                        self.request.logprobs)
        choice.started = True
        choice.num_sent_chars += len(text)
        return p.CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            prompt_token_ids=output.prompt_token_ids if wants_token_ids and first else None,
            token_ids=list(completion.token_ids) if wants_token_ids else None)

    def chunk(self, choices: list, usage: p.UsageInfo | None = None) -> BaseModel:
        return p.CompletionStreamResponse(id=self.response_id, created=self.created,
                                          model=self.serving.response_model(self.request),
                                          choices=choices, usage=usage)

    def final_choice(self, index: int, prompt_index: int, choice: Choice,
                     prompt_output: RequestOutput) -> p.CompletionChoice:
        text = "".join(choice.text_parts)
        token_ids, positions = choice.token_ids, list(choice.logprobs)
        if self.request.echo:
            text = self._prompt_text(prompt_index) + text
            token_ids = prompt_output.prompt_token_ids + token_ids
            positions = list(prompt_output.prompt_logprobs or [None]) + positions
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = self.serving.completion_logprobs(token_ids, positions, 0,
                                                        self.request.logprobs)
        wants_token_ids = bool(self.request.return_token_ids)
        return p.CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            prompt_logprobs=self.serving.prompt_logprobs(self.request, prompt_output),
            prompt_token_ids=prompt_output.prompt_token_ids if wants_token_ids else None,
            token_ids=choice.token_ids if wants_token_ids else None)

    def response(self, choices: list, usage: p.UsageInfo,
                 prompt_outputs: dict[int, RequestOutput]) -> BaseModel:
        return p.CompletionResponse(id=self.response_id, created=self.created,
                                    model=self.serving.response_model(self.request),
                                    choices=choices, usage=usage)


class ChatFormat:
    """/v1/chat/completions: an assistant message per choice, role delta first when streaming."""

    def __init__(self, serving: OpenAIServing, request: p.ChatCompletionRequest,
                 response_id: str, prompt: PromptInput, tool_parser: ToolParser | None = None
                 ) -> None:
        self.serving = serving
        self.request = request
        self.response_id = response_id
        self.prompt = prompt
        self.created = int(time.time())
        self.num_top_logprobs = request.top_logprobs or 0
        self.tool_parser = tool_parser

    def _logprobs(self, token_ids: list[int], positions) -> p.ChatLogProbs | None:
        if not self.request.logprobs:
            return None
        return self.serving.chat_logprobs(token_ids, positions or [], self.num_top_logprobs)

    def initial_chunks(self) -> list[BaseModel]:
        chunks = [
            self.chunk([p.ChatCompletionStreamChoice(
                index=index, delta=p.DeltaMessage(role="assistant", content=""))])
            for index in range(self.request.n)
        ]
        if self.request.return_token_ids:
            chunks[0].prompt_token_ids = self.prompt.token_ids  # vLLM: in the first chunk only
        return chunks

    def stream_choice(self, index: int, prompt_index: int, output: RequestOutput,
                      completion: CompletionOutput, choice: Choice
                      ) -> p.ChatCompletionStreamChoice | None:
        text, token_ids = completion.text, completion.token_ids
        finish_reason = completion.finish_reason
        tool_deltas = None
        if self.tool_parser is not None:
            if choice.tool_streamer is None:
                choice.tool_streamer = ToolCallStreamer(self.tool_parser)
            delta = choice.tool_streamer.update(text, final=finish_reason is not None)
            text = delta.content
            tool_deltas = [
                p.DeltaToolCall(
                    index=d.index, id=d.id, type="function" if d.id else None,
                    function=p.DeltaFunctionCall(name=d.name, arguments=d.arguments))
                for d in delta.tool_calls] or None
            if finish_reason == "stop" and delta.num_calls:
                finish_reason = "tool_calls"
        wants_token_ids = bool(self.request.return_token_ids)
        if (not text and not tool_deltas and finish_reason is None
                and not ((self.request.logprobs or wants_token_ids) and token_ids)):
            return None
        return p.ChatCompletionStreamChoice(
            index=index, delta=p.DeltaMessage(content=text or None, tool_calls=tool_deltas),
            logprobs=self._logprobs(token_ids, completion.logprobs),
            finish_reason=finish_reason, stop_reason=completion.stop_reason,
            token_ids=list(token_ids) if wants_token_ids else None)

    def chunk(self, choices: list, usage: p.UsageInfo | None = None) -> BaseModel:
        return p.ChatCompletionStreamResponse(id=self.response_id, created=self.created,
                                              model=self.serving.response_model(self.request),
                                              choices=choices, usage=usage)

    def final_choice(self, index: int, prompt_index: int, choice: Choice,
                     prompt_output: RequestOutput) -> p.ChatCompletionChoice:
        text = "".join(choice.text_parts)
        finish_reason = choice.finish_reason
        message = p.ChatResponseMessage(content=text)
        if self.tool_parser is not None:
            parsed = self.tool_parser.parse(text, final=True)
            calls = [p.ToolCall(id=new_tool_call_id(),
                                function=p.FunctionCall(name=call.name, arguments=call.arguments))
                     for call in parsed.calls]
            message = p.ChatResponseMessage(content=parsed.content or None, tool_calls=calls)
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return p.ChatCompletionChoice(
            index=index, message=message,
            logprobs=self._logprobs(choice.token_ids, choice.logprobs),
            finish_reason=finish_reason, stop_reason=choice.stop_reason,
            token_ids=choice.token_ids if self.request.return_token_ids else None)

    def response(self, choices: list, usage: p.UsageInfo,
                 prompt_outputs: dict[int, RequestOutput]) -> BaseModel:
        # vLLM puts a chat's prompt fields on the response, not on the choices (one prompt).
        return p.ChatCompletionResponse(
            id=self.response_id, created=self.created,
            model=self.serving.response_model(self.request), choices=choices, usage=usage,
            prompt_logprobs=self.serving.prompt_logprobs(self.request, prompt_outputs[0]),
            prompt_token_ids=self.prompt.token_ids if self.request.return_token_ids else None)
