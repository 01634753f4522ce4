"""Async scheduling in the scheduler (no torch): output placeholders and their limits, and stops,
aborts, grammars and a pool that runs out while a step is in flight.

The Harness of test_scheduler.py steps as the engine does with async scheduling: step N + 1 is
scheduled and run by the fake runner (which, like the device, knows every token it sampled)
before step N's results are applied. Every request's output must be what it gives alone,
synchronously, and every invariant holds after every step.
"""

from __future__ import annotations

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.request import RequestStatus
from tests.core.test_output_constraint import CountingConstraint
from tests.core.test_scheduler import (
    Harness,
    _first_new_token,
    assert_same_as_alone,
    make_request,
    prompt_of,
    run_alone,
)


def async_harness(**kwargs) -> Harness:
    return Harness(async_scheduling=True, **kwargs)


def progress(request) -> tuple[int, int, int, int]:
    """(computed tokens, placeholders, steps in flight, known outputs)."""
    return (request.num_computed_tokens, request.num_output_placeholders,
            request.num_steps_in_flight, request.num_output_tokens)


def test_a_sampled_token_is_decoded_before_it_is_known():
    harness = async_harness()
    request = make_request("a", prompt_of(10), max_tokens=4)
    harness.add(request)
    # The prompt step samples: its token is a placeholder until the step's results are back.
    assert harness.step().num_scheduled_tokens == {"a": 10}
    assert progress(request) == (10, 1, 1, 0)
    # The next step decodes the placeholder (10 known + 1 placeholder - 10 computed = 1 token)
    # and gets a placeholder of its own; then the prompt step's token arrives.
    assert harness.step().num_scheduled_tokens == {"a": 1}
    assert progress(request) == (11, 1, 1, 1)
    assert harness.step().num_scheduled_tokens == {"a": 1}
    assert harness.step().num_scheduled_tokens == {"a": 1}
    assert progress(request) == (13, 1, 1, 3)
    # 3 outputs + 1 placeholder = max_tokens: nothing to schedule; the last step's results
    # finish the request.
    assert harness.step().is_empty
    assert harness.finish_reasons == {"a": "length"}
    assert harness.scheduled("a") == [10, 1, 1, 1, 0]  # no step wasted past max_tokens
    assert not any(out.scheduled_spec_decode_tokens for out in harness.history)  # not drafts
    assert harness.num_overlapped_steps == 3
    harness.run()
    assert_same_as_alone(harness, [request])


def test_max_tokens_one_schedules_only_the_prompt():
    harness = async_harness()
    request = make_request("a", prompt_of(6), max_tokens=1)
    harness.add(request)
    harness.run()
    assert [n for n in harness.scheduled("a") if n] == [6]
    assert_same_as_alone(harness, [request])


def test_placeholders_count_against_max_model_len():
    harness = async_harness(max_model_len=20)
    request = make_request("a", prompt_of(15), max_tokens=100)
    harness.add(request)
    harness.run()
    # 15 + 5 = max_model_len tokens; the last sampled one never gets KV: 19 computed.
    assert len(harness.outputs["a"]) == 5 and harness.finish_reasons["a"] == "length"
    assert sum(harness.scheduled("a")) == 19
    assert_same_as_alone(harness, [request])


def test_a_stop_drops_the_step_in_flight():
    prompt = prompt_of(7, 5)
    reference, _ = run_alone(make_request("ref", prompt, max_tokens=12))
    k = _first_new_token(reference, 3)
    harness = async_harness()
    eos = make_request("eos", prompt, max_tokens=12, eos_token_ids=(reference[k],))
    other = make_request("other", prompt_of(9, 2), max_tokens=12)
    harness.add(eos, other)
    harness.run()
    assert harness.outputs["eos"] == reference[: k + 1]
    assert harness.finish_reasons["eos"] == "stop"
    # The step that decoded the stop token was scheduled before it was known; its sampled token
    # never reached the request.
    assert sum(harness.scheduled("eos")) == len(prompt) + k + 1
    assert_same_as_alone(harness, [eos, other])


def test_abort_with_a_step_in_flight():
    harness = async_harness(num_blocks=32)
    victim = make_request("victim", prompt_of(9, 1), max_tokens=20, arrival_time=0)
    survivor = make_request("survivor", prompt_of(5, 2), max_tokens=12, arrival_time=1)
    harness.add(victim, survivor)
    for _ in range(4):
        harness.step()
    assert victim.num_steps_in_flight == 1 and victim.num_output_placeholders == 1
    produced = list(harness.outputs["victim"])
    harness.scheduler.finish_requests(["victim"], RequestStatus.FINISHED_ABORTED)
    assert "victim" not in harness.scheduler.kv_cache_manager.req_to_blocks  # freed at once
    harness.scheduler.check_integrity()
    harness.run()
    assert harness.outputs["victim"] == produced  # the step in flight added nothing
    assert_same_as_alone(harness, [survivor])


def test_a_constrained_request_waits_for_its_last_token():
    harness = async_harness()
    constrained = make_request("c", prompt_of(6, 1), max_tokens=4)
    constrained.constraint = CountingConstraint(length=100)
    plain = make_request("p", prompt_of(6, 2), max_tokens=4)
    harness.add(constrained, plain)
    harness.run()
    # Its grammar (and the next bitmask) needs each token: never scheduled with one in flight.
    assert harness.scheduled("c")[:7] == [6, 0, 1, 0, 1, 0, 1]
    assert harness.scheduled("p")[:4] == [6, 1, 1, 1]
    assert constrained.constraint.accepted == harness.outputs["c"]
    assert_same_as_alone(harness, [constrained, plain])


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_a_pool_that_runs_out_with_every_request_in_flight_does_not_livelock(
        enable_prefix_caching):
    # 6 usable blocks of 4 tokens; each request grows to 8 + 12 - 1 = 19 tokens of KV (5 blocks).
    harness = async_harness(num_blocks=7, enable_prefix_caching=enable_prefix_caching)
    a = make_request("a", prompt_of(8, 1), max_tokens=12, arrival_time=0)
    b = make_request("b", prompt_of(8, 2), max_tokens=12, arrival_time=1)
    harness.add(a, b)
    harness.run(max_steps=200)
    # Both needed a block while both had a step in flight: neither may be preempted then, so a
    # step scheduled nothing and waited for the step in flight; the next one preempted b.
    stalled = [i for i, out in enumerate(harness.history)
               if out.is_empty and i < len(harness.history) - 1]
    assert stalled
    assert b.num_preemptions > 0 and a.num_preemptions == 0
    assert_same_as_alone(harness, [a, b])


def test_integrity_check_catches_a_stray_placeholder():
    harness = async_harness()
    request = make_request("a", prompt_of(6), max_tokens=8)
    harness.add(request)
    harness.step()
    harness.scheduler.check_integrity()
    request.num_output_placeholders += 1  # more placeholders than steps in flight
    with pytest.raises(RuntimeError, match="placeholders"):
        harness.scheduler.check_integrity()


def test_sync_scheduling_makes_no_placeholders():
    harness = Harness()
    request = make_request("a", prompt_of(6), max_tokens=3)
    harness.add(request)
    harness.step()
    assert request.num_output_placeholders == 0 and request.num_steps_in_flight == 0
    assert harness.step().num_scheduled_tokens == {"a": 1}


def test_async_scheduling_refuses_pipeline_stages():
    with pytest.raises(ValueError, match="pipeline stages"):
        SchedulerConfig(async_scheduling=True, max_num_batches_in_flight=2)
