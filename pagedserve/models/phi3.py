"""Phi-3: the Llama block, with q/k/v fused into one `qkv_proj` and gate/up into one `gate_up_proj`
in the checkpoint (HF and GGUF alike; GGUF's `ffn_up` holds gate then up).

The fused tensors are split into their q/k/v and gate/up rows on load and handed to the merged
layers like Llama's separate ones, so each tensor-parallel rank takes its own heads of q, k and v
and its own columns of gate and up, and the module tree (and the compiled decoder stack) are
Llama's. Only plain RoPE is supported (the loaders reject longrope). The config's sliding window is
recorded on ModelConfig.sliding_window for the attention.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedserve.layers.quantized import GGUFQuantWeight
from pagedserve.models.llama import LlamaForCausalLM

Weight = torch.Tensor | GGUFQuantWeight


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """Yield Llama's separate weights in place of the fused ones, whose rows are
        | q (q_size) | k (kv_size) | v (kv_size) |  in qkv_proj,  | gate | up |  in gate_up_proj."""
        config = self.config
        row_splits = {
            "qkv_proj": (("q_proj", config.q_size), ("k_proj", config.kv_size),
                         ("v_proj", config.kv_size)),
            "gate_up_proj": (("gate_proj", config.intermediate_size),
                             ("up_proj", config.intermediate_size)),
        }
        for name, weight in weights:
            module_path, _, kind = name.rpartition(".")  # kind: weight or bias
            module_path, _, fused_name = module_path.rpartition(".")
            if fused_name not in row_splits:
                yield name, weight
                continue
            num_rows = sum(size for _, size in row_splits[fused_name])
            if weight.shape[0] != num_rows:
                raise ValueError(f"{name} has {weight.shape[0]} rows, expected {num_rows}")
            offset = 0
            for part_name, size in row_splits[fused_name]:
                yield f"{module_path}.{part_name}.{kind}", weight.narrow(0, offset, size)
                offset += size
