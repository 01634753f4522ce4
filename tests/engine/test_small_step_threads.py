"""SmallStepThreads (engine/async_llm.py): small decode steps take whichever thread count the
measurements say runs them faster. Fed fixed step times here, so nothing depends on this
machine's timing."""

from __future__ import annotations

import itertools

import pytest

from pagedserve.engine.async_llm import SmallStepThreads


def run_trial(chooser: SmallStepThreads, step_seconds: dict[int, float]) -> list[int]:
    """Feed the trial's steps, each taking its count's time (with an outlier per count that a
    median ignores); returns the counts in the order the chooser asked for them."""
    asked = []
    while chooser.chosen is None:
        threads = chooser.next()
        asked.append(threads)
        outlier = len(asked) <= 2
        chooser.record(threads, 1.0 if outlier else step_seconds[threads])
    return asked


@pytest.mark.parametrize("faster", [2, 1])
def test_the_faster_count_serves_after_both_took_turns(faster):
    chooser = SmallStepThreads(2, trial_steps=5, retrial_steps=3)
    slower = 3 - faster
    asked = run_trial(chooser, {faster: 0.006, slower: 0.009})
    assert sorted(asked) == [1] * 5 + [2] * 5
    assert all(a != b for a, b in itertools.pairwise(asked))  # alternating: the same load for both
    assert chooser.chosen == faster
    assert [chooser.next() for _ in range(3)] == [faster] * 3
    # after retrial_steps small steps served, both are measured again: the load may have changed
    for _ in range(3):
        chooser.record(faster, 0.006)
    assert chooser.chosen is None
    assert run_trial(chooser, {faster: 0.009, slower: 0.006}) and chooser.chosen == slower


def test_one_thread_has_nothing_to_choose():
    chooser = SmallStepThreads(1)
    assert chooser.chosen == 1 and chooser.next() == 1
    chooser.record(1, 0.01)
    assert chooser.next() == 1
