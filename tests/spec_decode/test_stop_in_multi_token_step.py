"""A speculative step hands the output processor several tokens at once. When a stop string is
completed by one of them, the sequence must end exactly where a one-token-per-step engine ends
it: text, token ids, logprobs and finish reason. No model: the real tokenizer and synthetic
EngineCoreOutputs."""

from __future__ import annotations

import pytest

from pagedserve.core.outputs import EngineCoreOutput, TokenLogprobs
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.outputs import OutputKind
from pagedserve.sampling_params import SamplingParams

TEXT = " one two three four five six seven"


def run(tokenizer, chunks: list[list[int]], params: SamplingParams, finished_with=None):
    """Feed the token chunks as consecutive steps; returns (final output, stopped_by_string)."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, tokenizer.encode("Count:"), {"r": params},
                          OutputKind.FINAL_ONLY, arrival_time=0.0)
    stopped, final = {}, None
    for index, chunk in enumerate(chunks):
        last = index == len(chunks) - 1
        logprobs = [TokenLogprobs([t], [-0.5], 1) for t in chunk]
        out = EngineCoreOutput("r", chunk, new_logprobs=logprobs,
                               finish_reason=finished_with if last else None)
        processed = processor.process_outputs([out])
        stopped.update(processed.stopped_by_string)
        if processed.request_outputs:
            final = processed.request_outputs[0]
        if "r" in stopped or final is not None:
            break
    return final, stopped


@pytest.mark.parametrize("chunk_size", [2, 3, 5])
def test_a_stop_string_inside_a_multi_token_step_cuts_the_token_ids(tokenizer, chunk_size):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(stop=[" four"], logprobs=0)
    one_by_one, stopped_one = run(tokenizer, [[t] for t in ids], params)
    chunks = [ids[i : i + chunk_size] for i in range(0, len(ids), chunk_size)]
    multi, stopped_multi = run(tokenizer, chunks, params)
    a, b = one_by_one.outputs[0], multi.outputs[0]
    assert a.text == " one two three" and a.finish_reason == "stop" and a.stop_reason == " four"
    assert len(a.token_ids) < len(ids)  # the stop string ended it early
    assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (
        a.text, a.token_ids, a.finish_reason, a.stop_reason)
    assert len(b.logprobs) == len(b.token_ids) and b.cumulative_logprob == a.cumulative_logprob
    assert stopped_one == stopped_multi == {"r": " four"}  # the engine must finish it


def test_a_stop_string_before_the_schedulers_own_stop_wins(tokenizer):
    """The scheduler ended the request (length) at the step's last token, but a stop string
    completed earlier in the step: finish reason "stop", tokens cut there."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(stop=[" two"])
    final, stopped = run(tokenizer, [ids], params, finished_with="length")
    out = final.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (" one", "stop", " two")
    assert out.token_ids == ids[: len(out.token_ids)] and len(out.token_ids) < len(ids)
    assert stopped == {}  # already finished in the scheduler: nothing more to do there
