"""The throughput benchmark end to end on the real default model, with a tiny workload:
parsed from CLI flags, run in-process, its result dict checked for sane numbers.

The benchmark's LLM is built by the `make_llm` fixture: session-shared weights, and the engine is
checked idle (no KV blocks held) on teardown.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pagedserve.benchmarks import activation_modes, hybrid_kv, prefix_cache, throughput
from pagedserve.models.loader import DEFAULT_MODEL
from tests.shared_engines import SUITE_ACTIVATION_QUANTIZATION


@pytest.fixture
def run_bench(make_llm, monkeypatch):
    """run_bench(*cli_flags) -> main()'s result, on one torch thread (restored afterwards).

    NOTE: one thread because on a small shared CPU, threads that wait on each other's cores make
    a tiny model many times slower; the numbers are not what this test checks.
    """
    num_threads = torch.get_num_threads()

    def llm_over_shared_weights(**engine_kwargs):
        assert engine_kwargs.pop("model") == DEFAULT_MODEL
        return make_llm(**engine_kwargs)

    monkeypatch.setattr(throughput, "LLM", llm_over_shared_weights)
    monkeypatch.setattr(hybrid_kv, "LLM", llm_over_shared_weights)
    monkeypatch.setattr(activation_modes, "LLM", llm_over_shared_weights)
    monkeypatch.setattr(prefix_cache, "LLM", llm_over_shared_weights)

    def run(*flags: str) -> dict:
        parser = argparse.ArgumentParser()
        throughput.add_cli_args(parser)
        # the suite's activations (tests/shared_engines.py): the feature-on/off comparisons
        # hold summation-order variants to the same greedy tokens (a test may override it)
        return throughput.main(parser.parse_args(
            ["--dtype", "float32", "--kv-cache-memory", "256MiB", "--num-threads", "1",
             "--activation-quantization", SUITE_ACTIVATION_QUANTIZATION, *flags]
        ))

    yield run
    torch.set_num_threads(num_threads)


def check_ours(result: dict, num_prompts: int, output_len: int) -> dict:
    ours = result["pagedserve"]
    assert result["config"]["num_prompts"] == ours["num_requests"] == num_prompts
    assert ours["num_output_tokens"] == num_prompts * output_len
    assert ours["num_generation_tokens"] == num_prompts * output_len
    for key in ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
                "mean_ttft_s", "mean_tpot_s", "prefill_tokens_per_s", "decode_tokens_per_s"):
        assert ours[key] > 0, (key, ours[key])
    # Whatever the cache did not supply was computed, exactly once (no preemptions here).
    assert ours["num_preemptions"] == 0
    assert ours["prefix_cache_queries"] == ours["num_prompt_tokens"]
    num_uncached = ours["num_prompt_tokens"] - ours["prefix_cache_hits"]
    assert ours["num_prompt_tokens_computed"] == num_uncached
    assert ours["num_cached_tokens"] == ours["prefix_cache_hits"]
    return ours


@pytest.mark.slow
def test_random_dataset_with_hf_baseline(run_bench, tmp_path, capsys):
    pytest.importorskip("transformers")
    json_path = tmp_path / "result.json"
    # (the suite's int16 activations: fp32's default int8 parts from HF at the near-ties of
    # random prompts)
    result = run_bench("--num-prompts", "4", "--input-len", "16", "--output-len", "8",
                       "--baseline", "hf", "--output-json", str(json_path))
    ours = check_ours(result, num_prompts=4, output_len=8)
    assert ours["num_prompt_tokens"] == 4 * 16
    assert ours["prefix_cache_hits"] == 0  # random prompts share nothing
    hf = result["hf"]
    assert hf["num_output_tokens"] == 4 * 8  # min_new_tokens: nobody stops early
    assert hf["output_tokens_per_s"] > 0 and hf["batch_size"] == 4
    assert hf["weight_dtypes"] == ["float32"]  # a dense model in our dtype, as ours is
    assert result["output_tokens_per_s_ratio"] == pytest.approx(
        ours["output_tokens_per_s"] / hf["output_tokens_per_s"])
    # Greedy fp32 on the same weights: left padding must not change HF's answers.
    assert hf["num_outputs_identical_to_ours"] >= 3
    assert json.loads(json_path.read_text())["pagedserve"]["num_output_tokens"] == 32
    assert "output tokens/s ratio" in capsys.readouterr().out


@pytest.mark.slow
def test_doc_qa_dataset_hits_the_prefix_cache(run_bench):
    result = run_bench("--dataset", "doc-qa", "--num-docs", "2", "--doc-len", "64",
                       "--questions-per-doc", "2", "--question-len", "8", "--output-len", "8")
    ours = check_ours(result, num_prompts=4, output_len=8)
    assert result["hf"] is None
    assert ours["num_prompt_tokens"] == 4 * (64 + 8)
    # Each 64-token document (4 blocks) is computed once; the second question reuses it.
    assert ours["prefix_cache_hits"] == 2 * 64


def test_workload_is_deterministic_and_avoids_special_ids():
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    args = parser.parse_args(["--num-prompts", "3", "--input-len", "50", "--seed", "7"])
    first = throughput.make_workload(args, vocab_size=1000)
    assert first == throughput.make_workload(args, vocab_size=1000)
    ids = [i for prompt in first.prompt_token_ids for i in prompt]
    assert len(set(map(tuple, first.prompt_token_ids))) == 3
    assert 100 <= min(ids) and max(ids) < 900

    args = parser.parse_args(["--dataset", "doc-qa", "--num-docs", "2", "--doc-len", "20",
                              "--question-len", "5", "--num-prompts", "6"])
    prompts = throughput.make_workload(args, vocab_size=1000).prompt_token_ids
    assert len(prompts) == 6 and all(len(p) == 25 for p in prompts)
    # Interleaved across documents: d0, d1, d0, d1, ...
    assert prompts[0][:20] == prompts[2][:20] != prompts[1][:20] == prompts[3][:20]


def test_doc_qa_questions_can_quote_their_document():
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    args = parser.parse_args(["--dataset", "doc-qa", "--num-docs", "2", "--doc-len", "40",
                              "--question-len", "5", "--quote-len", "12", "--num-prompts", "4"])
    prompts = throughput.make_workload(args, vocab_size=1000).prompt_token_ids
    assert all(len(p) == 40 + 5 + 12 for p in prompts)
    for prompt in prompts:
        doc, quote = prompt[:40], prompt[-12:]
        assert any(doc[i : i + 12] == quote for i in range(40 - 12 + 1))


@pytest.mark.slow
def test_speculative_run_against_no_speculation_in_one_invocation(run_bench, capsys):
    """--compare-no-spec: the same engine without speculation on the same prompts; greedy
    outputs identical; the acceptance figures and the speedup are reported."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    result = run_bench("--dataset", "doc-qa", "--num-docs", "2", "--doc-len", "96",
                       "--questions-per-doc", "1", "--question-len", "8", "--quote-len", "16",
                       "--output-len", "12", "--speculative-config", spec, "--compare-no-spec")
    ours = check_ours(result, num_prompts=2, output_len=12)
    no_spec = result["no_spec"]
    assert no_spec["num_output_tokens"] == 2 * 12 and no_spec["spec_decode"] is None
    assert no_spec["num_outputs_identical_to_ours"] == 2
    figures = ours["spec_decode"]
    assert figures["num_drafts"] > 0 and 0 < figures["num_accepted_tokens"]
    assert len(figures["acceptance_rate_per_pos"]) == 3
    assert figures["mean_acceptance_length"] > 1
    assert result["spec_speedup"]["output_tokens_per_s"] == pytest.approx(
        ours["output_tokens_per_s"] / no_spec["output_tokens_per_s"])
    out = capsys.readouterr().out
    assert "spec: mean accepted length" in out and "speedup spec / no spec" in out


@pytest.mark.slow
def test_prefix_cache_off_then_on_in_one_invocation(run_bench, tmp_path, capsys):
    """--compare-no-prefix-cache: exact computed-token figures for each of the four batches,
    and greedy fp32 outputs identical with the cache on and off."""
    num_docs, questions_per_doc, doc_len, question_len = 2, 3, 100, 8
    json_path = tmp_path / "result.json"
    result = run_bench("--dataset", "doc-qa", "--num-docs", str(num_docs), "--doc-len",
                       str(doc_len), "--questions-per-doc", str(questions_per_doc),
                       "--question-len", str(question_len), "--output-len", "4",
                       "--compare-no-prefix-cache", "--output-json", str(json_path))
    compared = result["prefix_cache"]
    block_size = result["config"]["block_size"]
    prompt_len = doc_len + question_len
    num_repeats = num_docs * (questions_per_doc - 1)
    # A repeat hits its document's full blocks (96 of 100 tokens); the block holding the
    # document's tail and the question is the question's own.
    cached_per_repeat = doc_len // block_size * block_size
    expected = {  # run: (prompts, computed, cached)
        "cache_off_first": (num_docs, num_docs * prompt_len, 0),
        "cache_off_repeats": (num_repeats, num_repeats * prompt_len, 0),
        "cache_on_first": (num_docs, num_docs * prompt_len, 0),
        "cache_on_repeats": (num_repeats, num_repeats * (prompt_len - cached_per_repeat),
                             num_repeats * cached_per_repeat),
    }
    for key, (num_prompts, num_computed, num_cached) in expected.items():
        run = compared[key]
        assert run["num_requests"] == num_prompts, key
        assert run["num_prompt_tokens"] == num_prompts * prompt_len, key
        assert run["num_prompt_tokens_computed"] == num_computed, key
        assert run["num_cached_tokens"] == run["prefix_cache_hits"] == num_cached, key
        assert run["prefix_cache_hit_rate"] == num_cached / (num_prompts * prompt_len), key
        assert run["num_output_tokens"] == num_prompts * 4 and run["num_preemptions"] == 0
        assert 0 < run["mean_ttft_s"] and run["median_ttft_s"] <= run["p99_ttft_s"]
    assert compared["cache_on_repeats"]["num_prompt_tokens_computed"] == num_repeats * 12
    assert compared["cache_off_total"]["num_prompt_tokens_computed"] == 6 * prompt_len
    assert compared["cache_on_total"]["num_cached_tokens"] == num_repeats * cached_per_repeat
    assert compared["num_outputs_identical"] == compared["num_outputs_compared"] == 6
    repeats = compared["repeats_on_vs_off"]
    assert repeats["prompt_tokens_computed_ratio"] == pytest.approx(12 / prompt_len)
    assert repeats["output_tokens_per_s_ratio"] == pytest.approx(
        compared["cache_on_repeats"]["output_tokens_per_s"]
        / compared["cache_off_repeats"]["output_tokens_per_s"])
    assert compared["first_on_vs_off"]["prompt_tokens_computed_ratio"] == 1
    assert json.loads(json_path.read_text())["prefix_cache"]["num_outputs_identical"] == 6
    out = capsys.readouterr().out
    assert "outputs identical, on vs off" in out and "cache on / off, repeats" in out
    assert "not cold" not in out


@pytest.mark.parametrize("flags, message", [
    (["--num-prompts", "4"], "needs --dataset doc-qa"),
    (["--dataset", "doc-qa", "--questions-per-doc", "1"], "--questions-per-doc >= 2"),
    (["--dataset", "doc-qa", "--no-enable-prefix-caching"], "drop --no-enable-prefix-caching"),
    (["--dataset", "doc-qa", "--profile"], "without --profile"),
])
def test_prefix_cache_comparison_rejects_what_it_cannot_compare(flags, message):
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    with pytest.raises(ValueError, match=message):
        throughput.main(parser.parse_args(["--compare-no-prefix-cache", *flags]))


def test_chat_prompts_instead_of_a_dataset(run_bench, tokenizer):
    messages = ["Write hello world in Python.", "Name a prime number."]
    result = run_bench("--chat-prompt", messages[0], "--chat-prompt", messages[1],
                       "--output-len", "4")
    ours = result["pagedserve"]
    assert result["config"]["dataset"] == "chat-prompt" and ours["num_output_tokens"] == 2 * 4
    expected = sum(len(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": m}]), add_special_tokens=False)) for m in messages)
    assert ours["num_prompt_tokens"] == expected


@pytest.mark.slow
def test_structured_fraction_compares_constrained_and_not(run_bench, capsys):
    result = run_bench("--num-prompts", "4", "--input-len", "16", "--output-len", "8",
                       "--structured-fraction", "0.5")
    check_ours(result, num_prompts=4, output_len=8)
    structured = result["structured"]
    assert structured["num_constrained_requests"] == 2
    # The default schema cannot close within --output-len: same token counts as unconstrained.
    assert structured["num_output_tokens"] == 4 * 8
    assert structured["num_constrained_finished_early"] == 0
    assert structured["num_mask_steps"] >= 8 and structured["mask_ms_per_step"] > 0
    assert structured["output_tokens_per_s_ratio_to_unconstrained"] == pytest.approx(
        structured["output_tokens_per_s"] / structured["unconstrained_output_tokens_per_s"])
    assert "JSON-constrained" in capsys.readouterr().out


def test_constrained_rows_are_spread_evenly():
    assert throughput.constrained_rows(4, 0.5) == [True, False, True, False]
    assert sum(throughput.constrained_rows(32, 0.5)) == 16
    assert throughput.constrained_rows(3, 0.0) == [False] * 3
    assert throughput.constrained_rows(3, 1.0) == [True] * 3
    with pytest.raises(ValueError, match="structured-fraction"):
        throughput.constrained_rows(3, 1.5)


def test_event_stream_cost_is_measured_in_one_invocation(run_bench, capsys):
    """--compare-events: the batch with and without a timeline store subscribed, alternating;
    greedy outputs identical, a ratio per round."""
    result = run_bench("--num-prompts", "2", "--input-len", "24", "--output-len", "6",
                       "--compare-events", "2")
    events = result["events"]
    assert events["rounds"] == 2 and len(events["ratio_on_to_off_per_round"]) == 2
    assert all(ratio > 0 for ratio in events["ratio_on_to_off_per_round"])
    assert events["num_outputs_identical"] == events["num_outputs_compared"] == 4
    assert events["num_events"] > 0 and events["subscriber_seconds"] > 0
    assert 0 < events["measured_cost_share"] < 1
    assert "event stream observed vs not, 2 rounds" in capsys.readouterr().out


def test_hybrid_kv_comparison_runs_on_a_model_without_windows(run_bench, capsys):
    """--compare-no-hybrid-kv on a model with one KV cache group (no sliding windows): both
    engines hold the same blocks and give the same greedy outputs. (It called _config wrongly
    and raised, untested, until this test. Windowed models' KV groups: tests/models/test_gemma3.py.)
    """
    result = run_bench("--num-prompts", "2", "--input-len", "32", "--output-len", "8",
                       "--compare-no-hybrid-kv")
    compared = result["hybrid_kv"]
    assert result["config"]["dtype"] == "float32"
    for key in ("one_group", "per_layer_group"):
        run = compared[key]
        assert run["kv_cache_group_windows"] == [None] and run["window_freed_blocks"] == 0
        assert run["peak_used_blocks"] > 0 and run["output_tokens_per_s"] > 0
    assert compared["peak_kv_bytes_ratio"] == compared["final_kv_bytes_ratio"] == 1.0
    assert compared["same_outputs"]
    assert "greedy outputs equal" in capsys.readouterr().out


def test_activation_modes_compared_in_turns(run_bench, capsys):
    """--compare-activation-quantization: both engines loaded, three runs each in turn, the
    ratios those of the medians; in fp32 auto is int8 where the integer kernel is vectorized."""
    result = run_bench("--num-prompts", "2", "--input-len", "32", "--output-len", "8",
                       "--activation-quantization", "auto",
                       "--compare-activation-quantization", "int16")
    compared = result["activation_quantization"]
    assert compared["modes"] == {"ours": "auto", "other": "int16"}
    vectorized = compared["activation_bits"]["ours"] == 8
    assert compared["activation_bits"]["other"] == 16
    assert compared["activation_bits"]["ours"] in (8, 32)  # 32: the exact mode (not vectorized)
    for key in ("ours", "other"):
        runs = compared["runs"][key]
        assert len(runs) == activation_modes.ROUNDS
        assert all(run["num_output_tokens"] == 2 * 8 and run["prefix_cache_hits"] == 0
                   for run in runs)  # every run cold, all its tokens generated
        median = compared["medians"][key]["output_tokens_per_s"]
        assert median == sorted(run["output_tokens_per_s"] for run in runs)[1]
    assert compared["ratios"]["output_tokens_per_s"] == pytest.approx(
        compared["medians"]["ours"]["output_tokens_per_s"]
        / compared["medians"]["other"]["output_tokens_per_s"])
    assert 0 <= compared["num_outputs_identical"] <= compared["num_outputs"] == 2
    out = capsys.readouterr().out
    assert "greedy outputs identical" in out and ("8-bit" in out or not vectorized)


@pytest.mark.parametrize("flags, message", [
    (["--activation-quantization", "auto", "--compare-activation-quantization", "auto"],
     "this run's own"),
    (["--compare-activation-quantization", "int8", "--profile"], "runs on its own, without --profile"),
])
def test_activation_mode_comparison_rejects_what_it_cannot_compare(run_bench, flags, message):
    with pytest.raises(ValueError, match=message):
        run_bench("--num-prompts", "1", *flags)


@pytest.mark.parametrize("flags, message", [
    (["--compare-no-hybrid-kv", "--compare-activation-quantization", "int8"],
     "--compare-no-hybrid-kv runs on its own, without --compare-activation-quantization"),
    (["--dataset", "doc-qa", "--compare-no-prefix-cache", "--compare-events", "2"],
     "--compare-no-prefix-cache runs on its own, without --compare-events"),
    (["--compare-activation-quantization", "int8", "--compare-events", "2", "--profile"],
     "--compare-activation-quantization runs on its own, without --compare-events, --profile"),
])
def test_a_standalone_comparison_refuses_every_other_run_flag(run_bench, flags, message):
    """The comparisons that run on their own name each other flag they would leave unrun (the
    hybrid-KV and prefix-cache ones used to skip the later --compare-* flags without a word)."""
    with pytest.raises(ValueError, match=message):
        run_bench("--num-prompts", "1", *flags)
