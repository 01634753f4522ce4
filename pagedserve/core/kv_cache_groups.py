"""Which layers share a block table: the KV cache groups of a model (vLLM's hybrid allocator).

Every layer of a group has the same attention window, so one block table serves them all and the
group lets go of a block as soon as every window has passed it. A model whose layers all attend
alike is one group. A model that mixes windowed and global layers (Gemma 3: five local layers per
global one) is several: a global group keeps every block of a request, a windowed group only the
last `window` positions' blocks (the ones before are the null block in its table).

All groups draw their blocks from one pool, and a block holds `layers_per_block` layers' KV: the
groups have that many layers each (the last of a kind may have fewer), and the i-th layer of every
group keeps its KV in the same tensor (its slot). A block id names the same pages of each slot's
tensor; whichever group holds the block owns them. A request of L tokens then holds
cdiv(L, bs) blocks in a global group but about cdiv(window, bs) + 1 in a windowed one, against
cdiv(L, bs) of every layer when each layer kept every block.

Plain Python: the scheduler (core/) and the runner (worker/) build the same layout from the same
per-layer windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    sliding_window: int | None
    """Keys a query of these layers sees, its own included (None: every earlier position)."""
    layers: tuple[int, ...]
    """Model layer indices, ascending; layers[i] keeps its KV in slot i."""


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]

    @classmethod
    def for_layers(cls, layer_windows: Sequence[int | None], per_layer_group: bool = True
                   ) -> KVCacheLayout:
        """layer_windows: each layer's sliding window (None: global). per_layer_group: manage
        KV per window (False: one group that keeps every block, each layer masking its own
        window: what KV tiers and pipeline stages need)."""
        num_layers = len(layer_windows)
        if not num_layers:
            raise ValueError("a model needs at least one attention layer")
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        if not per_layer_group or len(kinds) == 1:
            window = next(iter(kinds)) if per_layer_group else None
            return cls((KVCacheGroup(window, tuple(range(num_layers))),))
        # Global layers first (group 0: the group whose blocks cover the whole prefix), then by
        # window. Groups of the smallest kind's size: a larger kind splits into several groups
        # (its last one smaller when the sizes do not divide: some of its pages then go unused).
        group_size = min(len(layers) for layers in kinds.values())
        groups = []
        for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
            layers = kinds[window]
            for start in range(0, len(layers), group_size):
                groups.append(KVCacheGroup(window, tuple(layers[start : start + group_size])))
        return cls(tuple(groups))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per group, its layers' sliding window (None: global)."""
        return tuple(group.sliding_window for group in self.groups)

    @property
    def layers_per_block(self) -> int:
        """Layers whose KV one block holds: the tensors (slots) the pool has per K and V."""
        return max(len(group.layers) for group in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(group.layers) for group in self.groups)

    def layer_groups(self) -> tuple[int, ...]:
        """Per model layer, its group's index."""
        owner = [0] * self.num_layers
        for index, group in enumerate(self.groups):
            for layer in group.layers:
                owner[layer] = index
        return tuple(owner)

    def layer_slots(self) -> tuple[int, ...]:
        """Per model layer, the slot (tensor) its KV lives in: its position in its group."""
        slot = [0] * self.num_layers
        for group in self.groups:
            for position, layer in enumerate(group.layers):
                slot[layer] = position
        return tuple(slot)


def first_needed_block(num_computed_tokens: int, sliding_window: int | None,
                       block_size: int) -> int:
    """Blocks before this one hold only positions no query from num_computed_tokens on can see
    through `sliding_window` (0: none such; a global group needs every block).

    A query at position p sees keys at positions > p - window; the earliest query still to come
    sits at num_computed_tokens."""
    if sliding_window is None:
        return 0
    return max(0, num_computed_tokens - sliding_window + 1) // block_size


def window_blocks(sliding_window: int, block_size: int) -> int:
    """Most blocks a windowed group needs behind a query for the window: the blocks the last
    `sliding_window` positions can straddle."""
    return -(-(sliding_window - 1) // block_size) + 1
