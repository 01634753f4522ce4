"""Tiny HF models and random PEFT adapters for the LoRA tests, and the transformers + PEFT
reference they are checked against."""

from __future__ import annotations

import os

import torch

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


def adapter_files(path) -> list[str]:
    return sorted(os.listdir(path))


def write_random_adapter(path, model_config, rank: int, targets: list[str], seed: int,
                         scale: float = 0.05, alpha: float | None = None,
                         config_overrides: dict | None = None) -> str:
    """A PEFT-format adapter for `model_config` (a pagedserve ModelConfig) written directly:
    adapter_config.json and adapter_model.safetensors with random A and B."""
    import json

    from safetensors.torch import save_file

    from pagedserve.lora.peft import module_shape

    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for module in targets:
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            in_features, out_features = module_shape(model_config, module)
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(
                rank, in_features, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                out_features, rank, generator=generator) * scale
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank,
              "target_modules": targets, "bias": "none", "use_dora": False,
              "use_rslora": False, "modules_to_save": None}
    config.update(config_overrides or {})
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)
