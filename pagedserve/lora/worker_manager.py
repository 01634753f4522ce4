"""The worker's adapters: host copies of the loaded ones, and the device slots a step uses.

    add_adapter(id, path)     read + check the PEFT files, keep this rank's part of every factor
                              in host memory (safe from any thread: the step loop never waits)
    remove_adapter(id)        forget it (and its slot)
    prepare_step(ids, ...)    put this step's adapters in slots (LRU over the others), and map
                              the step's tokens to slots: a LoRAStep for the forward context

Which adapters are loaded, and when one may be dropped, is decided by the engine
(lora/registry.py); this side only obeys, and the scheduler never puts more than max_loras
adapters in a step. Under tensor parallelism each rank keeps its own split of every factor: the
B rows of its output columns for a column-parallel layer, the A columns of its input rows for a
row-parallel one (lora/layers.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from pagedserve.config import LoRAConfig, ModelConfig
from pagedserve.distributed.parallel_state import get_tp_group
from pagedserve.layers.linear import MergedLinear
from pagedserve.lora.layers import MASKED_MAX_TOKENS, LayerLoRASlots, LoRAStep
from pagedserve.models.decoder_stack import FUSED_MAX_TOKENS
from pagedserve.lora.peft import TARGET_MODULES, AdapterError, inspect_adapter, module_shape

_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass(frozen=True)
class _Target:
    """Where an HF projection of one layer lives on this rank."""

    layer: torch.nn.Module
    """The Linear (merged or row-parallel) that computes it."""
    shard_index: int
    """Its position among the layer's outputs (q, k, v: 0, 1, 2); 0 for a single output."""
    out_rows: tuple[int, int]
    """(offset, size) of its output columns in the layer's output on this rank."""
    column_parallel: bool
    """True: B is split by output rows over TP ranks; False (row-parallel): A by input columns."""


@dataclass
class _HostAdapter:
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    """(layer, module) -> (A (r, in on this rank), scaling * B (out on this rank, r))."""
    rank: int


class WorkerLoRAManager:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: LoRAConfig,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model_config = model_config
        self.config = config
        self.dtype = dtype
        self.device = device
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self._host: dict[int, _HostAdapter] = {}
        self._lock = threading.Lock()
        """Guards _host: adapters load on another thread than the step's."""
        self._slot_last_use = [0] * config.max_loras
        self.attach(model)
        self._clock = 0
        self.num_slot_loads = 0
        """Adapters copied into a slot so far (more than the adapters used: slots were swapped)."""

    def attach(self, model: torch.nn.Module) -> None:
        """Adapt `model` from now on (also after its weights were reloaded: sleep level 2,
        update_weights): empty slots over its layers; the host copies stay."""
        self.targets: dict[tuple[int, str], _Target] = {}
        self.slots: dict[torch.nn.Module, LayerLoRASlots] = {}
        self.slot_ids: list[int | None] = [None] * self.config.max_loras
        self._build_slots(model)
        self.stack_slots = [
            self.slots[self.targets[(index, module)].layer]
            for index in range(model.start_layer, model.end_layer)
            for module in ("q_proj", "o_proj", "gate_proj", "down_proj")
        ]
        """The decoder stack's order: per layer qkv, o, gate_up, down."""

    def detach(self) -> None:
        """Drop the slots and every reference to the model's layers (sleep level 2)."""
        self.targets, self.slots, self.stack_slots = {}, {}, []
        self.slot_ids = [None] * self.config.max_loras

    def _build_slots(self, model: torch.nn.Module) -> None:
        mapping = getattr(model, "packed_modules_mapping", {})
        max_loras, max_rank = self.config.max_loras, self.config.max_lora_rank
        for index in range(model.start_layer, model.end_layer):
            for module in TARGET_MODULES:
                name, shard_id = mapping.get(module, (module, None))
                layer = model.get_submodule(f"model.layers.{index}.{_PARENT[module]}.{name}")
                if isinstance(layer, MergedLinear):
                    shard_ids = list(layer.shard_offsets)
                    target = _Target(layer, shard_ids.index(shard_id),
                                     layer.shard_offsets[shard_id], True)
                    out_features = sum(layer.output_sizes)
                    num_shards = len(shard_ids)
                    in_features = module_shape(self.model_config, module)[0]
                else:
                    out_features = module_shape(self.model_config, module)[1]
                    target = _Target(layer, 0, (0, out_features), False)
                    num_shards = 1
                    in_features = module_shape(self.model_config, module)[0] // self.tp_size
                self.targets[(index, module)] = target
                if layer not in self.slots:
                    width = num_shards * max_rank
                    self.slots[layer] = LayerLoRASlots(
                        a=torch.zeros(max_loras * width, in_features, dtype=self.dtype,
                                      device=self.device),
                        b=torch.zeros(max_loras * width, out_features, dtype=self.dtype,
                                      device=self.device),
                        width=width, active=[False] * max_loras)

    @property
    def slot_bytes(self) -> int:
        """Device memory of all the slots."""
        return sum(s.a.nbytes + s.b.nbytes for s in self.slots.values())

    @property
    def host_bytes(self) -> int:
        """Host memory of the loaded adapters' factors."""
        with self._lock:
            return sum(a.nbytes + b.nbytes for adapter in self._host.values()
                       for a, b in adapter.factors.values())

    # ---- adapters (any thread) --------------------------------------------------------------

    def add_adapter(self, lora_int_id: int, path: str) -> None:
        """Load an adapter into host memory. Raises AdapterError for a bad adapter (the engine
        checked it first; this re-check covers a file changed since)."""
        from safetensors.torch import load_file

        adapter = inspect_adapter(path, self.model_config, self.config.max_lora_rank)
        try:
            tensors = load_file(adapter.weights_path, device="cpu")
        except Exception as error:  # a file changed or vanished since the check: its load fails
            raise AdapterError(f"cannot read {adapter.weights_path}: {error}") from None
        factors = {}
        for module in adapter.modules:
            target = self.targets.get((module.layer, module.module))
            if target is None:  # another pipeline stage holds this layer
                continue
            lora_a = tensors[module.lora_a].to(self.dtype)
            lora_b = tensors[module.lora_b].to(torch.float32) * adapter.scaling
            if target.column_parallel:
                size = target.out_rows[1]
                lora_b = lora_b.narrow(0, self.tp_rank * size, size)
            else:
                size = lora_a.shape[1] // self.tp_size
                lora_a = lora_a.narrow(1, self.tp_rank * size, size)
            factors[(module.layer, module.module)] = (lora_a.contiguous(),
                                                      lora_b.to(self.dtype).contiguous())
        with self._lock:
            if lora_int_id in self._host:
                raise ValueError(f"adapter id {lora_int_id} is already loaded")
            self._host[lora_int_id] = _HostAdapter(factors, adapter.rank)

    def remove_adapter(self, lora_int_id: int) -> None:
        with self._lock:
            self._host.pop(lora_int_id, None)
        if lora_int_id in self.slot_ids:
            self.slot_ids[self.slot_ids.index(lora_int_id)] = None

    # ---- steps (the step's thread) ----------------------------------------------------------

    def prepare_step(self, lora_ids: list[int | None],
                     query_start_loc: list[int]) -> LoRAStep | None:
        """The LoRAStep of a batch whose request i uses adapter lora_ids[i] (None: the base) and
        owns tokens [query_start_loc[i], query_start_loc[i + 1]); None when no token uses one."""
        used = sorted({i for i in lora_ids if i is not None})
        if not used:
            return None
        slot_of = self._activate(used)
        rows: dict[int, list[int]] = {}
        for lora_id, start, end in zip(lora_ids, query_start_loc, query_start_loc[1:]):
            if lora_id is not None:
                rows.setdefault(slot_of[lora_id], []).extend(range(start, end))
        num_tokens = query_start_loc[-1]
        one_adapter_for_all = len(rows) == 1 and len(next(iter(rows.values()))) == num_tokens
        step = LoRAStep([], self.slots, num_slots=self.config.max_loras,
                        stack_slots=self.stack_slots)
        if num_tokens <= MASKED_MAX_TOKENS and (
                not one_adapter_for_all or num_tokens <= FUSED_MAX_TOKENS):
            # Small and mixed (several adapters, or adapter and base tokens), or small enough
            # for the compiled decoder stack: the masked form.
            token_slots = [-1] * num_tokens
            for slot, token_rows in rows.items():
                for row in token_rows:
                    token_slots[row] = slot
            step.token_slots = torch.tensor(token_slots, dtype=torch.int64, device=self.device)
        else:
            step.groups = [
                (slot, None if one_adapter_for_all
                 else torch.tensor(token_rows, dtype=torch.int64, device=self.device))
                for slot, token_rows in rows.items()
            ]
        return step

    def _activate(self, lora_ids: list[int]) -> dict[int, int]:
        """Slots holding `lora_ids` (at most max_loras), loading the missing ones into the least
        recently used slots of adapters this step does not use."""
        if len(lora_ids) > len(self.slot_ids):
            raise RuntimeError(f"{len(lora_ids)} adapters in one step; max_loras is "
                               f"{len(self.slot_ids)} (the scheduler must cap it)")
        self._clock += 1
        slot_of = {}
        for lora_id in lora_ids:
            if lora_id in self.slot_ids:
                slot_of[lora_id] = self.slot_ids.index(lora_id)
        for lora_id in lora_ids:
            if lora_id in slot_of:
                continue
            free = [s for s, held in enumerate(self.slot_ids) if held not in lora_ids]
            slot = min(free, key=lambda s: (self.slot_ids[s] is not None,
                                            self._slot_last_use[s]))
            self._write_slot(slot, lora_id)
            slot_of[lora_id] = slot
        for slot in slot_of.values():
            self._slot_last_use[slot] = self._clock
        return slot_of

    def _write_slot(self, slot: int, lora_id: int) -> None:
        with self._lock:
            adapter = self._host.get(lora_id)
        if adapter is None:
            raise RuntimeError(f"adapter id {lora_id} is not loaded on this worker")
        for slots in self.slots.values():
            columns = slice(slot * slots.width, (slot + 1) * slots.width)
            slots.a[columns].zero_()
            slots.b[columns].zero_()
            slots.active[slot] = False
        max_rank, rank = self.config.max_lora_rank, adapter.rank
        for key, (lora_a, lora_b) in adapter.factors.items():
            target = self.targets[key]
            slots = self.slots[target.layer]
            first = slot * slots.width + target.shard_index * max_rank
            offset, size = target.out_rows
            slots.a[first : first + rank].copy_(lora_a)
            slots.b[first : first + rank, offset : offset + size].copy_(lora_b.t())
            slots.active[slot] = True
        self.slot_ids[slot] = lora_id
        self.num_slot_loads += 1

