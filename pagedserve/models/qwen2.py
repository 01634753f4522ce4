"""Qwen2 / Qwen2.5: the Llama block with biases on q/k/v and (usually) an untied output head.

The difference is carried by ModelConfig (qkv_bias, tie_word_embeddings), so the module tree
and the weight names are Llama's (the q/k/v biases split over TP ranks with their weights).
"""

from __future__ import annotations

import torch

from pagedserve.config import ModelConfig
from pagedserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        if not config.qkv_bias or config.o_bias:
            raise ValueError("Qwen2 has biases on q/k/v and none on o_proj")
        super().__init__(config, dtype)
