"""Triton code of the next layer's input norm carried from FC2's combine into the qkv GEMV
(``kernels/next_norm.py`` says what is carried and why).

``next_norm_inputs`` (at a program's start) and ``next_norm_store`` (where a block output's bf16
row chunk is finished, FC2's combine): adds the block's residual, stores the next residual ``s``, ``u = bf16(s * w)`` (w: the next layer's
input-norm weight) and the chunk's sums of ``s**2`` per CHUNK columns. ``load_sums`` / ``inv_rms``: a token's
``1 / sqrt(mean(s**2) + eps)`` from those sums (a fixed order: deterministic). ``load_rows`` /
``store_rows``: the next residual into the qkv op's own output tensor, by the first programs of the
GEMV. The loads are issued before the GEMV's K loop and used after it. Plain loads,
stores and fp32 arithmetic: nothing architecture-specific.
"""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import to_bf16_rne

CHUNK = tl.constexpr(16)  # columns per partial sum of squares (kernels/next_norm.py: NEXT_NORM_CHUNK)


@triton.jit
def next_norm_inputs(res_ptr, stride_res, w_ptr, col0, M, H: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK: tl.constexpr):
    """The residual rows [BLOCK_T, BLOCK] (tokens < M) and the norm weight [BLOCK] of columns
    col0 .. col0 + BLOCK - 1, fp32 (zeros outside): loaded where the program starts, used by
    ``next_norm_store`` after its main loop."""
    cols = col0 + tl.arange(0, BLOCK)
    offs_t = tl.arange(0, BLOCK_T)
    ok = (offs_t[:, None] < M) & (cols[None, :] < H)
    r = tl.load(res_ptr + offs_t[:, None] * stride_res + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    return r, tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)


@triton.jit
def row_of(x, t, BLOCK_T: tl.constexpr):
    """Row ``t`` of x [BLOCK_T, BLOCK] as [BLOCK]."""
    return tl.sum(tl.where(tl.arange(0, BLOCK_T)[:, None] == t, x, 0.0), axis=0)


@triton.jit
def next_norm_store(o, r, w, t, t_ok, col0, s_ptr, u_ptr, ps_ptr, H: tl.constexpr, BLOCK: tl.constexpr):
    """Token ``t``'s finished block output ``o`` (fp32 [BLOCK] holding bf16 values) at columns
    col0 .. col0 + BLOCK - 1 (col0 a multiple of CHUNK), with its residual ``r`` and the norm weight
    ``w`` there (fp32 [BLOCK]): s = bf16(o + r) -> s_ptr, bf16(s * w) -> u_ptr (rows of H),
    sum(s**2) per CHUNK columns -> ps_ptr (rows of H / CHUNK). Masked by ``t_ok`` and the columns' range."""
    cols = col0 + tl.arange(0, BLOCK)
    ok = (cols < H) & t_ok
    s = to_bf16_rne(o + r).to(tl.float32)
    tl.store(s_ptr + t * H + cols, s.to(tl.bfloat16), mask=ok)
    tl.store(u_ptr + t * H + cols, to_bf16_rne(s * w), mask=ok)  # bf16 x bf16: exact in fp32, rounded once
    sq = tl.sum(tl.reshape(tl.where(ok, s * s, 0.0), [BLOCK // CHUNK, CHUNK]), axis=1)
    chunk = col0 // CHUNK + tl.arange(0, BLOCK // CHUNK)
    tl.store(ps_ptr + t * (H // CHUNK) + chunk, sq, mask=(chunk < H // CHUNK) & t_ok)


@triton.jit
def load_sums(ps_ptr, t, H: tl.constexpr, NP_PAD: tl.constexpr):
    """Token ``t``'s H / CHUNK partial sums as [NP_PAD] fp32 (zeros past them): issued before a
    kernel's main loop and reduced after it (``inv_rms``), so the loop's first loads do not wait
    for them."""
    offs = tl.arange(0, NP_PAD)
    return tl.load(ps_ptr + t * (H // CHUNK) + offs, mask=offs < H // CHUNK, other=0.0)


@triton.jit
def inv_rms(sums, eps, H: tl.constexpr):
    """1 / sqrt(mean(s**2) + eps) from a token's partial sums (``load_sums``; scalar fp32, summed
    in a fixed order: deterministic). IEEE-rounded square root and division: no flush-to-zero
    instruction in the GEMV that calls it (its e4m3 decode keeps denormals)."""
    return tl.div_rn(1.0, tl.sqrt_rn(tl.sum(sums, axis=0) / H + eps))


@triton.jit
def load_rows(src_ptr, NT: tl.constexpr, BLOCK_T: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr):
    """Program p < cdiv(H, BLOCK): columns p * BLOCK .. of the NT rows of src (rows of H) as
    [BLOCK_T, BLOCK] (zeros elsewhere and in every other program). With ``store_rows`` after the
    main loop: a copy whose load does not add a memory round trip at the program's end."""
    p = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    cols = p * BLOCK + tl.arange(0, BLOCK)
    ok = (offs_t[:, None] < NT) & (cols[None, :] < H)
    return tl.load(src_ptr + offs_t[:, None] * H + cols[None, :], mask=ok, other=0.0)


@triton.jit
def store_rows(vals, dst_ptr, stride_dst, NT: tl.constexpr, BLOCK_T: tl.constexpr, H: tl.constexpr,
               BLOCK: tl.constexpr):
    """The other half of ``load_rows``: program p < cdiv(H, BLOCK) stores its block to dst."""
    p = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    cols = p * BLOCK + tl.arange(0, BLOCK)
    ok = (offs_t[:, None] < NT) & (cols[None, :] < H)
    tl.store(dst_ptr + offs_t[:, None] * stride_dst + cols[None, :], vals, mask=ok)
