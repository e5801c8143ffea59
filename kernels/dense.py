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
    registers. ``path="mma"`` forces this kernel at any M.

    Decode for M <= DENSE_FMA_MAX_M tokens (``path="auto"``; 4, or DENSE_FMA_WIDE_MAX_M = 1 for
    layers of N >= WIDE_N such as lm_head; ``path="fma"`` forces it, $VLLM_SM121_DENSE_FMA_MAX_M
    overrides the limit at call time, 0 = off) runs a CUDA-core
    GEMV instead (``dense_details/_dense_fma.py``, no ``tl.dot``, the sibling of the MoE's FMA
    kernels): each program streams DenseFmaTiles.rows weight rows along K as [rows, kw] int32
    tiles (16-byte vectors per thread), decodes e4m3 bytes with 3 integer ops each
    (``((w << (24 - 8J)) >> 4) & 0x87F00000`` bitcast to fp32 = e4m3 * 2**-120, exact, denormals
    kept), multiplies them by each token's bf16 activations (read as int64 words of 4, upcast
    exactly, pre-scaled by 2**64), one fp32 accumulator per token so the weights are read and
    decoded once, reduces with ``tl.sum`` and applies 2**56, the scale and the bias in the
    epilogue. Tiles per family in DENSE_FMA_TILES, overridden at call time by
    $VLLM_SM121_DENSE_FMA_TILES="rows,kw,warps". ``dense_fp8_linear_rope`` (gpt-oss's qkv_proj +
    ``rotary_emb``, the model hook's default since stop 27): the FMA kernel with ROPE pairs each
    program's rows inside one head's NeoX halves and rotates in its epilogue; other paths rotate
    after the GEMM (``rope_neox_``, also the reference). Kernel tests passed on an H200 (0f84732).
    Its opt-in ``kv_write`` (also the nvfp4 KV-cache write, by each k / v head's last program):
    kernel tests passed on an H100 (2c4837a) and an H200 (006c509).

    Batches and prefill may instead take vLLM's own W8A8 FP8 GEMM (``path="w8a8"``: per-token
    e4m3 activations from ``scaled_fp8_quant``, ``cutlass_scaled_mm`` on the same weights and
    scales), opt-in with $VLLM_SM121_DENSE_W8A8_MIN_M until it has run end to end
    (DENSE_W8A8_MIN_M); where vLLM has no such kernel the call is refused, not rerouted.
    (An upcast-to-bf16 + cuBLAS prefill path was tried and removed: slower than cuBLAS bf16 and
    the W8A8 GEMM at every M on an H200, docs/dense-cmp-h200-09758ed.json.)

    For the error study (``benchmarks/dense_error.py``) the module also holds the weight-only MX
    formats as torch conversions: ``mxfp8_weight_quantize`` (e4m3 + e8m0 per 32 along K, via
    ``norm_mxfp8.mxfp8_quantize_torch``) and ``mxfp4_weight_quantize`` (e2m1 + e8m0 per 32, the
    gpt-oss checkpoint's expert format, read back by ``moe.dequant_mxfp4_torch``).

Instructions (``python -m vllm_sm121.kernels.aot``): weights arrive through 16-byte
    ``cp.async.cg`` (3-stage pipeline, 32 KB shared memory per program), are upcast in registers
    (``cvt.rn.f16x2.e4m3x2`` + ``cvt.bf16.f16``, exact) and fed via ``ldmatrix`` to
    ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` on sm_121a (decode and prefill) and
    on sm_90a at decode; sm_90a prefill tiles become ``wgmma m64n64k16``. The FMA path is
    ``ld.global.v4.b32`` (weights), ``ld.global.v2.b64`` (activations), integer shifts / masks,
    ``fma.rn.f32`` (``fma.rn.f32x2`` on sm_121a) without ``.ftz``, warp shuffles for the
    final sum and no barrier in its loop: nothing sm_90-only.

Limitations
    The MMA kernel matches its reference on an H100 (GPU tests) and in vLLM end to end; timed
    there (``benchmarks/dense.py``, gpt-oss-120b shapes, M = 1, before the FMA path existed; now
    ``path="mma"``): qkv 19.5 us and o 17.8 us, slower than
    cuBLAS bf16 (13.7 / 13.9 us) although it reads half the bytes (~25% of the copy bandwidth:
    too few programs and per-byte upcast work); lm_head 346 us with the default tile, 222 us with
    the wide-layer tile now used on sm_90 (cuBLAS bf16 410 us). Activations are bf16 (the fused norm's MXFP8 output is not consumed yet). No split-K: at
    M = 1 qkv (N = 5120) is 160 programs and o (N = 2880) 90 programs of BLOCK_N = 32 rows, which
    may under-fill a 132-SM H100 (GB10 has 48 SMs). MXFP8 / MXFP4 weights have torch references
    only.

    The FMA decode path (the default for M <= 4, M <= 1 on lm_head) was timed on an H100 at
    8e7318f: qkv 8.7 µs, o 8.6, lm_head 204 at M = 1 (59% / 47% / 98% of the copy bandwidth;
    cuBLAS bf16 13.5 / 14.4 / 409); its tiles are the first guess, not swept yet
    (``benchmarks/dense.py --fma-tiles``; ``--providers sm121_fma,sm121_mma,cublas_bf16``
    compares the paths). The activations must satisfy |x| < 2**64 (the 2**64 pre-scale;
    bf16 allows 2**128); below ~2**-60 their products with small codes lose bits as fp32
    denormals. e4m3 NaN codes are decoded as finite values (the converter never writes them).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from vllm_sm121 import platform as _platform

from . import _validate as V
from .dense_details._dense import _dense_fp8_kernel
from .dense_details._dense_fma import _dense_fp8_fma_kernel
from .dense_details._dense_mmav import _dense_fp8_mmav_kernel
from .moe import dequant_mxfp4_torch, split_counters
from .next_norm import NEXT_NORM_CHUNK, NEXT_NORM_MAX_T, NextNormBuffers, normed_torch
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

# Decode for very few tokens: the CUDA-core (FMA) GEMV (``dense_details/_dense_fma.py``).
# path="auto" takes it for M <= DENSE_FMA_MAX_M (<= DENSE_FMA_KERNEL_MAX_M, the accumulators the
# kernel unrolls); 0 turns it off. $VLLM_SM121_DENSE_FMA_MAX_M, read at each call (under CUDA
# graphs: at capture), overrides it (A/B runs). The path depends on M and N alone, so a captured
# CUDA graph replays the same kernel.
DENSE_FMA_KERNEL_MAX_M = 4
# H100, benchmarks/dense.py at 8e7318f (docs/dense-h100-8e7318f.json), FMA vs the MMA kernel, µs:
# qkv M=1/2/4 8.7/10.6/16.1 vs 19.4; o 8.6/9.3/14.0 vs 17.7 (cuBLAS bf16: 13.5 and 14.4);
# lm_head (N = 201088) M=1 204 vs 222 but M=2 228 vs 223 and M=4 423 vs 225: on layers of
# N >= WIDE_N the FMA path stops at DENSE_FMA_WIDE_MAX_M tokens.
DENSE_FMA_MAX_M = 4
DENSE_FMA_WIDE_MAX_M = 1
DENSE_FMA_MAX_M_ENV = "VLLM_SM121_DENSE_FMA_MAX_M"
# Per-family overrides of DENSE_FMA_MAX_M (see DENSE_MMAV_MAX_M_FAMILY: on sm_90 the tensor-core GEMV
# takes over from 3 tokens)
DENSE_FMA_MAX_M_FAMILY = {_platform.SM90: 2}
# Batches / prefill through vLLM's W8A8 FP8 GEMM ("w8a8": ``scaled_fp8_quant`` per token, then
# ``cutlass_scaled_mm`` on the same e4m3 weights and per-channel scales). On an H100 at 8e7318f
# (benchmarks/dense.py, provider vllm_cutlass_fp8, quantization included) it took 10.7-12.6 us
# for qkv / o at M = 8..64 against 17.7-43.0 us for the MMA kernel above and 12.5-15.4 us for
# cuBLAS bf16. It quantizes the activations (per-token e4m3: W8A8 numerics, not W8A16), so it is
# off by default (0) until it has run end to end; $VLLM_SM121_DENSE_W8A8_MIN_M=m takes it for
# M >= m (above the FMA path), read at each call like the FMA limit.
DENSE_W8A8_MIN_M = 0
DENSE_W8A8_MIN_M_ENV = "VLLM_SM121_DENSE_W8A8_MIN_M"
PATHS = ("auto", "fma", "mmav", "mma", "w8a8")

# Decode for up to DENSE_MMAV_KERNEL_MAX_M tokens on the tensor cores (``dense_details/_dense_mmav.py``:
# cp.async-pipelined e4m3 weights, fp16 MMAs, split-K with an in-kernel ordered sum). path="auto"
# takes it for the token counts above the FMA limit up to DENSE_MMAV_MAX_M (per family:
# DENSE_MMAV_MAX_M_FAMILY); $VLLM_SM121_DENSE_MMAV_MAX_M (read at each call, as the FMA limit)
# overrides it for every family (0: off; with $VLLM_SM121_DENSE_FMA_MAX_M=0 it takes one token too).
# At one token it is slower than the FMA GEMV (H100, ffd86d2, benchmarks/gemv_tiles.py,
# docs/gemv-tiles-mmav-h100-ffd86d2.json, cold / hot µs: qkv + rotation 10.47 / 8.49 vs 9.95 / 6.82,
# o 9.53 / 7.26 vs 7.18 / 4.70, lm_head 208.4 vs 207.0). From 4 tokens on it is the fastest of the
# plugin's paths (H200, 0f8d996, benchmarks/dense.py, docs/dense-cmp-mmav-h200-0f8d996.json, µs at
# M = 4 / 8 / 16): qkv 9.9 / 10.0 / 10.9 vs FMA 16.6 (M = 4) and MMA 19.7; o 9.5 / 9.6 / 10.8 vs 14.1 and
# 17.9; lm_head 149.3 / 151.9 / 160.5 vs 191.8 / 192.9 / 197.4 (MMA); cuBLAS bf16 10.7-11.0 / 12.1-12.7
# / 279-283. So sm_90 takes FMA for 1-2 tokens (lm_head: 1) and mmav for 3-16 (3-32 since stop 41, below; M = 3 and the FMA
# GEMV at 2 tokens against mmav were not timed in one run: the FMA GEMV took qkv 10.0 / o 7.6 µs at
# M = 2 with 8,256,8 in the stop-40 sweep). sm_12x keeps FMA up to 4 tokens and the MMA kernel above
# (not measured on GB10).
# The kernel takes up to 32 tokens (a 32-wide token tile above 16, stop 40). Timed at stop 41 (H200,
# d84142c, docs/dense-mmav32-h200-d84142c.json, µs at M = 17 / 24 / 32): qkv 14.6 / 14.9 / 15.0 vs
# MMA 32.1-32.3, cuBLAS bf16 10.8-10.9, vLLM's cutlass W8A8 12.0-12.5; o 10.3 / 10.6 / 10.7 vs 43.6-43.8,
# 12.3-12.8, 10.7-11.3; lm_head 259.9 / 257.9 / 252.4 vs MMA 250.5-252.9. (At d84142c the MMA kernel
# had no rotation epilogue either: torch rotated after it, ~25 µs per layer at batch 32 in the stop-41
# profile; it has one since.) So sm_90 takes mmav up to 32 tokens, the lm_head (N >= WIDE_N) up to 16
# (DENSE_MMAV_WIDE_MAX_M_FAMILY: slower than MMA at 17-24 tokens).
DENSE_MMAV_KERNEL_MAX_M = 32
DENSE_MMAV_MAX_M = 0
DENSE_MMAV_MAX_M_FAMILY = {_platform.SM90: 32}
DENSE_MMAV_WIDE_MAX_M_FAMILY = {_platform.SM90: 16}
DENSE_MMAV_MAX_M_ENV = "VLLM_SM121_DENSE_MMAV_MAX_M"
# The activations go to fp16 as x * 2**-DENSE_MMAV_X_SHIFT (|x| < 2**(16 + shift) stays finite).
DENSE_MMAV_X_SHIFT = 8


@dataclasses.dataclass(frozen=True)
class DenseMmavTiles:
    """Tiles of the tensor-core decode GEMV (performance hyper-parameters)."""

    rows: int  # weight rows per program (the MMA's M): a power of two >= 16
    kb: int  # bytes of each row per K step: a power of two >= 16
    split: int  # K splits per row tile; 0: enough for ~SPLIT_AUTO_WAVES programs per SM
    num_warps: int
    num_stages: int

    SPLIT_AUTO_WAVES = 2

    def __post_init__(self):
        def pow2(v):
            return v > 0 and v & (v - 1) == 0

        if not (pow2(self.rows) and 16 <= self.rows <= 256 and pow2(self.kb) and 16 <= self.kb <= 1024):
            raise ValueError(f"{self}: rows must be a power of two in 16..256, kb a power of two in 16..1024")
        if self.num_warps not in (1, 2, 4, 8) or not 1 <= self.num_stages <= 8 or not 0 <= self.split <= 32:
            raise ValueError(f"{self}: num_warps must be 1, 2, 4 or 8, stages 1..8, split 0..32")

    @classmethod
    def parse(cls, text: str) -> DenseMmavTiles:
        """"rows,kb,split,warps,stages" (the $VLLM_SM121_DENSE_MMAV_TILES format; split 0 = auto)."""
        return cls(*V.parse_ints(DENSE_MMAV_TILES_ENV, text, (5,), "rows,kb,split,warps,stages (integers)"))

    def spec(self) -> str:
        return f"{self.rows},{self.kb},{self.split},{self.num_warps},{self.num_stages}"

    def splits(self, n: int, k: int, sms: int) -> int:
        """K splits for an [n, k] weight on ``sms`` SMs (at most one per K step)."""
        steps = -(-k // self.kb)
        if self.split:
            return max(1, min(self.split, steps))
        tiles = -(-n // self.rows)
        return max(1, min(steps, -(-self.SPLIT_AUTO_WAVES * sms // tiles)))


# Per architecture family. One warp of 64 rows keeps the activations' MMA operand for 4 row tiles
# (sm_90a SASS: ~1.9 instructions per weight value in the K loop, against ~5.8 for the FMA GEMV's
# 8,256,8 tile). H100 sweep at one token (ffd86d2, cold µs qkv / o / lm_head): 64,256,0,1,3 11.68 /
# 10.18 / 218.9; 64,128,0,1,4 10.47 / 9.64 / 227.3; 32,256,0,1,3 10.96 / 9.54 / 209.5; 128,128,0,2,3
# 31.77 / 8.50 (suspect: the output was bit-identical to the FMA GEMV's) / 225.4 (qkv's rotation
# needs 64-row tiles); 4-warp (wgmma) tiles 12.1-12.4 / 9.6-13.2.
# The first guess stays (no tile beats the FMA GEMV). sm_12x: not measured.
DENSE_MMAV_TILES: dict[str, DenseMmavTiles] = {
    _platform.SM90: DenseMmavTiles(64, 256, 0, 1, 3),
    _platform.SM12X: DenseMmavTiles(64, 256, 0, 1, 3),
    _platform.INTERPRETER: DenseMmavTiles(16, 32, 2, 1, 1),
}
DENSE_MMAV_TILES_ENV = "VLLM_SM121_DENSE_MMAV_TILES"


def dense_mmav_tiles(t: torch.Tensor) -> DenseMmavTiles:
    env = os.environ.get(DENSE_MMAV_TILES_ENV, "").strip()
    if env:
        return DenseMmavTiles.parse(env)
    return DENSE_MMAV_TILES[_platform.family_of(t)]


@dataclasses.dataclass(frozen=True)
class DenseFmaTiles:
    """Tiles of the FMA decode kernel (performance hyper-parameters)."""

    rows: int  # weight rows per program: a power of two
    kw: int  # int32 words (4 bytes = 4 e4m3 values) of each row per K step: a power of two >= 4
    num_warps: int

    def __post_init__(self):
        def pow2(v):
            return v > 0 and v & (v - 1) == 0

        if not (pow2(self.rows) and self.rows <= 1024 and pow2(self.kw) and 4 <= self.kw <= 4096):
            raise ValueError(f"{self}: rows must be a power of two <= 1024, kw a power of two in 4..4096")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"{self}: num_warps must be a power of two <= 32")

    @classmethod
    def parse(cls, text: str) -> DenseFmaTiles:
        """"rows,kw,warps" (the $VLLM_SM121_DENSE_FMA_TILES format)."""
        return cls(*V.parse_ints(DENSE_FMA_TILES_ENV, text, (3,), "rows,kw,warps (integers)"))

    def spec(self) -> str:
        return f"{self.rows},{self.kw},{self.num_warps}"


# performance hyper-parameters, per architecture family: set before any GPU run and timed as is
# on an H100 at 8e7318f (numbers above), not swept (benchmarks/dense.py --fma-tiles sweeps them
# through $VLLM_SM121_DENSE_FMA_TILES; the one-token tiles, DENSE_FMA_TILES_M1 below, were). 16 rows x 128 words (512 bytes) per K step, 8 warps: each thread loads two
# 16-byte weight vectors and two 16-byte activation vectors per token per step (8 KB of weights
# per program in flight); qkv (N = 5120) is 320 programs, o (N = 2880) 180, lm_head 12568.
# Pitfall (sm_121a / sm_90a PTX, triton 3.6): with kw >= 32 * warps Triton loads the activation
# words one per thread and broadcasts them through shared memory, 2 bar.sync per token per step
# (16,128,4 does; 16,128,8 / 16,64,4 / 32,64,4 do not); since stop 40 the kernel loads them in the
# weight tile's layout there instead (``fma_x_rows``). sm_12x: the sm_90 values. The
# interpreter gets small tiles (K = 96: one full step and a masked tail).
DENSE_FMA_TILES: dict[str, DenseFmaTiles] = {
    _platform.SM90: DenseFmaTiles(16, 128, 8),
    _platform.SM12X: DenseFmaTiles(16, 128, 8),
    _platform.INTERPRETER: DenseFmaTiles(16, 16, 1),
}
DENSE_FMA_TILES_ENV = "VLLM_SM121_DENSE_FMA_TILES"
# One token (batch-1 decode), per (family, N >= WIDE_N i.e. lm_head): the fastest tiles of an H200
# sweep at 56c2045 (benchmarks/dense.py --fma-tiles, docs/dense-sweep-h200-56c2045.json, us at M = 1):
#   qkv (N 5120, K 2880)  8,256,8  7.7 (46% of copy BW)  vs 16,128,8  8.3
#   o   (N 2880, K 4096)  8,256,8  6.4 (44%)             vs 16,128,8  8.1
#   lm_head (N 201088)   32,128,8 146.2 (95%)            vs 16,128,8 156.2
# 8,256,8 is the Pitfall's case above (activation words broadcast through shared memory, barriers
# in the loop until stop 40, ``fma_x_rows``): faster all the same at one token. With 2+ tokens the family tile stayed (8,256,8
# was slower there: qkv 11.3 / 20.1 vs 10.9 / 16.5 us at M = 2 / 4). sm_12x: not measured, the
# family tile.
DENSE_FMA_TILES_M1: dict[tuple[str, bool], DenseFmaTiles] = {
    (_platform.SM90, False): DenseFmaTiles(8, 256, 8),
    (_platform.SM90, True): DenseFmaTiles(32, 128, 8),
}
# Two tokens on sm_90 (stop 40, H200, 9584daa, benchmarks/dense.py --fma-tiles with the activation
# words in the weight tile's layout, docs/dense-xrows-h200-9584daa.json, µs at M = 2): 8,256,8 qkv 10.0 /
# o 7.6 vs the family tile 16,128,8 10.3 / 9.3. (From 3 tokens sm_90 takes the tensor-core GEMV.)
DENSE_FMA_TILES_M2: dict[tuple[str, bool], DenseFmaTiles] = {
    (_platform.SM90, False): DenseFmaTiles(8, 256, 8),
}


def dense_fma_tiles(t: torch.Tensor, m: int = 4, n: int = 0) -> DenseFmaTiles:
    """The FMA kernel's tiles on ``t``'s device for M tokens and N outputs: $VLLM_SM121_DENSE_FMA_TILES
    if set, else DENSE_FMA_TILES_M1 / _M2[(family, N >= WIDE_N)] at M = 1 / 2 where the family has one,
    else DENSE_FMA_TILES[family]."""
    env = os.environ.get(DENSE_FMA_TILES_ENV, "").strip()
    if env:
        return DenseFmaTiles.parse(env)
    return family_fma_tiles(_platform.family_of(t), m, n >= WIDE_N)


def family_fma_tiles(family: str, m: int, wide: bool) -> DenseFmaTiles:
    """The shipped FMA tiles of ``family`` for M tokens (``wide``: N >= WIDE_N), without the
    environment override: what ``dense_fma_tiles`` and the AOT specs use."""
    few = {1: DENSE_FMA_TILES_M1, 2: DENSE_FMA_TILES_M2}.get(m, {})
    return few.get((family, wide), DENSE_FMA_TILES[family])


# $VLLM_SM121_DENSE_X_ROWS=0 turns fma_x_rows off (read at call time; for A/B runs: the old loads)
DENSE_X_ROWS_ENV = "VLLM_SM121_DENSE_X_ROWS"


def fma_x_rows(tiles: DenseFmaTiles, kw: int) -> bool:
    """Whether the FMA kernel loads its activation words in the weight tile's layout (X_ROWS): where
    its K step spans kw >= 32 * warps words, which Triton 3.6 would otherwise load one word per
    thread and broadcast through shared memory (barriers in the K loop; the one-token 8,256,8).
    Same bits either way (tests/test_dense.py)."""
    return kw >= 32 * tiles.num_warps and V.env_int(DENSE_X_ROWS_ENV, 1) != 0


def select_path(m: int, n: int = 0, family: str = _platform.INTERPRETER, *, w8a8: bool = True) -> str:
    """The path ``dense_fp8_linear(path="auto")`` takes for M tokens and N output channels on a
    device of ``family``: "fma", "mmav", "w8a8" or "mma" (from the shapes and the device alone: a
    captured CUDA graph replays the same kernel).

    FMA up to the family's FMA limit (N >= WIDE_N: DENSE_FMA_WIDE_MAX_M), then vLLM's W8A8 GEMM
    from $VLLM_SM121_DENSE_W8A8_MIN_M (default 0: off), then the tensor-core GEMV up to the
    family's mmav limit, else the MMA kernel. $VLLM_SM121_DENSE_FMA_MAX_M / _MMAV_MAX_M, when set, are
    the limits for every N and family. ``w8a8=False``: the path without the W8A8 opt-in (fp32 outputs).
    """
    fma_max = V.env_int(DENSE_FMA_MAX_M_ENV, DENSE_FMA_WIDE_MAX_M if n >= WIDE_N
                        else DENSE_FMA_MAX_M_FAMILY.get(family, DENSE_FMA_MAX_M))
    if 1 <= m <= min(fma_max, DENSE_FMA_KERNEL_MAX_M):
        return "fma"
    w8a8_min = V.env_int(DENSE_W8A8_MIN_M_ENV, DENSE_W8A8_MIN_M) if w8a8 else 0
    if 0 < w8a8_min <= m:  # an explicit opt-in wins over the mmav default
        return "w8a8"
    table = DENSE_MMAV_WIDE_MAX_M_FAMILY if n >= WIDE_N else DENSE_MMAV_MAX_M_FAMILY
    mmav_max = V.env_int(DENSE_MMAV_MAX_M_ENV, table.get(family, DENSE_MMAV_MAX_M))
    if 1 <= m <= min(mmav_max, DENSE_MMAV_KERNEL_MAX_M):
        return "mmav"
    return "mma"


def w8a8_unsupported_reason(x: torch.Tensor, n: int, k: int) -> str | None:
    """Why vLLM's W8A8 FP8 GEMM cannot take this call (None: it can)."""
    if x.device.type != "cuda":
        return f"it needs a CUDA device (vLLM's cutlass_scaled_mm), got {x.device}"
    if n % 16 or k % 16:
        return f"out_features={n} / in_features={k} must be multiples of 16"
    return _w8a8_device_reason(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _w8a8_device_reason(device_index: int) -> str | None:
    """The per-device part of ``w8a8_unsupported_reason``, asked once per device (not per call)."""
    try:
        from vllm import _custom_ops as ops
    except Exception as e:  # noqa: BLE001 - any import failure means the op is unavailable
        return f"vllm._custom_ops cannot be imported ({type(e).__name__}: {e})"
    major, minor = torch.cuda.get_device_capability(device_index)
    if not ops.cutlass_scaled_mm_supports_fp8(major * 10 + minor):
        return f"vLLM's cutlass_scaled_mm has no FP8 kernel for compute capability {major}.{minor}"
    return None


# ---- conversion ----------------------------------------------------------------------------

def fp8_row_amax(w: torch.Tensor, *, chunk_rows: int = 8192) -> torch.Tensor:
    """fp32 [N]: max |w| of each row of a [N, K] weight (what ``fp8_per_channel_quantize`` scales by);
    +inf for a row holding a non-finite value (so a MAX all-reduce carries it to every rank)."""
    n, k = w.shape
    amax = torch.zeros(n, dtype=torch.float32, device=w.device)
    for r0 in range(0, n if k else 0, chunk_rows):
        amax[r0:r0 + chunk_rows] = torch.nan_to_num(w[r0:r0 + chunk_rows].float().abs().amax(dim=1), nan=float("inf"))
    return amax


def fp8_per_channel_quantize(w: torch.Tensor, *, chunk_rows: int = 8192,
                             row_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16/fp16/fp32 weight [N, K] -> (e4m3 [N, K] float8_e4m3fn, fp32 scale [N]), w ~= codes * scale.

    scale = amax(|row|) / 448, so each row's largest value maps to +-448 (no saturation). An
    all-zero row gets scale 1 and zero codes; a tiny nonzero amax is clamped to the smallest
    normal fp32 scale (never a zero or subnormal divisor). Non-finite weights are an error.
    Rows are converted ``chunk_rows`` at a time (bounded fp32 temporaries: lm_head is 201088 rows).

    ``row_amax`` (fp32 [N], each >= the row's own max |w|): scale by it instead, for a slice of
    wider rows (a row-parallel TP shard scaled by its whole rows' max, so its codes equal the
    unsharded conversion's columns).
    """
    V.check_ndim("w", w, 2, "[out_features, in_features]")
    V.check_dtype("w", w, V.ACT_DTYPES + (torch.float32,))
    n, k = w.shape
    if row_amax is not None:
        V.check_dtype("row_amax", row_amax, (torch.float32,))
        if tuple(row_amax.shape) != (n,):
            raise ValueError(f"row_amax has shape {tuple(row_amax.shape)}; supported: [{n}] (one per row of w)")
        if not bool(torch.isfinite(row_amax).all()):  # a shard elsewhere (another TP rank) is not finite
            bad = torch.nonzero(~torch.isfinite(row_amax)).flatten()[:4].tolist()
            raise ValueError(f"row_amax is not finite in rows {bad}...: the weight has non-finite values in those "
                             "rows (in this shard or another rank's); supported: finite weights")
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    for r0 in range(0, n, chunk_rows):
        rows = w[r0:r0 + chunk_rows].float()
        if not torch.isfinite(rows).all():
            raise ValueError(f"w has non-finite values in rows {r0}..{r0 + rows.shape[0] - 1}; "
                             "supported: finite weights")
        amax = rows.abs().amax(dim=1) if k else torch.zeros(rows.shape[0], device=w.device)
        if row_amax is not None:
            given = row_amax[r0:r0 + chunk_rows].to(amax.device)
            if bool((given < amax).any()):
                raise ValueError(f"row_amax is below max |w| in rows {r0}..{r0 + rows.shape[0] - 1}; supported: "
                                 "row_amax >= each row's max |w| (the max over all of the row's shards)")
            amax = given
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
                     bias: torch.Tensor | None = None, *, path: str = "auto",
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """bf16 [M, N] = x [M, K] bf16 @ (w [N, K] e4m3 * scale [N])^T + bias [N] (fp32 accumulation).

    path: "auto" (``select_path``: the FMA GEMV for few tokens, else the MMA kernel, or vLLM's
    W8A8 GEMM where $VLLM_SM121_DENSE_W8A8_MIN_M says), "fma" (M <= DENSE_FMA_KERNEL_MAX_M only),
    "mma" or "w8a8" (the activations are quantized to e4m3 per token: W8A8 numerics).
    ``out_dtype`` torch.float32: the unrounded fp32 result (a row-parallel shard's partial sum under
    tensor parallelism, rounded to bf16 once after the all-reduce); "auto" then never takes "w8a8".
    """
    if path not in PATHS:
        raise ValueError(f"path={path!r} is not supported; supported: {', '.join(PATHS)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype={out_dtype} is not supported; supported: torch.bfloat16, torch.float32")
    if out_dtype == torch.float32 and path == "w8a8":
        raise ValueError("path='w8a8' writes bf16 only; out_dtype=torch.float32 takes 'auto', 'fma', 'mmav' or 'mma'")
    m, n, k = _check_linear(x, w, scale, bias)
    if path == "fma" and m > DENSE_FMA_KERNEL_MAX_M:
        raise ValueError(f"path='fma' takes at most {DENSE_FMA_KERNEL_MAX_M} tokens, got M={m}")
    if path == "mmav" and m > DENSE_MMAV_KERNEL_MAX_M:
        raise ValueError(f"path='mmav' takes at most {DENSE_MMAV_KERNEL_MAX_M} tokens, got M={m}")
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if path == "auto":
        family = _platform.family_of(x)
        path = select_path(m, n, family)
        if path == "w8a8" and out_dtype == torch.float32:  # W8A8 writes bf16 only: the path without it
            path = select_path(m, n, family, w8a8=False)
    if path == "fma":
        return _dense_fma(x, w, scale, bias, out)
    if path == "mmav":
        return _dense_mmav(x, w, scale, bias, out)
    if path == "w8a8":
        reason = w8a8_unsupported_reason(x, n, k)
        if reason:
            raise ValueError(f"dense FP8 path 'w8a8' (${DENSE_W8A8_MIN_M_ENV} or path='w8a8') is not supported "
                             f"here: {reason}; unset ${DENSE_W8A8_MIN_M_ENV} to use the MMA kernel")
        return _dense_w8a8(x, w, scale, bias)
    return _dense_mma(x, w, scale, bias, out)


def _mma_tiles(x: torch.Tensor, m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the MMA kernel for M tokens, N rows, K."""
    family = _platform.family_of(x)
    if m <= DECODE_MAX_M:
        bm, bn, bk, warps, stages = (DECODE_BLOCK_M, DECODE_BLOCK_N, DECODE_BLOCK_K, DECODE_NUM_WARPS,
                                     DECODE_NUM_STAGES)
    else:
        bm, bn, bk, warps, stages = (PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_BLOCK_K, PREFILL_NUM_WARPS,
                                     PREFILL_NUM_STAGES)
    if m <= DECODE_MAX_M and n >= WIDE_N and family == _platform.SM90:
        bn, bk = WIDE_BLOCK_N, WIDE_BLOCK_K
    if family == _platform.INTERPRETER:  # small tiles keep CPU runs fast
        bn, bk = 16, 32
    return bm, bn, min(bk, V._next_pow2(k)), warps, stages


def _rope_kwargs(rope) -> dict:
    """The rotation's kernel arguments from ``rope`` = (positions, cos_sin_cache, rope_rows, head_size),
    checked by ``dense_fp8_linear_rope`` (none for None)."""
    if rope is None:
        return {}
    positions, cache, rope_rows, head = rope
    return dict(pos_ptr=positions, cs_ptr=cache, stride_cs=cache.stride(0), ROPE=True, ROPE_ROWS=rope_rows, HEAD=head)


def _mma_rope_fits(bn: int, rope_rows: int, head: int) -> bool:
    """The MMA kernel can rotate in its epilogue with BLOCK_N = bn: pairs of runs inside one head's
    halves (bn <= head, rope_rows a multiple of bn) or whole heads (bn a multiple of head)."""
    if bn <= head:  # pairs of runs: every program all rotary or all not
        return bn >= 2 and (head // 2) % (bn // 2) == 0 and rope_rows % bn == 0
    return bn % head == 0  # whole heads: rows past rope_rows (a multiple of head) are left as they are


def _dense_mma(x, w, scale, bias, out, rope=None) -> torch.Tensor:
    """The MMA kernel into ``out``; ``rope`` = (positions, cos_sin_cache, rope_rows, head_size): the
    rotation in its epilogue (``_mma_rope_fits`` of its BLOCK_N, checked by the caller)."""
    (m, k), n = x.shape, w.shape[0]
    bm, bn, bk, warps, stages = _mma_tiles(x, m, n, k)
    _dense_fp8_kernel[(-(-n // bn), -(-m // bm))](
        x, w.view(torch.uint8), scale, bias if bias is not None else scale, out, m, n, x.stride(0), out.stride(0),
        K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None,
        DOT_FP32=_platform.family_of(x) == _platform.INTERPRETER, num_warps=warps, num_stages=stages,
        **_rope_kwargs(rope))
    return out


def _dense_fma(x, w, scale, bias, out, rope=None, kv=None, norm=None) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    tiles = dense_fma_tiles(x, m, n)
    try:  # 4 bf16 as one int64 word: needs row stride and offset multiples of 4 (else one small copy)
        xw = x.view(torch.int64)
    except RuntimeError:
        xw = (x.contiguous() if not x.is_contiguous() else x.clone()).view(torch.int64)
    kw = min(tiles.kw, V._next_pow2(k // 4))
    extra = _rope_kwargs(rope)
    if kv is not None:  # (k_pages, v_pages, slot_mapping), checked by dense_fp8_linear_rope
        kp, vp, slots = kv
        hkv = kp.shape[1]
        extra.update(slot_ptr=slots, k_data_ptr=kp.data, k_scale_ptr=kp.scales.view(torch.uint8), v_data_ptr=vp.data,
                     v_scale_ptr=vp.scales.view(torch.uint8), k_g_ptr=kp.global_scale, v_g_ptr=vp.global_scale,
                     cnt_ptr=split_counters(x.device, 2 * hkv, "qkv_kv"), stride_kd_b=kp.data.stride(0),
                     stride_ks_b=kp.scales.stride(0), stride_vd_b=vp.data.stride(0), stride_vs_b=vp.scales.stride(0),
                     KV_WRITE=True, Q_ROWS=extra["ROPE_ROWS"] - hkv * extra["HEAD"], KV_HEADS=hkv,
                     KV_BLOCK=kp.shape[2])
    grid = -(-n // tiles.rows)
    if norm is not None:  # (NextNormBuffers, eps, residual out [m, K]): x is bufs.u[:m]
        bufs, eps, res = norm
        extra.update(ps_ptr=bufs.psum, norm_eps=float(eps), s_src_ptr=bufs.s, res_out_ptr=res,
                     stride_res_out=res.stride(0), NORM=True, NP_PAD=V._next_pow2(k // NEXT_NORM_CHUNK),
                     COPY_BLOCK=max(NEXT_NORM_CHUNK, V._next_pow2(-(-k // grid))))
    _dense_fp8_fma_kernel[(grid,)](
        xw, w.view(torch.uint8).view(torch.int32), scale, bias if bias is not None else scale, out, n,
        xw.stride(0), out.stride(0), K=k, NT=m, BLOCK_R=tiles.rows, BLOCK_KW=kw, HAS_BIAS=bias is not None,
        X_ROWS=fma_x_rows(tiles, kw), num_warps=tiles.num_warps, **extra,
        **V.pdl_launch(x))  # $VLLM_SM121_PDL: a programmatic dependent
    return out


def mmav_block_t(m: int) -> int:
    """The tensor-core GEMV's token tile for M tokens: 16 (tl.dot's smallest N) up to 16, else 32."""
    return 16 if m <= 16 else 32


def mmav_num_warps(tiles: DenseMmavTiles, block_t: int) -> int:
    """Warps of a tensor-core GEMV launch: the tiles' own, at least 4 with the 32-wide token tile (sm_90a
    SASS of the one-warp 64-row tiles with 32 tokens: 282 spill instructions in qkv's build, none with 4
    warps)."""
    return tiles.num_warps if block_t <= 16 else max(tiles.num_warps, 4)


def _dense_mmav(x, w, scale, bias, out, rope=None) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    tiles = dense_mmav_tiles(x)
    block_t = mmav_block_t(m)
    gpu = _platform.family_of(x) != _platform.INTERPRETER
    split = tiles.splits(n, k, _platform.sm_count(x))
    n_tiles = -(-n // tiles.rows)
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        cnt = split_counters(x.device, n_tiles, "dense")
    else:
        part = cnt = scale  # (unused)
    _dense_fp8_mmav_kernel[(n_tiles, split)](
        x, w.view(torch.uint8), scale, bias if bias is not None else scale, out, part, cnt, m, n, x.stride(0),
        out.stride(0), K=k, BLOCK_N=tiles.rows, BLOCK_K=min(tiles.kb, V._next_pow2(k)), SPLIT=split,
        HAS_BIAS=bias is not None, X_SHIFT=DENSE_MMAV_X_SHIFT, DOT_FP32=not gpu, BLOCK_T=block_t,
        num_warps=mmav_num_warps(tiles, block_t), num_stages=tiles.num_stages, **_rope_kwargs(rope))
    return out


def _rope_tiles_fit(tiles, rope_rows: int, head: int) -> bool:
    """The FMA kernel can rotate in its epilogue: each program's rows pair up inside one head's halves."""
    half = tiles.rows // 2
    return half >= 1 and (head // 2) % half == 0 and rope_rows % tiles.rows == 0


def dense_fp8_linear_rope(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_rows: int, head_size: int,
                          *, path: str = "auto", kv_write: tuple | None = None, norm: tuple | None = None
                          ) -> torch.Tensor:
    """``dense_fp8_linear`` followed by the NeoX rotary embedding of the first ``rope_rows`` outputs
    (gpt-oss's qkv_proj then ``rotary_emb(positions, q, k)``: q and k heads of ``head_size``, the
    rotation over the whole head, ``cos_sin_cache`` [max_position, head_size] = cos then sin halves).

    The rotation runs in the epilogue of the FMA GEMV, the tensor-core GEMV (mmav) and the MMA kernel
    (stop 41) where their tiles pair the rotated rows (``_rope_tiles_fit``, ``_mma_rope_fits``): no
    kernel of its own. Elsewhere (vLLM's W8A8 GEMM, tiles that do not fit) the projection's output is
    rotated afterwards (``rope_neox_``). Numerics as upstream's:
    the bf16 projection rotated with the cache rounded to bf16, fp32 arithmetic, one bf16 rounding.

    ``kv_write=(k_pages, v_pages, slot_mapping)`` (``Nvfp4Pages`` of Hkv heads, int64 slots, -1 =
    skip; opt-in: $VLLM_SM121_KV_IN_QKV=1 in the model hook): the output is gpt-oss's whole qkv
    (N = rope_rows + Hkv * head_size: q and k heads rotated, then the v heads), and each token's k
    and v heads are also written to the pages, the bytes ``fp4_kv_write`` writes. On the FMA path
    the GEMV does it: the program that finishes a head's rows last quantizes the head, so the cache
    write needs no launch of its own; elsewhere ``fp4_kv_write`` runs after the projection.
    """
    m, n, _ = _check_linear(x, w, scale, bias)
    V.check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, head_size]")
    V.check_dtype("cos_sin_cache", cos_sin_cache, (torch.float32, torch.bfloat16))
    V.check_dtype("positions", positions, (torch.int64, torch.int32))
    if (head_size % 2 or cos_sin_cache.shape[1] != head_size or rope_rows % head_size or not 0 < rope_rows <= n
            or cos_sin_cache.stride(1) != 1):
        raise ValueError(f"rotary embedding: head_size={head_size}, rope_rows={rope_rows} (N={n}), cos_sin_cache "
                         f"{tuple(cos_sin_cache.shape)} are not supported; supported: an even head size, rope_rows a "
                         "positive multiple of it <= N, a [max_position, head_size] cache with a contiguous last "
                         "dimension (rotation over the whole head, NeoX halves)")
    if positions.shape != (m,) or positions.stride(0) != 1:
        raise ValueError(f"positions must be a contiguous [{m}] tensor (one per token), got {tuple(positions.shape)}")
    if kv_write is not None:
        _check_kv_write(kv_write, m, n, rope_rows, head_size, x.device)
    if path == "auto":
        path = select_path(m, n, _platform.family_of(x))
    if path == "fma" and m <= DENSE_FMA_KERNEL_MAX_M and _rope_tiles_fit(dense_fma_tiles(x, m, n), rope_rows,
                                                                        head_size):
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        if m == 0:
            return out
        return _dense_fma(x, w, scale, bias, out, rope=(positions, cos_sin_cache, rope_rows, head_size),
                          kv=None if kv_write is None else (*kv_write[:2], kv_write[2][:m]), norm=norm)
    if norm is not None:  # (dense_fp8_linear_rope_norm calls with it on the FMA path only)
        raise ValueError("norm: the carried input norm runs on the FMA path only")
    rope = (positions, cos_sin_cache, rope_rows, head_size)
    if path == "mmav" and m <= DENSE_MMAV_KERNEL_MAX_M and _rope_tiles_fit(dense_mmav_tiles(x), rope_rows, head_size):
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        if m:  # the rotation in the GEMV's epilogue
            out = _dense_mmav(x, w, scale, bias, out, rope=rope)
    elif path == "mma" and _mma_rope_fits(_mma_tiles(x, m, n, x.shape[1])[1], rope_rows, head_size):
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        if m:  # the rotation in the MMA kernel's epilogue (stop 41; torch's ~10 kernels before)
            out = _dense_mma(x, w, scale, bias, out, rope=rope)
    else:
        out = rope_neox_(dense_fp8_linear(x, w, scale, bias, path=path), positions, cos_sin_cache, rope_rows,
                         head_size)
    if kv_write is not None and m:  # off the FMA path: one write launch after the projection
        from .fp4_kv import fp4_kv_write

        kp, vp, slots = kv_write
        fp4_kv_write(*qkv_kv_heads(out, rope_rows, kp.shape[1], head_size), kp, vp, slots[:m])
    return out


def dense_fp8_linear_rope_norm(bufs: NextNormBuffers, m: int, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                               scale: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                               cos_sin_cache: torch.Tensor, rope_rows: int, head_size: int, *,
                               path: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``dense_fp8_linear_rope`` of the layer's input norm carried from the previous layer's FC2
    (``kernels/next_norm.py``; m <= NEXT_NORM_MAX_T tokens, in ``bufs`` rows 0 .. m-1): returns (qkv
    [m, N], the residual [m, H] = s). On the FMA path the GEMV reads ``u``, applies each token's
    1 / rms in its epilogue and copies ``s``; elsewhere upstream's norm output is rebuilt from the
    buffers (``normed_torch``) and projected."""
    if not 0 <= m <= NEXT_NORM_MAX_T:
        raise ValueError(f"the carried input norm takes up to {NEXT_NORM_MAX_T} tokens, got {m}")
    h = bufs.s.shape[1]
    if w.shape[-1] != h or norm_weight.shape != (h,):
        raise ValueError(f"the carried input norm has hidden size {h}; the weight is {tuple(w.shape)} and the norm "
                         f"weight {tuple(norm_weight.shape)}")
    res = torch.empty(m, h, dtype=torch.bfloat16, device=bufs.s.device)
    u = bufs.u[:m]
    if path == "auto":
        path = select_path(m, w.shape[0], _platform.family_of(u))
    if path == "fma" and _rope_tiles_fit(dense_fma_tiles(u, m, w.shape[0]), rope_rows, head_size):
        out = dense_fp8_linear_rope(u, w, scale, bias, positions, cos_sin_cache, rope_rows, head_size, path="fma",
                                    norm=(bufs, eps, res))
        return out, res
    res.copy_(bufs.s[:m])
    y = normed_torch(bufs, m, norm_weight, eps)
    return dense_fp8_linear_rope(y, w, scale, bias, positions, cos_sin_cache, rope_rows, head_size, path=path), res


def qkv_kv_heads(qkv: torch.Tensor, rope_rows: int, num_kv_heads: int, head_size: int):
    """Views (k, v) [T, num_kv_heads, head_size] of gpt-oss's qkv output [T, N] (q and k heads in the
    first ``rope_rows`` columns, then the v heads): what the KV cache write takes."""
    m, q = qkv.shape[0], rope_rows - num_kv_heads * head_size
    return (qkv[:, q:rope_rows].view(m, num_kv_heads, head_size),
            qkv[:, rope_rows:rope_rows + num_kv_heads * head_size].view(m, num_kv_heads, head_size))


def _check_kv_write(kv_write, m: int, n: int, rope_rows: int, head_size: int, device) -> None:
    from .fp4_kv import Nvfp4Pages

    if not (isinstance(kv_write, tuple) and len(kv_write) == 3):
        raise ValueError("kv_write must be (k_pages, v_pages, slot_mapping)")
    kp, vp, slots = kv_write
    if not (isinstance(kp, Nvfp4Pages) and isinstance(vp, Nvfp4Pages)) or kp.shape != vp.shape:
        raise ValueError("kv_write: k_pages and v_pages must be Nvfp4Pages of one shape (the nvfp4 KV cache)")
    hkv = kp.shape[1]
    if kp.shape[3] != head_size or n != rope_rows + hkv * head_size or rope_rows <= hkv * head_size:
        raise ValueError(f"kv_write: N={n} must be q + k + v heads of head_size={head_size} with rope_rows={rope_rows} "
                         f"(q and k) and {hkv} KV heads of {kp.shape[3]} in the pages")
    if slots.dtype != torch.int64 or slots.dim() != 1 or slots.shape[0] < m or slots.device != device:
        raise ValueError(f"kv_write: slot_mapping must be int64 [>= {m}] on {device}, got {slots.dtype} "
                         f"{tuple(slots.shape)} on {slots.device}")


def rope_neox_(out: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_rows: int,
               head_size: int) -> torch.Tensor:
    """In place on bf16 ``out`` [M, N]: NeoX rotation of columns [0, rope_rows) as heads of
    ``head_size`` (upstream's ``RotaryEmbedding.forward_native`` numerics: cache in bf16, fp32
    arithmetic, one rounding). Returns ``out``; also the reference of the fused epilogue."""
    m = out.shape[0]
    if m == 0:
        return out
    half = head_size // 2
    cs = cos_sin_cache.index_select(0, positions.long()).to(torch.bfloat16).float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x = out[:, :rope_rows].view(m, rope_rows // head_size, head_size).float()
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out[:, :rope_rows] = rot.reshape(m, rope_rows).to(torch.bfloat16)
    return out


def _dense_w8a8(x, w, scale, bias) -> torch.Tensor:
    from vllm import _custom_ops as ops

    xq, xs = ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    b = bias.to(torch.bfloat16) if bias is not None and bias.dtype != torch.bfloat16 else bias
    return ops.cutlass_scaled_mm(xq, w.view(torch.float8_e4m3fn).t(), xs, scale.view(-1, 1), torch.bfloat16, b)


def w8a8_activation_quantize_torch(x: torch.Tensor) -> torch.Tensor:
    """What the w8a8 path multiplies: x rounded to e4m3 with one fp32 scale per token (amax / 448),
    dequantized (fp32). Reference for the kernel-error check of that path."""
    xf = x.float()
    s = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s


def dense_fp8_linear_torch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of ``dense_fp8_linear`` in fp32 (on the dequantized weights: kernel error only)."""
    y = x.float() @ fp8_per_channel_dequantize(w.view(torch.float8_e4m3fn), scale).T
    return y + bias.float() if bias is not None else y
