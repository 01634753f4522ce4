"""Linear layers and the vocabulary embedding/head, each split over the tensor-parallel ranks.

Every parameter knows how to load its slice: `param.weight_loader(param, full_weight[, shard_id])`
takes the whole checkpoint tensor and copies this rank's part (the models never slice). The TP
rank and size are read from `get_tp_group()` at construction; with one rank every split is the
whole tensor and every collective the identity, so that case runs exactly as without TP.

  MergedLinear       column-parallel: several output projections (QKV, gate-up) in one matmul;
                     each rank holds its rows of every one (QKV: num_heads/tp query heads and
                     num_kv_heads/tp KV heads). Outputs stay split, no communication.
  RowParallelLinear  o_proj, down_proj: each rank holds its K/tp input columns and computes a
                     partial sum; one all_reduce completes it (one after attention, one after
                     the MLP per layer).
  VocabEmbedding     vocab/tp rows per rank (padded with zero rows up to a multiple of tp); the
  ParallelLMHead     lookup all-reduces, the head all-gathers full logits onto every rank.

A shard may also arrive as a GGUFQuantWeight (GGUF codes kept packed, see quantized.py): it is
narrowed to the rank's part still packed, set aside on the parameter, and
`process_weights_after_loading` packs the whole layer for the int4 kernel when every shard is
packable, else dequantizes into the dense weight (the slow reference).

In bf16 the compiled VNNI kernel (`GroupQuantizedWeight`) reads a quarter of the bytes. With
int8 activations (bf16's default, quantized.py `activation_bits_for`) it also beats the dense
product at every row count, so the layer runs on its codes alone: on SmolLM2's layers (AMD EPYC
Zen 4, 2 threads, with outlier channels) 1.13-1.25x less time than torch's dense bf16 matmul on
weights dequantized per call at 2,048 rows, 1.3-1.5x at 128. With int16 activations it wins
only while the matmul is bound by memory (3-4x dense bf16 at 1 row, ahead up to ~128 rows) and
falls behind in prefill, where dense bf16 runs near the CPU's peak: above PACKED_MAX_ROWS such
a layer runs torch's dense matmul on its weights dequantized from the codes per call
(`GroupQuantizedWeight.dense_product`): bitwise the dense layer's output, with no dense copy
held. The dequantization is the price: level with a held dense copy at 2,048 rows, a quarter
more time at 256. Only where the compiled kernels are missing (torch's int4 kernel
serves the codes) does a layer keep its dense bf16 weight beside them, for inputs of more than
TORCH_INT4_MAX_ROWS rows.

In fp32 (on the CPU, with the compiled kernels) a layer whose shards all pack keeps only its codes
and runs every row count on them, its activations quantized per 32-element group to int8 by
default (--activation-quantization, see quantized.py `activation_bits_for`). In the exact mode
(none) the kernel dequantizes each weight exactly (the dense model's value, bit for bit) and sums
in fp32, so the computation is the dense one up to summation order, with a sixth of the bytes to
read and no dense copy to build (see GroupQuantizedWeight). Either way a row's output does not
depend on the other rows of its batch.

`--quantization int4|int8` instead quantizes every dense weight on load (also a GGUF file's,
re-quantized from its dequantized values) and keeps only the packed form: less memory, all rows on
the packed kernel (so slower for large batches). Under TP each rank quantizes its own shard.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.metadata import get_lora_step
from pagedserve.distributed.parallel_state import GroupCoordinator, get_tp_group
from pagedserve.kernels import cpu_ops
from pagedserve.layers.quantized import (
    GROUP_SIZE,
    GGUFQuantWeight,
    GroupQuantizedWeight,
    concat_rows,
    packed_weight,
    quantize_weight,
)

logger = logging.getLogger(__name__)

PACKED_MAX_ROWS = 128
"""Rows up to which a bf16 layer multiplies by its codes; above, by the dense product (see the
module doc). Measured on SmolLM2-135M's layers (AMD EPYC Zen 4, 2 threads): the codes took 1.13x
less time than the dense product at 128 rows and 1.17x more at 256; in whole steps, where a
layer's weights come from memory rather than cache, batch-32 decode ran 1.2-1.5x faster on the
codes than on the dense product (and than a held dense copy)."""
TORCH_INT4_MAX_ROWS = 8
"""The same for a layer on torch's int4 kernel (no compiled kernels), which keeps its dense copy:
3-4x dense bf16 at 1 row, about even by 8 rows."""
DENSE_ROWS_MAX = 4
"""Rows up to which a bf16 layer on dense weights (an HF checkpoint, or GGUF types the codes'
layout cannot hold, such as Q6_K) multiplies by the compiled dense_rows kernel instead of
F.linear: a stream of the weights, 1.6x torch's bf16 linear at one row from memory (AMD EPYC
Zen 4, 2 threads, 640 x 2048)."""
HEAD_PACKED_MAX_ROWS = 128
"""The same for a tied head (int8 activations): at 64 rows 9.0 ms on the codes against 17.9 ms
for the dense product of SmolLM2's 49,152 x 576 head (2 threads, AMD EPYC Zen 4)."""


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor | GGUFQuantWeight, shard_id=None
) -> None:
    if isinstance(loaded_weight, GGUFQuantWeight):
        if not hasattr(param, "pending_quant"):
            param.pending_quant = {}
        param.pending_quant[shard_id] = loaded_weight  # sized: checked when it is used
        return
    _check_shape(loaded_weight, param.shape)
    param.data.copy_(loaded_weight)


def take_pending_quant(param: nn.Parameter) -> dict:
    """The GGUFQuantWeight shards set aside on `param` by the weight loaders (and forget them)."""
    pending = getattr(param, "pending_quant", {})
    if pending:
        del param.pending_quant
    return pending


def _check_shape(weight: torch.Tensor | GGUFQuantWeight, expected: tuple[int, ...]) -> None:
    if tuple(weight.shape) != tuple(expected):
        raise ValueError(f"weight shape {tuple(weight.shape)} != {tuple(expected)}")


def _split_size(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide {what} ({size})")
    return size // tp_size


class Linear(nn.Module):
    """y = x @ W^T + b with the whole matrix on every rank; the base of the parallel layers."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.packed: nn.Module | None = None
        """Set when the layer also runs on GGUF codes (for inputs of at most PACKED_MAX_ROWS)."""
        self.dense_above_max_rows = False
        """True when the layer holds only its codes (weight None) in bf16 with int16 or exact
        activations, and multiplies inputs of more than PACKED_MAX_ROWS rows by its dequantized
        weights (the dense product)."""
        self.dense_rows_kernels: ModuleType | None = None
        """The compiled kernels, when a bf16 layer holds only dense weights (an HF checkpoint,
        or GGUF types the codes' layout cannot hold) and multiplies up to DENSE_ROWS_MAX rows
        by their dense_rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is None or (self.weight is not None and x.shape[0] > TORCH_INT4_MAX_ROWS):
            rows_kernels = self.dense_rows_kernels
            if (rows_kernels is not None and x.dim() == 2 and 0 < x.shape[0] <= DENSE_ROWS_MAX
                    and x.dtype == self.weight.dtype == torch.bfloat16
                    and x.device.type == "cpu"):
                y = rows_kernels.dense_rows(x, self.weight, bias)
            else:
                y = F.linear(x, self.weight, bias)
        elif self._takes_dense_product(x):
            y = self.packed.dense_product(x, bias)
        else:
            y = self.packed(x)
            y = y if bias is None else y + bias
        lora_step = get_lora_step()
        # A row-parallel layer's caller all-reduces after this: its partial delta is summed too.
        return y if lora_step is None else lora_step.add_delta(self, x, y)

    def _takes_dense_product(self, x: torch.Tensor) -> bool:
        """Whether x's rows go to the dense product on weights dequantized from the codes."""
        return self.dense_above_max_rows and x.shape[0] > PACKED_MAX_ROWS

    def _shard_slices(self) -> dict:
        """shard id -> the rows of `weight` it fills."""
        return {None: self.weight.data}

    def process_weights_after_loading(self, dtype: torch.dtype, quantize: str | None = None) -> None:
        """Keep the layer's GGUF codes when every shard is packable, else dequantize its shards
        into the dense weight. On the compiled kernels (GroupQuantizedWeight) the codes alone
        are kept: fp32 multiplies them exactly for every row count, bf16 by VNNI for few rows and
        by the dense product above (see the module doc). On torch's int4 kernel the dense bf16
        weight stays beside them. quantize ("int4" / "int8", bf16 only): replace the dense
        weight by its packed quantization instead."""
        pending = take_pending_quant(self.weight)
        slices = self._shard_slices()
        for shard_id, weight in pending.items():
            _check_shape(weight, slices[shard_id].shape)
        complete = bool(pending) and pending.keys() == slices.keys()
        packable = complete and quantize is None and dtype in (torch.float32, torch.bfloat16)
        merged = concat_rows([pending[shard_id] for shard_id in slices]) if packable else None
        if merged is not None:  # None: mixed types, dense only
            self.packed = packed_weight(merged, dtype)  # fp32: None where not vectorized
            if isinstance(self.packed, GroupQuantizedWeight):  # the codes alone
                self.weight = None
                # int8 activations beat the dense product at every row count (see the module
                # doc); int16 and exact ones fall behind it in bf16's prefill.
                self.dense_above_max_rows = (dtype == torch.bfloat16
                                             and self.packed.activation_bits != 8)
                return
        for shard_id, weight in pending.items():
            slices[shard_id].copy_(weight.dequantize())
        if dtype == torch.bfloat16 and quantize is not None:
            codes = quantize_weight(self.weight.data, quantize)
            if codes is not None:
                self.packed = packed_weight(codes, dtype)
                self.weight = None
        kernels = cpu_ops.for_new_layer()
        if (self.packed is None and dtype == torch.bfloat16 and kernels is not None
                and self.weight.device.type == "cpu" and self.weight.shape[1] % 32 == 0
                and kernels.dense_rows_supported()):
            self.dense_rows_kernels = kernels


class MergedLinear(Linear):
    """Several output projections computed by one matmul: y = x @ [W_0; W_1; ...]^T.

    Column-parallel: `output_sizes` are the full sizes; each rank holds rows
    [r * n / tp, (r + 1) * n / tp) of every W_i and of its bias, so for QKV (whole heads of
    head_dim rows) its num_heads / tp query heads and num_kv_heads / tp KV heads.
    """

    def __init__(
        self, input_size: int, output_sizes: dict[str | int, int], bias: bool = False
    ) -> None:
        tp = get_tp_group()
        local_sizes = {
            shard_id: _split_size(size, tp.world_size, f"output shard {shard_id!r}")
            for shard_id, size in output_sizes.items()
        }
        super().__init__(input_size, sum(local_sizes.values()), bias)
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        """shard id -> (offset, size) of this rank's rows in `weight`."""
        offset = 0
        for shard_id, size in local_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self.output_sizes = list(local_sizes.values())
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFQuantWeight,
        shard_id: str | int,
    ) -> None:
        """Copy this rank's rows of the full HF tensor `shard_id` (weight or bias) into place."""
        offset, size = self.shard_offsets[shard_id]
        _check_shape(loaded_weight, (size * self.tp_size, *param.shape[1:]))
        rank_rows = loaded_weight.narrow(0, self.tp_rank * size, size)
        if isinstance(rank_rows, GGUFQuantWeight):
            default_weight_loader(param, rank_rows, shard_id)
            return
        default_weight_loader(param.data.narrow(0, offset, size), rank_rows)

    def _shard_slices(self) -> dict:
        return {
            shard_id: self.weight.data.narrow(0, offset, size)
            for shard_id, (offset, size) in self.shard_offsets.items()
        }

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(x).split(self.output_sizes, dim=-1)

    def gated_activation(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """act(gate) * up of a gate_up layer (two shards, gate first; activation "silu" or
        "gelu_tanh") computed by its codes in one pass, bitwise silu_and_mul(self(x)) (or
        gelu_tanh_and_mul); None where that pass does not apply (no
        compiled codes, the dense product's row counts, a bias, a LoRA step that adds its delta
        to the product first) or where hooks watch this layer's calls (the outlier channels'
        calibration records its input, `bench throughput --profile` times it), which the one
        pass would skip: the caller takes the two steps."""
        packed = self.packed
        if (self._forward_pre_hooks or self._forward_hooks
                or not isinstance(packed, GroupQuantizedWeight) or not packed.serves_gated_product
                or len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]
                or self.bias is not None or x.dim() != 2 or not x.is_contiguous()
                or self._takes_dense_product(x)
                or get_lora_step() is not None):
            return None
        return packed.gated_product(x, activation)


class RowParallelLinear(Linear):
    """y = x @ W^T + b where x arrives split by columns (the output of a column-parallel layer).

    Each rank holds W's input columns [r * K / tp, (r + 1) * K / tp) and computes a partial y; one
    all_reduce sums the partials. The bias (whole on every rank) joins rank 0's partial only, so
    it is added once.

    GGUF codes are split still packed when K / tp falls on 32-element groups (each group shares
    one scale and min). Where it does not, the layer is dequantized to dense on load instead, with
    one warning naming it, and runs the dense matmul (so no int4 kernel for that layer).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 prefix: str = "") -> None:
        tp = get_tp_group()
        super().__init__(_split_size(input_size, tp.world_size, "input size"), output_size, bias)
        self.tp_group: GroupCoordinator = tp
        self.prefix = prefix
        """The layer's name in the checkpoint, for the dense-fallback warning."""
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFQuantWeight, shard_id=None
    ) -> None:
        """Copy this rank's input columns of the full [N, K] HF weight."""
        output_size, local_k = param.shape
        _check_shape(loaded_weight, (output_size, local_k * self.tp_group.world_size))
        if isinstance(loaded_weight, GGUFQuantWeight) and local_k % GROUP_SIZE:
            logger.warning(
                "%s: %d input columns per rank split its 32-element GGUF groups; dequantized to "
                "dense (the int4 kernel will not serve this layer)", self.prefix, local_k)
            loaded_weight = loaded_weight.dequantize()
        default_weight_loader(
            param, loaded_weight.narrow(1, self.tp_group.rank_in_group * local_k, local_k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self._linear(x, self.bias if self.tp_group.is_first_rank else None)
        return self.tp_group.all_reduce(partial)


@dataclass(frozen=True)
class VocabShard:
    """One rank's rows of a vocabulary split over the TP ranks. The vocabulary is padded with
    zero rows up to a multiple of tp, so every rank holds the same number of rows (all_gather
    wants equal parts); those rows are never looked up and their logits are cut off."""

    vocab_size: int
    rows_per_rank: int
    start: int
    """First vocabulary id of this rank."""

    @classmethod
    def for_rank(cls, vocab_size: int, tp: GroupCoordinator) -> VocabShard:
        rows_per_rank = -(-vocab_size // tp.world_size)
        return cls(vocab_size, rows_per_rank, tp.rank_in_group * rows_per_rank)

    @property
    def num_real_rows(self) -> int:
        """Rows of real tokens; the rest (the last ranks' tails) are padding."""
        return max(0, min(self.rows_per_rank, self.vocab_size - self.start))

    def load(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFQuantWeight
    ) -> None:
        """Copy this rank's rows of the full [vocab, hidden] HF tensor; zero the padding."""
        _check_shape(loaded_weight, (self.vocab_size, param.shape[1]))
        rows = loaded_weight.narrow(0, self.start, self.num_real_rows)
        if isinstance(rows, GGUFQuantWeight):
            default_weight_loader(param, rows.pad_rows(self.rows_per_rank - self.num_real_rows))
            return
        default_weight_loader(param.data.narrow(0, 0, self.num_real_rows), rows)
        param.data[self.num_real_rows :].zero_()

    def gather_logits(self, local_logits: torch.Tensor, tp: GroupCoordinator) -> torch.Tensor:
        """(N, rows_per_rank) on each rank -> (N, vocab) on every rank."""
        logits = tp.all_gather(local_logits, dim=-1)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size].contiguous()
        return logits


class VocabEmbedding(nn.Module):
    """Token embedding [vocab, hidden]; with `serves_as_head` also the tied output projection.
    Split by vocabulary rows over the TP ranks (see VocabShard).

    Loaded from GGUF codes with the compiled kernels (fp32 or bf16), the table is held as those
    codes alone (`packed_table`): lookups dequantize their rows. The tied head multiplies by the
    codes (this rank's rows): in fp32 for every row count (int8 activations by default); in
    bf16 with int8 activations (HEAD_ACTIVATION_BITS) for inputs of at most packed_head_max_rows
    rows (decode steps), where it is several times faster, and by the dense product above.
    Without the compiled kernels the dense table is held, and in bf16 the tied head runs torch's
    int4 kernel on few rows.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, serves_as_head: bool) -> None:
        super().__init__()
        self.tp_group: GroupCoordinator = get_tp_group()
        self.shard = VocabShard.for_rank(num_embeddings, self.tp_group)
        self.weight = nn.Parameter(
            torch.empty(self.shard.rows_per_rank, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        self.serves_as_head = serves_as_head
        self.packed_head: nn.Module | None = None
        self.packed_table: GroupQuantizedWeight | None = None
        """The table on its GGUF codes (weight None then); the tied head's packed_head too."""
        self.dense_head_above_max_rows = True
        """False when the head was quantized on request (--quantization int4/int8)."""
        self.packed_head_max_rows = TORCH_INT4_MAX_ROWS
        """On the compiled kernel: HEAD_PACKED_MAX_ROWS."""

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFQuantWeight
    ) -> None:
        self.shard.load(param, loaded_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) -> (T, hidden)."""
        if self.tp_group.world_size == 1:
            return self._lookup(input_ids)
        # Ids of other ranks look up row 0 and are then zeroed: each token's row comes from
        # exactly one rank, so the all_reduce adds only zeros to it (exact).
        local_ids = input_ids - self.shard.start
        elsewhere = (local_ids < 0) | (local_ids >= self.shard.rows_per_rank)
        embeds = self._lookup(local_ids.masked_fill(elsewhere, 0))
        embeds.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(embeds)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed_table is None:
            return F.embedding(ids, self.weight)
        return self.packed_table.lookup(ids)

    def as_head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) in the compute dtype, the full vocabulary on every rank."""
        if self.packed_head is not None and (
            hidden_states.shape[0] <= self.packed_head_max_rows
            or not self.dense_head_above_max_rows
        ):
            local_logits = self.packed_head(hidden_states)
        elif self.weight is None:
            local_logits = self.packed_table.dense_product(hidden_states)
        else:
            local_logits = F.linear(hidden_states, self.weight)
        return self.shard.gather_logits(local_logits, self.tp_group)

    def process_weights_after_loading(self, dtype: torch.dtype, quantize: str | None = None) -> None:
        """Keep GGUF codes as the table where the compiled kernels serve them (see the class
        doc), else dequantize them into it; for a tied head in bf16 on torch's int4 kernel also
        pack the codes. With `quantize`, the tied head is a fresh int4/int8 quantization of the
        dense table, used for every row count."""
        pending = take_pending_quant(self.weight)
        codes = pending.get(None)
        if codes is not None:
            _check_shape(codes, self.weight.shape)
        if codes is not None and quantize is None and dtype in (torch.float32, torch.bfloat16):
            if self.serves_as_head:
                # int8 activations by default (HEAD_ACTIVATION_BITS, FP32_ACTIVATION_BITS); fp32:
                # None where the exact mode would not be vectorized
                self.packed_head = packed_weight(codes, dtype, head=True)
                self.dense_head_above_max_rows = dtype != torch.float32
                if isinstance(self.packed_head, GroupQuantizedWeight):
                    self.packed_head_max_rows = HEAD_PACKED_MAX_ROWS
            table = self.packed_head if self.serves_as_head else packed_weight(codes, dtype)
            if isinstance(table, GroupQuantizedWeight):  # the codes alone
                self.packed_table, self.weight = table, None
                return
        if codes is not None:
            self.weight.data.copy_(codes.dequantize())
        if dtype == torch.bfloat16 and self.serves_as_head and quantize is not None:
            requantized = quantize_weight(self.weight.data, quantize)
            if requantized is not None:  # serves every row count (dense_head_above_max_rows)
                self.packed_head = packed_weight(requantized, dtype)
                self.dense_head_above_max_rows = False


class ParallelLMHead(Linear):
    """The untied output head [vocab, hidden], split by vocabulary rows like VocabEmbedding;
    returns the full (N, vocab) logits on every TP rank (the sampler runs on each)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        tp = get_tp_group()
        shard = VocabShard.for_rank(vocab_size, tp)
        super().__init__(hidden_size, shard.rows_per_rank)
        self.tp_group: GroupCoordinator = tp
        self.shard = shard
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFQuantWeight
    ) -> None:
        self.shard.load(param, loaded_weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) in the compute dtype."""
        return self.shard.gather_logits(self._linear(hidden_states, None), self.tp_group)
