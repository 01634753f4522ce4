"""Mixtral: the Llama block with a sparse mixture-of-experts MLP (layers/moe.py).

Llama's attention and decoder layers are reused; only the MLP differs (`make_mlp`). The module
tree follows transformers 5 (`mlp.gate`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`);
checkpoints name the experts one by one (`block_sparse_moe.experts.{e}.w1/w3/w2`, gate/up/down)
or, saved by transformers 5 in its own layout, stacked. Both load. The GGUF loader splits a GGUF
file's stacked experts into one matrix each, in the Qwen2-MoE spelling
(`mlp.experts.{e}.gate_proj`), which loads here too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.layers.moe import SparseMoeBlock
from pagedserve.models.llama import LlamaForCausalLM, LlamaMLP

_EXPERT_WEIGHT = re.compile(
    r"(?P<prefix>model\.layers\.\d+\.mlp\.experts)\."
    r"(?:(?P<expert>\d+)\.(?P<shard>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
    r"|(?P<stacked>gate_up_proj|down_proj))"
)
_EXPERT_SHARD = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
                 "down_proj": "down", "gate_up_proj": "gate_up"}


class MixtralForCausalLM(LlamaForCausalLM):
    moe_block = SparseMoeBlock
    """The MoE MLP of this family (Qwen2-MoE adds a shared expert)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        if config.moe is None:
            raise ValueError(f"{config.architecture} needs an MoE config (experts, top-k)")
        super().__init__(config, dtype)

    def make_mlp(self, layer_index: int, prefix: str, kernels: ModuleType | None) -> nn.Module:
        if layer_index in self.config.moe.dense_layers:
            return LlamaMLP(self.config, prefix, kernels)
        return self.moe_block(self.config, prefix, kernels)

    def load_family_weight(self, name: str, tensor: torch.Tensor) -> set[str] | None:
        match = _EXPERT_WEIGHT.fullmatch(name)
        if match is None:
            return None
        prefix = match["prefix"]
        experts = self.get_submodule(prefix)
        expert_id = None if match["stacked"] else int(match["expert"])
        return experts.load(prefix, _EXPERT_SHARD[match["stacked"] or match["shard"]], tensor,
                            expert_id)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Mixtral checkpoints call the MoE block `block_sparse_moe`; transformers 5 calls it `mlp`.
        super().load_weights(
            (name.replace(".block_sparse_moe.", ".mlp."), tensor) for name, tensor in weights)

    def expert_load(self) -> dict[int, list[int]]:
        """Layer index -> the (token, expert) pairs each of its experts has served, for this
        stage's MoE layers (tokens x top_k per layer in all)."""
        return {
            index: layer.mlp.expert_tokens.tolist()
            for index, layer in enumerate(self.model.layers)
            if self.start_layer <= index < self.end_layer and isinstance(layer.mlp, SparseMoeBlock)
        }
