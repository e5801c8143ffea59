"""Triton code for the decode-time MoE FC1 (launcher and reference: ``kernels/moe.py``).

A bandwidth-bound grouped GEMV: program (slot, row tile, token block) streams 2 * BLOCK_N
rows of one routed expert's packed e2m1 weights (+ e8m0 scales) once, for every token of the
block routed to that expert (``routed_tokens``: duplicate experts exit at once). Tokens are the
MMA's N dimension (padded to BLOCK_M = 16), weights its M, so ``tl.dot_scaled`` runs on the
MXFP4 bytes as stored; the epilogue adds the bias, applies SwiGLU and writes MXFP8 for FC2.
"""

import triton
import triton.language as tl

from ._mx import mx_dot_wa, mxfp8_quantize_rows_fast, routed_tokens


@triton.jit
def _moe_fc1_swiglu_kernel(
    a_ptr,  # [M, K] uint8 e4m3: MXFP8 activations (fused norm, or ``moe_route``'s quantization)
    a_scale_ptr,  # [M, K / 32] uint8 e8m0
    w_ptr,  # [E, 2I, K / 2] uint8: e2m1 pairs, low nibble = even k (gpt-oss checkpoint layout)
    w_scale_ptr,  # [E, 2I, K / 32] uint8 e8m0
    bias_ptr,  # [E, 2I] bf16
    topk_ids_ptr,  # [M, TOPK] int32
    out_ptr,  # [M * TOPK, I] uint8 e4m3: SwiGLU output, MXFP8 for FC2
    out_scale_ptr,  # [M * TOPK, I / 32] uint8 e8m0
    M,  # number of tokens
    E: tl.constexpr,
    K: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,  # power of two >= TOPK
    BLOCK_M: tl.constexpr,  # tokens per program (the MMA's N; 16)
    BLOCK_N: tl.constexpr,  # SwiGLU outputs per program (32, dividing I): 2 * BLOCK_N weight rows
    BLOCK_K: tl.constexpr,  # power of two >= 64
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    DOT_SCALED: tl.constexpr,  # GPU: tl.dot_scaled; interpreter: fp32 dequantize + tl.dot
    HW_FP8: tl.constexpr,  # GPU: hardware fp32 -> e4m3 rounding; interpreter: software
):
    t0 = tl.program_id(2) * BLOCK_M
    p = t0 * TOPK + tl.program_id(0)  # routed slot (token * TOPK + j)
    if p >= M * TOPK:
        return
    expert, first, uses, slot, _hit = routed_tokens(topk_ids_ptr, p, t0, M, E, TOPK, TOPK_PAD, BLOCK_M)
    if not first:
        return
    nb = tl.program_id(1)
    tok = (t0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    rows = nb * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # interleaved: 2i gate, 2i+1 up
    w_rows = expert * (2 * I) + rows
    w_base = w_ptr + w_rows[:, None] * (K // 2)
    ws_base = w_scale_ptr + w_rows[:, None] * (K // 32)
    acc = tl.zeros([2 * BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        offs_kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        wq = tl.load(w_base + offs_kb[None, :], mask=offs_kb[None, :] < K // 2, other=0)
        ws = tl.load(ws_base + offs_kg[None, :], mask=offs_kg[None, :] < K // 32, other=0)
        aq = tl.load(a_ptr + tok[None, :] * K + offs_k[:, None], mask=uses[None, :] & (offs_k[:, None] < K), other=0)
        a_s = tl.load(a_scale_ptr + tok[:, None] * (K // 32) + offs_kg[None, :],
                      mask=uses[:, None] & (offs_kg[None, :] < K // 32), other=0)
        acc = mx_dot_wa(wq, ws, aq, a_s, acc, 2 * BLOCK_N, BLOCK_K, BLOCK_M, DOT_SCALED)
    acc += tl.load(bias_ptr + w_rows).to(tl.float32)[:, None]
    gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_N, 2, BLOCK_M]), [0, 2, 1]))  # [BLOCK_N, BLOCK_M]
    gate = tl.minimum(gate, LIMIT)
    up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    y = tl.trans((up + 1.0) * gate * tl.sigmoid(ALPHA * gate))  # [BLOCK_M, BLOCK_N]
    codes, scales = mxfp8_quantize_rows_fast(y, BLOCK_M, BLOCK_N // 32, HW_FP8)
    out_row = tok * TOPK + slot  # each token's (first) slot routed to this expert
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + out_row[:, None] * I + offs_n[None, :], codes, mask=uses[:, None])
    offs_s = nb * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
    tl.store(out_scale_ptr + out_row[:, None] * (I // 32) + offs_s[None, :], scales, mask=uses[:, None])
