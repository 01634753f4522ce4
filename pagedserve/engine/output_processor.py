"""Turns the scheduler's token outputs into user-facing RequestOutputs.

Owns everything textual about a running request: incremental detokenization, stop strings,
logprob dictionaries, and the fan-in of n > 1 sequences into one output. The scheduler knows none
of it; when a stop string ends a sequence, this module reports it and the engine finishes it there.
A pooling request is one sequence without text; its one output carries the vector.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedserve.core.outputs import EngineCoreOutput, TokenLogprobs
from pagedserve.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    Logprob,
    OutputKind,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import Tokenizer


@dataclass
class SequenceState:
    """One of a request's n sequences: a scheduler request of its own."""

    index: int
    params: SamplingParams | PoolingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    """Tokens already returned in DELTA outputs."""
    detokenize_at_end: bool = False
    """Text is wanted only once the sequence ends (FINAL_ONLY) and no stop string needs it
    earlier: tokens go to the detokenizer then, in one call, instead of every step (the same
    text: it decodes windows of the same ids either way)."""


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: OutputKind
    sequences: dict[str, SequenceState]
    """Scheduler request id -> its sequence."""
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    num_tier_cached_tokens: int = 0
    is_pooling: bool = False
    embedding: list[float] | None = None
    """A pooling request's vector, once its prompt is computed."""

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.sequences.values())


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput | PoolingRequestOutput]
    stopped_by_string: dict[str, str]
    """Scheduler request id -> the stop string that ended it; the engine must finish these."""


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._seq_to_request: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        seq_params: dict[str, SamplingParams | PoolingParams],
        output_kind: OutputKind,
        arrival_time: float,
    ) -> None:
        """seq_params: one entry per sequence (a pooling request has one, its PoolingParams)."""
        sequences = {}
        for index, (seq_id, params) in enumerate(seq_params.items()):
            if isinstance(params, PoolingParams):
                sequences[seq_id] = SequenceState(index, params, detokenizer=None)
                self._seq_to_request[seq_id] = request_id
                continue
            detokenizer = None
            if params.detokenize:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            sequences[seq_id] = SequenceState(
                index=index,
                params=params,
                detokenizer=detokenizer,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
                detokenize_at_end=(detokenizer is not None and not detokenizer.stop
                                   and output_kind == OutputKind.FINAL_ONLY),
            )
            self._seq_to_request[seq_id] = request_id
        first_params = next(iter(seq_params.values()))
        is_pooling = isinstance(first_params, PoolingParams)
        self.requests[request_id] = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            output_kind=output_kind,
            sequences=sequences,
            metrics=RequestMetrics(arrival_time=arrival_time, n=len(sequences),
                                   max_tokens=None if is_pooling else first_params.max_tokens),
            prompt_logprobs=(None if is_pooling or first_params.prompt_logprobs is None
                             else [None]),
            is_pooling=is_pooling,
        )

    def sequence_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return list(state.sequences) if state else []

    def abort_request(self, request_id: str) -> RequestOutput | PoolingRequestOutput | None:
        """Forget a request; returns its final output (unfinished sequences end in "abort")."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for seq in state.sequences.values():
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        state.metrics.finished_time = time.monotonic()
        output = self._make_output(state, finished=True)
        self._forget(request_id)
        return output

    def fail_request(self, request_id: str, error: str
                     ) -> RequestOutput | PoolingRequestOutput | None:
        """Like abort_request, with the reason in the final output's `error`."""
        output = self.abort_request(request_id)
        if output is not None:
            output.error = error
        return output

    def _forget(self, request_id: str) -> None:
        state = self.requests.pop(request_id)
        for seq_id in state.sequences:
            self._seq_to_request.pop(seq_id, None)

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        stopped_by_string: dict[str, str] = {}
        for out in core_outputs:
            request_id = self._seq_to_request.get(out.req_id)
            if request_id is None:
                continue  # aborted meanwhile
            state = self.requests[request_id]
            seq = state.sequences[out.req_id]
            touched[request_id] = state
            if out.num_cached_tokens > state.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
                state.num_tier_cached_tokens = out.num_tier_cached_tokens
            if out.first_scheduled_time is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = out.first_scheduled_time
            if out.pooled_output is not None:
                state.embedding = out.pooled_output
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, out.new_prompt_logprobs)
            if out.new_token_ids:
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                state.metrics.last_token_time = now
                new_token_ids, stop_str = out.new_token_ids, None
                if (seq.detokenizer is not None and seq.finish_reason is None
                        and not seq.detokenize_at_end):
                    num_kept, stop_str = _detokenize(seq.detokenizer, new_token_ids)
                    new_token_ids = new_token_ids[:num_kept]
                seq.token_ids.extend(new_token_ids)
                if out.new_logprobs is not None and seq.logprobs is not None:
                    for entry in out.new_logprobs[: len(new_token_ids)]:
                        seq.logprobs.append(self._to_position_logprobs(entry))
                        seq.cumulative_logprob += entry.logprobs[0]
                # A stop string completed before the step's last token ends the sequence there,
                # whatever the scheduler decided about the later tokens; at the last token the
                # scheduler's own stop (EOS, length) wins, as it does without speculation.
                cut_short = len(new_token_ids) < len(out.new_token_ids)
                if stop_str is not None and (cut_short or not out.finished):
                    seq.finish_reason, seq.stop_reason = "stop", stop_str
                    if not out.finished:
                        stopped_by_string[out.req_id] = stop_str
            if out.finished and seq.finish_reason is None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason

        request_outputs = []
        for request_id, state in touched.items():
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
            output = self._make_output(state, finished)
            if output is not None:
                request_outputs.append(output)
            if finished:
                self._forget(request_id)
        return ProcessedOutputs(request_outputs, stopped_by_string)

    def _make_output(self, state: RequestState, finished: bool
                     ) -> RequestOutput | PoolingRequestOutput | None:
        if state.is_pooling:
            return self._make_pooling_output(state) if finished else None
        kind = state.output_kind
        if kind == OutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for seq in state.sequences.values():
            text = ""
            if seq.detokenizer is not None:
                if seq.detokenize_at_end:
                    seq.detokenizer.update(seq.token_ids)  # once: only a final output asks
                    seq.detokenize_at_end = False
                seq_done = seq.finish_reason is not None
                text = seq.detokenizer.get_next_output_text(
                    finished=seq_done, delta=kind == OutputKind.DELTA
                )
            if kind == OutputKind.DELTA:
                new_tokens = seq.token_ids[seq.num_sent_tokens :]
                logprobs = None if seq.logprobs is None else seq.logprobs[seq.num_sent_tokens :]
                if not new_tokens and not text and seq.finish_reason is None:
                    continue
                seq.num_sent_tokens = len(seq.token_ids)
            else:
                new_tokens, logprobs = list(seq.token_ids), seq.logprobs
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=new_tokens,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        if not completions and not finished:
            return None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            num_tier_cached_tokens=state.num_tier_cached_tokens,
            metrics=state.metrics,
        )

    @staticmethod
    def _make_pooling_output(state: RequestState) -> PoolingRequestOutput:
        return PoolingRequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=EmbeddingOutput(state.embedding) if state.embedding is not None else None,
            finished=True,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )

    def _add_prompt_logprobs(self, state: RequestState, chunk: tuple[int, list[TokenLogprobs]]):
        first_position, entries = chunk
        # A request recomputed after preemption resends positions it already sent: overwrite.
        del state.prompt_logprobs[first_position:]
        assert len(state.prompt_logprobs) == first_position, "prompt logprobs arrived out of order"
        state.prompt_logprobs.extend(self._to_position_logprobs(e) for e in entries)

    def _to_position_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        result: PositionLogprobs = {}
        for rank_index, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs)):
            if token_id in result:
                continue  # the chosen token is also in the top-k
            rank = entry.chosen_rank if rank_index == 0 else rank_index
            result[token_id] = Logprob(logprob, rank, self.tokenizer.decode_token(token_id))
        return result


def _detokenize(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> tuple[int, str | None]:
    """Feed a step's tokens; returns (tokens kept, the stop string that ended the text or None).

    A speculative step emits several tokens at once. With stop strings they go in one by one,
    so a stop string completed by an early token drops the later ones (text and token ids end
    where a one-token-per-step engine would have stopped)."""
    if not detokenizer.stop or len(token_ids) == 1:
        return len(token_ids), detokenizer.update(token_ids)
    for num_fed, token_id in enumerate(token_ids, start=1):
        stop_str = detokenizer.update([token_id])
        if stop_str is not None:
            return num_fed, stop_str
    return len(token_ids), None
