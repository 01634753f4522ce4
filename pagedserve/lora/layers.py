"""The LoRA delta inside a linear layer: y += B (A x) for each token, with its own adapter's A, B.

Weights are never merged: one batch mixes requests of several adapters and of none. Each
adapted layer holds `max_loras` slots of stacked, zero-padded factors, W = width per slot:

    a: (slots * W, in)    slot s's rows [s * W + k * max_rank, ... + rank) are output shard k's A
    b: (slots * W, out)   B transposed: shard k's (scaling folded in) at those rows and its
                          output columns (each slot's block contiguous: a slot's matmul reads
                          it in place, where a column slice of B would be copied per call)

so a layer with several outputs in one matmul (q/k/v, gate/up) takes one shrink matmul and one
expand matmul per adapter: the zero blocks keep the shards apart. Two ways to run a step:

- segments (punica's SGMV): for each adapter in the step, gather its tokens' rows, shrink and
  expand with its slot's factors, add the result back at those rows. Tokens of no adapter cost
  nothing, and the work is the adapter's rank, not the slot count: prefill chunks go this way.
- masked: one shrink over every slot at once, the columns of the slots a token does not use
  zeroed, one expand. Four ops per layer however many adapters the step mixes: small steps
  (decodes) go this way, where a CPU pays more per op than per multiply (measured on a 2-core
  Xeon, bf16, 32 rows, q/k/v of SmolLM2: one adapter's two small matmuls take about as long as
  the layer's own matmul, so eight segments cost eight times that, the masked form about two).

The slots live in the worker's LoRA manager, not on the model, which stays shareable; a step
reaches them through the forward context (`LoRAStep`), as the KV caches do. The delta is added
before a row-parallel layer's all-reduce: every rank adds its partial B (A_r x_r), and the sum
over ranks is the whole product, because the delta is linear in x.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MASKED_MAX_TOKENS = 64
"""Steps of at most this many tokens that mix adapters run the masked form (see module doc)."""


@dataclass
class LayerLoRASlots:
    """One linear layer's adapter slots (see the module doc)."""

    a: torch.Tensor
    """(max_loras * width, in_features of this rank) in the compute dtype."""
    b: torch.Tensor
    """(max_loras * width, out_features of this rank): B transposed."""
    width: int
    """Columns per slot: the layer's output shards times max_lora_rank."""
    active: list[bool]
    """Per slot: whether its adapter targets this layer (else its factors are zero: skipped)."""


@dataclass
class LoRAStep:
    """One step's adapter mapping, built by the model runner, read by every adapted layer."""

    groups: list[tuple[int, torch.Tensor | None]]
    """Segment form: (slot, the rows of the step's tokens that use it); rows None: every token.
    Empty when the step runs the masked form (token_slots)."""
    layers: dict[torch.nn.Module, LayerLoRASlots] = field(default_factory=dict)
    """The adapted layers (by module) and their slots."""
    num_slots: int = 0
    """max_loras."""
    token_slots: torch.Tensor | None = None
    """(T,) each token's slot, -1 for none: set when the step runs the masked form."""
    stack_slots: list[LayerLoRASlots] = field(default_factory=list)
    """Every layer's qkv, o, gate_up and down slots in order, for the compiled decoder stack
    (models/decoder_stack.py), which runs the masked form in C++."""
    _masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def add_delta(self, layer: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (T, out) plus each token's adapter delta, for layer `layer` whose input is x (T, in).
        y may be updated in place (it is this layer's fresh output)."""
        slots = self.layers.get(layer)
        if slots is None:
            return y
        if self.token_slots is not None:
            shrink = F.linear(x, slots.a) * self._mask(slots.width, x.dtype)
            return y.add_(shrink @ slots.b)
        width = slots.width
        for slot, rows in self.groups:
            if not slots.active[slot]:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            columns = slice(slot * width, (slot + 1) * width)
            delta = F.linear(xs, slots.a[columns]) @ slots.b[columns]
            if rows is None:
                y.add_(delta)
            else:
                y.index_add_(0, rows, delta)
        return y

    def stack_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(A, B of every linear of every layer, the four linears' masks) for DecoderStack."""
        assert self.token_slots is not None, "the compiled stack runs the masked form"
        dtype = self.stack_slots[0].a.dtype
        factors = [t for slots in self.stack_slots for t in (slots.a, slots.b)]
        return factors, [self._mask(slots.width, dtype) for slots in self.stack_slots[:4]]

    def _mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """(T, slots * width): 1 where the column belongs to the token's slot (made once per
        step and width)."""
        key = (width, dtype)
        mask = self._masks.get(key)
        if mask is None:
            column_slots = torch.arange(self.num_slots, device=self.token_slots.device)
            column_slots = column_slots.repeat_interleave(width)
            mask = (self.token_slots[:, None] == column_slots[None, :]).to(dtype)
            self._masks[key] = mask
        return mask
