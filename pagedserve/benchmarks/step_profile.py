"""Where one engine step's time goes: a table of milliseconds per part of a decode step and of a
prefill chunk (`pagedserve bench throughput --profile`).

Timing is by wall clock around the parts, which on the CPU is exact (every op finishes before the
next starts; on CUDA the parts would need a synchronize, so this profile is CPU-only). Parts are
measured with forward hooks on the model's modules and wrappers on the engine's own stages,
installed only while profiling:

    engine step = scheduling + runner (input prep + forward + output head + sampling)
                  + output processing (detokenize, stop strings)
    forward     = embedding + norms + QKV/O projections + rotary + attention + MLP
                  + "other forward" (the Python between modules: views, splits, residuals)

A step of at most FUSED_MAX_TOKENS tokens normally runs its decoder layers in one compiled call
(models/decoder_stack.py), which hooks cannot see into: the timed steps run the modules instead
(the same kernels, one call each: the model's `fused_decoder_layers` off), and the bare step is
timed both ways.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.executor.uniproc import UniProcExecutor
from pagedserve.sampling_params import SamplingParams

# Module class name -> part; the first match walking up a module's class is used. Modules not
# listed (decoder layers, the attention block) only contain listed ones.
MODULE_PARTS = {
    "VocabEmbedding": "embedding",
    "RMSNorm": "norms (+ residual add)",
    "RotaryEmbedding": "rotary",
    "Attention": "attention (KV write + paged attn)",
}
# Submodule attribute name -> part, for the linear layers (their class says less than their role).
LINEAR_PARTS = {
    "qkv_proj": "QKV projection",
    "o_proj": "O projection",
    "gate_up_proj": "MLP gate/up projection",
    "down_proj": "MLP down projection",
}
MLP_ACTIVATION = "MLP activation (silu * up)"
PART_ORDER = [
    "scheduling", "input prep (runner)", "embedding", "norms (+ residual add)", "QKV projection",
    "rotary", "attention (KV write + paged attn)", "O projection", "MLP gate/up projection",
    MLP_ACTIVATION, "MLP down projection", "other forward (Python between modules)",
    "output head (logits)", "sampling", "output processing", "other runner/engine",
]


@dataclass
class StepTimes:
    parts: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Seconds per part, summed over the profiled steps."""
    total: float = 0.0
    num_steps: int = 0
    uninstrumented_step: float | None = None
    """Seconds of one such step without the hooks (decode only), to bound their overhead."""
    modules_step: float | None = None
    """The bare step with the compiled decoder stack off (Python modules, same kernels)."""

    def per_step_ms(self) -> dict[str, float]:
        return {part: 1000 * seconds / self.num_steps for part, seconds in self.parts.items()}


class _Timer:
    """Accumulates wall time into parts; nested timings are subtracted from their parent's."""

    def __init__(self) -> None:
        self.times = StepTimes()
        self._stack: list[list] = []  # [part, start, time spent in children]

    def start(self, part: str) -> None:
        self._stack.append([part, time.perf_counter(), 0.0])

    def stop(self) -> float:
        part, start, children = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.times.parts[part] += elapsed - children
        if self._stack:
            self._stack[-1][2] += elapsed
        return elapsed

    def wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self.start(part)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop()

        return timed


def _module_part(name: str, module: torch.nn.Module) -> str | None:
    attribute = name.rsplit(".", 1)[-1]
    if attribute in LINEAR_PARTS:
        return LINEAR_PARTS[attribute]
    return MODULE_PARTS.get(type(module).__name__)


@contextmanager
def _instrumented(engine: LLMEngine, timer: _Timer) -> Iterator[None]:
    if not isinstance(engine.executor, UniProcExecutor):
        raise ValueError("--profile hooks the model in this process: it needs tensor and "
                         "pipeline parallel size 1")
    runner = engine.executor.worker.model_runner
    model = runner.model
    handles = []
    for name, module in model.named_modules():
        part = "other forward (Python between modules)" if module is model else _module_part(
            name, module
        )
        if part is None:
            continue
        handles.append(module.register_forward_pre_hook(
            lambda _m, _args, part=part: timer.start(part)
        ))
        # A forward hook that returns a value replaces the module's output: return None.
        handles.append(module.register_forward_hook(lambda _m, _args, _out: timer.stop() and None))
    # Methods wrapped on the instances (an instance attribute shadows the class's method).
    wrapped: list[tuple[Any, str]] = []

    def wrap(obj: Any, method: str, part: str) -> None:
        setattr(obj, method, timer.wrap(part, getattr(obj, method)))
        wrapped.append((obj, method))

    wrap(engine.scheduler, "schedule", "scheduling")
    wrap(engine.scheduler, "update_from_output", "scheduling")
    wrap(engine.executor.worker.model_runner, "execute_model", "input prep (runner)")
    wrap(model, "compute_logits", "output head (logits)")
    wrap(runner, "_sample", "sampling")
    wrap(engine.output_processor, "process_outputs", "output processing")
    layers = model.model.layers[model.start_layer : model.end_layer]
    rotary = layers[0].self_attn.rotary_emb  # one instance shared by the layers
    wrap(rotary, "rotate_in_place", "rotary")  # the in-place kernel is a method, not forward
    for layer in layers:
        wrap(layer.mlp, "act_fn", MLP_ACTIVATION)  # a function call, not a module
    try:
        with _decoder_stack_off(engine):  # the modules run the stack's kernels one by one
            yield
    finally:
        for handle in handles:
            handle.remove()
        for obj, method in wrapped:
            delattr(obj, method)


def _timed_steps(engine: LLMEngine, num_steps: int) -> StepTimes:
    timer = _Timer()
    with _instrumented(engine, timer):
        for _ in range(num_steps):
            timer.start("other runner/engine")
            engine.step()
            timer.times.total += timer.stop()
            timer.times.num_steps += 1
    return timer.times


@contextmanager
def _decoder_stack_off(engine: LLMEngine) -> Iterator[None]:
    """Run every step through the Python modules (models/decoder_stack.py serves none)."""
    model = engine.executor.worker.model_runner.model.model  # the LlamaModel
    fused = model.fused_decoder_layers
    model.fused_decoder_layers = False
    try:
        yield
    finally:
        model.fused_decoder_layers = fused


def _bare_step_seconds(engine: LLMEngine, num_steps: int = 2) -> float:
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    return (time.perf_counter() - start) / num_steps


def _prompt(length: int, offset: int) -> dict:
    # Ids well inside the vocabulary, different per request so nothing hits the prefix cache.
    return {"prompt_token_ids": [1000 + (offset * 7919 + i * 31) % 20000 for i in range(length)]}


def profile_steps(
    engine: LLMEngine, batch_size: int, prompt_len: int, num_decode_steps: int = 8
) -> dict[str, StepTimes]:
    """Profile one prefill chunk of `prompt_len` tokens (one request, alone) and decode steps of
    `batch_size` requests; the engine is left idle."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=num_decode_steps + 12)
    engine.reset_prefix_cache()
    engine.add_request("profile-prefill", _prompt(prompt_len, -1), params)
    prefill = _timed_steps(engine, 1)
    engine.abort_request("profile-prefill")

    for i in range(batch_size):
        engine.add_request(f"profile-decode-{i}", _prompt(prompt_len, i), params)
    scheduler = engine.scheduler
    while (len(scheduler.running) < batch_size
           or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)):
        engine.step()
    engine.step()  # the first all-decode step, untimed (warm-up)
    decode = _timed_steps(engine, num_decode_steps)
    # The hooks cost a few microseconds per module call: time the same steps bare, to compare,
    # as served (small steps in the compiled decoder stack) and module by module.
    decode.uninstrumented_step = _bare_step_seconds(engine)
    with _decoder_stack_off(engine):
        decode.modules_step = _bare_step_seconds(engine)
    engine.abort_request([f"profile-decode-{i}" for i in range(batch_size)])
    engine.reset_prefix_cache()
    return {f"prefill chunk ({prompt_len} tokens, 1 request)": prefill,
            f"decode step (batch {batch_size})": decode}


def format_profile(profiles: dict[str, StepTimes]) -> str:
    width = 42
    names = list(profiles)
    lines = [f"{'part (ms per step)':<{width}}" + "".join(f"{n[:30]:>32}" for n in names)]
    per_step = [p.per_step_ms() for p in profiles.values()]
    for part in PART_ORDER:
        cells = []
        for times, profile in zip(per_step, profiles.values()):
            ms = times.get(part, 0.0)
            share = 100 * ms / (1000 * profile.total / profile.num_steps)
            cells.append(f"{ms:9.2f} ({share:4.1f}%)")
        lines.append(f"{part:<{width}}" + "".join(f"{c:>32}" for c in cells))
    totals = [f"{1000 * p.total / p.num_steps:9.2f}        " for p in profiles.values()]
    lines.append(f"{'total step':<{width}}" + "".join(f"{c:>32}" for c in totals))
    bare = [
        "" if p.uninstrumented_step is None else f"{1000 * p.uninstrumented_step:9.2f}        "
        for p in profiles.values()
    ]
    lines.append(f"{'same step without the timing hooks':<{width}}"
                 + "".join(f"{c:>32}" for c in bare))
    modules = [
        "" if p.modules_step is None else f"{1000 * p.modules_step:9.2f}        "
        for p in profiles.values()
    ]
    lines.append(f"{'  ... with the decoder stack off':<{width}}"
                 + "".join(f"{c:>32}" for c in modules))
    return "\n".join(lines)
