"""The persistent step buffers (worker/step_inputs.py) against the per-step metadata builder: the
same slots, block tables and offsets, and a padded step as a CUDA graph replays it. Runs on the
CPU (the buffers are device-agnostic; only their host side is pinned on cuda)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.attention.metadata import build_grouped_attention_metadata
from pagedserve.worker.step_inputs import PAD_SLOT, NoHostData, StepInputs

BLOCK_SIZE = 4


def random_step(rng: random.Random, num_groups: int, num_decodes: int, chunk_lens: list[int]):
    """Decodes first, then prefill chunks with earlier context: (chunks, ids, positions)."""
    free = list(range(1, 400))
    rng.shuffle(free)
    chunks, input_ids, positions = [], [], []
    for query_len in [1] * num_decodes + chunk_lens:
        context = rng.randrange(0, 30)
        end = context + query_len
        tables = tuple([free.pop() for _ in range(-(-end // BLOCK_SIZE))]
                       for _ in range(num_groups))
        chunks.append((tables, context, end))
        input_ids += [rng.randrange(1000) for _ in range(query_len)]
        positions += range(context, end)
    return chunks, input_ids, positions


@pytest.mark.parametrize("num_groups", [1, 2])
def test_staged_step_equals_the_built_metadata(num_groups):
    rng = random.Random(num_groups)
    inputs = StepInputs(64, 16, 16, num_groups, BLOCK_SIZE, torch.device("cpu"))
    layer_groups = (0, 1) if num_groups == 2 else ()
    for step in range(4):  # the staging buffers alternate: every step must stand alone
        chunks, input_ids, positions = random_step(rng, num_groups, 3 + step, [5, 2][: step % 3])
        ids, pos, meta = inputs.stage(input_ids, positions, chunks, [], layer_groups)
        built = build_grouped_attention_metadata(chunks, BLOCK_SIZE, [], "cpu", layer_groups)
        assert ids.tolist() == input_ids and pos.tolist() == positions
        for group in range(num_groups):
            ours = meta if group == 0 else meta.other_groups[group - 1]
            theirs = built if group == 0 else built.other_groups[group - 1]
            assert torch.equal(ours.slot_mapping, theirs.slot_mapping)
            assert torch.equal(ours.block_table, theirs.block_table)
        assert meta.query_start_loc == built.query_start_loc
        assert meta.seq_lens == built.seq_lens and meta.context_lens == built.context_lens
        assert meta.num_decodes == built.num_decodes == 3 + step
        assert meta.query_start_loc_tensor.tolist() == built.query_start_loc
        assert meta.seq_lens_tensor.tolist() == built.seq_lens
        assert meta.decode_seq_lens.tolist() == built.decode_seq_lens.tolist()
        assert meta.layer_groups == layer_groups


def test_a_padded_step_puts_its_padding_in_block_sized_sequences_over_the_null_block():
    rng = random.Random(7)
    inputs = StepInputs(64, 32, 16, 1, BLOCK_SIZE, torch.device("cpu"))
    # A larger step first, so padding must overwrite what it left in the buffers.
    chunks, input_ids, positions = random_step(rng, 1, 20, [9])
    inputs.stage(input_ids, positions, chunks, [], ())
    chunks, input_ids, positions = random_step(rng, 1, 5, [3])
    num_tokens, num_seqs, size = len(input_ids), len(chunks), 16
    num_padding = size - num_tokens  # 8: two sequences of a block each
    ids, pos, meta = inputs.stage(input_ids, positions, chunks, [], (), size)
    assert ids.shape == pos.shape == meta.slot_mapping.shape == (size,)
    assert ids[num_tokens:].eq(0).all()
    assert pos[num_tokens:].tolist() == [0, 1, 2, 3] * 2
    assert meta.slot_mapping[num_tokens:].eq(PAD_SLOT).all()  # no KV written for them
    built = build_grouped_attention_metadata(chunks, BLOCK_SIZE, [], "cpu")
    assert torch.equal(meta.slot_mapping[:num_tokens], built.slot_mapping)
    # Six real sequences, the padding's two (over block 0, the null block), then eight empty.
    query_start_loc = meta.query_start_loc_tensor.tolist()
    assert query_start_loc == (built.query_start_loc + [num_tokens + 4, size]
                               + [size] * (size - num_seqs - 2))
    seq_lens = meta.seq_lens_tensor.tolist()
    assert seq_lens == built.seq_lens + [4, 4] + [0] * (size - num_seqs - 2)
    assert meta.block_table.shape == (size, 16)
    assert torch.equal(meta.block_table[:num_seqs, : built.block_table.shape[1]],
                       built.block_table)
    assert meta.block_table[num_seqs : num_seqs + 2, 0].eq(0).all()
    # A captured step's host lists refuse to be read: a graph replays other contents.
    assert isinstance(meta.seq_lens, NoHostData) and meta.num_reqs == size
    with pytest.raises(RuntimeError, match="host metadata"):
        meta.seq_lens[0]
    with pytest.raises(RuntimeError, match="host metadata"):
        list(meta.query_start_loc)


def test_a_step_of_padding_alone_is_what_graphs_are_captured_on():
    inputs = StepInputs(16, 16, 4, 1, BLOCK_SIZE, torch.device("cpu"))
    ids, pos, meta = inputs.stage([], [], [], [], (), 10)
    assert pos.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1] and meta.slot_mapping.eq(PAD_SLOT).all()
    assert meta.query_start_loc_tensor.tolist() == [0, 4, 8] + [10] * 8
    assert meta.seq_lens_tensor.tolist() == [4, 4, 2] + [0] * 7


def test_padding_never_outgrows_a_sequence():
    """A graph may pad more tokens than one sequence may hold: 16 here, against 2 blocks (8
    positions) per sequence. (As one sequence, the padding of a 512-token graph on a model of
    256 positions read past the rotary tables and its block-table row: an illegal memory access
    on an H200.)"""
    max_blocks_per_seq = 2
    inputs = StepInputs(16, 16, max_blocks_per_seq, 1, BLOCK_SIZE, torch.device("cpu"))
    for input_ids, positions, chunks in (([], [], []), ([5], [6], [(([3, 4],), 6, 7)])):
        _, pos, meta = inputs.stage(input_ids, positions, chunks, [], (), 16)
        assert pos.max() < max_blocks_per_seq * BLOCK_SIZE
        seq_lens = meta.seq_lens_tensor
        assert seq_lens.max() <= max_blocks_per_seq * BLOCK_SIZE and int(seq_lens.sum()) > 0
        query_lens = meta.query_start_loc_tensor.diff()
        assert query_lens.sum() == 16 and query_lens.le(seq_lens).all()


def test_a_step_too_large_for_the_buffers_is_refused():
    inputs = StepInputs(8, 4, 2, 1, BLOCK_SIZE, torch.device("cpu"))
    assert inputs.fits(8, 4, 2)
    assert not inputs.fits(9, 1, 1) and not inputs.fits(2, 5, 1) and not inputs.fits(2, 1, 3)


@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens", [(256, 2048), (4, 8192),
                                                                  (64, 64)])
def test_the_buffers_hold_every_step_and_every_default_graph(max_num_seqs,
                                                             max_num_batched_tokens):
    from pagedserve.config import SchedulerConfig
    from pagedserve.engine.arg_utils import default_cuda_graph_sizes
    from pagedserve.worker.cuda_graph import CudaGraphRunner, EagerGraphs, usable_graph_sizes

    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, max_model_len=4096)
    sizes = usable_graph_sizes(default_cuda_graph_sizes(max_num_seqs, max_num_batched_tokens),
                               config)
    assert sizes[0] == 1 and sizes[-1] == min(2 * max_num_seqs, max_num_batched_tokens, 512)
    for graph_sizes in (sizes, ()):  # with graphs, and eager (--enforce-eager)
        inputs = StepInputs.for_steps(config, graph_sizes, 16, 1, torch.device("cpu"))
        assert inputs.fits(max_num_batched_tokens, max_num_seqs, 4096 // 16)
    CudaGraphRunner(sizes, StepInputs.for_steps(config, sizes, 16, 1, torch.device("cpu")),
                    EagerGraphs())  # refuses sizes its buffers cannot pad to
