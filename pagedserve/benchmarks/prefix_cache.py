"""--compare-no-prefix-cache of `bench throughput`: the founding document's method for document
QA. Each document's first questions, then the repeats, run by an engine without the prefix cache
and then by a fresh one with it; the table compares the same prompts in the same batch."""

from __future__ import annotations

import argparse
import gc
import os
from typing import Any

from pagedserve.benchmarks.datasets import (
    make_workload,
    num_questions_per_doc,
    split_first_questions,
)
from pagedserve.benchmarks.serve import safe_div
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm import LLM

PREFIX_CACHE_RUNS = (
    # (result key, table column)
    ("cache_off_first", "off: first"),
    ("cache_off_repeats", "off: repeats"),
    ("cache_on_first", "on: first"),
    ("cache_on_repeats", "on: repeats"),
)


def compare_prefix_cache(args: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    """--compare-no-prefix-cache: the doc-qa workload with the prefix cache off and on.

    The workload splits into each document's first question and the repeats; each engine runs
    the first questions, then (without a reset) the repeats, as two timed batches:

        engine                          | first questions        | repeats
        cache off (and no KV tier)      | every token computed   | every token computed
        cache on, fresh                 | cold: every token      | warm: the documents cached

    So each "on" batch compares with the "off" batch of the same prompts and batch size. The
    "off" engine is freed before the "on" one is made. Any other engine flag (--kv-cache-dtype,
    --kv-transfer-config, a smaller --kv-cache-memory) applies to the "on" engine.
    NOTE: a KV tier that persists between invocations (a disk or Redis store) may already hold
    the documents; "on: first" then shows cached tokens and is not cold.
    """
    from pagedserve.benchmarks.throughput import (
        _config,
        refuse_other_run_flags,
        run_pagedserve,
    )

    if args.dataset != "doc-qa" or args.chat_prompt:
        raise ValueError("--compare-no-prefix-cache needs --dataset doc-qa")
    if not engine_args.enable_prefix_caching:
        raise ValueError("--compare-no-prefix-cache compares against the prefix cache: drop "
                         "--no-enable-prefix-caching")
    refuse_other_run_flags(args, "--compare-no-prefix-cache")
    if num_questions_per_doc(args) < 2:
        raise ValueError("--compare-no-prefix-cache needs --questions-per-doc >= 2")
    load_average_start = os.getloadavg()[0]
    engine_kwargs = {
        # Off means off: no KV tier either (one that saves would warm it for the "on" engine).
        "off": {**vars(engine_args), "enable_prefix_caching": False, "kv_transfer_config": None},
        "on": vars(engine_args),
    }
    runs: dict[str, dict[str, Any]] = {}
    output_ids: dict[str, list[list[int]]] = {}
    for cache, kwargs in engine_kwargs.items():
        llm = LLM(**kwargs)
        if cache == "off":
            model_path, dtype = llm.engine.config.model_path, llm.engine.config.device.dtype
            workload = make_workload(args, llm.get_tokenizer().vocab_size)
            first, repeats = split_first_questions(workload, args.num_docs)
        for name, batch in (("first", first), ("repeats", repeats)):
            key = f"cache_{cache}_{name}"
            runs[key], output_ids[key] = run_pagedserve(llm, batch, cold=name == "first")
        llm.engine.shutdown()  # stops the worker processes, if any
        llm.engine.assert_idle()
        del llm  # free the KV pool before the next engine is made
        gc.collect()

    off_ids = output_ids["cache_off_first"] + output_ids["cache_off_repeats"]
    on_ids = output_ids["cache_on_first"] + output_ids["cache_on_repeats"]
    config = _config(args, engine_args, workload, model_path, dtype, load_average_start)
    config.update(questions_per_doc=num_questions_per_doc(args),
                  block_size=engine_args.block_size,
                  load_average_1min_end=os.getloadavg()[0])
    return {
        "config": config,
        "prefix_cache": {
            **runs,
            "cache_off_total": _totals(runs["cache_off_first"], runs["cache_off_repeats"]),
            "cache_on_total": _totals(runs["cache_on_first"], runs["cache_on_repeats"]),
            "repeats_on_vs_off": _on_vs_off(runs["cache_on_repeats"], runs["cache_off_repeats"]),
            "first_on_vs_off": _on_vs_off(runs["cache_on_first"], runs["cache_off_first"]),
            # Greedy both ways: cached KV must not change a token (fp32; bf16 may flip
            # near-ties, since a cached prefix was computed in another batch).
            "num_outputs_identical": sum(a == b for a, b in zip(off_ids, on_ids)),
            "num_outputs_compared": len(off_ids),
        },
    }


def _totals(*runs: dict[str, Any]) -> dict[str, Any]:
    """Counters summed over batches (timings do not add up across batches: see each batch)."""
    keys = ("num_requests", "num_prompt_tokens", "num_prompt_tokens_computed",
            "num_cached_tokens", "num_output_tokens", "elapsed_s")
    totals = {key: sum(run[key] for run in runs) for key in keys}
    totals["prefix_cache_hit_rate"] = safe_div(totals["num_cached_tokens"],
                                                totals["num_prompt_tokens"])
    return totals


def _on_vs_off(on: dict[str, Any], off: dict[str, Any]) -> dict[str, float | None]:
    """The same prompts in the same batch, cache on against off: > 1 is faster, < 1 less work."""
    return {
        "mean_ttft_speedup": safe_div(off["mean_ttft_s"], on["mean_ttft_s"]),
        "median_ttft_speedup": safe_div(off["median_ttft_s"], on["median_ttft_s"]),
        "p99_ttft_speedup": safe_div(off["p99_ttft_s"], on["p99_ttft_s"]),
        "output_tokens_per_s_ratio": safe_div(on["output_tokens_per_s"],
                                               off["output_tokens_per_s"]),
        "prompt_tokens_computed_ratio": safe_div(on["num_prompt_tokens_computed"],
                                                  off["num_prompt_tokens_computed"]),
    }


def format_prefix_cache_table(result: dict[str, Any]) -> str:
    config, compared = result["config"], result["prefix_cache"]
    rows = [
        ("prompts", "num_requests", "d"),
        ("prompt tokens", "num_prompt_tokens", "d"),
        ("prompt tokens computed", "num_prompt_tokens_computed", "d"),
        ("cached prompt tokens", "num_cached_tokens", "d"),
        ("prefix-cache hit rate", "prefix_cache_hit_rate", ".1%"),
        ("mean TTFT (ms)", "mean_ttft_s", "ms"),
        ("p50 TTFT (ms)", "median_ttft_s", "ms"),
        ("p99 TTFT (ms)", "p99_ttft_s", "ms"),
        ("output tokens/s", "output_tokens_per_s", ".1f"),
        ("mean time per output token (ms)", "mean_tpot_s", "ms"),
        ("total time (s)", "elapsed_s", ".2f"),
        ("preemptions", "num_preemptions", "d"),
    ]
    width, cell_width = 34, 14
    lines = [
        (f"model {os.path.basename(config['model_path'])}  dtype {config['dtype']}  dataset "
         f"doc-qa  {config['num_docs']} docs x {config['questions_per_doc']} questions  doc len "
         f"{config['doc_len']}  question len {config['question_len'] + config['quote_len']}  "
         f"output len {config['output_len']}  block size {config['block_size']}  threads "
         f"{config['num_threads']}  load avg {config['load_average_1min_start']:.2f} -> "
         f"{config['load_average_1min_end']:.2f}"),
        ("prefix cache off, then a fresh engine with it on; each runs the first questions "
         "(one per document), then the repeats"),
        f"{'':<{width}}" + "".join(f"{label:>{cell_width}}" for _, label in PREFIX_CACHE_RUNS),
    ]
    for label, key, fmt in rows:
        cells = []
        for run_key, _ in PREFIX_CACHE_RUNS:
            value = compared[run_key].get(key)
            if value is not None and fmt == "ms":
                value, fmt_used = value * 1000, ".1f"
            else:
                fmt_used = fmt
            cells.append("-" if value is None else format(value, fmt_used))
        lines.append(f"{label:<{width}}" + "".join(f"{cell:>{cell_width}}" for cell in cells))
    lines.append(f"{'outputs identical, on vs off':<{width}}"
                 f"{compared['num_outputs_identical']:>{cell_width}} / "
                 f"{compared['num_outputs_compared']}")

    def ratio(value: float | None, suffix: str = "x") -> str:
        return "-" if value is None else f"{value:.2f}{suffix}"

    for label, key in (("repeats", "repeats_on_vs_off"), ("first questions", "first_on_vs_off")):
        r = compared[key]
        lines.append(
            f"cache on / off, {label}: TTFT {ratio(r['mean_ttft_speedup'])} faster (mean), "
            f"{ratio(r['median_ttft_speedup'])} (p50), {ratio(r['p99_ttft_speedup'])} (p99); "
            f"output tokens/s {ratio(r['output_tokens_per_s_ratio'])}; prompt tokens computed "
            f"{ratio(r['prompt_tokens_computed_ratio'])}")
    if compared["cache_on_first"]["num_cached_tokens"]:
        lines.append("NOTE: the first questions found cached tokens with the cache on (a KV tier "
                     "kept from an earlier run?): that batch was not cold")
    return "\n".join(lines)
