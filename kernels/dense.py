"""Dense linear layers with FP8 (e4m3) weights for bandwidth-bound decode: conversion, kernel, references.

Architecture
    ``fp8_per_channel_quantize`` converts a bf16 weight [N, K] (vLLM layout: output channels
    are rows) to e4m3 codes and one fp32 scale per output channel (amax / 448; all-zero rows get
    scale 1 and zeros, never inf or NaN). ``dense_fp8_linear`` computes
    ``out[M, N] = x[M, K] @ (W_e4m3 * scale[:, None])^T (+ bias)`` in bf16 with fp32
    accumulation (``dense_details/_dense.py``): each program streams BLOCK_N weight rows once
    over K and multiplies them by all its tokens with ``tl.dot`` (weights = the MMA's M, tokens
    = its N), so at decode (M <= 16) every weight byte is read exactly once per step. Prefill
    (M > 16) runs the same kernel with 64-token tiles: a GEMM that dequantizes weight tiles in
    registers.

    For the error study (``benchmarks/dense_error.py``) the module also holds the weight-only MX
    formats as torch conversions: ``mxfp8_weight_quantize`` (e4m3 + e8m0 per 32 along K, via
    ``norm_mxfp8.mxfp8_quantize_torch``) and ``mxfp4_weight_quantize`` (e2m1 + e8m0 per 32, the
    gpt-oss checkpoint's expert format, read back by ``moe.dequant_mxfp4_torch``).

Instructions (``python -m vllm_sm121.kernels.aot``): weights arrive through 16-byte
    ``cp.async.cg`` (3-stage pipeline, 32 KB shared memory per program), are upcast in registers
    (``cvt.rn.f16x2.e4m3x2`` + ``cvt.bf16.f16``, exact) and fed via ``ldmatrix`` to
    ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` on sm_121a (decode and prefill) and
    on sm_90a at decode; sm_90a prefill tiles become ``wgmma m64n64k16``.

Limitations
    Matches its reference on an H100 (GPU tests) and in vLLM end to end; timed there
    (``benchmarks/dense.py``, gpt-oss-120b shapes, M = 1): qkv 19.5 us and o 17.8 us, slower than
    cuBLAS bf16 (13.7 / 13.9 us) although it reads half the bytes (~25% of the copy bandwidth:
    too few programs and per-byte upcast work); lm_head 346 us with the default tile, 222 us with
    the wide-layer tile now used on sm_90 (cuBLAS bf16 410 us). Activations are bf16 (the fused norm's MXFP8 output is not consumed yet). No split-K: at
    M = 1 qkv (N = 5120) is 160 programs and o (N = 2880) 90 programs of BLOCK_N = 32 rows, which
    may under-fill a 132-SM H100 (GB10 has 48 SMs). MXFP8 / MXFP4 weights have torch references
    only.
"""

from __future__ import annotations

import torch

from vllm_sm121 import platform as _platform

from . import _validate as V
from .dense_details._dense import _dense_fp8_kernel
from .moe import dequant_mxfp4_torch
from .norm_mxfp8 import mxfp8_dequantize_torch, mxfp8_quantize_torch
from .nvfp4 import _e2m1_codes_torch

FP8_MAX = 448.0
MX_BLOCK = 32

# performance hyper-parameters (the defaults were set before any GPU run; see WIDE_* below).
# Decode (M <= DECODE_MAX_M): one token tile of 16 (the smallest tl.dot N), 32 weight rows per
# program (qkv 160, o 90, lm_head 6284 programs), K in 256-byte steps per row (2880 = 11.25
# steps, the last masked), 3-stage cp.async pipeline: 3 x 32 x 256 B = 24 KB of weights in flight.
DECODE_MAX_M = 16
DECODE_BLOCK_M = 16
DECODE_BLOCK_N = 32
DECODE_BLOCK_K = 256
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
# Decode of very wide layers (lm_head, N = 201088) on sm_90: 64 rows x 128-byte K steps. H100 tile
# sweep at M = 1 (results/dense-sweep, commit 86635e0+): 222 us against 348 us for the default
# tile (cuBLAS bf16: 410 us); qkv / o were no faster with it. Not measured on sm_12x.
WIDE_N = 65536
WIDE_BLOCK_N = 64
WIDE_BLOCK_K = 128
# Prefill: 128 x 64 output tiles, K in 64-element steps (the MoE grouped GEMMs' shape).
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 128
PREFILL_BLOCK_K = 64
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 3


# ---- conversion ----------------------------------------------------------------------------

def fp8_per_channel_quantize(w: torch.Tensor, *, chunk_rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16/fp16/fp32 weight [N, K] -> (e4m3 [N, K] float8_e4m3fn, fp32 scale [N]), w ~= codes * scale.

    scale = amax(|row|) / 448, so each row's largest value maps to +-448 (no saturation). An
    all-zero row gets scale 1 and zero codes; a tiny nonzero amax is clamped to the smallest
    normal fp32 scale (never a zero or subnormal divisor). Non-finite weights are an error.
    Rows are converted ``chunk_rows`` at a time (bounded fp32 temporaries: lm_head is 201088 rows).
    """
    V.check_ndim("w", w, 2, "[out_features, in_features]")
    V.check_dtype("w", w, V.ACT_DTYPES + (torch.float32,))
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    for r0 in range(0, n, chunk_rows):
        rows = w[r0:r0 + chunk_rows].float()
        if not torch.isfinite(rows).all():
            raise ValueError(f"w has non-finite values in rows {r0}..{r0 + rows.shape[0] - 1}; "
                             "supported: finite weights")
        amax = rows.abs().amax(dim=1) if k else torch.zeros(rows.shape[0], device=w.device)
        s = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        s = torch.where(amax > 0, s, torch.ones_like(s))
        codes[r0:r0 + chunk_rows] = (rows / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        scale[r0:r0 + chunk_rows] = s
    return codes, scale


def fp8_per_channel_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K]: what the kernel multiplies by (codes * scale per row)."""
    return codes.float() * scale.float()[:, None]


def _check_mx_k(w: torch.Tensor) -> None:
    V.check_ndim("w", w, 2, "[out_features, in_features]")
    if w.shape[1] % MX_BLOCK:
        raise ValueError(f"in_features={w.shape[1]} is not supported for MX weights; supported: multiples of {MX_BLOCK}")


def mxfp8_weight_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], e8m0 [N, K/32] uint8): MXFP8 along K, as the activations' format."""
    _check_mx_k(w)
    return mxfp8_quantize_torch(w.float())


def mxfp8_weight_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return mxfp8_dequantize_torch(codes, scales.clamp(min=1))


def mxfp4_weight_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e2m1 pairs [N, K/2] uint8, low nibble first; e8m0 [N, K/32] uint8).

    OCP MX scale: 2**(floor(log2 amax) - 2) (e2m1's largest exponent is 2), values rounded to
    nearest even and saturated to +-6; all-zero blocks get byte 0 (read back as 2**-126, zeros).
    """
    _check_mx_k(w)
    n, k = w.shape
    wb = w.float().view(n, k // MX_BLOCK, MX_BLOCK)
    amax = wb.abs().amax(-1)
    _, ex = torch.frexp(amax)  # amax = m * 2**ex, m in [0.5, 1): floor(log2 amax) = ex - 1
    e = torch.where(amax > 0, (ex - 1 - 2).clamp(-127, 127), torch.full_like(ex, -127))
    q = wb * torch.exp2(-e.float().clamp(min=-126))[..., None]
    codes = _e2m1_codes_torch(q).view(n, k // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8), (e + 127).to(torch.uint8)


def mxfp4_weight_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequant_mxfp4_torch(blocks, scales)


# ---- the linear ----------------------------------------------------------------------------

def _check_linear(x, w, scale, bias) -> tuple[int, int, int]:
    V.check_ndim("x", x, 2, "[num_tokens, in_features]")
    V.check_ndim("w", w, 2, "[out_features, in_features]")
    V.check_dtype("x", x, (torch.bfloat16,))
    V.check_dtype("w", w, V.FP8_DTYPES + (torch.uint8,))
    V.check_dtype("scale", scale, (torch.float32,))
    m, k = x.shape
    n, kw = w.shape
    if kw != k:
        raise ValueError(f"x has in_features={k} but w={tuple(w.shape)} has {kw}")
    if k == 0 or k % 16:
        raise ValueError(f"in_features={k} is not supported; supported: positive multiples of 16")
    if scale.shape != (n,):
        raise ValueError(f"scale must be [out_features]=[{n}] fp32, got {tuple(scale.shape)}")
    if bias is not None:
        V.check_dtype("bias", bias, (torch.bfloat16, torch.float32))
        if bias.shape != (n,):
            raise ValueError(f"bias must be [out_features]=[{n}], got {tuple(bias.shape)}")
    V.check_last_dim_contiguous("x", x)
    if not w.is_contiguous():
        raise ValueError(f"w must be contiguous [out_features, in_features], got strides {w.stride()}")
    V.check_same_device(x=x, w=w, scale=scale, bias=bias)
    return m, n, k


def dense_fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N] = x [M, K] bf16 @ (w [N, K] e4m3 * scale [N])^T + bias [N] (fp32 accumulation)."""
    m, n, k = _check_linear(x, w, scale, bias)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m == 0 or n == 0:
        return out
    gpu = _platform.family_of(x) != _platform.INTERPRETER
    if m <= DECODE_MAX_M:
        bm, bn, bk, warps, stages = (DECODE_BLOCK_M, DECODE_BLOCK_N, DECODE_BLOCK_K, DECODE_NUM_WARPS,
                                     DECODE_NUM_STAGES)
    else:
        bm, bn, bk, warps, stages = (PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_BLOCK_K, PREFILL_NUM_WARPS,
                                     PREFILL_NUM_STAGES)
    if m <= DECODE_MAX_M and n >= WIDE_N and _platform.family_of(x) == _platform.SM90:
        bn, bk = WIDE_BLOCK_N, WIDE_BLOCK_K
    if not gpu:  # the interpreter: small tiles keep CPU runs fast
        bn, bk = 16, 32
    bk = min(bk, V._next_pow2(k))
    _dense_fp8_kernel[(-(-n // bn), -(-m // bm))](
        x, w.view(torch.uint8), scale, bias if bias is not None else scale, out, m, n, x.stride(0), out.stride(0),
        K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None, DOT_FP32=not gpu,
        num_warps=warps, num_stages=stages)
    return out


def dense_fp8_linear_torch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of ``dense_fp8_linear`` in fp32 (on the dequantized weights: kernel error only)."""
    y = x.float() @ fp8_per_channel_dequantize(w.view(torch.float8_e4m3fn), scale).T
    return y + bias.float() if bias is not None else y
