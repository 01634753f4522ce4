"""`pagedserve bench perplexity` on the real default model, parsed from CLI flags and run
in-process: the exact engine measured against itself drifts by nothing, and bf16 with int8
activations (the default) drifts but keeps its perplexity near the exact one.

The engines are built by the `make_llm` fixture (session-shared weights; each checked idle on
teardown).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest
import torch

from pagedserve.benchmarks import perplexity
from pagedserve.models.loader import DEFAULT_MODEL

TEXT = pathlib.Path(__file__).parent.parent / "data" / "gettysburg_address.txt"


@pytest.fixture
def run_bench(make_llm, monkeypatch):
    """run_bench(*cli_flags) -> main()'s result, on one torch thread (restored afterwards)."""
    num_threads = torch.get_num_threads()
    built = []

    def llm_over_shared_weights(**engine_kwargs):
        assert engine_kwargs.pop("model") == DEFAULT_MODEL
        built.append(engine_kwargs)
        return make_llm(**engine_kwargs)

    monkeypatch.setattr(perplexity, "LLM", llm_over_shared_weights)

    def run(*flags: str) -> dict:
        parser = argparse.ArgumentParser()
        perplexity.add_cli_args(parser)
        return perplexity.main(parser.parse_args(
            ["--text", str(TEXT), "--window", "64", "--max-tokens", "200",
             "--kv-cache-memory", "64MiB", "--num-threads", "1", *flags]))

    run.built = built
    yield run
    torch.set_num_threads(num_threads)


def test_exact_engine_against_itself_drifts_by_nothing(run_bench, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    result = run_bench("--dtype", "float32", "--activation-quantization", "none",
                       "--output-json", str(out))
    # 200 tokens in windows of 64, 63 + 63 + 63 + 7 scored: every token but each window's first
    assert (result["windows"], result["tokens_scored"]) == (4, 196)
    assert result["perplexity"] > 1
    assert result["mean_abs_logprob_drift"] == 0.0
    assert result["perplexity"] == result["exact_perplexity"]
    # the reference is the exact engine: fp32, unquantized activations
    assert [(b["dtype"], b["activation_quantization"]) for b in run_bench.built] == [
        ("float32", "none"), ("float32", "none")]
    assert json.loads(out.read_text()) == result
    assert "perplexity against exact      +0.00%" in capsys.readouterr().out


def test_default_engine_drifts_from_the_exact_one(run_bench):
    result = run_bench("--dtype", "bfloat16", "--reference", "exact")
    assert run_bench.built[1]["dtype"] == "float32"
    assert result["mean_abs_logprob_drift"] > 0
    # bf16 int8's drift is bounded on the real model (tests/models/test_quantized_model.py);
    # here only that the measurement is the same kind of number
    assert abs(result["perplexity_vs_exact"]) < 0.05, result


def test_reference_none_scores_one_engine(run_bench):
    result = run_bench("--dtype", "float32", "--reference", "none")
    assert len(run_bench.built) == 1 and "exact_perplexity" not in result


def test_windows_drop_a_lone_last_token():
    assert perplexity.windows(list(range(9)), 4, 9) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert perplexity.windows(list(range(10)), 4, 100) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="at least 2"):
        perplexity.windows([1, 2, 3], 1, 10)
