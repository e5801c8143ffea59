"""Triton code for the NVFP4 KV-cache write (launcher and reference: ``kernels/fp4_kv.py``)."""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import nvfp4_quantize_rows
from ..moe_details._mx import pdl_wait_then_release


@triton.jit
def _fp4_kv_write_kernel(
    key_ptr,  # [T, Hkv, HEAD]
    value_ptr,  # [T, Hkv, HEAD]
    k_data_ptr,  # [num_blocks, Hkv, BLOCK_SIZE, HEAD/2] uint8 (strided view of the page)
    k_scale_ptr,  # [num_blocks, Hkv, BLOCK_SIZE, HEAD/16] uint8 (e4m3 bytes)
    v_data_ptr,
    v_scale_ptr,
    slot_mapping_ptr,  # [T] int64, < 0 = skip
    k_global_ptr,  # [1] fp32
    v_global_ptr,  # [1] fp32
    stride_k_t: tl.int64,
    stride_k_h: tl.int64,
    stride_v_t: tl.int64,
    stride_v_h: tl.int64,
    stride_kd_b: tl.int64,
    stride_ks_b: tl.int64,
    stride_vd_b: tl.int64,
    stride_vs_b: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent ($VLLM_SM121_PDL): wait first thing
):
    """Program (token, side): side 0 writes the token's K, side 1 its V (two programs per token, so a
    one-token decode step spreads over two SMs instead of one warp doing both)."""
    if PDL:
        pdl_wait_then_release()
    tok = tl.program_id(0).to(tl.int64)
    side = tl.program_id(1)
    offs_h = tl.arange(0, NUM_KV_HEADS)
    offs_d = tl.arange(0, HEAD)
    if side == 0:
        src, sh, st, d_ptr, s_ptr, sdb, ssb, g_ptr = key_ptr, stride_k_h, stride_k_t, k_data_ptr, k_scale_ptr, stride_kd_b, stride_ks_b, k_global_ptr
    else:
        src, sh, st, d_ptr, s_ptr, sdb, ssb, g_ptr = value_ptr, stride_v_h, stride_v_t, v_data_ptr, v_scale_ptr, stride_vd_b, stride_vs_b, v_global_ptr
    # The slot, the token's row and the global scale are loaded together, and a skipped slot masks
    # the stores rather than returning early (the compiler would sink the row's loads below such a
    # branch): one memory round trip before the stores instead of two. The row exists for every
    # token < T, padded graph rows included, so loading it for a skipped slot is harmless.
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    x = tl.load(src + tok * st + offs_h[:, None] * sh + offs_d[None, :]).to(tl.float32)
    g = tl.load(g_ptr)
    nvfp4_store_slot(x, g, slot, 0, d_ptr, s_ptr, sdb, ssb, NUM_KV_HEADS, HEAD, BLOCK_SIZE)


@triton.jit
def nvfp4_store_slot(x, g, slot, head0, d_ptr, s_ptr, stride_d_page, stride_s_page, ROWS: tl.constexpr,
                     HEAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """x [ROWS, HEAD] fp32 (heads head0 .. head0 + ROWS - 1 of one token) quantized to NVFP4 with
    global scale g into page slot ``slot`` (< 0: nothing is stored; a mask, not a branch, so the
    caller's loads stay ahead of it). Within a page: [Hkv][BLOCK_SIZE][HEAD/2] data,
    [Hkv][BLOCK_SIZE][HEAD/16] e4m3 scales."""
    offs_p = tl.arange(0, HEAD // 2)
    offs_s = tl.arange(0, HEAD // 16)
    ok = slot >= 0
    slot = tl.maximum(slot, 0)
    page = slot // BLOCK_SIZE
    row = (head0 + tl.arange(0, ROWS)) * BLOCK_SIZE + slot % BLOCK_SIZE
    packed, s_code = nvfp4_quantize_rows(x, g, ROWS, HEAD // 16)
    tl.store(d_ptr + page * stride_d_page + row[:, None] * (HEAD // 2) + offs_p[None, :], packed, mask=ok)
    tl.store(s_ptr + page * stride_s_page + row[:, None] * (HEAD // 16) + offs_s[None, :], s_code, mask=ok)
