"""What the server's flags change in the answers of OpenAIServing: the names the model answers
to, the chat template and its defaults, the logprobs cap and how logprob tokens are spelled.

Built once at start-up from ServerConfig; knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedserve.sampling_params import MAX_LOGPROBS

_JINJA_CHARS = "{}\n"
"""A --chat-template value holding one of these is a template, not a path (vLLM's rule)."""


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template given inline on one line (escapes such as
    \\n are decoded, as vLLM does). A value that looks like a path but names no file is an error
    (before the model loads), not a template that renders its own path."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if not any(char in value for char in _JINJA_CHARS):
        raise ValueError(f"--chat-template {value!r} looks like a file path, but there is no "
                         "such file (an inline template holds {{ or {%)")
    return codecs.decode(value, "unicode_escape")


@dataclass(frozen=True)
class FrontendOptions:
    served_model_aliases: tuple[str, ...] = ()
    """Names besides the served model name that requests may use for the base model."""
    chat_template: str | None = None
    """Replaces the model's chat template (--chat-template), sandboxed the same way."""
    trust_request_chat_template: bool = False
    """Render a request's own `chat_template`; without it such a request gets a 400 (vLLM's)."""
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Passed to every chat template render; a request's chat_template_kwargs win."""
    max_logprobs: int = MAX_LOGPROBS
    """Most logprobs / top_logprobs a request may ask for."""
    return_tokens_as_token_ids: bool = False
    """Logprob tokens read "token_id:N" (tokens that are not valid UTF-8 alone stay exact)."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the engine's cap), "
                             f"got {self.max_logprobs}")

    def template_kwargs(self, request_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        return {**self.default_chat_template_kwargs, **(request_kwargs or {})}
