"""Tiny HF models and random PEFT adapters for the LoRA tests, and the transformers + PEFT
reference they are checked against."""

from __future__ import annotations


import torch

from pagedserve.benchmarks.lora import write_random_adapter

__all__ = ["SEED_PROMPTS", "make_adapter", "peft_greedy", "tiny_llama_dir",
           "write_random_adapter"]

SEED_PROMPTS = [[5, 17, 300, 42], list(range(100, 150)), [7] * 3, list(range(20, 60, 2))]


def tiny_llama_dir(path, tokenizer, **overrides):
    """A tiny random Llama saved as an HF directory; returns (path, the HF model)."""
    import transformers

    torch.manual_seed(0)
    values = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.3, tie_word_embeddings=True, rope_theta=10000.0)
    values.update(overrides)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**values), dtype=torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer._tokenizer.save(str(path / "tokenizer.json"))
    return str(path), model


def make_adapter(base_model, path, rank: int, targets: list[str], seed: int,
                 alpha: float | None = None, scale: float = 1.0, **config) -> str:
    """A random PEFT LoRA adapter (both factors random, so it changes the output) saved at
    `path`; the base model is left untouched."""
    import copy

    import peft

    torch.manual_seed(seed)
    lora_config = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets,
                                  init_lora_weights=False, **config)
    model = peft.get_peft_model(copy.deepcopy(base_model), lora_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(scale)
    model.save_pretrained(path)
    return str(path)


def peft_greedy(base_model, adapter_path: str | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of transformers with the PEFT adapter applied (None: the base model), for
    each prompt; end-of-sequence is suppressed until max_new_tokens (min_tokens on our side)."""
    import copy

    import peft

    model = base_model
    if adapter_path is not None:
        model = peft.PeftModel.from_pretrained(copy.deepcopy(base_model), adapter_path).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
            results.append(out[0, len(prompt):].tolist())
    return results

