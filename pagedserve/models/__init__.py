"""Model registry: architecture name -> (module, class), imported on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tokenizer reads GGUF headers (gguf_header.py) without torch
    from torch import nn

_MODELS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(_MODELS)}")
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"pagedserve.models.{module_name}")
    return getattr(module, class_name)
