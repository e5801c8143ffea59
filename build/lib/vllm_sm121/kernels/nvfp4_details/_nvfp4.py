"""Triton code for the NVFP4 codec (launcher and reference: ``kernels/nvfp4.py``)."""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import nvfp4_dequantize_rows, nvfp4_quantize_rows


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
    offs_d = tl.arange(0, NUM_BLOCKS * 16)
    x = tl.load(x_ptr + row * stride_x + offs_d).to(tl.float32)
    packed, s_code = nvfp4_quantize_rows(x[None, :], tl.load(global_scale_ptr), 1, NUM_BLOCKS)
    offs_p = tl.arange(0, NUM_BLOCKS * 8)
    tl.store(packed_ptr + row * stride_p + offs_p[None, :], packed)
    tl.store(scales_ptr + row * stride_s + offs_b[None, :], s_code)


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
    offs_p = tl.arange(0, NUM_BLOCKS * 8)
    packed = tl.load(packed_ptr + row * stride_p + offs_p)
    s_codes = tl.load(scales_ptr + row * stride_s + offs_b)
    vals = nvfp4_dequantize_rows(packed[None, :], s_codes[None, :], 1, NUM_BLOCKS * 16) * tl.load(global_scale_ptr)
    offs_d = tl.arange(0, NUM_BLOCKS * 16)
    tl.store(out_ptr + row * stride_o + offs_d[None, :], vals)
