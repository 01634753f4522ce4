"""Per-step attention metadata, reaching the layers through one scoped forward context.

The batch is flat: T tokens from B requests, decodes (one query token each) first, then prefill
chunks. For request i, its query tokens are [query_start_loc[i], query_start_loc[i+1]) of the
batch, at positions [context_lens[i], seq_lens[i]) of its sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    num_decodes: int
    """Requests 0..num_decodes-1 have exactly one query token; the rest are prefill chunks."""
    query_start_loc: list[int]
    """(B+1,) on the host: offsets of each request's query tokens in the flat batch."""
    context_lens: list[int]
    """(B,) tokens already in the cache before this step."""
    seq_lens: list[int]
    """(B,) tokens in the cache after this step (context + query)."""
    slot_mapping: torch.Tensor
    """(T,) int64: cache slot (block_id * block_size + offset) each new token's KV goes to."""
    block_table: torch.Tensor
    """(B, max_blocks) int64 block ids, padded with the null block 0."""
    decode_seq_lens: torch.Tensor
    """(num_decodes,) int64 on the device, for the batched decode mask."""
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer (key_cache, value_cache), each (Hkv, num_blocks, block_size, D). Carried here,
    not bound to the layers, so one loaded model can serve several engines (tests, drafts)."""
    backend_state: dict[str, Any] = field(default_factory=dict)
    """Tensors an attention backend derives from this metadata once per step (in its first
    layer) and reuses in the others, e.g. the decode mask."""

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


_forward_context: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(attn_metadata: AttentionMetadata) -> Iterator[None]:
    global _forward_context
    if _forward_context is not None:
        raise RuntimeError("forward contexts do not nest")
    _forward_context = attn_metadata
    try:
        yield
    finally:
        _forward_context = None


def get_forward_context() -> AttentionMetadata:
    if _forward_context is None:
        raise RuntimeError("attention ran outside a forward context")
    return _forward_context
