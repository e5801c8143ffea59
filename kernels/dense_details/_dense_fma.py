"""Triton code for the CUDA-core (FMA) decode GEMV of the FP8-weight dense linear, M <= 4 tokens
(launcher and reference: ``kernels/dense.py``: ``dense_fp8_linear(path="fma")``).

``_dense_fp8_fma_kernel``: out[NT, N] = x[NT, K] @ (W_e4m3[N, K] * scale[N, None])^T (+ bias[N]),
NT = 1..4 tokens (constexpr, one compiled variant per token count). No ``tl.dot``: at M <= 4
padding the tokens to an MMA N of 16 buys nothing, the cost is streaming the weight bytes.

* Program = BLOCK_R weight rows, streamed once along K as int32 words: a [BLOCK_R, BLOCK_KW]
  tile per step, contiguous along K, which Triton lays out as 16-byte vectors per thread (4 words
  = 16 e4m3 values); the thread's other vectors are other rows at the same K, so the activations
  it loads serve all of them. K is a multiple of 16, so the K tail is masked per whole vector.
* Decode: byte J of a word w is ``((w << (24 - 8J)) >> 4) & 0x87F00000`` (arithmetic shift: the
  sign lands in bit 31, the 4 exponent + 3 mantissa bits in fp32 bits 26..20) bitcast to fp32 =
  e4m3 * 2**-120, exact, e4m3 denormals become fp32 denormals (the PTX has no .ftz:
  ``tests/test_dense.py`` checks the sm_121a build). e4m3 NaN codes (0x7F / 0xFF) are not
  special: ``fp8_per_channel_quantize`` never writes them.
* Activations: each token row is read as int64 words, 4 bf16 each = the activations of one
  weight word (the thread's 4 words: two 16-byte loads per token; bf16 -> fp32 is a shift / mask
  of the right 16 bits into the top half of an int32, exact) and pre-scaled by 2**X_EXP (exact), so the products
  (e4m3 * 2**-120) * (x * 2**X_EXP) stay normal fp32 for |x| down to ~2**-60 and cannot
  overflow for any |x| < 2**(128 - X_EXP) (see X_EXP).
* Tokens: one accumulator each, updated from the same decoded weight tile (weights read and
  decoded once per step whatever NT). Per step each word's 4 products are summed (FMA chain),
  then the 4 words of a vector (all in one thread, no shuffle), into a [BLOCK_R, BLOCK_KW / 4]
  fp32 accumulator per token; ``tl.sum`` over K once at the end.
* Epilogue: (sum * 2**(120 - X_EXP)) * scale (two multiplies: scale * 2**56 alone could
  overflow for large rows) + bias, one bf16 rounding (``to_bf16_rne``; an fp32 ``out`` gets the
  unrounded value: a row-parallel shard's partial under TP).

Everything is plain loads, integer / fp32 arithmetic and ``tl.sum``: no MMA, no cp.async,
nothing sm_90-only.
"""

import triton
import triton.language as tl

from .._sync import last_to_arrive
from ..moe_details._mx import pdl_wait_then_release
from ..fp4_kv_details._fp4_kv import nvfp4_store_slot
from ..kv_cache_details._codecs import e4m3_word_byte, store_rounded, to_bf16_rne
from ..norm_mxfp8_details._next_norm import inv_rms, load_rows, load_sums, store_rows

BF16_HI_MASK = tl.constexpr(-65536)  # 0xFFFF0000 as int32
# Activations are multiplied by 2**X_EXP before the products (exact): the decoded weights carry
# 2**-120, so products of small codes and small activations would otherwise be fp32 denormals
# (lost bits) for |x| below ~2**-10. With 64, |x| < 2**64 is safe (bf16 activations of a
# transformer are many orders of magnitude below) and the sums cannot overflow (2**-56 * K * 448 *
# |x|max).
X_EXP = 64
X_SCALE = tl.constexpr(2.0**X_EXP)
OUT_SCALE = tl.constexpr(2.0**(120 - X_EXP))


def _launch_metadata(grid, kernel, args):
    m, n, k = args["NT"], args["N"], args["K"]
    return {"name": f"{kernel.name} [M={m}, N={n}, K={k}]", "flops": 2 * m * n * k,
            "bytes": n * k + 4 * n + 2 * m * k + 2 * m * n}


@triton.jit
def _token_dot(w0, w1, w2, w3, x_row, offs_w, w_ok, BLOCK_R: tl.constexpr, BLOCK_KW: tl.constexpr,
               X_ROWS: tl.constexpr = False):
    """One token's contribution of a decoded weight tile: [BLOCK_R, BLOCK_KW // 4] fp32 (units of
    2**(X_EXP - 120)). w0..w3: bytes 0..3 of the words [BLOCK_R, BLOCK_KW]; x_row: the token's
    activations as int64 words (4 bf16 each: the 4 activations of one weight word); offs_w: the
    tile's word indices along K ([BLOCK_KW], or with X_ROWS [BLOCK_R, BLOCK_KW] in the weight
    tile's own layout: each thread loads the activations of its own weight words, so no layout
    conversion through shared memory is needed; see ``_dense_fp8_fma_kernel``'s X_ROWS)."""
    xv = tl.load(x_row + offs_w, mask=w_ok, other=0)  # x[4c .. 4c + 3], lowest bits first
    x0 = (xv << 16).to(tl.int32).to(tl.float32, bitcast=True) * X_SCALE
    x1 = (xv.to(tl.int32) & BF16_HI_MASK).to(tl.float32, bitcast=True) * X_SCALE
    x2 = ((xv >> 16).to(tl.int32) & BF16_HI_MASK).to(tl.float32, bitcast=True) * X_SCALE
    x3 = ((xv >> 32).to(tl.int32) & BF16_HI_MASK).to(tl.float32, bitcast=True) * X_SCALE
    if X_ROWS:
        s = w0 * x0
        s += w1 * x1
        s += w2 * x2
        s += w3 * x3
    else:
        s = w0 * x0[None, :]
        s += w1 * x1[None, :]
        s += w2 * x2[None, :]
        s += w3 * x3[None, :]
    return tl.sum(tl.reshape(s, [BLOCK_R, BLOCK_KW // 4, 4]), axis=2)


@triton.jit
def _k_step(w, k0, offs_c, x_ptr, stride_xm, acc0, acc1, acc2, acc3, KW: tl.constexpr, NT: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_KW: tl.constexpr, X_ROWS: tl.constexpr = False):
    """One K step: the loaded weight words ``w`` [BLOCK_R, BLOCK_KW] at word ``k0``, decoded once, times
    each of the NT tokens' activations, into their accumulators. ``offs_c``: [BLOCK_KW] word offsets,
    or with X_ROWS the same broadcast to the tile's [BLOCK_R, BLOCK_KW]."""
    offs_w = k0 + offs_c
    w_ok = offs_w < KW
    w0 = e4m3_word_byte(w, 0)
    w1 = e4m3_word_byte(w, 1)
    w2 = e4m3_word_byte(w, 2)
    w3 = e4m3_word_byte(w, 3)
    acc0 += _token_dot(w0, w1, w2, w3, x_ptr, offs_w, w_ok, BLOCK_R, BLOCK_KW, X_ROWS)
    if NT > 1:
        acc1 += _token_dot(w0, w1, w2, w3, x_ptr + stride_xm, offs_w, w_ok, BLOCK_R, BLOCK_KW, X_ROWS)
    if NT > 2:
        acc2 += _token_dot(w0, w1, w2, w3, x_ptr + 2 * stride_xm, offs_w, w_ok, BLOCK_R, BLOCK_KW, X_ROWS)
    if NT > 3:
        acc3 += _token_dot(w0, w1, w2, w3, x_ptr + 3 * stride_xm, offs_w, w_ok, BLOCK_R, BLOCK_KW, X_ROWS)
    return acc0, acc1, acc2, acc3


@triton.jit
def _rope_rows(b, ROPE_ROWS: tl.constexpr, HEAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program ``b``'s output rows and, per row, its rotary index (-1: no rotation) and sign. The
    first ROPE_ROWS rows (q and k heads of HEAD features, NeoX halves) go to programs as pairs of
    runs: P = BLOCK_R / 2 features j0 .. j0 + P - 1 of one head's first half, then the same of its
    second half, so each program holds both rows every rotated output needs; the rows after
    ROPE_ROWS (v) are contiguous runs as without rotation."""
    P: tl.constexpr = BLOCK_R // 2
    HALF: tl.constexpr = HEAD // 2
    r = tl.arange(0, BLOCK_R)
    rope = b * BLOCK_R < ROPE_ROWS
    j = (b % (HALF // P)) * P + r % P  # rotary index of row r in a rotary program
    rot_rows = (b // (HALF // P)) * HEAD + (r // P) * HALF + j
    rows = tl.where(rope, rot_rows, b * BLOCK_R + r)
    return rows, tl.where(rope, j, -1), tl.where(r < P, -1.0, 1.0)


@triton.jit
def _rope_factors(pos_ptr, cs_ptr, stride_cs, t, j, sign, HEAD: tl.constexpr):
    """Token t's (cos, signed sin) per row (1 and 0 for rows j < 0), bf16-rounded as upstream's
    RotaryEmbedding uses its cache in the activations' dtype."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    ok = j >= 0
    c = tl.load(cs_ptr + pos * stride_cs + j, mask=ok, other=1.0).to(tl.float32)
    sn = tl.load(cs_ptr + pos * stride_cs + HEAD // 2 + j, mask=ok, other=0.0).to(tl.float32)
    return to_bf16_rne(c).to(tl.float32), to_bf16_rne(sn).to(tl.float32) * sign


@triton.jit
def _rope_factors_nt(pos_ptr, cs_ptr, stride_cs, j, sign, unused, HEAD: tl.constexpr, NT: tl.constexpr):
    """``_rope_factors`` of tokens 0..NT-1: (c0, c1, c2, c3, sn0, sn1, sn2, sn3), ``unused`` past NT."""
    c0, sn0 = _rope_factors(pos_ptr, cs_ptr, stride_cs, 0, j, sign, HEAD)
    c1, c2, c3, sn1, sn2, sn3 = unused, unused, unused, unused, unused, unused
    if NT > 1:
        c1, sn1 = _rope_factors(pos_ptr, cs_ptr, stride_cs, 1, j, sign, HEAD)
    if NT > 2:
        c2, sn2 = _rope_factors(pos_ptr, cs_ptr, stride_cs, 2, j, sign, HEAD)
    if NT > 3:
        c3, sn3 = _rope_factors(pos_ptr, cs_ptr, stride_cs, 3, j, sign, HEAD)
    return c0, c1, c2, c3, sn0, sn1, sn2, sn3


@triton.jit
def _swap_halves(y, BLOCK_R: tl.constexpr):
    """y [BLOCK_R] with its two halves exchanged (each row's rotation partner)."""
    a, b = tl.split(tl.trans(tl.reshape(y, [2, BLOCK_R // 2])))
    return tl.reshape(tl.trans(tl.join(b, a)), [BLOCK_R])


@triton.jit
def _rotate(y, toks, tok_ok, rot_j, rot_sign, pos_ptr, cs_ptr, stride_cs, HEAD: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_M: tl.constexpr):
    """y [BLOCK_N rows, BLOCK_M tokens] fp32 -> the NeoX rotation of its rows with rot_j >= 0 (others
    unchanged, as bf16). Partners: the other half of the program's rows (BLOCK_N <= HEAD, pairs of
    runs) or of each whole head (BLOCK_N > HEAD)."""
    pos = tl.load(pos_ptr + toks, mask=tok_ok, other=0).to(tl.int64)
    rot = rot_j >= 0
    ok = rot[:, None] & tok_ok[None, :]
    c_ptr = cs_ptr + pos[None, :] * stride_cs + rot_j[:, None]
    c = to_bf16_rne(tl.load(c_ptr, mask=ok, other=1.0).to(tl.float32)).to(tl.float32)
    sn = to_bf16_rne(tl.load(c_ptr + HEAD // 2, mask=ok, other=0.0).to(tl.float32)).to(tl.float32)
    y = to_bf16_rne(y).to(tl.float32)
    if BLOCK_N <= HEAD:
        swapped = tl.reshape(_swap_halves(tl.reshape(y, [BLOCK_N * BLOCK_M]), BLOCK_N * BLOCK_M), [BLOCK_N, BLOCK_M])
    else:
        h = tl.permute(tl.reshape(y, [BLOCK_N // HEAD, 2, HEAD // 2, BLOCK_M]), (0, 2, 3, 1))
        first, second = tl.split(h)
        swapped = tl.reshape(tl.permute(tl.join(second, first), (0, 3, 1, 2)), [BLOCK_N, BLOCK_M])
    return tl.where(rot[:, None], y * c + swapped * (sn * rot_sign[:, None]), y)


@triton.jit
def _epilogue(acc, scale, bias, out_ptr, t, stride_om, rows, row_ok, HAS_BIAS: tl.constexpr, c=None, sn=None,
              ROPE: tl.constexpr = False, BLOCK_R: tl.constexpr = 1):
    y = (tl.sum(acc, axis=1) * OUT_SCALE) * scale
    if HAS_BIAS:
        y += bias
    if ROPE:  # NeoX rotation of the bf16 projection (as upstream rotates the linear's bf16 output)
        y = to_bf16_rne(y).to(tl.float32)
        y = y * c + _swap_halves(y, BLOCK_R) * sn
    store_rounded(out_ptr + t * stride_om + rows, y, row_ok)


@triton.jit
def _kv_head_to_nvfp4(out_ptr, stride_om, head_idx, slot_ptr, k_data_ptr, k_scale_ptr, v_data_ptr, v_scale_ptr,
                      k_g_ptr, v_g_ptr, stride_kd_b, stride_ks_b, stride_vd_b, stride_vs_b, NT: tl.constexpr,
                      Q_ROWS: tl.constexpr, HEAD: tl.constexpr, KV_HEADS: tl.constexpr, KV_BLOCK: tl.constexpr):
    """Writes K or V head ``head_idx`` (K heads 0..KV_HEADS-1, then the V heads) of the NT tokens'
    finished projection rows to their NVFP4 page slots, as ``_fp4_kv_write_kernel`` does (the same
    bytes): run by the program that stored the head's last rows (``last_to_arrive``)."""
    offs_d = tl.arange(0, HEAD)
    if head_idx < KV_HEADS:
        h, d_ptr, s_ptr, g_ptr, sdb, ssb = head_idx, k_data_ptr, k_scale_ptr, k_g_ptr, stride_kd_b, stride_ks_b
    else:
        h, d_ptr, s_ptr, g_ptr, sdb, ssb = head_idx - KV_HEADS, v_data_ptr, v_scale_ptr, v_g_ptr, stride_vd_b, stride_vs_b
    g = tl.load(g_ptr)
    for t in tl.static_range(NT):
        slot = tl.load(slot_ptr + t).to(tl.int64)
        x = tl.load(out_ptr + t * stride_om + Q_ROWS + head_idx * HEAD + offs_d, cache_modifier=".cg")
        nvfp4_store_slot(tl.reshape(x.to(tl.float32), [1, HEAD]), g, slot, h, d_ptr, s_ptr, sdb, ssb, 1, HEAD,
                         KV_BLOCK)  # a padded token (slot -1) stores nothing


@triton.jit
def _norm_sums(ps_ptr, unused, K: tl.constexpr, NT: tl.constexpr, NP_PAD: tl.constexpr):
    """NORM: tokens 0..NT-1's partial sums of squares (``unused`` past NT), loaded before the K loop."""
    p0 = load_sums(ps_ptr, 0, K, NP_PAD)
    p1, p2, p3 = unused, unused, unused
    if NT > 1:
        p1 = load_sums(ps_ptr, 1, K, NP_PAD)
    if NT > 2:
        p2 = load_sums(ps_ptr, 2, K, NP_PAD)
    if NT > 3:
        p3 = load_sums(ps_ptr, 3, K, NP_PAD)
    return p0, p1, p2, p3


@triton.jit
def _norm_scales(p0, p1, p2, p3, eps, scale, K: tl.constexpr, NT: tl.constexpr):
    """NORM: the epilogue scale of tokens 0..NT-1 (``scale`` past NT): ``scale`` times the token's
    1 / rms from its partial sums (after the K loop)."""
    s0 = scale * inv_rms(p0, eps, K)
    s1, s2, s3 = scale, scale, scale
    if NT > 1:
        s1 = scale * inv_rms(p1, eps, K)
    if NT > 2:
        s2 = scale * inv_rms(p2, eps, K)
    if NT > 3:
        s3 = scale * inv_rms(p3, eps, K)
    return s0, s1, s2, s3


@triton.jit(launch_metadata=_launch_metadata)
def _dense_fp8_fma_kernel(
    x_ptr,  # [NT, K / 4] int64: bf16 activations viewed as 8-byte words, row stride stride_xm (words)
    w_ptr,  # [N, K / 4] int32: e4m3 weight codes viewed as words, contiguous
    scale_ptr,  # [N] fp32 per-output-channel dequantization scales
    bias_ptr,  # [N] bf16 or fp32 (HAS_BIAS only)
    out_ptr,  # [NT, N] bf16, row stride stride_om
    N,
    stride_xm: tl.int64,
    stride_om: tl.int64,
    K: tl.constexpr,  # multiple of 16
    NT: tl.constexpr,  # tokens: 1..4 (= M)
    BLOCK_R: tl.constexpr,  # weight rows per program, power of two
    BLOCK_KW: tl.constexpr,  # int32 words (4 bytes) of each row per K step, power of two >= 4
    HAS_BIAS: tl.constexpr,
    pos_ptr=None,  # ROPE: [NT] int64 token positions
    cs_ptr=None,  # ROPE: [max_position, HEAD] rotary cache, cos (HEAD / 2) then sin (HEAD / 2) per position
    stride_cs=0,
    ROPE: tl.constexpr = False,  # NeoX rotary embedding of the first ROPE_ROWS outputs in the epilogue
    ROPE_ROWS: tl.constexpr = 0,  # multiple of HEAD and BLOCK_R; HEAD / 2 a multiple of BLOCK_R / 2
    HEAD: tl.constexpr = 64,
    # KV_WRITE (with ROPE; opt-in, kernels/dense.py): the K and V heads (rows Q_ROWS .. +2 * KV_HEADS * HEAD)
    # also go to NVFP4 KV pages, written by each head's last program to finish (arrival counters)
    slot_ptr=None,  # [>= NT] int64 slots (< 0: skip)
    k_data_ptr=None,
    k_scale_ptr=None,
    v_data_ptr=None,
    v_scale_ptr=None,
    k_g_ptr=None,  # [1] fp32 global scales
    v_g_ptr=None,
    cnt_ptr=None,  # [>= 2 * KV_HEADS] int32 arrival counters, zero before and after each launch
    stride_kd_b=0,
    stride_ks_b=0,
    stride_vd_b=0,
    stride_vs_b=0,
    KV_WRITE: tl.constexpr = False,
    Q_ROWS: tl.constexpr = 0,
    KV_HEADS: tl.constexpr = 1,
    KV_BLOCK: tl.constexpr = 16,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (opt-in, kernels/dense.py)
    # NORM: the activations are the carried input norm's u = bf16(s * w) (kernels/next_norm.py); each token's
    # sums are multiplied by 1 / sqrt(sum(psum[t]) / K + eps), and s is copied to res_out (the next residual)
    ps_ptr=None,  # [>= NT, K / 16] fp32 sums of s**2 per 16 columns
    norm_eps=0.0,
    s_src_ptr=None,  # [>= NT, K] bf16: s
    res_out_ptr=None,  # [NT, K] bf16 out, row stride stride_res_out
    stride_res_out=0,
    NORM: tl.constexpr = False,
    NP_PAD: tl.constexpr = 1,  # next power of two >= K / 16
    COPY_BLOCK: tl.constexpr = 16,  # columns of s each of the first cdiv(K, COPY_BLOCK) programs copies
    # The activation words loaded as a [BLOCK_R, BLOCK_KW] tile in the weight tile's layout (each thread
    # the words its own weight words need) instead of one [BLOCK_KW] row broadcast over the rows. The
    # launcher sets it where a K step spans >= 32 words per warp (``fma_x_rows``; the one-token
    # 8,256,8): Triton 3.6 otherwise loads the row one word per thread and converts it to the tile's
    # layout through shared memory, 2 CTA barriers per activation vector and token in every K step
    # (sm_90a SASS of 8,256,8: 8 BAR.SYNC per K step). A thread holding several rows loads the same
    # words once per row (L1 hits). Same values, same sums.
    X_ROWS: tl.constexpr = False,
):
    KW: tl.constexpr = K // 4
    BLOCK_T: tl.constexpr = 1 if NT == 1 else (2 if NT == 2 else 4)
    if ROPE:
        rows, rot_j, rot_sign = _rope_rows(tl.program_id(0), ROPE_ROWS, HEAD, BLOCK_R)
    else:
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    # Rows past N read row N-1 (never stored): the weight loads need no row mask.
    w_base = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * KW
    offs_c = tl.arange(0, BLOCK_KW)
    if X_ROWS:
        offs_x = tl.broadcast_to(offs_c[None, :], (BLOCK_R, BLOCK_KW))
    else:
        offs_x = offs_c
    acc0 = tl.zeros([BLOCK_R, BLOCK_KW // 4], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_R, BLOCK_KW // 4], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_KW // 4], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_R, BLOCK_KW // 4], dtype=tl.float32)
    # The epilogue's scale and bias are loaded before the K loop, with the first weights: loaded
    # after it, they cost one more memory round trip at the end of every program.
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    else:
        bias = scale
    c0, c1, c2, c3, sn0, sn1, sn2, sn3 = scale, scale, scale, scale, scale, scale, scale, scale  # (unused without ROPE)
    if ROPE and not PDL:  # the rotation factors too, before the loop (positions, then the cache: off the weights' path)
        c0, c1, c2, c3, sn0, sn1, sn2, sn3 = _rope_factors_nt(pos_ptr, cs_ptr, stride_cs, rot_j, rot_sign, scale,
                                                              HEAD, NT)
    s0, s1, s2, s3 = scale, scale, scale, scale  # each token's epilogue scale (NORM: times its 1 / rms)
    # NORM: the sums of squares and this program's share of the residual copy are loaded here and
    # used after the K loop (no memory round trip before the loop's first loads or at its end)
    ps0, ps1, ps2, ps3, res_cp = scale, scale, scale, scale, scale
    if NORM and not PDL:
        ps0, ps1, ps2, ps3 = _norm_sums(ps_ptr, scale, K, NT, NP_PAD)
        res_cp = load_rows(s_src_ptr, NT, BLOCK_T, K, COPY_BLOCK)
    k_start = 0
    if PDL:  # the first K step's weights are in flight before the wait for the activations' producer
        w = tl.load(w_base + offs_c[None, :], mask=(offs_c < KW)[None, :], other=0)
        pdl_wait_then_release()
        if ROPE:  # positions: written by an earlier kernel, read after the wait
            c0, c1, c2, c3, sn0, sn1, sn2, sn3 = _rope_factors_nt(pos_ptr, cs_ptr, stride_cs, rot_j, rot_sign, scale,
                                                                  HEAD, NT)
        if NORM:
            ps0, ps1, ps2, ps3 = _norm_sums(ps_ptr, scale, K, NT, NP_PAD)
            res_cp = load_rows(s_src_ptr, NT, BLOCK_T, K, COPY_BLOCK)
        acc0, acc1, acc2, acc3 = _k_step(w, 0, offs_x, x_ptr, stride_xm, acc0, acc1, acc2, acc3, KW, NT, BLOCK_R,
                                         BLOCK_KW, X_ROWS)
        k_start = BLOCK_KW
    for k0 in range(k_start, KW, BLOCK_KW):
        offs_w = k0 + offs_c
        w = tl.load(w_base + offs_w[None, :], mask=(offs_w < KW)[None, :], other=0)
        acc0, acc1, acc2, acc3 = _k_step(w, k0, offs_x, x_ptr, stride_xm, acc0, acc1, acc2, acc3, KW, NT, BLOCK_R,
                                         BLOCK_KW, X_ROWS)
    if NORM:
        s0, s1, s2, s3 = _norm_scales(ps0, ps1, ps2, ps3, norm_eps, scale, K, NT)
    _epilogue(acc0, s0, bias, out_ptr, 0, stride_om, rows, row_ok, HAS_BIAS, c0, sn0, ROPE, BLOCK_R)
    if NT > 1:
        _epilogue(acc1, s1, bias, out_ptr, 1, stride_om, rows, row_ok, HAS_BIAS, c1, sn1, ROPE, BLOCK_R)
    if NT > 2:
        _epilogue(acc2, s2, bias, out_ptr, 2, stride_om, rows, row_ok, HAS_BIAS, c2, sn2, ROPE, BLOCK_R)
    if NT > 3:
        _epilogue(acc3, s3, bias, out_ptr, 3, stride_om, rows, row_ok, HAS_BIAS, c3, sn3, ROPE, BLOCK_R)
    if NORM:  # the next residual, by the first programs (loaded before the loop)
        store_rows(res_cp, res_out_ptr, stride_res_out, NT, BLOCK_T, K, COPY_BLOCK)
    if KV_WRITE:  # a program's rows lie inside one head (HEAD is a multiple of BLOCK_R)
        head_idx = tl.program_id(0) * BLOCK_R // HEAD - Q_ROWS // HEAD
        if (head_idx >= 0) & (head_idx < 2 * KV_HEADS):
            if last_to_arrive(cnt_ptr, head_idx, HEAD // BLOCK_R):
                _kv_head_to_nvfp4(out_ptr, stride_om, head_idx, slot_ptr, k_data_ptr, k_scale_ptr, v_data_ptr,
                                  v_scale_ptr, k_g_ptr, v_g_ptr, stride_kd_b, stride_ks_b, stride_vd_b, stride_vs_b,
                                  NT, Q_ROWS, HEAD, KV_HEADS, KV_BLOCK)
