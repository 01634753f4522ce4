"""The two forms of the LoRA delta (lora/layers.py) against a plain per-token reference: the
segment form (per adapter: gather, shrink, expand, scatter) and the masked form (all slots in one
shrink and one expand, foreign columns zeroed)."""

from __future__ import annotations

import torch

from pagedserve.lora.layers import LayerLoRASlots, LoRAStep


def test_masked_and_segment_forms_equal_the_per_token_reference():
    generator = torch.Generator().manual_seed(0)
    num_slots, width, in_features, out_features, num_tokens = 3, 8, 24, 40, 11
    layer = torch.nn.Linear(1, 1)  # only its identity keys the slots
    slots = LayerLoRASlots(
        a=torch.randn(num_slots * width, in_features, generator=generator, dtype=torch.float64),
        b=torch.randn(num_slots * width, out_features, generator=generator, dtype=torch.float64),
        width=width, active=[True] * num_slots)
    x = torch.randn(num_tokens, in_features, generator=generator, dtype=torch.float64)
    y = torch.randn(num_tokens, out_features, generator=generator, dtype=torch.float64)
    token_slots = [0, 2, -1, 2, 0, 0, -1, 1, 2, -1, 1]  # -1: the base model
    expected = y.clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            columns = slice(slot * width, (slot + 1) * width)
            expected[t] += slots.b[columns].t() @ (slots.a[columns] @ x[t])
    groups = [(slot, torch.tensor([t for t, s in enumerate(token_slots) if s == slot]))
              for slot in range(num_slots)]
    segments = LoRAStep(groups, {layer: slots}, num_slots=num_slots)
    masked = LoRAStep(groups, {layer: slots}, num_slots=num_slots,
                      token_slots=torch.tensor(token_slots))
    torch.testing.assert_close(segments.add_delta(layer, x, y.clone()), expected)
    torch.testing.assert_close(masked.add_delta(layer, x, y.clone()), expected)
    # a layer without slots is left alone
    other = torch.nn.Linear(1, 1)
    assert torch.equal(masked.add_delta(other, x, y.clone()), y)
