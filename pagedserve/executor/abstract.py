"""The engine's only door to the data plane: an Executor runs each step on one or more workers.

    engine --SchedulerOutput--> executor --> worker(s) --ModelRunnerOutput--> engine

Two implementations: `UniProcExecutor` (one worker in the engine's process, today's behaviour)
and `MultiprocExecutor` (one process per rank, torch.distributed between them). `submit` returns
a future so a pipeline of stages can hold several micro-batches at once.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from concurrent.futures import Future

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import ModelRunnerOutput, SchedulerOutput


def merge_expert_load(rank_loads: Iterable[dict[int, list[int]]]) -> dict[int, list[int]]:
    """The ranks' Worker.expert_load() as one: pipeline stages hold different layers; the TP
    ranks of a stage route the same tokens alike (the router is whole on each), so their counts
    are equal and counted once."""
    merged: dict[int, list[int]] = {}
    for load in rank_loads:
        merged.update(load)
    return dict(sorted(merged.items()))


class ExecutorError(RuntimeError):
    """A worker died or failed a step: the data plane is gone and the engine must stop."""


class Executor(abc.ABC):
    max_concurrent_batches: int = 1
    """Steps that may be in flight at once (the pipeline's stages)."""

    @staticmethod
    def create(config: EngineConfig, model=None) -> Executor:
        """model: an already loaded model to share (one process only)."""
        if config.parallel.world_size == 1:
            from pagedserve.executor.uniproc import UniProcExecutor

            return UniProcExecutor(config, model)
        if model is not None:
            raise ValueError("a shared, already loaded model needs world size 1")
        from pagedserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)

    @abc.abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """KV blocks every rank can hold (the smallest over the ranks)."""

    @abc.abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abc.abstractmethod
    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start one step; the future fails with ExecutorError if a worker fails."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(scheduler_output).result()

    def time_prefill(self, num_tokens: int, context_len: int) -> float:
        """Seconds one prefill of `num_tokens` after `context_len` cached tokens takes, timed on
        the workers before any request runs (the KV tiers' cost model)."""
        raise NotImplementedError(f"{type(self).__name__} cannot time a prefill")

    def calibrate_outlier_channels(self, token_ids: list[int]) -> int:
        """Every rank chooses its int8 layers' outlier channels from one pass over `token_ids`
        (layers/outliers.py), before any request runs; the number of layers set on the first."""
        raise NotImplementedError(f"{type(self).__name__} cannot calibrate")

    # ---- sleep mode and weight reload: every rank, only while no request runs -------------

    def sleep(self, level: int) -> None:
        """Free the KV cache (level 1) or the KV cache and the weights (level 2) on every rank."""
        raise NotImplementedError(f"{type(self).__name__} cannot sleep")

    def wake_up(self) -> None:
        """Bring back what sleep freed (weights reloaded from their file after level 2)."""
        raise NotImplementedError(f"{type(self).__name__} cannot wake up")

    def update_weights(self, model_path: str) -> None:
        """Every rank loads its shard of `model_path` (same architecture and shape) and runs it
        from now on."""
        raise NotImplementedError(f"{type(self).__name__} cannot update weights")

    @abc.abstractmethod
    def add_lora(self, lora_int_id: int, lora_path: str) -> None:
        """Load a LoRA adapter into every worker's host memory. The uni-process executor may do
        it on the calling thread while a step runs; raises ValueError for a bad adapter."""

    @abc.abstractmethod
    def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter no request uses from every worker."""

    # ---- the profiler: every rank, on the thread that runs its steps ------------------------

    def start_profile(self) -> None:
        """Start torch.profiler on every rank; ValueError (no rank left profiling) if a rank
        cannot."""
        raise NotImplementedError(f"{type(self).__name__} cannot profile")

    def stop_profile(self) -> list[str]:
        """Stop it and write each rank's Chrome trace; their paths, by rank."""
        raise NotImplementedError(f"{type(self).__name__} cannot profile")

    @abc.abstractmethod
    def memory_report(self) -> list[dict]:
        """Each rank's Worker.memory_report(), by rank."""
        raise NotImplementedError

    def expert_load(self) -> dict[int, list[int]]:
        """MoE layer index -> the tokens routed to each of its experts so far (every stage's
        layers; see merge_expert_load); {} for a dense model."""
        return {}

    def check_idle(self) -> list[str]:
        """What the workers still hold for requests: empty when idle (tests assert it)."""

    @property
    def is_failed(self) -> bool:
        """True once a worker died or failed: nothing more can run."""
        return False

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release what they hold; safe to call twice."""
