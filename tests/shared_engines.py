"""The real default model's weights loaded once per test session (per dtype and packing), and
engines built over them: a plain module, so every test module shares the one cache."""

from __future__ import annotations

_MODELS: dict[str, object] = {}


def _shared_model(model_path: str, dtype: str, keep_packed: bool, quantize: str | None = None,
                  activation_quantization: str = "auto"):
    key = f"{dtype}-{quantize or ('packed' if keep_packed else 'dense')}-{activation_quantization}"
    if key not in _MODELS:
        import torch

        from pagedserve.kernels.cpu_ops import KernelConfig
        from pagedserve.models.loader import load_model, load_model_config

        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        _MODELS[key] = load_model(
            model_path, load_model_config(model_path), torch_dtype, torch.device("cpu"),
            keep_packed, quantize, KernelConfig(activation_quantization=activation_quantization),
        )
    return _MODELS[key]


SUITE_ACTIVATION_QUANTIZATION = "int16"
"""The activations of the suite's fp32 engines unless a test asks for another mode (bf16's default
already takes int16 in the layers). Many tests compare two engines whose arithmetic differs in
summation order alone (chunked against whole prefill, KV loaded from a tier against recomputed,
spec decode's verification steps, TP's split sums): equal to ~1e-6. fp32's default int8
activations (1/254 of a group's largest value per step) turn such a difference into another
greedy token at near-ties; int16's steps are 258x finer. The default itself is checked where a
test asks for "auto": its quality against the exact engine and its parity with transformers
(tests/models), its kernels against their references (tests/kernels), and the servers the e2e
tests start with default flags."""


def shared_weights_llm(model_path: str, loaded_tokenizer, /, **overrides):
    """An LLM over the session's shared weights (fp32, in it SUITE_ACTIVATION_QUANTIZATION, and a
    512 MiB pool unless overridden); the caller checks it idle and shuts it down (make_llm does).
    Engine arguments may include `tokenizer` (EngineArgs' path), hence the positional-only
    parameters."""
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.llm_engine import LLMEngine

    overrides.setdefault("dtype", "float32")
    overrides.setdefault("kv_cache_memory", "512MiB")
    if overrides["dtype"] == "float32":
        overrides.setdefault("activation_quantization", SUITE_ACTIVATION_QUANTIZATION)
    config = EngineArgs(model=model_path, **overrides).create_engine_config()
    device = config.device
    model = _shared_model(
        model_path, device.dtype, device.keeps_weights_packed, device.quantize_on_load,
        device.activation_quantization,
    )
    return LLM.from_engine(LLMEngine(config, tokenizer=loaded_tokenizer, model=model))
