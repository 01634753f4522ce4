"""pagedserve: an LLM inference and serving engine with a paged KV cache.

Public names are imported lazily so that `pagedserve.core` (the torch-free control plane) can be
imported without pulling in torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedserve.engine.llm",
    "LLMEngine": "pagedserve.engine.llm_engine",
    "EngineArgs": "pagedserve.engine.arg_utils",
    "SamplingParams": "pagedserve.sampling_params",
    "StructuredOutputsParams": "pagedserve.sampling_params",
    "PoolingParams": "pagedserve.pooling_params",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "OutputKind": "pagedserve.outputs",
    "PoolingRequestOutput": "pagedserve.outputs",
    "EmbeddingOutput": "pagedserve.outputs",
    "LoRARequest": "pagedserve.lora.request",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
