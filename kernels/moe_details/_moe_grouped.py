"""Triton code for the MoE prefill path: grouped GEMMs over expert-sorted (token, slot) pairs
(launchers, tile table and references: ``kernels/moe.py``).

Tile map: ``moe_align`` builds it on the device (static shapes, no host sync): tile ``t`` covers
sorted pairs ``tile_start[t] .. tile_end[t]`` (at most BLOCK_M, all of one expert
``tile_expert[t]``; empty tiles exit at once). Grid (tile, weight-row block).

Swap-AB: the expert's weight rows are the MMA's M (2 * BLOCK_N rows for FC1, BLOCK_N for FC2)
and the tile's tokens its N (BLOCK_M = 16 .. 128, from the average pairs per expert):
``acc[rows, BLOCK_M] += w[rows, BLOCK_K] @ act^T[BLOCK_K, BLOCK_M]``, fp32 accumulation. Why: a
prefill of M = 512 tokens gives ~16 pairs per expert (gpt-oss-120b, top-4 of 128), so the
previous 64-token M tiles were 75% padding, and its decoded weight tile, the B operand, went
through shared memory. Now the padding is in the cheap dimension (16-token N tiles) and the
weight tile is decoded in the registers it is consumed from: the A operand of wgmma on sm_90a,
of mma.sync m16n8k16 on sm_12x (no wgmma there; the PTX is checked by tests/test_aot_compile.py).

Operands are exact bf16 (``_mx.py``): the MXFP4 weights decoded with integer ops straight into
bf16 pairs (``mxfp4_tile_bf16``: 4 integer ops per byte, then two power-of-two multiplies per
pair in ``mul.rn.bf16x2``; one with W_F2 off, the launchers' ``w_f2=False``, for weight scale
bytes that are all <= 128), the MXFP8 activations likewise (``mxfp8_tile_bf16``: ``prmt`` +
shift + mask per pair, two multiplies). No fp32 detour, no conversion instruction. They are the
values the previous fp32 decode fed ``tl.dot`` (activations below 2**-133 round to bf16 the same
way), so results match it up to the fp32 summation order. The e8m0 scales of the next K step
are loaded during this one (the software pipeline stages the weight and activation tiles only).
Cost (sm_90a SASS of FC1's K loop, per thread and step of 128 weight values): 735 instructions
at BLOCK_M 16 (weights: 64 ``LDS.U8``, 128 IMAD + 128 LOP3, 128 ``HMUL2``; the rest activations,
scales, addressing, 16 ``HGMMA.64x16x16``), 799 at 32; the previous kernel took 1484 per 64
weight values (fp32 decode, ``FMUL``/``FFMA``/``I2FP``/``F2FP`` per value): 5.7 instead of 23
per weight value. With the table's 64-wide K steps (4 warps, 64 weight values per thread and
step; ``python -m kernels.aot --sass-loop grouped --arch 90``): 401 instructions at BLOCK_M 16,
415 / 421 (FC1 / FC2) at 32; without the weights' F2 multiply (W_F2 False, stop 38) 358 and 375 /
377, about a tenth fewer. Since stop 42 that is how ``moe_block`` runs weights whose scales the MoE
method registered at load (``kernels.moe.register_weight_scales``; halves decoder, 128-value steps,
16,128,64,4,4: FC1 605 -> 526, FC2 616 -> 545 with the guard below). Guard: W_F2 off, each program
keeps the largest weight scale byte it decoded; above 128 (a byte the decoder misreads without F2,
e.g. weights reloaded in place after registration) FC2 writes NaN and FC1 writes e8m0 NaN (255) as its
output scales, which FC2 under NAN_SCALES turns into NaN: never a wrong finite value.

FC1 with bf16 input (A_MXFP8 off) quantizes the activations to MXFP8 and back in registers
(``mxfp8_roundtrip``) in every program; ``moe_block`` quantizes once, in the routing launch,
instead (the same numbers). FC1's epilogue adds the bias, applies SwiGLU to the interleaved
gate/up rows (acc rows 2i gate, 2i + 1 up), transposes to [tokens, outputs] and writes MXFP8 per
token (32-output blocks, hardware e4m3 rounding when HW_FP8) to row ``pair``. FC2's adds the
bias, scales by the pair's routing weight and writes fp32 partials [M * TOPK, H], summed over
the slots by the launcher.

The interpreter stores bf16 as raw integers (its bf16 arithmetic and dots are wrong) and runs
no inline PTX, so DOT_FP32 (CPU) builds the same bits and factors in fp32 and uses an fp32
``tl.dot``.
"""

import triton
import triton.language as tl

from ._mx import _bf16_bits, act_halves, mxfp4_halves_bf16, mxfp4_tile_bf16, mxfp8_quantize_rows_fast, mxfp8_roundtrip, mxfp8_tile_bf16


@triton.jit
def _tile_pairs(sorted_pair_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, t, BLOCK_M: tl.constexpr):
    """Tile t of the map: (non-empty, expert int64, pair ids [BLOCK_M] int64, valid [BLOCK_M])."""
    start = tl.load(tile_start_ptr + t)
    end = tl.load(tile_end_ptr + t)
    expert = tl.load(tile_expert_ptr + t).to(tl.int64)
    offs = start + tl.arange(0, BLOCK_M)
    ok = offs < end
    pair = tl.load(sorted_pair_ptr + offs, mask=ok, other=0).to(tl.int64)
    return start < end, expert, pair, ok


@triton.jit
def _scales(s_ptr, rows, row_ok, g0, K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_FIRST: tl.constexpr):
    """e8m0 bytes of rows ``rows`` ([*, K/32] row-major), groups g0 .. g0 + BLOCK_K/32: [rows, groups]
    (ROWS_FIRST) or [groups, rows]; 127 past K or a masked row."""
    offs_g = g0 + tl.arange(0, BLOCK_K // 32)
    if ROWS_FIRST:
        return tl.load(s_ptr + rows[:, None] * (K // 32) + offs_g[None, :],
                       mask=row_ok[:, None] & (offs_g[None, :] < K // 32), other=127)
    else:
        return tl.load(s_ptr + rows[None, :] * (K // 32) + offs_g[:, None],
                       mask=row_ok[None, :] & (offs_g[:, None] < K // 32), other=127)


@triton.jit
def _weight_bytes(w_ptr, w_rows, row_ok, kb, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``w_rows`` of an MXFP4 matrix ([*, K/2] e2m1 pairs), bytes kb .. kb + BLOCK_K/2 (k from
    2 * kb): uint8 [ROWS, BLOCK_K/2], zeros past K."""
    offs_kb = kb + tl.arange(0, BLOCK_K // 2)
    return tl.load(w_ptr + w_rows[:, None] * (K // 2) + offs_kb[None, :],
                   mask=row_ok[:, None] & (offs_kb[None, :] < K // 2), other=0)


@triton.jit
def _act_tile_t(a_ptr, a_s, rows, row_ok, k0, K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_K: tl.constexpr, A_MXFP8: tl.constexpr, DOT_FP32: tl.constexpr):
    """Rows ``rows`` [BLOCK_M] of activations [*, K], columns k0 .. k0+BLOCK_K, transposed: the
    MMA's B operand [BLOCK_K, BLOCK_M], exact MXFP8 values in bf16 (fp32 when DOT_FP32).

    A_MXFP8: e4m3 bytes with their e8m0 scales a_s [BLOCK_K/32, BLOCK_M]. Else bf16, quantized to
    MXFP8 and back in registers (a_s unused)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if A_MXFP8:
        aq = tl.load(a_ptr + rows[None, :] * K + offs_k[:, None], mask=row_ok[None, :] & (offs_k[:, None] < K),
                     other=0)
        return mxfp8_tile_bf16(aq, a_s, BLOCK_K, BLOCK_M, DOT_FP32)
    else:
        a = tl.load(a_ptr + rows[:, None] * K + offs_k[None, :], mask=row_ok[:, None] & (offs_k[None, :] < K),
                    other=0.0).to(tl.float32)
        a = tl.trans(mxfp8_roundtrip(a, BLOCK_M, BLOCK_K))  # MXFP8 values: exact in bf16
        if DOT_FP32:
            return a
        else:
            return a.to(tl.bfloat16)


@triton.jit
def _act_halves_bf16(a_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_M: tl.constexpr, DOT_FP32: tl.constexpr):
    """A_HALVES: rows ``rows`` of bf16 activations stored per 128-value block in the halves order
    (``kernels.moe.act_halves_bf16_torch``: the block's even values in ``act_halves``'s order, then its
    odd ones; rows of ceil(K / 128) whole blocks, zero-padded), step k0: (even, odd) [64, BLOCK_M], the
    MMA's B operands as loaded (no decode, no permutation). DOT_FP32 (interpreter, which mis-handles
    bf16): the same values from their bits."""
    KP: tl.constexpr = (K + 127) // 128 * 128  # rows padded to whole 128-value blocks (zeros)
    offs = tl.arange(0, 64)
    ok = row_ok[None, :] & (offs[:, None] < 64)
    if DOT_FP32:
        p = a_ptr.to(tl.pointer_type(tl.int16))
        ev = tl.load(p + rows[None, :] * KP + k0 + offs[:, None], mask=ok, other=0)
        od = tl.load(p + rows[None, :] * KP + k0 + 64 + offs[:, None], mask=ok, other=0)
        return _bf16_bits(ev.to(tl.int32) & 0xFFFF, True), _bf16_bits(od.to(tl.int32) & 0xFFFF, True)
    ev = tl.load(a_ptr + rows[None, :] * KP + k0 + offs[:, None], mask=ok, other=0.0)
    od = tl.load(a_ptr + rows[None, :] * KP + k0 + 64 + offs[:, None], mask=ok, other=0.0)
    return ev, od


@triton.jit
def _k_step(acc, w_ptr, ws, w_rows, row_ok, a_ptr, a_s, a_rows, a_ok, kb, K: tl.constexpr, ROWS: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, A_MXFP8: tl.constexpr, DOT_FP32: tl.constexpr,
            W_F2: tl.constexpr, HALVES: tl.constexpr, A_HALVES: tl.constexpr = False):
    """acc [ROWS, BLOCK_M] += the weight rows' K step at byte kb times the activation rows'
    (transposed). HALVES (BLOCK_K = 128): two K = 64 dots over the even and the odd values
    (``_mx.py``, the halves decoder); else one dot in checkpoint order. A_HALVES (with HALVES): the
    activations are bf16 already in the halves order (``_act_halves_bf16``)."""
    if HALVES:
        tl.static_assert(BLOCK_K == 128, "the halves decoder takes 128-value K steps (BLOCK_K = 128)")
        wq = _weight_bytes(w_ptr, w_rows, row_ok, kb, K, BLOCK_K)
        w_even, w_odd = mxfp4_halves_bf16(wq, ws, ROWS, BLOCK_K // 2, DOT_FP32, W_F2)
        if A_HALVES:
            a_even, a_odd = _act_halves_bf16(a_ptr, a_rows, a_ok, 2 * kb, K, BLOCK_M, DOT_FP32)
        else:
            a_even, a_odd = act_halves(_act_tile_t(a_ptr, a_s, a_rows, a_ok, 2 * kb, K, BLOCK_M, BLOCK_K, A_MXFP8,
                                                   DOT_FP32), BLOCK_M)
        acc = tl.dot(w_even, a_even, acc)
        return tl.dot(w_odd, a_odd, acc)
    else:
        w = mxfp4_tile_bf16(_weight_bytes(w_ptr, w_rows, row_ok, kb, K, BLOCK_K), ws, ROWS, BLOCK_K, DOT_FP32, W_F2)
        a = _act_tile_t(a_ptr, a_s, a_rows, a_ok, 2 * kb, K, BLOCK_M, BLOCK_K, A_MXFP8, DOT_FP32)
        return tl.dot(w, a, acc)


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
    K: tl.constexpr,  # multiple of 64
    I: tl.constexpr,  # multiple of 32
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,  # pairs (tokens) per tile: the MMA's N, 16 .. 128
    BLOCK_N: tl.constexpr,  # SwiGLU outputs per program (multiple of 32): 2 * BLOCK_N weight rows (the MMA's M)
    BLOCK_K: tl.constexpr,  # power of two >= 32 (HALVES: 128)
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    A_MXFP8: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter: fp32 operands (it mis-computes bf16)
    HW_FP8: tl.constexpr,  # GPU: hardware fp32 -> e4m3 rounding of the output; interpreter: software
    W_F2: tl.constexpr = True,  # False: every weight scale byte should be <= 128 (one multiply per pair fewer; guarded)
    HALVES: tl.constexpr = False,  # the halves decoder (BLOCK_K 128; _mx.py, stop 41)
    A_HALVES: tl.constexpr = False,  # HALVES, A_MXFP8 off: a_ptr holds bf16 MXFP8 values in the halves order
):
    tl.static_assert(not A_HALVES or (HALVES and not A_MXFP8), "A_HALVES takes bf16 activations and HALVES")
    live, expert, pair, m_ok = _tile_pairs(sorted_pair_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                                           tl.program_id(0), BLOCK_M)
    if not live:
        return
    wmax = tl.zeros([2 * BLOCK_N, BLOCK_K // 32], dtype=tl.int32)  # (W_F2 off: the largest scale byte seen)
    nb = tl.program_id(1)
    token = pair // TOPK
    rows = nb * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # interleaved: 2i gate, 2i+1 up
    row_ok = rows < 2 * I
    w_rows = expert * (2 * I) + rows
    acc = tl.zeros([2 * BLOCK_N, BLOCK_M], dtype=tl.float32)
    # The scales of step kb + 1 are loaded during step kb (the pipeliner only stages the tiles).
    ws_nxt = _scales(w_scale_ptr, w_rows, row_ok, 0, K, BLOCK_K, True)
    as_nxt = _scales(a_scale_ptr, token, m_ok & A_MXFP8, 0, K, BLOCK_K, False)
    for kb in range(0, K // 2, BLOCK_K // 2):  # kb: byte offset in a weight row (k = 2 * kb)
        ws = ws_nxt
        a_s = as_nxt
        ws_nxt = _scales(w_scale_ptr, w_rows, row_ok, kb // 16 + BLOCK_K // 32, K, BLOCK_K, True)
        as_nxt = _scales(a_scale_ptr, token, m_ok & A_MXFP8, kb // 16 + BLOCK_K // 32, K, BLOCK_K, False)
        if not W_F2:
            wmax = tl.maximum(wmax, ws.to(tl.int32))
        acc = _k_step(acc, w_ptr, ws, w_rows, row_ok, a_ptr, a_s, token, m_ok, kb, K, 2 * BLOCK_N, BLOCK_M, BLOCK_K,
                      A_MXFP8, DOT_FP32, W_F2, HALVES, A_HALVES)
    acc += tl.load(bias_ptr + w_rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_N, 2, BLOCK_M]), [0, 2, 1]))  # [BLOCK_N, BLOCK_M]
    gate = tl.minimum(gate, LIMIT)
    up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    y = tl.trans((up + 1.0) * gate * tl.sigmoid(ALPHA * gate))  # [BLOCK_M, BLOCK_N]: MXFP8 blocks along I
    codes, scales = mxfp8_quantize_rows_fast(y, BLOCK_M, BLOCK_N // 32, HW_FP8)
    if not W_F2:  # a scale byte the decoder without F2 misreads: e8m0 NaN (255) scales, which FC2 turns into NaN
        scales = tl.where(tl.max(tl.max(wmax, axis=1), axis=0) > 128, 255, scales.to(tl.int32)).to(tl.uint8)
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
    I: tl.constexpr,  # multiple of 64
    BLOCK_M: tl.constexpr,  # pairs per tile: the MMA's N
    BLOCK_N: tl.constexpr,  # rows of H per program: the MMA's M
    BLOCK_K: tl.constexpr,  # power of two >= 32 (HALVES: 128)
    DOT_FP32: tl.constexpr,
    W_F2: tl.constexpr = True,  # as FC1's
    HALVES: tl.constexpr = False,  # as FC1's
    NAN_SCALES: tl.constexpr = True,  # h's e8m0 byte 255 (FC1's guard without F2) makes the pair's output NaN
    A_HALVES: tl.constexpr = False,  # HALVES: h_ptr holds h's values in bf16 [M * TOPK, ceil(I / 128) * 128],
    # halves order (kernels.moe.act_halves_bf16_torch of h; h_scale_ptr still h's scales, for NAN_SCALES)
):
    tl.static_assert(not A_HALVES or HALVES, "A_HALVES goes with the halves decoder")
    live, expert, pair, m_ok = _tile_pairs(sorted_pair_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                                           tl.program_id(0), BLOCK_M)
    if not live:
        return
    wmax = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.int32)  # (W_F2 off: the largest weight scale byte seen)
    amax = tl.zeros([BLOCK_K // 32, BLOCK_M], dtype=tl.int32)  # (NAN_SCALES: each pair's largest h scale byte)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    w_rows = expert * H + rows
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    ws_nxt = _scales(w_scale_ptr, w_rows, row_ok, 0, I, BLOCK_K, True)
    as_nxt = _scales(h_scale_ptr, pair, m_ok, 0, I, BLOCK_K, False)
    for kb in range(0, I // 2, BLOCK_K // 2):
        ws = ws_nxt
        a_s = as_nxt
        ws_nxt = _scales(w_scale_ptr, w_rows, row_ok, kb // 16 + BLOCK_K // 32, I, BLOCK_K, True)
        as_nxt = _scales(h_scale_ptr, pair, m_ok, kb // 16 + BLOCK_K // 32, I, BLOCK_K, False)
        if not W_F2:
            wmax = tl.maximum(wmax, ws.to(tl.int32))
        if NAN_SCALES:
            amax = tl.maximum(amax, a_s.to(tl.int32))
        acc = _k_step(acc, w_ptr, ws, w_rows, row_ok, h_ptr, a_s, pair, m_ok, kb, I, BLOCK_N, BLOCK_M, BLOCK_K,
                      not A_HALVES, DOT_FP32, W_F2, HALVES, A_HALVES)
    acc += tl.load(bias_ptr + w_rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tw = tl.load(topk_w_ptr + pair, mask=m_ok, other=0.0)
    acc *= tw[None, :]
    # Guards, for the pairs that count (weight 0: a slot routed to another EP rank borrows a local expert):
    # a weight scale byte the decoder without F2 misreads, or FC1's e8m0 NaN scales: NaN, never a wrong
    # finite value
    bad = tl.zeros([BLOCK_M], dtype=tl.int1)
    if not W_F2:
        bad = bad | (tl.max(tl.max(wmax, axis=1), axis=0) > 128)
    if NAN_SCALES:
        bad = bad | (tl.max(amax, axis=0) == 255)
    if NAN_SCALES or not W_F2:
        acc = tl.where((bad & (tw != 0.0))[None, :], float("nan"), acc)
    tl.store(out_ptr + pair[None, :] * H + rows[:, None], acc, mask=m_ok[None, :] & row_ok[:, None])
