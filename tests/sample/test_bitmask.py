"""Structured output bitmasks on logits: unpacking matches llguidance's bit layout, and masked
greedy, top-k/top-p, min-p, seeded sampling and draft verification never emit a forbidden token
while leaving unmasked rows exactly as they were."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.sample.bitmask import apply_token_bitmask_, unpack_bitmask
from pagedserve.sample.rejection_sampler import RejectionSampler
from pagedserve.sample.sampler import Sampler, SamplingMetadata
from pagedserve.sampling_params import SamplingParams

VOCAB_SIZE = 100  # not a multiple of 32: the last word is partial


def pack(allowed: np.ndarray) -> torch.Tensor:
    """(R, V) bool -> (R, ceil(V / 32)) int32, bit i of word w = token 32w + i (llguidance)."""
    num_rows, vocab = allowed.shape
    words = np.zeros((num_rows, (vocab + 31) // 32), dtype=np.uint32)
    for row, token in zip(*np.nonzero(allowed)):
        words[row, token // 32] |= np.uint32(1) << np.uint32(token % 32)
    return torch.from_numpy(words.view(np.int32))


def random_allowed(num_rows: int, seed: int, vocab: int = VOCAB_SIZE) -> np.ndarray:
    rng = np.random.default_rng(seed)
    allowed = rng.random((num_rows, vocab)) < rng.uniform(0.02, 0.3, size=(num_rows, 1))
    allowed[np.arange(num_rows), rng.integers(0, vocab, num_rows)] = True  # never empty
    return allowed


def build(params_list, generators=None) -> SamplingMetadata:
    rows = len(params_list)
    return SamplingMetadata.build(params_list, [[] for _ in range(rows)], [[] for _ in range(rows)],
                                  generators or {}, (2,), VOCAB_SIZE, "cpu")


def test_unpack_matches_bit_layout():
    allowed = random_allowed(5, seed=0)
    assert torch.equal(unpack_bitmask(pack(allowed), VOCAB_SIZE), torch.from_numpy(allowed))
    # Logits wider than the mask (padded embeddings): the extra ids are never allowed.
    wide = unpack_bitmask(pack(allowed), VOCAB_SIZE + 40)
    assert not wide[:, VOCAB_SIZE:].any()
    # Bit 31 (the int32 sign bit) is a token like any other.
    only_31 = np.zeros((1, 64), dtype=bool)
    only_31[0, 31] = True
    assert unpack_bitmask(pack(only_31), 64)[0].nonzero().flatten().tolist() == [31]


PARAMS = {
    "greedy": SamplingParams(temperature=0),
    "random": SamplingParams(temperature=1.5),
    "top_p": SamplingParams(temperature=1.0, top_p=0.5),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "min_p": SamplingParams(temperature=0.8, min_p=0.2),
    "seeded": SamplingParams(temperature=1.0, seed=7),
    "penalties": SamplingParams(temperature=1.0, presence_penalty=1.5, repetition_penalty=1.3),
}


@pytest.mark.parametrize("mode", PARAMS)
def test_masked_sampling_never_picks_a_forbidden_token(mode):
    sampler = Sampler()
    for trial in range(40):
        allowed = random_allowed(4, seed=trial)
        # The unmasked argmax is forbidden more often than not: masking must do the work.
        logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(trial)) * 4
        masked = logits.clone()
        apply_token_bitmask_(masked, [0, 1, 2, 3], pack(allowed))
        params = [PARAMS[mode]] * 4
        generators = {}
        if mode == "seeded":
            generators = {row: torch.Generator().manual_seed(trial * 10 + row) for row in range(4)}
        tokens = sampler(masked, build(params, generators)).sampled_token_ids.tolist()
        for row, token in enumerate(tokens):
            assert allowed[row, token], (mode, trial, row, token)


def test_mask_leaves_other_rows_untouched():
    logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(0))
    masked = logits.clone()
    allowed = random_allowed(2, seed=1)
    apply_token_bitmask_(masked, [1, 3], pack(allowed))
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.equal(torch.isinf(masked[1]), torch.from_numpy(~allowed[0]))
    assert torch.equal(masked[3][allowed[1]], logits[3][allowed[1]])


def test_mixed_batch_seeded_and_greedy_rows_unaffected_by_constrained_neighbours():
    """Unconstrained greedy and seeded rows sample the same tokens whether or not constrained
    rows share their batch."""
    sampler = Sampler()
    free_params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)]
    logits = torch.randn(2, VOCAB_SIZE, generator=torch.Generator().manual_seed(5)) * 3
    alone = sampler(logits.clone(), build(free_params, {1: torch.Generator().manual_seed(3)}))
    constrained_logits = torch.randn(2, VOCAB_SIZE, generator=torch.Generator().manual_seed(6))
    batch = torch.cat([constrained_logits, logits])
    apply_token_bitmask_(batch, [0, 1], pack(random_allowed(2, seed=2)))
    mixed_params = [SamplingParams(temperature=0.9), SamplingParams(temperature=0)] + free_params
    mixed = sampler(batch, build(mixed_params, {3: torch.Generator().manual_seed(3)}))
    assert mixed.sampled_token_ids[2:].tolist() == alone.sampled_token_ids.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_verification_with_masks_emits_only_allowed_tokens(temperature):
    """Rejection sampling on masked logits: a forbidden draft is never accepted and the
    replacement token is allowed."""
    sampler = RejectionSampler()
    params = SamplingParams(temperature=temperature)
    for trial in range(30):
        drafts = [[int(t) for t in np.random.default_rng(trial).integers(0, VOCAB_SIZE, 3)]]
        allowed = random_allowed(4, seed=100 + trial)
        logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(trial)) * 3
        apply_token_bitmask_(logits, [0, 1, 2, 3], pack(allowed))
        emitted = sampler(logits, build([params] * 4), drafts, {})[0]
        for position, token in enumerate(emitted):
            assert allowed[position, token], (trial, position, token)
