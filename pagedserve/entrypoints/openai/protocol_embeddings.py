"""The wire format of POST /v1/embeddings (OpenAI's, with vLLM's extra fields): the request, and
the response with each vector as floats or as base64 of little-endian float32.

Only shapes and static bounds live here; limits that need the model (context length, embedding
size) are checked in serving_embeddings.py.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, field_validator

from pagedserve.entrypoints.openai.protocol import (
    RequestModel,
    ResponseModel,
    UsageInfo,
    check_prompt_shape,
)

MAX_EMBEDDING_INPUTS = 2048
"""Most inputs one request may embed (OpenAI's limit)."""


class EmbeddingRequest(RequestModel):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    """base64: each vector as the base64 of its little-endian float32 bytes (what the official
    client asks for by default, and decodes)."""
    dimensions: int | None = Field(default=None, ge=1)
    """Keep the first N dimensions, then normalize (Matryoshka-style truncation)."""
    user: str | None = None
    """Accepted and ignored."""
    # vLLM's extra fields:
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """Embed only the last N tokens of each input (-1: the context length)."""
    add_special_tokens: bool = True
    """Tokenize text inputs with the model's special tokens (e.g. BOS)."""
    normalize: bool = True
    """L2-normalize each vector."""
    priority: int = 0
    """Lower runs first (with other requests of the engine)."""

    @field_validator("input", mode="before")
    @classmethod
    def _check_input_shape(cls, value: Any) -> Any:
        return check_prompt_shape(value, "input", MAX_EMBEDDING_INPUTS, "inputs",
                                  allow_empty_text=False)


class EmbeddingData(ResponseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    """Floats, or a base64 string (encoding_format)."""


class EmbeddingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
    """prompt_tokens = total_tokens: the tokens embedded (nothing is generated)."""
