"""Verifies draft tokens so that speculative decoding changes speed, never the distribution.

Leviathan et al. (arXiv 2211.17192): draft x ~ q is accepted with probability min(1, p(x) / q(x));
at the first rejection the token is drawn from max(p - q, 0) renormalized, and when every draft is
accepted a bonus token is drawn from p at the next position. Every emitted token is then
distributed exactly as a draw from p. p is the target distribution after the request's own
processing (sampler.compute_target_probs); a greedy row's p is a point mass, so greedy is exact.
An n-gram proposer has no q: its q is a point mass on x, so x is accepted with probability p(x)
and the residual is p with x removed. `rejection_sample_reference` is the slow one-row twin.
"""

from __future__ import annotations

import random
from types import ModuleType

import torch
from torch import nn

from pagedserve.sample.sampler import (
    SamplingMetadata,
    apply_logits_processors,
    argmax_rows,
    compute_target_probs,
    random_sample,
)


class RejectionSampler(nn.Module):
    """Stateless: logits of every draft position and each request's bonus position in, the
    tokens each request emits out."""

    def __init__(self, kernels: ModuleType | None = None) -> None:
        """kernels: as Sampler's (the greedy targets' argmax)."""
        super().__init__()
        self.kernels = kernels

    def forward(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        draft_probs: torch.Tensor | None = None,
    ) -> list[list[int]]:
        """logits (N, V), metadata with N rows: see `rejection_sample` for the row layout. Each
        row's metadata must see the drafts before it as output tokens (penalties, min_tokens)."""
        if metadata.all_greedy:
            # The same result as rejection_sample on point-mass targets, without random draws.
            target_ids = argmax_rows(apply_logits_processors(logits.float(), metadata),
                                     self.kernels)
            return greedy_verify(target_ids.tolist(), draft_token_ids)
        target_probs = compute_target_probs(logits, metadata)
        return rejection_sample(target_probs, draft_token_ids, generators, draft_probs)


def greedy_verify(target_ids: list[int], draft_token_ids: list[list[int]]) -> list[list[int]]:
    """Greedy targets (one argmax per row, same row layout as `rejection_sample`): accept drafts
    while they equal the argmax, then emit the argmax at the first mismatch (or the bonus)."""
    outputs, start = [], 0
    for drafts in draft_token_ids:
        num_accepted = 0
        while (num_accepted < len(drafts)
               and drafts[num_accepted] == target_ids[start + num_accepted]):
            num_accepted += 1
        outputs.append(drafts[:num_accepted] + [target_ids[start + num_accepted]])
        start += len(drafts) + 1
    assert start == len(target_ids), f"{len(target_ids)} rows for {start} positions"
    return outputs


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: list[list[int]],
    generators: dict[int, torch.Generator],
    draft_probs: torch.Tensor | None = None,
) -> list[list[int]]:
    """Per request: its accepted drafts, then one recovered (at the first rejection) or bonus token.

    target_probs: (N, V), N = sum(k_i + 1). Request i owns k_i + 1 consecutive rows: p at each of
        its k_i draft positions, then p at the position after the last draft (the bonus).
    draft_token_ids: request i's k_i drafts (k_i may be 0: then it just samples from p).
    generators: request index -> its generator (seeded requests); every random draw of such a
        request comes from it, in a fixed order, so its output does not depend on the batch.
    draft_probs: (sum k_i, V), q at each draft position; None for point-mass drafts (n-gram).
    ```
    rows:  | req 0: d0 d1 d2 bonus | req 1: bonus | req 2: d0 bonus |
    ```
    """
    device = target_probs.device
    num_rows = target_probs.shape[0]
    row_starts, draft_rows, flat_draft_ids = [], [], []
    row = 0
    for drafts in draft_token_ids:
        row_starts.append(row)
        draft_rows.extend(range(row, row + len(drafts)))
        flat_draft_ids.extend(drafts)
        row += len(drafts) + 1
    assert row == num_rows, f"{num_rows} rows of target probs for {row} positions"
    num_drafts = len(flat_draft_ids)

    # What each row samples from if it is reached: residual at draft rows, p at bonus rows.
    sample_probs = target_probs
    accepted_list: list[bool] = []
    if num_drafts:
        draft_rows_t = torch.tensor(draft_rows, dtype=torch.int64, device=device)
        draft_ids_t = torch.tensor(flat_draft_ids, dtype=torch.int64, device=device)[:, None]
        p_draft = target_probs[draft_rows_t]                          # (D, V)
        p_x = p_draft.gather(1, draft_ids_t).squeeze(1)                # (D,)
        if draft_probs is None:
            q_x = torch.ones_like(p_x)
            residual = p_draft.scatter(1, draft_ids_t, 0.0)             # p with x removed
        else:
            q_x = draft_probs.gather(1, draft_ids_t).squeeze(1)
            residual = (p_draft - draft_probs).clamp_min(0.0)           # (D, V)
        # An all-zero residual means p <= q everywhere, i.e. p == q: the draft is then always
        # accepted and the row is never sampled; p keeps float rounding from yielding garbage.
        is_empty = (residual.sum(dim=1) <= 0).unsqueeze(1)
        residual = torch.where(is_empty, p_draft, residual)
        sample_probs = target_probs.clone()
        sample_probs[draft_rows_t] = residual

        uniform = torch.empty(num_drafts, device=device)
        if any(drafts and i not in generators for i, drafts in enumerate(draft_token_ids)):
            uniform.uniform_()  # unseeded requests share one draw
        draft_offset = 0
        for req_index, drafts in enumerate(draft_token_ids):
            if req_index in generators and drafts:
                span = slice(draft_offset, draft_offset + len(drafts))
                uniform[span] = torch.rand(
                    len(drafts), device=device, generator=generators[req_index]
                )
            draft_offset += len(drafts)
        # Accept x with probability min(1, p(x) / q(x)); q(x) > 0 as x was drawn from q.
        accepted_list = (uniform * q_x < p_x).tolist()

    row_generators = {}
    for req_index, generator in generators.items():
        start = row_starts[req_index]
        for row in range(start, start + len(draft_token_ids[req_index]) + 1):
            row_generators[row] = generator
    # Writes to sample_probs: a clone whenever there were drafts, else the caller's probs.
    if not num_drafts:
        sample_probs = sample_probs.clone()
    sampled = random_sample(sample_probs, row_generators).tolist()  # (N,), the device sync

    outputs = []
    draft_offset = 0
    for start, drafts in zip(row_starts, draft_token_ids):
        num_accepted = 0
        while num_accepted < len(drafts) and accepted_list[draft_offset + num_accepted]:
            num_accepted += 1
        outputs.append(drafts[:num_accepted] + [sampled[start + num_accepted]])
        draft_offset += len(drafts)
    return outputs


def rejection_sample_reference(
    target_probs: list[list[float]],
    draft_token_ids: list[int],
    draft_probs: list[list[float]] | None,
    rng: random.Random,
) -> list[int]:
    """One request, plain Python: target_probs has k + 1 rows for k drafts (see above)."""
    for position, token_id in enumerate(draft_token_ids):
        p = target_probs[position]
        q = draft_probs[position] if draft_probs is not None else None
        q_x = q[token_id] if q is not None else 1.0
        if rng.random() < p[token_id] / q_x:
            continue
        if q is None:
            residual = [0.0 if i == token_id else p_i for i, p_i in enumerate(p)]
        else:
            residual = [max(p_i - q_i, 0.0) for p_i, q_i in zip(p, q)]
        if sum(residual) <= 0:
            residual = p
        return draft_token_ids[:position] + [_categorical(residual, rng)]
    return list(draft_token_ids) + [_categorical(target_probs[len(draft_token_ids)], rng)]


def _categorical(weights: list[float], rng: random.Random) -> int:
    """Inverse-CDF draw from unnormalized weights."""
    threshold = rng.random() * sum(weights)
    cumulative = 0.0
    for token_id, weight in enumerate(weights):
        cumulative += weight
        if threshold < cumulative and weight > 0:
            return token_id
    return max(range(len(weights)), key=lambda i: weights[i])
