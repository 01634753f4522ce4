"""The scheduler's side of structured outputs, with a fake grammar (no llguidance, no torch):
accepted tokens advance the constraint, a terminated grammar finishes the request with "stop"
(even with ignore_eos and before max_tokens), and drafts the grammar forbids are never
scheduled."""

from __future__ import annotations

from tests.core.test_spec_decode_scheduling import plan_drafts
from tests.core.test_scheduler import Harness, make_request, prompt_of


class CountingConstraint:
    """Accepts anything; terminated after `length` tokens; forbids drafts past `max_drafts`."""

    def __init__(self, length: int, max_drafts: int = 100) -> None:
        self.length = length
        self.max_drafts = max_drafts
        self.accepted: list[int] = []
        self.draft_queries: list[list[int]] = []

    def accept_tokens(self, token_ids: list[int]) -> bool:
        self.accepted.extend(token_ids)
        return True

    @property
    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length

    def num_valid_prefix(self, token_ids: list[int]) -> int:
        self.draft_queries.append(list(token_ids))
        return min(len(token_ids), self.max_drafts)


def test_terminated_grammar_finishes_with_stop():
    harness = Harness()
    request = make_request("a", prompt_of(6), max_tokens=20)
    request.sampling_params.ignore_eos = True
    request.constraint = CountingConstraint(length=5)
    harness.add(request)
    harness.run()
    assert harness.finish_reasons["a"] == "stop"
    assert len(harness.outputs["a"]) == 5
    assert request.constraint.accepted == harness.outputs["a"]
    assert harness.pool.num_free_blocks == harness.pool.num_usable_blocks


def test_grammar_ending_on_the_last_allowed_token_is_a_stop():
    harness = Harness()
    request = make_request("a", prompt_of(6), max_tokens=5)
    request.constraint = CountingConstraint(length=5)
    harness.add(request)
    harness.run()
    assert harness.finish_reasons["a"] == "stop"


def test_drafts_are_cut_to_what_the_grammar_allows():
    harness = Harness()
    plan_drafts(harness, [True, True, True])
    request = make_request("a", prompt_of(6), max_tokens=12)
    request.constraint = CountingConstraint(length=100, max_drafts=1)
    harness.add(request)
    harness.step()
    assert len(request.spec_token_ids) == 1 and request.constraint.draft_queries
    out = harness.step()
    assert out.num_scheduled_tokens == {"a": 2}  # the last token + the one allowed draft
    harness.run()
    # Every emitted token, drafts included, went through the constraint exactly once.
    assert request.constraint.accepted == harness.outputs["a"]
