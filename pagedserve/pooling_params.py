"""What one pooling (embedding) request asks of the model runner, beside SamplingParams.

A pooling request computes its prompt and ends: no token is sampled. The runner pools the final
hidden states (after the model's final norm) of its prompt into one vector, keeps the first
`dimensions` of it and L2-normalizes it. Pure Python, no torch: the scheduler and the server
import it; the runner does the arithmetic (worker/pooler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean")
"""last: the hidden state of the prompt's last token (vLLM's default for decoder models);
mean: the mean over every prompt token's hidden state."""


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: str = "last"
    """One of POOLING_TYPES."""
    dimensions: int | None = None
    """Keep only the first N dimensions of the pooled vector, then normalize (Matryoshka-style
    truncation). None: the model's hidden size."""
    normalize: bool = True
    """L2-normalize the (truncated) vector."""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")
        if self.dimensions is not None:
            if not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool):
                raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")
            if self.dimensions < 1:
                raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt token's hidden state is pooled: then no prefix-cache hit may
        skip computing any of them (a hit's KV is reusable, its hidden states are gone)."""
        return self.pooling_type == "mean"

    def validate_for_hidden_size(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions must be <= the model's embedding size {hidden_size}, "
                             f"got {self.dimensions}")
