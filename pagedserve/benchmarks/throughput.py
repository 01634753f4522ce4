"""Offline throughput: every prompt submitted at once to LLM.generate, timed end to end.

Optionally runs Hugging Face transformers on the same GGUF and the same prompt token ids in the
same process (static batches, left padding) as a baseline. Knows nothing about the server.

    python -m pagedserve.benchmarks.throughput --num-prompts 32 --input-len 200 --output-len 128

With --structured-fraction F, the same batch runs twice, unconstrained and with a fraction F of
its requests JSON-constrained, and the table compares them (throughput ratio, mask ms per step).

With --compare-no-prefix-cache (doc-qa), the founding document's method for document QA: each
document's first questions, then the repeats, run by an engine without the prefix cache and then
by a fresh one with it (benchmarks/prefix_cache.py).

With --compare-no-hybrid-kv, a sliding-window model's KV held per request with KV managed per
layer group and with every block kept (benchmarks/hybrid_kv.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time
from typing import Any

import torch

from pagedserve.benchmarks.activation_modes import (
    compare_activation_quantization,
    format_activation_table,
)
from pagedserve.benchmarks.datasets import (
    NUM_SPECIAL_MARGIN,
    Workload,
    add_dataset_args,
    make_workload,
)
from pagedserve.benchmarks.event_cost import compare_events, format_events_comparison
from pagedserve.benchmarks.hybrid_kv import compare_hybrid_kv, format_hybrid_kv_table
from pagedserve.benchmarks.prefix_cache import (
    compare_prefix_cache,
    format_prefix_cache_table,
)
from pagedserve.benchmarks.serve import percentile, safe_div
from pagedserve.benchmarks.step_profile import format_profile, profile_steps
from pagedserve.config import ACTIVATION_QUANTIZATION_MODES
from pagedserve.core.stats import SpecDecodingStats
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.tokenizer import Tokenizer

WARMUP_PROMPT_LEN = 8
WARMUP_OUTPUT_LEN = 4


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Benchmark options plus every engine argument (--model, --dtype, --num-threads, --seed ...).

    --seed is the engine's; the prompt generator uses it too.
    """
    add_dataset_args(parser)
    group = parser.add_argument_group("baseline and output")
    group.add_argument("--baseline", choices=("none", "hf"), default="none",
                       help="hf: also run transformers generate() on the same prompts")
    group.add_argument("--hf-batch-size", type=int, default=None,
                       help="prompts per transformers generate() call (default: all)")
    group.add_argument("--chat-prompt", action="append", default=None, metavar="TEXT",
                       help="instead of --dataset: this user message in the model's chat "
                            "template (repeat the flag for several prompts)")
    group.add_argument("--compare-no-spec", action="store_true",
                       help="with --speculative-config: also run the same engine without "
                            "speculation (same weights, same prompts) and print the ratio")
    group.add_argument("--compare-one-process", action="store_true",
                       help="with --tensor/--pipeline-parallel-size > 1: also run the same "
                            "engine as one process (world size 1) and print the ratio")
    group.add_argument("--compare-no-prefix-cache", action="store_true",
                       help="with --dataset doc-qa: run each document's first question, then "
                            "the repeats, on an engine without the prefix cache and then on a "
                            "fresh one with it; report each batch and the ratios")
    group.add_argument("--compare-no-hybrid-kv", action="store_true",
                       help="run the workload with KV managed per layer group (the default) "
                            "and with one block table for every layer "
                            "(--disable-hybrid-kv-cache-manager); report the peak KV held per "
                            "request, throughput and whether the outputs agree")
    group.add_argument("--compare-activation-quantization", default=None, metavar="MODE",
                       choices=ACTIVATION_QUANTIZATION_MODES,
                       help="also load an engine whose matmuls on GGUF codes take activations "
                            "as MODE says (auto, none, int16, int8), run the two alternately "
                            "three times each and print the ratios of the medians "
                            "(benchmarks/activation_modes.py)")
    group.add_argument("--compare-events", type=int, default=0, metavar="ROUNDS",
                       help="after the run, run the batch ROUNDS more times with the event "
                            "stream observed (a timeline store subscribed, as the server does) "
                            "and as often without, alternating, and print the throughput ratio")
    group.add_argument("--output-json", type=str, default=None, help="write all results here")
    group.add_argument("--profile", action="store_true",
                       help="after the run, break one decode step (batch = --num-prompts) and one "
                            "prefill chunk (one prompt) into their parts, in ms")
    group = parser.add_argument_group("structured outputs")
    group.add_argument("--structured-fraction", type=float, default=0.0,
                       help="also run the batch with this fraction of its requests "
                            "JSON-constrained (0: off), and compare")
    group.add_argument("--json-schema", type=str, default=None,
                       help="the constraint: a JSON schema file or inline JSON (default: an "
                            "array of integers long enough that every request runs "
                            "--output-len tokens, as the unconstrained ones do)")
    EngineArgs.add_cli_args(parser)


def _throughput_metrics(
    workload: Workload, num_requests: int, num_output_tokens: int, elapsed: float
) -> dict[str, Any]:
    """The figures both engines report, computed the same way for a fair ratio."""
    return {
        "elapsed_s": elapsed,
        "num_requests": num_requests,
        "num_prompt_tokens": workload.num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
        "requests_per_s": num_requests / elapsed,
        "output_tokens_per_s": num_output_tokens / elapsed,
        "total_tokens_per_s": (workload.num_prompt_tokens + num_output_tokens) / elapsed,
    }


def _fixed_length_params(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len)


def default_json_schema(output_len: int) -> dict[str, Any]:
    """An array that cannot close within output_len tokens (each item takes at least one digit
    and a comma): constrained requests then run exactly as long as unconstrained ones, so the
    two runs differ only in the constraint's cost."""
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": output_len}


def load_json_schema(value: str) -> dict[str, Any]:
    """--json-schema: a file's path or the schema's JSON text."""
    text = value
    if not value.lstrip().startswith("{"):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    try:
        schema = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--json-schema is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise ValueError("--json-schema must be a JSON object")
    return schema


def constrained_rows(num_requests: int, fraction: float) -> list[bool]:
    """Which requests are constrained: round(fraction * n) of them, spread evenly."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--structured-fraction must be in [0, 1], got {fraction}")
    return [int((index + 1) * fraction + 0.5) > int(index * fraction + 0.5)
            for index in range(num_requests)]


def run_pagedserve(
    llm: LLM, workload: Workload, constraint: StructuredOutputsParams | None = None,
    fraction: float = 0.0, cold: bool = True,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Time one generate() over the whole workload; returns (metrics, output token ids).

    With a constraint, a `fraction` of the requests carry it (its grammar is compiled in the
    warmup, so the timing holds the per-step cost, not the one-off compile).
    cold: warm the engine up first, then empty the prefix cache; False: run on the engine as
    it is (an earlier run warmed it up, and what it cached stays)."""
    plain_params = _fixed_length_params(workload.output_len)
    params_list = [plain_params] * len(workload.prompt_token_ids)
    if cold:
        _warm_up(llm, constraint)
    if constraint is not None:
        constrained_params = SamplingParams(temperature=0, ignore_eos=True,
                                            max_tokens=workload.output_len,
                                            structured_outputs=constraint)
        params_list = [constrained_params if constrained else plain_params
                       for constrained in constrained_rows(len(params_list), fraction)]

    stats_before = llm.engine.get_stats()
    prompts = [{"prompt_token_ids": ids} for ids in workload.prompt_token_ids]
    start = time.monotonic()
    outputs = llm.generate(prompts, params_list)
    elapsed = time.monotonic() - start
    stats_after = llm.engine.get_stats()

    def stat_delta(name: str) -> int:
        return getattr(stats_after, name) - getattr(stats_before, name)

    num_output_tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    num_prompt_tokens_computed = stat_delta("num_prompt_tokens_computed")
    num_cached_tokens = sum(out.num_cached_tokens for out in outputs)
    spec_decode = None
    if llm.engine.config.speculative is not None:
        spec_decode = _spec_decode_metrics(stats_before.spec_decoding, stats_after.spec_decoding)
    metrics = {
        **_throughput_metrics(workload, len(outputs), num_output_tokens, elapsed),
        "num_prompt_tokens_computed": num_prompt_tokens_computed,
        "num_generation_tokens": stat_delta("num_generation_tokens"),
        "prefix_cache_queries": stat_delta("prefix_cache_queries"),
        "prefix_cache_hits": stat_delta("prefix_cache_hits"),
        "num_cached_tokens": num_cached_tokens,
        # Cached / prompt tokens: with a KV tier (--kv-transfer-config), tier hits count too.
        "prefix_cache_hit_rate": safe_div(num_cached_tokens, workload.num_prompt_tokens),
        "num_preemptions": stat_delta("num_preemptions"),
        "num_threads": torch.get_num_threads(),
        "spec_decode": spec_decode,
    }
    if constraint is not None:
        so_before, so_after = stats_before.structured_output, stats_after.structured_output
        num_mask_steps = so_after.num_mask_steps - so_before.num_mask_steps
        mask_seconds = so_after.mask_seconds_total - so_before.mask_seconds_total
        metrics.update(
            num_constrained_requests=sum(p is not plain_params for p in params_list),
            num_mask_steps=num_mask_steps,
            mask_ms_per_step=safe_div(mask_seconds * 1000, num_mask_steps),
            mask_share_of_elapsed=mask_seconds / elapsed,
            num_constrained_finished_early=sum(
                out.outputs[0].finish_reason == "stop" for out in outputs),
        )
    metrics.update(_phase_metrics(outputs, start, num_prompt_tokens_computed))
    return metrics, [out.outputs[0].token_ids for out in outputs]


def _warm_up(llm: LLM, constraint: StructuredOutputsParams | None) -> None:
    """One short request (and one constrained, compiling its grammar); then an empty prefix
    cache, so that the timed run starts cold."""
    warmup_ids = list(range(NUM_SPECIAL_MARGIN, NUM_SPECIAL_MARGIN + WARMUP_PROMPT_LEN))
    assert max(warmup_ids) < llm.get_tokenizer().vocab_size
    llm.generate({"prompt_token_ids": warmup_ids}, _fixed_length_params(WARMUP_OUTPUT_LEN))
    if constraint is not None:
        llm.generate({"prompt_token_ids": warmup_ids},
                     SamplingParams(temperature=0, max_tokens=WARMUP_OUTPUT_LEN,
                                    structured_outputs=constraint))
    llm.engine.reset_prefix_cache()


def _spec_decode_metrics(before: SpecDecodingStats, after: SpecDecodingStats) -> dict[str, Any]:
    """Speculative decoding during the timed run (the warm-up's drafts subtracted)."""
    delta = SpecDecodingStats()
    delta.num_drafts = after.num_drafts - before.num_drafts
    delta.num_draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    delta.num_accepted_tokens = after.num_accepted_tokens - before.num_accepted_tokens
    for name in ("num_draft_tokens_per_pos", "num_accepted_tokens_per_pos"):
        now, then = getattr(after, name), getattr(before, name)
        setattr(delta, name, [v - (then[i] if i < len(then) else 0) for i, v in enumerate(now)])
    return {
        "num_drafts": delta.num_drafts,
        "num_draft_tokens": delta.num_draft_tokens,
        "num_accepted_tokens": delta.num_accepted_tokens,
        "acceptance_rate": delta.acceptance_rate,
        "acceptance_rate_per_pos": delta.acceptance_rate_per_pos,
        "mean_acceptance_length": delta.mean_acceptance_length,
    }


def _chat_workload(tokenizer: Tokenizer, messages: list[str], output_len: int) -> Workload:
    """One prompt per user message, rendered with the model's chat template."""
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": message}]),
                         add_special_tokens=False)
        for message in messages
    ]
    return Workload(prompts, output_len)


def _without_speculation(llm: LLM) -> LLM:
    """The same engine config minus speculation, over the same loaded weights and tokenizer."""
    engine = llm.engine
    config = dataclasses.replace(engine.config, speculative=None)
    return type(llm).from_engine(
        LLMEngine(config, tokenizer=engine.tokenizer, model=engine.executor.worker.model_runner.model)
    )


def _phase_metrics(
    outputs: list[RequestOutput], start: float, num_prompt_tokens_computed: int
) -> dict[str, float | None]:
    """TTFT, TPOT, and prefill/decode rates split at the last request's first token.

    | prefill phase: until every request has its first token | decode phase: until the last token |
    NOTE: with chunked prefill, early requests already decode during the prefill phase; those
    tokens count toward the decode rate, which therefore is a slight overestimate.
    """
    ttfts = [out.metrics.time_to_first_token for out in outputs]
    tpots = []
    for out in outputs:
        num_tokens = len(out.outputs[0].token_ids)
        if num_tokens > 1:
            tpots.append((out.metrics.last_token_time - out.metrics.first_token_time)
                         / (num_tokens - 1))
    last_first_token = max(out.metrics.first_token_time for out in outputs)
    last_token = max(out.metrics.last_token_time for out in outputs)
    num_decode_tokens = sum(len(out.outputs[0].token_ids) - 1 for out in outputs)
    return {
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "median_ttft_s": percentile(ttfts, 50),
        "p99_ttft_s": percentile(ttfts, 99),
        "mean_tpot_s": sum(tpots) / len(tpots) if tpots else None,
        "prefill_time_s": last_first_token - start,
        "prefill_tokens_per_s": safe_div(num_prompt_tokens_computed, last_first_token - start),
        "decode_time_s": last_token - last_first_token,
        "decode_tokens_per_s": safe_div(num_decode_tokens, last_token - last_first_token),
    }


def run_hf(
    model_path: str, dtype: str, workload: Workload, batch_size: int | None
) -> tuple[dict[str, Any], list[list[int]]]:
    """transformers generate() with static batches and left padding; same metrics where defined."""
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError(
            "--baseline hf needs transformers (pip install 'pagedserve[test]' or transformers)"
        ) from exc
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    load_start = time.monotonic()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(os.path.abspath(model_path)), gguf_file=os.path.basename(model_path),
        dtype=torch_dtype,
    ).eval()
    load_time = time.monotonic() - load_start
    # NOTE: transformers may warn that GGUF weights "stay packed"; for architectures without a
    # packed kernel it dequantizes to a dense model. Record what was actually loaded.
    weight_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    pad_token_id = model.generation_config.pad_token_id
    if pad_token_id is None:
        pad_token_id = 0  # masked out; only needs to be a valid id

    def generate(prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
        max_len = max(len(ids) for ids in prompts)
        # Left padding: every row's last prompt token sits at column max_len - 1.
        input_ids = torch.tensor([[pad_token_id] * (max_len - len(ids)) + ids for ids in prompts])
        attention_mask = torch.tensor(
            [[0] * (max_len - len(ids)) + [1] * len(ids) for ids in prompts]
        )
        with torch.inference_mode():
            sequences = model.generate(
                input_ids, attention_mask=attention_mask, do_sample=False,
                max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,
                pad_token_id=pad_token_id,
            )
        return sequences[:, max_len:].tolist()  # (B, num_new_tokens)

    generate([workload.prompt_token_ids[0][:WARMUP_PROMPT_LEN]], WARMUP_OUTPUT_LEN)
    prompts = workload.prompt_token_ids
    batch_size = batch_size or len(prompts)
    start = time.monotonic()
    output_ids: list[list[int]] = []
    for offset in range(0, len(prompts), batch_size):
        output_ids.extend(generate(prompts[offset : offset + batch_size], workload.output_len))
    elapsed = time.monotonic() - start

    num_output_tokens = sum(len(ids) for ids in output_ids)
    metrics = {
        **_throughput_metrics(workload, len(prompts), num_output_tokens, elapsed),
        "load_time_s": load_time,
        "batch_size": batch_size,
        "num_threads": torch.get_num_threads(),
        "weight_dtypes": weight_dtypes,
        "attn_implementation": model.config._attn_implementation,
        "transformers_version": transformers.__version__,
    }
    return metrics, output_ids


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by parsed CLI args; print a table and return every number."""
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    if args.compare_no_spec and not args.speculative_config:
        raise ValueError("--compare-no-spec needs --speculative-config")
    engine_args = EngineArgs.from_cli_args(args)
    if args.compare_one_process and engine_args.create_parallel_config().world_size == 1:
        raise ValueError("--compare-one-process needs --tensor-parallel-size or "
                         "--pipeline-parallel-size > 1")
    if args.compare_no_hybrid_kv:
        result = compare_hybrid_kv(args, engine_args)
        _emit(result, format_hybrid_kv_table(result), args.output_json)
        return result
    if args.compare_no_prefix_cache:
        result = compare_prefix_cache(args, engine_args)
        _emit(result, format_prefix_cache_table(result), args.output_json)
        return result
    if args.compare_activation_quantization:
        result = compare_activation_quantization(args, engine_args)
        _emit(result, format_activation_table(result), args.output_json)
        return result
    load_average_start = os.getloadavg()[0]
    load_start = time.monotonic()
    llm = LLM(**vars(engine_args))
    load_time = time.monotonic() - load_start  # as run_hf's: construction, weights included
    model_path = llm.engine.config.model_path
    dtype = llm.engine.config.device.dtype  # --dtype auto as the engine resolved it
    workload = make_workload(args, llm.get_tokenizer().vocab_size)
    if args.chat_prompt:
        workload = _chat_workload(llm.get_tokenizer(), args.chat_prompt, args.output_len)
    no_spec = None
    if args.compare_no_spec:
        # First, so that the speculative run does not warm the CPU caches for it; the other
        # engine's KV pool is freed before the speculative one runs.
        plain_llm = _without_speculation(llm)
        no_spec, no_spec_output_ids = run_pagedserve(plain_llm, workload)
        plain_llm.engine.assert_idle()
        del plain_llm
        gc.collect()
    one_process = None
    if args.compare_one_process:
        # First, as --compare-no-spec: the parallel engine's workers idle meanwhile.
        single_llm = LLM(**{**vars(engine_args), "tensor_parallel_size": 1,
                            "pipeline_parallel_size": 1})
        one_process, one_process_output_ids = run_pagedserve(single_llm, workload)
        single_llm.engine.assert_idle()
        del single_llm
        gc.collect()
    ours, our_output_ids = run_pagedserve(llm, workload)
    ours["load_time_s"] = load_time
    events = compare_events(llm, workload, args.compare_events) if args.compare_events else None
    profile_table = None
    if args.profile:
        profiles = profile_steps(
            llm.engine, len(workload.prompt_token_ids),
            round(workload.num_prompt_tokens / len(workload.prompt_token_ids)),
        )
        profile_table = format_profile(profiles)
        ours["profile_ms_per_step"] = {name: p.per_step_ms() for name, p in profiles.items()}
    structured = None
    if args.structured_fraction > 0:
        schema = (load_json_schema(args.json_schema) if args.json_schema
                  else default_json_schema(workload.output_len))
        structured, _ = run_pagedserve(llm, workload, StructuredOutputsParams(json=schema),
                                       args.structured_fraction)
        # NOTE: the first run is cold (the KV pool's pages are touched for the first time, and
        # it ran first under whatever else the machine did): compare with an unconstrained run
        # made right after the constrained one instead.
        unconstrained, _ = run_pagedserve(llm, workload)
        structured["unconstrained_output_tokens_per_s"] = unconstrained["output_tokens_per_s"]
        structured["output_tokens_per_s_ratio_to_unconstrained"] = (
            structured["output_tokens_per_s"] / unconstrained["output_tokens_per_s"])
        structured["structured_fraction"] = args.structured_fraction
        structured["json_schema"] = schema
    llm.engine.shutdown()  # stops the worker processes, if any
    del llm  # free the KV pool before loading a second copy of the weights
    gc.collect()

    result: dict[str, Any] = {
        "config": _config(args, engine_args, workload, model_path, dtype, load_average_start),
        "pagedserve": ours,
        "no_spec": no_spec,
        "spec_speedup": None,
        "one_process": one_process,
        "parallel_speedup": None,
        "structured": structured,
        "events": events,
        "hf": None,
        "output_tokens_per_s_ratio": None,
    }
    if no_spec is not None:
        # Greedy both ways: speculation must not change a token (fp32; bf16 may flip near-ties).
        no_spec["num_outputs_identical_to_ours"] = sum(
            a == b for a, b in zip(our_output_ids, no_spec_output_ids)
        )
        result["spec_speedup"] = {
            "output_tokens_per_s": ours["output_tokens_per_s"] / no_spec["output_tokens_per_s"],
            "mean_tpot": safe_div(no_spec["mean_tpot_s"] or 0.0, ours["mean_tpot_s"] or 0.0),
        }
    if one_process is not None:
        one_process["num_outputs_identical_to_ours"] = sum(
            a == b for a, b in zip(our_output_ids, one_process_output_ids))
        result["parallel_speedup"] = {
            "output_tokens_per_s": ours["output_tokens_per_s"] / one_process["output_tokens_per_s"],
            "mean_tpot": safe_div(one_process["mean_tpot_s"] or 0.0, ours["mean_tpot_s"] or 0.0),
        }
    if args.baseline == "hf":
        hf, hf_output_ids = run_hf(model_path, dtype, workload, args.hf_batch_size)
        # Greedy on both sides, so identical outputs are expected up to numerics.
        hf["num_outputs_identical_to_ours"] = sum(
            a == b for a, b in zip(our_output_ids, hf_output_ids)
        )
        result["hf"] = hf
        ratio = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
        result["output_tokens_per_s_ratio"] = ratio
    result["config"]["load_average_1min_end"] = os.getloadavg()[0]
    table = format_table(result)
    if events is not None:
        table += "\n" + format_events_comparison(events)
    _emit(result, table + (f"\n{profile_table}" if profile_table else ""), args.output_json)
    return result


def _config(
    args: argparse.Namespace, engine_args: EngineArgs, workload: Workload, model_path: str,
    dtype: str, load_average_start: float,
) -> dict[str, Any]:
    config = {
        "model_path": model_path,
        "dtype": dtype,
        "dataset": "chat-prompt" if args.chat_prompt else args.dataset,
        "num_prompts": len(workload.prompt_token_ids),
        "output_len": workload.output_len,
        "mean_prompt_len": workload.num_prompt_tokens / len(workload.prompt_token_ids),
        "seed": args.seed,
        "num_threads": torch.get_num_threads(),
        "engine_args": vars(engine_args),
        # Other processes on the CPU slow both sides; keep the evidence with the numbers.
        "load_average_1min_start": load_average_start,
    }
    if args.chat_prompt:
        config["chat_prompts"] = args.chat_prompt
    elif args.dataset == "doc-qa":
        config.update(num_docs=args.num_docs, doc_len=args.doc_len,
                      question_len=args.question_len, quote_len=args.quote_len)
    else:
        config["input_len"] = args.input_len
    return config


def refuse_other_run_flags(args: argparse.Namespace, comparison: str) -> None:
    """`comparison` (--compare-no-prefix-cache, --compare-no-hybrid-kv or
    --compare-activation-quantization) runs on its own: refuse any other flag that changes what
    `bench throughput` runs, rather than leave it unrun without a word."""
    given = {"--baseline hf": args.baseline != "none",
             "--compare-no-spec": args.compare_no_spec,
             "--compare-one-process": args.compare_one_process,
             "--compare-no-prefix-cache": args.compare_no_prefix_cache,
             "--compare-no-hybrid-kv": args.compare_no_hybrid_kv,
             "--compare-activation-quantization": args.compare_activation_quantization is not None,
             "--compare-events": args.compare_events > 0,
             "--profile": args.profile,
             "--structured-fraction": args.structured_fraction > 0}
    others = [flag for flag, on in given.items() if on and flag != comparison]
    if others:
        raise ValueError(f"{comparison} runs on its own, without {', '.join(others)}")


def _emit(result: dict[str, Any], table: str, output_json: str | None) -> None:
    print(table)
    if output_json:
        with open(output_json, "w") as f:
            json.dump(result, f, indent=2)


def format_table(result: dict[str, Any]) -> str:
    config, ours, hf = result["config"], result["pagedserve"], result["hf"]
    no_spec = result.get("no_spec")
    # Columns: ours, then the same engine without speculation, then transformers.
    sides = [("pagedserve", ours)]
    if no_spec:
        sides = [("spec", ours), ("no spec", no_spec)]
    one_process = result.get("one_process")
    if one_process:
        sides = [("parallel", ours), ("one process", one_process)]
    if hf:
        sides.append(("hf", hf))

    def number(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    rows = [
        ("load time (s)", "load_time_s", ".2f"),
        ("total time (s)", "elapsed_s", ".2f"),
        ("requests/s", "requests_per_s", ".2f"),
        ("output tokens/s", "output_tokens_per_s", ".1f"),
        ("total tokens/s", "total_tokens_per_s", ".1f"),
        ("prompt tokens", "num_prompt_tokens", "d"),
        ("output tokens", "num_output_tokens", "d"),
        ("prompt tokens computed", "num_prompt_tokens_computed", "d"),
        ("prefix-cache hits / queries", None, None),
        ("preemptions", "num_preemptions", "d"),
        ("mean TTFT (ms)", "mean_ttft_s", "ms"),
        ("mean time per output token (ms)", "mean_tpot_s", "ms"),
        ("prefill tokens/s", "prefill_tokens_per_s", ".1f"),
        ("decode tokens/s", "decode_tokens_per_s", ".1f"),
    ]
    width = 34
    lines = [
        f"model {os.path.basename(config['model_path'])}  dtype {config['dtype']}  "
        f"dataset {config['dataset']}  prompts {config['num_prompts']}  "
        f"mean prompt len {config['mean_prompt_len']:.0f}  output len {config['output_len']}  "
        f"threads {config['num_threads']}  load avg {config['load_average_1min_start']:.2f} -> "
        f"{config['load_average_1min_end']:.2f}",
        f"{'':<{width}}" + "".join(f"{name:>14}" for name, _ in sides),
    ]
    for label, key, fmt in rows:
        if key is None:
            cells = [f"{side['prefix_cache_hits']} / {side['prefix_cache_queries']}"
                     for _, side in sides if "prefix_cache_hits" in side]
        else:
            cells = []
            for _, side in sides:
                value = side.get(key)
                if fmt == "ms":
                    cells.append(number(None if value is None else value * 1000, ".1f"))
                else:
                    cells.append(number(value, fmt))
        lines.append(f"{label:<{width}}" + "".join(f"{cell:>14}" for cell in cells))
    spec = ours.get("spec_decode")
    if spec:
        per_pos = " ".join(f"{rate:.2f}" for rate in spec["acceptance_rate_per_pos"])
        lines += [
            f"{'spec: drafts / draft tokens':<{width}}"
            f"{spec['num_drafts']:>14} / {spec['num_draft_tokens']}",
            f"{'spec: accepted tokens':<{width}}{spec['num_accepted_tokens']:>14}",
            f"{'spec: acceptance rate':<{width}}{spec['acceptance_rate']:>14.3f}",
            f"{'spec: acceptance rate per position':<{width}}{'':>4}{per_pos}",
            f"{'spec: mean accepted length':<{width}}{spec['mean_acceptance_length']:>14.2f}",
        ]
    comparisons = [("spec / no spec", no_spec, result.get("spec_speedup")),
                   ("parallel / one process", one_process, result.get("parallel_speedup"))]
    for label, other, speedup in comparisons:
        if not other:
            continue
        lines.append(f"{'outputs identical ' + label:<{width}}"
                     f"{other['num_outputs_identical_to_ours']:>14} / {config['num_prompts']}")
        mean_tpot = speedup["mean_tpot"]
        lines.append(f"speedup {label}: output tokens/s {speedup['output_tokens_per_s']:.2f}x"
                     + ("" if mean_tpot is None else f", decode (1 / mean TPOT) {mean_tpot:.2f}x"))
    structured = result.get("structured")
    if structured:
        lines.append(
            f"structured outputs: {structured['num_constrained_requests']} of "
            f"{structured['num_requests']} requests JSON-constrained: output tokens/s "
            f"{structured['output_tokens_per_s']:.1f} vs "
            f"{structured['unconstrained_output_tokens_per_s']:.1f} unconstrained, run right "
            f"after (ratio {structured['output_tokens_per_s_ratio_to_unconstrained']:.2f}"
            f"); mask {number(structured['mask_ms_per_step'], '.2f')} ms/step over "
            f"{structured['num_mask_steps']} steps ({structured['mask_share_of_elapsed']:.1%} "
            f"of the time); {structured['num_constrained_finished_early']} finished before "
            "--output-len")
    if hf:
        pad = f"{'':>14}" * (len(sides) - 1)
        lines.append(f"{'hf batch size':<{width}}{pad}{hf['batch_size']:>14}")
        lines.append(f"{'outputs identical to ours':<{width}}{pad}"
                     f"{hf['num_outputs_identical_to_ours']:>14}")
        ratio = result["output_tokens_per_s_ratio"]
        lines.append(f"output tokens/s ratio pagedserve / hf: {ratio:.2f}x")
        lines.append(f"load time ratio pagedserve / hf: "
                     f"{ours['load_time_s'] / hf['load_time_s']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cli_args(parser)
    main(parser.parse_args())
