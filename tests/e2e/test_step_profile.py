"""`bench throughput --profile`: the step's parts come from the event stream and module hooks
(nothing patched), cover the whole step, and leave the engine as it was."""

from __future__ import annotations

import pytest
import torch

from pagedserve.benchmarks.step_profile import (
    PART_ORDER,
    _module_part,
    format_profile,
    profile_steps,
)
from pagedserve.models.gemma3 import GemmaRMSNorm


def test_profile_parts_cover_the_step_and_patch_nothing(make_llm):
    engine = make_llm(max_num_seqs=8).engine
    scheduler_methods = dict(vars(engine.scheduler))
    profiles = profile_steps(engine, batch_size=2, prompt_len=32, num_decode_steps=3)
    assert set(profiles) == {"prefill chunk (32 tokens, 1 request)", "decode step (batch 2)"}
    for times in profiles.values():
        per_step = times.per_step_ms()
        assert set(per_step) <= set(PART_ORDER)
        for part in ("scheduling", "input prep (runner)", "QKV projection",
                     "attention (KV write + paged attn)", "MLP down projection",
                     "output head (logits)", "sampling", "output processing"):
            assert per_step[part] > 0, part
        assert sum(times.parts.values()) == pytest.approx(times.total, rel=1e-6)
    assert profiles["decode step (batch 2)"].uninstrumented_step > 0
    assert "total step" in format_profile(profiles)
    # Hooks and the subscription are gone; no method was replaced on the instances.
    model = engine.executor.worker.model_runner.model
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not engine.events.enabled
    assert vars(engine.scheduler).keys() == scheduler_methods.keys()


def test_subclassed_modules_take_their_base_class_part():
    """Gemma's norm, attention and MLP subclass Llama's: their time is their part's, not
    "other forward"."""
    norm = GemmaRMSNorm(64, 1e-6, None)
    assert _module_part("model.layers.0.pre_feedforward_layernorm", norm) == (
        "norms (+ residual add)")
    assert _module_part("model.layers.0.mlp.down_proj", torch.nn.Linear(2, 2)) == (
        "MLP down projection")
    assert _module_part("model.layers.0.mlp.act", torch.nn.ReLU()) is None
