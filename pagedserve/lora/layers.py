"""The LoRA delta inside a linear layer: y += B (A x) for each token, with its own adapter's A, B.

Weights are never merged: one batch mixes requests of several adapters and of none. Each
adapted layer holds `max_loras` slots of stacked, zero-padded factors:

    a: (slots, R, in)    rows [k * max_rank, k * max_rank + rank) are output shard k's A
    b: (slots, out, R)   B of shard k (scaling folded in) at its output rows and those columns

so a layer with several outputs in one matmul (q/k/v, gate/up) takes one shrink matmul and one
expand matmul per adapter: the zero blocks keep the shards apart. A step groups its tokens by
slot (punica's segment form, SGMV): for each adapter used, gather its tokens' rows, two small
matmuls, and add the result back at those rows. Tokens of no adapter cost nothing.

The slots live in the worker's LoRA manager, not on the model, which stays shareable; a step
reaches them through the forward context (`LoRAStep`), as the KV caches do. The delta is added
before a row-parallel layer's all-reduce: every rank adds its partial B (A_r x_r), and the sum
over ranks is the whole product, because the delta is linear in x.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerLoRASlots:
    """One linear layer's adapter slots (see the module doc)."""

    a: torch.Tensor
    """(max_loras, R, in_features of this rank) in the compute dtype."""
    b: torch.Tensor
    """(max_loras, out_features of this rank, R)."""
    active: list[bool]
    """Per slot: whether its adapter targets this layer (else its factors are zero: skipped)."""


@dataclass
class LoRAStep:
    """One step's adapter mapping, built by the model runner, read by every adapted layer."""

    groups: list[tuple[int, torch.Tensor | None]]
    """(slot, the rows of the step's tokens that use it); rows None: every token."""
    layers: dict[torch.nn.Module, LayerLoRASlots] = field(default_factory=dict)
    """The adapted layers (by module) and their slots."""

    def add_delta(self, layer: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (T, out) plus each token's adapter delta, for layer `layer` whose input is x (T, in).
        y may be updated in place (it is this layer's fresh output)."""
        slots = self.layers.get(layer)
        if slots is None:
            return y
        for slot, rows in self.groups:
            if not slots.active[slot]:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            delta = (xs @ slots.a[slot].t()) @ slots.b[slot].t()
            if rows is None:
                y.add_(delta)
            else:
                y.index_add_(0, rows, delta)
        return y
