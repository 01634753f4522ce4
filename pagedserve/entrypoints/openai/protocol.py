"""The OpenAI wire format: pydantic models for requests (validated strictly; unknown fields are
kept, and unknown_fields() names them for the server to warn about or refuse) and for responses
and stream chunks.

Only shapes and static bounds live here; limits that need the model (vocabulary, context length)
are checked in serving.py.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_N = 16
"""Most completions per prompt (n)."""
MAX_LOGPROBS = 20
"""OpenAI's cap on logprobs / top_logprobs."""
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_PROMPTS = 64
"""Most prompts, and most prompts times n, in one completion request."""
MAX_TOOLS = 128
"""Most tools one chat request may offer (OpenAI allows 128)."""
MAX_TOOLS_JSON_CHARS = 256 * 1024
"""Most characters the tools' definitions may take as JSON (they become prompt and grammar)."""
MAX_ALLOWED_TOKEN_IDS = 1 << 20
"""Most ids allowed_token_ids may list (more than any vocabulary: a bound on the body's work)."""


class RequestModel(BaseModel):
    """Strict: "5" is not an int and NaN is not a number. Unknown fields are kept (model_extra)
    so that unknown_fields() can name them; nothing reads their values."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The dotted names of the fields `model` and the models inside it did not declare, e.g.
    ["foo", "stream_options.bar", "messages.baz"] (list items are named by their field)."""
    names = [prefix + name for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, BaseModel):
                names += [n for n in unknown_fields(item, f"{prefix}{name}.") if n not in names]
    return names


def is_token_ids(item: Any) -> bool:
    return (isinstance(item, list) and len(item) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) for t in item))


def check_prompt_shape(value: Any, name: str, max_items: int, items: str,
                       allow_empty_text: bool = True) -> Any:
    """`value` if it is a string, a list of strings, a non-empty list of token ids or a list of
    such lists (at most `max_items` of them); else one clear ValueError instead of pydantic's
    four failed union members."""
    if isinstance(value, str):
        if not value and not allow_empty_text:
            raise ValueError(f"{name} must not be empty")
        return value
    if isinstance(value, list) and value:
        if is_token_ids(value):
            return value
        if len(value) > max_items:
            raise ValueError(f"at most {max_items} {items} per request, got {len(value)}")
        if all(isinstance(item, str) for item in value):
            if not allow_empty_text and not all(value):
                raise ValueError(f"{name} must not contain empty strings")
            return value
        if all(is_token_ids(item) for item in value):
            return value
    text = "a string" if allow_empty_text else "a non-empty string"
    raise ValueError(f"{name} must be {text}, a list of strings, a non-empty list of token ids, "
                     "or a list of such lists")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- requests ---------------------------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    """vLLM's: every chunk carries the usage so far (the final usage chunk still needs
    include_usage)."""


class JsonSchemaFormat(RequestModel):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's response_format: free text, any JSON object, or JSON fitting a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None
    """With json: the whitespace allowed between JSON tokens (a regex; vLLM's field)."""


class GenerationRequest(RequestModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's sampling extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's scheduling extras
    priority: int = 0
    cache_salt: str | None = Field(default=None, min_length=1)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    """Echoed as the response id; the engine always gets a fresh id of its own."""
    return_timeline: bool = False
    """pagedserve's: add the request's timeline (GET /v1/requests/{id}/timeline) to the
    response, or to the last chunk of a stream."""
    # constrained output
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older names for structured_outputs' constraints (serving.py maps them)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    """Accepted; the server has one structured output backend (llguidance)."""
    guided_whitespace_pattern: str | None = None
    """With a JSON constraint: the whitespace allowed between JSON tokens."""
    # vLLM's token-level extras
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1,
                                                max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[str] | None = Field(default=None, max_length=128)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """Keep only the last N prompt tokens (-1: the model's context length)."""
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """Logprobs of each prompt token (after the first) and of its top N alternatives."""
    return_token_ids: bool | None = None
    """Add prompt_token_ids and each choice's token_ids to the response (deltas when
    streaming; prompt_token_ids in the first chunk)."""

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if isinstance(value, list):
            if len(value) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
            if not all(isinstance(text, str) and text for text in value):
                raise ValueError("stop must be a non-empty string or a list of them")
        elif value is not None and not (isinstance(value, str) and value):
            raise ValueError("stop must be a non-empty string or a list of them")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias_size(cls, value: Any) -> Any:
        if isinstance(value, dict) and len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}")
        return value


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, value: Any) -> Any:
        return check_prompt_shape(value, "prompt", MAX_PROMPTS, "prompts")


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(RequestModel):
    name: str
    arguments: str
    """JSON text, as the API returned it."""


class ToolCallIn(RequestModel):
    """A tool call of an earlier assistant turn, sent back with the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    """assistant: the calls it made."""
    tool_call_id: str | None = None
    """tool: which call this message answers."""

    @field_validator("content", mode="before")
    @classmethod
    def _check_content_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, (str, list)):
            return value
        raise ValueError("content must be a string or a list of "
                         "{'type': 'text', 'text': ...} parts")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object (None: any object)."""
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


# ---- vLLM's chat template fields (chat completions and /tokenize with messages) ----

MAX_CHAT_TEMPLATE_CHARS = 64 * 1024
"""Longest chat_template a request may send."""


class ChatTemplateFields(RequestModel):
    """How the conversation becomes the prompt (vLLM's extras)."""

    add_generation_prompt: bool = True
    """End with the assistant turn's opening, so that the model answers."""
    continue_final_message: bool = False
    """End inside the final message, so that the model continues it (needs
    add_generation_prompt=false, as in vLLM)."""
    chat_template: str | None = Field(default=None, min_length=1,
                                      max_length=MAX_CHAT_TEMPLATE_CHARS)
    """This request's own template (the server needs --trust-request-chat-template)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More template variables, e.g. {"enable_thinking": false}."""

    @model_validator(mode="after")
    def _check_continuation(self) -> ChatTemplateFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true (set add_generation_prompt to false)")
        return self

# ---- end of the chat template fields ----


class ChatCompletionRequest(GenerationRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: "auto" when tools are given, else "none"."""
    parallel_tool_calls: bool = True

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tools_size(cls, value: Any) -> Any:
        # Before parsing: 10,000 tools should cost a length check, not 10,000 models.
        if isinstance(value, list):
            if len(value) > MAX_TOOLS:
                raise ValueError(f"at most {MAX_TOOLS} tools are allowed, got {len(value)}")
            size = len(json.dumps(value, default=str))
            if size > MAX_TOOLS_JSON_CHARS:
                raise ValueError(f"the tools' definitions take {size} characters as JSON; at "
                                 f"most {MAX_TOOLS_JSON_CHARS} are allowed")
        return value


class LoadLoRAAdapterRequest(RequestModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(RequestModel):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


class TokenizeRequest(ChatTemplateFields):
    """Exactly one of `prompt` (plain text) and `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------------


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    max_model_len: int
    root: str | None = None
    """The base model's name, or a LoRA adapter's path (as vLLM lists it)."""
    parent: str | None = None
    """A LoRA adapter's base model; None for the base itself."""


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0
    """Prompt tokens whose KV was reused (OpenAI's field): from the device pool or a KV tier."""
    kv_tier_cached_tokens: int = 0
    """pagedserve's: the part of cached_tokens loaded from a KV tier (disk, Redis, host)."""


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(ResponseModel):
    """vLLM's Logprob, as its prompt_logprobs carry it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]
"""Per prompt token: token id -> its logprob, for the actual token and the top N (None for the
first token, which has no context)."""


def _omit_none() -> Any:
    """A vLLM-only response field that is left out of the JSON unless the request asked for it."""
    return Field(default=None, exclude_if=lambda value: value is None)


class CompletionLogProbs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """vLLM's extension: the stop string or token id that ended the sequence."""
    prompt_logprobs: PromptLogprobs | None = _omit_none()
    prompt_token_ids: list[int] | None = _omit_none()
    token_ids: list[int] | None = _omit_none()


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    timeline: dict | None = Field(default=None, exclude_if=lambda value: value is None)
    """With return_timeline: where the request's time went (observability/timeline.py)."""


class CompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    timeline: dict | None = Field(default=None, exclude_if=lambda value: value is None)
    """With return_timeline: where the request's time went (observability/timeline.py)."""


class ChatLogProb(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(ResponseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str
    """The arguments object as JSON text."""


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _omit_none()


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    timeline: dict | None = Field(default=None, exclude_if=lambda value: value is None)
    """With return_timeline: where the request's time went (observability/timeline.py)."""
    prompt_logprobs: PromptLogprobs | None = _omit_none()
    prompt_token_ids: list[int] | None = _omit_none()


class _SparseModel(ResponseModel):
    """Serialized without its None fields: stream deltas carry only what changed."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_SparseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_SparseModel):
    """The first delta of a call carries its id, type and name; later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        # A delta carries only what changed: {"role": "assistant"} first, then {"content": ...}.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _omit_none()


class ChatCompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    timeline: dict | None = Field(default=None, exclude_if=lambda value: value is None)
    """With return_timeline: where the request's time went (observability/timeline.py)."""
    prompt_token_ids: list[int] | None = _omit_none()


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


# ---- lifecycle (admin) routes ------------------------------------------------------------------


class UpdateWeightsRequest(RequestModel):
    """POST /update_weights (SGLang's /update_weights_from_disk body, its `model_path` only: any
    other key is refused rather than silently ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model_path: str = Field(min_length=1)
    """A GGUF file, an HF directory or a short model name, read by the server's process."""


class UpdateWeightsResponse(ResponseModel):
    success: bool
    message: str
