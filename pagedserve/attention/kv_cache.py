"""The paged KV cache tensors: their layout, their size, and (quantized) how K/V are stored.

One layer's cache (a `KVCache`) is a tuple of tensors, each with the block index on dim 1, so a
block's whole KV is `[t[:, block_id] for t in kv_cache]`:
  compute dtype ("auto"): (key, value), each (Hkv, num_blocks, block_size, D)
  int8 / fp8 (e4m3) / fp16: (key, value, key_scale, value_scale): codes as above, scales
                          (Hkv, num_blocks, block_size) fp16
Head-major (see paged.py for why). Quantization is symmetric, one scale per (KV head, token):
x ~= code * scale, scale = absmax(x over D) / QUANT_MAX, so writing a token never re-quantizes
what its block already holds. The entry describes itself (2 tensors or 4), so one loaded model
serves caches of either kind: a self-draft runs the target's layers on its compute-dtype cache.

Zeroed, not empty: masked positions still pass through softmax @ V, and a NaN there would poison
the row (0 * NaN = NaN); zero codes with zero scales dequantize to 0. On the CPU the zeros cost
nothing up front: the tensors live in private anonymous mappings, which the kernel fills with zero
pages as they are first touched (see `lazily_zeroed`).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

KVCache = tuple[torch.Tensor, ...]
"""One layer's cache: (key, value) or (key, value, key_scale, value_scale); see above."""

QUANTIZED_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp16": torch.float16}
"""--kv-cache-dtype -> the element type of the codes ("auto" keeps the compute dtype). fp16 is for
an fp32 engine: half its cache's bytes, rounded at fp16's 11 bits (llama.cpp's default KV type);
as codes with a scale it cannot overflow (|code| <= 1) and it runs the quantized caches' kernels."""
QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float16: 1.0}
"""The largest code: absmax maps to it (e4m3's largest finite value is 448; fp16's precision is
the same at any magnitude, so 1)."""
SCALE_DTYPE = torch.float16
"""fp16 scales: 2 bytes per (head, token) against 4 for fp32, which is 3% of an int8 token-head
at head_dim 64 (bf16 128 B vs int8 64 + 2 B: 1.94x the tokens; fp32 scales: 1.88x). The rounded
scale is the one the codes are computed with, so rounding it costs no accuracy; its range is
clamped to [SCALE_MIN, SCALE_MAX] (see quantize_kv)."""
SCALE_MIN = 2.0**-14
"""fp16's smallest normal: rows with absmax below QUANT_MAX * SCALE_MIN (int8: 0.0078) are stored
with absolute error <= SCALE_MIN / 2 instead of relative; an all-zero row gets codes 0."""
SCALE_MAX = 65504.0
"""fp16's largest finite value; larger rows (absmax > 8e6) saturate."""


@dataclass(frozen=True)
class KVCacheSpec:
    """What one rank's paged KV cache holds: its layers, its layout and its element types."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    """K/V elements: the compute dtype, or int8 / float8_e4m3fn / float16 codes."""
    scale_dtype: torch.dtype | None = None
    """None: K/V stored as they are; else the per-(head, token) scales' dtype."""
    layer_slots: tuple[int, ...] = ()
    """Per layer, the slot whose tensors hold its KV: layers of different KV cache groups share
    a slot, each in the blocks its group holds (KVCacheLayout.layer_slots). (): a slot each."""

    @classmethod
    def create(
        cls, cache_dtype: str, compute_dtype: torch.dtype, num_layers: int, num_kv_heads: int,
        head_dim: int, block_size: int, layer_slots: tuple[int, ...] = (),
    ) -> KVCacheSpec:
        """cache_dtype: CacheConfig.cache_dtype ("auto", "int8", "fp8" or "fp16")."""
        if layer_slots and len(layer_slots) != num_layers:
            raise ValueError(f"{len(layer_slots)} layer slots for {num_layers} layers")
        if cache_dtype == "auto":
            return cls(num_layers, num_kv_heads, head_dim, block_size, compute_dtype,
                       layer_slots=layer_slots)
        if cache_dtype not in QUANTIZED_DTYPES:
            raise ValueError(f"unknown KV cache dtype {cache_dtype!r}")
        return cls(num_layers, num_kv_heads, head_dim, block_size, QUANTIZED_DTYPES[cache_dtype],
                   SCALE_DTYPE, layer_slots)

    @property
    def quantized(self) -> bool:
        return self.scale_dtype is not None

    @property
    def num_slots(self) -> int:
        """Layers' worth of KV one block holds."""
        return max(self.layer_slots) + 1 if self.layer_slots else self.num_layers

    def shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        """The shape of each tensor of one layer's KVCache, in order."""
        kv = kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [kv, kv] + ([kv[:3], kv[:3]] if self.quantized else [])

    def dtypes(self) -> list[torch.dtype]:
        return [self.dtype, self.dtype] + ([self.scale_dtype] * 2 if self.quantized else [])

    @property
    def bytes_per_block(self) -> int:
        """Every tensor of every slot, scales included (the pool is sized by this)."""
        per_layer = sum(
            _numel(shape) * _element_size(dtype)
            for shape, dtype in zip(self.shapes(1), self.dtypes())
        )
        return self.num_slots * per_layer

    def allocate(self, num_blocks: int, device: torch.device | str) -> list[KVCache]:
        """One KVCache per layer, zeroed (on the CPU, lazily: see lazily_zeroed); layers that
        share a slot share its tensors."""
        zeroed = lazily_zeroed if torch.device(device).type == "cpu" else torch.zeros
        slots = [
            tuple(zeroed(shape, dtype=dtype, device=device)
                  for shape, dtype in zip(self.shapes(num_blocks), self.dtypes()))
            for _ in range(self.num_slots)
        ]
        return [slots[slot] for slot in (self.layer_slots or range(self.num_layers))]


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
    """A zeroed CPU tensor whose memory is committed page by page as it is first written.

    It lives in a private anonymous mapping: the kernel backs every page with zeros on first
    touch (guaranteed, unlike torch.empty, whose memory may be reused from the allocator's
    heap). torch.zeros would write every byte at once: ~0.75 s at start-up for the default
    2 GiB pool, most of which a server touches only under load. The memory report counts the
    pool's resident pages (observability/memory.py). The tensor keeps the mapping alive; the
    mapping is unmapped when the last tensor viewing it is freed."""
    assert device is None or torch.device(device).type == "cpu", device
    nbytes = _numel(shape) * _element_size(dtype)
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    return (num_kv_heads, num_blocks, block_size, head_dim)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> codes (..., D) of `dtype` and fp16 scales (...): one scale per row.

    The compiled write (csrc/cpu_ops.cpp write_kv) does the same fp32 arithmetic, so both store
    the same bits: scale = clamp(absmax / QUANT_MAX) rounded to fp16, codes = x / scale rounded
    (int8: half to even, clamped to +-127; fp8 / fp16: clamped to +-448 / +-1, rounded by the
    cast)."""
    qmax = QUANT_MAX[dtype]
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1) / qmax).clamp_(SCALE_MIN, SCALE_MAX).to(SCALE_DTYPE)
    scaled = x32 / scale.float().unsqueeze(-1)
    if dtype == torch.int8:
        return scaled.round_().clamp_(-qmax, qmax).to(torch.int8), scale
    return scaled.clamp_(-qmax, qmax).to(dtype), scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., D), scale (...) -> (..., D) in `dtype`: the product in fp32, rounded once."""
    return (codes.float() * scale.float().unsqueeze(-1)).to(dtype)


def dequantize_kv_cache(
    kv_cache: KVCache, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole layer's (key, value) in `dtype`, quantized or not (for the slow reference)."""
    key, value, *scales = kv_cache
    if not scales:
        return key.to(dtype), value.to(dtype)
    return dequantize_kv(key, scales[0], dtype), dequantize_kv(value, scales[1], dtype)
