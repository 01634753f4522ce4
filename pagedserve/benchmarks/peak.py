"""`pagedserve bench peak`: the machine's limits that the other figures are ratios to.

- Compute: every thread runs a long loop of independent instructions of one kind, registers
  only (csrc/cpu_ops.cpp `peak_seconds`): the int8 dot product (AVX-512 VNNI, 64 multiply-adds),
  the bf16 one (AVX512-BF16, 32), the fp32 FMA (16 in AVX-512, 8 in AVX2). GOP/s counts a
  multiply-add as 2 operations, as `bench matmul` and `bench attention` count theirs. A kernel
  built on one kind can reach that kind's figure only if it does nothing else.
- Memory: the read bandwidth of a sum over a tensor much larger than the caches (torch, the
  engine's thread count), what a batch-1 decode step needs to stream the weights.

Each figure is the best of `--repeats` runs: a limit is what the machine can do, and a slow
spell only hides it.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.benchmarks.matmul import cpu_model

READ_MIB = 512
"""The tensor summed for the read bandwidth: far past any L3 of these machines."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iterations", type=int, default=50_000_000,
                        help="loop iterations per thread for each instruction kind (12 "
                             "instructions each)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads (default: torch's)")


def compute_peaks(iterations: int, repeats: int) -> dict[str, float]:
    """GOP/s of each instruction kind this build of the kernels has, on all torch threads."""
    from pagedserve.kernels import cpu_ops

    ops = cpu_ops.load()
    if ops is None:
        raise RuntimeError("the compiled CPU kernels are unavailable (see `pagedserve serve`'s "
                           "log for why)")
    threads = torch.get_num_threads()
    peaks = {}
    for kind, multiply_adds in sorted(ops.peak_kinds().items()):
        seconds = min(ops.peak_seconds(kind, iterations) for _ in range(repeats))
        peaks[kind] = 2 * multiply_adds * 12 * iterations * threads / seconds / 1e9
    return peaks


def read_bandwidth(repeats: int, mib: int = READ_MIB) -> float:
    """GB/s of a sum over `mib` MiB of bf16."""
    data = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16)
    data.sum()  # first touch
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * data.element_size() / best / 1e9


def main(args: argparse.Namespace) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    peaks = compute_peaks(args.iterations, args.repeats)
    bandwidth = read_bandwidth(args.repeats)
    print(f"{cpu_model()}, {torch.get_num_threads()} threads; best of {args.repeats}")
    names = {"int8": "int8 dot products (VNNI)", "bf16": "bf16 dot products (AVX512-BF16)",
             "fp32": "fp32 FMA"}
    for kind, gops in peaks.items():
        print(f"{names[kind]:>34}: {gops:8.1f} GOP/s")
    print(f"{f'read bandwidth ({READ_MIB} MiB sum)':>34}: {bandwidth:8.1f} GB/s")
    return 0
