"""The draft model's own paged KV cache: its tensors, its block pool, and per request the tokens
whose KV it holds.

Separate from the target's cache because the draft has other layers (and often another KV
shape), and because its KV runs ahead of the target's: it holds KV for its own guesses, which the
target may reject. Blocks are private to a request (no prefix sharing), so freeing is plain.
The pool is torch-free core code; only the cache tensors live here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.attention.kv_cache import KVCacheSpec
from pagedserve.core.block_pool import BlockPool, KVCacheBlock
from pagedserve.core.kv_cache_manager import cdiv


@dataclass
class DraftRequestState:
    blocks: list[KVCacheBlock] = field(default_factory=list)
    kv_token_ids: list[int] = field(default_factory=list)
    """kv_token_ids[p]: the token whose KV sits at position p of the draft cache. Compared with
    the target's tokens each step: a mismatch (a rejected guess) marks where the KV goes stale."""

    @property
    def block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]


class DraftKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks, enable_caching=False)
        # Always in the compute dtype, whatever --kv-cache-dtype (the attention backends read
        # either kind, so a self-draft shares the target's layers). NOTE: the pool has the
        # target's block count, outside the KV memory budget; a quantized target has ~2x the
        # blocks, so this pool then takes ~2x the bytes it would beside a compute-dtype target.
        self._spec = KVCacheSpec.create("auto", dtype, num_layers, num_kv_heads, head_dim,
                                        block_size)
        self._num_blocks, self._device = num_blocks, device
        self.kv_caches = self._spec.allocate(num_blocks, device)
        self.requests: dict[str, DraftRequestState] = {}

    def release_tensors(self) -> None:
        """Sleep mode: drop the cache tensors (no request may hold blocks); reallocate_tensors()
        makes new, zeroed ones of the same shape."""
        assert not self.requests, "the draft KV is released while requests hold blocks"
        self.kv_caches = []

    def reallocate_tensors(self) -> None:
        self.kv_caches = self._spec.allocate(self._num_blocks, self._device)

    def get_or_create(self, req_id: str) -> DraftRequestState:
        state = self.requests.get(req_id)
        if state is None:
            state = self.requests[req_id] = DraftRequestState()
        return state

    def reserve(self, req_id: str, num_positions: int) -> bool:
        """Make positions [0, num_positions) of the request's cache writable; False (nothing
        allocated) when the pool is short."""
        state = self.get_or_create(req_id)
        num_new = cdiv(num_positions, self.block_size) - len(state.blocks)
        if num_new <= 0:
            return True
        if num_new > self.block_pool.num_free_blocks:
            return False
        state.blocks.extend(self.block_pool.get_new_blocks(num_new))
        return True

    def free(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_pool.free_blocks(reversed(state.blocks))

    @property
    def num_held_blocks(self) -> int:
        return self.block_pool.num_usable_blocks - self.block_pool.num_free_blocks

    def check_integrity(self) -> None:
        """Raise if the pool and the requests' block lists disagree."""
        self.block_pool.check_integrity()
        held = [block.block_id for state in self.requests.values() for block in state.blocks]
        if len(held) != len(set(held)) or len(held) != self.num_held_blocks:
            raise RuntimeError(
                f"draft KV: requests hold {len(held)} block ids ({len(set(held))} distinct), "
                f"the pool counts {self.num_held_blocks} held"
            )
        for req_id, state in self.requests.items():
            if len(state.kv_token_ids) > len(state.blocks) * self.block_size:
                raise RuntimeError(f"draft KV of {req_id} has tokens past its blocks")
