"""Draft-model speculative decoding on the real default model, with a self-draft: SmolLM2's own
first 26 of 30 layers (+ final norm and head) guess, the full model verifies.

Each test first shows the draft acted (guesses accepted, and some rejected, so rollback ran),
then that the output is the plain engine's token for token; and the draft's own KV pool is
checked consistent throughout and empty at the end (the make_llm fixture's teardown).
"""

from __future__ import annotations

import random

from pagedserve.sampling_params import SamplingParams
from tests.e2e.spec_helpers import (
    assert_spec_run_exercised_everything,
    record_schedules,
    stop_string_params,
)
from tests.e2e.test_spec_decode import GREEDY, doc_qa_prompts, spec_stats

# 26 layers: on these prompts ~30% of guesses are accepted (8 layers: none; 30: all).
SELF_DRAFT = {"method": "draft_model", "model": "self", "draft_num_layers": 26,
              "num_speculative_tokens": 4}


def draft_kv(llm):
    return llm.engine.executor.worker.model_runner.proposer.kv


def test_greedy_with_self_draft_equals_greedy_without(make_llm, tokenizer, plain_greedy_doc_qa):
    # 10 prompts, not the n-gram test's 20: each self-draft step costs ~4.5 target passes here.
    prompts = doc_qa_prompts(tokenizer, 10)
    plain = plain_greedy_doc_qa[:10]
    llm = make_llm(speculative_config=SELF_DRAFT)
    spec = llm.generate(prompts, GREEDY)
    stats = spec_stats(llm)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.mean_acceptance_length > 1
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert draft_kv(llm).num_held_blocks == 0 and not draft_kv(llm).requests


def test_self_draft_with_chunking_caching_preemption_n2_stop_strings_and_mixed_batch(
    make_llm, tokenizer, plain_greedy_doc_qa
):
    """Greedy requests (n = 2, some with a stop string) next to requests that never get drafts
    (max_tokens 1) and seeded sampled ones, on a KV pool too small for all: preemption, prompt
    chunks beside verification steps, prefix-cache hits between the n = 2 copies."""
    prompts = doc_qa_prompts(tokenizer, 6)
    params = stop_string_params(plain_greedy_doc_qa[:6])
    params += [SamplingParams(temperature=0, max_tokens=1)] * 2
    params += [SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)] * 2
    prompts = prompts + prompts[:2] + prompts[2:4]
    plain = make_llm(enable_chunked_prefill=False, enable_prefix_caching=False).generate(
        prompts, params)

    # 40 blocks of 16 = 640 tokens: room for any one sequence, not for all at once.
    llm = make_llm(speculative_config=SELF_DRAFT, max_num_batched_tokens=64, max_num_seqs=16,
                   num_gpu_blocks_override=41, max_model_len=640)
    schedules = record_schedules(llm)
    spec = llm.generate(prompts, params)

    assert_spec_run_exercised_everything(llm, schedules)
    num_stopped = 0
    for a, b, p in zip(plain, spec, params):
        if p.temperature > 0:
            assert len(b.outputs[0].token_ids) == 16  # sampled: other draws, same length
            continue
        for ca, cb in zip(a.outputs, b.outputs):
            assert (cb.text, cb.token_ids, cb.finish_reason, cb.stop_reason) == (
                ca.text, ca.token_ids, ca.finish_reason, ca.stop_reason)
            num_stopped += ca.finish_reason == "stop"
    assert num_stopped >= 3


def test_draft_kv_tracks_the_target_through_random_accepts_rejects_and_aborts(make_llm, tokenizer):
    """Sampled requests accept and reject guesses at random. After every step: the draft pool is
    consistent, and each request's draft KV holds exactly its tokens so far plus the guesses it
    fed itself (d0 .. d(k-2)). Aborting requests midway frees their draft KV."""
    llm = make_llm(speculative_config=SELF_DRAFT, max_num_batched_tokens=128, max_num_seqs=8)
    engine, runner = llm.engine, llm.engine.executor.worker.model_runner
    proposer = runner.proposer
    proposals: dict[str, list[int]] = {}
    original_propose = proposer.propose_batch

    def recording_propose(contexts):
        result = original_propose(contexts)
        proposals.update(result)
        return result

    proposer.propose_batch = recording_propose
    rng = random.Random(0)
    prompts = doc_qa_prompts(tokenizer, 6)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.5]), top_p=rng.choice([1.0, 0.9]),
            seed=index, max_tokens=rng.randint(8, 28), ignore_eos=True))
    num_steps = num_checked = 0
    aborted = set()
    while engine.has_unfinished_requests():
        proposals.clear()
        engine.step()
        num_steps += 1
        engine.check_integrity()
        proposer.check_integrity()
        for req_id, drafts in proposals.items():
            if req_id in proposer.kv.requests:  # not finished and released in this step
                expected = runner.requests[req_id].token_ids + drafts[:-1]
                assert proposer.kv.requests[req_id].kv_token_ids == expected
                num_checked += 1
        if num_steps == 4:  # abort two running requests mid-decode
            running = [r.request_id for r in engine.scheduler.running][:2]
            assert all(r in proposer.kv.requests for r in running)
            engine.abort_request(running)
            aborted.update(running)
            engine.step()
            assert not aborted & set(proposer.kv.requests)
    stats = spec_stats(llm)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(aborted) == 2 and num_checked > 10
    assert proposer.num_requests == 0 and proposer.kv.num_held_blocks == 0
