"""One rank of the data plane: its device, CPU cores, threads and seed, its process groups, its
shard of the model, its share of the KV cache, and the runner that executes steps on them.

The executor drives workers through these calls only (init_device, load_model,
determine_num_kv_blocks, initialize_kv_cache, execute_model, check_idle, shutdown; and, while
idle, sleep, wake_up, update_weights); nothing here knows about queues, requests' text or how the
executor reaches it (same process or a socket).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed import parallel_state
from pagedserve.distributed.cpu_binding import bind_to_cpus, cpu_share, usable_cpus
from pagedserve.kernels import cpu_ops
from pagedserve.lora.worker_manager import WorkerLoRAManager
from pagedserve.models.loader import load_model
from pagedserve.observability import memory
from pagedserve.observability.startup import startup_phase
from pagedserve.worker.async_output import AsyncModelRunnerOutput
from pagedserve.worker.model_runner import DTYPES, ModelRunner
from pagedserve.worker.profiler import StepProfiler, step_range

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        """rank: global rank (pp_rank * tp_size + tp_rank); local_rank: its index on this node.
        distributed_init_method: "tcp://addr:port" of the rendezvous (world_size > 1 only).
        model: an already loaded model to share (one process only; tests build many engines)."""
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.model = model
        self.model_runner: ModelRunner | None = None
        self.device = torch.device(config.device.device)
        self.model_path = config.model_path
        """The weights' file: update_weights changes it, a level-2 wake_up reloads from it."""
        self.sleep_level = 0
        """0: awake; 1: KV cache freed; 2: KV cache and weights freed (see sleep)."""
        self.calibration_token_ids: list[int] | None = None
        """The calibration text's tokens (layers/outliers.py), kept for weights loaded later."""
        self.profiler = (StepProfiler(config.profiler, rank, self.device)
                         if config.profiler is not None else None)

    # ---- start-up ---------------------------------------------------------------------------

    def init_device(self) -> None:
        """Pin CPUs and set threads, seed the random stream, join the process groups."""
        device_config, parallel = self.config.device, self.config.parallel
        distributed = parallel.world_size > 1
        if self.device.type == "cpu":
            num_threads = device_config.num_threads
            if distributed and parallel.cpu_binding == "auto":
                cpus = cpu_share(usable_cpus(), self.local_rank, parallel.local_world_size)
                bind_to_cpus(cpus)
                logger.info("rank %d pinned to CPUs %s", self.rank, cpus)
            torch.set_num_threads(num_threads or len(usable_cpus()))
            if device_config.cpu_kernels:
                cpu_ops.load()  # logs the kernels phase: which path serves, and why
            else:
                with startup_phase("kernels") as phase:
                    phase.detail = "plain torch path (cpu_kernels off: --no-cpu-kernels)"
        elif self.device.type == "cuda" and distributed:
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        # Unseeded requests draw from the global generator: seed it so a run is repeatable. Every
        # tensor-parallel rank seeds alike, so they all sample the same tokens.
        torch.manual_seed(device_config.seed)
        if distributed:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            parallel_state.init_distributed_environment(
                parallel.world_size, self.rank, self.distributed_init_method, backend)
            parallel_state.initialize_model_parallel(
                parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                shm_name=self._shm_name())

    def _shm_name(self) -> str | None:
        """A name for the TP group's shared-memory all-reduce, or None where gloo/NCCL must
        serve: on CUDA, or when a TP group spans nodes (ranks are node-major, TP groups
        consecutive, so a group is node-local when whole groups fit in one node)."""
        parallel = self.config.parallel
        if self.device.type != "cpu" or parallel.local_world_size % parallel.tensor_parallel_size:
            return None
        # The rendezvous address names this engine uniquely on the node.
        digest = hashlib.sha1(self.distributed_init_method.encode()).hexdigest()[:12]
        return f"pagedserve-{digest}"

    def load_model(self) -> None:
        config = self.config
        if self.model is None:
            with startup_phase("weights") as phase:
                self.model = self._load_weights(self.model_path)
                # Loading leaves tens of MB of freed temporaries (dequantized shards) in glibc's
                # heaps: give them back, so the RSS is the weights (observability/memory.py).
                # No earlier model is being dropped, so no cycles to collect (0.1 s).
                release_memory(self.device, collect_cycles=False)
                parts = memory.model_bytes(self.model)
                phase.detail = (f"{sum(parts.values()) / 2**20:.0f} MiB in {config.device.dtype}"
                                f" ({parts['weights_packed'] / 2**20:.0f} MiB packed)"
                                + (f", rank {self.rank}" if config.parallel.world_size > 1 else ""))
        self.model_runner = ModelRunner(
            self.model, config.model, config.cache, config.device, self.device,
            speculative_config=config.speculative, scheduler_config=config.scheduler,
        )
        if config.lora is not None:
            self.model_runner.lora_manager = WorkerLoRAManager(
                self.model, config.model, config.lora, DTYPES[config.device.dtype], self.device)

    # ---- LoRA adapters (lora/worker_manager.py) ---------------------------------------------

    def add_lora(self, lora_int_id: int, lora_path: str) -> None:
        """Load an adapter into host memory (safe beside a running step)."""
        self._lora_manager().add_adapter(lora_int_id, lora_path)

    def remove_lora(self, lora_int_id: int) -> None:
        self._lora_manager().remove_adapter(lora_int_id)

    def _lora_manager(self) -> WorkerLoRAManager:
        manager = self.model_runner.lora_manager
        if manager is None:
            raise ValueError("LoRA is not enabled on this engine (enable_lora)")
        return manager

    def _load_weights(self, model_path: str) -> torch.nn.Module:
        config = self.config
        return load_model(
            model_path, config.model, DTYPES[config.device.dtype], self.device,
            config.device.keeps_weights_packed, config.device.quantize_on_load,
            self._kernel_config(),
        )

    def determine_num_kv_blocks(self) -> int:
        """Blocks this rank's KV memory budget holds (each block: its layers and KV heads)."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override:
            return cache.num_gpu_blocks_override
        budget_bytes = cache.kv_cache_memory_bytes
        if cache.gpu_memory_utilization is not None and self.device.type == "cuda":
            # The weights are loaded: the pool gets the fraction's rest (no activation profile).
            total_bytes = torch.cuda.get_device_properties(self.device).total_memory
            allocated_bytes = torch.cuda.memory_allocated(self.device)
            budget_bytes = int(cache.gpu_memory_utilization * total_bytes) - allocated_bytes
            if budget_bytes <= 0:
                raise ValueError(
                    f"gpu_memory_utilization {cache.gpu_memory_utilization} leaves no memory for "
                    f"the KV cache: {allocated_bytes} of {total_bytes} bytes are in use")
        return max(2, budget_bytes // self.model_runner.kv_cache_bytes_per_block)

    def _kernel_config(self) -> cpu_ops.KernelConfig:
        device = self.config.device
        return cpu_ops.KernelConfig(device.cpu_kernels, device.fused_decoder_layers,
                                    device.gpu_kernels, device.activation_quantization)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        with cpu_ops.building_with(self._kernel_config()):  # a separate draft model loads here
            self.model_runner.initialize_kv_cache(num_blocks)
        if self.model_runner.cuda_graphs is not None:
            with startup_phase("CUDA graphs") as phase:
                phase.detail = self.model_runner.capture_cuda_graphs()
        self._mark_ready_for_memory_report()
        if self.config.kv_transfer is not None:
            from pagedserve.kv_transfer.tiered import open_stores, parse_tiers
            from pagedserve.kv_transfer.tiered_worker import TieredConnectorWorker

            options = parse_tiers(self.config.kv_transfer, self.config.device.device)
            connector = TieredConnectorWorker(open_stores(self.config, options),
                                              options.num_load_threads,
                                              options.max_pending_save_blocks, options.sync_saves)
            connector.register_kv_caches(self.model_runner.kv_caches)
            self.model_runner.kv_connector = connector

    def _mark_ready_for_memory_report(self) -> None:
        """From here on, RSS growth is the runtime's (activations, workspaces, caches), less the
        KV pages first written since (the CPU pool fills lazily: attention/kv_cache.py)."""
        self._rss_when_ready = memory.rss_bytes()
        self._kv_resident_when_ready = _known_sum(self.model_runner.kv_resident_bytes())
        memory.reset_peak_rss()

    def memory_report(self) -> dict:
        """This rank's tensors by part, its RSS, the KV tensors' resident bytes, and its runtime
        peak: the peak RSS since the KV pool was allocated, over the RSS then, less the KV pages
        written since (activations and buffers; the CPU has no allocator statistics; on CUDA,
        the allocator's peak beyond weights and KV)."""
        components = self.model_runner.memory_components()
        resident_kv = self.model_runner.kv_resident_bytes()
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            components["runtime_peak"] = max(0, peak - sum(components.values()))
        else:
            peak, ready = memory.peak_rss_bytes(), getattr(self, "_rss_when_ready", None)
            # KV pages only ever fill (never given back), so those resident now bound the ones
            # the peak held: the runtime peak is not overstated, at worst slightly understated.
            kv_growth = _known_sum(resident_kv) - getattr(self, "_kv_resident_when_ready", 0)
            components["runtime_peak"] = (max(0, peak - ready - kv_growth)
                                          if peak is not None and ready is not None else 0)
        return {"rank": self.rank, "pid": os.getpid(), "rss_bytes": memory.rss_bytes(),
                "components": components, "resident_bytes": resident_kv}

    def expert_load(self) -> dict[int, list[int]]:
        """This rank's MoE layers: layer index -> the tokens routed to each expert so far
        (layers/moe.py); {} for a dense model."""
        expert_load = getattr(self.model, "expert_load", None)
        return expert_load() if expert_load is not None else {}

    def time_prefill(self, num_tokens: int, context_len: int) -> float:
        """Seconds a prefill of `num_tokens` after `context_len` cached tokens takes (the KV
        tiers' cost model, before any request runs)."""
        return self.model_runner.time_prefill(num_tokens, context_len)

    def calibrate_outlier_channels(self, token_ids: list[int]) -> int:
        """Choose the int8 layers' outlier channels from a pass over `token_ids` (before any
        request runs; again whenever the weights are loaded anew); the number of layers set."""
        self.calibration_token_ids = list(token_ids)
        return self.model_runner.calibrate_outlier_channels(self.calibration_token_ids)

    def _recalibrate(self) -> None:
        if self.calibration_token_ids:
            self.model_runner.calibrate_outlier_channels(self.calibration_token_ids)

    # ---- steps ------------------------------------------------------------------------------

    @property
    def is_output_rank(self) -> bool:
        """The rank whose step results go back to the engine: tensor rank 0 of the last stage
        (every tensor rank of that stage samples the same tokens)."""
        return (parallel_state.get_tp_group().is_first_rank
                and parallel_state.get_pp_group().is_last_rank)

    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        """The step's output (with async scheduling, possibly still to be read back: world size
        1 only); None on a rank that does not return one."""
        with step_range("pagedserve::worker.execute_model", self.is_profiling):
            output = self.model_runner.execute_model(scheduler_output)
        return output if self.is_output_rank else None

    # ---- the profiler (on the thread that runs the steps) -----------------------------------

    @property
    def is_profiling(self) -> bool:
        return self.profiler is not None and self.profiler.is_active

    def start_profile(self) -> None:
        """ValueError if the engine has no profiler_dir or this rank profiles already."""
        self._profiler().start()

    def stop_profile(self, export: bool = True) -> str | None:
        """Stop and write this rank's trace; returns its path (None: dropped, export=False)."""
        return self._profiler().stop(export)

    def _profiler(self) -> StepProfiler:
        if self.profiler is None:
            raise ValueError("profiling is off: start the engine with profiler_dir "
                             "(--profiler-dir or VLLM_TORCH_PROFILER_DIR)")
        return self.profiler

    # ---- sleep mode and weight reload (the engine calls these only while idle) ---------------

    def sleep(self, level: int) -> None:
        """Free memory. Level 1: the KV cache (and a draft model's); the weights stay, in host
        memory (moved there on CUDA). Level 2: the weights too: every reference this rank holds
        to the model goes, and wake_up loads it again from its file. A level not deeper than
        the current one is a no-op. The KV tiers keep what they hold (queued saves are written
        first)."""
        runner = self.model_runner
        if level <= self.sleep_level:
            return
        if self.sleep_level == 0:
            if runner.kv_connector is not None:
                runner.kv_connector.flush_saves()
                runner.kv_connector.register_kv_caches([])
            runner.release_kv_cache()
        if level == 2:
            runner.release_model()
            self.model = None
        elif self.device.type == "cuda":
            for model in self._models():
                model.to("cpu")
        self.sleep_level = level
        release_memory(self.device)

    def wake_up(self) -> None:
        """Undo sleep: the weights back on the device (reloaded from the file after level 2),
        and a zeroed KV cache of the same size (the engine has forgotten every cached block)."""
        if self.sleep_level == 0:
            return
        runner = self.model_runner
        if self.sleep_level == 2:
            self.model = self._load_weights(self.model_path)
            runner.replace_model(self.model)
            with cpu_ops.building_with(self._kernel_config()):  # a separate draft reloads here
                runner.initialize_kv_cache(runner.num_kv_blocks)
            self._recalibrate()
        else:
            if self.device.type == "cuda":
                for model in self._models():
                    model.to(self.device)
            runner.reallocate_kv_cache()
        runner.capture_cuda_graphs()  # the weights or the cache moved: their old addresses go
        if runner.kv_connector is not None:
            runner.kv_connector.register_kv_caches(runner.kv_caches)
        self.sleep_level = 0
        self._mark_ready_for_memory_report()

    def _models(self) -> list[torch.nn.Module]:
        """The target model and a separate draft model (a self-draft is the target)."""
        proposer = self.model_runner.proposer
        draft = getattr(proposer, "model", None)
        return [self.model] + ([draft] if draft is not None and draft is not self.model else [])

    def update_weights(self, model_path: str) -> None:
        """Run the weights of `model_path` from now on: a model of the same architecture and
        shape (the engine checked its config). The new weights load before the old ones go, so
        a file that fails to load leaves the old ones serving; memory peaks at both."""
        assert self.sleep_level == 0, "weights are updated while asleep"
        model = self._load_weights(model_path)
        self.model_runner.replace_model(model)
        self.model, self.model_path = model, model_path
        self._recalibrate()  # (the engine has forgotten every cached block)
        release_memory(self.device)
        self.model_runner.capture_cuda_graphs()

    def check_idle(self) -> list[str]:
        """What this rank still holds for requests (empty when idle)."""
        runner, problems = self.model_runner, []
        if runner.requests:
            problems.append(f"{len(runner.requests)} runner request states left")
        if runner.async_sampling is not None and runner.async_sampling.unread_output is not None:
            problems.append("a step's sampled tokens were never read back")
        if runner.kv_connector is not None and runner.kv_connector.num_loads_in_flight:
            problems.append(f"{runner.kv_connector.num_loads_in_flight} KV tier loads in flight")
        if runner.proposer is not None:
            runner.proposer.check_integrity()
            if runner.proposer.num_requests:
                problems.append(f"the proposer holds state (draft KV) of "
                                f"{runner.proposer.num_requests} requests")
        return problems

    def shutdown(self) -> None:
        if self.is_profiling:
            logger.warning("rank %d: shut down while profiling; the trace is dropped", self.rank)
            self.profiler.stop(export=False)
        if self.model_runner is not None and self.model_runner.kv_connector is not None:
            self.model_runner.kv_connector.shutdown()  # writes the saves still queued
            self.model_runner.kv_connector = None
        if self.config.parallel.world_size > 1:
            parallel_state.destroy_model_parallel()


def _known_sum(values: dict[str, int | None]) -> int:
    return sum(value for value in values.values() if value is not None)


def release_memory(device: torch.device, collect_cycles: bool = True) -> None:
    """Return freed tensors' memory to the system: collect reference cycles (a dropped module
    and its compiled decoder stack), empty CUDA's caching allocator, and ask glibc to give back
    the free pages it keeps in its heaps (large tensors are mmap'd and go back at once; many
    small ones, e.g. a small model's weights, would stay in the process's RSS)."""
    if collect_cycles:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    libc = memory.glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # not glibc (e.g. musl): nothing to trim
        libc.malloc_trim(0)
