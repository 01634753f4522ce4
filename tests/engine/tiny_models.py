"""Tiny random Llama directories (HF config.json + safetensors + the default model's tokenizer)
for the lifecycle tests: two of the same shape with other weights, and one of another shape."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def checked_llms(default_model: str | None = None) -> Iterator[Callable[..., object]]:
    """A factory for the test's engines: factory(model=default_model, **engine_args) -> LLM (fp32
    and a 16 MiB pool unless overridden); on exit each is checked idle and shut down."""
    from pagedserve.engine.llm import LLM

    llms: list[LLM] = []

    def factory(model: str | None = default_model, **overrides) -> LLM:
        overrides.setdefault("dtype", "float32")
        overrides.setdefault("kv_cache_memory", "16MiB")
        llm = LLM(model=model, **overrides)
        llms.append(llm)
        return llm

    yield factory
    for llm in llms:
        llm.engine.assert_idle()
        llm.engine.shutdown()


def write_tiny_llama(path: Path, tokenizer, seed: int, num_hidden_layers: int = 2,
                     hidden_size: int = 64, intermediate_size: int = 128) -> str:
    """A random Llama (512 token ids, the default model's tokenizer saved beside it); weights
    spread wide, so greedy decoding has no near-ties."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=True,
        rope_theta=10000.0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer._tokenizer.save(str(path / "tokenizer.json"))
    return str(path)


GEMMA3_SLIDING_WINDOW = 8
"""Shorter than the tests' prompts, so the windowed layer masks part of every long one."""


def write_tiny_gemma3(path: Path, tokenizer, seed: int = 0,
                      sliding_window: int = GEMMA3_SLIDING_WINDOW) -> tuple[str, object]:
    """A random Gemma 3 (512 token ids): a windowed layer (window 8 by default) and a global one,
    a score scale that is not head_dim's, logit softcapping, and norm weights away from zero
    (Gemma scales by 1 + weight). Returns the directory and the transformers model (fp32,
    eval)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        initializer_range=0.3, sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
        final_logit_softcapping=30.0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer._tokenizer.save(str(path / "tokenizer.json"))
    return str(path), model
