"""Speculative decoding in the scheduler, driven by the fake runner with planned drafts.

Drafts are scheduled as extra tokens of the request, verified in one step, and the rejected ones
rolled back (`num_computed_tokens`); they are capped by max_tokens and max_model_len, cut by the
token budget, and never enter the prefix-cache index. Outputs stay those of the plain run.
"""

from __future__ import annotations

from tests.core.test_scheduler import (
    VOCAB_SIZE,
    Harness,
    assert_same_as_alone,
    fake_next_token,
    kv_value,
    make_request,
    prompt_of,
)


def plan_drafts(harness: Harness, plan: list[bool]) -> None:
    """Make the fake runner propose len(plan) drafts each step: the true next token where plan
    says True, a wrong one where False."""

    def propose(state):
        kv = list(state.expected_kv_upto(len(state.token_ids)))
        drafts = []
        for right in plan:
            token_id = fake_next_token(kv)
            if not right:
                token_id = (token_id + 1) % VOCAB_SIZE
            kv.append(kv_value(kv[-1], len(kv), token_id))
            drafts.append(token_id)
        return drafts

    harness.runner.num_speculative_tokens = len(plan)
    harness.runner._propose = propose


def test_right_drafts_are_all_accepted_plus_a_bonus_token():
    harness = Harness()
    plan_drafts(harness, [True, True, True])
    request = make_request("a", prompt_of(6), max_tokens=12)
    harness.add(request)
    harness.step()  # prefill: samples 1 token, proposes 3 drafts
    assert request.num_tokens == 7 and len(request.spec_token_ids) == 3
    out = harness.step()
    assert out.num_scheduled_tokens == {"a": 4}  # the last token + 3 drafts
    assert out.scheduled_spec_decode_tokens == {"a": harness.outputs["a"][1:4]}
    assert len(harness.outputs["a"]) == 5  # 3 accepted + 1 bonus
    assert request.num_computed_tokens == request.num_tokens - 1
    harness.run()
    assert len(harness.history) < 12  # fewer steps than tokens
    stats = harness.scheduler.stats().spec_decoding
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.acceptance_rate == 1.0 and stats.mean_acceptance_length > 3
    assert_same_as_alone(harness, [request])


def test_rejected_drafts_are_rolled_back():
    harness = Harness()
    plan_drafts(harness, [True, False, True])
    request = make_request("a", prompt_of(6), max_tokens=20)
    harness.add(request)
    harness.step()
    out = harness.step()
    assert out.num_scheduled_tokens == {"a": 4}
    # Draft 0 accepted, draft 1 rejected and replaced: 2 tokens; the KV of the last 2 scheduled
    # positions is stale and will be overwritten.
    assert len(harness.outputs["a"]) == 3
    assert request.num_computed_tokens == request.num_tokens - 1 == 8
    harness.run()
    stats = harness.scheduler.stats().spec_decoding
    assert stats.num_accepted_tokens_per_pos[:2] == [stats.num_drafts, 0]
    assert stats.acceptance_rate_per_pos[0] == 1.0 and stats.acceptance_rate_per_pos[1] == 0.0
    assert stats.mean_acceptance_length == 2.0
    assert_same_as_alone(harness, [request])


def test_drafts_are_capped_by_max_tokens_and_max_model_len():
    harness = Harness(max_model_len=12)
    plan_drafts(harness, [True] * 5)
    by_tokens = make_request("tokens", prompt_of(4, 1), max_tokens=3)
    by_len = make_request("len", prompt_of(9, 2), max_tokens=10)
    harness.add(by_tokens, by_len)
    harness.step()
    # 1 of 3 tokens out: 2 more may come, so 1 draft (+1 bonus). 10 of 12 tokens: 1 draft.
    assert len(by_tokens.spec_token_ids) == 1
    assert len(by_len.spec_token_ids) == 1
    harness.run()
    assert len(harness.outputs["tokens"]) == 3 and len(harness.outputs["len"]) == 3
    assert_same_as_alone(harness, [by_tokens, by_len])


def test_token_budget_cuts_drafts():
    harness = Harness(max_num_batched_tokens=8, max_num_seqs=4)
    plan_drafts(harness, [True] * 4)
    a = make_request("a", prompt_of(3, 1), max_tokens=20, arrival_time=0)
    b = make_request("b", prompt_of(3, 2), max_tokens=20, arrival_time=1)
    harness.add(a, b)
    harness.step()
    out = harness.step()
    assert out.num_scheduled_tokens == {"a": 5, "b": 3}
    assert [len(out.scheduled_spec_decode_tokens[r]) for r in "ab"] == [4, 2]
    harness.run()
    assert_same_as_alone(harness, [a, b])


def test_draft_tokens_never_enter_the_prefix_cache_index():
    harness = Harness(block_size=4)
    plan_drafts(harness, [False, False])
    request = make_request("a", prompt_of(5), max_tokens=10)
    harness.add(request)
    harness.step()  # 6 tokens known
    out = harness.step()  # computes positions 5..7: block 1 is full, but 6 and 7 are drafts
    assert out.scheduled_spec_decode_tokens["a"]
    manager = harness.scheduler.kv_cache_manager
    block_1 = manager.req_to_blocks["a"][0][1]
    assert block_1.block_hash is None
    assert manager.num_cached_blocks["a"] == 1
    harness.run()
    assert_same_as_alone(harness, [request])


def test_stop_token_inside_accepted_drafts_ends_the_request_there():
    reference = Harness()
    reference.add(make_request("a", prompt_of(6), max_tokens=20))
    stop_token = reference.run()["a"][2]

    harness = Harness()
    plan_drafts(harness, [True] * 4)
    request = make_request("a", prompt_of(6), max_tokens=20, stop_token_ids=[stop_token])
    harness.add(request)
    harness.run()
    assert harness.outputs["a"][-1] == stop_token and len(harness.outputs["a"]) <= 3
    assert harness.finish_reasons["a"] == "stop"
    assert_same_as_alone(harness, [request])
