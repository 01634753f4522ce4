"""The attention layer models use: write this step's K/V into the paged cache, then attend."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata, get_forward_context
from pagedserve.attention.paged import paged_attention, write_kv

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        """Index of this layer's cache in the forward context's kv_caches."""
        self.attn_fn: AttentionFn = paged_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, H, D), k/v: (T, Hkv, D) -> (T, H, D)."""
        meta = get_forward_context()
        key_cache, value_cache = meta.kv_caches[self.layer_idx]
        write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        return self.attn_fn(q, key_cache, value_cache, meta)
