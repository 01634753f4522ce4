"""Linear layers whose parameters know how to load their own shards.

A merged layer (QKV, gate-up) holds several HF weights side by side along the output dimension;
`weight_loader(param, loaded_weight, shard_id)` copies one of them into its slice. Tensor
parallelism later narrows these slices per rank here, not in the models.

A shard may also arrive as a GGUFQuantWeight (GGUF codes kept packed, see quantized.py): it is set
aside on the parameter, and `process_weights_after_loading` packs the whole layer for the int4
kernel when every shard is packable, else dequantizes into the dense weight (the slow reference).

A packed layer keeps its dense bf16 weight too and picks per call by the number of rows. The
packed kernel (the compiled VNNI one, `GroupQuantizedWeight`, else torch's int4 kernel) reads a
quarter of the bytes, so it wins while the matmul is bound by memory: 3-4x dense bf16 at 1 row,
about even by 8 to 32 rows, behind in prefill, where dense bf16 runs near the CPU's peak. The price
is memory: both copies stay resident.

`--quantization int4|int8` instead quantizes every dense weight on load (also a GGUF file's,
re-quantized from its dequantized values) and keeps only the packed form: less memory, all rows on
the packed kernel (so slower for large batches).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.quantized import (
    GGUFQuantWeight,
    GroupQuantizedWeight,
    concat_rows,
    packed_weight,
    quantize_weight,
)

PACKED_MAX_ROWS = 8
"""Rows up to which a layer holding both forms multiplies by its int4 codes (see module doc)."""
HEAD_PACKED_MAX_ROWS = 32
"""The same for a tied head on the compiled kernel: at 32 rows it measured 6.4 ms against dense
bf16's 8.9 (SmolLM2's 49,152 x 576 head, 2 threads), where the smaller layers are already even."""


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor | GGUFQuantWeight, shard_id=None
) -> None:
    if isinstance(loaded_weight, GGUFQuantWeight):
        if not hasattr(param, "pending_quant"):
            param.pending_quant = {}
        param.pending_quant[shard_id] = loaded_weight  # sized: checked when it is used
        return
    if param.shape != loaded_weight.shape:
        raise ValueError(f"weight shape {tuple(loaded_weight.shape)} != {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def take_pending_quant(param: nn.Parameter) -> dict:
    """The GGUFQuantWeight shards set aside on `param` by the weight loaders (and forget them)."""
    pending = getattr(param, "pending_quant", {})
    if pending:
        del param.pending_quant
    return pending


def _check_shape(weight: GGUFQuantWeight, expected: torch.Size) -> None:
    if weight.shape != expected:
        raise ValueError(f"weight shape {tuple(weight.shape)} != {tuple(expected)}")


class Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.packed: nn.Module | None = None
        """Set when the layer also runs on GGUF codes (for inputs of at most PACKED_MAX_ROWS)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or (self.weight is not None and x.shape[0] > PACKED_MAX_ROWS):
            return F.linear(x, self.weight, self.bias)
        y = self.packed(x)
        return y if self.bias is None else y + self.bias

    def _shard_slices(self) -> dict:
        """shard id -> the rows of `weight` it fills."""
        return {None: self.weight.data}

    def process_weights_after_loading(self, dtype: torch.dtype, quantize: str | None = None) -> None:
        """Dequantize quantized shards into the dense weight and, for bf16 when every shard is
        packable, also pack them for the int4 kernel. quantize ("int4" / "int8", bf16 only):
        replace the dense weight by its packed quantization instead."""
        pending = take_pending_quant(self.weight)
        slices = self._shard_slices()
        for shard_id, weight in pending.items():
            _check_shape(weight, slices[shard_id].shape)
            slices[shard_id].copy_(weight.dequantize())
        if dtype != torch.bfloat16:
            return
        if quantize is not None:
            codes = quantize_weight(self.weight.data, quantize)
            if codes is not None:
                self.packed = packed_weight(codes, dtype)
                self.weight = None
        elif pending and pending.keys() == slices.keys():
            merged = concat_rows([pending[shard_id] for shard_id in slices])
            if merged is not None:  # None: mixed types, dense only
                self.packed = packed_weight(merged, dtype)


class MergedLinear(Linear):
    """Several output projections computed by one matmul: y = x @ [W_0; W_1; ...]^T."""

    def __init__(
        self, input_size: int, output_sizes: dict[str | int, int], bias: bool = False
    ) -> None:
        super().__init__(input_size, sum(output_sizes.values()), bias)
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in output_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self.output_sizes = list(output_sizes.values())

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFQuantWeight,
        shard_id: str | int,
    ) -> None:
        if isinstance(loaded_weight, GGUFQuantWeight):
            default_weight_loader(param, loaded_weight, shard_id)
            return
        offset, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)

    def _shard_slices(self) -> dict:
        return {
            shard_id: self.weight.data.narrow(0, offset, size)
            for shard_id, (offset, size) in self.shard_offsets.items()
        }

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(x).split(self.output_sizes, dim=-1)


class VocabEmbedding(nn.Module):
    """Token embedding [vocab, hidden]; with `serves_as_head` also the tied output projection.

    Loaded from GGUF codes in bf16, the tied head also keeps an int4-packed copy for inputs of at
    most PACKED_MAX_ROWS rows (decode of one to a few requests), where it is ~4x faster.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, serves_as_head: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim), requires_grad=False
        )
        self.serves_as_head = serves_as_head
        self.packed_head: nn.Module | None = None
        self.dense_head_above_max_rows = True
        """False when the head was quantized on request (--quantization int4/int8)."""
        self.packed_head_max_rows = PACKED_MAX_ROWS
        """The compiled kernel's head stays ahead of dense bf16 further: HEAD_PACKED_MAX_ROWS."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def as_head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) in the compute dtype."""
        if self.packed_head is not None and (
            hidden_states.shape[0] <= self.packed_head_max_rows
            or not self.dense_head_above_max_rows
        ):
            return self.packed_head(hidden_states)
        return F.linear(hidden_states, self.weight)

    def process_weights_after_loading(self, dtype: torch.dtype, quantize: str | None = None) -> None:
        """Dequantize GGUF codes into the table; for a tied head in bf16 also pack the codes (or,
        with `quantize`, a fresh int4/int8 quantization used for every row count)."""
        pending = take_pending_quant(self.weight)
        if pending:
            _check_shape(pending[None], self.weight.shape)
            self.weight.data.copy_(pending[None].dequantize())
        if dtype != torch.bfloat16 or not self.serves_as_head:
            return
        if quantize is not None:
            codes = quantize_weight(self.weight.data, quantize)
            if codes is not None:
                self.packed_head = packed_weight(codes, dtype)
                self.dense_head_above_max_rows = False
        elif pending:
            self.packed_head = packed_weight(pending[None], dtype)
        if isinstance(self.packed_head, GroupQuantizedWeight):
            self.packed_head_max_rows = HEAD_PACKED_MAX_ROWS
