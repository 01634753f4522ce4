"""Runs one scheduled step on the model: SchedulerOutput in, sampled tokens out.

The runner keeps its own copy of each live request (token ids, block ids, sampling params), fed by
the scheduler's diffs, so a step sends only what changed. It owns the model, the KV cache tensors
and the sampler; it knows nothing about queues, priorities or text.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pagedserve.attention import forward_context
from pagedserve.attention.kv_cache import KVCache, KVCacheSpec
from pagedserve.attention.layer import Attention
from pagedserve.attention.metadata import build_grouped_attention_metadata
from pagedserve.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedserve.core.outputs import (
    ModelRunnerOutput,
    RunnerTimings,
    SchedulerOutput,
)
from pagedserve.distributed import get_pp_group, get_tp_group
from pagedserve.kernels import cpu_ops
from pagedserve.kv_transfer.base import KVConnectorWorker
from pagedserve.layers.outliers import calibrate_outlier_channels
from pagedserve.lora.worker_manager import WorkerLoRAManager
from pagedserve.observability.memory import model_bytes, resident_bytes, tensors_bytes
from pagedserve.sample.rejection_sampler import RejectionSampler
from pagedserve.sample.sampler import Sampler, SamplingMetadata
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode import TargetInfo, create_proposer
from pagedserve.spec_decode.draft_model import DraftModelProposer
from pagedserve.worker.async_output import (
    AsyncModelRunnerOutput,
    AsyncSampling,
    record_sampled,
)
from pagedserve.worker.cuda_graph import CudaGraphRunner, usable_graph_sizes
from pagedserve.worker.pooler import PoolingState
from pagedserve.worker.step_inputs import StepInputs
from pagedserve.worker.step_outputs import (
    apply_grammar_bitmask,
    record_prompt_outputs,
    verify_drafts,
)

logger = logging.getLogger(__name__)

INTERMEDIATE_TENSOR_NAMES = ("hidden_states", "residual")
"""What a pipeline stage hands the next one (see models/llama.py)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    """Prompt + outputs so far; the runner appends what it samples."""
    num_prompt_tokens: int
    sampling_params: SamplingParams | None
    """None for a pooling request."""
    block_ids: tuple[list[int], ...]
    """Its block table per KV cache group. A windowed group's keeps the ids of blocks the
    scheduler has let go of (another request may hold them now): its layers never read blocks
    their window has passed (attention/paged.py)."""
    num_computed_tokens: int
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    lora_int_id: int | None = None
    pooling: PoolingState | None = None
    """A pooling request's vector so far (it samples nothing)."""
    num_placeholders: int = 0
    """Async scheduling: the last tokens of token_ids and output_token_ids that are sampled on
    the device but not read back yet (PLACEHOLDER_TOKEN_ID; worker/async_output.py)."""


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device_config: DeviceConfig,
        device: torch.device,
        speculative_config: SpeculativeConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
    ) -> None:
        """model: loaded, possibly shared with other engines (it holds no per-engine state) and
        possibly one rank's shard. speculative_config: propose draft tokens after each step
        (None: no speculation). scheduler_config: the largest step (sizes the input buffers on
        an accelerator; default: SchedulerConfig's defaults). The KV cache comes later:
        initialize_kv_cache."""
        self.model = model
        self.model_config = model_config
        self.device_config = device_config
        self.speculative_config = speculative_config
        self.block_size = cache_config.block_size
        self.device = device
        self.dtype = DTYPES[device_config.dtype]
        # The attention layers of this rank's model: a pipeline stage holds some of the layers,
        # a tensor-parallel rank some of the KV heads of each.
        attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.num_local_layers = len(attention_layers)
        self.num_local_kv_heads = attention_layers[0].num_kv_heads if attention_layers else 0
        self.pp_group = get_pp_group()
        self._pending_sends: list = []
        self._sent_tensors: list[torch.Tensor] = []
        """Hidden states sent to the next pipeline stage, kept alive until the send is done."""
        layout = model_config.kv_cache_layout(cache_config.hybrid_kv_cache)
        self.num_kv_cache_groups = layout.num_groups
        self.layer_groups: tuple[int, ...] = ()
        """Per local layer, its KV cache group (core/kv_cache_groups.py); (): one group."""
        layer_slots: tuple[int, ...] = ()
        if layout.num_groups > 1:
            if self.num_local_layers != layout.num_layers:
                raise ValueError("KV cache groups need every layer on one rank (a pipeline "
                                 "stage runs with CacheConfig.hybrid_kv_cache off)")
            self.layer_groups, layer_slots = layout.layer_groups(), layout.layer_slots()
        self.kv_cache_spec = KVCacheSpec.create(
            cache_config.cache_dtype, self.dtype, self.num_local_layers, self.num_local_kv_heads,
            model_config.head_dim, self.block_size, layer_slots)
        """This rank's layers and KV heads; int8/fp8 codes with scales or the compute dtype;
        layers of different KV cache groups share slots."""
        self.kv_caches: list[KVCache] = []
        kernels = cpu_ops.load() if device_config.cpu_kernels else None  # the argmax's
        self.sampler = Sampler(kernels)
        self.rejection_sampler = RejectionSampler(kernels)
        self.proposer = None
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_connector: KVConnectorWorker | None = None
        """The worker half of the KV tiers (kv_transfer/); the worker sets it."""
        self.lora_manager: WorkerLoRAManager | None = None
        """The LoRA adapters' slots (lora/worker_manager.py); the worker sets it."""
        scheduler_config = scheduler_config or SchedulerConfig()
        graph_sizes: tuple[int, ...] = ()
        if (device.type == "cuda" and get_pp_group().world_size == 1
                and get_tp_group().world_size == 1):
            graph_sizes = usable_graph_sizes(device_config.cuda_graph_sizes, scheduler_config)
        self.step_inputs: StepInputs | None = None
        """Device buffers for a step's integer inputs, filled by non-blocking copies from pinned
        memory (on an accelerator; the CPU builds them per step)."""
        if device.type != "cpu":
            self.step_inputs = StepInputs.for_steps(
                scheduler_config, graph_sizes, self.block_size, self.num_kv_cache_groups, device)
        self.cuda_graphs: CudaGraphRunner | None = (
            CudaGraphRunner(graph_sizes, self.step_inputs) if graph_sizes else None)
        """The captured CUDA graphs (worker/cuda_graph.py): cuda on one rank, with sizes
        configured (DeviceConfig.cuda_graph_sizes); None: every step eager."""
        self.async_sampling: AsyncSampling | None = None
        """Async scheduling: execute_model returns before the sampled tokens are on the host
        (worker/async_output.py); None: it returns them."""
        if scheduler_config.async_scheduling:
            assert speculative_config is None, "async scheduling runs no drafts"
            self.async_sampling = AsyncSampling(device)

    @property
    def kv_cache_bytes_per_block(self) -> int:
        return self.kv_cache_spec.bytes_per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate this rank's share of the paged KV cache (and the draft's, if any); then the
        CUDA graphs can be captured (capture_cuda_graphs)."""
        self.num_kv_blocks = num_blocks
        self.kv_caches = self.kv_cache_spec.allocate(num_blocks, self.device)
        if self.speculative_config is not None:
            self.proposer = create_proposer(self.speculative_config, TargetInfo(
                self.model, self.model_config, num_blocks, self.block_size, self.dtype,
                self.device, self.device_config.keeps_weights_packed,
                self.device_config.quantize_on_load,
            ))

    def capture_cuda_graphs(self) -> str | None:
        """Capture the CUDA graphs over the current weights and KV cache (again after sleep or a
        weight reload). Returns what was captured, for the start-up log; None: no graphs here. A
        model that cannot be captured (a host sync inside its forward pass, e.g. MoE routing
        counts) runs eagerly, with a warning."""
        if self.cuda_graphs is None:
            return None
        try:
            self.cuda_graphs.capture(self.model, self.kv_caches, self.layer_groups)
        except Exception as error:  # noqa: BLE001 - any capture failure means: run eagerly
            logger.warning("CUDA graphs could not be captured (%s: %s); every step runs eagerly",
                           type(error).__name__, error)
            self.cuda_graphs.clear()
            self.cuda_graphs = None
            return "none: capture failed, every step eager"
        return self.cuda_graphs.describe()

    def memory_components(self) -> dict[str, int]:
        """Bytes of this rank's tensors, by part (observability/memory.py)."""
        parts: dict[str, int] = {}
        if self.model is not None:
            parts.update(model_bytes(self.model))
        parts["kv_pool"] = tensors_bytes(self.kv_caches)
        if isinstance(self.proposer, DraftModelProposer):
            parts["draft_kv"] = tensors_bytes(self.proposer.kv.kv_caches)
            if self.proposer.model is not self.model:
                draft = model_bytes(self.proposer.model)
                parts["draft_weights"] = sum(draft.values())
        if self.lora_manager is not None:
            parts["lora_slots"] = self.lora_manager.slot_bytes
            parts["lora_host"] = self.lora_manager.host_bytes
        return parts

    def kv_resident_bytes(self) -> dict[str, int | None]:
        """Of the KV tensors (this rank's pool, a draft's), the bytes in memory now: on the CPU
        they are mapped lazily and fill as blocks are first written (attention/kv_cache.py); on
        a GPU, all of them. None: unknown (not Linux)."""
        measure = resident_bytes if self.device.type == "cpu" else tensors_bytes
        resident = {"kv_pool": measure(self.kv_caches)}
        if isinstance(self.proposer, DraftModelProposer):
            resident["draft_kv"] = measure(self.proposer.kv.kv_caches)
        return resident

    # ---- sleep mode and weight reload -------------------------------------------------------

    def release_kv_cache(self) -> None:
        """Sleep mode: drop this rank's KV tensors and the draft's (idle only: no request may
        hold blocks). The caller frees the memory (gc, malloc_trim); reallocate_kv_cache()
        brings zeroed ones of the same shape back."""
        assert not self.requests, "the KV cache is released while requests hold blocks"
        if self.cuda_graphs is not None:
            self.cuda_graphs.clear()  # they hold the cache's addresses
        self.kv_caches = []
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.kv.release_tensors()
        for work in self._pending_sends:  # a pipeline stage's last send may hold activations
            work.wait()
        self._pending_sends, self._sent_tensors = [], []

    def release_model(self) -> None:
        """Sleep level 2 (after release_kv_cache): drop the model and the proposer (a draft
        model's weights and KV). replace_model, then initialize_kv_cache, bring them back."""
        self.model = None
        self.proposer = None
        if self.lora_manager is not None:
            self.lora_manager.detach()  # its slots refer to the model's layers

    def reallocate_kv_cache(self) -> None:
        self.kv_caches = self.kv_cache_spec.allocate(self.num_kv_blocks, self.device)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.kv.reallocate_tensors()

    def replace_model(self, model: torch.nn.Module) -> None:
        """Run `model` (same architecture and shape) from now on (idle only). A self-draft
        drafts with the new model's first layers; a separate draft model stays as it is."""
        assert not self.requests, "the model is replaced while requests run"
        if self.cuda_graphs is not None:
            self.cuda_graphs.clear()  # they hold the old weights' addresses
        self.model = model
        if self.lora_manager is not None:
            self.lora_manager.attach(model)
        if isinstance(self.proposer, DraftModelProposer) and self.proposer.uses_layer_prefix:
            self.proposer.model = model

    # ---- state sync -------------------------------------------------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        self.release_requests(scheduler_output.finished_req_ids)
        for data in scheduler_output.scheduled_new_reqs:
            params = data.sampling_params
            generator = None
            if params is not None and params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            self.requests[data.req_id] = CachedRequestState(
                req_id=data.req_id,
                token_ids=list(data.token_ids),
                num_prompt_tokens=data.num_prompt_tokens,
                sampling_params=params,
                block_ids=tuple(list(ids) for ids in data.block_ids),
                num_computed_tokens=data.num_computed_tokens,
                generator=generator,
                output_token_ids=list(data.token_ids[data.num_prompt_tokens :]),
                lora_int_id=data.lora_int_id,
                pooling=(PoolingState(data.pooling_params)
                         if data.pooling_params is not None else None),
            )
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed, new_token_ids in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
            cached.new_token_ids,
        ):
            state = self.requests[req_id]
            for table, new_ids in zip(state.block_ids, new_block_ids):
                table.extend(new_ids)
            state.num_computed_tokens = num_computed
            # A rank that samples has these tokens already; another pipeline stage learns them
            # here. | known to this rank | new_token_ids[missing:] |
            first_new = max(num_computed, state.num_prompt_tokens)
            missing = len(state.token_ids) - first_new
            assert missing >= 0, f"{req_id}: the runner lost track of its tokens"
            if missing < len(new_token_ids):
                state.token_ids.extend(new_token_ids[missing:])
                state.output_token_ids.extend(new_token_ids[missing:])

    def release_requests(self, req_ids: Iterable[str]) -> None:
        """Drop finished, aborted or preempted requests' state (and their draft KV)."""
        for req_id in req_ids:
            self.requests.pop(req_id, None)
        if self.proposer is not None:
            self.proposer.remove_requests(list(req_ids))

    # ---- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        """The step's sampled tokens; None on a pipeline stage before the last, which hands its
        hidden states to the next stage instead. With async scheduling, a step that samples
        returns once launched, its tokens still on their way to the host (get_output())."""
        step_start = time.perf_counter()
        if self.async_sampling is not None:
            self.async_sampling.begin_step()
        self._update_states(scheduler_output)
        grammar_output = scheduler_output.grammar
        connector_meta = scheduler_output.kv_connector_metadata
        if self.kv_connector is not None and connector_meta is not None:
            self.kv_connector.start_load_kv(connector_meta)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(kv_connector_output=self._connector_output(wait=True))
        # Decodes first: the attention backend batches the one-token queries together.
        req_ids = sorted(
            scheduler_output.num_scheduled_tokens,
            key=lambda r: scheduler_output.num_scheduled_tokens[r] != 1,
        )
        states = [self.requests[r] for r in req_ids]
        num_scheduled = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]

        input_ids: list[int] = []
        positions: list[int] = []
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for state, num_tokens in zip(states, num_scheduled):
            start = state.num_computed_tokens
            # The query is [known tokens not computed yet, *drafts]; drafts are not in token_ids.
            drafts = spec_tokens.get(state.req_id, [])
            input_ids.extend(state.token_ids[start : start + num_tokens - len(drafts)])
            input_ids.extend(drafts)
            positions.extend(range(start, start + num_tokens))

        device = self.device
        query_start_loc = [0]
        for num_tokens in num_scheduled:
            query_start_loc.append(query_start_loc[-1] + num_tokens)
        placeholders = None  # async scheduling: inputs the previous step sampled on the device
        if self.async_sampling is not None:
            placeholders = self.async_sampling.placeholder_inputs(states, query_start_loc)
        lora_step = None
        if self.lora_manager is not None:
            lora_step = self.lora_manager.prepare_step([s.lora_int_id for s in states],
                                                       query_start_loc)
        graph_size, eager_reason = self._cuda_graph_decision(len(input_ids), lora_step,
                                                             connector_meta)
        input_ids_t, positions_t, meta = self._stage_inputs(
            input_ids, positions,
            [(s.block_ids, s.num_computed_tokens, s.num_computed_tokens + n)
             for s, n in zip(states, num_scheduled)], graph_size)
        if placeholders is not None:
            self.async_sampling.fill_placeholders(input_ids_t, placeholders)
        intermediate_tensors = self._receive_intermediate(len(input_ids))
        prepared = time.perf_counter()
        if graph_size is not None:
            hidden_states = self.cuda_graphs.replay(graph_size, len(input_ids))[: len(input_ids)]
        else:
            with forward_context(meta, lora_step):
                hidden_states = self.model(input_ids_t, positions_t, intermediate_tensors)
        forwarded = time.perf_counter()
        if self.kv_connector is not None and connector_meta is not None:
            self.kv_connector.wait_for_save(connector_meta)
        if not self.pp_group.is_last_rank:
            for state, num_tokens in zip(states, num_scheduled):
                state.num_computed_tokens += num_tokens
            self._send_intermediate(hidden_states)
            return None

        output = ModelRunnerOutput(cuda_graph_size=graph_size, eager_reason=eager_reason)
        record_prompt_outputs(self.model, states, num_scheduled, query_start_loc, hidden_states,
                              output)

        # Rows that sample: generation requests whose every known token now has KV (mid-prompt
        # chunks don't).
        sample_rows = [
            i for i, (s, n) in enumerate(zip(states, num_scheduled))
            if s.pooling is None and s.num_computed_tokens + n >= len(s.token_ids)
        ]
        plain_rows = [i for i in sample_rows if states[i].req_id not in spec_tokens]
        spec_rows = [i for i in sample_rows if states[i].req_id in spec_tokens]
        # Logits at each plain row's last position, then at each spec row's last k + 1 positions:
        #   query of a spec row: | known tokens | d0 ... d(k-1) |
        #   logits rows:                    |last| d0 ... d(k-1)|  (k + 1 rows: p at d0 .. bonus)
        logits_indices = [query_start_loc[i + 1] - 1 for i in plain_rows]
        for i in spec_rows:
            end = query_start_loc[i + 1]
            logits_indices.extend(range(end - len(spec_tokens[states[i].req_id]) - 1, end))
        num_rejected: dict[str, int] = {}
        logits_s = 0.0
        if logits_indices:
            head_start = time.perf_counter()
            # From pinned memory without blocking: a pageable copy waits for the forward pass.
            logits_indices_t = torch.tensor(logits_indices, dtype=torch.int64,
                                            pin_memory=device.type == "cuda")
            logits = self.model.compute_logits(
                hidden_states[logits_indices_t.to(device, non_blocking=True)]
            )
            logits_s = time.perf_counter() - head_start
            if grammar_output is not None:
                apply_grammar_bitmask(
                    logits, [states[i] for i in plain_rows + spec_rows], spec_tokens,
                    grammar_output,
                )
            if plain_rows:
                self._sample(logits[: len(plain_rows)], [states[i] for i in plain_rows], output)
            if spec_rows:
                num_rejected = verify_drafts(
                    self.rejection_sampler, self.model_config, self.device,
                    logits[len(plain_rows) :],
                    [states[i] for i in spec_rows],
                    [spec_tokens[states[i].req_id] for i in spec_rows],
                    output,
                )
        for state, num_tokens in zip(states, num_scheduled):
            state.num_computed_tokens += num_tokens - num_rejected.get(state.req_id, 0)
        if self.proposer is not None:
            output.spec_token_ids = self.proposer.propose_batch(
                {req_id: self.requests[req_id].token_ids for req_id in output.sampled_token_ids}
            )
        output.kv_connector_output = self._connector_output(wait=False)
        output.timings = RunnerTimings(prepared - step_start, forwarded - prepared, logits_s,
                                       time.perf_counter() - forwarded - logits_s)
        if self.async_sampling is not None:
            return self.async_sampling.step_output(output)
        return output

    def _cuda_graph_decision(self, num_tokens: int, lora_step, connector_meta
                             ) -> tuple[int | None, str | None]:
        """(the captured size this step replays, None) or (None, why it runs eagerly: counted);
        (None, None) without captured graphs."""
        graphs = self.cuda_graphs
        if graphs is None or not graphs.captured:
            return None, None
        size = None
        if lora_step is not None:
            reason = "lora"
        elif connector_meta is not None and self.kv_connector is not None:
            reason = "kv_transfer"
        else:
            size = graphs.size_for(num_tokens)
            reason = "tokens" if size is None else None
        if reason is not None:
            graphs.stats.observe_eager(reason)
        return size, reason

    def _stage_inputs(
        self, input_ids: list[int], positions: list[int],
        chunks: list[tuple[tuple[list[int], ...], int, int]], graph_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, object]:
        """The step's token ids and positions on the device, and its attention metadata: through
        the persistent buffers on an accelerator (padded to graph_size for a replay), built
        fresh on the CPU."""
        inputs = self.step_inputs
        max_blocks = max(len(tables[0]) for tables, _, _ in chunks)
        if inputs is not None and inputs.fits(len(input_ids), len(chunks), max_blocks):
            return inputs.stage(input_ids, positions, chunks, self.kv_caches, self.layer_groups,
                                graph_size)
        assert graph_size is None, "a replayed step must fit the buffers it was captured on"
        meta = build_grouped_attention_metadata(chunks, self.block_size, self.kv_caches,
                                                self.device, self.layer_groups)
        return (torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                torch.tensor(positions, dtype=torch.int64, device=self.device), meta)

    def _connector_output(self, wait: bool):
        """The KV tiers' finished loads and counters (None: no connector, or nothing to say)."""
        if self.kv_connector is None:
            return None
        connector_output = self.kv_connector.get_finished(wait)
        return None if connector_output.is_empty else connector_output

    @torch.inference_mode()
    def time_prefill(self, num_tokens: int, context_len: int) -> float:
        """Seconds one forward pass over `num_tokens` new tokens after `context_len` cached ones
        takes: the KV tiers' cost model calibrates on it at start-up. Writes junk KV into the
        first blocks, which no request holds yet."""
        input_ids = torch.randint(0, self.model_config.vocab_size, (num_tokens,),
                                  device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self._prefill_outside_requests(input_ids, context_len)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    @torch.inference_mode()
    def calibrate_outlier_channels(self, token_ids: list[int]) -> int:
        """Choose the int8 layers' outlier channels from one pass over `token_ids` (the
        calibration text, layers/outliers.py); the number of layers set. Writes junk KV into
        the first blocks, which no request holds yet. Not under pipeline parallelism (a stage
        cannot run alone): 0."""
        if self.pp_group.world_size > 1:
            return 0
        return calibrate_outlier_channels(self.model, token_ids, lambda ids: (
            self._prefill_outside_requests(torch.tensor(ids, device=self.device), 0)))

    def _prefill_outside_requests(self, input_ids: torch.Tensor, context_len: int) -> None:
        """One forward pass over `input_ids` after `context_len` junk cached tokens, its KV
        written into the first blocks (no request may hold them)."""
        end = context_len + input_ids.numel()
        block_ids = list(range(1, 1 + -(-end // self.block_size)))
        # (every group in the same blocks: junk KV either way)
        meta = build_grouped_attention_metadata(
            [((block_ids,) * self.num_kv_cache_groups, context_len, end)], self.block_size,
            self.kv_caches, self.device, self.layer_groups)
        positions = torch.arange(context_len, end, device=self.device)
        with forward_context(meta):
            self.model(input_ids, positions, None)

    # ---- pipeline stages --------------------------------------------------------------------

    def _receive_intermediate(self, num_tokens: int) -> dict[str, torch.Tensor] | None:
        """On a stage after the first: the previous stage's hidden states and residual for this
        step's tokens, (T, hidden) each (the shapes follow from the step, so none are sent)."""
        if self.pp_group.is_first_rank:
            return None
        shape = (num_tokens, self.model_config.hidden_size)
        tensors = {name: torch.empty(shape, dtype=self.dtype, device=self.device)
                   for name in INTERMEDIATE_TENSOR_NAMES}
        self.pp_group.recv(list(tensors.values()), self.pp_group.prev_rank)
        return tensors

    def _send_intermediate(self, intermediate_tensors: dict[str, torch.Tensor]) -> None:
        """Start sending to the next stage and return: this stage moves on to the next micro-batch
        while the send completes (the previous one is finished first, so at most one is open)."""
        for work in self._pending_sends:
            work.wait()
        tensors = [intermediate_tensors[name].contiguous() for name in INTERMEDIATE_TENSOR_NAMES]
        self._pending_sends = self.pp_group.send(tensors, self.pp_group.next_rank)
        self._sent_tensors = tensors  # alive until the send completes

    def _sample(
        self, logits: torch.Tensor, states: list[CachedRequestState], output: ModelRunnerOutput
    ) -> None:
        if self.async_sampling is not None:
            self.async_sampling.before_sampling(states)
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        metadata = SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.output_token_ids for s in states],
            [s.token_ids[: s.num_prompt_tokens] for s in states],
            generators,
            self.model_config.eos_token_ids,
            self.model_config.vocab_size,
            self.device,
        )
        sampler_output = self.sampler(logits, metadata)
        if self.async_sampling is not None:  # the tokens are read back later (get_output())
            self.async_sampling.launch(output, states, sampler_output)
            return
        sampled = sampler_output.sampled_token_ids.tolist()  # the step's device->host sync
        logprobs_rows = logprob_ids_rows = ranks = None
        if sampler_output.logprobs is not None:
            logprobs_rows = sampler_output.logprobs.tolist()
            logprob_ids_rows = sampler_output.logprob_token_ids.tolist()
            ranks = sampler_output.sampled_token_ranks.tolist()
        for state, token_id in zip(states, sampled):
            state.token_ids.append(token_id)
            state.output_token_ids.append(token_id)
        record_sampled(output, states, sampled, logprobs_rows, logprob_ids_rows, ranks)
