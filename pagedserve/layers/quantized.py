"""GGUF weights kept in their packed form, and the int4 CPU kernel that multiplies by them.

Every GGUF type kept packed here is, per 32-element group along K, `value = scale * code + min`:
  Q4_0  code 0..15, min = -8 * scale          (llama.cpp: d * (q - 8))
  Q4_1  code 0..15, fp16 scale d and min m    (d * q + m)
  Q4_K  code 0..15 in 256-element super-blocks; each 32-group has 6-bit sc, m:
        scale = d * sc, min = -dmin * m        (fp32 products of an fp16 and a 6-bit int: exact)
  Q5_0  code 0..31, min = -16 * scale         (d * (q - 16))
  Q5_1  code 0..31, fp16 scale d and min m    (d * q + m)
  Q5_K  code 0..31, Q4_K's super-blocks and 6-bit sc, m
  Q8_0  code -128..127, min = 0                (d * q)
`GGUFQuantWeight` holds codes, fp32 scales and mins in that form: `dequantize()` reproduces
`gguf.quants.dequantize` bit for bit (tests/layers/test_quantized.py). The compiled kernel holds
each width as its bits: 4, 5 or 8 per code (`vnni_layout`).

torch's CPU int4 kernel `_weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)` computes
`(code - 8) * scale + zero` per group, so zero = min + 8 * scale. It wants scales_and_zeros in the
activation dtype: bf16 (its fp32 path exists but is ~30x slower than a dense fp32 matmul). Q8_0
and the 5-bit types do not fit 4 bits; they are split exactly into two int4 halves along K
(`as_int4_halves`):
  q + 128 = 16 * hi + lo   =>   d * q = (16 d) * hi  +  d * lo - 128 d
  (5-bit: code = 16 * hi + lo  =>  scale * code + min = (16 scale) * hi  +  scale * lo + min)
so `x @ W^T = [x, x] @ [W_hi, W_lo]^T`: one int4 matmul over 2K, one byte per weight.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from pagedserve.config import ACTIVATION_QUANTIZATION_MODES
from pagedserve.kernels import cpu_ops

GROUP_SIZE = 32
INNER_K_TILES = 2
"""Any of 1, 2, 4, 8 packs identically on the CPU (checked on torch 2.13); only CUDA uses it.

The CPU layout, for reference: the uint8 [N, K/2] result is a [N/64, K, 32] byte stream; byte
(b, k, i) holds code[64b + i, k] in its low nibble and code[64b + 32 + i, k] in its high one."""

GQT = gguf.GGMLQuantizationType
INT4_TYPES = (GQT.Q4_0, GQT.Q4_1, GQT.Q4_K)
INT5_TYPES = (GQT.Q5_0, GQT.Q5_1, GQT.Q5_K)
PACKABLE_TYPES = (*INT4_TYPES, *INT5_TYPES, GQT.Q8_0)
"""GGUF types kept in the codes form (see the module doc)."""


@dataclass
class GGUFQuantWeight:
    """One GGUF matrix [N, K] as codes plus per-32-group fp32 scale and min (see module doc)."""

    qtype: GQT
    """The form: a 4-bit or 5-bit type, or Q8_0."""
    codes: torch.Tensor
    """uint8 [N, K] in 0..15 (0..31) for the 4-bit (5-bit) types; int8 [N, K] for Q8_0."""
    scales: torch.Tensor
    """fp32 [N, K / 32]."""
    mins: torch.Tensor
    """fp32 [N, K / 32] (zeros for Q8_0)."""

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def is_int4(self) -> bool:
        return self.qtype in INT4_TYPES

    @property
    def bits(self) -> int:
        """Bits per code: 4, 5 or 8."""
        return 4 if self.is_int4 else 5 if self.qtype in INT5_TYPES else 8

    def widened(self, bits: int) -> GGUFQuantWeight | None:
        """The same values in a form of `bits` >= self.bits, or None where that form cannot
        hold them exactly: 4-bit codes are 5-bit ones as they are; Q8_0 (no min) holds the
        symmetric types, Q4_0 and Q5_0 (min = -2^(bits - 1) * scale), as code - 2^(bits - 1)."""
        if bits == self.bits:
            return self
        if bits == 5 and self.bits == 4:
            return GGUFQuantWeight(GQT.Q5_1, self.codes, self.scales, self.mins)
        offset = 1 << (self.bits - 1)
        if bits != 8 or not torch.equal(self.mins, -offset * self.scales):
            return None
        codes = (self.codes.to(torch.int16) - offset).to(torch.int8)
        return GGUFQuantWeight(GQT.Q8_0, codes, self.scales, torch.zeros_like(self.scales))

    def select_rows(self, index: torch.Tensor) -> GGUFQuantWeight:
        """Rows `index` of the matrix (used to undo llama.cpp's q/k row permutation).
        index_select copies whole rows: ~30x faster than advanced indexing on uint8 codes."""
        return GGUFQuantWeight(self.qtype, *(values.index_select(0, index)
                                             for values in (self.codes, self.scales, self.mins)))

    def narrow(self, dim: int, start: int, length: int) -> GGUFQuantWeight:
        """A tensor-parallel shard, still packed: rows (dim 0) anywhere, columns (dim 1, K) only
        on whole 32-element groups, since each group shares one scale and min."""
        if dim == 0:
            return GGUFQuantWeight(self.qtype, self.codes.narrow(0, start, length),
                                   self.scales.narrow(0, start, length),
                                   self.mins.narrow(0, start, length))
        assert dim == 1 and start % GROUP_SIZE == 0 and length % GROUP_SIZE == 0, (start, length)
        group_start, num_groups = start // GROUP_SIZE, length // GROUP_SIZE
        return GGUFQuantWeight(self.qtype, self.codes.narrow(1, start, length),
                               self.scales.narrow(1, group_start, num_groups),
                               self.mins.narrow(1, group_start, num_groups))

    def pad_rows(self, num_rows: int) -> GGUFQuantWeight:
        """Append num_rows rows of value 0 (code 0, scale 0, min 0): a vocabulary padded up to a
        multiple of the tensor-parallel size."""
        if num_rows == 0:
            return self
        n, k = self.shape
        return GGUFQuantWeight(
            self.qtype,
            torch.cat([self.codes, self.codes.new_zeros(num_rows, k)]),
            torch.cat([self.scales, self.scales.new_zeros(num_rows, k // GROUP_SIZE)]),
            torch.cat([self.mins, self.mins.new_zeros(num_rows, k // GROUP_SIZE)]),
        )

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [N, K] (or [len(rows), K]): the slow reference, equal to gguf's dequantize."""
        codes, scales, mins = self.codes, self.scales, self.mins
        if rows is not None:
            codes, scales, mins = (values.index_select(0, rows) for values in (codes, scales, mins))
        n, k = codes.shape
        grouped = codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        return (scales.unsqueeze(-1) * grouped + mins.unsqueeze(-1)).view(n, k)


def decode_gguf_blocks(data: np.ndarray, qtype: GQT, shape: tuple[int, int]) -> GGUFQuantWeight:
    """Raw GGUF bytes of a [N, K] matrix (uint8, one row of blocks per matrix row) -> codes form.
    In torch rather than numpy: its elementwise ops use every thread (half the load time)."""
    n, k = shape
    if qtype not in PACKABLE_TYPES:
        raise ValueError(f"{qtype.name} is not kept packed")
    # The data is a read-only memmap of the file, which torch warns about; every tensor made
    # from it below is a copy (cat, or contiguous() of a strided slice), so nothing writes to it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
    blocks = raw.view(-1, gguf.GGML_QUANT_SIZES[qtype][1])

    def fp16_field(offset: int) -> torch.Tensor:  # one fp16 per block, as fp32
        return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float().view(-1)

    form = qtype
    if qtype == GQT.Q8_0:  # [d fp16][32 x int8]
        scales = fp16_field(0)
        codes = blocks[:, 2:].contiguous().view(torch.int8)
        mins = torch.zeros_like(scales)
    elif qtype in (GQT.Q5_0, GQT.Q5_1):
        # [d][m (Q5_1 only)][4 bytes: element j's 5th bit is bit j][16 bytes as Q4_0's]
        scales = fp16_field(0)
        if qtype == GQT.Q5_1:
            mins, fields = fp16_field(2), 4
        else:
            mins, fields = -16.0 * scales, 2
        high_bits = blocks[:, fields:fields + 4].contiguous().view(torch.int32)
        high = (high_bits >> torch.arange(32, dtype=torch.int32)) & 1  # [blocks, 32]
        qs = blocks[:, fields + 4:]
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1) | (high.to(torch.uint8) << 4)
    elif qtype == GQT.Q5_K:
        # [d][dmin][12 bytes of 6-bit sc/m][32 bytes: element i of 32-group j has its 5th bit
        # in bit j of byte i][128 bytes as Q4_K's]
        scales, mins = _k_quant_scales_and_mins(blocks, fp16_field)
        high = (blocks[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)
                .view(1, 8, 1)) & 1  # [blocks, 8 groups, 32]
        qs = blocks[:, 48:].reshape(-1, 4, 1, 32)
        low = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)
        codes = (low | (high << 4)).reshape(-1, 256)
    elif qtype in (GQT.Q4_0, GQT.Q4_1):  # [d][m (Q4_1 only)][16 bytes: lo nibbles 0..15, hi 16..31]
        scales = fp16_field(0)
        if qtype == GQT.Q4_1:
            mins, qs = fp16_field(2), blocks[:, 4:]
        else:
            mins, qs = -8.0 * scales, blocks[:, 2:]
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    else:  # Q4_K: [d][dmin][12 bytes of 6-bit sc/m][128 bytes: per 64 elements lo 32, hi 32]
        scales, mins = _k_quant_scales_and_mins(blocks, fp16_field)
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 256)
    return GGUFQuantWeight(form, codes.reshape(n, k), scales.reshape(n, k // GROUP_SIZE),
                           mins.reshape(n, k // GROUP_SIZE))


def _k_quant_scales_and_mins(blocks: torch.Tensor, fp16_field) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's per-32-group scale d * sc and min -dmin * m, [blocks, 8] fp32."""
    d, dmin = fp16_field(0).unsqueeze(-1), fp16_field(2).unsqueeze(-1)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].numpy())
    return (d * torch.from_numpy(sc.astype(np.float32)),
            -(dmin * torch.from_numpy(m.astype(np.float32))))


def as_int4_halves(weight: GGUFQuantWeight) -> GGUFQuantWeight:
    """A 5-bit or Q8_0 matrix [N, K] -> an exactly equal 4-bit matrix [N, 2K] to be multiplied
    by [x, x] (see the module doc; a 5-bit code's hi is 0 or 1)."""
    assert weight.bits in (5, 8), weight.qtype
    d = weight.scales
    if weight.qtype == GQT.Q8_0:
        unsigned, base = weight.codes.to(torch.int16) + 128, -128.0 * d  # 0..255
    else:
        unsigned, base = weight.codes, weight.mins
    hi, lo = (unsigned >> 4).to(torch.uint8), (unsigned & 0x0F).to(torch.uint8)
    return GGUFQuantWeight(
        GQT.Q4_1,
        torch.cat([hi, lo], dim=1),
        torch.cat([16.0 * d, d], dim=1),
        # the min on the low half: torch's kernel adds zero = min + 8 * scale, exact for the
        # high half's (128 * scale) and rounded once, as for a 4-bit type, for the low half's
        torch.cat([torch.zeros_like(d), base], dim=1),
    )


def int4_scales_and_zeros(scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype):
    """[N, G] scale and min -> torch's [G, N, 2] (scale, zero) with zero = min + 8 * scale."""
    zeros = mins + 8.0 * scales
    return torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()


class Int4PackedWeight(torch.nn.Module):
    """y = x @ W^T with W in torch's CPU int4 packed format; for Q8_0 and the 5-bit types, W is
    the 2K split."""

    holds_packed_weights = True  # observability/memory.py counts its tensors as packed

    def __init__(self, weight: GGUFQuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.duplicate_input = weight.bits != 4
        if self.duplicate_input:
            weight = as_int4_halves(weight)
        assert weight.is_int4, weight.qtype
        self.out_features, packed_in = weight.shape
        self.register_buffer(
            "packed",
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weight.codes.to(torch.int32), INNER_K_TILES
            ),
        )
        self.register_buffer(
            "scales_and_zeros", int4_scales_and_zeros(weight.scales, weight.mins, dtype)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) in the scales' dtype -> (..., N)."""
        leading = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if self.duplicate_input:
            x = torch.cat([x, x], dim=-1)
        x = x.to(self.scales_and_zeros.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, GROUP_SIZE, self.scales_and_zeros
        )
        return y.view(*leading, self.out_features)


ACTIVATION_BITS = 8
"""bf16's decoder layers take int8 activations by default, each layer's 16 outlier input channels
multiplied exactly (layers/outliers.py), every row count on the codes. Measured on SmolLM2-135M,
AMD EPYC Zen 4, against the exact fp32 engine (tests/models/test_quantized_model.py): perplexity
on the shipped text -0.51% (int16: +0.43%; int8 without outlier channels -1.04%, outside the 1%
bound), mean |logprob drift| 0.078 nats (int16 0.054, most of it bf16's own rounding), greedy
tokens equal before the first divergence 466 of 640 (int16 458); after the flash prefill
kernel's softmax change (csrc flash_rows) -0.34%, 0.067 nats, 352 of 640 (greedy agreement moves
a lot with near-ties: one flipped early ends a prompt's count). Against int16 (whose layers
run the dense product above PACKED_MAX_ROWS), `bench throughput --compare-activation-quantization
int16`: 1.27x the output tok/s of 32 x 200-token prompts with 128 new tokens (decode 1.36x,
prefill 1.13x), 1.10x a 2,000-token prefill, 0.90-0.96x batch-1 decode with 8 outlier channels;
with 16: 1.18x, 1.06x and 0.82x (layers/outliers.py OUTLIER_CHANNELS)."""
HEAD_ACTIVATION_BITS = 8
"""A tied output head on its GGUF codes in bf16 takes int8 activations: on SmolLM2-135M it is
1.6-1.7x the int16 speed at 1 to 32 rows (AMD EPYC Zen 4), and the perplexity on the shipped text
moved from 19.91 to 19.85 (fp32: 19.82)."""
FP32_ACTIVATION_BITS = 8
"""fp32 (the compute dtype of CPUs without native bf16) takes int8 activations in every layer and
the head by default, where the integer kernel is vectorized. With 16 outlier input channels per
layer multiplied exactly (layers/outliers.py; AMD EPYC Zen 4): perplexity on the shipped text
-0.33%, mean |logprob drift| 0.062 nats, greedy agreement 505 of 640. Before them, measured on
SmolLM2-135M, AMD EPYC Zen 3 (AVX2), against the exact fp32 engine
(tests/models/test_quantized_model.py):
- quality: perplexity on the shipped text -0.43% (int16: -0.00%); teacher-forced on it, the
  exact engine's top token kept at 94.5% of positions (int16: 100%), the text's tokens' logprobs
  0.09 nats from the exact ones on average (int16: 0.0004); greedy tokens equal before the first
  divergence 372 of 640 (int16: 640), on 20 prompts x 32 tokens;
- speed against int16: 1.39-1.48x per matmul at 32 and 2,048 rows (`bench matmul`); in whole
  runs (`bench throughput --compare-activation-quantization int16`) 1.25x the output tok/s of 32
  x 200-token prompts with 128 new tokens, 1.21x a 2,000-token prefill, 0.98x batch-1 decode.
int8 lost much more before its group sums came from the quantized activations (csrc/cpu_ops.cpp,
above QuantizedRows): 0.21 nats of mean |logprob| drift against 0.09 now."""
EXACT_ACTIVATION_BITS = 32
"""The kernel's exact mode: activations as they are, the weights dequantized exactly (the dense
model's values, bit for bit) and multiplied in fp32 (see GroupQuantizedWeight)."""
# --activation-quantization (KernelConfig.activation_quantization), for matmuls on GGUF codes by
# the compiled kernels:
#   auto   in fp32 int8 everywhere (FP32_ACTIVATION_BITS), or the exact mode where this build's
#          integer kernel is not vectorized; in bf16 int8 in the layers (ACTIVATION_BITS) and
#          in a tied head (HEAD_ACTIVATION_BITS)
#   none   exact (EXACT_ACTIVATION_BITS): in fp32 the dense model's computation up to summation
#          order, the reference the others are measured against
#   int16 / int8: those bits in every layer and the head.


EXPERT_ACTIVATION_BITS = 16
"""bf16's MoE experts keep int16 activations under auto: the outlier channels that bring int8
within bounds are chosen for Linear layers only (layers/outliers.py). On the tiny MoE test
models (tests/models/test_moe.py) int8 experts' logprobs drifted 0.035 from the fp32 reference,
the dense bf16 experts' 0.018."""


def activation_bits_for(mode: str, dtype: torch.dtype, ops, head: bool = False,
                        expert: bool = False) -> int:
    """The activation bits of a layer (or tied head, `head`, or MoE expert, `expert`) built
    under `mode` for `dtype`."""
    if mode not in ACTIVATION_QUANTIZATION_MODES:  # config.py's
        raise ValueError(f"activation quantization must be one of "
                         f"{', '.join(ACTIVATION_QUANTIZATION_MODES)}, got {mode!r}")
    if mode == "none":
        return EXACT_ACTIVATION_BITS
    if mode != "auto":
        return int(mode.removeprefix("int"))
    if dtype == torch.float32:
        return FP32_ACTIVATION_BITS if ops.integer_linear_vectorized() else EXACT_ACTIVATION_BITS
    if expert:
        return EXPERT_ACTIVATION_BITS
    return HEAD_ACTIVATION_BITS if head else ACTIVATION_BITS


def vnni_layout(weight: GGUFQuantWeight, ops=None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Codes, scales, mins and bits in the compiled kernel's layout (csrc/cpu_ops.cpp,
    quant_linear): 16 output columns per block, each 32-bit lane one column's 4 consecutive
    codes (5-bit: their low 4 bits, and a fifth chunk of fifth bits); scales and mins in fp16
    where that is exact, else fp32. N is padded to a multiple of 16 with zero columns. Q8_0
    codes are stored + 128 as unsigned bytes with min = -128 * scale (exact: the shift cancels
    in the kernel). ops: the compiled kernels, which lay the codes out in one pass
    (`pack_codes`); None: by torch's reshapes, the reference."""
    n, k = weight.shape
    groups, blocks = k // GROUP_SIZE, -(-n // 16)
    bits = weight.bits
    codes, scales, mins = weight.codes, weight.scales.float(), weight.mins.float()
    if bits == 8:
        codes = (codes.to(torch.int16) + 128).to(torch.uint8)
        mins = -128.0 * scales
    pad = blocks * 16 - n
    scales = torch.nn.functional.pad(scales, (0, 0, 0, pad))
    mins = torch.nn.functional.pad(mins, (0, 0, 0, pad))
    if ops is not None:
        packed = ops.pack_codes(codes, bits)
    else:
        codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
        grouped = codes.view(blocks, 16, groups, GROUP_SIZE)  # [block, column, group, element]
        if bits != 8:  # chunk i: element 4i + e in the low nibble, 16 + 4i + e in the high one
            low = grouped[..., :16].reshape(blocks, 16, groups, 4, 4) & 0x0F
            high = grouped[..., 16:].reshape(blocks, 16, groups, 4, 4) & 0x0F
            chunks = low | (high << 4)
        else:  # chunk j: element 4j + e
            chunks = grouped.reshape(blocks, 16, groups, 8, 4)
        packed = chunks.permute(0, 2, 3, 1, 4).contiguous()  # [block, group, chunk, col, byte]
        if bits == 5:  # chunk 4: word j's bit 4 * column + e is element 4j + e's fifth bit
            fifth = (grouped >> 4).reshape(blocks, 16, groups, 8, 4)  # [.., column, .., j, e]
            fifth = fifth.permute(0, 2, 3, 1, 4).reshape(blocks, groups, 8, 8, 8)
            weights = 1 << torch.arange(8, dtype=torch.uint8)  # bit (4 column + e) % 8
            fifth = (fifth * weights).sum(dim=-1, dtype=torch.uint8)  # [.., word j, byte]
            packed = torch.cat([packed.view(blocks, groups, 4, 64),
                                fifth.view(blocks, groups, 1, 64)], dim=2)

    def per_block(values: torch.Tensor) -> torch.Tensor:
        return values.view(blocks, 16, groups).transpose(1, 2).contiguous()

    scales, mins = per_block(scales), per_block(mins)
    # fp16 where exact (Q4_0, Q4_1, Q8_0 store fp16; Q4_K's d * sc products may not be): fewer
    # bytes to stream per weight, the same values.
    halves = scales.half(), mins.half()
    if all(torch.equal(h.float(), f) for h, f in zip(halves, (scales, mins))):
        scales, mins = halves
    return packed.flatten(), scales, mins, bits


class GroupQuantizedWeight(torch.nn.Module):
    """y = x @ W^T by the compiled CPU kernel (csrc/cpu_ops.cpp `quant_linear`), the weights kept
    as GGUF groups (`scale * code + min`): 4-bit codes take half a byte, Q8_0 codes one byte (no
    split). How the activations meet them depends on the compute dtype:

    - int16 / int8 (activation_bits 16 / 8; int8 by default, see activation_bits_for; int8
      layers multiply a few outlier input channels exactly, layers/outliers.py):
      they are quantized per 32-element group on the fly (int16 within ~1e-5 of the exact
      product; int8 as llama.cpp does), and VNNI (or AVX2's dot products) multiplies the two in
      exact integer sums.
    - exact (EXACT_ACTIVATION_BITS): each weight is dequantized exactly (the dense model's value,
      bit for bit) and multiplied by the activations with fp32 sums.
    Either way each output element's sum runs in an order fixed per element, so a row's result
    does not depend on its batch. In fp32 the exact mode is the dense matmul's arithmetic but the
    summation order, ~1/6 of its bytes to read.
    """

    holds_packed_weights = True  # observability/memory.py counts its tensors as packed

    def __init__(self, weight: GGUFQuantWeight, ops, dtype: torch.dtype = torch.bfloat16,
                 activation_bits: int | None = None) -> None:
        """activation_bits: 16, 8 or 32 (exact); None: exact in fp32, ACTIVATION_BITS in bf16."""
        super().__init__()
        self._ops = ops
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not buffers: model.to(bf16) must not round the fp32 scales. (This
        # form only lives on the CPU, so no device move is missed.)
        self.codes, self.scales, self.mins, self.bits = vnni_layout(weight, ops)
        self.dtype = dtype
        """The compute dtype served (lookups return it)."""
        if activation_bits is None:
            activation_bits = EXACT_ACTIVATION_BITS if dtype == torch.float32 else ACTIVATION_BITS
        self.activation_bits = activation_bits
        self.outlier_channels: torch.Tensor | None = None
        """Input channels multiplied exactly instead of quantized (int64, ascending; None: none):
        set by layers/outliers.py from a calibration text, int8 activations only."""
        self.outlier_weights: torch.Tensor | None = None
        """Their dequantized weights in fp16, [channels, N padded to 16]."""

    def set_outlier_channels(self, channels: torch.Tensor | None) -> None:
        """Multiply input `channels` exactly from now on (None or empty: none): the kernel takes
        them out of the quantized activations and adds x[:, c] * W[:, c] by fp32 FMAs, W's
        columns rounded to fp16 (csrc: OutlierChannels)."""
        if channels is None or channels.numel() == 0:
            self.outlier_channels = self.outlier_weights = None
            return
        channels = torch.unique(channels.to(torch.int64))  # ascending
        dense = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        self.dequantize_into(dense)
        padded = -(-self.out_features // 16) * 16
        weights = torch.zeros(channels.numel(), padded, dtype=torch.float16)
        weights[:, :self.out_features] = dense[:, channels].t().to(torch.float16)
        self.outlier_channels, self.outlier_weights = channels.contiguous(), weights

    def dequantize_into(self, out: torch.Tensor) -> None:
        """Write the weights as dense rows into out ([N, K] fp32 or bf16, contiguous): the
        values of GGUFQuantWeight.dequantize, rounded once to out's dtype."""
        self._ops.dequantize_codes(self.codes, self.scales, self.mins, self.bits, out)

    def dense_product(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, W, bias) with W the dense weights (dequantize_into's values), computed by
        torch's matmul on panels of them dequantized per call (csrc: dequantize_linear): the
        dense layer's output, bitwise, for large inputs, with no dense copy held."""
        leading = x.shape[:-1]
        y = self._ops.dequantize_linear(x.reshape(-1, x.shape[-1]), self.codes, self.scales,
                                        self.mins, self.out_features, self.bits, bias)
        return y.view(*leading, self.out_features)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W (ids of any shape -> (*ids.shape, K)) in the compute dtype: what
        F.embedding returns from the dense table, read from the codes."""
        return self._ops.embedding_from_codes(ids, self.codes, self.scales, self.mins,
                                              self.out_features, self.in_features, self.bits,
                                              self.dtype)

    def gated_product(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """x (T, K) -> (T, N / 2): act(gate) * up of this merged gate_up weight's product (gate
        rows first), activation "silu" or "gelu_tanh": bitwise layers/activation.py's
        silu_and_mul (gelu_tanh_and_mul) of self(x), in one pass that never stores the (T, N)
        product (csrc: quant_linear_gated). Quantized activations and N / 2 a multiple of 16
        only (`serves_gated_product`)."""
        return self._ops.quant_linear_gated(x, self.codes, self.scales, self.mins,
                                            self.out_features, self.bits, self.activation_bits,
                                            activation, self.outlier_channels,
                                            self.outlier_weights)

    @property
    def serves_gated_product(self) -> bool:
        """Whether gated_product serves this weight."""
        return self.activation_bits != 32 and self.out_features % 32 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) in fp32 or bf16 -> (..., N) in x's dtype."""
        leading = x.shape[:-1]
        y = self._ops.quant_linear(x.reshape(-1, x.shape[-1]), self.codes, self.scales,
                                   self.mins, self.out_features, self.bits,
                                   self.activation_bits, None, self.outlier_channels,
                                   self.outlier_weights)
        return y.view(*leading, self.out_features)


def packed_weight(weight: GGUFQuantWeight, dtype: torch.dtype, head: bool = False,
                  expert: bool = False) -> torch.nn.Module | None:
    """The fastest packed form available for compute `dtype`: the compiled kernel's (unless the
    KernelConfig of the model being loaded turns them off, kernels/cpu_ops.py), its activations
    quantized as that KernelConfig's activation_quantization says for a layer, a tied head
    (`head`) or an MoE expert (`expert`), else torch's int4 kernel (bf16 activations). None
    for fp32 where the compiled kernel would run the exact mode unvectorized (torch's int4
    kernel in fp32 is ~30x slower than the dense matmul): the layer stays dense."""
    ops = cpu_ops.for_new_layer()
    if ops is not None and dtype in (torch.float32, torch.bfloat16):
        mode = cpu_ops.build_config().activation_quantization
        bits = activation_bits_for(mode, dtype, ops, head, expert)
        if bits == EXACT_ACTIVATION_BITS and not ops.exact_linear_vectorized():
            return None if dtype == torch.float32 else Int4PackedWeight(weight, dtype)
        return GroupQuantizedWeight(weight, ops, dtype, bits)
    if dtype == torch.float32:
        return None
    return Int4PackedWeight(weight, dtype)


def concat_rows(weights: list[GGUFQuantWeight]) -> GGUFQuantWeight | None:
    """Stack shards along N (merged QKV / gate-up), in the widest shard's form; None where a
    shard cannot be held exactly in it (`GGUFQuantWeight.widened`: an asymmetric 4- or 5-bit
    shard beside a Q8_0 one).

    The 4-bit types share one form (per-32 scale and min), so Q4_0, Q4_1 and Q4_K shards mix;
    so do the 5-bit types, and 4-bit shards join them as they are.
    """
    bits = max(w.bits for w in weights)
    widened = [w.widened(bits) for w in weights]
    if any(w is None for w in widened):
        return None
    return GGUFQuantWeight(
        widened[0].qtype,
        torch.cat([w.codes for w in widened]),
        torch.cat([w.scales for w in widened]),
        torch.cat([w.mins for w in widened]),
    )


def quantize_weight(weight: torch.Tensor, scheme: str) -> GGUFQuantWeight | None:
    """Quantize a dense [N, K] matrix on load, per 32-element group along K (the GGUF layout, so
    the packed path is shared): "int4" / "int5" asymmetric (scale = (max - min) / 15 or 31, min
    kept: Q4_1's / Q5_1's form), "int8" symmetric (scale = absmax / 127: Q8_0's form). None if K
    is not a multiple of 32. Each element is off by at most half its group's scale
    (tests/layers/test_quantized.py).
    """
    n, k = weight.shape
    if k % GROUP_SIZE:
        return None
    groups = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    if scheme in ("int4", "int5"):
        top = 15 if scheme == "int4" else 31
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = (high - low) / top
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = ((groups - low[..., None]) / safe[..., None]).round_().clamp_(0, top)
        form = GQT.Q4_1 if scheme == "int4" else GQT.Q5_1
        return GGUFQuantWeight(form, codes.to(torch.uint8).reshape(n, k), scales, low)
    if scheme == "int8":
        scales = groups.abs().amax(dim=-1) / 127
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = (groups / safe[..., None]).round_().clamp_(-127, 127)
        return GGUFQuantWeight(
            GQT.Q8_0, codes.to(torch.int8).reshape(n, k), scales, torch.zeros_like(scales)
        )
    raise ValueError(f"unknown quantization scheme {scheme!r}")
