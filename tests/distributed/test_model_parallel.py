"""Tensor and pipeline parallelism in the model: ranks in separate processes (gloo) must produce
the one-process model's logits.

Each case saves the tiny random model's full weights once; every rank loads its own slice from
them, runs a fresh two-request prefill and one decode step that reads the cache it wrote (KV
caches of its own KV heads and layers), with hidden states passed stage to stage; every TP rank
of the last stage writes its full-vocabulary logits. fp32 throughout: allclose tightly, and the
same argmax.
"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.torch import save_file

from pagedserve.models.llama import layer_range
from tests.distributed.harness import run_ranks
from tests.distributed.tiny_llama import (
    build_model,
    random_state_dict,
    run_steps,
    sharded_weight_bytes,
    tiny_config,
)


def test_layer_range_is_contiguous_and_even():
    assert [layer_range(3, r, 2) for r in range(2)] == [(0, 2), (2, 3)]
    assert [layer_range(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert layer_range(5, 0, 1) == (0, 5)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        layer_range(2, 0, 3)


@pytest.mark.parametrize("architecture,tp,pp", [
    ("llama", 2, 1), ("llama", 4, 1), ("llama", 1, 2), ("qwen2", 2, 2), ("phi3", 2, 1), ("qwen2_moe", 2, 1),
], ids=lambda v: str(v))
def test_ranks_match_one_process(tmp_path, architecture, tp, pp):
    config = tiny_config(architecture)
    weights = random_state_dict(config)
    weights_path = tmp_path / "model.safetensors"
    save_file(weights, str(weights_path))
    reference = build_model(config, weights)
    expected = run_steps(reference)

    reports = run_ranks(tp * pp, {"architecture": architecture, "tp": tp, "pp": pp,
                                  "weights_path": str(weights_path)}, tmp_path)

    for rank, report in enumerate(reports):
        stage = rank // tp
        assert (report["start_layer"], report["end_layer"]) == layer_range(
            config.num_hidden_layers, stage, pp)
        logits_path = tmp_path / f"logits_rank{rank}.npy"
        assert logits_path.exists() == (stage == pp - 1)
        if stage == pp - 1:  # every TP rank of the last stage has the full vocabulary
            logits = np.load(logits_path, allow_pickle=False)
            assert logits.shape == expected.shape == (14, config.vocab_size)
            np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
            assert (logits.argmax(-1) == expected.argmax(-1)).all()
        if pp == 1:  # each TP rank holds ~1/tp of the split weights (replicated row biases,
            # one padding row of the vocabulary)
            per_rank = sharded_weight_bytes(reference) / tp
            assert abs(report["sharded_weight_bytes"] - per_rank) < 0.01 * per_rank
