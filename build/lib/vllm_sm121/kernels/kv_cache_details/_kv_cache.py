"""Triton code for the KV-cache write (launcher and reference: ``kernels/kv_cache.py``)."""

import triton
import triton.language as tl

from ._codecs import e4m3_encode

FP8_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [T, Hkv, HEAD_SIZE]
    value_ptr,  # [T, Hkv, HEAD_SIZE]
    k_cache_ptr,  # [num_blocks, Hkv, BLOCK_SIZE, HEAD_SIZE]
    v_cache_ptr,  # [num_blocks, Hkv, BLOCK_SIZE, HEAD_SIZE]
    slot_mapping_ptr,  # [T] int64: block * BLOCK_SIZE + offset, < 0 = skip (padding)
    k_scale_ptr,  # [1] fp32 (KV_FP8)
    v_scale_ptr,  # [1] fp32 (KV_FP8)
    stride_k_t: tl.int64,
    stride_k_h: tl.int64,
    stride_v_t: tl.int64,
    stride_v_h: tl.int64,
    stride_kc_b: tl.int64,
    stride_kc_h: tl.int64,
    stride_kc_t: tl.int64,
    stride_vc_b: tl.int64,
    stride_vc_h: tl.int64,
    stride_vc_t: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFT_FP8: tl.constexpr,  # encode e4m3 in software (the CPU interpreter's conversion is wrong)
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    page = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)

    k = tl.load(key_ptr + tok * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    if KV_FP8:
        # stored = clamp(x / scale) in e4m3 (round to nearest even); saturate like the hardware.
        k = tl.clamp(tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), -FP8_E4M3_MAX, FP8_E4M3_MAX)
        v = tl.clamp(tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    k_dst = k_cache_ptr + page * stride_kc_b + offs_h[:, None] * stride_kc_h + off * stride_kc_t + offs_d[None, :]
    v_dst = v_cache_ptr + page * stride_vc_b + offs_h[:, None] * stride_vc_h + off * stride_vc_t + offs_d[None, :]
    if SOFT_FP8:
        k = e4m3_encode(k).to(tl.float8e4nv, bitcast=True)
        v = e4m3_encode(v).to(tl.float8e4nv, bitcast=True)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
