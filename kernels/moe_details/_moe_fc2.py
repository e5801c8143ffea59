"""Triton code for the decode-time MoE FC2 (launcher and reference: ``kernels/moe.py``)."""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import mx_row_dot, to_bf16_rne


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
        acc = mx_row_dot(h_ptr + pair * I, h_scale_ptr + pair * (I // 32), w_ptr, w_scale_ptr, w_rows, row_ok,
                         I, BLOCK_N, BLOCK_K)
        acc += tl.load(bias_ptr + expert * H + rows, mask=row_ok, other=0.0).to(tl.float32)
        out += tl.load(topk_w_ptr + pair).to(tl.float32) * acc
    tl.store(out_ptr + token * H + rows, to_bf16_rne(out), mask=row_ok)
