"""A step's integer inputs on an accelerator: persistent device buffers, filled from pinned host
memory with non-blocking copies.

Why: `torch.tensor(list, device="cuda")` copies from pageable memory, which waits for every kernel
already queued on the stream. A step built that way cannot be prepared while the previous one
still runs (async scheduling), and CUDA graphs need their inputs at fixed addresses anyway. So the
runner stages a step's token ids, positions, slot mappings, block tables, query offsets and
sequence lengths in pinned host buffers and copies them into the same device buffers every step;
a graph captured on views of those buffers replays whatever the last step staged.

Two pinned staging sets alternate. A set is written again two steps later, and only once the
copies out of it are done (an event recorded behind them): steps that sample nothing (prompt
chunks) never make the host wait for the device, so it may run ahead of the copies.

Layout (all on the device, sized for the largest step):
  tokens        (2 + G, max_tokens) int64: row 0 token ids, row 1 positions, row 2 + g the slot
                mapping of KV cache group g (-1: a padding token, whose K/V is not written)
                (padding: see `stage`)
  block_tables  (G, max_seqs, max_blocks_per_seq) int64
  offsets       (2 * max_seqs + 1,) int32: query_start_loc (max_seqs + 1), then seq_lens
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedserve.attention.kv_cache import KVCache
from pagedserve.attention.metadata import AttentionMetadata, slot_mapping_of
from pagedserve.config import SchedulerConfig

PAD_SLOT = -1
"""Slot of a padding token: the attention backend writes no K/V for it."""

Chunk = tuple[tuple[Sequence[int], ...], int, int]
"""A request's part of a step: its block ids per KV cache group, the first position computed now,
and the end position (as build_grouped_attention_metadata takes them)."""


class NoHostData(Sequence):
    """Stands in for AttentionMetadata's host lists in a captured step: a graph replays with
    other contents, so code that reads them while capturing would bake in wrong values. Its
    length (a shape) is known; reading an element raises."""

    def __init__(self, length: int) -> None:
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        raise RuntimeError("a CUDA-graph-captured step read host metadata (query_start_loc, "
                           "seq_lens or context_lens): only device tensors may be read there")


class StepInputs:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 num_groups: int, block_size: int, device: torch.device) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_groups = num_groups
        self.block_size = block_size
        self.device = device
        self.tokens = torch.zeros((2 + num_groups, max_num_tokens), dtype=torch.int64,
                                  device=device)
        self.tokens[2:] = PAD_SLOT
        self.block_tables = torch.zeros((num_groups, max_num_seqs, max_blocks_per_seq),
                                        dtype=torch.int64, device=device)
        self.offsets = torch.zeros(2 * max_num_seqs + 1, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._staging = [
            (torch.zeros_like(self.tokens, device="cpu").pin_memory() if pin
             else torch.zeros_like(self.tokens, device="cpu"),
             torch.zeros_like(self.block_tables, device="cpu").pin_memory() if pin
             else torch.zeros_like(self.block_tables, device="cpu"),
             torch.zeros_like(self.offsets, device="cpu").pin_memory() if pin
             else torch.zeros_like(self.offsets, device="cpu"))
            for _ in range(2)
        ]
        self._turn = 0
        self._copied: list[torch.cuda.Event | None] = [None, None]
        """Per staging set, recorded behind the last copies out of it (cuda only)."""

    @classmethod
    def for_steps(cls, scheduler_config: SchedulerConfig, graph_sizes: tuple[int, ...],
                  block_size: int, num_groups: int, device: torch.device) -> StepInputs:
        """Buffers for every step the scheduler may make, and for every graph: a graph of N
        tokens pads the batch to N sequences, which may be more than max_num_seqs."""
        return cls(scheduler_config.max_num_batched_tokens,
                   max((scheduler_config.max_num_seqs, *graph_sizes)),
                   -(-scheduler_config.max_model_len // block_size), num_groups, block_size,
                   device)

    @property
    def query_start_loc(self) -> torch.Tensor:
        return self.offsets[: self.max_num_seqs + 1]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.offsets[self.max_num_seqs + 1 :]

    def fits(self, num_tokens: int, num_seqs: int, max_blocks: int) -> bool:
        return (num_tokens <= self.max_num_tokens and num_seqs <= self.max_num_seqs
                and max_blocks <= self.max_blocks_per_seq)

    def stage(
        self, input_ids: list[int], positions: list[int], chunks: list[Chunk],
        kv_caches: list[KVCache], layer_groups: tuple[int, ...], num_padded: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Copy a step's inputs to the device; returns (token ids, positions, metadata) viewing
        the device buffers. num_padded: pad to this many tokens and sequences for a CUDA graph
        of that size (its metadata then has the graph's shapes: `captured_metadata`).

        Padding: the tokens past the step's form more sequences of up to block_size tokens
        each, at positions 0, 1, ... over the null block 0 (never written: zeros), with slot -1
        (they write no KV), so their rows stay finite; the sequences after them have no tokens
        and seq_len 0. Short sequences, not one long one: a graph may pad more tokens than a
        sequence may hold (512 for a model of 256 positions), and a padding sequence must read
        neither past the rotary tables nor past its block-table row. There are rows enough:
        every real sequence has a token, so real plus padding sequences are at most num_padded.
        """
        block_size = self.block_size
        num_tokens, num_seqs = len(input_ids), len(chunks)
        num_rows = num_tokens if num_padded is None else num_padded
        num_seq_rows = num_seqs if num_padded is None else num_padded
        num_padding = num_rows - num_tokens
        num_padding_seqs = -(-num_padding // block_size)
        turn = self._turn
        self._turn ^= 1
        tokens, tables, offsets = self._staging[turn]
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # its last copies are done: it may be rewritten
        tokens_np, tables_np, offsets_np = tokens.numpy(), tables.numpy(), offsets.numpy()
        tokens_np[0, :num_tokens] = input_ids
        tokens_np[1, :num_tokens] = positions
        tokens_np[0, num_tokens:num_rows] = 0
        tokens_np[1, num_tokens:num_rows] = np.arange(num_padding) % block_size
        tokens_np[2:, num_tokens:num_rows] = PAD_SLOT
        max_blocks = max((len(tables_of[0]) for tables_of, _, _ in chunks), default=0)
        num_table_rows = num_seqs + num_padding_seqs
        num_table_cols = max(max_blocks, min(num_padding, 1))
        tables_np[:, :num_table_rows, :num_table_cols] = 0
        query_start_loc = [0]
        seq_lens = []
        slots: list[list[int]] = [[] for _ in range(self.num_groups)]
        for i, (block_tables, start, end) in enumerate(chunks):
            query_start_loc.append(query_start_loc[-1] + end - start)
            seq_lens.append(end)
            for group, block_ids in enumerate(block_tables):
                tables_np[group, i, : len(block_ids)] = block_ids
                if end - start == 1:  # a decode: most of a large batch
                    slots[group].append(block_ids[start // block_size] * block_size
                                        + start % block_size)
                else:
                    slots[group].extend(slot_mapping_of(block_ids, start, end, block_size))
        for group, group_slots in enumerate(slots):
            tokens_np[2 + group, :num_tokens] = group_slots
        seq_offset = self.max_num_seqs + 1
        offsets_np[: num_seqs + 1] = query_start_loc
        # The padding's sequences (block_size tokens each, the last one the rest), then none.
        padding_ends = np.minimum(np.arange(1, num_padding_seqs + 1) * block_size, num_padding)
        padding_seqs = slice(num_seqs, num_seqs + num_padding_seqs)
        offsets_np[num_seqs + 1 : num_seq_rows + 1] = num_rows
        offsets_np[padding_seqs.start + 1 : padding_seqs.stop + 1] = num_tokens + padding_ends
        offsets_np[seq_offset : seq_offset + num_seqs] = seq_lens
        offsets_np[seq_offset + num_seqs : seq_offset + num_seq_rows] = 0
        offsets_np[seq_offset + padding_seqs.start : seq_offset + padding_seqs.stop] = np.diff(
            padding_ends, prepend=0)
        # The copies: only the rows and columns this step uses (a graph reads no others).
        self.tokens[:, :num_rows].copy_(tokens[:, :num_rows], non_blocking=True)
        self.block_tables[:, :num_table_rows, :num_table_cols].copy_(
            tables[:, :num_table_rows, :num_table_cols], non_blocking=True)
        self.offsets[: num_seq_rows + 1].copy_(offsets[: num_seq_rows + 1], non_blocking=True)
        self.offsets[seq_offset : seq_offset + num_seq_rows].copy_(
            offsets[seq_offset : seq_offset + num_seq_rows], non_blocking=True)
        if self.device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        if num_padded is not None:
            meta = self.captured_metadata(num_padded, kv_caches, layer_groups)
        else:
            num_decodes = sum(1 for _, start, end in chunks if end - start == 1)
            meta = self._metadata(
                num_tokens, num_seqs, max_blocks, kv_caches, layer_groups,
                query_start_loc, [start for _, start, _ in chunks], seq_lens, num_decodes)
        return self.tokens[0, :num_rows], self.tokens[1, :num_rows], meta

    def captured_metadata(self, size: int, kv_caches: list[KVCache],
                          layer_groups: tuple[int, ...]) -> AttentionMetadata:
        """The metadata a graph of `size` tokens (and up to `size` sequences) is captured with:
        device views of fixed shape, host lists that refuse to be read."""
        return self._metadata(size, size, self.max_blocks_per_seq, kv_caches, layer_groups,
                              NoHostData(size + 1), NoHostData(size), NoHostData(size), size)

    def _metadata(self, num_tokens: int, num_seqs: int, max_blocks: int,
                  kv_caches: list[KVCache], layer_groups: tuple[int, ...], query_start_loc,
                  context_lens, seq_lens, num_decodes: int) -> AttentionMetadata:
        seq_lens_tensor = self.seq_lens[:num_seqs]
        groups = [
            AttentionMetadata(
                num_decodes=num_decodes, query_start_loc=query_start_loc,
                context_lens=context_lens, seq_lens=seq_lens,
                slot_mapping=self.tokens[2 + group, :num_tokens],
                block_table=self.block_tables[group, :num_seqs, :max_blocks],
                decode_seq_lens=seq_lens_tensor[:num_decodes], kv_caches=kv_caches,
                query_start_loc_tensor=self.query_start_loc[: num_seqs + 1],
                seq_lens_tensor=seq_lens_tensor)
            for group in range(self.num_groups)
        ]
        meta = groups[0]
        if self.num_groups > 1:
            meta.layer_groups, meta.other_groups = layer_groups, tuple(groups[1:])
        return meta
