"""LoRA adapters on the server: the names requests pick them by, and loading them at run time.

`--lora-modules name=path ...` load at start-up; each adapter is then a model of its own in
/v1/models (its `parent` is the base) and a request picks it with `model`. With
`--enable-lora-runtime-updates` (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true),
POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the set while the server runs:
- a loaded path must lie inside `--lora-dir` (after following every symlink);
- the adapter is checked (rank, shapes, the file) before anything is allocated, and a bad one
  leaves nothing behind (400);
- unloading an adapter that running or queued requests use is refused (400): their streams go
  on untouched; unload it when they have finished.

All state here lives on the event loop's thread; the engine is reached through AsyncLLM.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai import protocol as p
from pagedserve.entrypoints.openai.errors import APIError, bad_request
from pagedserve.lora.peft import AdapterError
from pagedserve.lora.request import LoRARequest

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModule:
    """`name=path`, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}."""
    if value.lstrip().startswith("{"):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {value!r} is not valid JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not (
                isinstance(data.get("path"), str)):
            raise ValueError(f"--lora-modules {value!r} needs string 'name' and 'path'")
        return LoRAModule(data["name"], data["path"], data.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {value!r}: expected name=path")
    return LoRAModule(name, path)


def runtime_updates_from_env() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").lower() in ("1", "true")


class LoRAServing:
    def __init__(self, async_llm: AsyncLLM, base_model_name: str, lora_dir: str | None) -> None:
        self.async_llm = async_llm
        self.base_model_name = base_model_name
        self.lora_dir = lora_dir
        self.adapters: dict[str, LoRARequest] = {}
        """Name -> the adapter; only names whose load finished."""
        self._loading: set[str] = set()
        self._ids = itertools.count(1)

    def lookup(self, model: str) -> LoRARequest | None:
        return self.adapters.get(model)

    def model_card(self, name: str, max_model_len: int) -> p.ModelCard:
        lora = self.adapters[name]
        return p.ModelCard(id=name, max_model_len=max_model_len, root=lora.lora_path,
                           parent=lora.base_model_name or self.base_model_name)

    def model_cards(self, max_model_len: int) -> list[p.ModelCard]:
        return [self.model_card(name, max_model_len) for name in self.adapters]

    async def load(self, name: str, path: str, base_model_name: str | None = None,
                   confine: bool = True) -> LoRARequest:
        """Load an adapter under `name`; APIError 400 says why it cannot be. confine: the path
        must lie inside --lora-dir (always, for a runtime load)."""
        if name == self.base_model_name:
            raise bad_request(f"{name!r} is the base model's name", "lora_name")
        if name in self.adapters or name in self._loading:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if confine and self.lora_dir is None:
            raise bad_request("loading adapters at run time needs --lora-dir", "lora_path")
        lora = LoRARequest(name, next(self._ids), path, base_model_name)
        self._loading.add(name)
        try:
            await self.async_llm.add_lora(lora, self.lora_dir if confine else None)
        except AdapterError as error:
            raise bad_request(str(error), "lora_path") from None
        except ValueError as error:
            raise bad_request(str(error)) from None
        finally:
            self._loading.discard(name)
        self.adapters[name] = lora
        return lora

    async def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="lora_not_found")
        try:
            await self.async_llm.remove_lora(name)
        except ValueError as error:
            raise bad_request(str(error), "lora_name") from None
        del self.adapters[name]
