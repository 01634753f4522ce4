"""Applies structured output token bitmasks to logits: forbidden tokens get -inf.

The bitmask is llguidance's layout (int32 words, bit i of word w allows token 32 * w + i). It is
applied before anything else the sampler does, so greedy, top-p/top-k, min-p, seeded sampling
and the rejection sampler all draw only allowed tokens.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 -> (R, vocab_size) bool, True where the token is allowed. Tokens past
    32 * W are not allowed."""
    num_rows, num_words = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1                  # (R, W, 32)
    allowed = bits.view(num_rows, num_words * 32).bool()          # (R, 32W)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    padding = torch.zeros(num_rows, vocab_size - allowed.shape[1], dtype=torch.bool,
                          device=bitmask.device)
    return torch.cat([allowed, padding], dim=1)


def apply_token_bitmask_(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Mask logits[rows[i]] with bitmask[i], in place; the other rows are untouched."""
    if not rows:
        return
    assert len(rows) == bitmask.shape[0], f"{len(rows)} rows but {bitmask.shape[0]} masks"
    # From pinned memory without blocking on a GPU: a pageable copy waits for the stream.
    pin_memory = logits.device.type == "cuda"
    index = torch.tensor(rows, dtype=torch.int64, pin_memory=pin_memory).to(
        logits.device, non_blocking=True)
    if pin_memory and bitmask.device.type == "cpu":
        bitmask = bitmask.pin_memory()
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    logits[index] = logits[index].masked_fill(~allowed, _NEG_INF)
