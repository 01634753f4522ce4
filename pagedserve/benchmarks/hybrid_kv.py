"""`bench throughput --compare-no-hybrid-kv`: the KV a sliding-window model holds per request,
with KV managed per layer group (the default, core/kv_cache_groups.py) and with one block table
for every layer (--disable-hybrid-kv-cache-manager: every block kept, windowed layers mask).

Both engines run the same workload (the one-group engine first, freed before the other is made),
each warmed up first. Per engine, per request (all of them at once): the KV the blocks held at the
last step before the requests end (each at its longest context) and the most held at any time
(a prefill chunk takes blocks for all its tokens in every group: KVCacheManager.peak_used_blocks),
a block's bytes being every slot's K and V; the throughput; and whether the greedy outputs agree.

    pagedserve bench throughput --model gemma3-270m --compare-no-hybrid-kv --num-prompts 1 \\
        --input-len 4000 --output-len 96            # one request at 4k context
"""

from __future__ import annotations

import argparse
import gc
import os
from typing import Any

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm import LLM

RUNS = (
    # (result key, table column, disable_hybrid_kv_cache_manager)
    ("one_group", "every block", True),
    ("per_layer_group", "per group", False),
)


def compare_hybrid_kv(args: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    from pagedserve.benchmarks.throughput import (
        _config,
        _warm_up,
        make_workload,
        refuse_other_run_flags,
        run_pagedserve,
    )

    if engine_args.disable_hybrid_kv_cache_manager:
        raise ValueError("--compare-no-hybrid-kv compares against the hybrid KV cache manager: "
                         "drop --disable-hybrid-kv-cache-manager")
    refuse_other_run_flags(args, "--compare-no-hybrid-kv")
    load_average_start = os.getloadavg()[0]
    runs: dict[str, dict[str, Any]] = {}
    output_ids: dict[str, list[list[int]]] = {}
    workload = model_path = dtype = None
    for key, _, disable in RUNS:
        llm = LLM(**{**vars(engine_args), "disable_hybrid_kv_cache_manager": disable})
        if workload is None:
            model_path = llm.engine.config.model_path
            dtype = llm.engine.config.device.dtype  # --dtype auto as the engine resolved it
            workload = make_workload(args, llm.get_tokenizer().vocab_size)
        manager = llm.engine.scheduler.kv_cache_manager
        _warm_up(llm, None)
        manager.reset_peak_usage()
        freed_before = manager.num_window_freed_blocks
        used_after_steps: list[int] = []  # blocks held after each step of the timed run
        pool = manager.block_pool
        unsubscribe = llm.engine.events.subscribe(
            lambda _: used_after_steps.append(pool.num_usable_blocks - pool.num_free_blocks))
        runs[key], output_ids[key] = run_pagedserve(llm, workload, cold=False)
        unsubscribe()
        bytes_per_block = llm.engine.memory_breakdown()["kv_pool"]["bytes_per_block"]
        num_requests = len(workload.prompt_token_ids)
        # The last step that ends no request: every request holds its longest context.
        held_at_end = next((n for n in reversed(used_after_steps) if n), 0)
        runs[key].update(
            kv_cache_group_windows=list(manager.group_windows), num_blocks=pool.num_blocks,
            bytes_per_block=bytes_per_block, peak_used_blocks=manager.peak_used_blocks,
            peak_kv_bytes_per_request=manager.peak_used_blocks * bytes_per_block / num_requests,
            final_used_blocks=held_at_end,
            final_kv_bytes_per_request=held_at_end * bytes_per_block / num_requests,
            window_freed_blocks=manager.num_window_freed_blocks - freed_before)
        llm.engine.shutdown()
        llm.engine.assert_idle()
        del llm  # free the KV pool before the next engine is made
        gc.collect()

    config = _config(args, engine_args, workload, model_path, dtype, load_average_start)
    config.update(block_size=engine_args.block_size, load_average_1min_end=os.getloadavg()[0])
    one, per_group = runs["one_group"], runs["per_layer_group"]
    return {
        "config": config,
        "hybrid_kv": {
            **runs,
            "peak_kv_bytes_ratio": (one["peak_kv_bytes_per_request"]
                                    / per_group["peak_kv_bytes_per_request"]),
            "final_kv_bytes_ratio": (one["final_kv_bytes_per_request"]
                                     / per_group["final_kv_bytes_per_request"]),
            "throughput_ratio": (per_group["output_tokens_per_s"]
                                 / one["output_tokens_per_s"]),
            "same_outputs": output_ids["one_group"] == output_ids["per_layer_group"],
        },
    }


def format_hybrid_kv_table(result: dict[str, Any]) -> str:
    config, compared = result["config"], result["hybrid_kv"]
    rows = [
        ("KV cache groups", lambda r: str(len(r["kv_cache_group_windows"]))),
        ("pool blocks", lambda r: f"{r['num_blocks']}"),
        ("bytes per block", lambda r: f"{r['bytes_per_block']:,}"),
        ("blocks freed by windows", lambda r: f"{r['window_freed_blocks']}"),
        ("peak blocks held", lambda r: f"{r['peak_used_blocks']}"),
        ("peak KV MiB per request", lambda r: f"{r['peak_kv_bytes_per_request'] / 2**20:.2f}"),
        ("blocks held at the end", lambda r: f"{r['final_used_blocks']}"),
        ("  KV MiB per request", lambda r: f"{r['final_kv_bytes_per_request'] / 2**20:.2f}"),
        ("output tokens/s", lambda r: f"{r['output_tokens_per_s']:.1f}"),
        ("total time (s)", lambda r: f"{r['elapsed_s']:.2f}"),
    ]
    width, cell_width = 26, 14
    lines = [
        f"model {os.path.basename(config['model_path'])}  dtype {config['dtype']}  prompts "
        f"{config['num_prompts']}  mean prompt len {config['mean_prompt_len']:.0f}  output len "
        f"{config['output_len']}  block size {config['block_size']}  threads "
        f"{config['num_threads']}  load avg {config['load_average_1min_start']:.2f} -> "
        f"{config['load_average_1min_end']:.2f}",
        f"{'':<{width}}" + "".join(f"{label:>{cell_width}}" for _, label, _ in RUNS),
    ]
    for label, cell in rows:
        lines.append(f"{label:<{width}}"
                     + "".join(f"{cell(compared[key]):>{cell_width}}" for key, _, _ in RUNS))
    lines.append(f"KV per request, every block / per group: {compared['final_kv_bytes_ratio']:.2f}x "
                 f"at the end ({compared['peak_kv_bytes_ratio']:.2f}x at the peak); throughput "
                 f"per group / every block: {compared['throughput_ratio']:.2f}x; greedy outputs "
                 f"{'equal' if compared['same_outputs'] else 'DIFFER'}")
    return "\n".join(lines)
