"""Per-request timelines, built from the event stream: where one request's time went.

A `TimelineStore` subscribes to the engine's events. It keeps a builder per live sequence and,
once a sequence finishes, its rendered timeline in a bounded ring (the last `history` ones).
`get(id)` answers for live and finished requests alike, by the engine's request id, a
sequence id, or an alias (the server registers its response ids).

A timeline is a JSON-ready dict. Times are seconds relative to the request's arrival:

    summary     queue, prefill, decode, e2e and TTFT seconds; the TTFT split into admission wait,
                queueing, time in steps, preempted time and waits between steps; cached tokens by
                source; preemptions and recomputed tokens; a one-line explanation
    segments    what the Gantt chart draws: admission_wait, queued, prefill (each chunk, with its
                step), decode (runs of consecutive decode steps, compressed), preempted
    events      queued, admitted, prefix_hit, preempted, resumed, first_token, finished
    itl         inter-token latency statistics; speculative: drafts and acceptance

Thread-safe: events arrive on the engine thread, readers are HTTP handlers.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.observability.events import (
    AdmissionWaited,
    DraftsVerified,
    Event,
    PrefixHit,
    RequestFinished,
    RequestPreempted,
    RequestQueued,
    RequestResumed,
    RequestScheduled,
    StepFinished,
    TokensGenerated,
)

DEFAULT_HISTORY = 1000


@dataclass
class _StepSpan:
    """A prefill chunk (one step) or a decode run (consecutive decode steps of one request).
    start and end come from the steps' StepFinished events, which may arrive later."""

    kind: str
    first_step: int
    last_step: int
    num_tokens: int
    num_computed_tokens: int = 0
    num_steps: int = 1
    start: float | None = None
    end: float | None = None

    def step_finished(self, event: StepFinished) -> None:
        if self.start is None:
            self.start = event.start
        self.end = event.end


@dataclass
class _Preemption:
    step: int
    time: float
    num_tokens_lost: int
    resumed_step: int | None = None
    resumed: _StepSpan | None = None
    num_tokens_to_recompute: int | None = None
    num_tokens_from_cache: int = 0
    """Of the lost tokens, those the prefix cache (or a tier) still held at resumption."""


@dataclass
class _Builder:
    """One sequence's timeline while it is live."""

    req_id: str
    parent_id: str
    arrival: float
    num_prompt_tokens: int
    max_tokens: int
    lora_name: str | None
    sampling: dict | None = None
    """What was asked for: temperature, top_p, n."""
    admission: AdmissionWaited | None = None
    spans: list[_StepSpan] = field(default_factory=list)
    open_decode: _StepSpan | None = None
    hits: list[PrefixHit] = field(default_factory=list)
    """Prefix hits at its first admission; a resumption's are in its _Preemption."""
    preemptions: list[_Preemption] = field(default_factory=list)
    first_token: float | None = None
    last_token: float | None = None
    num_output_tokens: int = 0
    token_gaps: list[float] = field(default_factory=list)
    """Inter-token latency of each token after the first (a multi-token step spreads its gap)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    finished: RequestFinished | None = None

    @property
    def state(self) -> str:
        if self.finished is not None:
            return "finished"
        if self.preemptions and self.preemptions[-1].resumed_step is None:
            return "preempted"
        if self.spans:
            return "running"
        return "waiting"


class TimelineStore:
    """Subscribe `store.on_events` to an EventBus (engine.events.subscribe)."""

    def __init__(self, history: int = DEFAULT_HISTORY) -> None:
        if history < 1:
            raise ValueError(f"the timeline history must hold at least 1 request, got {history}")
        self.history = history
        self._lock = threading.Lock()
        self._live: dict[str, _Builder] = {}
        self._finished: OrderedDict[str, dict] = OrderedDict()
        """Sequence id -> rendered timeline, oldest first."""
        self._sequences: dict[str, list[str]] = {}
        """Request id (the engine's) -> its sequence ids."""
        self._aliases: OrderedDict[str, list[str]] = OrderedDict()
        """An outside id (the server's response id) -> the engine request ids it covers."""
        self._pending_steps: dict[int, list[_StepSpan]] = {}
        """Step -> spans that wait for its StepFinished."""
        self._finish_listeners: list[Callable[[dict], None]] = []
        self._wall_offset = time.time() - time.monotonic()

    # ---- the engine thread ----------------------------------------------------------------------

    def on_events(self, events: list[Event]) -> None:
        finished: list[_Builder] = []
        with self._lock:
            for event in events:
                handler = self._HANDLERS.get(type(event))
                if handler is not None:
                    builder = handler(self, event)
                    if builder is not None:
                        finished.append(builder)
            rendered = [self._retire(builder) for builder in finished]
        for timeline in rendered:
            for listener in self._finish_listeners:
                listener(timeline)

    def add_finish_listener(self, listener: Callable[[dict], None]) -> None:
        """Call `listener(timeline)` (on the engine thread) as each sequence finishes."""
        self._finish_listeners.append(listener)

    def _queued(self, event: RequestQueued) -> None:
        self._live[event.req_id] = _Builder(event.req_id, event.parent_id, event.time,
                                            event.num_prompt_tokens, event.max_tokens,
                                            event.lora_name,
                                            {"temperature": event.temperature,
                                             "top_p": event.top_p, "n": event.n})
        self._sequences.setdefault(event.parent_id, []).append(event.req_id)

    def _admitted(self, event: AdmissionWaited) -> None:
        builder = self._live.get(event.req_id)
        if builder is not None:
            builder.admission = event

    def _scheduled(self, event: RequestScheduled) -> None:
        builder = self._live.get(event.req_id)
        if builder is None:
            return
        if event.phase == "decode" and builder.open_decode is not None:
            span = builder.open_decode
            span.last_step = event.step
            span.num_steps += 1
            span.num_tokens += event.num_tokens
        else:
            span = _StepSpan(event.phase, event.step, event.step, event.num_tokens,
                             event.num_computed_tokens)
            builder.spans.append(span)
            builder.open_decode = span if event.phase == "decode" else None
            preemption = builder.preemptions[-1] if builder.preemptions else None
            if preemption is not None and preemption.resumed_step == event.step:
                preemption.resumed = span
        self._pending_steps.setdefault(event.step, []).append(span)

    def _step_finished(self, event: StepFinished) -> None:
        for span in self._pending_steps.pop(event.step, ()):
            span.step_finished(event)

    def _prefix_hit(self, event: PrefixHit) -> None:
        builder = self._live.get(event.req_id)
        if builder is None:
            return
        if builder.preemptions:
            builder.preemptions[-1].num_tokens_from_cache += event.num_tokens
        else:
            builder.hits.append(event)

    def _preempted(self, event: RequestPreempted) -> None:
        builder = self._live.get(event.req_id)
        if builder is not None:
            builder.preemptions.append(_Preemption(event.step, event.time, event.num_tokens_lost))
            builder.open_decode = None

    def _resumed(self, event: RequestResumed) -> None:
        builder = self._live.get(event.req_id)
        if builder is not None and builder.preemptions:
            preemption = builder.preemptions[-1]
            preemption.resumed_step = event.step
            preemption.num_tokens_to_recompute = event.num_tokens_to_recompute

    def _tokens(self, event: TokensGenerated) -> None:
        builder = self._live.get(event.req_id)
        if builder is None:
            return
        if builder.last_token is not None:
            gap = (event.time - builder.last_token) / event.num_tokens
            builder.token_gaps.extend([gap] * event.num_tokens)
        if builder.first_token is None:
            builder.first_token = event.time
        builder.last_token = event.time
        builder.num_output_tokens += event.num_tokens

    def _drafts(self, event: DraftsVerified) -> None:
        builder = self._live.get(event.req_id)
        if builder is not None:
            builder.num_drafts += 1
            builder.num_draft_tokens += event.num_draft_tokens
            builder.num_accepted_tokens += event.num_accepted_tokens

    def _finished_event(self, event: RequestFinished) -> _Builder | None:
        builder = self._live.get(event.req_id)
        if builder is not None:
            builder.finished = event
        return builder

    _HANDLERS = {
        RequestQueued: _queued,
        AdmissionWaited: _admitted,
        RequestScheduled: _scheduled,
        StepFinished: _step_finished,
        PrefixHit: _prefix_hit,
        RequestPreempted: _preempted,
        RequestResumed: _resumed,
        TokensGenerated: _tokens,
        DraftsVerified: _drafts,
        RequestFinished: _finished_event,
    }

    def _retire(self, builder: _Builder) -> dict:
        """Render a finished sequence into the ring (evicting the oldest past `history`)."""
        del self._live[builder.req_id]
        timeline = self._render(builder)
        self._finished[builder.req_id] = timeline
        while len(self._finished) > self.history:
            old_id, old = self._finished.popitem(last=False)
            parent = old["parent_id"]
            siblings = self._sequences.get(parent)
            if siblings is not None:
                if old_id in siblings:
                    siblings.remove(old_id)
                if not siblings:
                    del self._sequences[parent]
        while len(self._aliases) > self.history:
            self._aliases.popitem(last=False)
        return timeline

    # ---- readers ----------------------------------------------------------------------------------

    def add_alias(self, alias: str, request_ids: list[str]) -> None:
        """Let `get(alias)` find the timelines of these engine request ids."""
        with self._lock:
            self._aliases[alias] = list(request_ids)
            self._aliases.move_to_end(alias)

    def get(self, request_id: str) -> dict | None:
        """The timeline of a request (by alias, engine request id or sequence id), live or
        finished; None if unknown or evicted. A request of several sequences (n > 1, or an
        alias over several prompts) gets the first sequence's timeline plus `sequences`, all
        of them."""
        with self._lock:
            request_ids = self._aliases.get(request_id, [request_id])
            seq_ids = [s for r in request_ids for s in self._sequences.get(r, [r])]
            timelines = [t for t in map(self._lookup, seq_ids) if t is not None]
        if not timelines:
            return None
        if len(timelines) == 1 and len(seq_ids) == 1:
            timeline = timelines[0]
            if timeline["request_id"] == request_id or timeline["sequence_id"] == request_id:
                return timeline
            return {**timeline, "request_id": request_id,
                    "engine_request_id": timeline["request_id"]}
        return {**timelines[0], "request_id": request_id, "sequences": timelines}

    def recent(self, limit: int = 50) -> list[dict]:
        """The last `limit` sequences to arrive, live and finished, newest first."""
        with self._lock:
            live = [self._render(b) for b in self._live.values()]
            finished = list(self._finished.values())[-limit:]
        timelines = live + finished
        timelines.sort(key=lambda t: t["arrival_time"], reverse=True)
        return timelines[:limit]

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def num_pending_steps(self) -> int:
        with self._lock:
            return len(self._pending_steps)

    def _lookup(self, seq_id: str) -> dict | None:
        builder = self._live.get(seq_id)
        if builder is not None:
            return self._render(builder)
        return self._finished.get(seq_id)

    # ---- rendering ----------------------------------------------------------------------------------

    def _render(self, b: _Builder) -> dict:
        arrival = b.arrival

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - arrival, 6)

        segments: list[dict] = []
        events: list[dict] = [{"t": 0.0, "type": "queued",
                               "num_prompt_tokens": b.num_prompt_tokens}]
        wait_end = arrival
        if b.admission is not None:
            wait_end = b.admission.end
            segments.append({"kind": "admission_wait", "start": rel(b.admission.start),
                             "end": rel(b.admission.end), "grammar": b.admission.grammar,
                             "adapter": b.admission.adapter})
            events.append({"t": rel(b.admission.end), "type": "admitted",
                           "grammar": b.admission.grammar, "adapter": b.admission.adapter})
        first_start = b.spans[0].start if b.spans else None
        if first_start is not None:
            segments.append({"kind": "queued", "start": rel(wait_end), "end": rel(first_start)})
        elif b.finished is None:
            segments.append({"kind": "queued", "start": rel(wait_end), "end": None})
        for span in b.spans:
            segment = {"kind": span.kind, "start": rel(span.start), "end": rel(span.end),
                       "first_step": span.first_step, "num_tokens": span.num_tokens}
            if span.kind == "prefill":
                segment["num_computed_tokens"] = span.num_computed_tokens
            else:
                segment["last_step"] = span.last_step
                segment["num_steps"] = span.num_steps
            segments.append(segment)
        for preemption in b.preemptions:
            resumed_at = preemption.resumed.start if preemption.resumed is not None else None
            segments.append({"kind": "preempted", "start": rel(preemption.time),
                             "end": rel(resumed_at), "step": preemption.step,
                             "num_tokens_lost": preemption.num_tokens_lost})
            events.append({"t": rel(preemption.time), "type": "preempted",
                           "step": preemption.step,
                           "num_tokens_lost": preemption.num_tokens_lost})
            if preemption.resumed_step is not None:
                events.append({"t": rel(resumed_at), "type": "resumed",
                               "step": preemption.resumed_step,
                               "num_tokens_to_recompute": preemption.num_tokens_to_recompute,
                               "num_tokens_from_cache": preemption.num_tokens_from_cache})
        segments.sort(key=lambda s: math.inf if s["start"] is None else s["start"])
        for hit in b.hits:
            events.append({"t": rel(self._step_start(b, hit.step)), "type": "prefix_hit",
                           "step": hit.step, "num_tokens": hit.num_tokens,
                           "source": hit.source})
        if b.first_token is not None:
            events.append({"t": rel(b.first_token), "type": "first_token"})
        if b.finished is not None:
            events.append({"t": rel(b.finished.time), "type": "finished",
                           "reason": b.finished.reason})
        events.sort(key=lambda e: math.inf if e["t"] is None else e["t"])

        timeline = {
            "object": "request.timeline",
            "request_id": b.parent_id,
            "sequence_id": b.req_id,
            "state": b.state,
            "arrival_time": round(arrival + self._wall_offset, 6),
            "finish_reason": b.finished.reason if b.finished else None,
            "lora_name": b.lora_name,
            "num_prompt_tokens": b.num_prompt_tokens,
            "num_output_tokens": b.num_output_tokens,
            "max_tokens": b.max_tokens,
            "sampling": b.sampling,
            "summary": self._summary(b, first_start),
            "segments": segments,
            "events": events,
            "itl": _itl_stats(b.token_gaps),
            "speculative": ({"num_drafts": b.num_drafts, "num_draft_tokens": b.num_draft_tokens,
                             "num_accepted_tokens": b.num_accepted_tokens,
                             "acceptance_rate": round(b.num_accepted_tokens
                                                      / b.num_draft_tokens, 4)}
                            if b.num_draft_tokens else None),
            "grammar": ({"wait_s": round(b.admission.end - b.admission.start, 6)}
                        if b.admission is not None and b.admission.grammar else None),
        }
        return timeline

    @staticmethod
    def _step_start(b: _Builder, step: int) -> float | None:
        for span in b.spans:
            if span.first_step == step:
                return span.start
        return None

    def _summary(self, b: _Builder, first_start: float | None) -> dict:
        arrival = b.arrival
        finished = b.finished.time if b.finished is not None else None
        admission_s = b.admission.end - b.admission.start if b.admission is not None else 0.0
        cached: dict[str, int] = {}
        for hit in b.hits:
            cached[hit.source] = cached.get(hit.source, 0) + hit.num_tokens
        summary = {
            "queue_s": _round(first_start - arrival if first_start is not None else None),
            "prefill_s": _round(b.first_token - first_start
                                if b.first_token is not None and first_start is not None
                                else None),
            "decode_s": _round(b.last_token - b.first_token
                               if b.first_token is not None else None),
            "e2e_s": _round(finished - arrival if finished is not None else None),
            "ttft_s": _round(b.first_token - arrival if b.first_token is not None else None),
            "admission_wait_s": _round(admission_s),
            "num_prefill_chunks": sum(1 for s in b.spans if s.kind == "prefill"),
            "num_decode_steps": sum(s.num_steps for s in b.spans if s.kind == "decode"),
            "cached_tokens": cached,
            "num_preemptions": len(b.preemptions),
            "num_recomputed_tokens": sum(p.num_tokens_to_recompute or 0
                                         for p in b.preemptions),
        }
        breakdown = self._ttft_breakdown(b, first_start, admission_s)
        summary["ttft_breakdown"] = breakdown
        summary["explanation"] = _explain(b, summary, breakdown)
        return summary

    @staticmethod
    def _ttft_breakdown(b: _Builder, first_start: float | None, admission_s: float) -> dict | None:
        """The time to first token as a partition: admission wait, queueing before the first
        step, the steps that ran this request's chunks (their whole wall time: the batch shares
        it), preempted time (preemption to resumption) and the rest, waiting between steps."""
        if b.first_token is None or first_start is None:
            return None
        ttft = b.first_token - b.arrival
        # The step that produced the first token counts up to it (its outputs end a bit later).
        in_steps = sum(min(s.end, b.first_token) - s.start for s in b.spans
                       if s.start is not None and s.end is not None and s.start < b.first_token)
        preempted = sum(p.resumed.start - p.time for p in b.preemptions
                        if p.resumed is not None and p.resumed.start is not None
                        and p.resumed.start <= b.first_token)
        queued = first_start - b.arrival - admission_s
        rest = ttft - admission_s - queued - in_steps - preempted
        return {"admission_wait_s": _round(admission_s), "queued_s": _round(queued),
                "in_steps_s": _round(in_steps), "preempted_s": _round(preempted),
                "between_steps_s": _round(max(rest, 0.0))}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def nearest_rank_percentile(sorted_values: list[float], q: float) -> float:
    """The q-quantile (0 < q <= 1) of a sorted, non-empty list: a value that occurred."""
    index = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[index]


def _itl_stats(gaps: list[float]) -> dict | None:
    if not gaps:
        return None
    ordered = sorted(gaps)
    quantiles = {f"p{round(100 * q)}_s": _round(nearest_rank_percentile(ordered, q))
                 for q in (0.5, 0.9, 0.99)}
    return {"count": len(ordered), "mean_s": _round(sum(ordered) / len(ordered)), **quantiles,
            "max_s": _round(ordered[-1])}


def _explain(b: _Builder, summary: dict, breakdown: dict | None) -> str:
    """One sentence: what the TTFT went to, largest part first."""
    if breakdown is None:
        if b.finished is not None:
            return f"finished ({b.finished.reason}) before its first token"
        return "waiting for its first token"
    ttft = summary["ttft_s"]
    names = {"admission_wait_s": "waiting for its grammar or adapter",
             "queued_s": "queued before its first step",
             "in_steps_s": f"in {summary['num_prefill_chunks']} prefill step(s)",
             "preempted_s": "preempted", "between_steps_s": "waiting between its steps"}
    parts = sorted(((value, key) for key, value in breakdown.items() if value and value > 0),
                   reverse=True)
    text = f"TTFT {ttft:.3f} s: " + ", ".join(
        f"{value:.3f} s {names[key]} ({100 * value / ttft:.0f}%)" for value, key in parts[:3]
        if ttft > 0)
    cached = summary["cached_tokens"]
    if cached:
        text += "; cached " + ", ".join(f"{n} tokens from {source}"
                                        for source, n in cached.items())
    if summary["num_preemptions"]:
        text += f"; preempted {summary['num_preemptions']}x, "
        text += ("waiting to resume" if b.state == "preempted"
                 else f"{summary['num_recomputed_tokens']} tokens recomputed")
    return text
