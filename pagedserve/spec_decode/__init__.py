"""Draft-token proposers for speculative decoding, chosen once at startup by `create_proposer`.

A proposer has one method, `propose(token_ids) -> list[int]`: given a request's tokens so far
(prompt + accepted outputs), up to `num_speculative_tokens` guesses of what comes next. The target
model verifies them (sample/rejection_sampler.py), so a bad guess costs time, never correctness.
"""

from __future__ import annotations

from pagedserve.config import SpeculativeConfig
from pagedserve.spec_decode.ngram import NgramProposer


def create_proposer(config: SpeculativeConfig) -> NgramProposer:
    if config.method == "ngram":
        return NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
    raise ValueError(f"unknown speculative method {config.method!r}")
