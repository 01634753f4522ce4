"""Shared fixtures: the real default model loaded once per session, and engines built over it.

Every engine made through `make_llm` is checked on teardown: all KV blocks free, all queues empty.
"""

from __future__ import annotations

import pytest

# Engine imports live inside the fixtures: tests/core must run without importing torch.


@pytest.fixture(scope="session")
def model_path() -> str:
    from pagedserve.models.loader import DEFAULT_MODEL, resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_default_model(model_path):
    """transformers' fp32 model of the default GGUF (the same dequantized weights), loaded once
    per session: read-only (a test that changes it, e.g. with PEFT, works on a deep copy)."""
    import os

    import torch

    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from pagedserve.tokenizer import Tokenizer

    return Tokenizer.from_path(model_path)


_MODELS: dict[str, object] = {}


def _shared_model(model_path: str, dtype: str, keep_packed: bool, quantize: str | None = None):
    key = f"{dtype}-{quantize or ('packed' if keep_packed else 'dense')}"
    if key not in _MODELS:
        import torch

        from pagedserve.models.loader import load_model_config
        from pagedserve.models.loader import load_model

        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        _MODELS[key] = load_model(
            model_path, load_model_config(model_path), torch_dtype, torch.device("cpu"),
            keep_packed, quantize,
        )
    return _MODELS[key]


@pytest.fixture
def make_llm(model_path, tokenizer):
    """Factory: make_llm(**engine_args) -> LLM over the session's shared weights (fp32 default)."""
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.llm_engine import LLMEngine

    engines: list[LLMEngine] = []

    def factory(**overrides) -> LLM:
        overrides.setdefault("dtype", "float32")
        overrides.setdefault("kv_cache_memory", "512MiB")
        config = EngineArgs(model=model_path, **overrides).create_engine_config()
        device = config.device
        model = _shared_model(
            model_path, device.dtype, device.keeps_weights_packed, device.quantize_on_load
        )
        engine = LLMEngine(config, tokenizer=tokenizer, model=model)
        engines.append(engine)
        return LLM.from_engine(engine)

    yield factory
    for engine in engines:
        engine.assert_idle()
        engine.shutdown()
