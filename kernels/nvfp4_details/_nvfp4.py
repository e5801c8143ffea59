"""Triton code for the NVFP4 codec (launcher and reference: ``kernels/nvfp4.py``)."""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import e2m1_decode, e2m1_encode, e4m3_encode


@triton.jit
def _nvfp4_quantize_kernel(
    x_ptr,  # [R, D] bf16/fp16/fp32
    packed_ptr,  # [R, D // 2] uint8: two e2m1 codes per byte, even element in the low nibble
    scales_ptr,  # [R, D // 16] uint8 (e4m3 bytes): one block scale per 16 elements
    global_scale_ptr,  # [1] fp32
    stride_x: tl.int64,
    stride_p: tl.int64,
    stride_s: tl.int64,
    NUM_BLOCKS: tl.constexpr,  # D // 16
):
    row = tl.program_id(0).to(tl.int64)
    offs_b = tl.arange(0, NUM_BLOCKS)
    offs_e = tl.arange(0, 16)
    x = tl.load(x_ptr + row * stride_x + offs_b[:, None] * 16 + offs_e[None, :]).to(tl.float32)
    g = tl.load(global_scale_ptr)
    amax = tl.max(tl.abs(x), axis=1)
    # Block scale in e4m3, relative to the global scale; amax/6 maps the block onto e2m1's range.
    s_code = e4m3_encode(tl.math.div_rn(amax, 6.0 * g))
    s = s_code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    denom = s * g
    safe = tl.where(denom > 0.0, denom, 1.0)
    q = tl.math.div_rn(x, safe[:, None])
    q = tl.where(denom[:, None] > 0.0, q, 0.0)
    codes = e2m1_encode(q).to(tl.int32)  # [NUM_BLOCKS, 16]
    lo, hi = tl.split(tl.reshape(codes, [NUM_BLOCKS, 8, 2]))
    packed = (lo | (hi << 4)).to(tl.uint8)  # [NUM_BLOCKS, 8]
    offs_p = tl.arange(0, 8)
    tl.store(packed_ptr + row * stride_p + offs_b[:, None] * 8 + offs_p[None, :], packed)
    tl.store(scales_ptr + row * stride_s + offs_b, s_code)


@triton.jit
def _nvfp4_dequantize_kernel(
    packed_ptr,  # [R, D // 2] uint8
    scales_ptr,  # [R, D // 16] uint8 (e4m3 bytes)
    global_scale_ptr,  # [1] fp32
    out_ptr,  # [R, D] fp32
    stride_p: tl.int64,
    stride_s: tl.int64,
    stride_o: tl.int64,
    NUM_BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_b = tl.arange(0, NUM_BLOCKS)
    offs_p = tl.arange(0, 8)
    packed = tl.load(packed_ptr + row * stride_p + offs_b[:, None] * 8 + offs_p[None, :]).to(tl.int32)
    s = tl.load(scales_ptr + row * stride_s + offs_b).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scale = s * tl.load(global_scale_ptr)
    lo = e2m1_decode(packed) * scale[:, None]
    hi = e2m1_decode(packed >> 4) * scale[:, None]
    vals = tl.reshape(tl.join(lo, hi), [NUM_BLOCKS, 16])  # interleave back: element 2i, 2i+1
    offs_e = tl.arange(0, 16)
    tl.store(out_ptr + row * stride_o + offs_b[:, None] * 16 + offs_e[None, :], vals)
