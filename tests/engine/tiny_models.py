"""Tiny random Llama directories (HF config.json + safetensors + the default model's tokenizer)
for the lifecycle tests: two of the same shape with other weights, and one of another shape."""

from __future__ import annotations

from pathlib import Path


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
