"""LoRARequest: the adapter a request runs with (vLLM's fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    """The adapter's name: the `model` a server request uses to pick it."""
    lora_int_id: int
    """A positive id, unique per adapter in one engine."""
    lora_path: str
    """A PEFT directory: adapter_config.json and adapter_model.safetensors."""
    base_model_name: str | None = None
    """The model /v1/models names as the adapter's parent (default: the served model)."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string")
