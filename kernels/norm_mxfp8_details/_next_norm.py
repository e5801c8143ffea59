"""Triton code of the next layer's input norm carried from FC2's combine into the qkv GEMV
(``kernels/next_norm.py`` says what is carried and why).

``next_norm_store``: run where a block output's bf16 row chunk is finished (FC2's combine): adds
the block's residual, stores the next residual ``s``, ``u = bf16(s * w)`` (w: the next layer's
input-norm weight) and the chunk's sums of ``s**2`` per CHUNK columns. ``inv_rms``: a token's
``1 / sqrt(mean(s**2) + eps)`` from those sums (a fixed order: deterministic). ``copy_rows``: the
next residual into the qkv op's own output tensor, by the first programs of the GEMV. Plain loads,
stores and fp32 arithmetic: nothing architecture-specific.
"""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import to_bf16_rne

CHUNK = tl.constexpr(16)  # columns per partial sum of squares (kernels/next_norm.py: NEXT_NORM_CHUNK)


@triton.jit
def next_norm_store(o, t, t_ok, col0, res_ptr, stride_res, w_ptr, s_ptr, u_ptr, ps_ptr, H: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Token ``t``'s finished block output ``o`` (fp32 [BLOCK] holding bf16 values) at columns
    col0 .. col0 + BLOCK - 1 (col0 a multiple of CHUNK): s = bf16(o + residual) -> s_ptr, bf16(s * w)
    -> u_ptr (rows of H), sum(s**2) per CHUNK columns -> ps_ptr (rows of H / CHUNK). Masked by
    ``t_ok`` and the columns' range."""
    cols = col0 + tl.arange(0, BLOCK)
    ok = (cols < H) & t_ok
    r = tl.load(res_ptr + t * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
    s = to_bf16_rne(o + r).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(s_ptr + t * H + cols, s.to(tl.bfloat16), mask=ok)
    tl.store(u_ptr + t * H + cols, to_bf16_rne(s * w), mask=ok)  # bf16 x bf16: exact in fp32, rounded once
    sq = tl.sum(tl.reshape(tl.where(ok, s * s, 0.0), [BLOCK // CHUNK, CHUNK]), axis=1)
    chunk = col0 // CHUNK + tl.arange(0, BLOCK // CHUNK)
    tl.store(ps_ptr + t * (H // CHUNK) + chunk, sq, mask=(chunk < H // CHUNK) & t_ok)


@triton.jit
def inv_rms(ps_ptr, t, eps, H: tl.constexpr, NP_PAD: tl.constexpr):
    """1 / sqrt(mean(s**2) + eps) of token ``t`` from its H / CHUNK partial sums (scalar fp32), the
    arithmetic of the plugin's norm kernels (``_add_rmsnorm_row``)."""
    offs = tl.arange(0, NP_PAD)
    p = tl.load(ps_ptr + t * (H // CHUNK) + offs, mask=offs < H // CHUNK, other=0.0)
    return 1.0 / tl.sqrt(tl.sum(p, axis=0) / H + eps)


@triton.jit
def copy_rows(src_ptr, dst_ptr, stride_dst, NT: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr):
    """Program p < cdiv(H, BLOCK) of the grid copies columns p * BLOCK .. of the NT rows of src (rows of
    H) to dst; the other programs do nothing. The grid must have at least cdiv(H, BLOCK) programs."""
    p = tl.program_id(0)
    if p * BLOCK < H:
        cols = p * BLOCK + tl.arange(0, BLOCK)
        ok = cols < H
        for t in tl.static_range(NT):
            tl.store(dst_ptr + t * stride_dst + cols, tl.load(src_ptr + t * H + cols, mask=ok, other=0.0), mask=ok)
