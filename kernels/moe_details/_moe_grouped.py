"""Triton code for the MoE prefill path: grouped GEMMs over expert-sorted (token, slot) pairs
(launchers and references: ``kernels/moe.py``).

Both kernels take the tile map that ``moe_align`` builds on the device (static shapes, no host
sync): tile ``t`` covers sorted pairs ``tile_start[t] .. tile_end[t]`` (at most BLOCK_M, all of
one expert ``tile_expert[t]``; empty tiles exit at once). MXFP4 weights are decoded to fp32 in
registers and fed to ``tl.dot`` as bf16 (exact: e2m1 x 2**e and e4m3 x 2**e fit bf16), with fp32
accumulation; the interpreter cannot run bf16 dots, hence DOT_FP32.
"""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import mxfp8_quantize_rows
from ._mx import load_act_tile, load_mxfp4_tile


@triton.jit
def _moe_fc1_grouped_kernel(
    a_ptr,  # [M, K] activations: bf16, or uint8 e4m3 when A_MXFP8
    a_scale_ptr,  # [M, K / 32] uint8 e8m0 (A_MXFP8 only)
    w_ptr,  # [E, 2I, K / 2] uint8 e2m1 pairs, low nibble first (gpt-oss checkpoint layout)
    w_scale_ptr,  # [E, 2I, K / 32] uint8 e8m0
    bias_ptr,  # [E, 2I] bf16
    sorted_pair_ptr,  # [M * TOPK] int32: pair ids (token * TOPK + slot) sorted by expert
    tile_expert_ptr,  # [NUM_TILES] int32
    tile_start_ptr,  # [NUM_TILES] int32: first sorted pair of the tile
    tile_end_ptr,  # [NUM_TILES] int32: one past its last (== start: empty tile)
    out_ptr,  # [M * TOPK, I] uint8 e4m3: SwiGLU output (MXFP8), row = pair id
    out_scale_ptr,  # [M * TOPK, I / 32] uint8 e8m0
    K: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # SwiGLU outputs per program (multiple of 32): 2 * BLOCK_N weight rows
    BLOCK_K: tl.constexpr,  # multiple of 32
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    A_MXFP8: tl.constexpr,
    DOT_FP32: tl.constexpr,  # Triton's CPU interpreter mis-computes bf16 tl.dot: upcast there
):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    start = tl.load(tile_start_ptr + t)
    end = tl.load(tile_end_ptr + t)
    if start >= end:
        return
    expert = tl.load(tile_expert_ptr + t).to(tl.int64)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    pair = tl.load(sorted_pair_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    token = pair // TOPK
    rows = nb * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # interleaved: 2i gate, 2i+1 up
    row_ok = rows < 2 * I
    w_rows = expert * (2 * I) + rows
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = load_act_tile(a_ptr, a_scale_ptr, token, m_ok, k0, K, BLOCK_M, BLOCK_K, A_MXFP8)
        w = load_mxfp4_tile(w_ptr, w_scale_ptr, w_rows, row_ok, k0, K, 2 * BLOCK_N, BLOCK_K)
        if DOT_FP32:
            acc = tl.dot(a, tl.trans(w), acc)
        else:
            acc = tl.dot(a.to(tl.bfloat16), tl.trans(w).to(tl.bfloat16), acc)
    acc += tl.load(bias_ptr + expert * (2 * I) + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    gate = tl.minimum(gate, LIMIT)
    up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    y = (up + 1.0) * gate * tl.sigmoid(ALPHA * gate)
    codes, scales = mxfp8_quantize_rows(y, BLOCK_M, BLOCK_N // 32)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + pair[:, None] * I + offs_n[None, :], codes, mask=m_ok[:, None] & (offs_n[None, :] < I))
    offs_s = nb * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
    tl.store(out_scale_ptr + pair[:, None] * (I // 32) + offs_s[None, :], scales,
             mask=m_ok[:, None] & (offs_s[None, :] < I // 32))


@triton.jit
def _moe_fc2_grouped_kernel(
    h_ptr,  # [M * TOPK, I] uint8 e4m3: FC1 output (MXFP8), row = pair id
    h_scale_ptr,  # [M * TOPK, I / 32] uint8 e8m0
    w_ptr,  # [E, H, I / 2] uint8 e2m1 pairs, low nibble first
    w_scale_ptr,  # [E, H, I / 32] uint8 e8m0
    bias_ptr,  # [E, H] bf16
    topk_w_ptr,  # [M * TOPK] fp32 routing weights, by pair id
    sorted_pair_ptr,  # [M * TOPK] int32
    tile_expert_ptr,  # [NUM_TILES] int32
    tile_start_ptr,  # [NUM_TILES] int32
    tile_end_ptr,  # [NUM_TILES] int32
    out_ptr,  # [M * TOPK, H] fp32: w_j * (h_j @ W2[e_j]^T + b2[e_j]), summed over slots by the launcher
    H: tl.constexpr,
    I: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # multiple of 32
    DOT_FP32: tl.constexpr,
):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    start = tl.load(tile_start_ptr + t)
    end = tl.load(tile_end_ptr + t)
    if start >= end:
        return
    expert = tl.load(tile_expert_ptr + t).to(tl.int64)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    pair = tl.load(sorted_pair_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    w_rows = expert * H + rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a = load_act_tile(h_ptr, h_scale_ptr, pair, m_ok, k0, I, BLOCK_M, BLOCK_K, True)
        w = load_mxfp4_tile(w_ptr, w_scale_ptr, w_rows, row_ok, k0, I, BLOCK_N, BLOCK_K)
        if DOT_FP32:
            acc = tl.dot(a, tl.trans(w), acc)
        else:
            acc = tl.dot(a.to(tl.bfloat16), tl.trans(w).to(tl.bfloat16), acc)
    acc += tl.load(bias_ptr + expert * H + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(topk_w_ptr + pair, mask=m_ok, other=0.0)[:, None]
    tl.store(out_ptr + pair[:, None] * H + rows[None, :], acc, mask=m_ok[:, None] & row_ok[None, :])
