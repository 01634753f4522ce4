"""Load or recompute: predict both from measurements and take the cheaper.

Recomputing n tokens after a context of c costs about n * (a + b * (c + n / 2)) seconds: a per
token (the matmuls) plus b per token per context token (attention). `a` and `b` come from two
timed prefills at startup (`PrefillProfile`). Loading a block from a tier costs what its loads
have cost: measured once at startup (a probe block written and read back), then a running
average of real loads, so a tier that slows down (a busy Redis, a cold disk) is noticed.

No peer engine decides this: they always load a hit. A slow tier (a remote store behind a long
link) can be slower than recomputing a short prefix on a fast device.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefillTiming:
    num_tokens: int
    context_len: int
    seconds: float


@dataclass
class PrefillProfile:
    seconds_per_token: float
    """a: cost of a token with no context."""
    seconds_per_token_per_context: float
    """b: extra cost per token per context token."""

    @classmethod
    def fit(cls, timings: list[PrefillTiming]) -> PrefillProfile:
        """From prefills of the same length at two contexts (the first at context 0)."""
        first, last = timings[0], timings[-1]
        per_token_first = first.seconds / first.num_tokens
        per_token_last = last.seconds / last.num_tokens
        slope = 0.0
        if last.context_len > first.context_len:
            slope = max(0.0, (per_token_last - per_token_first)
                        / (last.context_len - first.context_len))
        base = max(1e-9, per_token_first - slope * (first.context_len + first.num_tokens / 2))
        return cls(base, slope)

    def recompute_seconds(self, num_tokens: int, context_len: int) -> float:
        return num_tokens * (self.seconds_per_token
                             + self.seconds_per_token_per_context * (context_len + num_tokens / 2))


@dataclass
class TierCost:
    seconds_per_block: float
    """Measured wall time of one block's load (fetch, verify, copy), running average."""
    num_parallel: int = 1
    """Blocks loaded concurrently."""
    ema_weight: float = 0.2

    def load_seconds(self, num_blocks: int) -> float:
        return self.seconds_per_block * num_blocks / max(1, min(self.num_parallel, num_blocks))

    def observe(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0:
            per_block = seconds / num_blocks
            self.seconds_per_block += self.ema_weight * (per_block - self.seconds_per_block)


@dataclass
class CostModel:
    prefill: PrefillProfile
    tiers: list[TierCost] = field(default_factory=list)
    policy: str = "cost"
    """"cost": load only when predicted faster; "always": load every hit (tests, and tiers known
    to be fast); "never": look up and count, but recompute (a tier being warmed)."""

    def should_load(self, tier_of_block: list[int], context_len: int, block_size: int) -> bool:
        if self.policy != "cost":
            return self.policy == "always"
        return self.load_seconds(tier_of_block) < self.recompute_seconds(
            len(tier_of_block) * block_size, context_len)

    def load_seconds(self, tier_of_block: list[int]) -> float:
        return sum(self.tiers[tier].load_seconds(tier_of_block.count(tier))
                   for tier in set(tier_of_block))

    def recompute_seconds(self, num_tokens: int, context_len: int) -> float:
        return self.prefill.recompute_seconds(num_tokens, context_len)
