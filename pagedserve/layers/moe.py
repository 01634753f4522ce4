"""Mixture-of-experts MLP: a top-k router and the experts, run grouped by expert.

  TopKRouter       (T, H) -> each token's top_k experts and their weights: softmax over all
                   experts in fp32, then top-k, renormalized to sum 1 where the model says so.
  FusedExperts     E SiLU-gated MLPs stored stacked, gate_up_proj (E, 2*I, H) and down_proj
                   (E, H, I) (transformers' layout), or each expert on its GGUF codes (below).
                   The (token, expert) pairs are sorted by expert, each expert multiplies its
                   rows once, and the weighted rows are scatter-added back to their tokens: a
                   loop over experts, never over tokens.
  SparseMoeBlock   router + experts (Mixtral's block); Qwen2-MoE adds a shared expert to it.

Under tensor parallelism each rank holds every expert's intermediate columns
[r * I / tp, (r + 1) * I / tp) (like a column- then row-parallel MLP), so its output is a partial
sum and the block all-reduces it once. The router is whole on every rank (it is tiny), so all ranks
route alike.

GGUF expert weights stay packed: when every expert's gate, up and down arrive as codes of the
packed types (quantized.py), each expert runs on its codes (one packed matrix for gate-up, one for
down) and no dense copy is made or kept. Unlike a dense Linear layer, which keeps a bf16 copy for
large batches, experts keep the codes alone: an MoE model's experts are most of its bytes, and each
expert sees only its share of a batch's rows. `--quantization int4|int8` packs the experts too.
Mixed or unpackable types are dequantized into the stacked dense form (the slow reference).

Each block counts the tokens routed to each of its experts (`expert_tokens`, an int64 bincount
per step on the device, no sync): the load statistics expert-parallel load balancing will read.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.distributed.parallel_state import get_tp_group
from pagedserve.layers.activation import silu_and_mul
from pagedserve.layers.linear import _check_shape, _split_size
from pagedserve.layers.quantized import (
    GROUP_SIZE,
    GGUFQuantWeight,
    concat_rows,
    packed_weight,
    quantize_weight,
)

EXPERT_SHARDS = ("gate", "up", "down")
"""The checkpoint's matrices of one expert: gate (I, H), up (I, H), down (H, I)."""


def _dense(weight: torch.Tensor | GGUFQuantWeight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, GGUFQuantWeight) else weight


class GateLinear(nn.Module):
    """x @ W^T for a gate, W (N, H) whole on every rank and always dense: routing decisions are
    sensitive to rounding, and the matrix is tiny (llama.cpp keeps routers unquantized too; a
    quantized one is dequantized on load)."""

    def __init__(self, hidden_size: int, num_outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_outputs, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight) -> None:
        loaded_weight = _dense(loaded_weight)
        _check_shape(loaded_weight, param.shape)
        param.data.copy_(loaded_weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight)


class TopKRouter(GateLinear):
    """Router logits x @ W^T (W: (E, H)) -> each token's top-k experts and their weights."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__(hidden_size, num_experts)
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> weights (T, top_k) fp32, expert ids (T, top_k) int64."""
        probs = super().forward(hidden_states).float().softmax(dim=-1)  # (T, E)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, expert_ids


class FusedExperts(nn.Module):
    """E SiLU-gated MLPs: expert e maps x to down[e] @ (silu(gate[e] @ x) * (up[e] @ x)).

    gate_up_proj (E, 2*I_local, H) holds each expert's gate rows then its up rows (this rank's
    I_local = I / tp of each); down_proj (E, H, I_local) the matching columns of down."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 kernels: ModuleType | None) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_experts = num_experts
        self.local_size = _split_size(intermediate_size, tp.world_size,
                                      "the experts' intermediate size")
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * self.local_size, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.local_size), requires_grad=False)
        self.kernels = kernels
        self.packed_gate_up: nn.ModuleList | None = None
        self.packed_down: nn.ModuleList | None = None
        """Set when the experts run on their codes (the stacked parameters are then None)."""
        self._pending_codes: dict[tuple[int, str], GGUFQuantWeight] = {}
        """(expert, shard) -> this rank's part of a GGUF matrix, until process_weights_after_
        loading packs or dequantizes it."""

    def load_keys(self, prefix: str) -> set[str]:
        """What a complete checkpoint fills (`load` returns its share): one key per expert and
        shard, so a missing expert is named."""
        return {f"{prefix}#{expert}#{shard}" for expert in range(self.num_experts)
                for shard in EXPERT_SHARDS}

    def load(self, prefix: str, shard: str, loaded_weight, expert_id: int | None) -> set[str]:
        """Copy this rank's part of one expert's full checkpoint matrix (expert_id given), or of
        all experts' stacked (E, ...) matrices (expert_id None); shard "gate", "up", "down", or
        "gate_up" (gate rows then up rows, transformers' packed layout). Returns the keys filled."""
        if isinstance(loaded_weight, GGUFQuantWeight) and (
                expert_id is None or shard == "gate_up"
                or (shard == "down" and self.local_size % GROUP_SIZE)):
            # Kept packed only per expert and shard (the GGUF loader's form), and where this
            # rank's down columns fall on whole 32-element groups.
            loaded_weight = loaded_weight.dequantize()
        if expert_id is None:
            if loaded_weight.shape[0] != self.num_experts:
                raise ValueError(f"{prefix}: {loaded_weight.shape[0]} experts in the checkpoint, "
                                 f"expected {self.num_experts}")
            keys = set()
            for expert in range(self.num_experts):
                keys |= self.load(prefix, shard, loaded_weight[expert], expert)
            return keys
        if shard == "gate_up":
            gate, up = loaded_weight.chunk(2, dim=0)
            return (self.load(prefix, "gate", gate, expert_id)
                    | self.load(prefix, "up", up, expert_id))
        local, full = self.local_size, self.local_size * self.tp_size
        hidden_size = self.down_proj.shape[1]
        if shard == "down":
            _check_shape(loaded_weight, (hidden_size, full))
            rank_part = loaded_weight.narrow(1, self.tp_rank * local, local)
        else:
            _check_shape(loaded_weight, (full, hidden_size))
            rank_part = loaded_weight.narrow(0, self.tp_rank * local, local)
        if isinstance(rank_part, GGUFQuantWeight):
            self._pending_codes[expert_id, shard] = rank_part
        else:
            self._dense_matrix(expert_id, shard).copy_(rank_part)
        return {f"{prefix}#{expert_id}#{shard}"}

    def _dense_matrix(self, expert: int, shard: str) -> torch.Tensor:
        """The rows (gate, up) or matrix (down) of one expert in the stacked parameters."""
        if shard == "down":
            return self.down_proj.data[expert]
        offset = 0 if shard == "gate" else self.local_size
        return self.gate_up_proj.data[expert, offset : offset + self.local_size]

    def process_weights_after_loading(self, dtype: torch.dtype, quantize: str | None = None) -> None:
        """Run every expert on its GGUF codes where all of them arrived packable (or, with
        `quantize`, on a fresh int4/int8 quantization of the dense weights); else dequantize the
        codes into the stacked dense parameters."""
        pending, self._pending_codes = self._pending_codes, {}
        if quantize is not None and dtype == torch.bfloat16 and not pending:
            pending = {(expert, shard): quantize_weight(self._dense_matrix(expert, shard), quantize)
                       for expert in range(self.num_experts) for shard in EXPERT_SHARDS}
            if any(weight is None for weight in pending.values()):  # K not on 32-groups
                return
        packed = self._pack(pending, dtype)
        if packed is not None:
            self.packed_gate_up, self.packed_down = packed
            self.gate_up_proj = self.down_proj = None  # the codes alone
            return
        for (expert, shard), weight in pending.items():
            self._dense_matrix(expert, shard).copy_(weight.dequantize())

    def _pack(self, pending: dict[tuple[int, str], GGUFQuantWeight], dtype: torch.dtype
              ) -> tuple[nn.ModuleList, nn.ModuleList] | None:
        """Every expert's gate-up and down as packed modules, or None unless all of them pack
        (every shard present, gate and up of one form, a packed kernel for `dtype`)."""
        if len(pending) != self.num_experts * len(EXPERT_SHARDS):
            return None
        if dtype not in (torch.float32, torch.bfloat16):
            return None
        experts = range(self.num_experts)
        gate_up = [concat_rows([pending[e, "gate"], pending[e, "up"]]) for e in experts]
        if any(merged is None for merged in gate_up):
            return None
        gate_up_modules = [packed_weight(merged, dtype, expert=True) for merged in gate_up]
        down_modules = [packed_weight(pending[e, "down"], dtype, expert=True) for e in experts]
        if any(module is None for module in (*gate_up_modules, *down_modules)):
            return None
        return nn.ModuleList(gate_up_modules), nn.ModuleList(down_modules)

    def forward(self, hidden_states: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """hidden_states (T, H); weights, expert_ids (T, top_k); tokens_per_expert: the pairs
        each expert serves. -> (T, H), this rank's partial sum under TP."""
        top_k = expert_ids.shape[1]
        # Sorted by expert, the pairs of expert e are one contiguous run of rows:
        # | expert 0's pairs | expert 1's pairs | ... |   each row = (token, one of its experts)
        pair_order = expert_ids.flatten().argsort(stable=True)  # (T * top_k,)
        pair_tokens = pair_order // top_k
        rows = hidden_states.index_select(0, pair_tokens)       # (T * top_k, H)
        outputs = torch.empty_like(rows)
        start = 0
        for expert, num_rows in enumerate(tokens_per_expert):
            if num_rows:
                end = start + num_rows
                gate_up = self._gate_up(expert, rows[start:end])  # (n, 2 * I)
                outputs[start:end] = self._down(expert, silu_and_mul(gate_up, self.kernels))
                start = end
        # The weights stay fp32 for the product, as transformers multiplies.
        weighted = (outputs * weights.flatten()[pair_order].unsqueeze(1)).to(outputs.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, pair_tokens, weighted)

    def _gate_up(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        if self.packed_gate_up is not None:
            return self.packed_gate_up[expert](rows)
        return F.linear(rows, self.gate_up_proj[expert])

    def _down(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        if self.packed_down is not None:
            return self.packed_down[expert](rows)
        return F.linear(rows, self.down_proj[expert])


class SparseMoeBlock(nn.Module):
    """Mixtral's MoE MLP: route each token to its top-k experts and sum their weighted outputs.
    Checkpoint names under the block: gate.weight (the router), experts.*."""

    def __init__(self, config: ModelConfig, prefix: str, kernels: ModuleType | None) -> None:
        """prefix: the block's checkpoint name (for a subclass's own layers)."""
        super().__init__()
        moe = config.moe
        self.gate = TopKRouter(config.hidden_size, moe.num_experts, moe.num_experts_per_tok,
                               moe.norm_topk_prob)
        self.experts = FusedExperts(moe.num_experts, config.hidden_size,
                                    moe.expert_intermediate_size, kernels)
        self.tp_group = get_tp_group()
        self.register_buffer("expert_tokens", torch.zeros(moe.num_experts, dtype=torch.int64),
                             persistent=False)
        """(E,) int64: the (token, expert) pairs each expert has served since the model was
        loaded: its load. Summed over experts, tokens x top_k."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (T, H), complete on every TP rank."""
        return self.tp_group.all_reduce(self._routed_experts(hidden_states))

    def _routed_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum, this rank's partial under TP."""
        weights, expert_ids = self.gate(hidden_states)
        counts = torch.bincount(expert_ids.flatten(), minlength=self.experts.num_experts)
        self.expert_tokens += counts
        # NOTE: the one host sync of the block: the row count of each expert's matmul.
        return self.experts(hidden_states, weights, expert_ids, counts.tolist())
