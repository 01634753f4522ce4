"""What the engine returns to users: one RequestOutput per request, one CompletionOutput per
sequence (n > 1 gives several), with text, token ids, logprobs and timing; and for a pooling
(embedding) request one PoolingRequestOutput with its EmbeddingOutput."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OutputKind(enum.Enum):
    CUMULATIVE = enum.auto()
    """Every output carries everything generated so far."""
    DELTA = enum.auto()
    """Every output carries only what is new since the last one (streaming)."""
    FINAL_ONLY = enum.auto()
    """One output when the request finishes (offline generate)."""


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    """1 = the model's most likely token."""
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]
"""token id -> logprob at one position: the chosen token plus the top-k."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    """"stop", "length" or "abort"; None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the sequence (None for EOS or length)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic-clock timestamps in seconds, and the request's parameters that the metrics
    count (metrics.py)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    n: int = 1
    """Sequences the request asked for (SamplingParams.n)."""
    max_tokens: int | None = None
    """Its max_tokens, as the engine runs it (filled in when the request left it out)."""

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache (of the first sequence): from the device
    pool or a KV tier."""
    metrics: RequestMetrics
    num_tier_cached_tokens: int = 0
    """The part of num_cached_tokens loaded from a KV tier (kv_transfer/)."""
    error: str | None = None
    """Why the request failed before generating anything (e.g. its grammar did not compile);
    its sequences then end with finish_reason "abort"."""


@dataclass
class EmbeddingOutput:
    embedding: list[float]
    """The pooled vector: truncated to the request's dimensions, L2-normalized (PoolingParams)."""

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    """What a pooling (embedding) request returns: one output, when its prompt is computed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    """None when the request was aborted (or failed: see `error`) before its prompt was done."""
    finished: bool
    num_cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache (only last pooling reuses any)."""
    metrics: RequestMetrics
    error: str | None = None
    """Why the request failed (e.g. its LoRA adapter did not load)."""
