"""Triton code for the decode-time MoE FC2 (launcher and reference: ``kernels/moe.py``)."""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import _pow2, e2m1_decode, to_bf16_rne


@triton.jit
def _moe_fc2_combine_kernel(
    h_ptr,  # [M * TOPK, I] uint8 e4m3: FC1 output (MXFP8)
    h_scale_ptr,  # [M * TOPK, I / 32] uint8 e8m0
    w_ptr,  # [E, H, I / 2] uint8 e2m1 pairs, low nibble first
    w_scale_ptr,  # [E, H, I / 32] uint8 e8m0
    bias_ptr,  # [E, H] bf16
    topk_ids_ptr,  # [M, TOPK] int32
    topk_w_ptr,  # [M, TOPK] fp32 routing weights
    out_ptr,  # [M, H] bf16: sum_j w_j * (h_j @ W2[e_j]^T + b2[e_j])
    H: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # multiple of 32
):
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pair = token * TOPK + j
        expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
        w_rows = expert * H + rows
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < I
            h = tl.load(h_ptr + pair * I + offs_k, mask=k_ok, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            h_e = tl.load(h_scale_ptr + pair * (I // 32) + offs_k // 32, mask=k_ok, other=127).to(tl.int32) - 127
            h = h * _pow2(tl.maximum(h_e, -126))
            offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            wq = tl.load(w_ptr + w_rows[:, None] * (I // 2) + offs_kb[None, :],
                         mask=row_ok[:, None] & (offs_kb[None, :] < I // 2), other=0).to(tl.int32)
            w = tl.reshape(tl.join(e2m1_decode(wq), e2m1_decode(wq >> 4)), [BLOCK_N, BLOCK_K])
            offs_kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            w_e = tl.load(w_scale_ptr + w_rows[:, None] * (I // 32) + offs_kg[None, :],
                          mask=row_ok[:, None] & (offs_kg[None, :] < I // 32), other=127).to(tl.int32) - 127
            w = tl.reshape(tl.reshape(w, [BLOCK_N, BLOCK_K // 32, 32]) * _pow2(tl.maximum(w_e, -126))[:, :, None],
                           [BLOCK_N, BLOCK_K])
            acc += tl.sum(w * h[None, :], axis=1)
        acc += tl.load(bias_ptr + expert * H + rows, mask=row_ok, other=0.0).to(tl.float32)
        out += tl.load(topk_w_ptr + pair).to(tl.float32) * acc
    tl.store(out_ptr + token * H + rows, to_bf16_rne(out), mask=row_ok)
