"""Triton code for the tensor-core decode GEMV of the FP8-weight dense linear, M <= 32 tokens
(launcher and reference: ``kernels/dense.py``: ``dense_fp8_linear(path="mmav")``).

``_dense_fp8_mmav_kernel``: out[M, N] = x[M, K] @ (W_e4m3[N, K] * scale[N, None])^T (+ bias[N]),
optionally followed by gpt-oss's NeoX rotation of the first ROPE_ROWS outputs (qkv).

Why: the CUDA-core GEMV (``_dense_fma.py``) spends ~5 instructions per weight value (integer
decode + FFMA), so even with its weight in L2 a one-token qkv takes ~6 us on an H100
(``benchmarks/l2_probe.py``): the math, not DRAM, sets its time. Here a weight value costs half a
conversion instruction: the e4m3 codes go global -> shared memory through Triton's ``cp.async``
pipeline (``num_stages`` steps in flight, no registers held), come back through ``ldmatrix``, are
widened by ``cvt.rn.f16x2.e4m3x2`` (exact: every e4m3 value is an fp16) and multiplied on the
tensor cores, ``mma.sync m16n8k16`` fp16 x fp16 -> fp32 (sm_121a and sm_90a alike when the
program's tile is under a warpgroup; a wider sm_90a tile may become ``wgmma``). The token tile is
BLOCK_T = 16 wide (tl.dot's smallest N) up to 16 tokens, 32 above (stop 40): tokens past M are
zeros and cost only tensor-core issue slots.

* Activations: bf16 -> fp16 after a 2**-X_SHIFT pre-scale (exact apart from the fp16 range:
  |x| < 2**(16 + X_SHIFT) stays finite; below 2**(X_SHIFT - 14) the fp16 is a denormal and keeps
  fewer bits, an absolute error under 2**(X_SHIFT - 25)). Products and sums are fp32 (the MMA's
  accumulator); the epilogue multiplies by 2**X_SHIFT, the row scale, adds the bias, rotates
  (ROPE) and rounds to bf16 once.
* Split-K (grid axis 1, SPLIT > 1): each split writes fp32 partials [SPLIT, M, N] to ``part_ptr``,
  and the last split of a row tile to arrive (``last_to_arrive``) sums them in split order and runs
  the epilogue: deterministic, and the grid can be sized to the SM count without short K loops.
* ROPE: as ``_dense_fma._rope_rows``: a rotary program's rows are runs of P = BLOCK_N / 2 features
  of one head's first half and the same features of its second half, so every rotated output's
  partner row is in the program.

Nothing sm_90-only at the sm_121a tiles (``tests/test_aot_compile.py``).
"""

import triton
import triton.language as tl

from .._sync import last_to_arrive
from ..kv_cache_details._codecs import store_rounded
from ._dense_fma import _rope_rows, _rotate



def _launch_metadata(grid, kernel, args):
    m, n, k = args["M"], args["N"], args["K"]
    return {"name": f"{kernel.name} [M={m}, N={n}, K={k}, split={args['SPLIT']}]", "flops": 2 * m * n * k,
            "bytes": n * k + 4 * n + 2 * m * k + 2 * m * n}


@triton.jit
def _mmav_epilogue(acc, rows, row_ok, toks, tok_ok, scale_ptr, bias_ptr, out_ptr, stride_om, pos_ptr, cs_ptr, stride_cs,
                   rot_j, rot_sign, X_SHIFT: tl.constexpr, HAS_BIAS: tl.constexpr, ROPE: tl.constexpr,
                   HEAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """acc [BLOCK_N, BLOCK_T] fp32 (rows x tokens) -> bf16 out[toks, rows]."""
    y = acc * (2.0 ** X_SHIFT) * tl.load(scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    if ROPE:  # NeoX rotation of the bf16 projection, the cache rounded to bf16 (as upstream)
        y = _rotate(y, toks, tok_ok, rot_j, rot_sign, pos_ptr, cs_ptr, stride_cs, HEAD, BLOCK_N, BLOCK_T)
    store_rounded(out_ptr + toks.to(tl.int64)[None, :] * stride_om + rows[:, None], y,
                  mask=row_ok[:, None] & tok_ok[None, :])


@triton.jit(launch_metadata=_launch_metadata)
def _dense_fp8_mmav_kernel(
    x_ptr,  # [M, K] bf16 activations, row stride stride_xm
    w_ptr,  # [N, K] uint8 e4m3 weight codes, contiguous
    scale_ptr,  # [N] fp32 per-output-channel dequantization scales
    bias_ptr,  # [N] bf16 or fp32 (HAS_BIAS only)
    out_ptr,  # [M, N] bf16, row stride stride_om
    part_ptr,  # SPLIT > 1: [SPLIT, M, N] fp32 partial sums
    cnt_ptr,  # SPLIT > 1: [>= cdiv(N, BLOCK_N)] int32 arrival counters, zero before and after each launch
    M,
    N,
    stride_xm: tl.int64,
    stride_om: tl.int64,
    K: tl.constexpr,  # multiple of 16
    BLOCK_N: tl.constexpr,  # weight rows per program (the MMA's M), power of two >= 16
    BLOCK_K: tl.constexpr,  # bytes of each row per K step, power of two >= 16
    SPLIT: tl.constexpr,  # K splits (grid axis 1)
    HAS_BIAS: tl.constexpr,
    X_SHIFT: tl.constexpr = 8,
    DOT_FP32: tl.constexpr = False,  # the interpreter: fp32 tl.dot (its fp16 dot does not accumulate in fp32)
    pos_ptr=None,  # ROPE: [M] token positions
    cs_ptr=None,  # ROPE: [max_position, HEAD] rotary cache (cos half, sin half)
    stride_cs=0,
    ROPE: tl.constexpr = False,
    ROPE_ROWS: tl.constexpr = 0,  # multiple of HEAD and BLOCK_N; HEAD / 2 a multiple of BLOCK_N / 2
    HEAD: tl.constexpr = 64,
    BLOCK_T: tl.constexpr = 16,  # the token tile (the MMA's N): 16 (tl.dot's smallest) or 32, >= M
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    if ROPE:
        rows, rot_j, rot_sign = _rope_rows(tile, ROPE_ROWS, HEAD, BLOCK_N)
    else:
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        rot_j, rot_sign = rows, rows.to(tl.float32)  # (unused)
    row_ok = rows < N
    # Rows past N read row N-1 (never stored): the weight loads need no row mask.
    w_base = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * K
    toks = tl.arange(0, BLOCK_T)
    tok_ok = toks < M
    x_base = x_ptr + toks.to(tl.int64)[None, :] * stride_xm
    # this split's K range: PER whole BLOCK_K steps (the last non-empty split ends at K; with more splits
    # than ceil(STEPS / PER), the trailing ones are empty: they store zero partials and count in)
    STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    PER: tl.constexpr = (STEPS + SPLIT - 1) // SPLIT
    k_lo = split * (PER * BLOCK_K)
    k_hi = tl.minimum(k_lo + PER * BLOCK_K, K)
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        w = tl.load(w_base + offs_k[None, :], mask=k_ok[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        x = tl.load(x_base + offs_k[:, None], mask=tok_ok[None, :] & k_ok[:, None], other=0.0).to(tl.float32)
        x = x * (2.0 ** -X_SHIFT)
        if DOT_FP32:
            acc = tl.dot(w.to(tl.float32), x.to(tl.float16).to(tl.float32), acc)
        else:
            acc = tl.dot(w.to(tl.float16), x.to(tl.float16), acc)
    if SPLIT == 1:
        _mmav_epilogue(acc, rows, row_ok, toks, tok_ok, scale_ptr, bias_ptr, out_ptr, stride_om, pos_ptr, cs_ptr,
                       stride_cs, rot_j, rot_sign, X_SHIFT, HAS_BIAS, ROPE, HEAD, BLOCK_N, BLOCK_T)
    else:
        mask = row_ok[:, None] & tok_ok[None, :]
        part = part_ptr + toks.to(tl.int64)[None, :] * N + rows[:, None]
        tl.store(part + split.to(tl.int64) * M * N, acc, mask=mask)
        if last_to_arrive(cnt_ptr, tile, SPLIT):
            acc = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):  # in split order: the sum does not depend on arrival
                acc += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _mmav_epilogue(acc, rows, row_ok, toks, tok_ok, scale_ptr, bias_ptr, out_ptr, stride_om, pos_ptr, cs_ptr,
                           stride_cs, rot_j, rot_sign, X_SHIFT, HAS_BIAS, ROPE, HEAD, BLOCK_N, BLOCK_T)
