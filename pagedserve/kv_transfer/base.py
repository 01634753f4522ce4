"""The KV connector interface: KV that lives beyond the device pool, in two halves as in vLLM.

    scheduler half (engine process, torch-free)         worker half (each rank, owns tensors)
    get_num_new_matched_tokens  -- how much a tier has  start_load_kv   -- load blocks (async)
    update_state_after_alloc    -- blocks to load into  wait_for_save   -- copy out this step's
    build_connector_meta -> SchedulerOutput field  ---> get_finished    -- loads done, stats
    update_connector_output  <--- ModelRunnerOutput field (KVConnectorOutput)
    request_finished            -- may its blocks be freed now

A load never runs in the same step as the request's compute: the request waits, off the queues,
with its blocks reserved, until the worker reports how many leading blocks it loaded and verified;
only then are those blocks indexed for the prefix cache and the request scheduled from there. So
a corrupt, foreign or missing block shortens the hit and is recomputed, and is never read.
Saves copy each block's KV out after the step that completed it, so a finished or preempted
request's blocks can always be freed at once.

The messages here are plain data: they cross to worker processes like the rest of
SchedulerOutput / ModelRunnerOutput.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.request import Request


@dataclass
class BlockTransfer:
    """One block to load or save: where it is in the pool and what it must contain."""

    block_id: int
    key: str
    """The block's name in every tier (model, KV layout, chained block hash)."""
    block_hash: bytes
    token_ids: list[int]
    """The block's tokens: a loaded block must carry the same (verified before use)."""


@dataclass
class LoadJob:
    req_id: str
    blocks: list[BlockTransfer]
    """Consecutive blocks of the request, in order: a failure at block i makes i.. recompute."""
    tiers: list[int]
    """Per block, the index of the first tier that had it at lookup time."""


@dataclass
class KVConnectorMetadata:
    """This step's transfers, built by the scheduler half (SchedulerOutput.kv_connector_metadata)."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    """Blocks whose KV is complete once this step has run; copied out after it."""


@dataclass
class TierCounters:
    """What one tier did, counted since the last report (worker) or since start (scheduler)."""

    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    blocks_saved: int = 0
    bytes_saved: int = 0
    save_seconds: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)
    """kind -> count: io_error (the store failed), missing (gone since lookup), corrupt (bad
    checksum or truncated), foreign (another block's or another layout's KV)."""

    def add(self, other: TierCounters) -> None:
        self.blocks_loaded += other.blocks_loaded
        self.bytes_loaded += other.bytes_loaded
        self.load_seconds += other.load_seconds
        self.blocks_saved += other.blocks_saved
        self.bytes_saved += other.bytes_saved
        self.save_seconds += other.save_seconds
        for kind, count in other.faults.items():
            self.faults[kind] = self.faults.get(kind, 0) + count

    def fault(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1


@dataclass
class KVConnectorOutput:
    """The worker half's report with a step's results (ModelRunnerOutput.kv_connector_output)."""

    finished_loads: dict[str, int] = field(default_factory=dict)
    """req_id -> leading blocks of its load job that were loaded and verified."""
    tiers: dict[str, TierCounters] = field(default_factory=dict)
    """tier name -> counters since the last report."""
    num_saves_dropped: int = 0
    """Saves skipped because the writer fell behind (bounded queue)."""

    @property
    def is_empty(self) -> bool:
        return not self.finished_loads and not self.tiers and not self.num_saves_dropped


@dataclass
class KVTierStats:
    """Counters since start, for /metrics and the benchmarks."""

    lookup_tokens: int = 0
    """Tokens past the device pool's hit that were looked up in the tiers."""
    hit_tokens: dict[str, int] = field(default_factory=dict)
    """tier -> tokens found there (first tier in search order that had them)."""
    decisions: dict[str, int] = field(default_factory=lambda: {"load": 0, "recompute": 0})
    """Hits the cost model loaded, and hits it left to recompute."""
    loaded_tokens: int = 0
    """Tokens loaded and verified (what requests really got from the tiers)."""
    load_failed_tokens: int = 0
    """Tokens of load jobs that failed (fault, corrupt, missing): recomputed instead."""
    load_fallbacks: int = 0
    """Load jobs that ended short (a transfer failed or timed out): their rest was recomputed."""
    num_saves_dropped: int = 0
    tiers: dict[str, TierCounters] = field(default_factory=dict)


class KVConnectorScheduler(ABC):
    """The scheduler's half: decides what to load and save; never touches tensors."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past the `num_computed_tokens` the device pool has that the connector will
        load for this request (a multiple of the block size, but for a P/D decode: all of the
        prompt but its last token; 0: compute them)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The scheduler reserved `block_ids` (the request's whole block table) for a load of
        `num_external_tokens` after its computed tokens; queue the load."""

    @abstractmethod
    def build_connector_meta(self, requests: dict[str, Request],
                             block_ids: Callable[[str], list[int]],
                             num_scheduled_tokens: dict[str, int]) -> KVConnectorMetadata | None:
        """This step's loads and saves (None: nothing to do). Called once per schedule(), after
        the scheduled requests' computed-token counts have advanced past this step."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Take in the worker's report (counters, finished loads are the scheduler's to act on)."""

    @abstractmethod
    def get_stats(self) -> KVTierStats:
        """Counters since start (a copy)."""

    @abstractmethod
    def record_load_result(self, num_loaded_tokens: int, num_failed_tokens: int) -> None:
        """A load job ended with these tokens in place and these left to recompute."""

    def load_sources(self, request_id: str, num_tokens: int) -> dict[str, int]:
        """Where the first `num_tokens` tokens of the request's finished load came from: source
        name -> tokens (the scheduler's PrefixHit events name them). Called once per load."""
        return {"kv_tier": num_tokens}

    def request_finished(self, request: Request) -> bool:
        """The request finished or was preempted. True: its blocks are still being read and must
        not be freed yet (the tier connectors copy at step end, so never)."""
        return False

    def shutdown(self) -> None:
        """Release stores and threads."""


class KVConnectorWorker(ABC):
    """A rank's half: moves blocks between its KV tensors and the tiers."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[tuple]) -> None:
        """The rank's cache: per layer a tuple of tensors, each with the block index on dim 1."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start this step's loads; they finish in the background (see get_finished)."""

    @abstractmethod
    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        """After the step's forward pass: take this step's blocks to save (copied out before
        returning, so the blocks may be freed or overwritten after)."""

    @abstractmethod
    def get_finished(self, wait: bool) -> KVConnectorOutput:
        """Loads finished since the last call, and counters. wait: nothing else runs this step,
        so block briefly for a load to finish rather than let the engine spin."""

    def shutdown(self) -> None:
        """Finish or drop pending saves and release stores and threads."""
