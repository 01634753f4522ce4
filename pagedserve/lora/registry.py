"""The engine's side of LoRA: which adapters exist, which the workers hold, and who uses them.

An adapter is *registered* (checked, by name and id), then *loaded* into the workers' host
memory, at most max_cpu_loras at a time. Loads run on a thread of their own, so the step loop
never waits for a file: a request whose adapter is not loaded waits beside the queue (as one
whose grammar compiles does) and joins it when the load is done. When the host cache is full,
the least recently used adapter that no request holds is unloaded first; if every loaded adapter
is in use, the load waits for one to be released.

Every state change happens on the engine's thread (`poll` reads finished loads), so nothing here
needs a lock. No torch: the checks are lora/peft.py's, the loads the executor's.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.config import LoRAConfig, ModelConfig
from pagedserve.lora.peft import AdapterError, PeftAdapter, inspect_adapter
from pagedserve.lora.request import LoRARequest


@dataclass
class Adapter:
    request: LoRARequest
    peft: PeftAdapter
    loaded: bool = False
    load: concurrent.futures.Future | None = None
    """The load in flight, if any."""
    load_error: str | None = None
    """Why the last load failed (its waiting requests fail with it)."""
    num_users: int = 0
    """Requests (not finished) that run with it: while > 0 it is never unloaded."""
    last_used: int = 0

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id

    @property
    def name(self) -> str:
        return self.request.lora_name


class LoRARegistry:
    def __init__(self, config: LoRAConfig, model_config: ModelConfig,
                 load: Callable[[int, str], None], unload: Callable[[int], None]) -> None:
        """load(id, path) / unload(id): the executor's add_lora / remove_lora."""
        self.config = config
        self.model_config = model_config
        self._load, self._unload = load, unload
        self._by_name: dict[str, Adapter] = {}
        self._by_id: dict[int, Adapter] = {}
        self._clock = itertools.count(1)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "pagedserve-lora-load")

    # ---- registration -----------------------------------------------------------------------

    def inspect(self, request: LoRARequest, root: str | None = None) -> PeftAdapter:
        """Check an adapter's files (any thread: reads files, changes nothing)."""
        return inspect_adapter(request.lora_path, self.model_config, self.config.max_lora_rank,
                               root)

    def register(self, request: LoRARequest, peft: PeftAdapter | None = None) -> Adapter:
        """The adapter of `request`, registered now if new (checked first unless `peft` is the
        check's result). The same name, id and path again is the same adapter; a name or id
        already taken by another is an AdapterError."""
        known = self._by_name.get(request.lora_name)
        if known is not None:
            if known.request.lora_int_id == request.lora_int_id and (
                    known.request.lora_path == request.lora_path):
                return known
            raise AdapterError(f"a LoRA adapter named {request.lora_name!r} is already loaded")
        if request.lora_int_id in self._by_id:
            raise AdapterError(f"lora_int_id {request.lora_int_id} is already used by adapter "
                               f"{self._by_id[request.lora_int_id].name!r}")
        adapter = Adapter(request, peft or self.inspect(request))
        self._by_name[request.lora_name] = adapter
        self._by_id[request.lora_int_id] = adapter
        return adapter

    def unregister(self, name: str) -> Adapter:
        """Forget an adapter no request uses (unloading it); raises AdapterError otherwise."""
        adapter = self._by_name.get(name)
        if adapter is None:
            raise AdapterError(f"no LoRA adapter named {name!r} is loaded")
        if adapter.num_users:
            raise AdapterError(f"LoRA adapter {name!r} is in use by {adapter.num_users} "
                               f"request(s); unload it when they have finished")
        if adapter.load is not None:
            raise AdapterError(f"LoRA adapter {name!r} is still loading")
        if adapter.loaded:
            self._unload(adapter.lora_int_id)
        del self._by_name[name], self._by_id[adapter.lora_int_id]
        return adapter

    def get(self, name: str) -> Adapter | None:
        return self._by_name.get(name)

    def get_by_id(self, lora_int_id: int) -> Adapter | None:
        return self._by_id.get(lora_int_id)

    @property
    def adapters(self) -> list[Adapter]:
        return list(self._by_name.values())

    # ---- use --------------------------------------------------------------------------------

    def acquire(self, adapter: Adapter) -> None:
        adapter.num_users += 1
        adapter.last_used = next(self._clock)

    def release(self, lora_int_id: int) -> None:
        adapter = self.get_by_id(lora_int_id)
        if adapter is not None and adapter.num_users > 0:
            adapter.num_users -= 1

    def start_load(self, adapter: Adapter) -> concurrent.futures.Future | None:
        """Make sure the adapter is loaded or loading: its load's future (None when it waits for
        room: every loaded adapter is in use). A loaded adapter's future is already done. Loads
        that ended count as loaded once `poll` took them in."""
        if adapter.loaded:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return done
        if adapter.load is not None:
            return adapter.load
        resident = [a for a in self._by_name.values() if a.loaded or a.load is not None]
        if len(resident) >= self.config.max_cpu_loras:
            idle = [a for a in resident if a.loaded and not a.num_users]
            if not idle:
                return None
            victim = min(idle, key=lambda a: a.last_used)
            self._unload(victim.lora_int_id)
            victim.loaded = False
        adapter.load_error = None
        adapter.load = self._pool.submit(self._load, adapter.lora_int_id, adapter.peft.path)
        return adapter.load

    def poll(self) -> None:
        """Take in the loads that finished (the engine's thread)."""
        for adapter in self._by_name.values():
            load = adapter.load
            if load is None or not load.done():
                continue
            adapter.load = None
            error = load.exception()
            if error is None:
                adapter.loaded = True
            else:
                adapter.load_error = (str(error) if isinstance(error, ValueError)
                                      else f"{type(error).__name__}: {error}")

    def pending_loads(self) -> list[concurrent.futures.Future]:
        return [a.load for a in self._by_name.values() if a.load is not None]

    def check_idle(self) -> list[str]:
        busy = [f"{a.name} ({a.num_users})" for a in self._by_name.values() if a.num_users]
        return [f"LoRA adapters still held by requests: {', '.join(busy)}"] if busy else []

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
