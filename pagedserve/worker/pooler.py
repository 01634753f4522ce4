"""Pooling in the model runner: a pooling request's final hidden states (after the model's final
norm) -> one vector, across however many prefill chunks its prompt takes.

Last pooling takes the last prompt token's row of the step that completes the prompt; mean pooling
adds each chunk's rows to a running fp32 sum. The vector is then truncated to `dimensions` and
L2-normalized, and leaves the runner as plain floats. Knows nothing of scheduling or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.pooling_params import PoolingParams


@dataclass
class PoolingState:
    """One pooling request's progress in the runner (dropped with the request: a preempted one
    starts over, and mean pooling never starts from a prefix-cache hit)."""

    params: PoolingParams
    hidden_sum: torch.Tensor | None = None
    """(hidden,) fp32: the sum of the rows pooled so far (mean pooling only)."""
    num_pooled_tokens: int = 0


def pool_chunk(state: PoolingState, hidden_states: torch.Tensor, first_position: int,
               completes_prompt: bool) -> list[float] | None:
    """Take one step's rows of a request: hidden_states (num_tokens, hidden) are its prompt
    positions first_position, first_position + 1, ... Returns the finished vector when this step
    completes the prompt, else None."""
    vector = None
    if state.params.pooling_type == "mean":
        # The sum must cover positions 0 .. first_position - 1 already: mean pooling never skips
        # a position (Request.needs_every_prompt_position keeps prefix-cache hits off).
        assert state.num_pooled_tokens == first_position, (
            f"mean pooling has {state.num_pooled_tokens} rows but the chunk starts at "
            f"position {first_position}")
        chunk_sum = hidden_states.float().sum(dim=0)  # (hidden,)
        state.hidden_sum = chunk_sum if state.hidden_sum is None else state.hidden_sum + chunk_sum
        state.num_pooled_tokens += hidden_states.shape[0]
        if completes_prompt:
            vector = state.hidden_sum / state.num_pooled_tokens
    elif completes_prompt:
        vector = hidden_states[-1].float()
    return None if vector is None else finish_vector(vector, state.params)


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> list[float]:
    """(hidden,) -> the first `dimensions` values, L2-normalized (as params ask), as floats.
    Truncation comes first, so the kept prefix has norm 1 (Matryoshka-style)."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.tolist()
