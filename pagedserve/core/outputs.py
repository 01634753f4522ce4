"""The typed messages between the scheduler, the model runner and the engine.

scheduler --SchedulerOutput--> model runner --ModelRunnerOutput--> scheduler --EngineCoreOutput--> engine
Plain Python data only: these cross process boundaries later (msgpack-able, never pickled).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedserve.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Everything the runner needs about a request it has not seen (or has forgotten after a
    preemption): sent once."""

    req_id: str
    token_ids: list[int]
    """Prompt plus any output tokens generated before a preemption."""
    num_prompt_tokens: int
    sampling_params: SamplingParams | None
    """None for a pooling request."""
    block_ids: tuple[list[int], ...]
    """Its block table per KV cache group (core/kv_cache_groups.py)."""
    num_computed_tokens: int
    """Tokens with KV already in the cache (prefix-cache hits) before this step's tokens."""
    lora_int_id: int | None = None
    """The LoRA adapter the request runs with (None: the base model)."""
    pooling_params: PoolingParams | None = None
    """Set for a pooling request: pool its prompt's hidden states, sample nothing."""


@dataclass
class CachedRequestData:
    """What changed for requests the runner already holds: parallel lists, one entry each."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    """Per request, the blocks appended to each KV cache group's table. (A windowed group puts
    the null block where its window lets go of a block; the runner's table keeps the old id,
    which its layers never read again.)"""
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    """Output tokens this step computes (sampled since the request was last scheduled). The rank
    that sampled them already has them; every other pipeline stage appends them here."""


@dataclass
class GrammarOutput:
    """What the model runner needs to mask one step's logits: plain numpy, no matcher.

    A constrained request that samples this step owns 1 + len(its drafts) consecutive rows of
    `bitmask`, starting at `first_row[req_id]`, in the order of its logits rows.
    """

    first_row: dict[str, int]
    bitmask: np.ndarray
    """(rows, ceil(model vocab / 32)) int32; bit i of word w allows token 32 * w + i."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """req_id -> tokens to compute this step, in batch order."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    """Requests finished or preempted since the last step: the runner drops their state."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> the draft tokens to verify this step (only requests that have some). They are
    the last len(drafts) of the request's scheduled tokens: the query is [last token, *drafts]."""
    grammar: GrammarOutput | None = None
    """Bitmask rows of the constrained requests that sample this step; the engine's structured
    output manager fills it after scheduling (None: no constrained request samples)."""
    kv_connector_metadata: KVConnectorMetadata | None = None
    """This step's KV tier loads and saves (None: none, or no connector)."""
    step_index: int = -1
    """The scheduler's step number (-1: a step outside the schedule, e.g. an empty one)."""
    num_prefill_requests: int = 0
    num_prefill_tokens: int = 0
    """Of the scheduled requests and tokens, those that compute known tokens (prompt chunks,
    recomputation after a preemption); the rest decode."""

    @classmethod
    def empty(cls, finished_req_ids: set[str]) -> SchedulerOutput:
        """A step that computes nothing and only tells the runner which requests are gone."""
        return cls([], CachedRequestData(), {}, 0, finished_req_ids)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class TokenLogprobs:
    """Top logprobs at one position: the chosen token first, then the top-k by rank."""

    token_ids: list[int]
    logprobs: list[float]
    chosen_rank: int
    """Rank of the chosen token in the model's distribution (1 = most likely)."""


PromptLogprobsChunk = tuple[int, list[TokenLogprobs]]
"""(position of the first prompt token covered, its logprobs and those after it). Position 0 has
no logprob; a request recomputed after preemption may resend positions already sent."""


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Only requests whose prompt is fully computed sample; mid-prefill chunks are absent. A
    request that verified drafts gets its accepted drafts plus one corrected or bonus token."""
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    """Logprobs of the prompt tokens computed this step."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> draft tokens proposed for the next step (the scheduler caps them)."""
    kv_connector_output: KVConnectorOutput | None = None
    """KV tier loads finished since the last step, and transfer counters."""
    timings: RunnerTimings | None = None
    """Where the runner's time went (the last pipeline stage's; None: not measured)."""
    cuda_graph_size: int | None = None
    """The captured CUDA graph size this step replayed (its tokens padded up to it)."""
    eager_reason: str | None = None
    """Why a step ran eagerly although CUDA graphs are captured ("tokens": more than the
    largest graph, "lora", "kv_transfer"); both None: no graphs here."""
    pooled_outputs: dict[str, list[float]] = field(default_factory=dict)
    """req_id -> the pooled, truncated, normalized vector of each pooling request whose prompt
    was completed this step (plain floats: no tensor leaves the runner)."""


@dataclass
class RunnerTimings:
    """Seconds of one step in the model runner, by wall clock. On the CPU every op finishes
    before the next starts, so the split is exact; on CUDA kernels run ahead of the host and
    the forward's time partly shows under sampling (which waits for the results)."""

    prepare_s: float = 0.0
    """Inputs: request states, ids and positions, attention metadata."""
    forward_s: float = 0.0
    logits_s: float = 0.0
    """The output head (the sampling rows' logits)."""
    sample_s: float = 0.0
    """Sampling, draft verification, drafting, prompt logprobs."""


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: PromptLogprobsChunk | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_tier_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    pooled_output: list[float] | None = None
    """A pooling request's vector (it finishes with it)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
