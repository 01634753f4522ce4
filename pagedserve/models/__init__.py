"""Model registry: architecture name -> (module, class), imported on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tokenizer reads GGUF headers (gguf_header.py) without torch
    from torch import nn

_MODELS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "gemma3": ("gemma3", "Gemma3ForCausalLM"),
}
"""Our architecture names are llama.cpp's (GGUF general.architecture; its Qwen2-MoE is "qwen2moe"
and a Mixtral GGUF may say "llama"); the classes are named as
in HF config.json `architectures`, which is how an HF directory finds its entry."""

HF_ARCHITECTURES = {class_name: name for name, (_, class_name) in _MODELS.items()}
"""HF config.json architecture -> our name."""


def unsupported_architecture(architecture: str, source: str) -> ValueError:
    """The one error for a model of an architecture not in the registry."""
    supported = ", ".join(f"{name} ({class_name})" for name, (_, class_name) in _MODELS.items())
    return ValueError(f"unsupported model architecture {architecture!r} in {source}; "
                      f"supported: {supported}")


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise unsupported_architecture(architecture, "the model config")
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"pagedserve.models.{module_name}")
    return getattr(module, class_name)
