"""Constrained decoding in the engine on the real default model: constrained and unconstrained
requests share batches without changing each other, speculative decoding and preemption leave
constrained outputs as they were, and a grammar that is invalid or too slow fails only its own
request."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                  "minItems": 1, "maxItems": 3}}}
JSON_PARAMS = SamplingParams(temperature=0, max_tokens=80,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
FREE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
JSON_PROMPTS = ["Describe a flower as JSON:", "Describe a car as JSON:"]


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_mixed_batch_leaves_unconstrained_rows_unchanged(make_llm):
    llm = make_llm()
    free_params = [SamplingParams(temperature=0, max_tokens=24),
                   SamplingParams(temperature=1.0, seed=11, max_tokens=24),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=12, max_tokens=24)]
    alone = llm.generate(FREE_PROMPTS, free_params)
    mixed = llm.generate(JSON_PROMPTS + FREE_PROMPTS + ["Pick a color:"],
                         [JSON_PARAMS, SamplingParams(temperature=0.9, top_p=0.8, seed=5,
                                                      max_tokens=80,
                                                      structured_outputs=JSON_PARAMS
                                                      .structured_outputs)]
                         + free_params
                         + [SamplingParams(temperature=1.0, max_tokens=5,
                                           structured_outputs=StructuredOutputsParams(
                                               choice=["red", "green"]))])
    assert token_ids(mixed[2:5]) == token_ids(alone)
    for output in mixed[:2]:
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
        assert output.outputs[0].finish_reason == "stop"
    assert mixed[5].outputs[0].text in ("red", "green")
    assert llm.engine.get_stats().structured_output.num_constrained_requests == 3


def test_spec_decoding_keeps_constrained_greedy_output(make_llm):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
            "prompt_lookup_min": 1}
    # A prompt that spells out the JSON gives the n-gram proposer drafts to offer.
    prompts = [f'Example: {{"name": "rose", "tags": ["red", "green"]}}\nNow {thing} as JSON:'
               for thing in ("a tulip", "a violet", "a fern")]
    plain = make_llm().generate(prompts, JSON_PARAMS)
    speculative_llm = make_llm(speculative_config=spec)
    speculated = speculative_llm.generate(prompts, JSON_PARAMS)
    assert token_ids(speculated) == token_ids(plain)
    assert speculative_llm.engine.get_stats().spec_decoding.num_accepted_tokens > 0
    for output in plain:
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
    # Sampled, with drafts: still valid.
    sampled = speculative_llm.generate(prompts, SamplingParams(
        temperature=1.0, seed=3, n=4, max_tokens=80, structured_outputs=JSON_PARAMS
        .structured_outputs))
    for output in sampled:
        for completion in output.outputs:
            if completion.finish_reason == "stop":
                jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_preemption_keeps_constrained_output(make_llm):
    prompts = [f"Describe item {index} as JSON:" for index in range(8)]
    expected = token_ids(make_llm().generate(prompts, JSON_PARAMS))
    llm = make_llm(num_gpu_blocks_override=8, max_model_len=120)
    outputs = llm.generate(prompts, JSON_PARAMS)
    assert llm.engine.get_stats().num_preemptions > 0
    assert token_ids(outputs) == expected


def test_grammar_end_finishes_even_with_ignore_eos(make_llm):
    llm = make_llm()
    output = llm.generate("Pick one:", SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(regex=r"(yes|no)!")))[0].outputs[0]
    assert re.fullmatch(r"(yes|no)!", output.text) and output.finish_reason == "stop"


def test_invalid_grammar_raises_and_queues_nothing(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate(["a", "b"], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="[.*")))
    assert not llm.engine.has_unfinished_requests()


class _SlowCompile:
    """Holds every compile until released: a grammar that takes too long."""

    def __init__(self, manager):
        self.manager = manager
        self.release = threading.Event()
        self.compile = manager.backend.compile

    def __call__(self, kind, text):
        self.release.wait(timeout=30)
        return self.compile(kind, text)


def test_slow_grammar_fails_only_its_request(make_llm, monkeypatch):
    llm = make_llm(grammar_compile_timeout=0.3)
    manager = llm.engine.structured_output_manager
    slow = _SlowCompile(manager)
    monkeypatch.setattr(manager.backend, "compile", slow)
    try:
        outputs = llm.generate(
            ["Hello", "The capital of France is"],
            [SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
                regex="slow[0-9]+")), SamplingParams(temperature=0, max_tokens=16)])
    finally:
        slow.release.set()
    failed, served = outputs
    assert "did not compile within the 0.3 s budget" in failed.error
    assert failed.outputs[0].finish_reason == "abort" and failed.outputs[0].token_ids == []
    assert served.error is None and len(served.outputs[0].token_ids) == 16
    assert llm.engine.get_stats().structured_output.num_compile_failures == 1


def test_abort_while_grammar_compiles(make_llm, monkeypatch):
    llm = make_llm()
    manager = llm.engine.structured_output_manager
    slow = _SlowCompile(manager)
    monkeypatch.setattr(manager.backend, "compile", slow)
    try:
        request_id = llm.engine.add_request(None, "Hi", SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="abort[0-9]")))
        assert llm.engine.num_awaiting_grammar == 1 and llm.engine.has_unfinished_requests()
        final = llm.engine.abort_request(request_id)
        assert final[0].outputs[0].finish_reason == "abort"
        assert not llm.engine.has_unfinished_requests()
    finally:
        slow.release.set()
