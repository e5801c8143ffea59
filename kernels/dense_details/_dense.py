"""Triton code for the FP8-weight dense linear (launcher and reference: ``kernels/dense.py``).

``_dense_fp8_kernel``: out[M, N] = x[M, K] @ (W_e4m3[N, K] * scale[N, None])^T (+ bias[N]).
One program owns BLOCK_N weight rows and BLOCK_M tokens: it streams its rows once over K in
BLOCK_K tiles (each row a contiguous BLOCK_K-byte run: 16-byte vector loads) and multiplies
them by the token tile with ``tl.dot`` -- weights are the MMA's M, tokens its N (decode: one
token block of 16, so every weight byte is read once per step) -- accumulating in fp32. The
e4m3 -> bf16 upcast is exact (3 mantissa bits, exponents well inside bf16's); the
per-output-channel scale and the bias are applied once in the epilogue, then one bf16 rounding.
Prefill runs the same kernel with larger BLOCK_M tiles (a dequantize-in-registers GEMM).
"""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import store_rounded
from ._dense_fma import _rope_rows, _rotate


def _launch_metadata(grid, kernel, args):
    m, n, k = args["M"], args["N"], args["K"]
    return {"name": f"{kernel.name} [M={m}, N={n}, K={k}]", "flops": 2 * m * n * k,
            "bytes": n * k + 4 * n + 2 * m * k + 2 * m * n}


@triton.jit(launch_metadata=_launch_metadata)
def _dense_fp8_kernel(
    x_ptr,  # [M, K] bf16 activations, row stride stride_xm
    w_ptr,  # [N, K] uint8 e4m3 weight codes, contiguous
    scale_ptr,  # [N] fp32 per-output-channel dequantization scales
    bias_ptr,  # [N] bf16 (HAS_BIAS only)
    out_ptr,  # [M, N] bf16, row stride stride_om
    M,
    N,
    stride_xm: tl.int64,
    stride_om: tl.int64,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,  # tokens per program (>= 16: tl.dot's N)
    BLOCK_N: tl.constexpr,  # weight rows per program (>= 16: tl.dot's M)
    BLOCK_K: tl.constexpr,  # power of two >= 16
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # Triton's CPU interpreter mis-computes bf16 tl.dot: upcast there
    pos_ptr=None,  # ROPE: [M] token positions
    cs_ptr=None,  # ROPE: [max_position, HEAD] rotary cache (cos half, sin half)
    stride_cs=0,
    ROPE: tl.constexpr = False,  # NeoX rotation of the first ROPE_ROWS outputs in the epilogue (stop 41)
    ROPE_ROWS: tl.constexpr = 0,  # multiple of HEAD and of BLOCK_N
    HEAD: tl.constexpr = 64,  # BLOCK_N <= HEAD: HEAD / 2 a multiple of BLOCK_N / 2 (pairs of runs, _rope_rows);
    # BLOCK_N > HEAD: a multiple of HEAD (whole heads)
):
    rot_j = tl.arange(0, BLOCK_N)  # (placeholders, read under ROPE only)
    rot_sign = rot_j.to(tl.float32)
    if ROPE and BLOCK_N <= HEAD:
        rows, rot_j, rot_sign = _rope_rows(tl.program_id(0), ROPE_ROWS, HEAD, BLOCK_N)
    else:
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        if ROPE:  # whole heads: row r's partner is r -+ HEAD / 2 in the same program
            in_head = rows % HEAD
            rot_j = tl.where(rows < ROPE_ROWS, in_head % (HEAD // 2), -1)
            rot_sign = tl.where(in_head < HEAD // 2, -1.0, 1.0)
    row_ok = rows < N
    # Rows past N read row N-1 (never stored): the weight loads need no row mask.
    w_base = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * K
    toks = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_ok = toks < M
    x_base = x_ptr + toks.to(tl.int64)[None, :] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(w_base + offs_k[None, :], mask=k_ok[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        x = tl.load(x_base + offs_k[:, None], mask=tok_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_M]
        if DOT_FP32:
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc)
        else:
            acc = tl.dot(w.to(tl.bfloat16), x.to(tl.bfloat16), acc)
    y = acc * tl.load(scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    if ROPE:  # as the FMA / mmav epilogues: the bf16 projection rotated with the cache rounded to bf16
        y = _rotate(y, toks, tok_ok, rot_j, rot_sign, pos_ptr, cs_ptr, stride_cs, HEAD, BLOCK_N, BLOCK_M)
    store_rounded(out_ptr + toks.to(tl.int64)[None, :] * stride_om + rows[:, None], y,
                  mask=row_ok[:, None] & tok_ok[None, :])

