"""Triton code for the decode-time MoE FC2 + combine (launcher and reference: ``kernels/moe.py``).

``_moe_fc2_kernel``: the FC1 scheme (program = routed expert x BLOCK_N rows of H x token block,
weights streamed once for every token routed there, ``tl.dot_scaled`` with tokens as N); each
program writes its tokens' w_j * (h_j W2[e]^T + b2[e]) as fp32 partials [M * TOPK, H] (row =
token * TOPK + slot; a slot repeated in one token gets zeros, its weight is summed into the
first). ``_moe_combine_kernel`` sums each token's TOPK partials (fixed order: deterministic, no
atomics, no zero fill) and rounds once to bf16 (or stores the fp32 sum for an fp32 ``out``: a
rank's share under TP / EP, rounded after the all-reduce).
"""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import store_rounded, to_bf16_rne
from ..norm_mxfp8_details._next_norm import next_norm_inputs, next_norm_store
from ._mx import mx_dot_wa, pdl_wait_then_release, routed_tokens


@triton.jit
def _moe_fc2_kernel(
    h_ptr,  # [M * TOPK, I] uint8 e4m3: FC1 output (MXFP8), row = token * TOPK + slot
    h_scale_ptr,  # [M * TOPK, I / 32] uint8 e8m0
    w_ptr,  # [E, H, I / 2] uint8 e2m1 pairs, low nibble first
    w_scale_ptr,  # [E, H, I / 32] uint8 e8m0
    bias_ptr,  # [E, H] bf16
    topk_ids_ptr,  # [M, TOPK] int32
    topk_w_ptr,  # [M, TOPK] fp32 routing weights
    part_ptr,  # [M * TOPK, H] fp32: w_j * (h_j @ W2[e_j]^T + b2[e_j])
    M,
    E: tl.constexpr,
    H: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # tokens per program (16)
    BLOCK_N: tl.constexpr,  # rows of H per program
    BLOCK_K: tl.constexpr,  # power of two >= 64
    DOT_SCALED: tl.constexpr,
):
    t0 = tl.program_id(2) * BLOCK_M
    p = t0 * TOPK + tl.program_id(0)
    if p >= M * TOPK:
        return
    expert, first, uses, slot, hit = routed_tokens(topk_ids_ptr, p, t0, M, E, TOPK, TOPK_PAD, BLOCK_M)
    if not first:
        return
    tok = (t0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair = tok * TOPK + slot
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    w_rows = expert * H + tl.minimum(rows, H - 1)  # rows past H: read row H-1, never stored
    w_base = w_ptr + w_rows[:, None] * (I // 2)
    ws_base = w_scale_ptr + w_rows[:, None] * (I // 32)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        offs_kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        wq = tl.load(w_base + offs_kb[None, :], mask=offs_kb[None, :] < I // 2, other=0)
        ws = tl.load(ws_base + offs_kg[None, :], mask=offs_kg[None, :] < I // 32, other=0)
        aq = tl.load(h_ptr + pair[None, :] * I + offs_k[:, None], mask=uses[None, :] & (offs_k[:, None] < I), other=0)
        a_s = tl.load(h_scale_ptr + pair[:, None] * (I // 32) + offs_kg[None, :],
                      mask=uses[:, None] & (offs_kg[None, :] < I // 32), other=0)
        acc = mx_dot_wa(wq, ws, aq, a_s, acc, BLOCK_N, BLOCK_K, BLOCK_M, DOT_SCALED)
    acc += tl.load(bias_ptr + w_rows).to(tl.float32)[:, None]
    offs_j = tl.arange(0, TOPK_PAD)
    rw = tl.load(topk_w_ptr + tok[:, None] * TOPK + offs_j[None, :], mask=hit, other=0.0)
    val = tl.trans(acc) * tl.sum(rw, axis=1)[:, None]  # [BLOCK_M, BLOCK_N]
    for j in tl.static_range(TOPK):
        hit_j = tl.sum(tl.where(offs_j[None, :] == j, hit.to(tl.int32), 0), axis=1) > 0
        v = tl.where((slot == j)[:, None], val, 0.0)
        tl.store(part_ptr + (tok * TOPK + j)[:, None] * H + rows[None, :], v, mask=hit_j[:, None] & row_ok[None, :])


@triton.jit
def _moe_combine_kernel(
    part_ptr,  # [M * TOPK, H] fp32
    out_ptr,  # [M, H] bf16 (or fp32, unrounded: a rank's share under TP / EP): sum over the TOPK partials
    H: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # a programmatic dependent of the FC2 launch (the FMA path, opt-in)
    # NEXT_NORM: the next layer's input norm carried into its qkv GEMV (kernels/next_norm.py), as in
    # _moe_fma._combine_when_last
    nn_res_ptr=None,
    nn_stride=0,
    nn_w_ptr=None,
    nn_s_ptr=None,
    nn_u_ptr=None,
    nn_ps_ptr=None,
    NEXT_NORM: tl.constexpr = False,
):
    if PDL:
        pdl_wait_then_release()
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    if NEXT_NORM:  # (loaded with the partials: the same memory round trip)
        nn_r, nn_w = next_norm_inputs(nn_res_ptr + token * nn_stride, nn_stride, nn_w_ptr, tl.program_id(1) * BLOCK, 1,
                                      H, 1, BLOCK)
    out = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        out += tl.load(part_ptr + (token * TOPK + j) * H + offs, mask=ok, other=0.0)
    store_rounded(out_ptr + token * H + offs, out, ok)  # (bf16, or an fp32 out under TP)
    if NEXT_NORM:
        o = to_bf16_rne(out)
        next_norm_store(o.to(tl.float32), tl.reshape(nn_r, [BLOCK]), nn_w, token, True, tl.program_id(1) * BLOCK,
                        nn_s_ptr, nn_u_ptr, nn_ps_ptr, H, BLOCK)
