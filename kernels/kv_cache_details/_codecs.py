"""Software float codecs in Triton (bit-exact, round-to-nearest-even, saturating).

Used where hardware conversion is unavailable or unreliable: Triton's CPU interpreter rounds
fp32 -> e4m3 wrongly near powers of two (31.2 -> 16), and the nvfp4 KV cache (a later issue)
needs e4m3 block scales and e2m1 codes packed by hand. The GPU path of the KV write uses the
hardware ``cvt.rn.satfinite`` conversion; tests check both against ``torch``.
"""

import triton
import triton.language as tl


E4M3_WORD_MASK = tl.constexpr(-2014314496)  # 0x87F00000 as int32: sign bit + fp32 bits 26..20


@triton.jit
def e4m3_word_byte(w, J: tl.constexpr):
    """Byte J (0 = lowest) of int32 words -> fp32 e4m3 value * 2**-120, exact: ``((w << (24 - 8J))
    >> 4) & 0x87F00000`` (arithmetic shift: the sign lands in bit 31, the 4 exponent + 3 mantissa
    bits in fp32 bits 26..20) bitcast to fp32; e4m3 denormals become fp32 denormals (kept: no
    .ftz), NaN codes are not special. Three integer ops, no conversion instruction (the FMA GEMVs
    of the dense and MoE kernels)."""
    if J == 3:
        v = w >> 4
    else:
        v = (w << (24 - 8 * J)) >> 4
    return (v & E4M3_WORD_MASK).to(tl.float32, bitcast=True)


@triton.jit
def _pow2(k):
    """2**k as fp32 for integer k in [-126, 127] (exact)."""
    return ((k + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_half_even(y):
    """Round fp32 ``y >= 0`` (< 2**23) to the nearest integer, ties to even."""
    f = tl.floor(y)
    r = y - f
    odd = (f.to(tl.int32) % 2) == 1
    return f + tl.where((r > 0.5) | ((r == 0.5) & odd), 1.0, 0.0)


@triton.jit
def e4m3_encode(x):
    """fp32 -> float8_e4m3fn byte (uint8): RNE, saturating to +-448, NaN -> 0x7F."""
    is_nan = x != x
    a = tl.minimum(tl.abs(x), 448.0)
    neg = (x.to(tl.uint32, bitcast=True) >> 31) == 1  # keeps the sign of -0.0
    # Normal range: a = 2**e * q / 8 with q in [8, 16).
    e = ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    e = tl.maximum(e, -6)  # below 2**-6 the code is subnormal: fixed exponent, step 2**-9
    q = _round_half_even(a * _pow2(3 - e))
    carry = q >= 16.0
    e = tl.where(carry, e + 1, e)
    q = tl.where(carry, 8.0, q)
    qi = q.to(tl.int32)
    normal = qi >= 8
    code = tl.where(normal, ((e + 7) << 3) | (qi - 8), qi)
    code = tl.where(neg, code | 0x80, code)
    code = tl.where(is_nan, 0x7F, code)
    return code.to(tl.uint8)


@triton.jit
def e2m1_encode(x):
    """fp32 (already divided by its scale) -> e2m1 nibble (uint8 0..15): RNE, saturating to +-6.

    Magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} are codes 0..7; bit 3 is the sign. Ties go to the
    even code: .25->0, .75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4.
    """
    a = tl.abs(x)
    neg = (x.to(tl.uint32, bitcast=True) >> 31) == 1
    code = tl.where(a > 0.25, 1, 0)
    code = tl.where(a >= 0.75, 2, code)
    code = tl.where(a > 1.25, 3, code)
    code = tl.where(a >= 1.75, 4, code)
    code = tl.where(a > 2.5, 5, code)
    code = tl.where(a >= 3.5, 6, code)
    code = tl.where(a > 5.0, 7, code)
    code = tl.where(neg & (code > 0), code | 8, code)
    return code.to(tl.uint8)


@triton.jit
def e2m1_decode(code):
    """e2m1 nibble (any int, low 4 bits) -> fp32."""
    c = code.to(tl.int32) & 0xF
    mag = c & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    # subnormal (e == 0): m * 0.5; normal: (1 + m/2) * 2**(e-1)
    val = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * _pow2(e - 1))
    return tl.where((c & 8) != 0, -val, val)


@triton.jit
def nvfp4_quantize_rows(x, g, ROWS: tl.constexpr, NUM_BLOCKS: tl.constexpr):
    """x [ROWS, NUM_BLOCKS*16] fp32 -> (packed [ROWS, NUM_BLOCKS*8] uint8, scale codes [ROWS, NUM_BLOCKS] uint8)."""
    xb = tl.reshape(x, [ROWS, NUM_BLOCKS, 16])
    amax = tl.max(tl.abs(xb), axis=2)
    s_code = e4m3_encode(tl.math.div_rn(amax, 6.0 * g))
    denom = s_code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * g
    safe = tl.where(denom > 0.0, denom, 1.0)
    q = tl.where(denom[:, :, None] > 0.0, tl.math.div_rn(xb, safe[:, :, None]), 0.0)
    codes = e2m1_encode(q).to(tl.int32)
    lo, hi = tl.split(tl.reshape(codes, [ROWS, NUM_BLOCKS * 8, 2]))
    return (lo | (hi << 4)).to(tl.uint8), s_code


@triton.jit
def nvfp4_dequantize_rows(packed, s_codes, NUM_ROWS: tl.constexpr, HEAD: tl.constexpr):
    """packed [NUM_ROWS, HEAD/2] uint8 + scale codes [NUM_ROWS, HEAD/16] -> [NUM_ROWS, HEAD] fp32 (no global scale)."""
    p = packed.to(tl.int32)
    vals = tl.reshape(tl.join(e2m1_decode(p), e2m1_decode(p >> 4)), [NUM_ROWS, HEAD // 16, 16])
    s = s_codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.reshape(vals * s[:, :, None], [NUM_ROWS, HEAD])


@triton.jit
def mxfp8_quantize_rows(y, ROWS: tl.constexpr, NUM_BLOCKS: tl.constexpr):
    """y [ROWS, NUM_BLOCKS*32] fp32 -> (e4m3 bytes [ROWS, NUM_BLOCKS*32] uint8, e8m0 bytes [ROWS, NUM_BLOCKS]).

    MXFP8 (OCP MX): one power-of-two scale per 32 elements, the smallest 2**e with
    amax <= 448 * 2**e (so nothing saturates); all-zero blocks get byte 0 (2**-127) and zeros.
    """
    ys, e = mxfp8_block_scale(y, ROWS, NUM_BLOCKS)
    codes = e4m3_encode(ys)
    return tl.reshape(codes, [ROWS, NUM_BLOCKS * 32]), (e + 127).to(tl.uint8)


@triton.jit
def mxfp8_block_scale(y, ROWS: tl.constexpr, NUM_BLOCKS: tl.constexpr):
    """MXFP8's scale step: y [ROWS, NUM_BLOCKS*32] fp32 -> (y / 2**e as [ROWS, NUM_BLOCKS, 32],
    e [ROWS, NUM_BLOCKS] int32), e the smallest exponent with amax <= 448 * 2**e (-127 for an
    all-zero block). The caller rounds the scaled values to e4m3 (software or hardware)."""
    yb = tl.reshape(y, [ROWS, NUM_BLOCKS, 32])
    amax = tl.max(tl.abs(yb), axis=2)
    k = ((amax.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127  # floor(log2(amax))
    e = tl.where(amax > 1.75 * _pow2(tl.maximum(k, -126)), k - 7, k - 8)  # 448 * 2**(k-8) = 1.75 * 2**k
    e = tl.where(amax > 0.0, tl.minimum(tl.maximum(e, -127), 127), -127)
    inv = _pow2(tl.minimum(-e, 127))  # exact: a power of two
    return yb * inv[:, :, None], e


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even, in integer ops (finite inputs).

    Triton's CPU interpreter truncates fp32 -> bf16; doing the rounding here makes the interpreter
    and the GPU (where this is a few integer ops next to a memory-bound load) give the same bits.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def store_rounded(ptr, y, mask=None):
    """Store fp32 ``y`` at ``ptr``: rounded to bf16 (``to_bf16_rne``) for a bf16 tensor, as is for an
    fp32 one (a rank's partial sum under tensor parallelism, rounded once after the all-reduce)."""
    if ptr.dtype.element_ty == tl.float32:
        tl.store(ptr, y, mask=mask)
    else:
        tl.store(ptr, to_bf16_rne(y), mask=mask)
