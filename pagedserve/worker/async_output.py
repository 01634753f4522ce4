"""Async scheduling, the runner's half: a step's sampled tokens stay on the device until read.

The runner launches step N and returns an AsyncModelRunnerOutput at once; N's sampled token ids
(and logprobs) are being copied to pinned host memory behind the sampling kernels. Meanwhile the
engine schedules step N + 1 and the runner prepares it: the tokens N sampled are placeholders
(PLACEHOLDER_TOKEN_ID) at the end of their requests' token_ids, and N + 1's input ids at those
positions are filled on the device from N's sampled-token tensor, with no host sync.
`get_output()` waits for N's copy, builds its ModelRunnerOutput and writes the real tokens over
the placeholders. The engine reads N only after launching N + 1, and N + 1 before launching
N + 2, so a placeholder met while preparing a step always comes from the step just before.

On the CPU a step computes synchronously and nothing overlaps, but the same path runs (the
"copy" is the sampled tensor itself), so tests compare it with synchronous scheduling there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.core.outputs import ModelRunnerOutput, TokenLogprobs
from pagedserve.sample.sampler import SamplerOutput, reads_output_token_values

if TYPE_CHECKING:
    from pagedserve.worker.model_runner import CachedRequestState

PLACEHOLDER_TOKEN_ID = -1
"""Stands in a request's token_ids for a token sampled on the device but not read back yet."""


def record_sampled(
    output: ModelRunnerOutput, states: Sequence[CachedRequestState], sampled: list[int],
    logprobs_rows: list[list[float]] | None, logprob_ids_rows: list[list[int]] | None,
    ranks: list[int] | None,
) -> None:
    """Put one token per row (and its logprobs, for the requests that asked) into `output`."""
    for i, (state, token_id) in enumerate(zip(states, sampled)):
        output.sampled_token_ids[state.req_id] = [token_id]
        num_logprobs = state.sampling_params.logprobs
        if num_logprobs is not None and logprobs_rows is not None:
            output.logprobs[state.req_id] = [
                TokenLogprobs(
                    token_ids=logprob_ids_rows[i][: 1 + num_logprobs],
                    logprobs=logprobs_rows[i][: 1 + num_logprobs],
                    chosen_rank=ranks[i],
                )
            ]


@dataclass
class DeviceSampledTokens:
    """One step's sampled token ids, still on the device: where the next step's input ids at
    placeholders come from."""

    step_index: int
    token_ids: torch.Tensor
    """(B,) int64 on the device, one row per request sampled."""
    rows: dict[str, int]
    """req_id -> its row."""


class AsyncModelRunnerOutput:
    """A launched step's output. Everything but the sampled tokens and their logprobs is filled
    by the time execute_model returns; those are read back by get_output() (vLLM's
    AsyncModelRunnerOutput)."""

    def __init__(self, output: ModelRunnerOutput, states: list[CachedRequestState],
                 sampler_output: SamplerOutput) -> None:
        """Start copying the sampled tokens (and logprobs) to the host; call right after the
        sampler, before the placeholders are appended. `output` may still be filled in."""
        self._output = output
        self._states = states
        self._positions = [(len(s.token_ids), len(s.output_token_ids)) for s in states]
        """Per row, the placeholder's index in token_ids and in output_token_ids."""
        tensors = [sampler_output.sampled_token_ids]
        if sampler_output.logprobs is not None:
            tensors += [sampler_output.logprobs, sampler_output.logprob_token_ids,
                        sampler_output.sampled_token_ranks]
        self._copied: torch.cuda.Event | None = None
        if tensors[0].device.type == "cuda":
            # NOTE: on the current stream, so behind the sampling kernels; the event behind the
            # copies. Pinned buffers are allocated per step: torch's pinned allocator reuses one
            # only once the copies recorded on it are done.
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, tensor in zip(self._host, tensors):
                host.copy_(tensor, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = tensors  # already on the host, computed
        self.done = False
        """Whether get_output() has read the tokens back."""

    def get_output(self) -> ModelRunnerOutput:
        """Wait for the copy, fill in the sampled tokens, and write them over the placeholders in
        the request states (also states the runner has dropped since: harmless). Idempotent."""
        if self.done:
            return self._output
        if self._copied is not None:
            self._copied.synchronize()
        sampled, *logprobs = [t.tolist() for t in self._host]
        for state, (position, output_position), token_id in zip(
                self._states, self._positions, sampled):
            assert state.token_ids[position] == PLACEHOLDER_TOKEN_ID
            state.token_ids[position] = token_id
            state.output_token_ids[output_position] = token_id
            state.num_placeholders -= 1
        record_sampled(self._output, self._states, sampled, *(logprobs or (None, None, None)))
        self.done = True
        self._host, self._states = [], []
        return self._output


class AsyncSampling:
    """The runner's async scheduling state: the last step's sampled tokens on the device, and the
    last launched output not read back yet."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.step_index = -1
        """The number of the current execute_model call (from 0; empty steps count too)."""
        self.last_sampled: DeviceSampledTokens | None = None
        self.last_output: AsyncModelRunnerOutput | None = None
        self._launched: AsyncModelRunnerOutput | None = None
        """This step's output, once its sampler has run."""
        self.num_early_reads = 0
        """Steps read back by the runner itself, before the next one sampled: a row of that one
        read its output tokens on the host (before_sampling)."""

    @property
    def unread_output(self) -> AsyncModelRunnerOutput | None:
        """The last launched output, if nothing has read it back (the engine always does)."""
        output = self.last_output
        return output if output is not None and not output.done else None

    def begin_step(self) -> None:
        self.step_index += 1
        self._launched = None

    def placeholder_inputs(
        self, states: Sequence[CachedRequestState], query_start_loc: list[int]
    ) -> tuple[list[int], list[int], torch.Tensor] | None:
        """Which of this step's input ids are placeholders (indices into the step's tokens), the
        rows of the previous step's sampled tokens that hold them, and that tensor; None if
        none is."""
        flat_indices: list[int] = []
        rows: list[int] = []
        previous = self.last_sampled
        for i, state in enumerate(states):
            if not state.num_placeholders:
                continue
            assert (state.num_placeholders == 1 and previous is not None
                    and previous.step_index == self.step_index - 1
                    and state.req_id in previous.rows), (
                f"{state.req_id}: a placeholder that the step just before did not sample")
            # | computed | query of this step ... placeholder |
            #            ^ query_start_loc[i]                 ^ its index in the step's tokens
            position = len(state.token_ids) - 1
            start = state.num_computed_tokens
            assert start <= position < start + query_start_loc[i + 1] - query_start_loc[i]
            flat_indices.append(query_start_loc[i] + position - start)
            rows.append(previous.rows[state.req_id])
        if not flat_indices:
            return None
        return flat_indices, rows, previous.token_ids

    def fill_placeholders(self, input_ids: torch.Tensor,
                          placeholders: tuple[list[int], list[int], torch.Tensor]) -> None:
        """Write the previous step's sampled tokens into `input_ids` (on the device, after the
        copy of the other ids: the same stream orders them) at the placeholders."""
        flat_indices, rows, sampled = placeholders
        input_ids.index_copy_(0, _index_tensor(flat_indices, self.device),
                              sampled.index_select(0, _index_tensor(rows, self.device)))

    def before_sampling(self, states: Sequence[CachedRequestState]) -> None:
        """If a row to sample reads output tokens' values on the host (penalties, bad words)
        while a row's last token is a placeholder, read the previous step back first: correct,
        only not overlapped. Any row's: once one row has penalties, the sampler counts every
        row's tokens."""
        if self.unread_output is None:
            return
        if (any(s.num_placeholders for s in states)
                and any(reads_output_token_values(s.sampling_params) for s in states)):
            self.unread_output.get_output()
            self.num_early_reads += 1

    def launch(self, output: ModelRunnerOutput, states: list[CachedRequestState],
               sampler_output: SamplerOutput) -> None:
        """Start reading this step's sampled tokens back, and append a placeholder to each
        request for its token."""
        async_output = AsyncModelRunnerOutput(output, states, sampler_output)
        rows = {}
        for row, state in enumerate(states):
            rows[state.req_id] = row
            state.token_ids.append(PLACEHOLDER_TOKEN_ID)
            state.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
            state.num_placeholders += 1
        self.last_sampled = DeviceSampledTokens(self.step_index, sampler_output.sampled_token_ids,
                                                rows)
        self._launched = self.last_output = async_output

    def step_output(self, output: ModelRunnerOutput
                    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """What execute_model returns: this step's async output if it sampled, else `output`."""
        return self._launched if self._launched is not None else output


def _index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    # From pinned memory without blocking: a pageable copy would wait for the stream (the
    # previous step still running on it).
    pin_memory = device.type == "cuda"
    return torch.tensor(values, dtype=torch.int64, pin_memory=pin_memory).to(
        device, non_blocking=True)
