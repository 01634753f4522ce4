"""`pagedserve bench matmul`: one linear layer on its GGUF codes (csrc/cpu_ops.cpp quant_linear)
in each activation mode, against torch's dense matmul on the same dequantized weights, at the
row counts a step uses (1 for a decode, 32 for a batch, hundreds for a prefill chunk).
`--baseline-kernels PATH` also times another build of the kernels (the `_cpu_ops*.so` of an
older checkout, built with `python setup.py build_ext --inplace` there) in the same process,
interleaved call by call with this one, and checks that both give the same bits: on a noisy
machine the ratio of the two is what can be trusted. `--compare-tiles` does the same with this
build's int8 mode on the AMX tiles against this build with them off (the VNNI kernel).

The weights are a random matrix quantized to 4-bit groups of 32 (`--qtype int4`, GGUF's Q4_1
form), 5-bit (`int5`, Q5_1) or 8-bit (`int8`, Q8_0); the activations are random rows. Each figure is the median
of `--iterations` calls after one warm-up; modes run interleaved, so a slow spell of the
machine lands on all of them. GFLOP/s counts 2 * rows * N * K. `--outlier-channels N` gives the
int8 layers N input channels multiplied exactly (layers/outliers.py; the model's int8 layers
take 16), chosen at random.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

# N x K of SmolLM2-135M's projections: gate-up, down, QKV, O
DEFAULT_SHAPES = "3072x576,576x1536,960x576,576x576"
MODES = {"exact": 32, "int16": 16, "int8": 8}
"""quant_linear's activation bits per --activation-quantization mode (exact = none)."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma-separated NxK weight shapes (default: SmolLM2-135M's)")
    parser.add_argument("--rows", default="1,8,32,200,512,2048",
                        help="comma-separated row counts")
    parser.add_argument("--qtype", choices=("int4", "int5", "int8"), default="int4")
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads (default: torch's)")
    parser.add_argument("--baseline-kernels", default=None, metavar="PATH",
                        help="another build's _cpu_ops*.so: its int16 and int8 modes are timed "
                             "beside this build's (column 'base int16' etc.)")
    parser.add_argument("--outlier-channels", type=int, default=0, metavar="N",
                        help="N outlier input channels in the int8 layers (the model's take "
                             "16)")
    parser.add_argument("--compare-tiles", action="store_true",
                        help="the baseline is this build with the AMX tiles off (a copy of its "
                             "module): int8 on the tiles against the VNNI kernel")


def load_kernels(path: str):
    """Another build of csrc/cpu_ops.cpp, loaded beside this one under its own module name."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader("pagedserve_baseline._cpu_ops", path)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def untiled_copy():
    """This build's module loaded a second time from a copy of its file (its own globals), with
    the AMX tiles off, where this one has them on."""
    import shutil
    import tempfile
    from pathlib import Path

    from pagedserve.kernels import cpu_ops

    ops = cpu_ops.load()
    if ops is None or ops.tiles() == "off":
        raise RuntimeError("--compare-tiles: the AMX tiles are off in this process "
                           f"({ops.set_tiles('amx') if ops else 'no kernels'})")
    copy = Path(tempfile.mkdtemp(prefix="pagedserve-untiled-")) / Path(ops.__file__).name
    shutil.copyfile(ops.__file__, copy)
    try:
        module = load_kernels(str(copy))
    finally:
        shutil.rmtree(copy.parent)  # the loaded module stays mapped
    module.set_tiles("off")
    return module


def cpu_model() -> str:
    """The CPU's name, family and model, and the instruction sets the kernels choose by."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "unknown CPU"
    flags = set(fields.get("flags", "").split())
    features = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8")
                if f in flags]
    return (f"{fields.get('model name', 'unknown CPU')} (family {fields.get('cpu family', '?')} "
            f"model {fields.get('model', '?')}: {' '.join(features) or 'no AVX2'})")


def kernel_call(kernels, layer, x: torch.Tensor):
    """`layer`'s product of x by a build of the kernels, called straight: every build the same
    way (the layer's Python wrapper would weigh on one side only, ~30% of the call at one row)."""
    return partial(kernels.quant_linear, x, layer.codes, layer.scales, layer.mins,
                   layer.out_features, layer.bits, layer.activation_bits, None,
                   layer.outlier_channels, layer.outlier_weights)


def measure(shapes: list[tuple[int, int]], rows: list[int], qtype: str, iterations: int,
            seed: int = 0, baseline=None, outlier_channels: int = 0) -> list[dict]:
    """One record per (shape, rows): median milliseconds per mode ("dense" and MODES, and with
    `baseline` (load_kernels) "base int16" and "base int8", whose outputs must equal this
    build's bit for bit); the int8 layers with `outlier_channels` random outlier input
    channels."""
    from pagedserve.kernels import cpu_ops
    from pagedserve.layers.quantized import GroupQuantizedWeight, quantize_weight

    ops = cpu_ops.load()
    if ops is None:
        raise RuntimeError("the compiled CPU kernels are unavailable (see `pagedserve serve`'s "
                           "log for why)")
    generator = torch.Generator().manual_seed(seed)
    records = []
    for n, k in shapes:
        weight = quantize_weight(torch.randn(n, k, generator=generator) * 0.05, qtype)
        dense = weight.dequantize().float()
        layers = {mode: GroupQuantizedWeight(weight, ops, torch.float32, bits)
                  for mode, bits in MODES.items()}
        if outlier_channels:
            channels = torch.randperm(k, generator=generator)[:outlier_channels].sort().values
            layers["int8"].set_outlier_channels(channels)
        for m in rows:
            x = torch.randn(m, k, generator=generator)
            calls = {"dense": partial(F.linear, x, dense)}
            calls.update({mode: kernel_call(ops, layers[mode], x) for mode in MODES})
            if baseline is not None:
                for mode in ("int16", "int8"):
                    calls[f"base {mode}"] = kernel_call(baseline, layers[mode], x)
                    if not torch.equal(calls[f"base {mode}"](), calls[mode]()):
                        raise RuntimeError(f"the baseline kernels' {mode} product differs from "
                                           f"this build's at {m} rows, {n} x {k}")
            records.append({"n": n, "k": k, "rows": m, "ms": median_ms(calls, iterations)})
    return records


def median_ms(calls: dict[str, Callable[[], object]], iterations: int) -> dict[str, float]:
    """Each call's median milliseconds over `iterations` rounds, the calls interleaved within
    each round (a slow spell of the machine lands on all of them), in a new order each round
    (seeded), each timed call right after an untimed one of its own. A call timed always after
    the same other call finds the machine as that one leaves it: a one-row product timed right
    after the exact mode's ran 0.87-0.92x of the same product timed after another (an A/A
    comparison, one build against a copy of itself, Zen 3), and such a bias had passed for a
    change's effect."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    shuffler = random.Random(0)
    for _ in range(iterations):
        shuffler.shuffle(order)
        for name in order:
            calls[name]()
            started = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - started)
    return {name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()}


def main(args: argparse.Namespace) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    baseline = load_kernels(args.baseline_kernels) if args.baseline_kernels else None
    if args.compare_tiles:
        baseline = untiled_copy()
    records = measure(shapes, rows, args.qtype, args.iterations, baseline=baseline,
                      outlier_channels=args.outlier_channels)
    from pagedserve.kernels import cpu_ops

    print(f"{cpu_model()}, {torch.get_num_threads()} threads, {args.qtype} codes, fp32 "
          f"activations, {args.outlier_channels} outlier channels, tiles {cpu_ops.load().tiles()}"
          f"{' (base: off)' if args.compare_tiles else ''}; median of {args.iterations} "
          "calls, ms (GFLOP/s)")
    modes = list(records[0]["ms"]) if records else []
    ratios = [("dense", "int16")] + ([("base int16", "int16"), ("base int8", "int8")]
                                     if baseline else [])
    if args.compare_tiles:
        ratios = [("dense", "int16"), ("base int8", "int8")]
    print(f"{'N x K':>12}{'rows':>6}" + "".join(f"{mode:>18}" for mode in modes)
          + "".join(f"{f'{a} / {b}':>22}" for a, b in ratios))
    for record in records:
        flop = 2 * record["rows"] * record["n"] * record["k"]
        ms = record["ms"]
        cells = "".join(f" {ms[mode]:>9.3f} ({flop / ms[mode] / 1e6:>5.0f})" for mode in modes)
        speedups = "".join(f"{ms[a] / ms[b]:>21.2f}x" for a, b in ratios)
        print(f"{record['n']:>6} x {record['k']:<4}{record['rows']:>6}{cells}{speedups}")
    return 0
