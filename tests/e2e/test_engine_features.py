"""Engine features on the real default model: each first shows it acted, then that greedy output
is the same as the plain run. Every engine is checked idle (no blocks held) on teardown."""

from __future__ import annotations

import pytest

from pagedserve.outputs import OutputKind
from pagedserve.sampling_params import SamplingParams
from tests.prompts import PARITY_PROMPTS, source_text

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def mixed_prompts(tokenizer, count: int = 16) -> list[dict]:
    """`count` distinct prompts of very different lengths (5 to ~620 tokens)."""
    texts = PARITY_PROMPTS[:9] + [source_text(n) for n in (300, 1000, 2000)]
    texts += [p + " Answer briefly." for p in PARITY_PROMPTS[:4]]
    assert count <= len(texts)
    return [{"prompt_token_ids": tokenizer.encode(t)} for t in texts[:count]]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def record_schedules(llm) -> list:
    """Capture every SchedulerOutput the engine produces from now on."""
    scheduler = llm.engine.scheduler
    original = scheduler.schedule
    seen = []

    def schedule():
        output = original()
        seen.append(output)
        return output

    scheduler.schedule = schedule
    return seen


@pytest.fixture(scope="module")
def plain_outputs_cache():
    return {}


def plain_outputs(make_llm, prompts, cache):
    """Greedy outputs of the plain configuration (no chunking, no caching), computed once."""
    key = tuple(tuple(p["prompt_token_ids"]) for p in prompts)
    if key not in cache:
        llm = make_llm(enable_chunked_prefill=False, enable_prefix_caching=False)
        cache[key] = token_ids(llm.generate(prompts, GREEDY))
    return cache[key]


def test_batch_equals_alone(make_llm, tokenizer):
    """16 prompts in one batch; alone, every other short one and all the long ones (a batch-1
    run of all 16 took most of this test's 27 s)."""
    prompts = mixed_prompts(tokenizer, 16)
    llm = make_llm(enable_prefix_caching=False)
    batched = token_ids(llm.generate(prompts, GREEDY))
    checked = [0, 2, 4, 6, 8, 9, 10, 11]  # 9-11: source text of 300, 1000 and 2000 chars
    alone = [token_ids(llm.generate([prompts[i]], GREEDY))[0] for i in checked]
    assert [batched[i] for i in checked] == alone


def test_chunked_prefill_does_not_change_output(make_llm, tokenizer, plain_outputs_cache):
    prompts = mixed_prompts(tokenizer, 8)
    llm = make_llm(max_num_batched_tokens=256, enable_prefix_caching=False)
    schedules = record_schedules(llm)
    chunked = token_ids(llm.generate(prompts, GREEDY))
    # The feature acted: some prompt was split, and some step held chunks of two prompts.
    prompt_lens = {}
    for out in schedules:
        for data in out.scheduled_new_reqs:
            prompt_lens[data.req_id] = len(data.token_ids)
    split = [r for out in schedules for data in out.scheduled_new_reqs
             if out.num_scheduled_tokens[(r := data.req_id)] < len(data.token_ids)]
    assert split, "no prompt was chunked"
    assert any(sum(1 for n in out.num_scheduled_tokens.values() if n > 1) >= 2
               for out in schedules), "no step prefilled two prompts"
    assert all(out.total_num_scheduled_tokens <= 256 for out in schedules)
    assert chunked == plain_outputs(make_llm, prompts, plain_outputs_cache)


def test_prefix_caching_does_not_change_output(make_llm, tokenizer, plain_outputs_cache):
    prompts = mixed_prompts(tokenizer, 8)
    llm = make_llm(enable_prefix_caching=True)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert sum(o.num_cached_tokens for o in second) > 0
    for out, prompt in zip(second, prompts):
        num_prompt = len(prompt["prompt_token_ids"])
        assert out.num_cached_tokens == (num_prompt - 1) // 16 * 16
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits
    expected = plain_outputs(make_llm, prompts, plain_outputs_cache)
    assert token_ids(first) == expected
    assert token_ids(second) == expected


def test_preemption_does_not_change_output(make_llm, tokenizer, plain_outputs_cache):
    prompts = mixed_prompts(tokenizer, 8)
    # 48 blocks of 16 = 768 tokens: enough for any one request, far too few for all at once.
    llm = make_llm(num_gpu_blocks_override=49, max_model_len=700)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.get_stats().num_preemptions > 0
    assert token_ids(outputs) == plain_outputs(make_llm, prompts, plain_outputs_cache)


def test_document_qa_second_question_reuses_the_document(make_llm, tokenizer):
    document = source_text(4000)
    doc_ids = tokenizer.encode(document)
    assert len(doc_ids) >= 1000
    llm = make_llm()
    question_a = tokenizer.encode("\n\nSummarize the code above.")
    question_b = tokenizer.encode("\n\nWhat are the risks in this code?")
    llm.generate([{"prompt_token_ids": doc_ids + question_a}], GREEDY)

    computed_before = llm.engine.get_stats().num_prompt_tokens_computed
    out_b = llm.generate([{"prompt_token_ids": doc_ids + question_b}], GREEDY)[0]
    computed_for_b = llm.engine.get_stats().num_prompt_tokens_computed - computed_before

    full_doc_blocks = len(doc_ids) // 16 * 16
    assert out_b.num_cached_tokens >= full_doc_blocks
    assert computed_for_b == len(doc_ids) + len(question_b) - out_b.num_cached_tokens


def test_seeded_sampling_is_independent_of_the_batch(make_llm, tokenizer):
    llm = make_llm()
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=32)
    prompt = "Once upon a time"
    alone = llm.generate([prompt], seeded)[0].outputs[0].text
    others = [SamplingParams(temperature=1.0, max_tokens=20), GREEDY,
              SamplingParams(temperature=0.7, top_k=20, max_tokens=40)]
    batch = ["Write a poem about the sea.", prompt, "1, 2, 3,", "请介绍一下上海。"]
    params = [others[0], seeded, others[1], others[2]]
    mixed = llm.generate(batch, params)[1].outputs[0].text
    assert alone == mixed
    assert llm.generate([prompt], SamplingParams(temperature=0.9, top_p=0.95, seed=99,
                                                 max_tokens=32))[0].outputs[0].text != alone


def test_n_copies_share_prompt_blocks_and_differ(make_llm, tokenizer):
    llm = make_llm()
    prompt_ids = tokenizer.encode(source_text(600))
    engine = llm.engine
    engine.add_request("shared", {"prompt_token_ids": prompt_ids},
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8))
    engine.step()
    tables = [engine.scheduler.kv_cache_manager.get_block_ids(f"{i}_shared")[0] for i in range(3)]
    num_full = len(prompt_ids) // 16
    assert tables[0][:num_full] == tables[1][:num_full] == tables[2][:num_full]
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1


def test_stop_strings_and_stop_tokens(make_llm, tokenizer):
    llm = make_llm()
    free = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=24))[0]
    text = free.outputs[0].text
    assert " 5," in text, text
    stopped = llm.generate(["Count: 1, 2, 3,"],
                           SamplingParams(temperature=0, max_tokens=24, stop=[" 5,"]))[0]
    out = stopped.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 5,"
    assert out.text == text[: text.index(" 5,")]
    first_token = free.outputs[0].token_ids[2]
    by_token = llm.generate(["Count: 1, 2, 3,"], SamplingParams(
        temperature=0, max_tokens=24, stop_token_ids=[first_token]))[0].outputs[0]
    assert by_token.token_ids == free.outputs[0].token_ids[:3]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == first_token


def test_streaming_chinese_deltas_are_clean(make_llm):
    llm = make_llm()
    engine = llm.engine
    engine.add_request("zh", "请用中文介绍一下长城的历史。",
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       output_kind=OutputKind.DELTA)
    deltas, final_ids = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].text)
            final_ids += out.outputs[0].token_ids
    full_text = llm.get_tokenizer().decode(final_ids, skip_special_tokens=True)
    assert "".join(deltas) == full_text
    # A character is only streamed once all its bytes arrived; only the final flush may carry
    # the replacement character, and only when the generation stopped mid-character.
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert ("\ufffd" in deltas[-1]) == full_text.endswith("\ufffd")
    assert any("\u4e00" <= ch <= "\u9fff" for ch in "".join(deltas))


def test_logprobs_and_prompt_logprobs(make_llm, tokenizer):
    prompt = tokenizer.encode(source_text(900))
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    # The exact mode: 64-token chunks attend in another summation order than the whole prompt
    # (equal to ~1e-6, not bitwise), which quantized activations can turn into ~1e-3 steps
    # (an int8 head did); what this checks is which positions and tokens the logprobs belong to.
    exact = {"activation_quantization": "none"}
    chunked = make_llm(max_num_batched_tokens=64, max_num_seqs=8, **exact).generate(
        [{"prompt_token_ids": prompt}], params)[0]
    whole = make_llm(**exact).generate([{"prompt_token_ids": prompt}], params)[0]
    assert chunked.prompt_logprobs[0] is None and len(chunked.prompt_logprobs) == len(prompt)
    for a, b in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for token_id in a:
            assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=1e-3)
    for position, logprobs in zip(chunked.outputs[0].token_ids, chunked.outputs[0].logprobs):
        assert 3 <= len(logprobs) <= 4 and position in logprobs
        assert logprobs[position].rank == 1  # greedy picks the top token


def test_priority_runs_lower_value_first(make_llm):
    llm = make_llm(max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=2)
    outputs = llm.generate(["a b c", "d e f", "g h i"], params, priority=[5, 0, 1])
    order = sorted(outputs, key=lambda o: o.metrics.first_token_time)
    assert [o.prompt for o in order] == ["d e f", "g h i", "a b c"]


BAD_PROMPTS = [
    ("", "prompt must not be empty"),
    ([], "prompt must not be empty"),
    ([1, 2, 49152], "outside the vocabulary"),
    ([1, -1], "outside the vocabulary"),
    ([1, 2.5], "integers"),
    ("x " * 900, "context length"),
]


def test_bad_prompts_are_rejected_and_others_keep_running(make_llm):
    llm = make_llm(max_model_len=512)
    engine = llm.engine
    engine.add_request("good", "Tell me a story.",
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    for prompt, needle in BAD_PROMPTS:
        with pytest.raises(ValueError, match=needle):
            engine.add_request("bad", prompt, GREEDY)
        engine.check_integrity()
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("bad", "hi", SamplingParams(logit_bias={49152: 1.0}))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["good"]
    assert len(outputs[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_abort_frees_blocks(make_llm):
    llm = make_llm()
    engine = llm.engine
    engine.add_request("long", "Write a long essay about rivers.",
                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.add_request("short", "Hi", SamplingParams(temperature=0, max_tokens=4))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.kv_cache_manager.usage > 0
    engine.abort_request("long")
    while engine.has_unfinished_requests():
        engine.step()
    engine.assert_idle()
