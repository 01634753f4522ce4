"""Draft-token proposers for speculative decoding, chosen once at startup by `create_proposer`.

A proposer guesses, for each request that just sampled, up to `num_speculative_tokens` next
tokens from its tokens so far (prompt + accepted outputs). The target model verifies them
(sample/rejection_sampler.py), so a bad guess costs time, never correctness.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve.config import ModelConfig, SpeculativeConfig
from pagedserve.models.loader import load_model, load_model_config
from pagedserve.spec_decode.draft_model import DraftModelProposer
from pagedserve.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    num_speculative_tokens: int

    def propose_batch(self, contexts: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        """req_id -> tokens so far in; req_id -> its guesses out (requests with none left out)."""
        ...

    def remove_requests(self, req_ids: Sequence[str]) -> None:
        """Forget finished, aborted or preempted requests; free what they hold."""
        ...

    @property
    def num_requests(self) -> int:
        """Requests the proposer holds state (draft KV) for; 0 when idle."""
        ...

    def check_integrity(self) -> None: ...


@dataclass(frozen=True)
class TargetInfo:
    """What a draft model needs to know about the target engine it drafts for."""

    model: torch.nn.Module
    model_config: ModelConfig
    num_kv_blocks: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    keep_packed: bool
    """Load a separate draft's GGUF weights packed, as the target's are."""
    quantize_on_load: str | None = None
    """Quantize a separate draft's weights on load ("int4" / "int8"), as the target's are."""


def create_proposer(config: SpeculativeConfig, target: TargetInfo | None = None) -> Proposer:
    """target: needed by the draft-model method only.

    The draft's KV pool gets as many blocks as the target's: the draft holds KV for at most
    k - 1 more positions per request than the target, and a request the draft pool cannot hold
    just gets no drafts."""
    if config.method == "ngram":
        return NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
    if config.method == "draft_model":
        if target is None:
            raise ValueError("the draft_model method needs the target model")
        if config.is_self_draft:
            model, model_config = target.model, target.model_config
            num_layers = config.draft_num_layers
        else:
            model_config = load_model_config(config.model)
            model = load_model(config.model, model_config, target.dtype, target.device,
                               target.keep_packed, target.quantize_on_load)
            num_layers = model_config.num_hidden_layers
        return DraftModelProposer(
            model, model_config, num_layers, config.num_speculative_tokens,
            target_vocab_size=target.model_config.vocab_size,
            num_blocks=target.num_kv_blocks, block_size=target.block_size,
            dtype=target.dtype, device=target.device, uses_layer_prefix=config.is_self_draft,
        )
    raise ValueError(f"unknown speculative method {config.method!r}")
