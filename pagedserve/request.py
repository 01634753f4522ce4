"""A request as the scheduler sees it: token ids, progress, status. No torch, no text.

Progress is counted in tokens: `num_computed_tokens` of `num_tokens` have KV in the cache. A prompt
chunk, a prefix-cache hit and a decode step all move the same counter.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    """Off the queues, its blocks reserved, while a KV tier loads part of its prefix."""
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything from here on is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class OutputConstraint(Protocol):
    """A constrained request's grammar state, as the scheduler sees it: plain token ids in, yes or
    no out. Implemented by structured_output/grammar.py (llguidance); the scheduler advances it
    with every accepted token and finishes the request when it is terminated."""

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over tokens the request emitted; False if the grammar rejected one."""

    @property
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and allows nothing more (or is in an error state)."""

    def num_valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (e.g. draft tokens) the grammar would accept in a row, from its
        current state, without advancing."""


@dataclass
class RequestTimes:
    """Wall-clock timestamps (time.monotonic seconds) of one request's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    """None for a pooling request."""
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    """Lower runs first; equal priorities run in arrival order."""
    cache_salt: str | None = None
    """Isolates this request's prefix-cache entries from requests with another salt."""
    lora_int_id: int | None = None
    """The LoRA adapter the request runs with (None: the base model)."""
    lora_digest: str | None = None
    """The adapter's content digest: its KV is cached apart from other adapters' and the base's."""
    arrival_time: float = field(default_factory=time.monotonic)
    pooling_params: PoolingParams | None = None
    """Set for a pooling (embedding) request: it computes its prompt, samples nothing, and
    finishes with the pooled vector."""

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first scheduling (-1: not scheduled yet),
    from the device pool or a KV tier."""
    num_tier_cached_tokens: int = 0
    """The part of num_cached_tokens loaded from a KV tier (kv_transfer/)."""
    num_preemptions: int = 0
    admission_order: int = -1
    """Set by the scheduler when first queued: breaks ties between equal priority and arrival."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that finished the request, if any."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Hash of each full block of `all_token_ids`, chained; maintained by the KV cache manager."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens proposed after the last step, to verify in the next one. Not part of
    `all_token_ids` (they may be rejected), so never hashed into the prefix cache."""
    constraint: OutputConstraint | None = None
    """Grammar state when sampling_params.structured_outputs is set; the engine attaches it once
    the grammar is compiled, before the request reaches the scheduler."""

    def __post_init__(self) -> None:
        self.times = RequestTimes(arrival=self.arrival_time)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_steps_in_flight = 0
        """Scheduled steps of this request whose results are not back yet (pipeline stages
        hold up to one per stage, async scheduling one; otherwise 0 whenever the scheduler
        runs)."""
        self.num_output_placeholders = 0
        """Async scheduling: output tokens sampled by steps in flight, not known yet. The
        scheduler counts them as tokens (a decode of the last one may be scheduled before it
        is known: the runner fills it in on the device) and as outputs (max_tokens)."""

    @property
    def cache_namespace(self) -> tuple:
        """What besides the tokens its KV depends on: the salt and the LoRA adapter (block_hash)."""
        namespace: tuple = ()
        if self.cache_salt is not None:
            namespace += ("salt", self.cache_salt)
        if self.lora_digest is not None:
            namespace += ("lora", self.lora_digest)
        return namespace

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_every_prompt_position(self) -> bool:
        """Whether the output of every prompt position is needed (prompt logprobs, mean
        pooling): then no prefix-cache or KV-tier hit may skip computing one."""
        if self.pooling_params is not None:
            return self.pooling_params.needs_every_position
        return self.sampling_params.prompt_logprobs is not None

    @property
    def max_tokens(self) -> int:
        assert self.sampling_params.max_tokens is not None, "the engine fills max_tokens"
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def check_stop(self, max_model_len: int) -> bool:
        """Finish the request if its last token ends it; returns True when it did.

        Stop strings are matched on text by the output processor, not here. A finished grammar
        is a stop ("stop"), even on the last token max_tokens allows: the output is complete.
        """
        params = self.sampling_params
        if self.constraint is not None and self.constraint.is_terminated:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if self.num_output_tokens >= params.min_tokens:
            last_token_id = self.output_token_ids[-1]
            if not params.ignore_eos and last_token_id in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last_token_id in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last_token_id
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
