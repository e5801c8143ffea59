"""Triton code for the CUDA-core (FMA) MoE decode GEMVs for very few tokens (launchers and
references: ``kernels/moe.py``: ``moe_fc1_swiglu_fma`` / ``moe_fc2_combine_fma``).

Why: at M <= 4 tokens a routed expert sees ~1 token, so the GEMMs are matrix-vector products
whose cost is streaming the MXFP4 weights; padding the tokens to an MMA N of 16 (the
``tl.dot_scaled`` decode kernels) buys nothing. Here the weights never leave registers:

* Program (routed slot, tile of BLOCK_R weight rows) of ONE routed expert (``routed_tokens``: a
  slot whose expert an earlier slot already has exits at once, so each expert's rows are read
  once for all the tokens routed to it).
* The rows are streamed along K as int32 words, a [BLOCK_R, 4 * BLOCK_G] tile per step (Triton
  lays it out as 16-byte vectors per thread, BLOCK_G threads along K, the rest along rows): 4
  words = 16 contiguous bytes = 32 e2m1 values = exactly one e8m0 scale group, so each thread
  issues 16-byte vector loads, owns whole scale groups, and its other vectors are other rows of
  the same groups (the activations it decodes serve all of them). The scales are loaded in the
  layout of the group sums (``_stream_rows``): no layout conversion, no barrier in the loop.
  Optionally (PREFETCH) the next step's weights are loaded before this step's math.
* Decoding is 3 integer ops per value and no conversion instruction: nibble J of a word w is
  ``((w << (28 - 4J)) >> 6) & 0x81C00000`` (arithmetic shift: the sign lands in bit 31, the 3
  magnitude bits in bits 24..22), i.e. the fp32 e2m1 * 2**-126 (code 1 is an fp32 denormal:
  Triton's PTX keeps denormals, no .ftz). e4m3 activation bytes likewise:
  ``((x << (24 - 8J)) >> 4) & 0x87F00000`` = e4m3 * 2**-120, times 2**127 once. Products are
  exact (2- and 4-bit significands), summed in fp32 per 32-value group, and each group sum is
  multiplied by 2**(e8m0_w + e8m0_a - 254 + 119) (one exact power of two) into an fp32
  [BLOCK_R, BLOCK_G] accumulator per token, reduced with ``tl.sum`` at the end.
* Tokens (NT <= 4 accumulators, constexpr): the tokens routed to the program's expert are listed
  first (``_user``), one accumulator each; user 0 always exists, users 1..3 are updated under a
  uniform branch only where they exist, so the weight tile is loaded and decoded once per step
  whatever the number of tokens, and the usual case (one token per expert) does one FMA per value.
  With more tokens than accumulators (WINDOW, up to ``FMA_LAUNCH_MAX_TOKENS`` in one launch) a
  program serves a window of NT of its expert's users and the expert's next NT users have their
  own program (``routed_tokens``): weights are streamed once per NT users of an expert.

FC1's epilogue adds the bias, applies gpt-oss SwiGLU to the interleaved gate/up rows and
writes MXFP8 (BLOCK_R = 64 rows -> 32 outputs = one MXFP8 block per program). With SPLIT > 1
(grid axis 2, tile field ``fc1_split``) each split writes fp32 partials and the last split of a
tile to arrive sums them in split order and runs that epilogue (``_split_fixup``); measured
without gain on an H200, so off by default (``kernels/moe.py``). FC2 writes fp32
partials per (token, slot) exactly as ``_moe_fc2_kernel`` (zeros for a repeated slot), or per
(token, slot, K split) with SPLIT > 1 (grid axis 2; the bias goes into split 0), summed in a
fixed order by ``_moe_combine_kernel``: deterministic.

Cost (sm_90a SASS, 64 x 256-byte tile, 4 warps, one token): ~5.2 instructions per weight value
(3 integer for the decode, 1 FFMA, the rest activation decode / scales / addressing). Everything is plain loads, integer/fp32 arithmetic and ``tl.sum``
(+ the e4m3 ``cvt`` of the FC1 epilogue when HW_FP8): no MMA, nothing sm_90-only.

Opt-ins (GPU only, ``kernels/moe.py``): F16X2, packed fp16 products (``_e2m1_pairs_f16``,
``_e4m3_pairs_f16``, ``_dot8_f16``: ~3.1 instructions per weight value, each word's 8-term sum
rounded to fp16 once), or F16X2 == 2 (``_dot32_f16``: each 32-value group in one fp16 chain; the
GPU default since stop 34); PDL, programmatic dependent launch of FC1 -> FC2 -> combine
(``_mx.pdl_wait_then_release``: FC1 waits first thing, FC2 after its routing and any prefetched
first weights); ACT_LDG (``_ldg_nc_pair``) and SCALE_LDG (``_ldg_u8``), plain ``ld.global.nc``
loads of the activation words and of the scale bytes.
"""

import triton
import triton.language as tl

from .._prefetch import prefetch_l2, prefetch_l2_grid
from .._sync import last_to_arrive as _last_to_arrive
from ..kv_cache_details._codecs import _pow2, e4m3_word_byte, store_rounded, to_bf16_rne
from ..norm_mxfp8_details._next_norm import next_norm_inputs, next_norm_store, row_of
from ._moe_route import route_rows
from ._mx import mxfp8_quantize_rows_fast, pdl_wait_then_release, routed_tokens, routed_tokens_of

E2M1_MASK = tl.constexpr(-2118123520)  # 0x81C00000 as int32: sign bit + fp32 bits 24..22
TWO_127 = tl.constexpr(1.7014118346046923e38)  # 2**127
# group sum (units of 2**-119: e2m1 * 2**-126 times e4m3 * 2**7) -> value: 2**119 folded into
# the scale exponent
PROD_EXP = tl.constexpr(119)


@triton.jit
def _e2m1_nibble(w, J: tl.constexpr):
    """Nibble J (0 = lowest) of int32 words -> fp32 e2m1 value * 2**-126 (exact; code 1 denormal)."""
    return (((w << (28 - 4 * J)) >> 6) & E2M1_MASK).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_byte(x, J: tl.constexpr):
    """Byte J (0 = lowest) of int32 words -> fp32 e4m3 value * 2**7 (exact; NaN codes not special)."""
    return e4m3_word_byte(x, J) * TWO_127


@triton.jit
def _e2m1_pairs_f16(w):
    """int32 words of 8 e2m1 nibbles (n0 lowest) -> four fp16x2 words (as int32) holding the
    nibble pairs (n0, n2), (n4, n6), (n1, n3), (n5, n7) (low half first) as e2m1 * 2**-14, exact
    (code 1 is an fp16 denormal). Such an fp16 has one non-zero byte, its high one: the sign in
    bit 7, the 3 magnitude bits in bits 3..1. Those bytes are built for 4 nibbles at a time
    (even nibbles: ``(w << 1) & 0x0E0E0E0E | (w << 4) & 0x80808080``; odd ones: ``(w >> 3) &
    0x0E0E0E0E | w & 0x80808080``) and one ``prmt`` per pair moves two of them into the high bytes
    of an fp16x2 word (zero low bytes): 11 instructions per 8 values. Inline PTX (sm_90+ and
    sm_12x alike; the interpreter cannot run it)."""
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 a, b, e, o;
        shl.b32 a, $4, 1; shl.b32 b, $4, 4; and.b32 a, a, 0x0E0E0E0E; and.b32 b, b, 0x80808080; or.b32 e, a, b;
        shr.b32 a, $4, 3; and.b32 a, a, 0x0E0E0E0E; and.b32 b, $4, 0x80808080; or.b32 o, a, b;
        prmt.b32 $0, e, 0, 0x1404; prmt.b32 $1, e, 0, 0x3424; prmt.b32 $2, o, 0, 0x1404; prmt.b32 $3, o, 0, 0x3424; }""",
        constraints="=r,=r,=r,=r,r", args=[w], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
        pack=1)


@triton.jit
def _e4m3_pairs_f16(lo, hi):
    """int32 words of e4m3 bytes v0..v3 (lo) and v4..v7 (hi) -> four fp16x2 words (as int32)
    (v0, v2), (v4, v6), (v1, v3), (v5, v7) (``_e2m1_pairs_f16``'s order), exact: two ``prmt`` +
    four ``cvt.rn.f16x2.e4m3x2`` (sm_89+; NaN codes stay NaN, the quantizer never writes them)."""
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 t; .reg .b16 x, y;
        prmt.b32 t, $4, $5, 0x3120; mov.b32 {x, y}, t; cvt.rn.f16x2.e4m3x2 $0, x; cvt.rn.f16x2.e4m3x2 $2, y;
        prmt.b32 t, $4, $5, 0x7564; mov.b32 {x, y}, t; cvt.rn.f16x2.e4m3x2 $1, x; cvt.rn.f16x2.e4m3x2 $3, y; }""",
        constraints="=r,=r,=r,=r,r,r", args=[lo, hi], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True, pack=1)


@triton.jit
def _dot8_f16(p0, p1, p2, p3, a0, a1, a2, a3):
    """One weight word's 8 products with its activations: four fp16x2 multiply-adds (each
    product is exact: 2 x 4 significant bits), the two halves added in fp16, -> fp32 in units of
    2**-14 (|sum| <= 8 * 6 * 448 * 2**-14 < 1.4: no overflow; the rounding is ~2**-11 of the
    word's 8-term sum)."""
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 s; .reg .b16 x, y;
        mul.rn.f16x2 s, $1, $5; fma.rn.f16x2 s, $2, $6, s; fma.rn.f16x2 s, $3, $7, s; fma.rn.f16x2 s, $4, $8, s;
        mov.b32 {x, y}, s; add.rn.f16 x, x, y; cvt.f32.f16 $0, x; }""",
        constraints="=f,r,r,r,r,r,r,r,r", args=[p0, p1, p2, p3, a0, a1, a2, a3], dtype=tl.float32,
        is_pure=True, pack=1)


@triton.jit
def _words4(x, LEAD: tl.constexpr, G: tl.constexpr):
    """The 4 consecutive int32 words of each 32-value group of x [LEAD, 4 * G] (in one thread's
    registers: 16-byte vectors) as four [LEAD, G] tensors (a re-layout Triton does in registers)."""
    ev, od = tl.split(tl.reshape(x, [LEAD, G, 2, 2]))
    w0, w2 = tl.split(ev)
    w1, w3 = tl.split(od)
    return w0, w1, w2, w3


# _dot32_f16's chain: 16 fp16x2 multiply-adds of the weight pairs $1..$16 with the activation pairs
# $17..$32, the two halves added once and converted to fp32.
_DOT32_ASM = tl.constexpr("{ .reg .b32 s; .reg .b16 x, y; mul.rn.f16x2 s, $1, $17; "
                          + " ".join(f"fma.rn.f16x2 s, ${i}, ${i + 16}, s;" for i in range(2, 17))
                          + " mov.b32 {x, y}, s; add.rn.f16 x, x, y; cvt.f32.f16 $0, x; }")
_DOT32_CONSTRAINTS = tl.constexpr(",".join(["=f"] + ["r"] * 32))


@triton.jit
def _dot32_f16(p0, p1, p2, p3, a0, a1, a2, a3, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    """F16X2 == 2 (the GPU default since stop 34): a whole 32-value group's products in one fp16x2 multiply-add chain (16
    of them, the two halves added once, one conversion to fp32 in units of 2**-14) instead of
    ``_dot8_f16`` per word and three fp32 adds: 18 instead of 27 instructions per group. The
    price: the group's 16 partial sums of each half are rounded to fp16 (|sum| <= 32 * 6 * 448 *
    2**-14 < 5.3: no overflow). Inline PTX (sm_90+ and sm_12x alike)."""
    ps = _words4(p0, BLOCK_R, BLOCK_G) + _words4(p1, BLOCK_R, BLOCK_G) + _words4(p2, BLOCK_R, BLOCK_G) \
        + _words4(p3, BLOCK_R, BLOCK_G)
    acts = _words4(a0, 1, BLOCK_G) + _words4(a1, 1, BLOCK_G) + _words4(a2, 1, BLOCK_G) + _words4(a3, 1, BLOCK_G)
    return tl.inline_asm_elementwise(asm=_DOT32_ASM, constraints=_DOT32_CONSTRAINTS, args=list(ps) + list(acts),
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _prefetch_expert(pf_ptr, pf_bytes, pfs_ptr, pfs_bytes, expert, LANES: tl.constexpr, LINE: tl.constexpr):
    """L2 prefetch of expert ``expert``'s slice of two per-expert arrays (pf_bytes / pfs_bytes each),
    shared by the programs of grid axes 1 and 2 (the expert's row tiles and K splits)."""
    n = tl.num_programs(1) * tl.num_programs(2)
    part = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    prefetch_l2(pf_ptr + expert.to(tl.int64) * pf_bytes, pf_bytes, part, n, LANES, LINE)
    prefetch_l2(pfs_ptr + expert.to(tl.int64) * pfs_bytes, pfs_bytes, part, n, LANES, LINE)


@triton.jit
def _user(uses, slot, offs_t, U: tl.constexpr):
    """The U-th token (in token order) routed to the program's expert, as scalars: (exists,
    token, its first slot there). User 0 always exists (the program's own slot routes there)."""
    u = uses.to(tl.int32)
    sel = (u > 0) & (tl.cumsum(u, 0) == U + 1)
    return tl.sum(sel.to(tl.int32)) > 0, tl.sum(tl.where(sel, offs_t, 0)), tl.sum(tl.where(sel, slot, 0))


@triton.jit
def _ldg_nc_pair(ptr, ok):
    """Two consecutive int32 words at each 8-byte aligned ``ptr`` (zeros where not ``ok``) by one
    ``ld.global.nc.v2``: a load Triton's pipeliner does not turn into a cp.async + shared-memory
    round trip (and its CTA barrier) per K step. Not marked pure: it reads what the previous kernel
    wrote, so it must stay after a PDL wait. Inline PTX (sm_90 and sm_12x; not the interpreter)."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $3, 0; mov.b32 $0, 0; mov.b32 $1, 0;"
            " @p ld.global.nc.v2.b32 {$0, $1}, [$2]; }",
        constraints="=r,=r,l,r", args=[ptr, ok.to(tl.int32)], dtype=(tl.int32, tl.int32), is_pure=False, pack=1)


@triton.jit
def _ldg_u8(ptr, ok):
    """One e8m0 scale byte at each ``ptr`` (127, i.e. 1.0, where not ``ok``) by ``ld.global.nc.u8`` straight into a
    32-bit register, as int32. Triton carries a uint8 ``tl.load`` across a loop iteration packed
    in a register that ptxas unpacks (``PRMT`` / ``LOP3 & 0xff``) soon after the load, so a scale
    loaded one K step ahead was still waited for in the step that loaded it (ncu, H100, FC1: 14% of
    the stall samples on two such unpacks); here the first use is the next step's arithmetic. Not
    marked pure (stays after a PDL wait). Inline PTX (sm_90 and sm_12x; not the interpreter)."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 127; @p ld.global.nc.u8 $0, [$1]; }",
        constraints="=r,l,r", args=[ptr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _group_dot(w, p0, p1, p2, p3, act_ptr, act_scale_ptr, row, w_exp, g0, offs_c, c_ok, offs_g, g_ok,
               K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, F16X2: tl.constexpr,
               ACT_LDG: tl.constexpr = False, a_raw=None):
    """One token's contribution of a weight tile: [BLOCK_R, BLOCK_G] fp32 (true values).

    w: [BLOCK_R, 4 * BLOCK_G] int32 words (8 e2m1 each; 4 words = one 32-value group), or with
    F16X2 its fp16x2 nibble pairs p0..p3 (``_e2m1_pairs_f16``, decoded once for every token);
    w_exp: [BLOCK_R, BLOCK_G] int32 weight scale exponents; the token's activations are row
    ``row`` of int32 e4m3 words [*, K/4] (2 per weight word) and e8m0 scales [*, K/32].
    """
    a_words = act_ptr + row * (K // 4) + (g0 * 4 + offs_c) * 2
    if ACT_LDG:  # (opt-in: plain cached loads instead of Triton's pipelined copies through shared memory)
        lo, hi = _ldg_nc_pair(a_words, c_ok)
    else:
        lo = tl.load(a_words, mask=c_ok, other=0)  # values 8c .. 8c+3 of weight word c
        hi = tl.load(a_words + 1, mask=c_ok, other=0)  # values 8c+4 .. 8c+7
    group_sums: tl.constexpr = F16X2 == 2
    if group_sums:  # whole-group fp16 chains: already [BLOCK_R, BLOCK_G]
        a0, a1, a2, a3 = _e4m3_pairs_f16(lo, hi)
        s = _dot32_f16(p0, p1, p2, p3, a0[None, :], a1[None, :], a2[None, :], a3[None, :], BLOCK_R, BLOCK_G)
        unit = 14
    elif F16X2:
        a0, a1, a2, a3 = _e4m3_pairs_f16(lo, hi)
        s = _dot8_f16(p0, p1, p2, p3, a0[None, :], a1[None, :], a2[None, :], a3[None, :])
        unit = 14  # word sums are in units of 2**-14
    else:
        s = _e2m1_nibble(w, 0) * _e4m3_byte(lo, 0)[None, :]
        for j in tl.static_range(1, 4):
            s += _e2m1_nibble(w, j) * _e4m3_byte(lo, j)[None, :]
        for j in tl.static_range(4):
            s += _e2m1_nibble(w, 4 + j) * _e4m3_byte(hi, j)[None, :]
        unit = PROD_EXP
    if a_raw is None:
        a_raw = tl.load(act_scale_ptr + row * (K // 32) + g0 + offs_g, mask=g_ok, other=127).to(tl.int32)
    a_exp = tl.maximum(a_raw - 127, -126)
    e = tl.minimum(tl.maximum(w_exp + a_exp[None, :] + unit, -126), 127)
    if not group_sums:
        s = tl.sum(tl.reshape(s, [BLOCK_R, BLOCK_G, 4]), axis=2)
    return s * _pow2(e)


@triton.jit
def _stream_rows(w_ptr, w_scale_ptr, act_ptr, act_scale_ptr, w_rows, rows_ok, r0, r1, r2, r3, u1, u2, u3,
                 g_lo, G_RANGE: tl.constexpr, K: tl.constexpr, NT: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_G: tl.constexpr, PREFETCH: tl.constexpr, F16X2: tl.constexpr, PDL: tl.constexpr = False,
                 w_desc=None, row0=0, TMA: tl.constexpr = 0, SCALES_AHEAD: tl.constexpr = True,
                 ACT_LDG: tl.constexpr = False, SCALE_LDG: tl.constexpr = False):
    """Rows ``w_rows`` [BLOCK_R] of an MXFP4 matrix (int32 words [*, K/8], e8m0 [*, K/32]) times
    up to NT = 4 tokens' MXFP8 activation rows r0..r3 (r0 always; r1..r3 only where u1..u3),
    over the 32-value groups g_lo .. g_lo + G_RANGE of K (clipped to K/32).
    Returns four fp32 [BLOCK_R] dot products (unused ones zero).

    TMA > 0: the weight tiles come through ``w_desc`` (a tensor descriptor of the int32 words,
    block [BLOCK_R, 4 * BLOCK_G], tile rows row0 .. row0 + BLOCK_R: rows past the matrix and
    words past K/8 read as zeros) in a TMA pipeline of TMA stages in shared memory, so the bytes
    in flight cost shared memory instead of registers (PREFETCH is ignored).

    The weight tile is 2-D [BLOCK_R, 4 * BLOCK_G] words, contiguous along K, so each thread
    loads 16-byte vectors (one scale group) and its repeats are other rows of the same groups:
    the activations it decodes serve all of its rows."""
    NUM_STAGES: tl.constexpr = TMA if TMA > 0 else 1
    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, 4 * BLOCK_G)
    w_base = w_ptr + w_rows[:, None] * (K // 8) + offs_c[None, :]
    # The scales are loaded transposed, [BLOCK_G, BLOCK_R], one byte per thread and group ("(x * 3)
    # // 3" hides the contiguity from Triton's axis analysis, so it neither vectorizes nor makes
    # rows the fast dimension) and transposed back: that is the layout of the group sums, so the
    # loop carries no layout conversion (a shared-memory round trip and barrier per step).
    ws_base = w_scale_ptr + ((offs_g * 3) // 3)[:, None] + w_rows[None, :] * (K // 32)
    acc0 = tl.zeros([BLOCK_R, BLOCK_G], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_R, BLOCK_G], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_G], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_R, BLOCK_G], dtype=tl.float32)
    if PREFETCH and TMA == 0:
        w_nxt = tl.load(w_base + g_lo * 4, mask=rows_ok[:, None] & (g_lo * 4 + offs_c[None, :] < K // 8), other=0)
    # The scales one step ahead too (with PREFETCH, and in the TMA pipeline for up to 2 tokens): byte
    # loads, which neither TMA nor Triton's cp.async pipelining (4-byte minimum) can carry, would
    # otherwise stall every step for a memory round trip. Not with TMA at NT >= 3, where the extra
    # registers spill (sm_90a, FC1: 32 -> 96 bytes of stack at NT = 4, 0 -> 32 at NT = 3).
    WS_AHEAD: tl.constexpr = PREFETCH if TMA == 0 else (NT <= 2 and SCALES_AHEAD)
    # SCALE_LDG (GPU, opt-in): those scale bytes, and token 0's activation scales one step ahead
    # too, loaded by _ldg_u8 (int32 registers: no unpacking that waits for the load in its own step).
    a_row0 = act_scale_ptr + r0 * (K // 32)
    if WS_AHEAD:
        if SCALE_LDG:
            ws_nxt = _ldg_u8(ws_base + g_lo, rows_ok[None, :] & (g_lo + offs_g[:, None] < K // 32))
            as_nxt = _ldg_u8(a_row0 + g_lo + offs_g, g_lo + offs_g < K // 32)
        else:
            ws_nxt = tl.load(ws_base + g_lo, mask=rows_ok[None, :] & (g_lo + offs_g[:, None] < K // 32), other=127)
    if PDL:  # the weights (never written) are in flight: now wait for the previous kernel's activations
        pdl_wait_then_release()
    for gi in tl.range(0, G_RANGE, BLOCK_G, num_stages=NUM_STAGES):
        g0 = g_lo + gi
        g_ok = g0 + offs_g < K // 32
        c_ok = g0 * 4 + offs_c < K // 8
        in_range = gi + BLOCK_G < G_RANGE  # the next step is this program's (not the next split's)
        a_raw = None
        if WS_AHEAD:  # the scales: loaded one step ahead (see above)
            ws = ws_nxt
            g_nxt = (g0 + BLOCK_G + offs_g < K // 32) & in_range
            if SCALE_LDG:
                a_raw = as_nxt
                ws_nxt = _ldg_u8(ws_base + g0 + BLOCK_G, rows_ok[None, :] & g_nxt[:, None])
                as_nxt = _ldg_u8(a_row0 + g0 + BLOCK_G + offs_g, g_nxt)
            else:
                ws_nxt = tl.load(ws_base + g0 + BLOCK_G, mask=rows_ok[None, :] & g_nxt[:, None], other=127)
        else:
            ws = tl.load(ws_base + g0, mask=rows_ok[None, :] & g_ok[:, None], other=127)
        if TMA > 0:  # Triton pipelines the descriptor loads (cp.async.bulk.tensor + mbarriers)
            w = w_desc.load([row0, g0 * 4])
        elif PREFETCH:  # software pipelining by hand: the next step's loads are issued before this step's math
            w = w_nxt
            c_nxt = ((g0 + BLOCK_G) * 4 + offs_c < K // 8) & in_range
            w_nxt = tl.load(w_base + (g0 + BLOCK_G) * 4, mask=rows_ok[:, None] & c_nxt[None, :], other=0)
        else:
            w = tl.load(w_base + g0 * 4, mask=rows_ok[:, None] & c_ok[None, :], other=0)
        w_exp = tl.trans(tl.maximum(ws.to(tl.int32) - 127, -126))  # [BLOCK_R, BLOCK_G]
        if F16X2:
            p0, p1, p2, p3 = _e2m1_pairs_f16(w)
        else:
            p0 = w
            p1 = w
            p2 = w
            p3 = w
        acc0 += _group_dot(w, p0, p1, p2, p3, act_ptr, act_scale_ptr, r0, w_exp, g0, offs_c, c_ok, offs_g, g_ok, K,
                           BLOCK_R, BLOCK_G, F16X2, ACT_LDG, a_raw)
        if NT > 1:
            if u1:
                acc1 += _group_dot(w, p0, p1, p2, p3, act_ptr, act_scale_ptr, r1, w_exp, g0, offs_c, c_ok, offs_g,
                                   g_ok, K, BLOCK_R, BLOCK_G, F16X2, ACT_LDG)
        if NT > 2:
            if u2:
                acc2 += _group_dot(w, p0, p1, p2, p3, act_ptr, act_scale_ptr, r2, w_exp, g0, offs_c, c_ok, offs_g,
                                   g_ok, K, BLOCK_R, BLOCK_G, F16X2, ACT_LDG)
        if NT > 3:
            if u3:
                acc3 += _group_dot(w, p0, p1, p2, p3, act_ptr, act_scale_ptr, r3, w_exp, g0, offs_c, c_ok, offs_g,
                                   g_ok, K, BLOCK_R, BLOCK_G, F16X2, ACT_LDG)
    return tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1)


@triton.jit
def _fc1_epilogue(h, use, tok, slot, bias, nb, out_ptr, out_scale_ptr, I: tl.constexpr, TOPK: tl.constexpr,
                  BLOCK_R: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, HW_FP8: tl.constexpr):
    """bias + SwiGLU of interleaved gate/up rows h [BLOCK_R] -> MXFP8 row tok * TOPK + slot of out."""
    gate, up = tl.split(tl.reshape(h + bias, [BLOCK_R // 2, 2]))
    gate = tl.minimum(gate, LIMIT)
    up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    y = (up + 1.0) * gate * tl.sigmoid(ALPHA * gate)
    codes, scales = mxfp8_quantize_rows_fast(tl.reshape(y, [1, BLOCK_R // 2]), 1, BLOCK_R // 64, HW_FP8)
    out_row = tok.to(tl.int64) * TOPK + slot
    offs_n = nb * (BLOCK_R // 2) + tl.arange(0, BLOCK_R // 2)
    tl.store(out_ptr + out_row * I + offs_n[None, :], codes, mask=use & (offs_n[None, :] < I))
    offs_s = nb * (BLOCK_R // 64) + tl.arange(0, BLOCK_R // 64)
    tl.store(out_scale_ptr + out_row * (I // 32) + offs_s[None, :], scales, mask=use & (offs_s[None, :] < I // 32))


@triton.jit
def _split_fixup(h0, h1, h2, h3, ws_ptr, cnt_ptr, tile, split, NT: tl.constexpr, BLOCK_R: tl.constexpr,
                 SPLIT: tl.constexpr):
    """Split-K without a second launch: each split of ``tile`` writes its partial dot products (NT
    tokens x BLOCK_R rows, fp32) to the workspace, then counts itself in on the tile's counter
    (``_last_to_arrive``). The split that arrives last reads all SPLIT partials back and sums
    them in split order (deterministic: the same sums whichever split is last) and returns
    last = True; the others return False and exit.
    Returns (last, h0..h3)."""
    offs_r = tl.arange(0, BLOCK_R)
    base = ws_ptr + tile.to(tl.int64) * (SPLIT * NT * BLOCK_R)
    mine = base + split * (NT * BLOCK_R) + offs_r
    tl.store(mine, h0)
    if NT > 1:
        tl.store(mine + BLOCK_R, h1)
    if NT > 2:
        tl.store(mine + 2 * BLOCK_R, h2)
    if NT > 3:
        tl.store(mine + 3 * BLOCK_R, h3)
    last = _last_to_arrive(cnt_ptr, tile, SPLIT)
    if last:
        h0 = tl.zeros([BLOCK_R], dtype=tl.float32)
        h1 = tl.zeros([BLOCK_R], dtype=tl.float32)
        h2 = tl.zeros([BLOCK_R], dtype=tl.float32)
        h3 = tl.zeros([BLOCK_R], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            part = base + s * (NT * BLOCK_R) + offs_r
            h0 += tl.load(part, cache_modifier=".cg")
            if NT > 1:
                h1 += tl.load(part + BLOCK_R, cache_modifier=".cg")
            if NT > 2:
                h2 += tl.load(part + 2 * BLOCK_R, cache_modifier=".cg")
            if NT > 3:
                h3 += tl.load(part + 3 * BLOCK_R, cache_modifier=".cg")
    return last, h0, h1, h2, h3


@triton.jit
def _moe_fc1_swiglu_fma_kernel(
    a_ptr,  # [M, K / 4] int32: MXFP8 e4m3 activations viewed as words
    a_scale_ptr,  # [M, K / 32] uint8 e8m0
    w_ptr,  # [E, 2I, K / 8] int32: the e2m1 pairs (low nibble = even k) viewed as words
    w_scale_ptr,  # [E, 2I, K / 32] uint8 e8m0
    bias_ptr,  # [E, 2I] bf16
    topk_ids_ptr,  # [M, TOPK] int32
    out_ptr,  # [M * TOPK, I] uint8 e4m3: SwiGLU output (MXFP8), row = token * TOPK + slot
    out_scale_ptr,  # [M * TOPK, I / 32] uint8 e8m0
    ws_ptr,  # SPLIT > 1: [M * TOPK, 2I / BLOCK_R, SPLIT, NT, BLOCK_R] fp32 partial dot products
    cnt_ptr,  # SPLIT > 1: [M * TOPK * 2I / BLOCK_R] int32 arrival counters, zero before and after each launch
    w_desc,  # TMA > 0: tensor descriptor of w as [E * 2I, K / 8] int32, block [BLOCK_R, 4 * BLOCK_G]; else None
    logits_ptr,  # ROUTE: [M, E_ROUTE] router logits, routed here (topk_ids_ptr / topk_w_ptr are then outputs)
    topk_w_ptr,  # ROUTE: [M, TOPK] fp32 out (written by program (0, 0, 0), for FC2)
    expert_map_ptr,  # ROUTE and HAS_MAP: [E_ROUTE] int32 global -> local expert id or -1
    stride_l,  # ROUTE: the logits' row stride
    M,  # tokens (<= NT, or any with WINDOW)
    pf_ptr,  # PF: uint8 [E, pf_bytes]: per-expert bytes (FC2's weights) to prefetch into L2 for the next launch
    pf_bytes,
    pfs_ptr,  # PF: uint8 [E, pfs_bytes]: a second such array (FC2's weight scales)
    pfs_bytes,
    E: tl.constexpr,
    K: tl.constexpr,  # multiple of 64
    I: tl.constexpr,  # multiple of BLOCK_R / 2
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    NT: tl.constexpr,  # token accumulators (1..4): >= M, or WINDOW
    BLOCK_T: tl.constexpr,  # power of two >= M
    BLOCK_R: tl.constexpr,  # weight rows per program: a power of two >= 64 (whole MXFP8 output blocks)
    BLOCK_G: tl.constexpr,  # 32-value groups (16 bytes of a row) per K step, power of two
    PREFETCH: tl.constexpr,  # load the next K step's weights before this step's math
    F16X2: tl.constexpr,  # packed fp16 products (inline PTX, GPU; 2: per group, the default) or 0: exact fp32
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    HW_FP8: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent of the routing (GPU, opt-in)
    SPLIT: tl.constexpr = 1,  # K splits (grid axis 2); the last split of a tile to finish does the epilogue
    GPS: tl.constexpr = 0,  # 32-value groups per split: a multiple of BLOCK_G, SPLIT * GPS >= K / 32 (0: K / 32)
    TMA: tl.constexpr = 0,  # > 0: weight tiles through w_desc in a TMA pipeline of TMA stages (GPU)
    ROUTE: tl.constexpr = False,  # route the M tokens here (``route_rows``, as _moe_route_kernel) instead of reading ids
    E_ROUTE: tl.constexpr = 0,  # ROUTE: router experts (the logits' width; E is this rank's experts)
    E_PAD: tl.constexpr = 1,  # ROUTE: power of two >= E_ROUTE
    HAS_MAP: tl.constexpr = False,  # ROUTE: expert parallelism (expert_map_ptr)
    SCALES_AHEAD: tl.constexpr = True,  # TMA: the weight scales one step ahead (_stream_rows; A/B switch)
    ACT_LDG: tl.constexpr = False,  # activations by plain loads, not pipelined ($VLLM_SM121_MOE_ACT_LDG)
    SCALE_LDG: tl.constexpr = False,  # scale bytes one step ahead as int32 ($VLLM_SM121_MOE_SCALE_LDG)
    PF: tl.constexpr = False,  # L2 prefetch of the routed experts' pf / pfs slices (kernels/l2_prefetch.py)
    PF_LATE: tl.constexpr = False,  # ... after this program's own weight stream instead of before it
    PF_LANES: tl.constexpr = 128,
    PF_LINE: tl.constexpr = 128,
    WINDOW: tl.constexpr = 0,  # M > NT: each program serves a window of <= NT of its expert's users (routed_tokens)
):
    if PDL:  # the routing and the activations come from the previous launch: nothing to do before
        pdl_wait_then_release()
    p = tl.program_id(0)
    if p >= M * TOPK:
        return
    if ROUTE:  # every program routes the M <= 4 tokens (a few hundred logits); one writes them for FC2
        offs_t = tl.arange(0, BLOCK_T)
        offs_j = tl.arange(0, TOPK_PAD)[None, :]
        rw, rids = route_rows(logits_ptr, stride_l, offs_t, offs_t < M, expert_map_ptr, E_ROUTE, E_PAD, TOPK,
                              TOPK_PAD, HAS_MAP)
        mine = (offs_t[:, None] * TOPK + offs_j == p) & (offs_j < TOPK)
        writer = (p == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
        out_ok = writer & (offs_t[:, None] < M) & (offs_j < TOPK)
        tl.store(topk_w_ptr + offs_t[:, None] * TOPK + offs_j, rw, mask=out_ok)
        tl.store(topk_ids_ptr + offs_t[:, None] * TOPK + offs_j, rids, mask=out_ok)
        expert, first, uses, slot, _hit = routed_tokens_of(rids, tl.sum(tl.where(mine, rids, 0)), p, 0, M, E, TOPK,
                                                           TOPK_PAD, BLOCK_T)
    else:
        expert, first, uses, slot, _hit = routed_tokens(topk_ids_ptr, p, 0, M, E, TOPK, TOPK_PAD, BLOCK_T, WINDOW)
    if not first:
        return
    if PF and not PF_LATE:
        _prefetch_expert(pf_ptr, pf_bytes, pfs_ptr, pfs_bytes, expert, PF_LANES, PF_LINE)
    nb = tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    u0, t0, s0 = _user(uses, slot, offs_t, 0)
    u1, t1, s1 = _user(uses, slot, offs_t, 1)
    u2, t2, s2 = _user(uses, slot, offs_t, 2)
    u3, t3, s3 = _user(uses, slot, offs_t, 3)
    rows = nb * BLOCK_R + tl.arange(0, BLOCK_R)  # interleaved: 2i gate, 2i+1 up
    row_ok = rows < 2 * I
    # rows past 2I: read row 2I-1 (TMA: the next expert's rows, or zeros past the matrix), never stored
    w_rows = expert * (2 * I) + tl.minimum(rows, 2 * I - 1)
    row0 = (expert * (2 * I) + nb * BLOCK_R).to(tl.int32)
    G_RANGE: tl.constexpr = K // 32 if SPLIT == 1 else GPS
    split = tl.program_id(2) if SPLIT > 1 else 0  # (a constant 0 unsplit: the K loop starts at 0)
    if NT <= 2:  # the bias before the K loop (no round trip after it) where registers allow (see WS_AHEAD)
        bias = tl.load(bias_ptr + w_rows).to(tl.float32)
    h0, h1, h2, h3 = _stream_rows(w_ptr, w_scale_ptr, a_ptr, a_scale_ptr, w_rows, row_ok, t0, t1, t2, t3,
                                  u1, u2, u3, split * G_RANGE, G_RANGE, K, NT, BLOCK_R, BLOCK_G, PREFETCH, F16X2,
                                  w_desc=w_desc, row0=row0, TMA=TMA, SCALES_AHEAD=SCALES_AHEAD, ACT_LDG=ACT_LDG,
                                  SCALE_LDG=SCALE_LDG)
    if PF and PF_LATE:
        _prefetch_expert(pf_ptr, pf_bytes, pfs_ptr, pfs_bytes, expert, PF_LANES, PF_LINE)
    if SPLIT > 1:
        tile = p * tl.num_programs(1) + nb
        last, h0, h1, h2, h3 = _split_fixup(h0, h1, h2, h3, ws_ptr, cnt_ptr, tile, split, NT, BLOCK_R, SPLIT)
        if not last:
            return
    if NT > 2:
        bias = tl.load(bias_ptr + w_rows).to(tl.float32)
    _fc1_epilogue(h0, u0, t0, s0, bias, nb, out_ptr, out_scale_ptr, I, TOPK, BLOCK_R, ALPHA, LIMIT, HW_FP8)
    if NT > 1:
        _fc1_epilogue(h1, u1, t1, s1, bias, nb, out_ptr, out_scale_ptr, I, TOPK, BLOCK_R, ALPHA, LIMIT, HW_FP8)
    if NT > 2:
        _fc1_epilogue(h2, u2, t2, s2, bias, nb, out_ptr, out_scale_ptr, I, TOPK, BLOCK_R, ALPHA, LIMIT, HW_FP8)
    if NT > 3:
        _fc1_epilogue(h3, u3, t3, s3, bias, nb, out_ptr, out_scale_ptr, I, TOPK, BLOCK_R, ALPHA, LIMIT, HW_FP8)


@triton.jit
def _routing_weight(topk_w_ptr, tok, hit, offs_j, TOPK: tl.constexpr):
    """Token ``tok``'s routing weight for the program's expert: the sum over its slots ``hit`` routed
    there (loaded before the K loop, so the epilogue waits on no memory)."""
    return tl.sum(tl.load(topk_w_ptr + tok * TOPK + offs_j, mask=hit, other=0.0))


@triton.jit
def _fc2_epilogue_inputs(bias_ptr, w_rows, split, topk_w_ptr, hit, offs_t, t0, t1, offs_j, TOPK: tl.constexpr,
                         SPLIT: tl.constexpr):
    """FC2's bias for rows ``w_rows`` (split 0's only with SPLIT > 1) and the routing weights of
    users 0 and 1 (``_routing_weight``)."""
    bias = tl.load(bias_ptr + w_rows).to(tl.float32)
    if SPLIT > 1:
        bias = tl.where(split == 0, bias, 0.0)  # the bias goes into split 0's partial only
    return (bias, _routing_weight(topk_w_ptr, t0, _hit_row(hit, offs_t, t0), offs_j, TOPK),
            _routing_weight(topk_w_ptr, t1, _hit_row(hit, offs_t, t1), offs_j, TOPK))


@triton.jit
def _fc2_epilogue(y, rw, tok, slot, hit, offs_j, part_ptr, rows, row_ok, split, H: tl.constexpr,
                  TOPK: tl.constexpr, SPLIT: tl.constexpr):
    """rw * y into partial row (tok * TOPK + slot) * SPLIT + split (rw: ``_routing_weight``); zeros
    into the token's other slots routed to the same expert (their weights are summed into rw), so
    the combine sums every (slot, split) once."""
    val = y * rw
    for j in tl.static_range(TOPK):
        hit_j = tl.sum(tl.where(offs_j == j, hit.to(tl.int32), 0)) > 0
        v = tl.where(slot == j, val, 0.0)
        tl.store(part_ptr + ((tok.to(tl.int64) * TOPK + j) * SPLIT + split) * H + rows, v, mask=hit_j & row_ok)


@triton.jit
def _hit_row(hit, offs_t, tok):
    """Row ``tok`` of hit [BLOCK_T, TOPK_PAD] as a [TOPK_PAD] bool vector."""
    return tl.sum(tl.where(offs_t[:, None] == tok, hit.to(tl.int32), 0), axis=0) > 0


@triton.jit
def _combine_when_last(part_ptr, out_ptr, cnt_ptr, M, H: tl.constexpr, TOPK_SPLIT: tl.constexpr, NT: tl.constexpr,
                       BLOCK_R: tl.constexpr, nn_r=None, nn_w=None, nn_s_ptr=None, nn_u_ptr=None, nn_ps_ptr=None,
                       NEXT_NORM: tl.constexpr = False, BLOCK_T: tl.constexpr = 1):
    """The combine without its launch: every program of row tile program_id(1) arrives here once
    (after storing its partials; a duplicate slot's program at once). The one that arrives last
    (``_last_to_arrive`` of M * TOPK_SPLIT) sums each token's TOPK_SPLIT partial rows in order from
    zero, exactly as ``_moe_combine_kernel``, into bf16 ``out`` [M, H] (an fp32 ``out``: the sums
    unrounded, a rank's share under TP / EP); with NEXT_NORM (bf16 ``out``) it also
    stores the next layer's carried input norm of those columns (``next_norm_store``; nn_r / nn_w:
    the tile's residual rows [BLOCK_T, BLOCK_R] and norm weight from ``next_norm_inputs``)."""
    tile = tl.program_id(1)
    if _last_to_arrive(cnt_ptr, tile, M * TOPK_SPLIT):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        for t in tl.static_range(NT):
            ok = (rows < H) & (t < M)
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            for j in tl.static_range(TOPK_SPLIT):
                acc += tl.load(part_ptr + (t * TOPK_SPLIT + j) * H + rows, mask=ok, other=0.0, cache_modifier=".cg")
            if NEXT_NORM:  # (bf16 out): the rounded sum stored and carried into the next norm, rounded once
                o = to_bf16_rne(acc)
                tl.store(out_ptr + t * H + rows, o, mask=ok)
                next_norm_store(o.to(tl.float32), row_of(nn_r, t, BLOCK_T), nn_w, t, t < M, tile * BLOCK_R, nn_s_ptr,
                                nn_u_ptr, nn_ps_ptr, H, BLOCK_R)
            else:
                store_rounded(out_ptr + t * H + rows, acc, ok)


@triton.jit
def _nn_inputs(nn_res_ptr, nn_stride, nn_w_ptr, M, H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
               ON: tl.constexpr):
    """NEXT_NORM: the row tile's residual rows and norm weight (``next_norm_inputs``); else zeros."""
    if ON:
        r, w = next_norm_inputs(nn_res_ptr, nn_stride, nn_w_ptr, tl.program_id(1) * BLOCK_R, M, H, BLOCK_T, BLOCK_R)
    else:
        r = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
        w = tl.zeros([BLOCK_R], dtype=tl.float32)
    return r, w


@triton.jit
def _moe_fc2_fma_kernel(
    h_ptr,  # [M * TOPK, I / 4] int32: FC1 output (MXFP8 e4m3) viewed as words, row = token * TOPK + slot
    h_scale_ptr,  # [M * TOPK, I / 32] uint8 e8m0
    w_ptr,  # [E, H, I / 8] int32: e2m1 pairs viewed as words
    w_scale_ptr,  # [E, H, I / 32] uint8 e8m0
    bias_ptr,  # [E, H] bf16
    topk_ids_ptr,  # [M, TOPK] int32
    topk_w_ptr,  # [M, TOPK] fp32
    part_ptr,  # [M * TOPK * SPLIT, H] fp32: w_j * (h_j @ W2[e_j]^T (this split's K range) + b2[e_j] (split 0))
    w_desc,  # TMA > 0: tensor descriptor of w as [E * H, I / 8] int32, block [BLOCK_R, 4 * BLOCK_G]; else None
    out_ptr,  # COMBINE: [M, H] bf16, the block's output (the last program of each row tile sums the partials)
    cnt_ptr,  # COMBINE: [H / BLOCK_R] int32 arrival counters, zero before and after each launch
    M,
    pf_ptr,  # PF: uint8 bytes to prefetch into L2 for a later kernel (the next layer's qkv weight)
    pf_bytes,
    E: tl.constexpr,
    H: tl.constexpr,
    I: tl.constexpr,  # multiple of 64
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    NT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows of H per program, power of two
    BLOCK_G: tl.constexpr,
    SPLIT: tl.constexpr,  # K splits (grid axis 2)
    GPS: tl.constexpr,  # 32-value groups per split: a multiple of BLOCK_G, SPLIT * GPS >= I / 32
    PREFETCH: tl.constexpr,
    F16X2: tl.constexpr,
    PDL: tl.constexpr = False,  # a programmatic dependent of FC1: routing + first weights before the wait
    PDL_TOP: tl.constexpr = False,  # a programmatic dependent that waits first thing ($VLLM_SM121_PDL)
    TMA: tl.constexpr = 0,  # > 0: weight tiles through w_desc in a TMA pipeline of TMA stages (GPU)
    COMBINE: tl.constexpr = False,  # sum the partials into out_ptr here (no combine launch)
    SCALES_AHEAD: tl.constexpr = True,  # TMA: the weight scales one step ahead (_stream_rows; A/B switch)
    ACT_LDG: tl.constexpr = False,  # activations by plain loads, not pipelined ($VLLM_SM121_MOE_ACT_LDG)
    SCALE_LDG: tl.constexpr = False,  # scale bytes one step ahead as int32 ($VLLM_SM121_MOE_SCALE_LDG)
    PF: tl.constexpr = False,  # L2 prefetch of pf_ptr's bytes, shared by every program (kernels/l2_prefetch.py)
    PF_LATE: tl.constexpr = False,  # ... after the program's own weight stream instead of first thing
    PF_LANES: tl.constexpr = 128,
    PF_LINE: tl.constexpr = 128,
    # NEXT_NORM (with COMBINE): the next layer's input norm carried into its qkv GEMV (kernels/next_norm.py)
    nn_res_ptr=None,  # [M, H] bf16 the block's residual, row stride nn_stride
    nn_stride=0,
    nn_w_ptr=None,  # [H] the next layer's input-norm weight
    nn_s_ptr=None,  # [>= M, H] bf16 out: the next residual
    nn_u_ptr=None,  # [>= M, H] bf16 out: bf16(s * w)
    nn_ps_ptr=None,  # [>= M, H / 16] fp32 out: sums of s**2 per 16 columns
    NEXT_NORM: tl.constexpr = False,
    WINDOW: tl.constexpr = 0,  # as FC1's (not with COMBINE, whose last program sums NT tokens)
):
    if PDL_TOP:
        pdl_wait_then_release()
    p = tl.program_id(0)
    if PF and not PF_LATE:
        prefetch_l2_grid(pf_ptr, pf_bytes, PF_LANES, PF_LINE)
    if p >= M * TOPK:  # (a program that exits releases the next launch as a wait would)
        return
    expert, first, uses, slot, hit = routed_tokens(topk_ids_ptr, p, 0, M, E, TOPK, TOPK_PAD, BLOCK_T, WINDOW)
    if not first:
        if PF and PF_LATE:
            prefetch_l2_grid(pf_ptr, pf_bytes, PF_LANES, PF_LINE)
        if COMBINE:  # a duplicate slot still counts itself in on its row tile
            nn_r, nn_w = _nn_inputs(nn_res_ptr, nn_stride, nn_w_ptr, M, H, BLOCK_T, BLOCK_R, NEXT_NORM)
            _combine_when_last(part_ptr, out_ptr, cnt_ptr, M, H, TOPK * SPLIT, NT, BLOCK_R, nn_r, nn_w, nn_s_ptr,
                               nn_u_ptr, nn_ps_ptr, NEXT_NORM, BLOCK_T)
        return
    if SPLIT == 1:
        split = 0
    else:
        split = tl.program_id(2)
    offs_t = tl.arange(0, BLOCK_T)
    offs_j = tl.arange(0, TOPK_PAD)
    _u0, t0, s0 = _user(uses, slot, offs_t, 0)
    u1, t1, s1 = _user(uses, slot, offs_t, 1)
    u2, t2, s2 = _user(uses, slot, offs_t, 2)
    u3, t3, s3 = _user(uses, slot, offs_t, 3)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < H
    w_rows = expert * H + tl.minimum(rows, H - 1)  # rows past H: row H-1 (TMA: the next expert's), never stored
    # The carried norm's residual rows and weight, before the K loop: the combine needs no load after it
    nn_r, nn_w = _nn_inputs(nn_res_ptr, nn_stride, nn_w_ptr, M, H, BLOCK_T, BLOCK_R, NEXT_NORM and COMBINE)
    # The epilogue's bias and routing weights before the K loop (no memory round trip after it) for
    # up to 2 tokens; with more, the registers they hold across the loop spill (sm_90a, TMA tiles).
    if NT <= 2:
        bias, rw0, rw1 = _fc2_epilogue_inputs(bias_ptr, w_rows, split, topk_w_ptr, hit, offs_t, t0, t1, offs_j,
                                              TOPK, SPLIT)
    y0, y1, y2, y3 = _stream_rows(w_ptr, w_scale_ptr, h_ptr, h_scale_ptr, w_rows, row_ok, t0 * TOPK + s0,
                                  t1 * TOPK + s1, t2 * TOPK + s2, t3 * TOPK + s3, u1, u2, u3, split * GPS, GPS,
                                  I, NT, BLOCK_R, BLOCK_G, PREFETCH, F16X2, PDL, w_desc=w_desc,
                                  row0=(expert * H + tl.program_id(1) * BLOCK_R).to(tl.int32), TMA=TMA,
                                  SCALES_AHEAD=SCALES_AHEAD, ACT_LDG=ACT_LDG, SCALE_LDG=SCALE_LDG)
    if PF and PF_LATE:
        prefetch_l2_grid(pf_ptr, pf_bytes, PF_LANES, PF_LINE)
    if NT > 2:
        bias, rw0, rw1 = _fc2_epilogue_inputs(bias_ptr, w_rows, split, topk_w_ptr, hit, offs_t, t0, t1, offs_j,
                                              TOPK, SPLIT)
    _fc2_epilogue(y0 + bias, rw0, t0, s0, _hit_row(hit, offs_t, t0), offs_j, part_ptr, rows, row_ok, split, H, TOPK,
                  SPLIT)
    if NT > 1:
        _fc2_epilogue(y1 + bias, rw1, t1, s1, _hit_row(hit, offs_t, t1), offs_j, part_ptr, rows, row_ok & u1, split,
                      H, TOPK, SPLIT)
    if NT > 2:
        hit2 = _hit_row(hit, offs_t, t2)
        _fc2_epilogue(y2 + bias, _routing_weight(topk_w_ptr, t2, hit2, offs_j, TOPK), t2, s2, hit2, offs_j, part_ptr,
                      rows, row_ok & u2, split, H, TOPK, SPLIT)
    if NT > 3:
        hit3 = _hit_row(hit, offs_t, t3)
        _fc2_epilogue(y3 + bias, _routing_weight(topk_w_ptr, t3, hit3, offs_j, TOPK), t3, s3, hit3, offs_j, part_ptr,
                      rows, row_ok & u3, split, H, TOPK, SPLIT)
    if COMBINE:
        _combine_when_last(part_ptr, out_ptr, cnt_ptr, M, H, TOPK * SPLIT, NT, BLOCK_R, nn_r, nn_w, nn_s_ptr,
                           nn_u_ptr, nn_ps_ptr, NEXT_NORM, BLOCK_T)
