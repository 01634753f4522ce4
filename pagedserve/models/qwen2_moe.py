"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Mixtral's routed experts plus a shared expert.

Every token also runs the shared expert, a dense SiLU MLP, scaled per token by
sigmoid(shared_expert_gate(x)); the routed weights are renormalized only with norm_topk_prob.
Layers listed in MoEConfig.dense_layers keep a dense MLP. q/k/v carry biases (ModelConfig), as in
Qwen2. Checkpoint names are transformers' (`mlp.gate`, `mlp.experts.{e}.gate_proj`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate`).
"""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.config import ModelConfig
from pagedserve.layers.moe import GateLinear, SparseMoeBlock
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.mixtral import MixtralForCausalLM


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, config: ModelConfig, prefix: str, kernels: ModuleType | None) -> None:
        super().__init__(config, prefix, kernels)
        shared_size = config.moe.shared_expert_intermediate_size
        if not shared_size:
            raise ValueError("Qwen2-MoE needs shared_expert_intermediate_size")
        self.shared_expert = LlamaMLP(config, f"{prefix}.shared_expert", kernels, shared_size)
        self.shared_expert_gate = GateLinear(config.hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Both terms are complete sums here: shared_expert's down_proj all-reduces its own.
        shared = self.shared_expert(hidden_states)
        shared = shared * torch.sigmoid(self.shared_expert_gate(hidden_states))  # (T, H) * (T, 1)
        return super().forward(hidden_states) + shared


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    moe_block = Qwen2MoeSparseMoeBlock

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        if config.o_bias:
            raise ValueError("Qwen2-MoE has no bias on o_proj")
        super().__init__(config, dtype)
