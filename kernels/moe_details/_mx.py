"""MX tile loaders shared by the MoE kernels (launchers and references: ``kernels/moe.py``).

Every loader returns fp32 values exactly as the MX formats define them, so the CUDA-core
(decode) and ``tl.dot`` kernels see the same operands: an e4m3 or e2m1 code times a power of two
is exact in fp32 and in bf16. The grouped (prefill) GEMMs' decoders (``mxfp4_tile_bf16``,
``mxfp8_tile_bf16``) build those values straight in bf16 with integer ops. e8m0 byte 0 (2**-127)
is read as 2**-126 (only all-zero blocks use it).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..kv_cache_details._codecs import _pow2, e2m1_decode, e4m3_encode, mxfp8_block_scale, mxfp8_quantize_rows


@triton.jit
def load_mxfp4_tile(w_ptr, w_scale_ptr, w_rows, row_ok, k0, K: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """Rows ``w_rows`` [ROWS] of a row-major MXFP4 matrix ([*, K/2] e2m1 pairs, low nibble first,
    + [*, K/32] e8m0), columns k0 .. k0+BLOCK_K -> fp32 [ROWS, BLOCK_K]."""
    offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    wq = tl.load(w_ptr + w_rows[:, None] * (K // 2) + offs_kb[None, :],
                 mask=row_ok[:, None] & (offs_kb[None, :] < K // 2), other=0).to(tl.int32)
    w = tl.reshape(tl.join(e2m1_decode(wq), e2m1_decode(wq >> 4)), [ROWS, BLOCK_K // 32, 32])
    offs_kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    w_e = tl.load(w_scale_ptr + w_rows[:, None] * (K // 32) + offs_kg[None, :],
                  mask=row_ok[:, None] & (offs_kg[None, :] < K // 32), other=127).to(tl.int32) - 127
    return tl.reshape(w * _pow2(tl.maximum(w_e, -126))[:, :, None], [ROWS, BLOCK_K])


@triton.jit
def mxfp8_roundtrip(x, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [ROWS, BLOCK_K] -> the fp32 values its MXFP8 encoding (e4m3 + e8m0 per 32) decodes to.

    This is the FC1 prologue when the MoE is handed bf16 activations: the same numbers the fused
    norm's MXFP8 output would give, with no quantized copy written to memory.
    """
    codes, scales = mxfp8_quantize_rows(x, ROWS, BLOCK_K // 32)
    vals = tl.reshape(codes.to(tl.float8e4nv, bitcast=True).to(tl.float32), [ROWS, BLOCK_K // 32, 32])
    e = tl.maximum(scales.to(tl.int32) - 127, -126)
    return tl.reshape(vals * _pow2(e)[:, :, None], [ROWS, BLOCK_K])


@triton.jit
def _bf16_bits(bits, FP32: tl.constexpr):
    """int32 holding bf16 bits in its low 16 -> that bf16 value (FP32: as fp32, exact: the
    interpreter stores bf16 as raw uint16 and cannot multiply it)."""
    if FP32:
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def mxfp4_tile_bf16(wq, ws, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr, W_F2: tl.constexpr = True):
    """wq [ROWS, BLOCK_K/2] uint8 e2m1 pairs (low nibble = even k) + ws [ROWS, BLOCK_K/32] e8m0 ->
    [ROWS, BLOCK_K] bf16, exactly the values of the LUT reference ``dequant_mxfp4_torch`` (signed
    zeros included) and of ``load_mxfp4_tile``, for every code and scale byte.

    Decode: a nibble (s e1 e0 m) shifted into bf16 bits (sign -> 15, e1 e0 m -> 8..6) is
    e2m1 * 2**-126 exactly (code 1 = 0.5 lands on the bf16 denormal 2**-127). Both nibbles of a
    byte b at once, as the 32-bit word holding the bf16 pair (low half = even k: what the MMA
    operand register holds): ``(b * 0x40040 | (b & 0xF8) * 0x1001000) & 0x81C081C0``; the first
    product is b << 6 | b << 18 (magnitudes -> 8..6 and 24..22), the second puts the sign bits 3
    and 7 on 15 and 31 (& 0xF8 keeps bits 2..0 off 24..22); the shifted copies never overlap, so
    the products are ORs. 4 integer ops per byte (IMAD, LOP3, IMAD, LOP3 in the sm_90a SASS).
    Scale: times 2**(x - 1), x = max(e8m0, 1) (byte 0 read as 2**-126). That factor leaves
    bf16's range for x > 128, so it is split into F1 = 2**min(x - 1, 127) and F2 =
    2**max(x - 128, 0), bf16 bits ``(min(x, 128) + 126) << 7`` and ``(max(x, 128) - 1) << 7``:
    (v * F1) * F2. Both products are exact (a 2-bit significand times a power of two; the first is
    at most 6 * 2**-126 * 2**127 = 12), the second overflows to inf exactly where fp32 does
    (|value| >= 2**128); F2 is 1 at every realistic scale (x <= 128). On the GPU the multiplies
    are ``mul.rn.bf16x2`` (inline PTX, sm_90+ and sm_12x) on the pair word as built: per value 2
    integer ops + 1 multiply. (Per-element bf16 multiplies let ptxas re-pair the halves, with a
    ``prmt`` per register to swap them back.) FP32 (interpreter): the same bits and factors in fp32.
    W_F2 False: the caller knows every scale byte is <= 128 (F2 == 1; ``kernels.moe.weight_scales_need_f2``), and
    the second multiply is left out: the same values, one multiply per pair fewer (sm_90a SASS of
    the grouped K loop at 16,128,64,4,4: 401 -> 358 instructions). The grouped kernels guard it (NaN
    outputs where a larger byte shows up: ``_moe_grouped.py``)."""
    b = wq.to(tl.int32)
    p = ((b * 0x40040) | ((b & 0xF8) * 0x1001000)) & -2118090304  # 0x81C081C0
    lo = p.to(tl.int16)
    hi = (p >> 16).to(tl.int16)
    v = _bf16_bits(tl.reshape(tl.join(lo, hi), [ROWS, BLOCK_K // 32, 32]), FP32)
    x = tl.maximum(ws.to(tl.int32), 1)
    f1 = _bf16_bits((tl.minimum(x, 128) + 126) << 7, FP32)[:, :, None]
    f2 = _bf16_bits((tl.maximum(x, 128) - 1) << 7, FP32)[:, :, None]
    if FP32:
        v = v * f1 * f2 if W_F2 else v * f1
    elif W_F2:
        v = tl.inline_asm_elementwise(
            asm="mul.rn.bf16x2 $0, $1, $2; mul.rn.bf16x2 $0, $0, $3;", constraints="=r,r,r,r",
            args=[v, f1, f2], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        v = tl.inline_asm_elementwise(asm="mul.rn.bf16x2 $0, $1, $2;", constraints="=r,r,r", args=[v, f1],
                                      dtype=tl.bfloat16, is_pure=True, pack=2)
    return tl.reshape(v, [ROWS, BLOCK_K])


# ---- the grouped GEMMs' halves decoder (HALVES, stop 41) -------------------------------------------
#
# A dot product does not care which K index sits in which operand slot, as long as the weights and
# the activations use the same order. The halves decoder picks the order that makes the weight side
# cheap; the activation side (BLOCK_N / BLOCK_M times fewer values per program) follows it:
# * Halves: a 128-value step (64 bytes of a row, byte j holding checkpoint values 2j (low nibble) and
#   2j + 1) is two K = 64 dots, one over the even values, one over the odd. A bf16 operand register
#   then holds the low (or high) nibbles of bytes j and j + 1: one ``prmt`` spreads two bytes 16 bits
#   apart, and one mask, one multiply (two shifted copies) and one mask build the pair, with no
#   repacking of int16 halves (``mxfp4_tile_bf16`` interleaves the nibbles of one byte instead).
#   Each output element depends on its own input byte and scale only, so the inline PTX is correct
#   however Triton packs the elements.
# * Lanes (``lane_order``): the MMA's A fragment gives lane t of a quad the K slots {2t, 2t+1,
#   2t+8, 2t+9} of every 16. Relabelling slot j -> logical k so that lane t owns slots 16t .. 16t+15
#   turns the 32 ``LDS.U8`` per 64 weight values of the byte-order kernel into ``LDS.128``
#   (sm_90a SASS). Which lane owns which slots follows the operand layout (sm_90a wgmma, sm_12x
#   mma.sync); the result does not, only the load width.
# * Activations: decoded in checkpoint order as before, then permuted in registers to the same
#   order (``act_halves``).
# sm_90a SASS of the grouped FC2 K loop (16,128,128,4,3), per 64 weight values per thread: 266
# instructions vs 358 (byte order, no F2) / 401 (F2) at 16,128,64,4,4 (``python -m
# vllm_sm121.kernels.aot --sass-loop grouped --arch 90``).

@triton.jit
def lane_order(v, ROWS: tl.constexpr, NB: tl.constexpr):
    """[ROWS, NB] in slot order (NB = 64 bytes of a 128-value step) -> logical K order: k bit 0 =
    slot bit 0, k bits 1-2 = slot bits 4-5 (the lane of a quad), k bits 3-5 = slot bits 1-3."""
    v = tl.reshape(v, [ROWS, 2, 2, NB // 8, 2])
    return tl.reshape(tl.permute(v, (0, 3, 1, 2, 4)), [ROWS, NB])


@triton.jit
def mxfp4_halves_bf16(wq, ws, ROWS: tl.constexpr, NB: tl.constexpr, FP32: tl.constexpr, W_F2: tl.constexpr = True):
    """wq [ROWS, NB] uint8 e2m1 pairs (NB = 64: one 128-value step) + ws [ROWS, NB/16] e8m0 ->
    (even, odd) [ROWS, NB] bf16 (fp32 when FP32): the values of checkpoint K 2j and 2j + 1 of slot j,
    in ``lane_order``; exactly ``mxfp4_tile_bf16``'s values (the same bits, factors and multiplies)."""
    x = tl.maximum(ws.to(tl.int32), 1)
    f1 = _bf16_bits((tl.minimum(x, 128) + 126) << 7, FP32)
    f1 = tl.reshape(tl.broadcast_to(f1[:, :, None], [ROWS, NB // 16, 16]), [ROWS, NB])
    f2 = f1  # (W_F2 only)
    if W_F2:
        f2 = _bf16_bits((tl.maximum(x, 128) - 1) << 7, FP32)
        f2 = tl.reshape(tl.broadcast_to(f2[:, :, None], [ROWS, NB // 16, 16]), [ROWS, NB])
    if FP32:
        b = wq.to(tl.int32)
        lo = _bf16_bits(((b & 7) << 6) | ((b & 8) << 12), True) * f1
        hi = _bf16_bits(((b & 0x70) << 2) | ((b & 0x80) << 8), True) * f1
        if W_F2:
            lo = lo * f2
            hi = hi * f2
    elif W_F2:
        lo, hi = tl.inline_asm_elementwise(
            asm="""{ .reg .b32 t, m;
            prmt.b32 t, $4, 0, 0x7170;
            and.b32 m, t, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 m, m, 0x81C081C0;
            mul.rn.bf16x2 m, m, $5; mul.rn.bf16x2 $0, m, $7;
            and.b32 m, t, 0x00F000F0; mul.lo.u32 m, m, 0x104; and.b32 m, m, 0x81C081C0;
            mul.rn.bf16x2 m, m, $5; mul.rn.bf16x2 $2, m, $7;
            prmt.b32 t, $4, 0, 0x7372;
            and.b32 m, t, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 m, m, 0x81C081C0;
            mul.rn.bf16x2 m, m, $6; mul.rn.bf16x2 $1, m, $8;
            and.b32 m, t, 0x00F000F0; mul.lo.u32 m, m, 0x104; and.b32 m, m, 0x81C081C0;
            mul.rn.bf16x2 m, m, $6; mul.rn.bf16x2 $3, m, $8; }""",
            constraints="=r,=r,=r,=r,r,r,r,r,r", args=[wq, f1, f2], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(
            asm="""{ .reg .b32 t, m;
            prmt.b32 t, $4, 0, 0x7170;
            and.b32 m, t, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 m, m, 0x81C081C0; mul.rn.bf16x2 $0, m, $5;
            and.b32 m, t, 0x00F000F0; mul.lo.u32 m, m, 0x104; and.b32 m, m, 0x81C081C0; mul.rn.bf16x2 $2, m, $5;
            prmt.b32 t, $4, 0, 0x7372;
            and.b32 m, t, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 m, m, 0x81C081C0; mul.rn.bf16x2 $1, m, $6;
            and.b32 m, t, 0x00F000F0; mul.lo.u32 m, m, 0x104; and.b32 m, m, 0x81C081C0; mul.rn.bf16x2 $3, m, $6; }""",
            constraints="=r,=r,=r,=r,r,r,r", args=[wq, f1], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return lane_order(lo, ROWS, NB), lane_order(hi, ROWS, NB)


@triton.jit
def act_halves(x, COLS: tl.constexpr):
    """Activations [128, COLS] of one step in checkpoint K order -> (even, odd) [64, COLS] in the
    logical order of ``mxfp4_halves_bf16``'s outputs."""
    x = tl.reshape(x, [2, 2, 8, 2, 2, COLS])  # slot bits 5, 4, 3..1, 0; the half; cols
    x = tl.permute(x, (2, 0, 1, 3, 5, 4))
    return tl.split(tl.reshape(x, [64, COLS, 2]))


@triton.jit
def mxfp8_tile_bf16(aq, a_s, BLOCK_K: tl.constexpr, COLS: tl.constexpr, FP32: tl.constexpr):
    """aq [BLOCK_K, COLS] uint8 e4m3 (K-major: tokens are the MMA's N) + a_s [BLOCK_K/32, COLS] e8m0
    -> [BLOCK_K, COLS] bf16 e4m3 * 2**(e8m0 - 127) (byte 0 read as 2**-126), the value
    the fp32 MXFP8 dequantization rounds to in bf16 (exact unless below 2**-133, rounded the same way).

    Decode: the byte's sign -> bf16 bit 15, its 7 other bits -> bits 10..4 is e4m3 * 2**-120
    exactly (e4m3 denormals land on bf16 denormals; NaN codes are not special). Scale: times
    2**(x - 7), x = max(e8m0, 1), split like the weights' into F1 = 2**min(x - 7, 127) and
    F2 = 2**max(x - 134, 0) (1 unless the block's scale exceeds 2**7). On the GPU one inline-PTX
    block per 4 bytes: 2 ``prmt`` (byte + sign-replicated byte), 2 shifts, 2 masks and 4
    ``mul.rn.bf16x2`` (sm_90+ and sm_12x alike), all integer/fp16-pipe ops, no conversion
    instruction. FP32 (interpreter): the same bits and factors in fp32."""
    x = tl.maximum(a_s.to(tl.int32), 1)
    f1 = _bf16_bits((tl.minimum(x, 134) + 120) << 7, FP32)[:, None, :]
    f2 = _bf16_bits((tl.maximum(x, 134) - 7) << 7, FP32)[:, None, :]
    if FP32:
        q = tl.reshape(aq.to(tl.int32), [BLOCK_K // 32, 32, COLS])
        a = _bf16_bits(((q << 24) >> 20) & 0x87F0, FP32) * f1 * f2
    else:
        q = tl.reshape(aq, [BLOCK_K // 32, 32, COLS])
        a = tl.inline_asm_elementwise(
            asm="""{ .reg .b32 t0, t1;
            prmt.b32 t0, $2, 0, 0x9180;
            prmt.b32 t1, $2, 0, 0xB3A2;
            shl.b32 t0, t0, 4;
            shl.b32 t1, t1, 4;
            and.b32 t0, t0, 0x87F087F0;
            and.b32 t1, t1, 0x87F087F0;
            mul.rn.bf16x2 $0, t0, $3;
            mul.rn.bf16x2 $1, t1, $4;
            mul.rn.bf16x2 $0, $0, $5;
            mul.rn.bf16x2 $1, $1, $6; }""",
            constraints="=r,=r,r,r,r,r,r", args=[q, f1, f2], dtype=tl.bfloat16, is_pure=True, pack=4)
    return tl.reshape(a, [BLOCK_K, COLS])


# ---- decode (GEMV-shaped) helpers ---------------------------------------------------------------

@triton.jit
def mxfp8_quantize_rows_fast(y, ROWS: tl.constexpr, NUM_BLOCKS: tl.constexpr, HW_FP8: tl.constexpr):
    """``_codecs.mxfp8_quantize_rows`` with the e4m3 rounding done by the hardware when HW_FP8
    (``cvt.rn.satfinite.e4m3x2.f32``, sm_89+: RNE, saturating, as the software encoder). The
    interpreter rounds fp32 -> e4m3 wrongly near powers of two, so CPU runs pass HW_FP8=False."""
    ys, e = mxfp8_block_scale(y, ROWS, NUM_BLOCKS)
    if HW_FP8:
        codes = ys.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        codes = e4m3_encode(ys)
    return tl.reshape(codes, [ROWS, NUM_BLOCKS * 32]), (e + 127).to(tl.uint8)


@triton.jit
def mx_dot_wa(wq, ws, aq, a_s, acc, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, COLS: tl.constexpr,
              DOT_SCALED: tl.constexpr):
    """acc [ROWS, COLS] += W @ A for an MXFP4 weight tile and an MXFP8 activation tile.

    wq [ROWS, BLOCK_K/2] uint8 e2m1 pairs (low nibble = even k), ws [ROWS, BLOCK_K/32] e8m0;
    aq [BLOCK_K, COLS] uint8 e4m3 (activations transposed: tokens are the MMA's N), a_s
    [COLS, BLOCK_K/32] e8m0. DOT_SCALED: ``tl.dot_scaled`` (Triton's e2m1/e4m3 upcast + bf16 MMA
    on sm_90a, its MX path on sm_12x). Else (the interpreter, which has no dot_scaled) both are
    dequantized to fp32 here and multiplied with an fp32 ``tl.dot``: the same exact products.
    """
    if DOT_SCALED:
        return tl.dot_scaled(wq, ws, "e2m1", aq, a_s, "e4m3", acc, fast_math=True)
    else:
        wi = wq.to(tl.int32)
        w = tl.reshape(tl.join(e2m1_decode(wi), e2m1_decode(wi >> 4)), [ROWS, BLOCK_K // 32, 32])
        w_e = tl.maximum(ws.to(tl.int32) - 127, -126)
        w = tl.reshape(w * _pow2(w_e)[:, :, None], [ROWS, BLOCK_K])
        a = tl.reshape(aq.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BLOCK_K // 32, 32, COLS])
        a_e = tl.maximum(tl.trans(a_s).to(tl.int32) - 127, -126)  # [BLOCK_K/32, COLS]
        a = tl.reshape(a * _pow2(a_e)[:, None, :], [BLOCK_K, COLS])
        return tl.dot(w, a, acc)


@triton.jit
def routed_tokens(topk_ids_ptr, p, t0, M, E: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, WINDOW: tl.constexpr = 0):
    """Which tokens of the block t0 .. t0+BLOCK_M the program of routed slot ``p`` serves.

    The program of slot p (= token * TOPK + j) owns expert ``topk_ids[p]`` for the whole token
    block unless an earlier slot of the block routes to the same expert (then it is a duplicate
    and does nothing), so each expert's weights are streamed once per block whatever the batch.
    Ids are clamped to [0, E) (padded or garbage rows never index out of bounds).
    Returns (expert int64, first, uses [BLOCK_M] bool, slot [BLOCK_M]: the token's first slot
    routed there, hit [BLOCK_M, TOPK_PAD] bool: every slot routed there).

    WINDOW > 0 (a program holds at most WINDOW tokens' accumulators, fewer than the block's): the
    expert's users (tokens routed there, in token order) are served in windows of WINDOW. The
    program of slot p leads the window that starts at its token's rank among the users when that
    rank is a multiple of WINDOW and p is its token's first slot there; ``uses`` then marks that
    window's tokens only, and ``first`` is whether p leads one. So an expert's weights are streamed
    once per WINDOW users (once, for the usual 1-4), never per chunk of tokens.
    """
    offs_t = tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, TOPK_PAD)
    tok = t0 + offs_t
    slot_ok = (tok[:, None] < M) & (offs_j[None, :] < TOPK)
    ids = tl.load(topk_ids_ptr + tok[:, None] * TOPK + offs_j[None, :], mask=slot_ok, other=0)
    return routed_tokens_of(ids, tl.load(topk_ids_ptr + p), p, t0, M, E, TOPK, TOPK_PAD, BLOCK_M, WINDOW)


@triton.jit
def routed_tokens_of(ids, expert, p, t0, M, E: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, WINDOW: tl.constexpr = 0):
    """``routed_tokens`` on ids already in registers: ``ids`` [BLOCK_M, TOPK_PAD] of the block's
    tokens (slots >= TOPK and tokens >= M ignored), ``expert`` = slot p's id."""
    offs_t = tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, TOPK_PAD)
    tok = t0 + offs_t
    slot_ok = (tok[:, None] < M) & (offs_j[None, :] < TOPK)
    ids = tl.minimum(tl.maximum(ids, 0), E - 1)
    expert = tl.minimum(tl.maximum(expert, 0), E - 1)
    hit = slot_ok & (ids == expert)
    uses = tl.max(hit.to(tl.int32), axis=1) > 0
    slot = tl.min(tl.where(hit, offs_j[None, :], TOPK_PAD), axis=1)
    if WINDOW > 0:
        u = uses.to(tl.int32)
        rank = tl.cumsum(u, 0) - u  # users before each token
        mine = offs_t == (p - t0 * TOPK) // TOPK  # the program's token (it routes there: u == 1)
        my_rank = tl.sum(tl.where(mine, rank, 0))
        lead = tl.sum(tl.where(mine, slot, 0)) == (p - t0 * TOPK) % TOPK
        first = lead & (my_rank % WINDOW == 0)
        uses = uses & (rank >= my_rank) & (rank < my_rank + WINDOW)
    else:
        local = offs_t[:, None] * TOPK + offs_j[None, :]
        first = tl.sum((hit & (local < p - t0 * TOPK)).to(tl.int32)) == 0
    return expert.to(tl.int64), first, uses, slot, hit


@triton.jit
def pdl_wait_then_release():
    """Programmatic dependent launch (``PDL``): wait until the previous kernel in the stream has
    finished and its writes are visible, then let the next one launch (its pre-wait prologue may
    overlap this kernel). Everything a PDL kernel does before this call reads only memory that no
    kernel still running can write (weights, and routing written two launches back)."""
    gdc_wait()
    gdc_launch_dependents()
