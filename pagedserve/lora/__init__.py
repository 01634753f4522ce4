"""LoRA adapters over a shared base model: many fine-tuned variants served in one batch.

  request.py   LoRARequest (vLLM's name and fields): which adapter a request runs with.
  peft.py      reads and checks a PEFT adapter directory without torch (config, tensor shapes,
               content digest): bad adapters fail before anything is allocated.
  registry.py  the engine's side: known adapters, which are loaded on the workers, who uses them.
  layers.py    the per-token delta y += B (A x) added inside the linear layers, per adapter slot.
  worker_manager.py  the worker's side: host copies (LRU) and the device slots one step uses.
"""

from pagedserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
