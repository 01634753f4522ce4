"""Async scheduling (step N + 1 scheduled and launched before step N's tokens are applied) gives
exactly the outputs of synchronous scheduling: tokens, text, finish and stop reasons, logprobs.

On a tiny random Llama and on the real default model (fp32), for batches that mix prompt lengths,
chunked prefill, EOS / stop token / stop string / max_tokens=1 stops, seeded sampling, n > 1,
logprobs, penalties (which read the tokens on the host: the runner waits for the step before) and
a grammar; then an abort mid-stream and a KV pool small enough to preempt. On the CPU nothing
overlaps (a step computes synchronously), but the same code path runs: output placeholders,
input ids filled from the previous step's sampled tensor, outputs read back later. Each test
first shows the feature acted. Every engine is checked idle (no block held) on teardown.
"""

from __future__ import annotations

import pytest

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm import LLM
from pagedserve.outputs import OutputKind
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.tiny_models import checked_llms
from tests.prompts import PARITY_PROMPTS, source_text

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer) -> str:
    pytest.importorskip("transformers")
    from tests.engine.tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-async"), tokenizer, seed=3)


@pytest.fixture
def make_tiny(tiny_model):
    """Factory: make_tiny(**engine_args) -> LLM over the tiny random Llama (fp32); each is
    checked idle and shut down on teardown."""
    with checked_llms(tiny_model) as factory:
        yield factory


def assert_same_outputs(actual, expected) -> None:
    """Tokens, text, finish and stop reasons exactly; logprobs to float precision: a step's batch
    may differ (async scheduling decodes a request once more before its stop is known, in a
    batch of its own), and the CPU's matmuls are not bitwise the same over batch sizes."""
    def exact(outputs):
        return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
                for o in outputs]

    def logprobs(outputs):
        return [(o.prompt_logprobs, [(c.logprobs, c.cumulative_logprob) for c in o.outputs])
                for o in outputs]

    assert exact(actual) == exact(expected)
    assert_close(logprobs(actual), logprobs(expected))


def assert_close(actual, expected) -> None:
    """Equal structure, ids and ranks; floats within 1e-4."""
    if isinstance(expected, float):
        assert actual == pytest.approx(expected, abs=1e-4)
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_close(a, e)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_close(actual[key], expected[key])
    elif hasattr(expected, "logprob"):  # a Logprob
        assert (actual.rank, actual.decoded_token) == (expected.rank, expected.decoded_token)
        assert_close(actual.logprob, expected.logprob)
    else:
        assert actual == expected


def async_sampling(llm: LLM):
    return llm.engine.executor.worker.model_runner.async_sampling


def generate_sync_and_async(make, prompts, params, **engine_args):
    """The same batch through a synchronous and an async-scheduling engine; checks that the
    async one overlapped steps and gave the same outputs. Returns the sync outputs and the
    async LLM."""
    sync = make(async_scheduling=False, **engine_args)
    expected = sync.generate(prompts, params)
    assert sync.engine.num_overlapped_steps == 0 and async_sampling(sync) is None
    overlapped = make(async_scheduling=True, **engine_args)
    actual = overlapped.generate(prompts, params)
    # The feature acted: steps were scheduled and launched while the one before was in flight.
    assert overlapped.engine.max_batches_in_flight == 2
    assert overlapped.engine.num_overlapped_steps > 0
    assert_same_outputs(actual, expected)
    return expected, overlapped


def first_fresh_index(tokens: list[int], start: int) -> int:
    """Index >= start of a token that does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def stop_string_in(text: str) -> str:
    """A piece of `text` past its start (a stop string that ends the output early)."""
    middle = len(text) // 2
    piece = text[middle : middle + 3]
    assert piece.strip() and text.index(piece) > 0, text
    return piece


# ---- the mixed batches --------------------------------------------------------------------------


def test_tiny_model_mixed_batch(make_tiny):
    prompts = [{"prompt_token_ids": [(7 * i + seed) % 500 + 3 for i in range(length)]}
               for seed, length in enumerate([4, 9, 33, 90, 17, 60, 25, 12, 48])]
    probe = make_tiny().generate(prompts[1:3], GREEDY)
    stop_token = probe[0].outputs[0].token_ids[first_fresh_index(probe[0].outputs[0].token_ids, 5)]
    stop_string = stop_string_in(probe[1].outputs[0].text)
    params = [
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=24, stop=[stop_string]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),  # chunked: 90 tokens
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=11, max_tokens=20),
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=10, logprobs=4, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5,
                       frequency_penalty=0.4, presence_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=6,
                       stop_token_ids=list(range(0, 512, 5))),
    ]
    expected, overlapped = generate_sync_and_async(
        make_tiny, prompts, params, max_num_batched_tokens=32, max_num_seqs=8)
    # Each stop acted (in both runs: they are equal).
    assert len(expected[0].outputs[0].token_ids) == 1
    assert (expected[1].outputs[0].finish_reason, expected[1].outputs[0].stop_reason) == (
        "stop", stop_token)
    assert (expected[2].outputs[0].finish_reason, expected[2].outputs[0].stop_reason) == (
        "stop", stop_string)
    assert len(expected[5].outputs) == 3
    assert expected[8].outputs[0].finish_reason == "stop"
    assert len(expected[8].outputs[0].token_ids) >= 6
    # The penalty request sampled from tokens read back early (correct, not overlapped).
    assert async_sampling(overlapped).num_early_reads > 0


def test_default_model_mixed_batch(make_llm, tokenizer):
    chat = ("<|im_start|>user\nWhat is 2+2? Answer with one number.<|im_end|>\n"
            "<|im_start|>assistant\n")
    prompts = [chat, PARITY_PROMPTS[1], PARITY_PROMPTS[5], PARITY_PROMPTS[0], PARITY_PROMPTS[3],
               "Explain this code:\n" + source_text(600), "A list of three fruits:",
               "Name a colour:"]
    probe = make_llm().generate([PARITY_PROMPTS[0]], GREEDY)
    stop_string = stop_string_in(probe[0].outputs[0].text)
    params = [
        SamplingParams(temperature=0, max_tokens=40),  # ends with EOS
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop=[stop_string]),
        SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=3, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=8, logprobs=5),  # chunked: ~170 tokens
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3,
                       frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(
            regex="[A-Z][a-z]{2,8}( [a-z]{2,8}){0,2}\\.")),
    ]
    expected, overlapped = generate_sync_and_async(
        make_llm, prompts, params, max_num_batched_tokens=64, max_num_seqs=8)
    assert expected[0].outputs[0].finish_reason == "stop"  # EOS
    assert expected[0].outputs[0].stop_reason is None
    assert len(expected[0].outputs[0].token_ids) < 40
    assert len(expected[1].outputs[0].token_ids) == 1
    assert expected[3].outputs[0].stop_reason == stop_string
    assert len(tokenizer.encode(prompts[5])) > 64
    assert expected[7].outputs[0].text.endswith(".")
    assert async_sampling(overlapped).num_early_reads > 0


# ---- aborts and preemptions ---------------------------------------------------------------------


def test_abort_mid_stream(make_tiny):
    prompts = [{"prompt_token_ids": [(11 * i + seed) % 500 + 3 for i in range(length)]}
               for seed, length in enumerate([7, 20, 35])]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in make_tiny().generate(prompts, params)]

    engine = make_tiny(async_scheduling=True).engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, output_kind=OutputKind.DELTA)
    produced: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    finish_reasons = {}

    def collect(outputs) -> None:
        for output in outputs:
            produced[output.request_id] += output.outputs[0].token_ids
            if output.finished:
                finish_reasons[output.request_id] = output.outputs[0].finish_reason

    while len(produced["r1"]) < 8:
        collect(engine.step())
    # r1 has a step in flight (scheduled before its last token was applied): aborted now, that
    # step's token is dropped and its blocks go back at once.
    assert engine.scheduler.requests["r1"].num_steps_in_flight == 1
    collect(engine.abort_request("r1"))
    assert "r1" not in engine.scheduler.kv_cache_manager.req_to_blocks
    while engine.has_unfinished_requests():
        collect(engine.step())
    assert finish_reasons == {"r0": "length", "r1": "abort", "r2": "length"}
    assert produced["r0"] == expected[0] and produced["r2"] == expected[2]
    assert produced["r1"] == expected[1][: len(produced["r1"])]

    # Aborting everything while a step is in flight: the engine drains it and goes idle.
    for i, prompt in enumerate(prompts):
        engine.add_request(f"again{i}", prompt, params)
    engine.step()
    engine.step()
    assert engine.num_overlapped_steps > 0
    engine.abort_request(engine.request_ids)
    while engine.has_unfinished_requests():
        assert not engine.step()
    engine.assert_idle()


def test_tiny_kv_pool_preempts_with_the_same_output(make_tiny):
    # 11 usable blocks of 16 tokens; each request grows to 40 + 40 - 1 = 79 tokens (5 blocks).
    prompts = [{"prompt_token_ids": [(13 * i + seed) % 500 + 3 for i in range(40)]}
               for seed in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected, overlapped = generate_sync_and_async(
        make_tiny, prompts, params, num_gpu_blocks_override=12, enable_prefix_caching=False)
    assert overlapped.engine.scheduler.num_preemptions > 0
    assert all(len(o.outputs[0].token_ids) == 40 for o in expected)


def test_warm_up_and_sleep_leave_nothing_in_flight(make_tiny):
    prompts = [{"prompt_token_ids": [(5 * i + seed) % 500 + 3 for i in range(length)]}
               for seed, length in enumerate([6, 30])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in make_tiny().generate(prompts, params)]
    llm = make_tiny(async_scheduling=True, enable_sleep_mode=True)
    llm.engine.warm_up()  # steps below the scheduler, each read back at once; checks idle
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    llm.sleep(1)  # needs an idle engine: generate returned with no step in flight
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.num_overlapped_steps > 0


def test_shutdown_with_a_step_in_flight(tiny_model):
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="16MiB", async_scheduling=True)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.scheduler.requests["r"].num_steps_in_flight == 1
    engine.shutdown()  # waits for the step in flight: its tokens are read back
    assert not any("never read back" in problem for problem in engine.executor.check_idle())


# ---- configuration ------------------------------------------------------------------------------


def test_auto_is_off_on_the_cpu_and_explicit_conflicts_are_refused(model_path):
    def scheduler_config(**args):
        return EngineArgs(model=model_path, **args).create_engine_config().scheduler

    assert not scheduler_config().async_scheduling  # auto: the CPU overlaps nothing
    assert scheduler_config(async_scheduling=True).async_scheduling
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert not scheduler_config(device="cuda", speculative_config=ngram).async_scheduling
    assert scheduler_config(device="cuda").async_scheduling
    with pytest.raises(ValueError, match="--async-scheduling does not run with speculative"):
        scheduler_config(async_scheduling=True, speculative_config=ngram)
    with pytest.raises(ValueError, match="tensor or pipeline parallelism"):
        scheduler_config(async_scheduling=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="KV tiers"):
        scheduler_config(async_scheduling=True, kv_transfer_config={
            "kv_connector": "DiskConnector", "kv_connector_extra_config": {"path": "/tmp/kv"}})
