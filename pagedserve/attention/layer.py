"""The attention layer models use: write this step's K/V into the paged cache, then attend."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 backend: AttentionBackend, scale: float | None = None,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        """Index of this layer's cache in the forward context's kv_caches: local to the pipeline
        stage (layer - start_layer), as a stage's cache list holds only its own layers."""
        self.backend = backend
        """Chosen once for the model (create_attention_backend), shared by its layers."""
        self.scale = head_dim**-0.5 if scale is None else scale
        """Of the scores q.k (Gemma 3: query_pre_attn_scalar ** -0.5)."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        """Keys this layer sees per query, the query's own included (None: all earlier ones).
        The layer masks what lies outside its window; its KV cache group's block table may
        have let go of those blocks (core/kv_cache_groups.py)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, H, D), k/v: (T, Hkv, D) -> (T, H, D)."""
        meta = get_forward_context().for_layer(self.layer_idx)
        kv_cache = meta.kv_caches[self.layer_idx]
        self.backend.write_kv(kv_cache, k, v, meta.slot_mapping)
        return self.backend.forward(q, kv_cache, meta, self.scale, self.sliding_window)
