"""Requests held back from the scheduler until what they need is ready: a structured-output grammar
still compiling (within its compile budget) and a LoRA adapter still loading. LLMEngine holds a
request here when either is pending at add_request, and each step asks which held requests are
ready to schedule and which failed (their grammar did not compile or ran past its budget, their
adapter did not load)."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

from pagedserve.lora.registry import Adapter, LoRARegistry
from pagedserve.request import Request
from pagedserve.structured_output.manager import StructuredOutputManager

IDLE_POLL_SECONDS = 0.005
"""With nothing else to run, how long a poll waits for a compile or a load to finish."""


@dataclass
class HeldRequest:
    """A request's sequences, held back until their grammar is compiled and their LoRA adapter
    is loaded."""

    requests: list[Request]
    grammar: concurrent.futures.Future | None
    deadline: float
    """When the grammar's compile budget runs out (an adapter load has no deadline)."""
    adapter: Adapter | None
    since: float
    """When it started waiting."""
    until: float = 0.0
    """When it was found ready, or failed."""
    error: str | None = None
    """Why it failed (None: ready)."""


class AdmissionGate:
    def __init__(self, structured_output_manager: StructuredOutputManager,
                 lora_registry: LoRARegistry | None) -> None:
        self._structured_output = structured_output_manager
        self._lora_registry = lora_registry
        self._held: dict[str, HeldRequest] = {}
        """Request id -> its sequences whose grammar is still compiling or whose adapter is
        still loading."""

    def __len__(self) -> int:
        return len(self._held)

    @property
    def num_compiling(self) -> int:
        """Held requests whose grammar is still compiling."""
        return sum(1 for held in self._held.values()
                   if held.grammar is not None and not held.grammar.done())

    @staticmethod
    def must_hold(grammar: concurrent.futures.Future | None, adapter: Adapter | None) -> bool:
        """Whether a request with this grammar and adapter has to wait before it is scheduled."""
        return (grammar is not None and not grammar.done()) or (
            adapter is not None and not adapter.loaded)

    def hold(self, request_id: str, requests: list[Request],
             grammar: concurrent.futures.Future | None, adapter: Adapter | None) -> None:
        now = time.monotonic()
        deadline = now + self._structured_output.config.compile_timeout_s
        self._held[request_id] = HeldRequest(requests, grammar, deadline, adapter, now)
        if adapter is not None:
            self._lora_registry.start_load(adapter)

    def release(self, request_id: str) -> HeldRequest | None:
        """Stop holding a request (aborted); None if it was not held."""
        return self._held.pop(request_id, None)

    def poll(self, idle: bool) -> dict[str, HeldRequest]:
        """The requests that stop waiting now, by id, no longer held: ready to schedule, or
        failed with an `error`. idle: nothing else is running, so wait a moment for a compile or
        a load rather than spin."""
        if not self._held:
            return {}
        if idle:
            pending = [held.grammar for held in self._held.values() if held.grammar is not None]
            if self._lora_registry is not None:
                pending += self._lora_registry.pending_loads()
            concurrent.futures.wait(pending, timeout=IDLE_POLL_SECONDS,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        if self._lora_registry is not None:
            self._lora_registry.poll()
        done = {}
        now = time.monotonic()
        for request_id, held in list(self._held.items()):
            held.error = self._error(held, now)
            adapter = held.adapter
            if held.error is None and adapter is not None and not adapter.loaded:
                self._lora_registry.start_load(adapter)  # waits for room, or loads already
                continue
            if held.error is None and held.grammar is not None and not held.grammar.done():
                continue
            held.until = now
            done[request_id] = self._held.pop(request_id)
        return done

    def _error(self, held: HeldRequest, now: float) -> str | None:
        """Why a held request fails, or None while it may still run."""
        grammar = held.grammar
        if grammar is not None:
            if grammar.done() and grammar.exception() is not None:
                self._structured_output.compile_failed()
                return str(grammar.exception())
            if not grammar.done() and now >= held.deadline:
                self._structured_output.compile_failed()
                budget = self._structured_output.config.compile_timeout_s
                return (f"the structured output grammar did not compile within the {budget:g} s "
                        f"budget")
        adapter = held.adapter
        if adapter is not None and adapter.load_error is not None and not adapter.loaded:
            return f"LoRA adapter {adapter.name!r} failed to load: {adapter.load_error}"
        return None
