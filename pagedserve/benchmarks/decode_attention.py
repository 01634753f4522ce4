"""`pagedserve bench decode-attention`: a decode step's attention on the compiled kernel
(csrc/cpu_ops.cpp paged_attention: one query per sequence, the cache read in place) against the
torch path it replaces (attention/paged.py decode_attention: blocks gathered, then batched
matmuls), over a model's worth of layers.

A step reads every layer's cache once, and a batch's caches (30 layers x 32 sequences x 300 keys
of SmolLM2 at fp16: 110 MB) are far larger than the CPU's caches: each layer's reads start cold.
So each layer has its own cache, and one timed call runs the layers in turn, as the step does
("cold"). "warm" runs the first layer's cache as many times: the figure a one-layer benchmark
gives, which hides the cost of the cache misses (prefetching, say, changes the cold figure and
not the warm one). `--block-order` places each sequence's blocks as a busy pool does
("shuffled"), as a decode batch allocates them ("interleaved": one block of each sequence in
turn), or one sequence's after another ("in-order").

The caches are random, quantized by the engine's own quantize_kv where `--kv-cache-dtype` asks.
Every path runs interleaved call by call (a slow spell of the machine lands on all of them);
each figure is the median of `--iterations` calls, per layer (matmul.median_ms). GB/s: the
cache's bytes (codes and scales) over the cold time. "max diff" is the largest absolute
difference between the kernel's and torch's outputs (they sum in different orders).
`--baseline-kernels` times another build's kernel beside this one ("base"), whose output must
equal this build's bit for bit.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from pagedserve.benchmarks.matmul import cpu_model, load_kernels, median_ms

CACHE_DTYPES = ("auto", "fp16", "int8", "fp8")
"""--kv-cache-dtype: "auto" keeps fp32 (the compute dtype here), the rest as the engine's."""
BLOCK_ORDERS = ("shuffled", "interleaved", "in-order")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", default="32x120,32x300,32x1000",
                        help="comma-separated SEQUENCESxKEYS: the batch's sequences and the "
                             "keys each one's query sees")
    parser.add_argument("--heads", default="9/3", help="query heads / KV heads (SmolLM2's)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30,
                        help="caches visited in turn by one timed call (SmolLM2 has 30 layers)")
    parser.add_argument("--kv-cache-dtype", choices=CACHE_DTYPES, default="fp16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--block-order", choices=BLOCK_ORDERS, default="shuffled")
    parser.add_argument("--iterations", type=int, default=7)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads (default: torch's)")
    parser.add_argument("--baseline-kernels", metavar="PATH",
                        help="another build's _cpu_ops*.so, timed beside this build's "
                             "(column 'base'); its output must equal this build's")


def block_table(sequences: int, blocks_per_sequence: int, order: str,
                generator: torch.Generator) -> torch.Tensor:
    """(sequences, blocks_per_sequence) block ids from 1 up (block 0 stays unused, as the pool's
    null block), placed as `order` says."""
    count = sequences * blocks_per_sequence
    if order == "shuffled":
        ids = torch.randperm(count, generator=generator)
    elif order == "interleaved":  # position p of every sequence, then position p + 1
        ids = torch.arange(count).view(blocks_per_sequence, sequences).t().flatten()
    else:
        ids = torch.arange(count)
    return (ids + 1).view(sequences, blocks_per_sequence)


def layer_cache(shape: tuple[int, ...], cache_dtype: str,
                generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One layer's cache (attention/kv_cache.py's layout): random K and V, quantized by the
    engine's quantize_kv unless `cache_dtype` is "auto"."""
    from pagedserve.attention.kv_cache import QUANTIZED_DTYPES, quantize_kv

    key, value = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    if cache_dtype == "auto":
        return key, value
    (key_codes, key_scale), (value_codes, value_scale) = (
        quantize_kv(x, QUANTIZED_DTYPES[cache_dtype]) for x in (key, value))
    return key_codes, value_codes, key_scale, value_scale


def measure(cases: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, layers: int,
            cache_dtype: str, block_size: int, block_order: str, iterations: int, seed: int = 0,
            baseline=None) -> list[dict]:
    """One record per (sequences, keys): median ms per layer of "kernel" (cold), "warm",
    "torch" (and "base": `baseline`'s kernel, cold), the cache bytes per layer, the max
    difference between the kernel and torch."""
    from pagedserve.attention.metadata import build_attention_metadata
    from pagedserve.attention.paged import decode_attention
    from pagedserve.kernels import cpu_ops

    ops = cpu_ops.load()
    if ops is None:
        raise RuntimeError("the compiled CPU kernels are unavailable (see `pagedserve serve`'s "
                           "log for why)")
    generator = torch.Generator().manual_seed(seed)
    scale = head_dim ** -0.5
    records = []
    for sequences, keys in cases:
        blocks_per_sequence = -(-keys // block_size)
        table = block_table(sequences, blocks_per_sequence, block_order, generator)
        shape = (kv_heads, sequences * blocks_per_sequence + 1, block_size, head_dim)
        caches = [layer_cache(shape, cache_dtype, generator) for _ in range(layers)]
        q = torch.randn(sequences, heads, head_dim, generator=generator)
        rows, lens = torch.arange(sequences), torch.full((sequences,), keys)
        meta = build_attention_metadata([(ids, keys - 1, keys) for ids in table.tolist()],
                                        block_size, caches, torch.device("cpu"))

        def attend(module, cache):
            return module.paged_attention(q, cache[0], cache[1], table, rows, lens, scale,
                                          *cache[2:])

        def kernel_pass(module, layer_caches):
            for cache in layer_caches:
                attend(module, cache)

        def torch_pass():
            for cache in caches:
                decode_attention(q, cache, meta, scale)

        calls = {"kernel": partial(kernel_pass, ops, caches),
                 "warm": partial(kernel_pass, ops, caches[:1] * layers),
                 "torch": torch_pass}
        first = caches[0]
        out = attend(ops, first)
        if baseline is not None:
            calls["base"] = partial(kernel_pass, baseline, caches)
            if not torch.equal(attend(baseline, first), out):
                raise RuntimeError(f"the baseline kernel's output differs from this build's at "
                                   f"{sequences} x {keys} keys")
        diff = (out - decode_attention(q, first, meta, scale)).abs().max().item()
        # the keys and values the queries see (codes and, quantized, their scales)
        cache_bytes = 2 * sequences * keys * kv_heads * (
            head_dim * first[0].element_size() + (first[2].element_size() if len(first) > 2
                                                  else 0))
        ms = {name: value / layers for name, value in median_ms(calls, iterations).items()}
        records.append({"sequences": sequences, "keys": keys, "ms": ms, "max_diff": diff,
                        "cache_bytes": cache_bytes})
        del caches, calls
    return records


def main(args: argparse.Namespace) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    cases = [tuple(int(v) for v in case.split("x")) for case in args.cases.split(",")]
    heads, kv_heads = (int(v) for v in args.heads.split("/"))
    baseline = load_kernels(args.baseline_kernels) if args.baseline_kernels else None
    records = measure(cases, heads, kv_heads, args.head_dim, args.layers, args.kv_cache_dtype,
                      args.block_size, args.block_order, args.iterations, baseline=baseline)
    names = ["kernel", "warm", "torch"] + (["base"] if baseline else [])
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, fp32 queries, "
          f"{'fp32' if args.kv_cache_dtype == 'auto' else args.kv_cache_dtype} cache "
          f"({args.block_order} blocks of {args.block_size}), "
          f"{heads} heads / {kv_heads} KV heads x {args.head_dim}; {args.layers} layers' "
          f"caches in turn, median of {args.iterations} calls, ms per layer (cold: GB/s)")
    print(f"{'seqs':>5}{'keys':>6}" + "".join(f"{name:>16}" for name in names)
          + f"{'torch / kernel':>16}" + (f"{'base / kernel':>15}" if baseline else "")
          + f"{'max diff':>10}")
    for record in records:
        ms = record["ms"]
        cells = "".join(
            f" {ms[name]:>8.3f}" + (f" ({record['cache_bytes'] / ms[name] / 1e6:>4.0f})"
                                    if name != "warm" else " " * 7)
            for name in names)
        base = f"{ms['base'] / ms['kernel']:>14.2f}x" if baseline else ""
        print(f"{record['sequences']:>5}{record['keys']:>6}{cells}"
              f"{ms['torch'] / ms['kernel']:>15.2f}x{base}{record['max_diff']:>10.1e}")
    return 0
