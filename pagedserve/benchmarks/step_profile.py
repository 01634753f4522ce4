"""Where one engine step's time goes: a table of milliseconds per part of a decode step and of a
prefill chunk (`pagedserve bench throughput --profile`).

Nothing is patched. The engine's own parts come from its event stream (observability/events.py:
each StepFinished splits the step into schedule, prepare, forward, logits, sample and output, as
the runner and the engine measured them), and the forward's parts from forward hooks on the
model's modules, installed only while profiling. Timing is by wall clock, which on the CPU is
exact (every op finishes before the next starts; on CUDA the parts would need a synchronize, so
this profile is CPU-only):

    engine step = scheduling + input prep + forward + output head + sampling + output processing
                  + other (admission, between the stages)
    forward     = embedding + norms + QKV/O projections + rotary + attention + MLP
                  + "other forward" (the Python between modules: views, splits, residuals)

A module's own time excludes its hooked children: the attention block's is the rotary kernel and
the q/k/v split around it, the MLP's is its activation. A hooked gate_up layer runs as two steps
(its product, then the activation) where unhooked modules and the decoder stack compute silu(gate)
* up in one pass on the codes (MergedLinear.gated_activation): the two rows time that pair of steps.

A step of at most FUSED_MAX_TOKENS tokens normally runs its decoder layers in one compiled call
(models/decoder_stack.py), which hooks cannot see into: the timed steps run the modules instead
(the same kernels, one call each: the model's `fused_decoder_layers` off), and the bare step is
timed both ways.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.executor.uniproc import UniProcExecutor
from pagedserve.observability.events import StepFinished
from pagedserve.sampling_params import SamplingParams

OTHER_FORWARD = "other forward (Python between modules)"
MLP_ACTIVATION = "MLP activation (silu * up)"
# Module class name -> part. A module's own time excludes its hooked children.
MODULE_PARTS = {
    "VocabEmbedding": "embedding",
    "RMSNorm": "norms (+ residual add)",
    "LlamaAttention": "rotary (+ q/k/v split)",
    "Attention": "attention (KV write + paged attn)",
    "LlamaMLP": MLP_ACTIVATION,
}
# Submodule attribute name -> part, for the linear layers (their class says less than their role).
LINEAR_PARTS = {
    "qkv_proj": "QKV projection",
    "o_proj": "O projection",
    "gate_up_proj": "MLP gate/up projection",
    "down_proj": "MLP down projection",
}
# StepFinished field -> part.
STEP_PARTS = {
    "schedule_s": "scheduling",
    "prepare_s": "input prep (runner)",
    "logits_s": "output head (logits)",
    "sample_s": "sampling",
    "output_s": "output processing",
}
PART_ORDER = [
    "scheduling", "input prep (runner)", "embedding", "norms (+ residual add)", "QKV projection",
    "rotary (+ q/k/v split)", "attention (KV write + paged attn)", "O projection",
    "MLP gate/up projection", MLP_ACTIVATION, "MLP down projection", OTHER_FORWARD,
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


def _module_part(name: str, module: torch.nn.Module) -> str | None:
    """A module's part: by its attribute name for the linear layers, else by the nearest class
    in its MRO that MODULE_PARTS names (so Gemma's norms, attention and MLP, subclasses of
    Llama's, are their parts and not "other forward")."""
    attribute = name.rsplit(".", 1)[-1]
    if attribute in LINEAR_PARTS:
        return LINEAR_PARTS[attribute]
    return next((MODULE_PARTS[cls.__name__] for cls in type(module).__mro__
                 if cls.__name__ in MODULE_PARTS), None)


@contextmanager
def _instrumented(engine: LLMEngine, timer: _Timer, steps: list[StepFinished]) -> Iterator[None]:
    """Forward hooks on the model's parts, and the engine's StepFinished events into `steps`."""
    if not isinstance(engine.executor, UniProcExecutor):
        raise ValueError("--profile hooks the model in this process: it needs tensor and "
                         "pipeline parallel size 1")
    model = engine.executor.worker.model_runner.model
    handles = []
    for name, module in model.named_modules():
        part = _module_part(name, module)
        if part is None:
            continue
        handles.append(module.register_forward_pre_hook(
            lambda _m, _args, part=part: timer.start(part)
        ))
        # A forward hook that returns a value replaces the module's output: return None.
        handles.append(module.register_forward_hook(lambda _m, _args, _out: timer.stop() and None))
    unsubscribe = engine.events.subscribe(
        lambda events: steps.extend(e for e in events if isinstance(e, StepFinished)))
    try:
        with _decoder_stack_off(engine):  # the modules run the stack's kernels one by one
            yield
    finally:
        unsubscribe()
        for handle in handles:
            handle.remove()


def _timed_steps(engine: LLMEngine, num_steps: int) -> StepTimes:
    timer = _Timer()
    steps: list[StepFinished] = []
    with _instrumented(engine, timer, steps):
        for _ in range(num_steps):
            start = time.perf_counter()
            engine.step()
            timer.times.total += time.perf_counter() - start
            timer.times.num_steps += 1
    parts = timer.times.parts
    # The forward's hooked parts came from the hooks; the rest of it is Python between modules.
    hooked_forward = sum(parts.values())
    for step in steps:
        for field_name, part in STEP_PARTS.items():
            parts[part] += getattr(step, field_name)
    parts[OTHER_FORWARD] += max(0.0, sum(step.forward_s for step in steps) - hooked_forward)
    parts["other runner/engine"] += max(0.0, timer.times.total - sum(parts.values()))
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
