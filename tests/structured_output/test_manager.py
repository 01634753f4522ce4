"""StructuredOutputManager and GrammarState on the real tokenizer (no model): validation
messages, the LRU bound, shared in-flight compiles, draft-position masks that leave the state
as it was, and bitmasks only for constrained rows that sample."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from pagedserve.config import StructuredOutputConfig
from pagedserve.core.outputs import CachedRequestData, SchedulerOutput
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.structured_output.manager import StructuredOutputManager

EOS = (2,)


@pytest.fixture
def manager(tokenizer):
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size + 40, EOS,
                                      StructuredOutputConfig(max_cached_grammars=4))
    yield manager
    manager.shutdown()


def schema(index: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={"type": "object",
                                         "properties": {f"k{index}": {"type": "integer"}},
                                         "required": [f"k{index}"], "additionalProperties": False})


def allowed_tokens(bitmask: np.ndarray, row: int) -> set[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
    return set(np.nonzero(bits)[0].tolist())


@pytest.mark.parametrize("params,message", [
    (StructuredOutputsParams(regex="[.*"), "invalid regex"),
    (StructuredOutputsParams(json='{"type": "nonsense"}'), "nonsense"),
    (StructuredOutputsParams(json="{not json"), "invalid JSON schema"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_validate_says_what_is_wrong(manager, params, message):
    with pytest.raises(ValueError, match=message):
        manager.validate(params)
    future = manager.request_grammar(params)
    with pytest.raises(ValueError, match=message):
        future.result(timeout=30)


@pytest.mark.parametrize("params", [
    dict(), dict(regex="a", choice=["a"]), dict(regex=""), dict(choice=[]), dict(choice=["a", 1]),
    dict(json=5), dict(grammar="   "), dict(json_object="yes"),
])
def test_params_shape_is_checked(params):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**params)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=params)


def test_equal_schemas_share_a_key():
    a = StructuredOutputsParams(json={"b": 1, "a": {"type": "object"}})
    b = StructuredOutputsParams(json={"a": {"type": "object"}, "b": 1})
    assert a.spec() == b.spec()


def test_cache_is_lru_bounded_and_compiles_are_shared(manager):
    futures = [manager.request_grammar(schema(0)) for _ in range(5)]
    templates = {id(f.result(timeout=30)) for f in futures}
    # One compile whether the others joined it in flight or (on a busy machine, after it
    # finished) hit the cache.
    assert manager.stats().num_compiles == 1 and len(templates) == 1
    for index in range(1, 10):
        manager.request_grammar(schema(index)).result(timeout=30)
        assert manager.num_cached_grammars <= 4
    assert manager.stats().num_compiles == 10
    hits_before = manager.stats().num_cache_hits
    hit = manager.request_grammar(schema(9))
    assert hit.done() and manager.stats().num_cache_hits == hits_before + 1
    # schema(0) was evicted long ago: asking again compiles again.
    manager.request_grammar(schema(0)).result(timeout=30)
    assert manager.stats().num_compiles == 11


def test_draft_masks_leave_the_state_unchanged(manager, tokenizer):
    template = manager.request_grammar(StructuredOutputsParams(regex="ab+c")).result(timeout=30)
    state = manager.new_state(template)
    words = manager.backend.num_tokenizer_words
    a, b, c = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abc")
    bitmask = np.full((4, manager.backend.num_bitmask_words), -1, dtype=np.int32)
    state.fill_bitmasks_with_drafts(bitmask, 0, words, [a, b, a])
    assert a in allowed_tokens(bitmask, 0) and b not in allowed_tokens(bitmask, 0)
    assert b in allowed_tokens(bitmask, 1) and c not in allowed_tokens(bitmask, 1)
    assert {b, c} <= allowed_tokens(bitmask, 2)
    # The third draft ("a" after "ab") is forbidden: the row after it is never used.
    assert state.num_valid_prefix([a, b, a]) == 2
    # Nothing was consumed for real: the state still expects "a" first.
    single = np.full((1, manager.backend.num_bitmask_words), -1, dtype=np.int32)
    state.fill_bitmask(single, 0, words)
    assert allowed_tokens(single, 0) == allowed_tokens(bitmask, 0)
    assert state.accept_tokens([a, b, b, c]) and state.is_terminated


def _request(req_id: str, constraint, num_computed: int) -> Request:
    request = Request(req_id, [5, 6, 7], SamplingParams(max_tokens=8))
    request.constraint = constraint
    request.num_computed_tokens = num_computed
    return request


def test_bitmask_only_for_constrained_rows_that_sample(manager):
    template = manager.request_grammar(StructuredOutputsParams(choice=["yes", "no"])
                                       ).result(timeout=30)
    requests = {
        "free": _request("free", None, 3),
        "prefilling": _request("prefilling", manager.new_state(template), 2),
        "sampling": _request("sampling", manager.new_state(template), 3),
    }
    scheduler_output = SchedulerOutput([], CachedRequestData(), {"free": 1, "prefilling": 2,
                                                                 "sampling": 1}, 4, set())
    grammar_output = manager.grammar_bitmask(requests, scheduler_output)
    assert grammar_output.first_row == {"sampling": 0}
    assert grammar_output.bitmask.shape == (1, manager.backend.num_bitmask_words)
    # The model's padded ids past the tokenizer are never allowed.
    assert not grammar_output.bitmask[0, manager.backend.num_tokenizer_words:].any()
    assert manager.stats().num_mask_steps == 1
    del requests["sampling"]
    assert manager.grammar_bitmask(requests, scheduler_output) is None


def test_validate_is_thread_safe(manager):
    errors = []

    def work(offset: int) -> None:
        try:
            for index in range(offset, offset + 20):
                manager.validate(schema(index))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i * 100,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert json.loads(schema(3).spec()[1])["required"] == ["k3"]


def test_choices_with_quotes_newlines_and_unicode(manager, tokenizer):
    choices = ['say "hi"', "back\\slash", "two\nlines", "café", "日本"]
    template = manager.request_grammar(StructuredOutputsParams(choice=choices)).result(timeout=30)
    for choice in choices:
        state = manager.new_state(template)
        assert state.accept_tokens(tokenizer.encode(choice, add_special_tokens=False)), choice
        assert state.is_terminated
    state = manager.new_state(template)
    assert not state.accept_tokens(tokenizer.encode("nope", add_special_tokens=False))
