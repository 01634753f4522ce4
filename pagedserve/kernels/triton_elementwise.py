"""The Triton kernels behind kernels/triton_ops.py (its wrappers launch them; see its docstring).

A module of its own, imported on first launch: @triton.jit reads TRITON_INTERPRET as it
decorates, so the tests that run these under the interpreter set it before this module loads,
whatever imported the layers (and kernels/triton_ops.py) earlier.
"""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                         hidden: tl.constexpr, eps, HAS_RESIDUAL: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0)
        # torch adds in the compute dtype: one rounding of the fp32 sum
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.math.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, width: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * width + width + cols, mask=mask, other=0.0)
    # F.silu rounds to the compute dtype, then the product rounds again
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

@triton.jit
def rotary_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, row_stride, num_heads,
                   HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HEADS_BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    half = HALF
    dims = tl.arange(0, HALF)
    position = tl.load(positions_ptr + token)
    cos_lo = tl.load(cos_ptr + position * HEAD_DIM + dims).to(tl.float32)
    cos_hi = tl.load(cos_ptr + position * HEAD_DIM + half + dims).to(tl.float32)
    sin_lo = tl.load(sin_ptr + position * HEAD_DIM + dims).to(tl.float32)  # already negated
    sin_hi = tl.load(sin_ptr + position * HEAD_DIM + half + dims).to(tl.float32)
    mask = (heads < num_heads)[:, None]
    base = qkv_ptr + token * row_stride + heads[:, None] * HEAD_DIM + dims[None, :]
    lo = tl.load(base, mask=mask, other=0.0)
    hi = tl.load(base + half, mask=mask, other=0.0)
    dtype = lo.dtype
    lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
    # x * cos + roll(x, D/2) * signed_sin, each product and the sum rounded as torch does
    new_lo = ((lo32 * cos_lo[None, :]).to(dtype).to(tl.float32)
              + (hi32 * sin_lo[None, :]).to(dtype).to(tl.float32)).to(dtype)
    new_hi = ((hi32 * cos_hi[None, :]).to(dtype).to(tl.float32)
              + (lo32 * sin_hi[None, :]).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base, new_lo, mask=mask)
    tl.store(base + half, new_hi, mask=mask)
