"""`pagedserve bench attention`: one request's prefill attention on the compiled kernel
(csrc/cpu_ops.cpp prefill_attention: fp32 on AVX2 + FMA, bf16 on AVX512-BF16) against the torch
path it replaces (attention/paged.py: SDPA for a fresh prompt, blocked matmuls over a chunk with
context), for one layer, at the prompt lengths and contexts a prefill meets.

The cache is random, its blocks scattered as a busy pool's are; the two paths run interleaved call
by call, so a slow spell of the machine lands on both, and each figure is the median of
`--iterations` calls (matmul.median_ms). GFLOP/s counts the causal products only: 4 * heads *
head_dim per (query, key it sees). "max diff" is the largest absolute difference between the two
outputs (they sum in different orders). `--compare-tiles` also times the kernel with the AMX tiles
off (a copy of this build's module, loaded beside it), where this process has them on.
`--baseline-kernels` times another build's kernel beside this one ("base"; "base diff": the largest
difference between the two builds' outputs, 0 when a change keeps the bits). Against a copy of the
same build (Zen 3, 2 threads, `--iterations 15`) "base / kernel" read 0.98-1.10x: a smaller
difference on chunks of a few milliseconds is noise.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from pagedserve.benchmarks.matmul import cpu_model, median_ms

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", default="200+0,512+0,2000+0,200+300,512+1536",
                        help="comma-separated TOKENS+CONTEXT chunks: query tokens, and the "
                             "tokens cached before them")
    parser.add_argument("--heads", default="9/3", help="query heads / KV heads (SmolLM2's)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=9)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads (default: torch's)")
    parser.add_argument("--compare-tiles", action="store_true",
                        help="also the kernel with the AMX tiles off (column 'untiled')")
    parser.add_argument("--baseline-kernels", metavar="PATH",
                        help="another build's _cpu_ops*.so, timed beside this build's "
                             "(column 'base')")


def measure(cases: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
            dtype: torch.dtype, block_size: int, iterations: int, seed: int = 0,
            untiled=None, baseline=None) -> list[dict]:
    """One record per (tokens, context): median ms of "kernel" and "torch" (and "untiled": the
    `untiled` module's kernel; "base": the `baseline` module's), the max difference between the
    kernel and torch (and "base_diff": between the kernel and the baseline's)."""
    from pagedserve.attention.cpu_kernel_backend import PREFILL_KERNEL_HEAD_DIMS
    from pagedserve.attention.metadata import build_attention_metadata
    from pagedserve.attention.paged import gathered_prefill_attention
    from pagedserve.kernels import cpu_ops

    ops = cpu_ops.load()
    if ops is None:
        raise RuntimeError("the compiled CPU kernels are unavailable (see `pagedserve serve`'s "
                           "log for why)")
    served = (ops.prefill_attention_f32_supported() if dtype == torch.float32
              else ops.prefill_attention_supported() and head_dim in PREFILL_KERNEL_HEAD_DIMS)
    if not served:
        raise RuntimeError(f"this build's prefill kernel does not take {dtype} at head_dim "
                           f"{head_dim} on this CPU")
    generator = torch.Generator().manual_seed(seed)
    records = []
    for tokens, context in cases:
        seq_len = context + tokens
        num_blocks = 2 * (-(-seq_len // block_size)) + 1
        shape = (kv_heads, num_blocks, block_size, head_dim)
        key_cache = torch.randn(shape, generator=generator).to(dtype)
        value_cache = torch.randn(shape, generator=generator).to(dtype)
        table = torch.randperm(num_blocks - 1, generator=generator)[: -(-seq_len // block_size)] + 1
        q = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
        scale = head_dim ** -0.5
        meta = build_attention_metadata([(table.tolist(), context, seq_len)], block_size,
                                        [(key_cache, value_cache)], torch.device("cpu"))
        calls = {
            "kernel": partial(ops.prefill_attention, q, key_cache, value_cache, table, context,
                              scale),
            "torch": partial(gathered_prefill_attention, q, (key_cache, value_cache), meta, 0,
                             scale),
        }
        for name, module in (("untiled", untiled), ("base", baseline)):
            if module is not None:
                calls[name] = partial(module.prefill_attention, q, key_cache, value_cache, table,
                                      context, scale)
        out = calls["kernel"]().float()
        record = {"tokens": tokens, "context": context,
                  "max_diff": (out - calls["torch"]().float()).abs().max().item()}
        if baseline is not None:
            record["base_diff"] = (out - calls["base"]().float()).abs().max().item()
        record["ms"] = median_ms(calls, iterations)
        records.append(record)
    return records


def main(args: argparse.Namespace) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    cases = [tuple(int(v) for v in case.split("+")) for case in args.cases.split(",")]
    heads, kv_heads = (int(v) for v in args.heads.split("/"))
    from pagedserve.benchmarks.matmul import load_kernels, untiled_copy
    from pagedserve.kernels import cpu_ops

    untiled = untiled_copy() if args.compare_tiles else None
    baseline = load_kernels(args.baseline_kernels) if args.baseline_kernels else None
    records = measure(cases, heads, kv_heads, args.head_dim, DTYPES[args.dtype],
                      args.block_size, args.iterations, untiled=untiled, baseline=baseline)
    names = ["kernel", "torch"] + (["untiled"] if untiled else []) + (["base"] if baseline else [])
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, {args.dtype}, {heads} heads / "
          f"{kv_heads} KV heads x {args.head_dim}, tiles {cpu_ops.load().tiles()}; one layer, "
          f"median of {args.iterations} calls, ms (GFLOP/s)")
    print(f"{'tokens':>7}{'context':>9}" + "".join(f"{name:>18}" for name in names)
          + f"{'torch / kernel':>16}" + (f"{'untiled / kernel':>18}" if untiled else "")
          + (f"{'base / kernel':>15}" if baseline else "") + f"{'max diff':>11}"
          + (f"{'base diff':>11}" if baseline else ""))
    for record in records:
        tokens, context = record["tokens"], record["context"]
        seen = tokens * context + tokens * (tokens + 1) // 2  # (query, key) pairs, causal
        flop = 4 * heads * args.head_dim * seen
        ms = record["ms"]
        cells = "".join(f" {ms[name]:>9.3f} ({flop / ms[name] / 1e6:>5.0f})" for name in names)
        tiles = f"{ms['untiled'] / ms['kernel']:>17.2f}x" if untiled else ""
        base = f"{ms['base'] / ms['kernel']:>14.2f}x" if baseline else ""
        base_diff = f"{record['base_diff']:>11.1e}" if baseline else ""
        print(f"{tokens:>7}{context:>9}{cells}{ms['torch'] / ms['kernel']:>15.2f}x{tiles}{base}"
              f"{record['max_diff']:>11.1e}{base_diff}")
    return 0
