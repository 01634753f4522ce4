"""The fast paged attention against the token-by-token reference, on a mixed batch.

Random caches, scattered (non-contiguous) block tables, decodes and prefill chunks with and
without earlier context, GQA. Every test runs twice: on the compiled CPU kernels' backend (which
takes decodes and steps of up to KERNEL_MAX_TOKENS tokens) and on the plain-torch backend.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import sys

import pytest
import torch

from pagedserve.attention import AttentionBackend, create_attention_backend
from pagedserve.attention.cpu_kernel_backend import CpuKernelAttentionBackend
from pagedserve.attention.kv_cache import kv_cache_shape
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.paged import PREFILL_QUERY_BLOCK, TorchAttentionBackend
from pagedserve.attention.reference import reference_paged_attention
from pagedserve.kernels import cpu_ops

BLOCK_SIZE = 4
SPLIT_KEYS = 512
"""csrc/cpu_ops.cpp kSplitKeys: decodes past it are attended in slices of it."""


@pytest.fixture(params=["kernel", "torch"])
def backend(request) -> AttentionBackend:
    if request.param == "torch":
        backend = create_attention_backend("cpu", torch.float32, None)
        assert isinstance(backend, TorchAttentionBackend)
        return backend
    kernels = cpu_ops.load()
    if kernels is None:
        pytest.skip("the compiled CPU kernels are unavailable here")
    backend = create_attention_backend("cpu", torch.float32, kernels)
    assert isinstance(backend, CpuKernelAttentionBackend)
    return backend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16


def build_batch(backend, query_lens, context_lens, num_blocks=64, seed=0):
    num_blocks = max(num_blocks, 2 + sum(-(-(q + c) // BLOCK_SIZE) for q, c in zip(query_lens, context_lens)))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    block_tables, slots = [], []
    for q_len, ctx in zip(query_lens, context_lens):
        seq_len = ctx + q_len
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        block_tables.append(blocks)
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx, seq_len)]
    max_blocks = max(map(len, block_tables))
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    num_decodes = sum(1 for q in query_lens if q == 1)
    assert query_lens[:num_decodes] == [1] * num_decodes, "decodes must come first"
    cache_shape = kv_cache_shape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(cache_shape), torch.randn(cache_shape)
    meta = AttentionMetadata(
        num_decodes=num_decodes,
        query_start_loc=[0] + list(torch.tensor(query_lens).cumsum(0).tolist()),
        context_lens=list(context_lens),
        seq_lens=seq_lens,
        slot_mapping=torch.tensor(slots),
        block_table=torch.tensor([b + [0] * (max_blocks - len(b)) for b in block_tables]),
        decode_seq_lens=torch.tensor(seq_lens[:num_decodes]),
        kv_caches=[(key_cache, value_cache)],
    )
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    backend.write_kv((key_cache, value_cache), k, v, meta.slot_mapping)
    return q, key_cache, value_cache, meta


@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1, 1, 1], [0, 5, 30]),  # decodes only, one with an empty context
        ([7], [0]),  # one fresh prompt
        ([5, 9], [3, 16]),  # prefill chunks after earlier chunks / cache hits
        ([1, 1, 13, 4, 1 + 3], [12, 3, 0, 21, 8]),  # the mixed batch of a busy step
        # longer than PREFILL_QUERY_BLOCK: several query blocks, each with its causal limit
        ([1, 300], [40, 0]),
        ([2 * PREFILL_QUERY_BLOCK + 5], [37]),
        # past SPLIT_KEYS: the kernel attends in slices and merges them
        ([1, 1, 1, 1, 2], [SPLIT_KEYS - 1, SPLIT_KEYS, 3 * SPLIT_KEYS + 7, 40, 2 * SPLIT_KEYS]),
    ],
)
def test_fast_matches_reference(backend, query_lens, context_lens):
    q, key_cache, value_cache, meta = build_batch(backend, query_lens, context_lens)
    q_before = q.clone()
    actual = backend.forward(q, (key_cache, value_cache), meta)
    assert torch.equal(q, q_before), "attention wrote to its query"  # fp32: q.float() is q
    expected = reference_paged_attention(q, key_cache, value_cache, meta)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_a_long_decode_gives_the_same_bits_alone_and_in_a_batch(backend):
    """The kernel's slices of a long sequence depend on its length alone: the batch, and so the
    tasks the threads share, change nothing. (The torch path pads every decode to the batch's
    longest, which may change the last bits: it makes no such promise.)"""
    if not isinstance(backend, CpuKernelAttentionBackend):
        pytest.skip("a property of the compiled kernel")
    query_lens, context_lens = [1, 1, 1, 5], [3 * SPLIT_KEYS + 7, 9, 2 * SPLIT_KEYS, 11]
    q, key_cache, value_cache, meta = build_batch(backend, query_lens, context_lens)
    batch = backend.forward(q, (key_cache, value_cache), meta)
    for i in range(3):
        alone = dataclasses.replace(
            meta, num_decodes=1, query_start_loc=[0, 1], context_lens=[meta.context_lens[i]],
            seq_lens=[meta.seq_lens[i]], slot_mapping=meta.slot_mapping[i:i + 1],
            block_table=meta.block_table[i:i + 1], decode_seq_lens=meta.decode_seq_lens[i:i + 1],
            backend_state={})
        assert torch.equal(backend.forward(q[i:i + 1], (key_cache, value_cache), alone), batch[i:i + 1])


def test_write_kv_lands_in_the_slots_the_table_names(backend):
    _q, key_cache, value_cache, meta = build_batch(backend, [1, 3], [6, 2])
    k = torch.randn(4, NUM_KV_HEADS, HEAD_DIM)
    backend.write_kv((key_cache, value_cache), k, k, meta.slot_mapping)
    block_table = meta.block_table.tolist()
    # row 1 has 2 tokens of context and 3 new ones: batch tokens 1..3 go to positions 2..4
    for j, pos in enumerate(range(2, 5), start=1):
        block = block_table[1][pos // BLOCK_SIZE]
        torch.testing.assert_close(key_cache[:, block, pos % BLOCK_SIZE], k[j])


def test_decode_mask_ignores_stale_blocks_past_the_sequence(backend):
    """Padded block-table entries (block 0) and stale slots past seq_len must not leak in."""
    q, key_cache, value_cache, meta = build_batch(backend, [1, 1], [2, 40])
    expected = backend.forward(q, (key_cache, value_cache), meta)
    key_cache[:, 0].fill_(1e4)  # the null block the short request's table is padded with
    torch.testing.assert_close(backend.forward(q, (key_cache, value_cache), meta), expected)


def _use_head_shape(monkeypatch, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """build_batch's head shape for this test (it reads the module's constants)."""
    for name, value in (("NUM_HEADS", num_heads), ("NUM_KV_HEADS", num_kv_heads),
                        ("HEAD_DIM", head_dim)):
        monkeypatch.setattr(sys.modules[__name__], name, value)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 1, 256)])
def test_bf16_matches_reference_within_bf16_rounding(backend, num_heads, num_kv_heads, head_dim,
                                                     monkeypatch):
    """The bf16 path computes decode scores in bf16 (see _decode_attention): bound the error, at
    the head dims of the real models (SmolLM2 and Qwen 64, Llama 128, Gemma 3 256)."""
    _use_head_shape(monkeypatch, num_heads, num_kv_heads, head_dim)
    q, key_cache, value_cache, meta = build_batch(backend, [1, 1, 1, 20], [7, 100, 33, 40])
    expected = reference_paged_attention(q, key_cache, value_cache, meta)
    actual = backend.forward(
        q.bfloat16(), (key_cache.bfloat16(), value_cache.bfloat16()), meta
    ).float()
    torch.testing.assert_close(actual, expected, rtol=0, atol=3e-2)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (9, 3, 64),  # SmolLM2's shape: a KV head's 3 query heads are one row group of the kernel
    (14, 2, 64),  # Qwen2.5-0.5B's: group 7, so a row group spans two or three tokens
    (8, 2, 128),
    (4, 1, 256),  # Gemma-3-270M's: one row per pass over the keys
])
@pytest.mark.parametrize("query_lens,context_lens", [([1, 300], [40, 0]), ([200, 70], [37, 500])])
def test_bf16_prefill_chunks_match_reference(backend, query_lens, context_lens, num_heads,
                                             num_kv_heads, head_dim, monkeypatch):
    """Long bf16 chunks: on the CPU the flash-style prefill kernel (probabilities rounded to bf16
    before the value product, as a bf16 matmul would), else the torch matmuls."""
    _use_head_shape(monkeypatch, num_heads, num_kv_heads, head_dim)
    q, key_cache, value_cache, meta = build_batch(backend, query_lens, context_lens)
    expected = reference_paged_attention(q, key_cache, value_cache, meta)
    actual = backend.forward(
        q.bfloat16(), (key_cache.bfloat16(), value_cache.bfloat16()), meta
    ).float()
    torch.testing.assert_close(actual, expected, rtol=0, atol=3e-2)


@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1, 1, 1], [0, 5, 30]),  # decodes: one inside the window, two past it
        ([40], [0]),  # a fresh prompt longer than the window
        ([1, 1, 13, 4, 4], [12, 3, 0, 21, 8]),  # a mixed step
        ([1, 2 * PREFILL_QUERY_BLOCK + 5], [3, 37]),  # several query blocks
    ],
)
def test_sliding_window_and_scale_match_reference(backend, query_lens, context_lens):
    """A windowed layer (Gemma 3's local layers) sees only the last `window` keys, itself
    included; the kernels' backend hands such steps to the torch paths."""
    q, key_cache, value_cache, meta = build_batch(backend, query_lens, context_lens)
    window, scale = 9, 0.1
    expected = reference_paged_attention(q, key_cache, value_cache, meta, scale, window)
    actual = backend.forward(q, (key_cache, value_cache), meta, scale, window)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    # and the window acted: without it the output differs
    unwindowed = reference_paged_attention(q, key_cache, value_cache, meta, scale)
    assert not torch.allclose(unwindowed, expected, atol=1e-3)


@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1, 1, 1], [30, 45, 3]),  # decodes past the window (and one inside it)
        ([1, 6, 2 * PREFILL_QUERY_BLOCK + 5], [37, 40, 29]),  # chunks after a long context
    ],
)
def test_a_window_reads_no_block_it_has_passed(backend, query_lens, context_lens):
    """A windowed KV cache group lets go of the blocks its window has passed, and another
    request may reuse them: the layer must not read them at all. Here they hold NaN, which
    masking alone would not stop (0 * NaN in the product with V)."""
    q, key_cache, value_cache, meta = build_batch(backend, query_lens, context_lens)
    window = 9
    expected = reference_paged_attention(q, key_cache, value_cache, meta, 0.1, window)
    table = meta.block_table.clone()
    reused = next(b for b in range(1, key_cache.shape[1]) if b not in set(table.flatten().tolist()))
    num_let_go = 0
    for i, context_len in enumerate(context_lens):
        first = max(0, context_len - window + 1) // BLOCK_SIZE
        table[i, :first] = reused
        num_let_go += first
    assert num_let_go > 0
    key_cache[:, reused], value_cache[:, reused] = float("nan"), float("nan")
    meta.block_table = table
    actual = backend.forward(q, (key_cache, value_cache), meta, 0.1, window)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_a_short_sequence_gets_the_same_bits_beside_a_long_prefill(backend, head_dim, monkeypatch):
    """Each sequence goes to the kernel its own query count picks (decodes and chunks of at most
    KERNEL_MAX_TOKENS: the short-step kernel), whatever else its step holds: a short prompt gets
    the same bits alone as beside a long prefill chunk, and both match the reference (head_dim
    64: the real models', with the kernel's vectorized weighted sum)."""
    if not isinstance(backend, CpuKernelAttentionBackend):
        pytest.skip("a property of the compiled kernel's backend")
    monkeypatch.setattr(sys.modules[__name__], "HEAD_DIM", head_dim)  # build_batch reads it
    query_lens, context_lens = [1, 21, 60, 9], [30, 0, 5, 14]
    q, key_cache, value_cache, meta = build_batch(backend, query_lens, context_lens)
    batch = backend.forward(q, (key_cache, value_cache), meta)
    expected = reference_paged_attention(q, key_cache, value_cache, meta)
    torch.testing.assert_close(batch, expected, rtol=1e-4, atol=1e-4)
    for i in (1, 3):  # the short prompt and the short chunk, each alone
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        alone = dataclasses.replace(
            meta, num_decodes=0, query_start_loc=[0, end - start],
            context_lens=[meta.context_lens[i]], seq_lens=[meta.seq_lens[i]],
            slot_mapping=meta.slot_mapping[start:end], block_table=meta.block_table[i:i + 1],
            decode_seq_lens=meta.decode_seq_lens[:0], backend_state={})
        assert torch.equal(backend.forward(q[start:end], (key_cache, value_cache), alone),
                           batch[start:end])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8, torch.float8_e4m3fn,
                                         torch.float16], ids=["fp32", "int8", "fp8", "fp16"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (14, 2, 64), (8, 4, 128),
                                                             (6, 2, 16)])
def test_query_heads_sharing_a_kv_head_get_the_bits_of_one_head_each(num_heads, num_kv_heads,
                                                                     head_dim, cache_dtype):
    """The kernel scores the query heads of a KV head together (on AVX2 three per pass over the
    keys, and against a quantized cache each value row's codes widened once for three heads);
    with each KV head copied once per query head (group 1) every head is attended alone. Both
    must give the same bits."""
    kernels = cpu_ops.load()
    if kernels is None:
        pytest.skip("the compiled CPU kernels are unavailable here")
    group, num_seqs, block_size, seq_len = num_heads // num_kv_heads, 3, 16, 300
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    if cache_dtype == torch.float32:
        caches = [torch.randn(shape), torch.randn(shape)]
    else:  # codes and per-row fp16 scales (attention/kv_cache.py's layout)
        caches = [(torch.randn(shape) * 40).clamp(-127, 127).to(cache_dtype) for _ in range(2)]
        caches += [(torch.rand(shape[:3]) * 0.05 + 0.001).half() for _ in range(2)]
    table = torch.arange(1, num_blocks).view(num_seqs, blocks_per_seq)
    rows, lens = torch.arange(num_seqs), torch.tensor([seq_len, seq_len - 5, 37])
    q = torch.randn(num_seqs, num_heads, head_dim)
    key_cache, value_cache, *scales = caches
    grouped = kernels.paged_attention(q, key_cache, value_cache, table, rows, lens, 0.125, *scales)
    copied = [c.repeat_interleave(group, 0) for c in caches]
    one_each = kernels.paged_attention(q, copied[0], copied[1], table, rows, lens, 0.125,
                                       *copied[2:])
    assert torch.equal(grouped, one_each)


def _prefill_kernel_or_skip():
    kernels = cpu_ops.load()
    if kernels is None:
        pytest.skip("the compiled CPU kernels are unavailable here")
    if not kernels.prefill_attention_f32_supported():
        pytest.skip("the fp32 prefill kernel needs AVX2 and FMA (csrc/prefill_attention_f32.h)")
    return kernels


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (9, 3, 64),  # SmolLM2's shape: one 3-head tile per KV head
    (8, 2, 64),  # group 4: two 2-head tiles
    (5, 1, 32),  # group 5: a 3-head tile and a 2-head tile
    (4, 4, 128),  # no GQA: 1-head tiles
])
@pytest.mark.parametrize("num_tokens,context_len", [(45, 0), (203, 37), (64, 500)])
def test_fp32_prefill_kernel_matches_reference(num_heads, num_kv_heads, head_dim, num_tokens,
                                               context_len, monkeypatch):
    """The fp32 prefill kernel, called directly, against the token-by-token reference: chunks
    with and without context, ends that fill part of the kernel's 8-token blocks, every head
    tile it takes. Then through the backend: a chunk longer than KERNEL_MAX_TOKENS is the
    kernel's (same bits as the direct call), with the short-step kernel's decodes beside it."""
    kernels = _prefill_kernel_or_skip()
    _use_head_shape(monkeypatch, num_heads, num_kv_heads, head_dim)
    backend = create_attention_backend("cpu", torch.float32, kernels)
    q, key_cache, value_cache, meta = build_batch(backend, [1, 1, num_tokens], [9, 70, context_len])
    start = meta.query_start_loc[2]
    direct = kernels.prefill_attention(q[start:], key_cache, value_cache, meta.block_table[2],
                                       context_len, head_dim ** -0.5)
    expected = reference_paged_attention(q, key_cache, value_cache, meta)
    torch.testing.assert_close(direct, expected[start:], rtol=1e-4, atol=1e-4)
    batch = backend.forward(q, (key_cache, value_cache), meta)
    assert torch.equal(batch[start:], direct)
    torch.testing.assert_close(batch, expected, rtol=1e-4, atol=1e-4)


def test_fp32_prefill_kernel_reads_no_key_past_its_chunk():
    """A chunk's last block holds stale slots past the sequence, and the kernel's last 8-token
    block may run past the chunk's end: neither may reach the output (NaN there would)."""
    kernels = _prefill_kernel_or_skip()
    heads, kv_heads, head_dim, block_size = 6, 2, 16, 16
    num_tokens, context_len = 37, 6  # positions 0..42: block 2 holds 43..47 unused
    key_cache = torch.randn(kv_heads, 4, block_size, head_dim)
    value_cache = torch.randn(kv_heads, 4, block_size, head_dim)
    table = torch.tensor([3, 1, 2])
    key_cache[:, 2, 11:], value_cache[:, 2, 11:] = float("nan"), float("nan")
    key_cache[:, 0], value_cache[:, 0] = float("nan"), float("nan")  # a block not in the table
    q = torch.randn(num_tokens, heads, head_dim)
    out = kernels.prefill_attention(q, key_cache, value_cache, table, context_len, 0.25)
    assert torch.isfinite(out).all()


def test_bench_attention_times_the_kernel_beside_the_torch_path(capsys, tmp_path):
    """`pagedserve bench attention` times both paths on each chunk, and another build's kernel
    (here a copy of this build's file: loaded from its own path, it is a module of its own, and
    its output equals this build's bit for bit), and prints a row per case (timings: only their
    presence is checked) with the outputs' difference to torch's, which must be rounding only."""
    kernels = _prefill_kernel_or_skip()
    from pagedserve.benchmarks import attention
    from pagedserve.benchmarks.matmul import load_kernels
    from pagedserve.entrypoints.cli import build_parser

    copy = shutil.copy(kernels.__file__, tmp_path)
    records = attention.measure([(40, 0), (35, 21)], heads=6, kv_heads=2, head_dim=16,
                                dtype=torch.float32, block_size=4, iterations=2,
                                baseline=load_kernels(copy))
    assert [(r["tokens"], r["context"]) for r in records] == [(40, 0), (35, 21)]
    assert all(set(r["ms"]) == {"kernel", "torch", "base"} and min(r["ms"].values()) > 0
               for r in records)
    assert all(r["max_diff"] < 1e-4 and r["base_diff"] == 0 for r in records)
    args = build_parser().parse_args(["bench", "attention", "--cases", "33+0,40+9", "--heads",
                                      "4/2", "--head-dim", "32", "--iterations", "1",
                                      "--baseline-kernels", copy])
    assert args.func(args) == 0
    table = capsys.readouterr().out.splitlines()
    assert "4 heads / 2 KV heads x 32" in table[0] and "base / kernel" in table[1]
    assert [line.split()[:2] for line in table[2:]] == [["33", "0"], ["40", "9"]]
    assert all(line.split()[-1] == "0.0e+00" for line in table[2:])  # base diff: same bits


@pytest.mark.parametrize("order", ["shuffled", "interleaved", "in-order"])
def test_decode_bench_block_tables_place_every_block_once(order):
    """Each order hands out blocks 1..N once (0 stays the pool's null block); interleaved puts
    block position p of sequence i at p * sequences + i + 1, as a decode batch allocates them."""
    from pagedserve.benchmarks.decode_attention import block_table

    table = block_table(3, 4, order, torch.Generator().manual_seed(0))
    assert table.shape == (3, 4)
    assert sorted(table.flatten().tolist()) == list(range(1, 13))
    if order == "interleaved":
        assert table[1].tolist() == [2, 5, 8, 11]
    if order == "in-order":
        assert table[1].tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_bench_decode_attention_times_the_kernel_over_layers(cache_dtype, capsys, tmp_path):
    """`pagedserve bench decode-attention` times the kernel over every layer's cache (cold), over
    one layer's (warm), the torch path, and another build's kernel, whose output must equal this
    build's bit for bit (here a copy of this build's file: loaded from its own path, it is a
    module of its own); the kernel and torch differ by rounding only. Timings: only their
    presence is checked."""
    kernels = cpu_ops.load()
    if kernels is None:
        pytest.skip("the compiled CPU kernels are unavailable here")
    from pagedserve.benchmarks import decode_attention
    from pagedserve.benchmarks.matmul import load_kernels
    from pagedserve.entrypoints.cli import build_parser

    records = decode_attention.measure(
        [(3, 21), (2, 40)], heads=4, kv_heads=2, head_dim=16, layers=3, cache_dtype=cache_dtype,
        block_size=4, block_order="interleaved", iterations=2,
        baseline=load_kernels(shutil.copy(kernels.__file__, tmp_path)))
    assert [(r["sequences"], r["keys"]) for r in records] == [(3, 21), (2, 40)]
    assert all(set(r["ms"]) == {"kernel", "warm", "torch", "base"} and min(r["ms"].values()) > 0
               for r in records)
    assert all(r["max_diff"] < 1e-4 for r in records)
    per_key = 2 * 2 * 16 * (4 if cache_dtype == "auto" else 1 + 2 / 16)  # K, V; 2 KV heads
    assert records[0]["cache_bytes"] == 3 * 21 * per_key
    args = build_parser().parse_args(["bench", "decode-attention", "--cases", "2x30,4x17",
                                      "--heads", "4/2", "--head-dim", "32", "--layers", "2",
                                      "--iterations", "1", "--kv-cache-dtype", cache_dtype])
    assert args.func(args) == 0
    table = capsys.readouterr().out.splitlines()
    assert "4 heads / 2 KV heads x 32" in table[0] and "torch / kernel" in table[1]
    assert [line.split()[:2] for line in table[2:]] == [["2", "30"], ["4", "17"]]
