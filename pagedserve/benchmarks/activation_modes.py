"""`bench throughput --compare-activation-quantization MODE`: the same workload on two engines that
differ only in how their matmuls on GGUF codes take their activations (--activation-quantization,
layers/quantized.py `activation_bits_for`): this invocation's mode and MODE.

Both engines are loaded at once and take turns, ROUNDS runs each in the order A B, B A, A B, so
that a machine whose speed drifts from minute to minute (shared CPUs do, by 20-40%) weighs on both
alike; the ratios are of the medians, as speedups (times: other / ours). Each run starts cold (a
warm-up request, then an empty prefix cache). The greedy outputs of the two engines' first runs
are compared.

    pagedserve bench throughput --num-prompts 32 --input-len 200 --output-len 128 \\
        --compare-activation-quantization int16      # the default (int8 in fp32) against int16
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm import LLM

ROUNDS = 3
FIGURES = {  # figure: (label, whether more is better)
    "output_tokens_per_s": ("output tok/s", True),
    "prefill_tokens_per_s": ("prefill tok/s", True),
    "decode_tokens_per_s": ("decode tok/s", True),
    "mean_ttft_s": ("mean TTFT (s)", False),
}
"""The ratios are speedups: ours / other where more is better, other / ours for times."""


def _activation_bits(llm: LLM) -> int | None:
    """The activation bits of the model's first layer on GGUF codes (None: no such layer)."""
    model = llm.engine.executor.worker.model_runner.model
    return next((m.activation_bits for m in model.modules() if hasattr(m, "activation_bits")),
                None)


def compare_activation_quantization(args: argparse.Namespace,
                                    engine_args: EngineArgs) -> dict[str, Any]:
    from pagedserve.benchmarks.throughput import (
        _config,
        make_workload,
        refuse_other_run_flags,
        run_pagedserve,
    )

    modes = {"ours": engine_args.activation_quantization,
             "other": args.compare_activation_quantization}
    if modes["ours"] == modes["other"]:
        raise ValueError(f"--compare-activation-quantization {modes['other']} is this run's own "
                         "--activation-quantization: name another mode")
    refuse_other_run_flags(args, "--compare-activation-quantization")
    load_average_start = os.getloadavg()[0]
    llms = {key: LLM(**{**vars(engine_args), "activation_quantization": mode})
            for key, mode in modes.items()}
    try:
        first = llms["ours"]
        workload = make_workload(args, first.get_tokenizer().vocab_size)
        runs: dict[str, list[dict[str, Any]]] = {key: [] for key in llms}
        output_ids: dict[str, list[list[int]]] = {}
        for round_index in range(ROUNDS):
            order = ("ours", "other") if round_index % 2 == 0 else ("other", "ours")
            for key in order:
                metrics, ids = run_pagedserve(llms[key], workload)
                runs[key].append(metrics)
                output_ids.setdefault(key, ids)
        bits = {key: _activation_bits(llm) for key, llm in llms.items()}
        config = _config(args, engine_args, workload, first.engine.config.model_path,
                         first.engine.config.device.dtype, load_average_start)
        for llm in llms.values():
            llm.engine.assert_idle()
    finally:
        for llm in llms.values():
            llm.engine.shutdown()
    config["load_average_1min_end"] = os.getloadavg()[0]
    # a figure a run has no value for (decode tok/s with one output token) is left out
    medians = {key: {figure: statistics.median(run[figure] for run in key_runs)
                     for figure in FIGURES if all(run[figure] for run in key_runs)}
               for key, key_runs in runs.items()}
    ratios = {}
    for figure, (_, more_is_better) in FIGURES.items():
        if figure in medians["ours"] and figure in medians["other"]:
            ours, other = medians["ours"][figure], medians["other"][figure]
            ratios[figure] = ours / other if more_is_better else other / ours
    return {
        "config": config,
        "activation_quantization": {
            "modes": modes,
            "activation_bits": bits,
            "runs": runs,
            "medians": medians,
            "ratios": ratios,
            "num_outputs_identical": sum(a == b for a, b in zip(output_ids["ours"],
                                                                output_ids["other"])),
            "num_outputs": len(output_ids["ours"]),
        },
    }


def format_activation_table(result: dict[str, Any]) -> str:
    config, compared = result["config"], result["activation_quantization"]
    modes, bits = compared["modes"], compared["activation_bits"]
    names = {key: f"{modes[key]} ({bits[key]}-bit)" if bits[key] else modes[key] for key in modes}
    header = (f"model {os.path.basename(config['model_path'])}  dtype {config['dtype']}  prompts "
              f"{config['num_prompts']}  mean prompt len {config['mean_prompt_len']:.0f}  output "
              f"len {config['output_len']}  threads {config['num_threads']}  load avg "
              f"{config['load_average_1min_start']:.2f} -> {config['load_average_1min_end']:.2f}")
    lines = [header, f"{'output tok/s per run':<26}{names['ours']:>18}{names['other']:>18}"]
    for index, (ours, other) in enumerate(zip(compared["runs"]["ours"],
                                              compared["runs"]["other"])):
        lines.append(f"{f'  round {index + 1}':<26}{ours['output_tokens_per_s']:>18.1f}"
                     f"{other['output_tokens_per_s']:>18.1f}")
    for figure, ratio in compared["ratios"].items():
        label, _ = FIGURES[figure]
        lines.append(f"{f'median {label}':<26}{compared['medians']['ours'][figure]:>18.2f}"
                     f"{compared['medians']['other'][figure]:>18.2f}{ratio:>9.2f}x")
    lines.append(f"greedy outputs identical: {compared['num_outputs_identical']} of "
                 f"{compared['num_outputs']}")
    return "\n".join(lines)
