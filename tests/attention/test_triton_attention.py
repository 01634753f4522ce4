"""The Triton paged-attention kernels (kernels/triton_attention.py) against the torch backend and
the token-by-token reference: decodes, fresh prompts, prefill chunks with context and mixed
steps, GQA, head_dim 64 / 256, scattered block tables, padded (CUDA-graph) steps, long contexts,
sliding windows, int8 / fp8 caches, fp32 / bf16 / fp16; and the cache write, to the bit.

On cuda the kernels run compiled (with larger steps and a CUDA-graph replay besides); elsewhere
under the Triton interpreter (TRITON_INTERPRET=1, set before the kernels' module is imported),
which runs each program in numpy: the shapes stay small.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from tests.attention.batches import scattered_block_tables
from tests.triton_interpreter import ON_CUDA  # noqa: E402  (before the kernels)

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from pagedserve.attention.kv_cache import (  # noqa: E402
    KVCache,
    KVCacheSpec,
    dequantize_kv_cache,
    kv_cache_shape,
)
from pagedserve.attention.metadata import AttentionMetadata  # noqa: E402
from pagedserve.attention.paged import TorchAttentionBackend, write_kv_index_copy  # noqa: E402
from pagedserve.attention.reference import reference_paged_attention  # noqa: E402
from pagedserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedserve.kernels import triton_attention  # noqa: E402

DEVICE = "cuda" if ON_CUDA else "cpu"
assert triton_attention._INTERPRETED != ON_CUDA, (
    "the kernels' module was imported before TRITON_INTERPRET was set")

FP32_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
"""ieee fp32 products on both sides: only the order of the sums differs."""
HALF_TOLERANCE = {torch.bfloat16: dict(rtol=0, atol=3e-2), torch.float16: dict(rtol=0, atol=5e-3)}
"""Against the fp64 reference on the same (rounded) inputs: the probabilities are rounded to the
compute dtype before the product with V."""


@dataclass
class Step:
    q: torch.Tensor
    """(T + padded tokens, H, D) fp32; rows past T belong to no request."""
    kv_cache: KVCache
    meta: AttentionMetadata
    """Host lists of the B real requests (what the torch paths read); block_table and the device
    tensors also hold the padded requests, as a captured step does."""

    @property
    def num_tokens(self) -> int:
        return self.meta.query_start_loc[-1]


def make_step(
    query_lens: list[int], context_lens: list[int], *, num_heads: int = 6, num_kv_heads: int = 2,
    head_dim: int = 64, block_size: int = 4, kv_dtype: str = "auto",
    num_padded_seqs: int = 0, num_padded_tokens: int = 0, seed: int = 0,
) -> Step:
    """A random cache (every slot written, so stale KV is everywhere), scattered block tables,
    this step's K/V written by the torch backend; decodes first."""
    torch.manual_seed(seed)
    num_blocks, block_tables, slots = scattered_block_tables(query_lens, context_lens,
                                                             block_size, seed)
    spec = KVCacheSpec.create(kv_dtype, torch.float32, 1, num_kv_heads, head_dim, block_size)
    kv_cache = tuple(torch.zeros(shape, dtype=dtype, device=DEVICE)
                     for shape, dtype in zip(spec.shapes(num_blocks), spec.dtypes()))
    every_slot = torch.arange(num_blocks * block_size, device=DEVICE)
    # rows of varied magnitude, so quantization scales differ from token to token
    magnitude = torch.rand(len(every_slot), num_kv_heads, 1, device=DEVICE) * 4
    write_kv_index_copy(
        kv_cache, torch.randn(len(every_slot), num_kv_heads, head_dim, device=DEVICE) * magnitude,
        torch.randn(len(every_slot), num_kv_heads, head_dim, device=DEVICE), every_slot)
    num_tokens = sum(query_lens)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE) for _ in range(2))
    write_kv_index_copy(kv_cache, k, v, torch.tensor(slots, device=DEVICE))

    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    num_decodes = sum(1 for q in query_lens if q == 1)
    assert query_lens[:num_decodes] == [1] * num_decodes, "decodes must come first"
    query_start_loc = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    max_blocks = max(map(len, block_tables))
    block_table = [b + [0] * (max_blocks - len(b)) for b in block_tables]
    block_table += [[0] * max_blocks] * num_padded_seqs
    meta = AttentionMetadata(
        num_decodes=num_decodes,
        query_start_loc=query_start_loc,
        context_lens=list(context_lens),
        seq_lens=seq_lens,
        slot_mapping=torch.tensor(slots, device=DEVICE),
        block_table=torch.tensor(block_table, device=DEVICE),
        decode_seq_lens=torch.tensor(seq_lens[:num_decodes], device=DEVICE),
        kv_caches=[kv_cache],
        query_start_loc_tensor=torch.tensor(
            query_start_loc + [num_tokens] * num_padded_seqs, dtype=torch.int32, device=DEVICE),
        seq_lens_tensor=torch.tensor(seq_lens + [0] * num_padded_seqs, dtype=torch.int32,
                                     device=DEVICE),
    )
    q = torch.randn(num_tokens + num_padded_tokens, num_heads, head_dim, device=DEVICE)
    return Step(q, kv_cache, meta)


def torch_backend(step: Step, scale=None, sliding_window=None):
    # a copy: the torch prefill path scales an fp32 q in place
    q = step.q[: step.num_tokens].clone()
    return TorchAttentionBackend().forward(q, step.kv_cache, step.meta, scale, sliding_window)


def triton_forward(step: Step, scale=None, sliding_window=None, dtype=torch.float32,
                   num_kv_splits: int | None = None):
    """The kernel's rows of the B real requests' tokens."""
    key_cache, value_cache, *scales = step.kv_cache
    q = step.q.to(dtype)
    head_dim = q.shape[-1]
    out = triton_attention.paged_attention(
        q, key_cache, value_cache, torch.empty_like(q), step.meta.query_start_loc_tensor,
        step.meta.seq_lens_tensor, step.meta.block_table,
        head_dim**-0.5 if scale is None else scale, sliding_window, *scales,
        num_kv_splits=num_kv_splits)
    return out[: step.num_tokens]


def reference(step: Step, scale=None, sliding_window=None):
    """fp64 softmax over the (dequantized) cache."""
    return reference_paged_attention(step.q[: step.num_tokens], *dequantize_kv_cache(step.kv_cache),
                                     step.meta, scale, sliding_window)


BATCHES = {
    "decodes": ([1, 1, 1], [0, 5, 30]),  # one with an empty context
    "fresh prompt": ([7], [0]),
    "chunks with context": ([5, 9], [3, 16]),  # after earlier chunks / prefix-cache hits
    "mixed": ([1, 1, 13, 4, 4], [12, 3, 0, 21, 8]),  # the busy step: decodes first
}
SHAPES = {  # (num_heads, num_kv_heads, head_dim, block_size)
    "G3-d64-bs4": (6, 2, 64, 4),
    "G4-d256-bs16": (4, 1, 256, 16),
    "G1-d64-bs8": (2, 2, 64, 8),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("query_lens,context_lens", BATCHES.values(), ids=BATCHES.keys())
def test_fp32_matches_the_torch_backend(query_lens, context_lens, shape):
    num_heads, num_kv_heads, head_dim, block_size = shape
    step = make_step(query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=block_size)
    torch.testing.assert_close(triton_forward(step), torch_backend(step), **FP32_TOLERANCE)


@pytest.mark.parametrize("num_kv_splits", [2, 3])
def test_keys_split_across_programs_merge_to_the_one_pass_result(num_kv_splits):
    """Split-KV (chosen for steps too small to fill the GPU): each split attends a run of key
    tiles, a second kernel merges them. Some splits here get no tile at all."""
    step = make_step([1, 1, 5, 3], [130, 2, 100, 70], num_kv_heads=2, head_dim=64)
    expected = torch_backend(step)
    torch.testing.assert_close(triton_forward(step, num_kv_splits=num_kv_splits), expected,
                               **FP32_TOLERANCE)


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_padded_requests_and_tokens_change_nothing(num_kv_splits):
    """A CUDA-graph step: the batch padded with requests of no tokens and seq_len 0 (their
    block-table rows all the null block) and with token rows no request owns."""
    step = make_step([1, 1, 6], [9, 20, 5], num_padded_seqs=3, num_padded_tokens=5)
    step.q[step.num_tokens:] = float("nan")  # no request's queries: nothing may read them
    torch.testing.assert_close(triton_forward(step, num_kv_splits=num_kv_splits),
                               torch_backend(step), **FP32_TOLERANCE)


def test_long_context():
    """Past a thousand keys: many tiles per program, and (for the decodes) split-KV."""
    step = make_step([1, 1, 6], [1100, 40, 1030], num_heads=4, num_kv_heads=2, block_size=16)
    torch.testing.assert_close(triton_forward(step), torch_backend(step), **FP32_TOLERANCE)


@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1, 1, 1], [30, 45, 3]),  # decodes past the window (and one inside it)
        ([1, 6, 20], [37, 40, 29]),  # chunks after a long context, one longer than the window
    ],
)
def test_sliding_window_reads_no_block_it_has_passed(query_lens, context_lens):
    """A windowed layer sees the last `window` keys (itself included). Its KV cache group lets
    go of the blocks the window has passed, and another request may reuse them: here they hold
    NaN, which masking alone would not keep out (0 * NaN in the product with V)."""
    window, scale, block_size = 9, 0.1, 4
    step = make_step(query_lens, context_lens, block_size=block_size)
    expected = torch_backend(step, scale, window)
    torch.testing.assert_close(expected, reference(step, scale, window), **FP32_TOLERANCE)
    assert not torch.allclose(expected, reference(step, scale), atol=1e-3)  # the window acts
    table = step.meta.block_table
    reused = next(b for b in range(1, step.kv_cache[0].shape[1])
                  if b not in set(table.flatten().tolist()))
    for i, context_len in enumerate(context_lens):
        table[i, : max(0, context_len - window + 1) // block_size] = reused
    for cache in step.kv_cache:
        cache[:, reused] = float("nan")
    torch.testing.assert_close(triton_forward(step, scale, window), expected, **FP32_TOLERANCE)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_cache_matches_the_torch_backend(kv_dtype):
    """fp32 queries: the kernel scales its products per key, the torch path the dequantized
    values (code * scale): equal up to fp32 rounding."""
    step = make_step(*BATCHES["mixed"], kv_dtype=kv_dtype)
    torch.testing.assert_close(triton_forward(step), torch_backend(step), **FP32_TOLERANCE)


@pytest.mark.parametrize("query_lens,context_lens", [
    ([1, 1, 13, 4], [40, 3, 0, 21]),
    ([80], [20]),  # a long chunk: the tiles of prefill-heavy steps (64 query rows)
], ids=["mixed", "long chunk"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_its_rounding(dtype, kv_dtype, query_lens, context_lens):
    step = make_step(query_lens, context_lens, kv_dtype=kv_dtype)
    if kv_dtype == "auto":  # the cache in the compute dtype; the reference reads the same values
        step.kv_cache = tuple(cache.to(dtype) for cache in step.kv_cache)
    step.q = step.q.to(dtype).float()
    actual = triton_forward(step, dtype=dtype)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), reference(step), **HALF_TOLERANCE[dtype])


def test_backend_reads_only_the_device_tensors():
    """TritonAttentionBackend on a KVCache tuple: the host lists may be stale (a replayed
    graph's), the kernels never see them."""
    step = make_step(*BATCHES["mixed"], kv_dtype="int8")
    expected = torch_backend(step)
    backend = TritonAttentionBackend()
    step.meta.query_start_loc, step.meta.seq_lens = [0], []  # stale host data
    step.meta.context_lens, step.meta.num_decodes = [], 0
    actual = backend.forward(step.q, step.kv_cache, step.meta)[: expected.shape[0]]
    torch.testing.assert_close(actual, expected, **FP32_TOLERANCE)
    step.meta.query_start_loc_tensor = None
    with pytest.raises(ValueError, match="device tensors"):
        backend.forward(step.q, step.kv_cache, step.meta)


# ---- write_kv ---------------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize(
    "kv_dtype,compute_dtype",
    [("auto", torch.float32), ("auto", torch.bfloat16), ("auto", torch.float16),
     ("int8", torch.float32), ("int8", torch.bfloat16), ("fp8", torch.float32),
     ("fp8", torch.bfloat16)],
)
def test_write_kv_stores_the_torch_bits(kv_dtype, compute_dtype):
    """Rows of every magnitude (zero, below the smallest scale, past the largest), and rows whose
    codes fall exactly half-way (absmax 127: scale 1, so x.5 must round to even)."""
    spec = KVCacheSpec.create(kv_dtype, compute_dtype, 1, 3, 64, 4)
    torch_cache, kernel_cache = (
        tuple(torch.zeros(shape, dtype=dtype, device=DEVICE)
              for shape, dtype in zip(spec.shapes(10), spec.dtypes())) for _ in range(2))
    torch.manual_seed(0)
    magnitudes = torch.tensor([1, 1e-3, 1e-9, 0, 300, 1e7, 1], device=DEVICE)
    k = torch.randn(7, 3, 64, device=DEVICE) * magnitudes[:, None, None]
    k[6] = torch.arange(64, device=DEVICE) - 31.5  # .5 everywhere ...
    k[6, :, 0] = 127  # ... under scale 1
    v = torch.randn(7, 3, 64, device=DEVICE)
    k, v = k.to(compute_dtype), v.to(compute_dtype)
    slots = torch.tensor([7, 0, 39, 12, 13, 21, 30], device=DEVICE)
    write_kv_index_copy(torch_cache, k, v, slots)
    key_cache, value_cache, *scales = kernel_cache
    triton_attention.write_kv(key_cache, value_cache, k, v, slots, *scales)
    for expected, actual in zip(torch_cache, kernel_cache):
        assert torch.equal(_bits(actual), _bits(expected))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_write_kv_skips_negative_slots(kv_dtype):
    """Slot -1 (a padded row of a captured step) writes nothing: the poisoned cache stays."""
    spec = KVCacheSpec.create(kv_dtype, torch.bfloat16, 1, 2, 64, 4)
    kv_cache = tuple(torch.full(shape, 3, dtype=dtype, device=DEVICE)
                     for shape, dtype in zip(spec.shapes(6), spec.dtypes()))
    poisoned = tuple(t.clone() for t in kv_cache)
    k, v = (torch.randn(5, 2, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.tensor([5, -1, 17, -1, -1], device=DEVICE)
    TritonAttentionBackend().write_kv(kv_cache, k, v, slots)
    expected = tuple(t.clone() for t in poisoned)
    write_kv_index_copy(expected, k[[0, 2]], v[[0, 2]], slots[[0, 2]])
    for cache, want, before in zip(kv_cache, expected, poisoned):
        assert torch.equal(cache, want)
        assert not torch.equal(cache, before)  # the real rows did land


# ---- compiled only ----------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not ON_CUDA, reason="too large for the interpreter")


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_large_mixed_step(dtype, kv_dtype):
    """64 requests with contexts up to 2,000: 48 decodes, then chunks of up to 300 tokens."""
    rng = random.Random(1)
    query_lens = [1] * 48 + [rng.randint(2, 300) for _ in range(16)]
    context_lens = [rng.randint(0, 2000) for _ in range(64)]
    step = make_step(query_lens, context_lens, num_heads=16, num_kv_heads=4, head_dim=128,
                     block_size=16, kv_dtype=kv_dtype, num_padded_seqs=4)
    if dtype != torch.float32:
        if kv_dtype == "auto":
            step.kv_cache = tuple(cache.to(dtype) for cache in step.kv_cache)
        step.q = step.q.to(dtype).float()
    actual = triton_forward(step, dtype=dtype).float()
    # fp32 sums over up to 2,300 keys: torch's own fp32 paths are 1e-5 off the reference here
    tolerance = dict(rtol=1e-5, atol=3e-5) if dtype == torch.float32 else HALF_TOLERANCE[dtype]
    torch.testing.assert_close(actual, reference(step), **tolerance)


@cuda_only
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,kv_dtype", [
    (8, 2, 128, "auto"), (8, 2, 128, "int8"), (4, 2, 256, "auto"), (4, 4, 64, "fp8"),
])
def test_long_chunks_take_the_prefill_tiles(num_heads, num_kv_heads, head_dim, kv_dtype):
    """bf16 steps of long chunks (64 or 128 query rows per program, longer key tiles)."""
    step = make_step([600, 300], [0, 700], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=16, kv_dtype=kv_dtype)
    if kv_dtype == "auto":
        step.kv_cache = tuple(cache.bfloat16() for cache in step.kv_cache)
    step.q = step.q.bfloat16().float()
    expected = torch_backend(Step(step.q, dequantize_kv_cache(step.kv_cache), step.meta))
    torch.testing.assert_close(triton_forward(step, dtype=torch.bfloat16).float(), expected,
                               **HALF_TOLERANCE[torch.bfloat16])


@cuda_only
def test_cuda_graph_replay_reads_the_refilled_metadata():
    """Capture write_kv + attention once for a padded decode step; replay it for other requests
    (other lengths, tables and queries, copied into the same buffers): as eager."""
    backend = TritonAttentionBackend()
    first = make_step([1] * 6, [50, 300, 7, 1000, 64, 129], num_heads=8, num_kv_heads=2,
                      block_size=16, num_padded_seqs=2, num_padded_tokens=2, seed=1)
    second = make_step([1] * 5, [900, 3, 33, 250, 17], num_heads=8, num_kv_heads=2,
                       block_size=16, num_padded_seqs=3, num_padded_tokens=3, seed=2)
    num_blocks = max(s.kv_cache[0].shape[1] for s in (first, second))
    max_blocks = max(s.meta.block_table.shape[1] for s in (first, second))
    kv_cache = tuple(torch.randn(kv_cache_shape(num_blocks, 16, 2, 64), device=DEVICE)
                     for _ in range(2))
    q, k, v = (torch.zeros(8, h, 64, device=DEVICE) for h in (8, 2, 2))
    slot_mapping = torch.full((8,), -1, dtype=torch.int64, device=DEVICE)
    query_start_loc = torch.zeros(9, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    block_table = torch.zeros(8, max_blocks, dtype=torch.int64, device=DEVICE)
    meta = AttentionMetadata(  # host lists empty: the backend must not need them
        num_decodes=0, query_start_loc=[], context_lens=[], seq_lens=[],
        slot_mapping=slot_mapping, block_table=block_table, decode_seq_lens=seq_lens,
        kv_caches=[kv_cache], query_start_loc_tensor=query_start_loc, seq_lens_tensor=seq_lens)

    def refill(step: Step, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        num_tokens = step.num_tokens
        q.copy_(step.q)
        k.zero_()
        v.zero_()
        k[:num_tokens], v[:num_tokens] = new_k, new_v
        slot_mapping.fill_(-1)
        slot_mapping[:num_tokens] = step.meta.slot_mapping
        query_start_loc.copy_(step.meta.query_start_loc_tensor)
        seq_lens.copy_(step.meta.seq_lens_tensor)
        block_table.zero_()
        table = step.meta.block_table
        block_table[:, : table.shape[1]] = table

    def run() -> torch.Tensor:
        backend.write_kv(kv_cache, k, v, slot_mapping)
        return backend.forward(q, kv_cache, meta)

    new_kv = [(torch.randn(s.num_tokens, 2, 64, device=DEVICE),
               torch.randn(s.num_tokens, 2, 64, device=DEVICE)) for s in (first, second)]
    refill(first, *new_kv[0])
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run()
    for step, (new_k, new_v) in zip((second, first), reversed(new_kv)):
        refill(step, new_k, new_v)
        graph.replay()
        replayed = graph_out[: step.num_tokens].clone()
        eager = run()[: step.num_tokens]
        torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
        eager_step = Step(step.q, kv_cache, step.meta)
        torch.testing.assert_close(replayed, torch_backend(eager_step), **FP32_TOLERANCE)
