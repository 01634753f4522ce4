"""transformers as the reference for greedy decoding, checked by teacher forcing.

Greedy decoding is deterministic: a continuation is transformers' greedy output exactly when
every one of its tokens is transformers' argmax given the prompt and the tokens before it. One
forward pass over prompt + continuation gives all those argmaxes at once, where `generate()`
would run one step per token: the comparison is the same and costs a fraction of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReferenceSteps:
    """transformers' view of each position of a continuation, given the tokens before it."""

    greedy: list[int]
    """The argmax, end-of-sequence suppressed as min_tokens / min_new_tokens do."""
    top: list[set[int]]
    """The top-N token ids of the raw logits."""


def teacher_forced(hf_model, prompt_ids: list[int], continuation: list[int], top_n: int,
                   suppress_ids: tuple[int, ...] = ()) -> ReferenceSteps:
    """transformers' argmax and top-N at each position of `continuation` after `prompt_ids`.

    suppress_ids: tokens never chosen (the end-of-sequence ids while min_tokens holds)."""
    input_ids = torch.tensor([prompt_ids + continuation[:-1]])
    with torch.inference_mode():
        logits = hf_model(input_ids=input_ids).logits[0, len(prompt_ids) - 1:].float()
        top = [set(row.topk(top_n).indices.tolist()) for row in logits]
        if suppress_ids:
            logits[:, list(suppress_ids)] = float("-inf")
        return ReferenceSteps(logits.argmax(dim=-1).tolist(), top)


def eos_ids(hf_model) -> tuple[int, ...]:
    """The ids generate() treats as end-of-sequence for this model."""
    eos = hf_model.generation_config.eos_token_id
    return () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def first_divergence(ours: list[int], our_top: list[set[int]], reference: ReferenceSteps
                     ) -> int | None:
    """None where every token of ours is the reference's greedy choice; else the first position
    that is not, after checking that the two choices there are near-ties: each in the other's
    top-N (past it the reference's context is ours, so later positions are not judged)."""
    for pos, (token, theirs) in enumerate(zip(ours, reference.greedy)):
        if token != theirs:
            assert theirs in our_top[pos], f"reference token {theirs} not in our top-N at {pos}"
            assert token in reference.top[pos], f"our token {token} not in its top-N at {pos}"
            return pos
    return None
