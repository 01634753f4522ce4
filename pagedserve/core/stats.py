"""What the scheduler counts, handed to the stat loggers (metrics.py, logging_stat_logger.py) and
the benchmarks.

Plain data: the scheduler fills it, the engine adds what it owns (structured output), and nothing
here knows how it is exported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.kv_transfer.base import KVTierStats
from pagedserve.structured_output.stats import StructuredOutputStats


def counter_growth(value: float, last: float) -> float:
    """How much a cumulative counter grew since it read `last`. A smaller value means the counters
    restarted from zero (a new engine behind the reader); Prometheus counts that as a reset, so all
    of it is new."""
    return value - last if value >= last else value


@dataclass
class SpecDecodingStats:
    """Counters since start. A "draft" is one request's run of draft tokens verified in a step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    """[i]: drafts that had a token at position i (0-based, after the last accepted token)."""
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    """[i]: drafts whose token at position i was accepted (so were all before it)."""

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        assert 0 <= num_accepted_tokens <= num_draft_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for counts, num in ((self.num_draft_tokens_per_pos, num_draft_tokens),
                            (self.num_accepted_tokens_per_pos, num_accepted_tokens)):
            counts.extend([0] * (num_draft_tokens - len(counts)))
            for pos in range(num):
                counts[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [accepted / drafted for accepted, drafted
                in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens gained per verifying step: the accepted drafts plus the one sampled token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
            list(self.num_draft_tokens_per_pos), list(self.num_accepted_tokens_per_pos),
        )


@dataclass
class CudaGraphCounters:
    """How steps ran where CUDA graphs are captured (worker/cuda_graph.py): counters since
    start-up."""

    replays: int = 0
    replayed_tokens: int = 0
    padded_tokens: int = 0
    """Padding rows computed by replays (the cost of a size ladder with gaps)."""
    eager_steps: dict[str, int] = field(default_factory=dict)
    """Why steps ran eagerly: "tokens" (larger than every graph), "lora", "kv_transfer"."""

    def observe_replay(self, size: int, num_tokens: int) -> None:
        self.replays += 1
        self.replayed_tokens += num_tokens
        self.padded_tokens += size - num_tokens

    def observe_eager(self, reason: str) -> None:
        self.eager_steps[reason] = self.eager_steps.get(reason, 0) + 1


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens_computed: int
    num_generation_tokens: int
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    """Counters of speculative decoding (all zero when it is off)."""
    structured_output: StructuredOutputStats = field(default_factory=StructuredOutputStats)
    """Counters of constrained decoding; the engine fills them (its manager owns them)."""
    kv_tier: KVTierStats | None = None
    """Counters of the KV tiers (None: no connector)."""
    cuda_graphs: CudaGraphCounters | None = None
    """Replayed and eager steps; the engine fills them from the runner's outputs (None: no
    step has run with CUDA graphs captured)."""
