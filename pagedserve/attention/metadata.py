"""Per-step attention metadata, reaching the layers through one scoped forward context.

The batch is flat: T tokens from B requests, decodes (one query token each) first, then prefill
chunks. For request i, its query tokens are [query_start_loc[i], query_start_loc[i+1]) of the
batch, at positions [context_lens[i], seq_lens[i]) of its sequence.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.attention.kv_cache import KVCache


@dataclass
class AttentionMetadata:
    num_decodes: int
    """Requests 0..num_decodes-1 have exactly one query token; the rest are prefill chunks."""
    query_start_loc: list[int]
    """(B+1,) on the host: offsets of each request's query tokens in the flat batch."""
    context_lens: list[int]
    """(B,) tokens already in the cache before this step."""
    seq_lens: list[int]
    """(B,) tokens in the cache after this step (context + query)."""
    slot_mapping: torch.Tensor
    """(T,) int64: cache slot (block_id * block_size + offset) each new token's KV goes to."""
    block_table: torch.Tensor
    """(B, max_blocks) int64 block ids, padded with the null block 0."""
    decode_seq_lens: torch.Tensor
    """(num_decodes,) int64 on the device, for the batched decode mask."""
    kv_caches: list[KVCache]
    """Per layer its KVCache (attention/kv_cache.py): (key_cache, value_cache), each (Hkv,
    num_blocks, block_size, D), or quantized codes and their scales. Carried here, not bound to
    the layers, so one loaded model can serve several engines (tests, drafts)."""
    query_start_loc_tensor: torch.Tensor | None = None
    """(B+1,) int32 on the device: query_start_loc for kernels that read no host data (the
    Triton backend, and so steps replayed from a CUDA graph). None: not built (CPU steps)."""
    seq_lens_tensor: torch.Tensor | None = None
    """(B,) int32 on the device: seq_lens, likewise. A captured step pads the batch with
    sequences of no query tokens and seq_len 0 (query_start_loc repeats its last value)."""
    backend_state: dict[str, Any] = field(default_factory=dict)
    """Tensors an attention backend derives from this metadata once per step (in its first
    layer) and reuses in the others, e.g. the decode mask."""
    layer_groups: tuple[int, ...] = ()
    """Per layer (its index in kv_caches), the KV cache group whose block table it reads
    (core/kv_cache_groups.py); (): every layer reads this metadata's."""
    other_groups: tuple[AttentionMetadata, ...] = ()
    """Groups 1, 2, ...: the same step through their own block tables (slot_mapping,
    block_table and backend_state of their own; the rest as here)."""

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def for_layer(self, layer_idx: int) -> AttentionMetadata:
        """The metadata layer `layer_idx` attends with: its KV cache group's."""
        group = self.layer_groups[layer_idx] if self.layer_groups else 0
        return self if group == 0 else self.other_groups[group - 1]


def slot_mapping_of(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end) of a request whose blocks are block_ids:
    | block 0: slots b0*bs .. b0*bs+bs-1 | block 1 ... |, position p in block p // bs."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_attention_metadata(
    chunks: list[tuple[list[int], int, int]],
    block_size: int,
    kv_caches: list[KVCache],
    device: torch.device,
) -> AttentionMetadata:
    """The step's metadata from its requests in batch order, one-token chunks first: each as
    (block ids, first position computed now, end position). Shared by the model runner and the
    draft model, whose caches are different but laid out alike."""
    query_start_loc, slot_mapping = [0], []
    for block_ids, start, end in chunks:
        query_start_loc.append(query_start_loc[-1] + end - start)
        slot_mapping.extend(slot_mapping_of(block_ids, start, end, block_size))
    seq_lens = [end for _, _, end in chunks]
    num_decodes = sum(1 for _, start, end in chunks if end - start == 1)
    max_blocks = max(len(block_ids) for block_ids, _, _ in chunks)
    block_table = [block_ids + [0] * (max_blocks - len(block_ids)) for block_ids, _, _ in chunks]
    return AttentionMetadata(
        num_decodes=num_decodes,
        query_start_loc=query_start_loc,
        context_lens=[start for _, start, _ in chunks],
        seq_lens=seq_lens,
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        block_table=torch.tensor(block_table, dtype=torch.int64, device=device),
        decode_seq_lens=torch.tensor(seq_lens[:num_decodes], dtype=torch.int64, device=device),
        kv_caches=kv_caches,
        **(_device_offsets(query_start_loc, seq_lens, device)
           if torch.device(device).type != "cpu" else {}),
    )


def _device_offsets(query_start_loc: list[int], seq_lens: list[int],
                    device: torch.device) -> dict[str, torch.Tensor]:
    """query_start_loc and seq_lens as int32 device tensors, in one host-to-device copy."""
    both = torch.tensor(query_start_loc + seq_lens, dtype=torch.int32).to(device, non_blocking=True)
    return {"query_start_loc_tensor": both[: len(query_start_loc)],
            "seq_lens_tensor": both[len(query_start_loc):]}


def build_grouped_attention_metadata(
    chunks: list[tuple[tuple[list[int], ...], int, int]],
    block_size: int,
    kv_caches: list[KVCache],
    device: torch.device,
    layer_groups: tuple[int, ...] = (),
) -> AttentionMetadata:
    """As build_attention_metadata, with each request's block ids given per KV cache group;
    layer_groups: per layer, its group (() with one group)."""
    meta = build_attention_metadata([(tables[0], start, end) for tables, start, end in chunks],
                                    block_size, kv_caches, device)
    num_groups = len(chunks[0][0])
    if num_groups == 1:
        return meta
    others = []
    for group in range(1, num_groups):
        slot_mapping = []
        for tables, start, end in chunks:
            slot_mapping.extend(slot_mapping_of(tables[group], start, end, block_size))
        max_blocks = max(len(tables[group]) for tables, _, _ in chunks)
        block_table = [tables[group] + [0] * (max_blocks - len(tables[group]))
                       for tables, _, _ in chunks]
        others.append(dataclasses.replace(
            meta, backend_state={},
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_table=torch.tensor(block_table, dtype=torch.int64, device=device)))
    meta.layer_groups, meta.other_groups = layer_groups, tuple(others)
    return meta


_forward_context: AttentionMetadata | None = None
_lora_step = None


@contextlib.contextmanager
def forward_context(attn_metadata: AttentionMetadata, lora_step=None) -> Iterator[None]:
    """The step's attention metadata and, when some token of the step uses a LoRA adapter, its
    `LoRAStep` (lora/layers.py), for the layers to read during one forward pass."""
    global _forward_context, _lora_step
    if _forward_context is not None:
        raise RuntimeError("forward contexts do not nest")
    _forward_context, _lora_step = attn_metadata, lora_step
    try:
        yield
    finally:
        _forward_context = _lora_step = None


def get_forward_context() -> AttentionMetadata:
    if _forward_context is None:
        raise RuntimeError("attention ran outside a forward context")
    return _forward_context


def get_lora_step():
    """The running step's LoRAStep, or None (no adapter in the step, or outside a step)."""
    return _lora_step
