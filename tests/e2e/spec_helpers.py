"""Pieces the speculative-decoding end-to-end tests share (n-gram and draft-model runs)."""

from __future__ import annotations

from pagedserve.core.outputs import SchedulerOutput
from pagedserve.sampling_params import SamplingParams


def stop_string_params(free_outputs) -> list[SamplingParams]:
    """n = 2 greedy params per prompt, with a stop string taken from the middle of that prompt's
    free-running output (where one is printable); at least 3 prompts get one."""
    params = []
    for out in free_outputs:
        text = out.outputs[0].text
        stop = [text[12:16]] if len(text.strip()) > 20 and text[12:16].strip() else []
        params.append(SamplingParams(n=2, temperature=0, max_tokens=32, ignore_eos=True,
                                     stop=stop))
    assert sum(bool(p.stop) for p in params) >= 3
    return params


def record_schedules(llm) -> list[SchedulerOutput]:
    """Every SchedulerOutput the engine's scheduler hands out from now on."""
    schedules: list[SchedulerOutput] = []
    original = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: schedules.append(original()) or schedules[-1]
    return schedules


def assert_spec_run_exercised_everything(llm, schedules: list[SchedulerOutput]) -> None:
    """Preemption, prefix-cache hits and accepted drafts all happened, and some step verified
    drafts next to a prompt chunk."""
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0  # the n = 2 copies share the prompt
    assert stats.spec_decoding.num_accepted_tokens > 0
    assert any(out.scheduled_spec_decode_tokens and any(
        n > 1 and r not in out.scheduled_spec_decode_tokens
        for r, n in out.num_scheduled_tokens.items()) for out in schedules), \
        "no step verified drafts next to a prompt chunk"
