"""Triton code for the decode-time MoE FC1 (launcher and reference: ``kernels/moe.py``)."""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import mx_row_dot, mxfp8_quantize_rows
from ._mx import bf16_row_dot


@triton.jit
def _moe_fc1_swiglu_kernel(
    a_ptr,  # [M, K] uint8 e4m3: MXFP8 activations (from the fused norm); bf16 if not A_MXFP8
    a_scale_ptr,  # [M, K / 32] uint8 e8m0 (A_MXFP8 only)
    w_ptr,  # [E, 2I, K / 2] uint8: e2m1 pairs, low nibble = even k (gpt-oss checkpoint layout)
    w_scale_ptr,  # [E, 2I, K / 32] uint8 e8m0
    bias_ptr,  # [E, 2I] bf16
    topk_ids_ptr,  # [M, TOPK] int32
    out_ptr,  # [M * TOPK, I] uint8 e4m3: SwiGLU output, MXFP8 for FC2
    out_scale_ptr,  # [M * TOPK, I / 32] uint8 e8m0
    K: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,  # SwiGLU outputs per program (multiple of 32): 2 * BLOCK_N weight rows
    BLOCK_K: tl.constexpr,  # multiple of 32
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    A_MXFP8: tl.constexpr,  # False: bf16 activations, quantized to MXFP8 in registers (no copy written)
):
    pair = tl.program_id(0).to(tl.int64)  # (token, slot)
    nb = tl.program_id(1)
    token = pair // TOPK
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    rows = nb * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # interleaved: 2i gate, 2i+1 up
    row_ok = rows < 2 * I
    w_rows = expert * (2 * I) + rows
    if A_MXFP8:
        acc = mx_row_dot(a_ptr + token * K, a_scale_ptr + token * (K // 32), w_ptr, w_scale_ptr, w_rows, row_ok,
                         K, 2 * BLOCK_N, BLOCK_K)
    else:
        acc = bf16_row_dot(a_ptr + token * K, w_ptr, w_scale_ptr, w_rows, row_ok, K, 2 * BLOCK_N, BLOCK_K)
    acc += tl.load(bias_ptr + expert * (2 * I) + rows, mask=row_ok, other=0.0).to(tl.float32)
    gate, up = tl.split(tl.reshape(acc, [BLOCK_N, 2]))
    gate = tl.minimum(gate, LIMIT)
    up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    y = (up + 1.0) * gate * tl.sigmoid(ALPHA * gate)
    codes, scales = mxfp8_quantize_rows(y[None, :], 1, BLOCK_N // 32)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + pair * I + offs_n[None, :], codes, mask=offs_n[None, :] < I)
    offs_s = nb * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
    tl.store(out_scale_ptr + pair * (I // 32) + offs_s[None, :], scales, mask=offs_s[None, :] < I // 32)
