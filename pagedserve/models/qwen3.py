"""Qwen3 (dense): the Llama block with QK-norm and no q/k/v bias; head_dim is its own setting.

QK-norm (an RMSNorm over head_dim on every query and key head, before RoPE) is carried by
ModelConfig.qk_norm and built by LlamaAttention; its weights are HF's `self_attn.q_norm` and
`self_attn.k_norm`, whole on every TP rank (they act per head). The compiled decoder stack does not
implement it, so Qwen3 always runs the modules (models/decoder_stack.py).
"""

from __future__ import annotations

import torch

from pagedserve.config import ModelConfig
from pagedserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        if not config.qk_norm:
            raise ValueError("Qwen3 normalizes q and k per head (qk_norm)")
        super().__init__(config, dtype)
