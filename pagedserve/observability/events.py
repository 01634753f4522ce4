"""The engine's event stream: typed events per request, per step and from the block pool.

The scheduler, the block pool and the engine emit events into one `EventBus`; after every step
(and after adds and aborts) the engine publishes what was emitted, in order, to each subscriber.
Timelines, the tracer, the dashboard and the profiler consume the stream; the cache-aware router
will consume the block events.

Cheap by construction: with no subscriber the bus is disabled, and emitters test
`bus.enabled` before they build an event, so a step pays one attribute read per emit site.
Subscribers run on the engine thread, in the step: they must be quick and must not raise.

Times are time.monotonic() seconds, the clock of RequestTimes. Plain data, no torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


# ---- per request ------------------------------------------------------------------------------
# `req_id` is the scheduler's id of one sequence: the engine's request id, or `{i}_{id}` for
# the i-th of n > 1 sequences (`parent_id` in RequestQueued names the request).


@dataclass(frozen=True, slots=True)
class RequestQueued:
    req_id: str
    parent_id: str
    time: float
    """The request's arrival time."""
    num_prompt_tokens: int
    max_tokens: int
    lora_name: str | None = None
    temperature: float | None = None
    """The request's sampling parameters (the tracer's gen_ai.request.* attributes)."""
    top_p: float | None = None
    n: int = 1
    """Sequences of the request (each has its own req_id)."""


@dataclass(frozen=True, slots=True)
class AdmissionWaited:
    """The request was held back before the scheduler saw it: its grammar compiled, or its LoRA
    adapter loaded, from `start` to `end`."""

    req_id: str
    start: float
    end: float
    grammar: bool
    adapter: bool


@dataclass(frozen=True, slots=True)
class RequestScheduled:
    """The request runs `num_tokens` tokens in step `step`, after `num_computed_tokens` already
    have KV. Phase "prefill" computes known tokens (a prompt chunk, or recomputation after a
    preemption); "decode" computes the last sampled token (plus draft tokens)."""

    req_id: str
    step: int
    num_tokens: int
    num_computed_tokens: int
    phase: str
    num_draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """When the request was scheduled from the waiting queue, `num_tokens` of its tokens already
    had KV in `source`: "device" (the block pool's prefix cache) or a KV tier's name."""

    req_id: str
    step: int
    num_tokens: int
    source: str


@dataclass(frozen=True, slots=True)
class RequestPreempted:
    """Its blocks were freed in step `step`; the `num_tokens_lost` tokens it had computed will
    be recomputed (less what the prefix cache still holds when it resumes)."""

    req_id: str
    step: int
    time: float
    num_tokens_lost: int


@dataclass(frozen=True, slots=True)
class RequestResumed:
    """A preempted request is scheduled again; `num_tokens_to_recompute` tokens need KV anew."""

    req_id: str
    step: int
    num_tokens_to_recompute: int


@dataclass(frozen=True, slots=True)
class TokensGenerated:
    """Step `step` gave the request `num_tokens` new tokens (more than one: accepted drafts),
    known at `time`; `first` for its first token."""

    req_id: str
    step: int
    time: float
    num_tokens: int
    first: bool


@dataclass(frozen=True, slots=True)
class DraftsVerified:
    """Speculative decoding: of `num_draft_tokens` drafts verified in `step`, the first
    `num_accepted_tokens` were accepted."""

    req_id: str
    step: int
    num_draft_tokens: int
    num_accepted_tokens: int


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """reason: "stop", "length", "abort" or "error" (failed before it ran, e.g. its grammar)."""

    req_id: str
    time: float
    reason: str
    num_output_tokens: int


# ---- per step ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepFinished:
    """One engine step: what ran and where its time went. `start` is when scheduling began,
    `end` when its outputs were processed. The parts: schedule (scheduler + grammar masks),
    prepare (the runner's inputs), forward (the model), logits (the output head), sample
    (sampling, verification, drafting), output (update, detokenize, stop strings); `other` is
    the rest
    (admission, IPC to worker processes). The runner's parts are 0 when it did not report them
    (a step served by a pipeline)."""

    step: int
    start: float
    end: float
    num_requests: int
    num_prefill_requests: int
    num_decode_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    schedule_s: float
    prepare_s: float
    forward_s: float
    logits_s: float
    sample_s: float
    output_s: float

    @property
    def duration_s(self) -> float:
        return self.end - self.start

    @property
    def other_s(self) -> float:
        return max(0.0, self.duration_s - self.schedule_s - self.prepare_s - self.forward_s
                   - self.logits_s - self.sample_s - self.output_s)


# ---- from the block pool ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Full blocks that joined the prefix-cache index: their hashes, in chain order."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class BlocksEvicted:
    """Blocks whose cached content was dropped (reallocated, or the cache was reset)."""

    block_hashes: tuple[bytes, ...]


Event = (RequestQueued | AdmissionWaited | RequestScheduled | PrefixHit | RequestPreempted
         | RequestResumed | TokensGenerated | DraftsVerified | RequestFinished | StepFinished
         | BlocksStored | BlocksEvicted)

Subscriber = Callable[[list[Event]], None]


class EventBus:
    """Collects events during a step and hands them, in emission order, to every subscriber when
    the engine publishes. Emit sites check `enabled` first (False while nobody listens)."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []
        self._pending: list[Event] = []
        self.enabled = False
        self.publish_seconds = 0.0
        """Time spent in subscribers, in total (what observing costs beyond emitting)."""
        self.num_published = 0

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call `subscriber(events)` after every step that emitted some; returns the
        unsubscribe function."""
        self._subscribers.append(subscriber)
        self.enabled = True

        def unsubscribe() -> None:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)
            self.enabled = bool(self._subscribers)
            if not self.enabled:
                self._pending.clear()

        return unsubscribe

    def emit(self, event: Event) -> None:
        if self.enabled:
            self._pending.append(event)

    def publish(self) -> None:
        """Hand the pending events to the subscribers. A subscriber that raises is logged and
        dropped: observing must never stop the engine."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        start = time.perf_counter()
        self.num_published += len(events)
        for subscriber in list(self._subscribers):
            try:
                subscriber(events)
            except Exception:
                logger.exception("event subscriber %r failed; unsubscribed", subscriber)
                self._subscribers.remove(subscriber)
                self.enabled = bool(self._subscribers)
        self.publish_seconds += time.perf_counter() - start

    @property
    def num_pending(self) -> int:
        return len(self._pending)
