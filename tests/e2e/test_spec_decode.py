"""Speculative decoding (n-gram) on the real default model: it acted (drafts were accepted), and
the output is what the plain engine gives: greedy token for token, seeded sampling reproducibly,
with chunked prefill, prefix caching, preemption, n > 1, stop strings, penalties and logprobs."""

from __future__ import annotations

import pytest

from pagedserve.sampling_params import SamplingParams
from tests.e2e.spec_helpers import (
    assert_spec_run_exercised_everything,
    record_schedules,
    stop_string_params,
)
from tests.prompts import _CHINESE_TEXT, _ENGLISH_STORY, source_text

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

_MANUAL = (
    "To reset the router, hold the reset button for ten seconds until the light blinks amber. "
    "The router then restarts with factory settings: the network name is printed on the label "
    "and the password is the serial number. To update the firmware, open the admin page, choose "
    "System, then Update, and select the file you downloaded. Never unplug the router during an "
    "update, or it may no longer start. "
)
DOCUMENTS = [_ENGLISH_STORY, _MANUAL, source_text(900), _CHINESE_TEXT * 2]


def doc_qa_prompts(tokenizer, count: int = 20) -> list[dict]:
    """Document-QA prompts whose questions quote the document, so the answers repeat it."""
    prompts = []
    for index in range(count):
        document = DOCUMENTS[index % len(DOCUMENTS)]
        start = (index // len(DOCUMENTS)) * len(document) // 6
        quote = document[start : start + 60]
        question = (f"\n\nQuestion: the text above says \"{quote}\". Quote the sentence that "
                    "comes right after it, word for word.\nAnswer:")
        prompts.append({"prompt_token_ids": tokenizer.encode(document + question)})
    return prompts


def texts_and_ids(outputs) -> list[list[tuple[str, list[int]]]]:
    return [[(c.text, c.token_ids) for c in o.outputs] for o in outputs]


def spec_stats(llm):
    return llm.engine.get_stats().spec_decoding


def test_greedy_with_ngram_equals_greedy_without(make_llm, tokenizer, plain_greedy_doc_qa):
    prompts = doc_qa_prompts(tokenizer, 20)
    plain = plain_greedy_doc_qa[:20]
    llm = make_llm(speculative_config=SPEC)
    spec = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = spec_stats(llm)
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    assert len(stats.acceptance_rate_per_pos) == 4 and stats.mean_acceptance_length > 1
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and some were rejected


def test_penalties_and_logprobs_with_ngram(make_llm, tokenizer):
    """Penalties must see the drafts accepted before each position; logprobs of every emitted
    token come from its own position. Eight prompts: penalties push the answers off the quoted
    text, and with four an accepted draft hung on one prompt (exact mode 6 of 70; none at all
    with int8 head activations); with eight 12-16 of ~140 were accepted in both."""
    prompts = doc_qa_prompts(tokenizer, 8)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, min_tokens=12,
                            repetition_penalty=1.1, frequency_penalty=0.2)
    plain = make_llm().generate(prompts, params)
    llm = make_llm(speculative_config=SPEC)
    spec = llm.generate(prompts, params)
    assert spec_stats(llm).num_accepted_tokens > 0
    for a, b in zip(plain, spec):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == len(b.token_ids)
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
        for pa, pb in zip(a.logprobs, b.logprobs):
            assert list(pa) == list(pb)


def test_seeded_sampling_with_ngram_is_reproducible(make_llm, tokenizer):
    prompts = doc_qa_prompts(tokenizer, 4)
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=100 + i, max_tokens=32,
                             ignore_eos=True) for i in range(len(prompts))]
    first_llm = make_llm(speculative_config=SPEC)
    first = texts_and_ids(first_llm.generate(prompts, seeded))
    assert spec_stats(first_llm).num_accepted_tokens > 0
    # Again, in a fresh engine, with other requests in the batch and another engine seed.
    llm = make_llm(speculative_config=SPEC, seed=5)
    others = doc_qa_prompts(tokenizer, 7)[4:]
    batch_params = seeded + [SamplingParams(temperature=1.0, max_tokens=20)] * len(others)
    again = texts_and_ids(llm.generate(prompts + others, batch_params))[: len(prompts)]
    assert again == first


def test_ngram_with_chunking_caching_preemption_n2_and_stop_strings(make_llm, tokenizer,
                                                                   plain_greedy_doc_qa):
    prompts = doc_qa_prompts(tokenizer, 6)
    # A stop string from the middle of each plain output (where one is printable).
    params = stop_string_params(plain_greedy_doc_qa[:6])
    plain = make_llm(enable_chunked_prefill=False, enable_prefix_caching=False).generate(
        prompts, params)

    # 40 blocks of 16 = 640 tokens: room for any one sequence, not for 12 at once.
    llm = make_llm(speculative_config=SPEC, max_num_batched_tokens=64, max_num_seqs=16,
                   num_gpu_blocks_override=41, max_model_len=640)
    schedules = record_schedules(llm)
    spec = llm.generate(prompts, params)

    assert_spec_run_exercised_everything(llm, schedules)
    num_stopped = 0
    for a, b in zip(plain, spec):
        for ca, cb in zip(a.outputs, b.outputs):
            assert (cb.text, cb.finish_reason, cb.stop_reason) == (
                ca.text, ca.finish_reason, ca.stop_reason)
            # Token ids too: a stop string completed inside a multi-token step drops the
            # accepted tokens after it.
            assert cb.token_ids == ca.token_ids
            num_stopped += ca.finish_reason == "stop"
    assert num_stopped >= 3


def test_spec_decode_metrics_appear_and_move(make_llm, tokenizer):
    """Through the serving path: AsyncLLM's engine loop feeds the Prometheus logger after every
    step; the spec_decode counters equal the scheduler's and grow with a second request."""
    import asyncio
    import time

    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.metrics import PrometheusStatLogger

    llm = make_llm(speculative_config=SPEC)
    stat_logger = PrometheusStatLogger("m", num_speculative_tokens=4)
    async_llm = AsyncLLM(llm.engine, [stat_logger])

    def scrape() -> dict[str, float]:
        samples = {}
        for family in text_string_to_metric_families(stat_logger.render().decode()):
            for sample in family.samples:
                position = sample.labels.get("position")
                samples[sample.name + (f"[{position}]" if position else "")] = sample.value
        return samples

    async def generate(prompt) -> None:
        async for _ in async_llm.generate(prompt, GREEDY):
            pass

    prompts = doc_qa_prompts(tokenizer, 2)
    try:
        before = scrape()
        assert before["vllm:spec_decode_num_drafts_total"] == 0
        history = []
        for prompt in prompts:
            asyncio.run(generate(prompt))
            stats = spec_stats(llm)  # the engine is idle now: final
            # The loop records stats after handing out the step's outputs: wait for that.
            deadline = time.monotonic() + 10
            while (scrape()["vllm:spec_decode_num_drafts_total"] != stats.num_drafts
                   and time.monotonic() < deadline):
                time.sleep(0.01)
            history.append((scrape(), stats))
    finally:
        asyncio.run(async_llm.shutdown(drain_timeout=0))
    (first, first_stats), (second, second_stats) = history
    for samples, stats in history:
        assert samples["vllm:spec_decode_num_drafts_total"] == stats.num_drafts
        assert samples["vllm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
        assert (samples["vllm:spec_decode_num_accepted_tokens_total"]
                == stats.num_accepted_tokens)
        assert [samples[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{pos}]"]
                for pos in range(4)] == stats.num_accepted_tokens_per_pos
        assert (samples["pagedserve:spec_decode_mean_acceptance_length"]
                == stats.mean_acceptance_length)
    assert 0 < first["vllm:spec_decode_num_accepted_tokens_total"] < (
        second["vllm:spec_decode_num_accepted_tokens_total"])
    assert first["vllm:spec_decode_num_drafts_total"] < (
        second["vllm:spec_decode_num_drafts_total"])
