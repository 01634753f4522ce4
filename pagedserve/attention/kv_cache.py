"""The paged KV cache tensors: one layout and one allocator for the target's cache and a draft's.

Per layer, for K and for V: (num_kv_heads, num_blocks, block_size, head_dim), head-major (see
paged.py for why). Zeroed, not empty: masked positions still pass through softmax @ V, and a NaN
there would poison the row (0 * NaN = NaN).
"""

from __future__ import annotations

import torch


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    return (num_kv_heads, num_blocks, block_size, head_dim)


def kv_cache_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(key_cache, value_cache) per layer."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device),
         torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
