"""gpt-oss MoE block: routing, FC1 (MXFP8 x MXFP4) + bias + SwiGLU -> MXFP8, FC2 + bias, routing-weighted sum over the top-k -> bf16; references.

Architecture
    ``moe_block`` runs the whole routed-expert block from bf16 (or MXFP8) activations and bf16
    router logits: ``moe_route`` (top-k, softmax over the selected, as gpt-oss; NaN/inf-safe), then
    for small token counts the decode kernels ``moe_fc1_swiglu`` / ``moe_fc2_combine`` and for
    large ones the grouped GEMMs ``moe_fc1_swiglu_grouped`` / ``moe_fc2_grouped`` over pairs sorted
    by expert (``moe_align``: one Triton launch up to ALIGN_TRITON_MAX_PAIRS pairs, torch ops above). Every path is graph-capturable: no
    host sync, shapes depend only on the token count.

    Prefill (grouped, ``moe_details/_moe_grouped.py``): swap-AB GEMMs, weight rows as the MMA's M
    and each expert's tokens as its N in tiles of 16..128 (GroupedTiles: GROUPED_TILES per family
    and average pairs per expert, $VLLM_SM121_MOE_GROUPED_TILE at call time), both operands
    decoded to exact bf16 with integer ops in registers (the weight tile is wgmma's / mma.sync's
    register A operand); bf16 x is quantized to MXFP8 in the routing launch.

    Decode for M <= FMA_MAX_TOKENS (4) tokens ("fma", ``moe_fc1_swiglu_fma`` /
    ``moe_fc2_combine_fma``, ``moe_details/_moe_fma.py``): the same 4 launches and numbers on CUDA
    cores, no MMA and no token padding: program (routed slot, tile of FmaTiles.fc1_rows = 64
    weight rows) streams its expert's rows once as 16-byte words (32 e2m1 values = one e8m0
    group per thread), decodes them with 3 integer ops per value, FMAs them with each routed
    token's e4m3 activations (decoded the same way) and reduces with ``tl.sum``; a slot whose
    expert an earlier slot has exits. Tiles per family in FMA_TILES, overridable at call time
    with $VLLM_SM121_MOE_FMA_TILES; ``select_path`` picks the path from M and the device (on sm_90
    also M <= 16, each program serving up to 4 of its expert's tokens: FMA_WINDOW_MAX_TOKENS).

    Decode (bandwidth-bound grouped GEMVs, 4 launches): ``moe_route`` also quantizes bf16 x to
    MXFP8; FC1 and FC2 run one program per (routed slot, row tile, block of 16 tokens) -- a slot
    whose expert an earlier slot of the block already has exits, so each routed expert's weights
    are streamed exactly once per 16 tokens, by 90 programs per GEMM at gpt-oss shapes -- with
    tokens as the N of ``tl.dot_scaled`` (e2m1 weights x e4m3 activations as stored, wide
    cp.async loads); FC2 writes fp32 partials per (token, slot) and ``_moe_combine_kernel`` sums
    them in slot order into bf16. On the interpreter the same kernels dequantize to fp32 and use
    ``tl.dot`` (no dot_scaled there) and round to e4m3 in software (DOT_SCALED / HW_FP8 off).

    Weights are the gpt-oss checkpoint layout as loaded (``w13_weight`` [E, 2I, K/2] uint8 e2m1
    pairs, low nibble first; ``w13_weight_scale`` [E, 2I, K/32] e8m0; bias [E, 2I]; gate/up rows
    interleaved; ``w2_*`` [E, H, I/2], [E, H, I/32], [E, H]). FC1 takes MXFP8 activations (what
    the fused norm emits, ``norm_mxfp8.py``) or bf16 ones, which it quantizes to MXFP8 in
    registers (no quantized copy is written, no quantization kernel runs); its epilogue applies
    gpt-oss's SwiGLU (gate clamped to <= 7, up to [-7, 7], ``(up + 1) * gate * sigmoid(1.702 *
    gate)``) and writes MXFP8 for FC2.

Instructions (``python -m vllm_sm121.kernels.aot``): decode ``tl.dot_scaled`` lowers to Triton's
    e2m1/e4m3 -> bf16 upcast + ``mma.sync.aligned.m16n8k16.bf16`` on sm_121a (``wgmma m64n16k16``
    for FC1 on sm_90a), weights via 16-byte ``cp.async.cg``, SwiGLU -> e4m3 via
    ``cvt.rn.satfinite.e4m3x2.f32``; the grouped kernels' bf16 ``tl.dot`` becomes
    ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` on sm_121a and
    ``wgmma.mma_async ... m64n{BLOCK_M}k16.f32.bf16.bf16`` (A from registers) on sm_90a.

Limitations
    Status: the first decode kernels (CUDA-core row dots) matched the reference on an H200 but
    ran at 3% of copy bandwidth; the dot_scaled GEMVs replacing them took 121 us per
    gpt-oss-120b layer at M = 1 on an H100 (436 GB/s). The FMA GEMVs (GPU-tested on an H100 at
    gpt-oss-120b/20b shapes, M = 1..4) take 52.8 / 98.4 / 179.6 us at M = 1 / 2 / 4 there
    against 123.8 / 212.9 / 367.8 us for the dot_scaled ones (33-36% of copy bandwidth: FC1 at
    ~42%, FC2 + combine at ~30%; FMA_TILES). Tensor / expert parallel shards (``moe_block``'s
    ``expert_map``) matched the unsharded block on the interpreter and, in vLLM at TP=2 / EP=2,
    TP=1 within the spread of that configuration on two H100s; their speed was not measured
    separately. The swap-AB grouped GEMMs match the reference on an H100 (M = 16..2048) and run
    M = 512 in 1.35 ms per gpt-oss-120b layer there (the kernels they replaced: 5.7 ms; vLLM's
    ``triton_kernels``: 0.90 ms; GROUPED_TILES from that sweep, sm_12x untimed). e8m0
    byte 0 (2**-127) is read as 2**-126 (only all-zero blocks use it).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch
import triton

from vllm_sm121 import platform as _platform

from . import _validate as V
from . import l2_prefetch
from .moe_details._moe_align import _moe_align_kernel
from .moe_details._moe_fc1 import _moe_fc1_swiglu_kernel
from .moe_details._moe_fc2 import _moe_combine_kernel, _moe_fc2_kernel
from .moe_details._moe_fma import _moe_fc1_swiglu_fma_kernel, _moe_fc2_fma_kernel
from .moe_details._moe_grouped import _moe_fc1_grouped_kernel, _moe_fc2_grouped_kernel
from .moe_details._moe_route import _moe_route_kernel
from .next_norm import NEXT_NORM_CHUNK, NextNorm, next_norm_torch
from .nvfp4 import E2M1_VALUES

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def _check_fc1(a, a_scale, w13, w13_scale, bias, topk_ids) -> tuple[int, int, int, int, int]:
    V.check_ndim("a", a, 2, "[num_tokens, hidden]")
    V.check_ndim("w13", w13, 3, "[num_experts, 2 * intermediate, hidden / 2]")
    V.check_ndim("topk_ids", topk_ids, 2, "[num_tokens, topk]")
    V.check_dtype("a", a, V.FP8_DTYPES + (torch.bfloat16,))
    V.check_dtype("w13", w13, (torch.uint8,))
    V.check_dtype("topk_ids", topk_ids, (torch.int32,))
    m, k = a.shape
    e, two_i, k_half = w13.shape
    i = two_i // 2
    if k % 64 or k_half * 2 != k or i % 32:
        raise ValueError(f"hidden={k} (w13 holds {k_half * 2}) and intermediate={i} are not supported; "
                         "supported: hidden a multiple of 64 matching w13, intermediate a multiple of 32")
    mxfp8 = a.dtype != torch.bfloat16
    if mxfp8 and (a_scale is None or a_scale.shape != (m, k // 32)):
        raise ValueError(f"MXFP8 activations need a_scale [{m}, {k // 32}] uint8, got "
                         f"{None if a_scale is None else tuple(a_scale.shape)}")
    if w13_scale.shape != (e, two_i, k // 32) or bias.shape != (e, two_i) or topk_ids.shape[0] != m:
        raise ValueError(f"w13_scale={tuple(w13_scale.shape)}, bias={tuple(bias.shape)} or "
                         f"topk_ids={tuple(topk_ids.shape)} disagree with a={tuple(a.shape)}, w13={tuple(w13.shape)}")
    V.check_last_dim_contiguous("a", a)
    if a.stride(0) != k:
        raise ValueError(f"a must be contiguous [num_tokens, hidden], got strides {a.stride()}")
    return m, k, e, i, topk_ids.shape[1]


def _gpu_flags(t: torch.Tensor) -> dict:
    """DOT_SCALED / HW_FP8: tl.dot_scaled and hardware e4m3 rounding on a GPU; the interpreter
    has no dot_scaled and rounds fp32 -> e4m3 wrongly, so CPU runs take the software paths."""
    gpu = _platform.family_of(t) != _platform.INTERPRETER
    return dict(DOT_SCALED=gpu, HW_FP8=gpu)


# Decode-kernel tiles (performance hyper-parameters). Tokens are the MMA's N (DECODE_BLOCK_M,
# the smallest tl.dot tile); FC1 programs own 2 * 32 weight rows (32 SwiGLU outputs = one MXFP8
# block), FC2 programs 32 rows of H: at gpt-oss-120b shapes and M = 1 that is 4 x 90 programs
# per GEMM, each streaming 49-98 KB of weights in BLOCK_K = 256 steps (128 B per row per step).
DECODE_BLOCK_M = 16
DECODE_FC1_BLOCK_N = 32
DECODE_FC2_BLOCK_N = 32
DECODE_BLOCK_K = 256
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3


def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [M, K] -> (e4m3 [M, K], e8m0 [M, K/32]) in one small kernel (the same numbers as
    ``norm_mxfp8.mxfp8_quantize_torch``)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, k // 32, dtype=torch.uint8, device=x.device)
    if m:
        _moe_route_kernel[(m,)](x, q, q, x, q, s, q, 0, E=1, E_PAD=1, TOPK=1, TOPK_PAD=1, K=k,
                                BLOCK_K=min(512, triton.next_power_of_2(k)), ROUTE=False, QUANT=True,
                                HW_FP8=_gpu_flags(x)["HW_FP8"], num_warps=4)
    return q.view(torch.float8_e4m3fn), s


def moe_fc1_swiglu(a: torch.Tensor, a_scale: torch.Tensor | None, w13: torch.Tensor, w13_scale: torch.Tensor,
                   bias: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode FC1. a [M, K]: e4m3 with a_scale [M, K/32] e8m0, or bf16 (a_scale None: quantized
    to MXFP8 first). Returns (h [M*topk, I] e4m3, h_scale [M*topk, I/32] e8m0), row = token * topk + slot.

    Grid (slot, row tile, token block): each routed expert's rows are streamed once per block of
    DECODE_BLOCK_M tokens (programs whose expert an earlier slot of the block has exit at once).
    """
    m, k, e, i, topk = _check_fc1(a, a_scale, w13, w13_scale, bias, topk_ids)
    if a.dtype == torch.bfloat16:
        a, a_scale = mxfp8_quantize(a)
    out = torch.empty(m * topk, i, dtype=torch.uint8, device=a.device)
    out_scale = torch.empty(m * topk, i // 32, dtype=torch.uint8, device=a.device)
    bm, bn = DECODE_BLOCK_M, DECODE_FC1_BLOCK_N
    if m:
        _moe_fc1_swiglu_kernel[(min(m, bm) * topk, i // bn, -(-m // bm))](
            a.view(torch.uint8), a_scale, w13, w13_scale, bias, topk_ids, out, out_scale, m,
            E=e, K=k, I=i, TOPK=topk, TOPK_PAD=triton.next_power_of_2(topk), BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=min(DECODE_BLOCK_K, triton.next_power_of_2(k)), ALPHA=SWIGLU_ALPHA, LIMIT=SWIGLU_LIMIT,
            **_gpu_flags(a), num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES)
    return out.view(torch.float8_e4m3fn), out_scale


# ---- decode for very few tokens: CUDA-core (FMA) grouped GEMVs ------------------------------------

# Most tokens an FMA program holds (its accumulators are unrolled per token).
FMA_KERNEL_MAX_TOKENS = 4
# Most tokens one FMA launch takes: above FMA_KERNEL_MAX_TOKENS each program serves a window of
# that many of its expert's users (``_mx.routed_tokens``), so an expert routed to by several tokens
# is streamed once per 4 of them, not once per chunk of tokens it appears in.
FMA_LAUNCH_MAX_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class FmaTiles:
    """Tiles of the FMA decode kernels (performance hyper-parameters)."""

    fc1_rows: int  # FC1 weight rows per program: a power of two >= 64 (32 SwiGLU outputs = 1 MXFP8 block per 64)
    fc1_kb: int  # bytes of each row per K step: a power of two >= 16 (16 bytes = 32 values = 1 scale group)
    fc2_rows: int  # FC2 rows of H per program: a power of two
    fc2_kb: int
    num_warps: int
    num_stages: int  # 1: plain loop; 2: the next K step's weights are loaded before this step's math;
    # >= 3: the weight tiles come through a TMA pipeline of that many shared-memory stages (sm_90+)
    fc2_num_warps: int | None = None  # None: num_warps
    fc2_num_stages: int | None = None  # None: num_stages
    fc2_split: int = 1  # FC2 split-K: fp32 partials per (token, slot, split), summed in order by the combine
    fc1_split: int = 1  # FC1 split-K: fp32 partials per (tile, split), summed in order by the last split to finish

    def __post_init__(self):
        def pow2(v):
            return v > 0 and v & (v - 1) == 0

        if not (pow2(self.fc1_rows) and self.fc1_rows >= 64 and pow2(self.fc2_rows) and pow2(self.fc1_kb)
                and self.fc1_kb >= 16 and pow2(self.fc2_kb) and self.fc2_kb >= 16):
            raise ValueError(f"{self}: rows and kb must be powers of two, fc1_rows >= 64, kb >= 16")
        for w in (self.num_warps, self.fc2_num_warps):
            if w is not None and w not in (1, 2, 4, 8, 16, 32):
                raise ValueError(f"{self}: num_warps must be a power of two <= 32")
        for st in (self.num_stages, self.fc2_num_stages):
            if st is not None and not 1 <= st <= 8:
                raise ValueError(f"{self}: stages must be in 1..8 (1 plain, 2 register prefetch, >= 3 TMA)")
        if not (1 <= self.fc2_split <= 16 and 1 <= self.fc1_split <= 16):
            raise ValueError(f"{self}: fc2_split and fc1_split must be in 1..16")

    @classmethod
    def parse(cls, text: str) -> FmaTiles:
        """"fc1_rows,fc1_kb,fc2_rows,fc2_kb,warps,stages[,fc2_warps,fc2_stages[,fc2_split[,fc1_split]]]"
        (the env format; fc2_warps / fc2_stages 0: as warps / stages)."""
        vals = V.parse_ints(FMA_TILES_ENV, text, (6, 8, 9, 10), "fc1_rows,fc1_kb,fc2_rows,fc2_kb,warps,stages"
                            "[,fc2_warps,fc2_stages[,fc2_split[,fc1_split]]]")
        if len(vals) > 6:
            vals[6] = vals[6] or None
            vals[7] = vals[7] or None
        return cls(*vals)

    def spec(self) -> str:
        s = f"{self.fc1_rows},{self.fc1_kb},{self.fc2_rows},{self.fc2_kb},{self.num_warps},{self.num_stages}"
        if self.fc2_num_warps or self.fc2_num_stages or self.fc2_split > 1 or self.fc1_split > 1:
            s += f",{self.fc2_num_warps or 0},{self.fc2_num_stages or 0}"
        if self.fc2_split > 1 or self.fc1_split > 1:
            s += f",{self.fc2_split}"
        return s + (f",{self.fc1_split}" if self.fc1_split > 1 else "")

    def fc2_launch(self) -> tuple[int, int]:
        return self.fc2_num_warps or self.num_warps, self.fc2_num_stages or self.num_stages


# performance hyper-parameters, per (architecture family, 1 token or 2..4 tokens). sm_90: the
# fastest of benchmarks/moe.py --fma-tiles on an H100 (2026-11-26, gpt-oss-120b layer, cold L2,
# whole block / FC1 / FC2+combine, us; sm121_decode took 123.8 / 212.9 / 367.8 us at M = 1 / 2 / 4):
#   M=1  64,256,32,256,4,1        52.8 / 28.3 / 20.4  (8 fc1 warps: 53.4; 512-byte steps: 57.3)
#   M=2  64,256,32,256,8,2,4,2    98.4 / 62.7 / 38.7  (4 fc1 warps: 133.2: 232 registers with 2+ tokens)
#   M=4  64,256,32,256,8,2,4,2   179.6 / 115.6 / 69.0
# fc2_split (split-K of FC2), H100 at bd8218e (docs/logs/moe-fma-split-sweep-h100-bd8218e.txt): no
# gain (M=1 52.7 us with 1 or 4 splits; M=2/4 slower with splits: 104.5/191.6 at 2, 108.0/203.0
# at 4 vs 99.9/179.7 for the unsplit default tiles in the same run), so it stays 1; vLLM's triton_kernels MoE in that run: 66.3 / 83.9 /
# 142.5 us at M = 1 / 2 / 4 (ours wins at M = 1 only). sm_12x: the sm_90
# choice (not measured: no GB10 here). The interpreter gets small tiles (its cost grows with
# the tile). Overridden at call time, for every M, by
# fc1_split (FC1 split-K, last-arriving split does the epilogue), H200 at a584fa0, in-graph timing
# (docs/moe-fc1-split-sweep-h200-a584fa0.json): no gain (FC1 at M=1 24.0 us unsplit, 25.8 / 27.7 /
# 27.6 with 2 / 3 / 6 splits; slower at M=2/4): at 159 registers per thread 3 CTAs fit an SM, so
# more programs mean more waves, not more bytes in flight. It stays 1.
# VLLM_SM121_MOE_FMA_TILES="fc1_rows,fc1_kb,fc2_rows,fc2_kb,warps,stages[,fc2_warps,fc2_stages[,fc2_split[,fc1_split]]]"
# (benchmarks/moe.py --fma-tiles sweeps it).
FMA_TILES: dict[tuple[str, int], FmaTiles] = {
    (_platform.SM90, 1): FmaTiles(64, 256, 32, 256, 4, 1),
    (_platform.SM90, 2): FmaTiles(64, 256, 32, 256, 8, 2, 4, 2),
    (_platform.SM12X, 1): FmaTiles(64, 256, 32, 256, 4, 1),
    (_platform.SM12X, 2): FmaTiles(64, 256, 32, 256, 8, 2, 4, 2),
    (_platform.INTERPRETER, 1): FmaTiles(64, 32, 16, 32, 4, 1),
    (_platform.INTERPRETER, 2): FmaTiles(64, 32, 16, 32, 4, 1),
}
FMA_TILES_ENV = "VLLM_SM121_MOE_FMA_TILES"


# The tiles with packed fp16 products (VLLM_SM121_MOE_FMA_F16X2=1): fewer instructions per value
# leave room for the register prefetch of the next step, and 4 warps win at every M. H200, in-graph
# timing (benchmarks/moe.py --in-graph 10), beb4e57, docs/moe-fma-f16x2-sweep-h200-beb4e57.json,
# whole block / FC1 / FC2 + combine, us:
#   M=1  64,256,32,256,4,1   48.0 / 20.3 / 21.1     64,256,32,256,4,2   41.7 / 20.6 / 14.7
#   M=2  64,256,32,256,8,2,4,2  73.7 / 47.9 / 23.4  64,256,32,256,4,2   67.1 / 40.8 / 23.5
#   M=4  64,256,32,256,8,2,4,2 140.0 / 87.5 / 53.9  64,256,32,256,4,2  135.7 / 80.1 / 53.8
# (vLLM's triton_kernels MoE in that run: 60.2 / 75.1 / 116.4 us; Marlin on the same card 56.9 /
# 78.1 / 114.9). sm_90 since fa352d2 (H200, docs/moe-f16split-sweep-h200-fa352d2.json): the same
# tile with a 3-stage TMA pipeline for the weights, 40.2 / 68.8 / 125.8 us at M = 1 / 2 / 4 against
# 42.0 / 67.3 / 136.3 for register prefetch in that run; FC1 split-K (2-4 splits) and other FC2
# tiles were slower. sm_12x: register prefetch (the TMA tiles are not measured off sm_90).
FMA_TILES_F16X2: dict[tuple[str, int], FmaTiles] = {
    (_platform.SM90, 1): FmaTiles(64, 256, 32, 256, 4, 3),
    (_platform.SM90, 2): FmaTiles(64, 256, 32, 256, 4, 3),
    (_platform.SM12X, 1): FmaTiles(64, 256, 32, 256, 4, 2),
    (_platform.SM12X, 2): FmaTiles(64, 256, 32, 256, 4, 2),
}


def fma_tiles(t: torch.Tensor, m: int = 1) -> FmaTiles:
    """The FMA kernels' tiles for M tokens on ``t``'s device: $VLLM_SM121_MOE_FMA_TILES if set,
    else FMA_TILES_F16X2 (packed fp16 products on) or FMA_TILES at (family, 1 if M == 1 else 2)."""
    env = os.environ.get(FMA_TILES_ENV, "").strip()
    if env:
        return FmaTiles.parse(env)
    table = FMA_TILES_F16X2 if fma_f16x2(t) else FMA_TILES
    return table[(_platform.family_of(t), 1 if m <= 1 else 2)]


# The FMA GEMVs' products. On a GPU the default is packed fp16 products: ~3.1
# instead of ~5.2 sm_90a instructions per weight value; VLLM_SM121_MOE_FMA_F16X2=0 (read at call
# time) selects the exact fp32 integer decode (``_moe_fma.py``), which the interpreter always runs
# (it cannot run inline PTX). The history that made it the default:
# H200, gpt-oss-120b layer, dbee2b3 (docs/moe-fma-f16x2-h200-dbee2b3.json): no faster at M = 1
# (latency-bound: 53.4 vs 51.7 us at 5ce6f3e), 1.23-1.25x at M = 2..8 (78.8 / 145.2 / 263.0 vs
# 96.8 / 177.6 / 328.6 us), but each 8-term word sum is rounded to fp16 once, and the MXFP8
# rounding of FC1's output turns that into block rel L2 ~3e-3 against the exact path (MXFP8
# activations themselves are ~4e-2 from bf16). On that run it broke the exact path's test rules:
# FC1 outputs within one e4m3 step of the reference (8 of 8 gpt-oss-shape cases) and the 5e-3
# block bound (2 of 16), so it was opt-in at first. Timed in-graph (no host launch latency) with its own
# tiles (FMA_TILES_F16X2: register prefetch, 4 warps), H200, beb4e57: 41.7 / 67.1 / 135.7 us at
# M = 1 / 2 / 4 vs 47.0 / 92.0 / 172.4 for the exact path's defaults (556381a, the same kind of
# card), and gpt-oss-120b batch-1 decode with it, fused routing and fused combine (e2e config
# sm121-all-moe-f16x2) 339.7 tok/s vs upstream's 247.1 on one H200 in one run (fa352d2, two
# runs: 329.8 vs 245.1 and 338.7 vs 230.6). Made the default after that: faster at every M the FMA
# path takes, and its error against the exact products (block rel L2 ~3e-3, its GPU test's bound
# 1e-2) is a tenth of what MXFP8 activations already cost against bf16. The exact-rule kernel
# tests pin VLLM_SM121_MOE_FMA_F16X2=0.
FMA_F16X2_ENV = "VLLM_SM121_MOE_FMA_F16X2"
# =2 (opt-in, stop 31): each 32-value group's products in one fp16x2 chain (``_moe_fma._dot32_f16``:
# 18 instead of 27 instructions per group, the group's partial sums rounded to fp16). One H200,
# 096aea5 (docs/logs/f16group-h200-096aea5.log, moe_probe --rotate, M = 1), mode 1 / 2, cold / hot us:
# FC1 15.9 / 13.3 vs 14.4 / 12.3 (-1.5 us cold), FC2 + combine 11.4 / 9.6 vs 11.5 / 10.1; block rel
# L2 against the exact products 4.8e-3 (M = 1, 4) and 7.4e-3 (M = 3, split-K tiles) vs 3.1-4.2e-3
# for mode 1 (GPU test bound 1e-2; docs/logs/moetests-f16group-h200-096aea5.log). Opt-in until an
# end-to-end run. Stop 33 ran it end to end with the carried norm: 0.966 of the step time of mode 1 on one
# H200 (e16211b), after 0.980 at stop 32 (one card, 94bb348): the default on a GPU since stop 34.


def fma_f16x2(t: torch.Tensor) -> int:
    """0: exact fp32 products, 1: packed fp16 products per word, 2: per 32-value group (the GPU default)."""
    if _platform.family_of(t) == _platform.INTERPRETER:
        return 0
    v = V.env_int(FMA_F16X2_ENV, 2)
    if v not in (0, 1, 2):
        raise ValueError(f"${FMA_F16X2_ENV}={v}: supported: 0 (exact fp32 products), 1 (packed fp16 products per "
                         "8-value word), 2 (per 32-value group, the default)")
    return v


# A register cap for the FMA GEMVs (opt-in, VLLM_SM121_MOE_FMA_MAXNREG=<n>, read at call time; GPU
# only): ptxas' maxnreg. sm_90a, FC1 at the M=1 tiles: 159 registers (3 CTAs of 4 warps per SM);
# capped at 128 (4 CTAs per SM) its K loop keeps its 1337 instructions with 0 spill stores and 3
# spill reloads (checked offline with ptxas, 2026-11-27). Timed on an H200 (556381a,
# docs/moe-tma-sweep-maxnreg128-h200-556381a.json): no gain at M = 1 (47.1 vs 46.6 us), much slower
# with 2+ tokens (92.0 -> 169.6 us at M = 2 for the default tiles: the capped kernels spill). With the packed fp16
# products and their tiles FC1 takes 144 registers uncapped, and capped at 128 its K loop has 0 spill
# stores and 1 reload (offline): untimed (gpu_session step moef16split, with FC1 split-K).
FMA_MAXNREG_ENV = "VLLM_SM121_MOE_FMA_MAXNREG"


def fma_maxnreg(t: torch.Tensor) -> dict:
    """Launch options for $VLLM_SM121_MOE_FMA_MAXNREG on ``t``'s device: {} when unset or on the CPU."""
    n = V.env_int(FMA_MAXNREG_ENV, 0)
    if n == 0 or _platform.family_of(t) == _platform.INTERPRETER:
        return {}
    if not 24 <= n <= 255:
        raise ValueError(f"{FMA_MAXNREG_ENV}={n}: registers per thread must be in 24..255 (0: no cap)")
    return dict(maxnreg=n)


# Routing inside the FMA FC1 ($VLLM_SM121_MOE_FUSED_ROUTE, read at call time): for M <= 4 tokens
# with MXFP8 activations (the fused norm's), every FC1 program routes the tokens itself
# (``_moe_route.route_rows``, the routing kernel's code: the same ids and weights) and one of them
# writes ids and weights for FC2, so the routing launch goes. Not with VLLM_SM121_MOE_PDL (FC2 would
# read the routing before waiting for FC1, which now writes it). H200, in-graph, MXFP8 input
# (docs/logs/moefused-h200-556381a-beb4e57.log): ~0.5 us faster at M = 1, slower with more tokens
# (every program routes every token: 95.4 vs 88.0 us at M = 2). Unset: on at one token (without
# PDL), off with more; 1: every M <= 4; 0: off. The default since stop 27: gpt-oss-120b batch 1
# on an H200 (0f84732) ran 408.6 tok/s with both fusions vs 386.0 without.
FUSED_ROUTE_ENV = "VLLM_SM121_MOE_FUSED_ROUTE"


def fused_route(m: int, t: torch.Tensor) -> bool:
    """Whether FC1 routes ``m`` tokens itself ($VLLM_SM121_MOE_FUSED_ROUTE; see above)."""
    v = V.env_int(FUSED_ROUTE_ENV, -1)
    if v < 0:
        return m == 1 and not moe_pdl(t)
    return v != 0  # (moe_fc1_swiglu_fma refuses it together with PDL)


# The combine inside FC2 ($VLLM_SM121_MOE_FUSED_COMBINE, read at call time): the last FC2 program
# of each row tile to finish sums the partials in the combine kernel's order
# (``_moe_fma._combine_when_last``: bit-identical output), so the combine launch goes. Same run:
# ~1 us faster at M = 1 (41.4 vs 42.2 us), neutral at M = 2, slower at M = 4 (172.2 vs 167.9 us).
# Unset: on at one token, off with more; 1: every M <= 4; 0: off.
FUSED_COMBINE_ENV = "VLLM_SM121_MOE_FUSED_COMBINE"


def fused_combine(m: int) -> bool:
    """Whether FC2 combines ``m`` tokens itself ($VLLM_SM121_MOE_FUSED_COMBINE; see above)."""
    v = V.env_int(FUSED_COMBINE_ENV, -1)
    return m == 1 if v < 0 else v != 0


# The TMA GEMVs load each K step's weight scales one step ahead (up to 2 tokens; stop 26). H200,
# in-graph MoE block at 0f84732 (docs/logs/scalesahead-h200-0f84732.log), M = 1 / 2 / 4: 38.8 /
# 62.9 / 119.8 us vs 39.4 / 65.6 / 119.7 with the old order; VLLM_SM121_MOE_SCALES_AHEAD=0 (read at
# call time) loads them inside the step as before, for A/B timing in one run.
SCALES_AHEAD_ENV = "VLLM_SM121_MOE_SCALES_AHEAD"


def scales_ahead() -> bool:
    return V.env_int(SCALES_AHEAD_ENV, 1) != 0


# The FMA GEMVs' activation words by plain ``ld.global.nc`` loads (opt-in, $VLLM_SM121_MOE_ACT_LDG=1,
# read at call time; GPU only) instead of Triton's pipelined cp.async copies through shared memory,
# which cost every K step a ``cp.async.wait_group`` + CTA barrier before the math (sm_90a PTX of the
# TMA FC1 at M = 1: 3 -> 2 ``bar.sync`` per step). Timed on an H100 (ef6fdb1, moe_probe --rotate,
# docs/logs/actldg-h100-ef6fdb1.log), off / on, cold / hot us: FC1 M=1 18.1 / 13.5 vs 17.9 / 13.0,
# FC2 + combine 12.2 / 9.7 vs 13.1 / 10.9 (slower), M=2/4 within ~1 us either way: stays off.
ACT_LDG_ENV = "VLLM_SM121_MOE_ACT_LDG"


def act_ldg(t: torch.Tensor) -> bool:
    return _platform.family_of(t) != _platform.INTERPRETER and V.env_int(ACT_LDG_ENV, 0) != 0


# The FMA GEMVs' scale bytes one K step ahead as int32 registers (opt-in, $VLLM_SM121_MOE_SCALE_LDG=1,
# read at call time; GPU only; ``_moe_fma._ldg_u8``): the weight scales (already one step ahead,
# but Triton's packed uint8 registers made ptxas unpack them in the loading step) and token 0's
# activation scales (loaded inside the step before). Per-instruction ncu of FC1 (H100, ef6fdb1,
# docs/logs/moesass-h100-ef6fdb1.csv): 14% of the stall samples on those two unpacks, 19% on the
# TMA stage wait. Same bits as without (GPU test, H200). Timed once on an H200 (7f8bd46,
# docs/logs/scaleldg-h200-7f8bd46.log), off / on, cold / hot us: FC1 M=1 16.0 / 13.3 vs 16.2 / 13.3,
# FC2 + combine 11.5 / 9.7 vs 10.9 / 9.3, M=2 FC1 32.2 vs 31.7, FC2 21.0 vs 20.6 (cold): FC2 ~0.5 us
# faster, FC1 unchanged, one run; off until an end-to-end run says more.
SCALE_LDG_ENV = "VLLM_SM121_MOE_SCALE_LDG"


def scale_ldg(t: torch.Tensor) -> bool:
    return _platform.family_of(t) != _platform.INTERPRETER and V.env_int(SCALE_LDG_ENV, 0) != 0


# Programmatic dependent launch of the FMA path's FC1 -> FC2 -> combine (opt-in,
# VLLM_SM121_MOE_PDL=1, read at call time; GPU only): each launch may start while the previous one
# drains; FC2 reads its routing and issues its first weight loads before waiting for FC1's output
# (``_mx.pdl_wait_then_release``). H200 at 16a6751 (docs/logs/moepdl-h200-16a6751.log): equal
# outputs (GPU test passed), no gain (M=1 block 54.4-54.9 us with PDL vs 51.6-52.0 without).
PDL_ENV = "VLLM_SM121_MOE_PDL"


def moe_pdl(t: torch.Tensor) -> dict:
    """Launch options and the kernels' PDL flag for ``t``'s device: {} when off."""
    if _platform.family_of(t) == _platform.INTERPRETER or V.env_int(PDL_ENV, 0) == 0:
        return {}
    return dict(PDL=True, launch_pdl=True)


def _check_fma_tokens(m: int) -> None:
    if m > FMA_LAUNCH_MAX_TOKENS:
        raise ValueError(f"the FMA decode kernels take at most {FMA_LAUNCH_MAX_TOKENS} tokens per launch, got {m}")


def _fma_token_args(m: int) -> dict:
    """NT (accumulators per program), BLOCK_T and WINDOW of an FMA launch of ``m`` tokens."""
    nt = min(m, FMA_KERNEL_MAX_TOKENS)
    return dict(NT=nt, BLOCK_T=triton.next_power_of_2(max(m, 1)), WINDOW=nt if m > nt else 0)


def moe_fc1_swiglu_fma(a: torch.Tensor, a_scale: torch.Tensor | None, w13: torch.Tensor, w13_scale: torch.Tensor,
                       bias: torch.Tensor, topk_ids: torch.Tensor,
                       tiles: FmaTiles | None = None,
                       route: tuple | None = None, l2_w2: tuple | None = None,
                       l2_late: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_fc1_swiglu`` for M <= FMA_LAUNCH_MAX_TOKENS tokens on CUDA cores (same contract and numbers).

    Grid (routed slot, fc1_rows-row tile): each routed expert's rows are streamed once, as
    16-byte words, for the tokens routed to it (once per FMA_KERNEL_MAX_TOKENS of them; ``_moe_fma.py``).
    ``route`` and ``l2_w2`` take M <= FMA_KERNEL_MAX_TOKENS only.

    ``route`` = (router_logits [M, E_global], expert_map or None, topk_weights out fp32 [M, topk]):
    the kernel routes the tokens itself (exactly ``moe_route``'s ids and weights) and writes them
    to ``topk_ids`` (then an output, int32 [M, topk]) and topk_weights for FC2: one launch fewer.

    ``l2_w2`` = (w2, w2_scale) of the same experts ([E, ...] each, contiguous): each routed
    expert's programs prefetch its FC2 rows into L2 (``l2_prefetch``; before their own weight
    stream, or after it with ``l2_late``). GPU only; the results do not change.
    """
    m, k, e, i, topk = _check_fc1(a, a_scale, w13, w13_scale, bias, topk_ids)
    _check_fma_tokens(m)
    if a.dtype == torch.bfloat16:
        a, a_scale = mxfp8_quantize(a)
    out = torch.empty(m * topk, i, dtype=torch.uint8, device=a.device)
    out_scale = torch.empty(m * topk, i // 32, dtype=torch.uint8, device=a.device)
    tok = _fma_token_args(m)
    if tok["WINDOW"] and (route is not None or l2_w2 is not None):
        raise ValueError(f"fused routing and L2 prefetches take at most {FMA_KERNEL_MAX_TOKENS} tokens, got {m}")
    tiles = tiles or fma_tiles(a, m)
    rows = tiles.fc1_rows
    block_g = min(tiles.fc1_kb // 16, triton.next_power_of_2(k // 32))
    split, gps = fc2_split_k(k, block_g, tiles.fc1_split)  # (the same whole-step cut of K as FC2's)
    n_tiles = -(-2 * i // rows)
    if split > 1:
        ws = torch.empty(m * topk * n_tiles * split * tok["NT"] * rows, dtype=torch.float32, device=a.device)
        cnt = split_counters(a.device, m * topk * n_tiles)
    else:
        ws = cnt = out  # unused
    tma = _tma_stages(a, tiles.num_stages)
    if route is not None:
        logits, emap, topk_w = route
        m_route, e_route = _check_route(logits, topk, emap)
        if m_route != m or topk_w.shape != (m, topk) or topk_w.dtype != torch.float32 or topk_ids.dtype != torch.int32:
            raise ValueError(f"fused routing: router_logits [{m}, E], topk_weights fp32 [{m}, {topk}] and int32 "
                             f"topk_ids expected, got {tuple(logits.shape)}, {topk_w.dtype} {tuple(topk_w.shape)}, "
                             f"{topk_ids.dtype}")
        if moe_pdl(a):
            raise ValueError(f"{FUSED_ROUTE_ENV}=1 and {PDL_ENV}=1 cannot be combined (FC2 reads the routing before "
                             "its programmatic-launch wait, and with fused routing FC1 writes it); unset one")
        route_args = (logits, topk_w, emap if emap is not None else topk_ids, logits.stride(0))
        route_kw = dict(ROUTE=True, E_ROUTE=e_route, E_PAD=triton.next_power_of_2(e_route), HAS_MAP=emap is not None)
    else:
        route_args, route_kw = (topk_ids, topk_ids, topk_ids, 0), {}
    pf_w, pf_bytes, pf_kw = l2_prefetch.launch_args(l2_w2[0] if l2_w2 else None, a)
    pf_s, pfs_bytes, _ = l2_prefetch.launch_args(l2_w2[1] if l2_w2 else None, a)
    if pf_kw["PF"]:
        if l2_w2[0].shape[0] != e or l2_w2[1].shape[0] != e:
            raise ValueError(f"l2_w2: FC2 weights of the same {e} experts expected, got {tuple(l2_w2[0].shape)} and "
                             f"{tuple(l2_w2[1].shape)}")
        pf_bytes, pfs_bytes = pf_bytes // e, pfs_bytes // e
        pf_kw["PF_LATE"] = l2_late
    if m:
        w_words = w13.view(torch.int32)
        _moe_fc1_swiglu_fma_kernel[(m * topk, n_tiles, split)](
            a.view(torch.uint8).view(torch.int32), a_scale, w_words, w13_scale, bias, topk_ids, out,
            out_scale, ws, cnt, _weight_desc(w_words, rows, block_g) if tma else None, *route_args, m, pf_w, pf_bytes,
            pf_s, pfs_bytes, E=e, K=k, I=i,
            TOPK=topk,
            TOPK_PAD=triton.next_power_of_2(topk), **tok, BLOCK_R=rows,
            BLOCK_G=block_g, PREFETCH=tiles.num_stages > 1, F16X2=fma_f16x2(a), ALPHA=SWIGLU_ALPHA,
            LIMIT=SWIGLU_LIMIT, HW_FP8=_gpu_flags(a)["HW_FP8"], SPLIT=split, GPS=gps, TMA=tma,
            SCALES_AHEAD=scales_ahead(), ACT_LDG=act_ldg(a), SCALE_LDG=scale_ldg(a), **route_kw, **pf_kw,
            num_warps=tiles.num_warps, num_stages=1, **(moe_pdl(a) or V.pdl_launch(a)), **fma_maxnreg(a))
    return out.view(torch.float8_e4m3fn), out_scale


def _tma_stages(t: torch.Tensor, stages: int) -> int:
    """The TMA pipeline's stages for FMA tiles with ``stages`` (0: none, stages < 3). Measured and
    AOT-checked on sm_90 only (ptxas also accepts it for sm_121a, but ``kernels/aot.py`` keeps TMA
    out of every sm_12x build), so other GPUs are refused with the knob to change."""
    if stages < 3:
        return 0
    if _platform.family_of(t) not in (_platform.SM90, _platform.INTERPRETER):
        raise ValueError(f"{FMA_TILES_ENV}: stages >= 3 (a TMA pipeline) are supported on sm_90 only, not on "
                         f"{_platform.family_of(t)}; use stages 1 or 2")
    return stages


def _weight_desc(w_words: torch.Tensor, rows: int, block_g: int):
    """TMA descriptor of an expert weight matrix's int32 words [E, R, K/8] viewed as [E * R, K/8],
    block [rows, 4 * block_g] (one K step of one tile; K/2 bytes per row is a multiple of 16 as
    TMA needs, since K is a multiple of 32)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    e, r, kw = w_words.shape
    return TensorDescriptor.from_tensor(w_words.view(e * r, kw), [rows, 4 * block_g])  # (never a copy)


# Split-K arrival counters of the FMA FC1 (``_moe_fma._split_fixup``), one int32 per (slot, row
# tile), per device: zero between launches (the last split of a tile resets its own), so one
# zeroed buffer serves every layer and every graph replay. Two FC1 launches must not run at once
# on one device (vLLM 0.26 runs a model's MoE layers one after another on one stream). Allocated
# outside graph captures: the plugin's MoE method allocates it when its weights are processed
# (``vllm_sm121/moe/method.py``); SPLIT_COUNTERS_MIN covers M <= 4 of any gpt-oss shape.
_SPLIT_COUNTERS: dict[str, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []  # replaced buffers stay allocated: captured graphs may hold them
SPLIT_COUNTERS_MIN = 1 << 14


def split_counters(device: torch.device, n: int = SPLIT_COUNTERS_MIN, purpose: str = "fc1") -> torch.Tensor:
    """The zeroed arrival counters of ``purpose`` ("fc1": FC1 split-K; "fc2": FC2's fused combine,
    apart so that a PDL-launched FC2 never shares one with a running FC1) on ``device``."""
    key = f"{device}:{purpose}"
    buf = _SPLIT_COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the FMA MoE's {purpose} arrival counters for {n} tiles were first needed inside a "
                               "CUDA graph capture; run the layer once eagerly at that batch size first (vLLM does)")
        if buf is not None:
            _RETIRED_COUNTERS.append(buf)
        buf = torch.zeros(max(n, SPLIT_COUNTERS_MIN), dtype=torch.int32, device=device)
        _SPLIT_COUNTERS[key] = buf
    return buf


def fc2_split_k(i: int, block_g: int, want: int) -> tuple[int, int]:
    """(splits, 32-value groups per split) of FC2's K = i for ``want`` splits: whole K steps of
    block_g groups per split, no empty split."""
    groups = i // 32
    gps = -(-(-(-groups // want)) // block_g) * block_g
    return -(-groups // gps), gps


def _out_dtype(dt: torch.dtype) -> torch.dtype:
    """FC2's output dtype, checked: bf16 (the block's output) or fp32 (a rank's unrounded share)."""
    if dt not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype={dt} is not supported; supported: torch.bfloat16, torch.float32")
    return dt


def moe_fc2_combine_fma(h: torch.Tensor, h_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                        bias: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        tiles: FmaTiles | None = None, l2_next: torch.Tensor | None = None,
                        l2_late: bool = False, next_norm: NextNorm | None = None,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``moe_fc2_combine`` for M <= FMA_LAUNCH_MAX_TOKENS tokens on CUDA cores (same contract and
    numbers): the FMA GEMV writes the fp32 partials per (token, slot), ``_moe_combine_kernel`` sums them.
    ``l2_next``: a contiguous tensor (the next layer's qkv weight) its programs prefetch into L2, first
    thing or (``l2_late``) after their own weight stream (``l2_prefetch``; GPU only, results unchanged).
    ``next_norm``: the combine also writes the next layer's carried input norm (``kernels/next_norm.py``).
    ``out_dtype`` torch.float32 (see ``moe_block``): the sums unrounded, fused combine or not."""
    m, topk, e, hidden, i = _check_fc2(h, h_scale, w2, w2_scale, bias, topk_ids, topk_weights)
    out_dtype = _out_dtype(out_dtype)
    if out_dtype != torch.bfloat16 and next_norm is not None:
        raise ValueError("next_norm needs the bf16 output (out_dtype=torch.bfloat16)")
    _check_fma_tokens(m)
    tok = _fma_token_args(m)
    if tok["WINDOW"] and (l2_next is not None or next_norm is not None):
        raise ValueError(f"L2 prefetches and next_norm take at most {FMA_KERNEL_MAX_TOKENS} tokens, got {m}")
    tiles = tiles or fma_tiles(h, m)
    rows = tiles.fc2_rows
    warps, stages = tiles.fc2_launch()
    block_g = min(tiles.fc2_kb // 16, triton.next_power_of_2(i // 32))
    split, gps = fc2_split_k(i, block_g, tiles.fc2_split)
    out = torch.empty(m, hidden, dtype=out_dtype, device=h.device)
    part = torch.empty(m * topk * split, hidden, dtype=torch.float32, device=h.device)
    pdl = moe_pdl(h)
    # $VLLM_SM121_PDL (the decode step's switch) without $VLLM_SM121_MOE_PDL: FC2 waits first thing
    # (with the routing fused into FC1, FC1 writes what FC2 reads first)
    pdl_top = dict(PDL_TOP=True, launch_pdl=True) if not pdl and V.pdl_launch(h) else {}
    tma = _tma_stages(h, stages)
    n_tiles = -(-hidden // rows)
    combine = fused_combine(m) and not tok["WINDOW"]  # (its last program sums NT tokens)
    cnt = split_counters(h.device, n_tiles, "fc2") if combine and m else part
    pf, pf_bytes, pf_kw = l2_prefetch.launch_args(l2_next, h)
    if pf_kw["PF"]:
        pf_kw["PF_LATE"] = l2_late
    nn_kw, nn_after = {}, False
    if next_norm is not None:
        next_norm.check(out)
        nn_kw = dict(nn_res_ptr=next_norm.residual, nn_stride=next_norm.residual.stride(0), nn_w_ptr=next_norm.weight,
                     nn_s_ptr=next_norm.bufs.s, nn_u_ptr=next_norm.bufs.u, nn_ps_ptr=next_norm.bufs.psum,
                     NEXT_NORM=True)
        if combine and rows % NEXT_NORM_CHUNK:  # (no tile table has such rows; an env tile might): torch after
            nn_kw, nn_after = {}, True
    if m:
        w_words = w2.view(torch.int32)
        _moe_fc2_fma_kernel[(m * topk, n_tiles, split)](
            h.view(torch.uint8).view(torch.int32), h_scale, w_words, w2_scale, bias, topk_ids,
            topk_weights, part, _weight_desc(w_words, rows, block_g) if tma else None, out, cnt, m, pf, pf_bytes,
            E=e, H=hidden,
            I=i, TOPK=topk, TOPK_PAD=triton.next_power_of_2(topk), **tok,
            BLOCK_R=rows, BLOCK_G=block_g, SPLIT=split, GPS=gps, PREFETCH=stages > 1, F16X2=fma_f16x2(h), TMA=tma,
            SCALES_AHEAD=scales_ahead(), ACT_LDG=act_ldg(h), SCALE_LDG=scale_ldg(h),
            COMBINE=combine, num_warps=warps, num_stages=1, **pdl, **pdl_top, **fma_maxnreg(h), **pf_kw,
            **(nn_kw if combine else {}))
    if m and not combine:
        block = max(NEXT_NORM_CHUNK, min(1024, triton.next_power_of_2(hidden)))
        # rows (token, slot, split) of a token are contiguous: the combine sums topk * split of them in order
        _moe_combine_kernel[(m, -(-hidden // block))](part, out, H=hidden, TOPK=topk * split, BLOCK=block,
                                                      num_warps=4, **(pdl or V.pdl_launch(h)), **nn_kw)
    if nn_after and m:
        next_norm_torch(out, next_norm)
    return out


def dequant_mxfp4_torch(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., K/2] e2m1 pairs (low nibble first) + [..., K/32] e8m0 -> fp32 [..., K]."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=blocks.device)
    b = blocks.long()
    vals = torch.stack([lut[b & 15], lut[b >> 4]], dim=-1).flatten(-2)
    s = torch.exp2(scales.float().clamp(min=1) - 127)  # byte 0 read as 2**-126, like the kernel
    return (vals.unflatten(-1, (-1, 32)) * s[..., None]).flatten(-2)


def moe_fc1_swiglu_torch(a, a_scale, w13, w13_scale, bias, topk_ids):
    """Reference of ``moe_fc1_swiglu``: ((h, h_scale), SwiGLU output in fp32 before quantization)."""
    from .norm_mxfp8 import mxfp8_dequantize_torch, mxfp8_quantize_torch

    if a.dtype == torch.bfloat16:
        a, a_scale = mxfp8_quantize_torch(a.float())
    x = mxfp8_dequantize_torch(a, a_scale.clamp(min=1))  # [M, K]
    _m, topk = topk_ids.shape
    ids = topk_ids.long().flatten()
    w = dequant_mxfp4_torch(w13[ids], w13_scale[ids])  # [M*topk, 2I, K]
    h = torch.einsum("pnk,pk->pn", w, x.repeat_interleave(topk, dim=0)) + bias[ids].float()
    gate, up = h[:, 0::2], h[:, 1::2]
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    y = (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)
    return mxfp8_quantize_torch(y), y


def moe_fc2_combine(h: torch.Tensor, h_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                    bias: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """h [M*topk, I] e4m3 + h_scale [M*topk, I/32]; returns bf16 [M, H] = sum_j w_j (h_j W2[e_j]^T + b2[e_j]).

    Two launches: the grouped GEMV (as FC1's grid) writing fp32 partials per (token, slot), and
    a combine summing each token's topk partials in slot order, rounded once to bf16 (``out_dtype``
    torch.float32: not rounded, see ``moe_block``).
    """
    m, topk, e, hidden, i = _check_fc2(h, h_scale, w2, w2_scale, bias, topk_ids, topk_weights)
    out = torch.empty(m, hidden, dtype=_out_dtype(out_dtype), device=h.device)
    part = torch.empty(m * topk, hidden, dtype=torch.float32, device=h.device)
    bm, bn = DECODE_BLOCK_M, DECODE_FC2_BLOCK_N
    if m:
        _moe_fc2_kernel[(min(m, bm) * topk, -(-hidden // bn), -(-m // bm))](
            h.view(torch.uint8), h_scale, w2, w2_scale, bias, topk_ids, topk_weights, part, m,
            E=e, H=hidden, I=i, TOPK=topk, TOPK_PAD=triton.next_power_of_2(topk), BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=min(DECODE_BLOCK_K, triton.next_power_of_2(i)), DOT_SCALED=_gpu_flags(h)["DOT_SCALED"],
            num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES)
        block = min(1024, triton.next_power_of_2(hidden))
        _moe_combine_kernel[(m, -(-hidden // block))](part, out, H=hidden, TOPK=topk, BLOCK=block, num_warps=4)
    return out


def moe_fc2_combine_torch(h, h_scale, w2, w2_scale, bias, topk_ids, topk_weights):
    from .norm_mxfp8 import mxfp8_dequantize_torch

    x = mxfp8_dequantize_torch(h, h_scale.clamp(min=1))  # [M*topk, I]
    ids = topk_ids.long().flatten()
    w = dequant_mxfp4_torch(w2[ids], w2_scale[ids])  # [M*topk, H, I]
    y = torch.einsum("phk,pk->ph", w, x) + bias[ids].float()
    m, topk = topk_ids.shape
    return (y.view(m, topk, -1) * topk_weights.float()[..., None]).sum(1)


# ---- routing ---------------------------------------------------------------------------------

def _check_route(router_logits: torch.Tensor, topk: int, expert_map: torch.Tensor | None) -> tuple[int, int]:
    """(M, E) of routing inputs (``moe_route`` and the fused routing of ``moe_fc1_swiglu_fma``)."""
    V.check_ndim("router_logits", router_logits, 2, "[num_tokens, num_experts]")
    V.check_last_dim_contiguous("router_logits", router_logits)
    m, e = router_logits.shape
    if not 0 < topk <= e:
        raise ValueError(f"topk={topk} is not supported for {e} experts; supported: 1..{e}")
    if expert_map is not None:
        if expert_map.shape != (e,) or expert_map.dtype != torch.int32 or expert_map.device != router_logits.device:
            raise ValueError(f"expert_map must be int32 [{e}] on {router_logits.device}, got {expert_map.dtype} "
                             f"{tuple(expert_map.shape)} on {expert_map.device}")
    return m, e


def moe_route(router_logits: torch.Tensor, topk: int, x: torch.Tensor | None = None,
              expert_map: torch.Tensor | None = None):
    """gpt-oss routing: (topk_weights fp32 [M, topk], topk_ids int32 [M, topk]), the top-k logits in
    descending order with a softmax over them (= vLLM's softmax over all experts, renormalized).

    NaN logits (padded rows of a captured graph) rank lowest and +-inf is clamped, so ids are
    always distinct and in [0, E) and weights finite. With ``x`` (bf16 [M, K]) the same launch
    also quantizes it to MXFP8 and (topk_weights, topk_ids, x_q, x_scale) is returned.

    ``expert_map`` (expert parallelism: int32 [E], global -> this rank's expert id or -1): ids are
    local; slots on other ranks get weight 0 and a local id the token already uses (or 0), so
    summing every rank's ``moe_block`` output gives the unsharded block's.
    """
    m, e = _check_route(router_logits, topk, expert_map)
    dev = router_logits.device
    topk_w = torch.empty(m, topk, dtype=torch.float32, device=dev)
    topk_ids = torch.empty(m, topk, dtype=torch.int32, device=dev)
    quant = x is not None
    if quant:
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] != m or x.shape[1] % 32 or not x.is_contiguous():
            raise ValueError(f"x must be contiguous bf16 [{m}, K] with K a multiple of 32, got "
                             f"{x.dtype} {tuple(x.shape)}")
        k = x.shape[1]
        xq = torch.empty(m, k, dtype=torch.uint8, device=dev)
        xs = torch.empty(m, k // 32, dtype=torch.uint8, device=dev)
    if m:
        _moe_route_kernel[(m,)](router_logits, topk_w, topk_ids, x if quant else router_logits,
                                xq if quant else topk_ids, xs if quant else topk_ids,
                                topk_ids if expert_map is None else expert_map, router_logits.stride(0),
                                E=e, E_PAD=triton.next_power_of_2(e), TOPK=topk, TOPK_PAD=triton.next_power_of_2(topk),
                                K=k if quant else 32, BLOCK_K=min(512, triton.next_power_of_2(k)) if quant else 32,
                                ROUTE=True, QUANT=quant, HW_FP8=_gpu_flags(router_logits)["HW_FP8"],
                                HAS_MAP=expert_map is not None, num_warps=4 if quant else 1)
    if quant:
        return topk_w, topk_ids, xq.view(torch.float8_e4m3fn), xs
    return topk_w, topk_ids


def moe_route_torch(router_logits: torch.Tensor, topk: int,
                    expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    vals, ids = torch.topk(router_logits.float(), topk, dim=-1)
    w, ids = torch.softmax(vals, dim=-1), ids.int()
    if expert_map is None:
        return w, ids
    loc = expert_map.to(ids.device).long()[ids.long()]
    here = loc >= 0
    first = torch.where(here, torch.arange(topk, device=ids.device), topk).argmin(dim=-1, keepdim=True)
    borrow = torch.where(here.any(-1, keepdim=True), loc.gather(-1, first), 0)
    return torch.where(here, w, 0.0), torch.where(here, loc, borrow).int()


# ---- prefill: grouped GEMMs over expert-sorted pairs -------------------------------------------

# moe_align: the one-program Triton kernel beats the ~10 torch ops up to a few hundred pairs and
# loses above (H200 at e7de1aa, docs/moe-align-h200-e7de1aa.json, E = 128 top-4: 6.2 / 9.1 / 25.4 /
# 34.2 us vs 59.8 / 60.5 / 64.9 / 84.3 us at 4 / 32 / 128 / 256 pairs; 144 vs 91 us at 2048 and
# 1,177 vs 146 us at 16,384). Larger P takes moe_align_torch (a shape-only choice: capturable).
ALIGN_TRITON_MAX_PAIRS = 512


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, chunk: int | None = None,
              max_pairs: int = ALIGN_TRITON_MAX_PAIRS):
    """Tile map for the grouped kernels, on the device with static shapes (graph-capturable).

    Returns (sorted_pair [P] int32: pair ids token * topk + slot sorted by expert (stable),
    tile_expert, tile_start, tile_end [NUM_TILES] int32) with NUM_TILES = cdiv(P, block_m) +
    min(E, P), an upper bound of sum_e cdiv(count_e, block_m); unused tiles are empty. Ids out of
    [0, E) are clamped into it. One launch of ``_moe_align_kernel`` (``moe_details/_moe_align.py``),
    identical to ``moe_align_torch``. ``chunk``: pairs (and tiles) per step of the kernel's loops,
    a power of two (default: up to 16384 / E_PAD, ~64 one-hot entries per thread); tests only.
    More than ``max_pairs`` pairs (default ALIGN_TRITON_MAX_PAIRS): ``moe_align_torch``, faster there.
    """
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts={num_experts} and block_m={block_m} must be >= 1")
    if chunk is not None and (chunk < 1 or chunk & (chunk - 1)):
        raise ValueError(f"chunk={chunk} must be a power of two")
    flat = topk_ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        flat = flat.long()  # as the reference's .long(); the kernel clamps int32 / int64 as loaded
    flat = flat.contiguous()
    p = flat.numel()
    if p >= 2**30:  # int32 positions (+ a chunk) never overflow
        raise ValueError(f"{p} pairs: moe_align takes fewer than 2**30")
    if p > max_pairs:
        return moe_align_torch(topk_ids, num_experts, block_m)
    num_tiles = -(-p // block_m) + min(num_experts, p)
    dev = topk_ids.device
    order = torch.empty(p, dtype=torch.int32, device=dev)
    tile_e, tile_s, tile_t = (torch.empty(num_tiles, dtype=torch.int32, device=dev) for _ in range(3))
    if p:
        e_pad = triton.next_power_of_2(num_experts)
        cap = chunk or max(1, 16384 // e_pad)  # one-hot [CHUNK, E_PAD] per step: 64 KB of shared memory
        c = min(cap, max(16, triton.next_power_of_2(p)))
        tc = min(cap, max(16, triton.next_power_of_2(num_tiles)))
        _moe_align_kernel[(1,)](flat, order, tile_e, tile_s, tile_t, p, num_tiles, E=num_experts, E_PAD=e_pad,
                                BLOCK_M=block_m, CHUNK=c, TILE_CHUNK=tc,
                                num_warps=4 if max(c, tc) * e_pad <= 4096 else 8)
    return order, tile_e, tile_s, tile_t


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Reference of ``moe_align`` (its previous implementation: ~10 torch ops, static shapes)."""
    flat = topk_ids.flatten().long().clamp(0, num_experts - 1)  # garbage ids never index out of bounds
    p = flat.numel()
    dev = topk_ids.device
    _, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    ends = torch.cumsum(counts, 0)
    tiles = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    t = torch.arange(-(-p // block_m) + min(num_experts, p), device=dev)
    expert = torch.searchsorted(tile_ends, t, right=True)
    ec = expert.clamp(max=num_experts - 1)
    start = (ends - counts)[ec] + (t - (tile_ends - tiles)[ec]) * block_m
    end = torch.where(expert < num_experts, torch.minimum(start + block_m, ends[ec]), start)
    return order.int(), ec.int(), start.int(), end.int()


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """Tiles of the grouped (prefill) kernels (performance hyper-parameters); swap-AB: weight rows
    are the MMA's M, the tile's tokens its N (``moe_details/_moe_grouped.py``)."""

    block_m: int  # pairs (tokens) per tile, the MMA's N: 16, 32, 64 or 128 (moe_align's block)
    block_n: int  # weight rows per program, the MMA's M: a power of two >= 64 (FC1: block_n / 2 SwiGLU outputs)
    block_k: int  # K per step: a power of two >= 32 (whole e8m0 groups)
    num_warps: int
    num_stages: int  # software-pipeline stages of the weight / activation tiles

    def __post_init__(self):
        def pow2(v):
            return v > 0 and v & (v - 1) == 0

        if (self.block_m not in GROUPED_BLOCK_M or not (pow2(self.block_n) and self.block_n >= 64)
                or not (pow2(self.block_k) and self.block_k >= 32) or self.num_warps not in (1, 2, 4, 8, 16)
                or not 1 <= self.num_stages <= 8):
            raise ValueError(f"{self}: block_m must be one of {GROUPED_BLOCK_M}, block_n a power of two >= 64, "
                             "block_k a power of two >= 32, num_warps a power of two <= 16, num_stages 1..8")

    @classmethod
    def parse(cls, text: str) -> GroupedTiles:
        """"bm,bn,bk,warps,stages" (the $VLLM_SM121_MOE_GROUPED_TILE format)."""
        vals = V.parse_ints(GROUPED_TILE_ENV, text, (5,), "bm,bn,bk,warps,stages (5 integers)")
        try:
            return cls(*vals)
        except ValueError as e:
            raise ValueError(f"{GROUPED_TILE_ENV}={text!r}: {e}") from None

    def spec(self) -> str:
        return f"{self.block_m},{self.block_n},{self.block_k},{self.num_warps},{self.num_stages}"


GROUPED_BLOCK_M = (16, 32, 64, 128)
# performance hyper-parameters, per architecture family: (largest average pairs per expert
# M * topk / E, tiles), first match wins. BLOCK_M grows with the average so most experts fit one
# tile (each extra tile re-reads the expert's weights; bound = 0.75 * BLOCK_M: at average 12 a
# Poisson count exceeds 16 for ~10% of the experts). 64- and 128-token tiles need 8 warps (4
# spill) and lost on the H100; tests/test_aot_compile.py checks every entry compiles (sm_12x: ~99 KB
# of shared memory per block on GB10). The interpreter: small tiles (its cost grows with the tile).
# Overridden at call time, for every M, by VLLM_SM121_MOE_GROUPED_TILE="bm,bn,bk,warps,stages".
GROUPED_TILES: dict[str, tuple[tuple[float, GroupedTiles], ...]] = {
    # H100 at 8e7d4de, 6 tiles x M = 1..4096 (docs/moe-grouped-sweep-h100-8e7d4de.json): 64-wide K
    # steps with 4 warps win everywhere (fewer registers, more CTAs per SM); 16-token tiles up to
    # M = 64, 32-token tiles at M = 512 and 4096 (where 64/128-token tiles lost 1.1-2.9x)
    # H200 at c27ad1a with the halves decoder (its BLOCK_K 128; docs/moe-grouped-sweep-h200-c27ad1a.json,
    # 7 tiles at M = 64 / 512 / 2048): 16-token tiles at M = 64 (795 us vs 961 for 32), 32 at M = 512
    # (1,161 vs 1,225 for 16, 1,716 for 64), 64 tokens with 8 warps at M = 2048 (2,539 vs 2,641 for 32,
    # 3,151 for 128); the 32 / 64 bound is 0.75 * 64 as the 16 / 32 one (no point between was timed)
    _platform.SM90: ((12, GroupedTiles(16, 128, 64, 4, 4)), (48, GroupedTiles(32, 128, 64, 4, 4)),
                     (float("inf"), GroupedTiles(64, 128, 128, 8, 3))),
    # sm_12x: the H100 choice with 2 stages (no GB10 to time it; ~99 KB of shared memory per block)
    _platform.SM12X: ((12, GroupedTiles(16, 128, 64, 4, 2)), (float("inf"), GroupedTiles(32, 128, 64, 4, 2))),
    _platform.INTERPRETER: ((12, GroupedTiles(16, 64, 64, 4, 1)), (float("inf"), GroupedTiles(32, 64, 64, 4, 1))),
}
GROUPED_TILE_ENV = "VLLM_SM121_MOE_GROUPED_TILE"
# The halves decoder (``moe_details/_mx.py``, stop 41): 128-value K steps as two K = 64 dots over the
# even and the odd weight values, whose lanes read 16 contiguous bytes each (sm_90a SASS of FC2's K
# loop: 266 instructions per 64 weight values vs 358-401 in checkpoint order). Replaces the tiles'
# block_k by 128 (also a $VLLM_SM121_MOE_GROUPED_TILE's or a benchmarks/moe.py sweep's: their bk is
# ignored while it is on; the stages stay the tile's). Per family; $VLLM_SM121_MOE_GROUPED_HALVES (0 / 1,
# read at call time) overrides.
GROUPED_HALVES: dict[str, bool] = {_platform.SM90: True, _platform.SM12X: True, _platform.INTERPRETER: True}
GROUPED_HALVES_ENV = "VLLM_SM121_MOE_GROUPED_HALVES"
HALVES_BLOCK_K = 128


def grouped_halves(t: torch.Tensor) -> bool:
    """Whether the grouped GEMMs on ``t``'s device use the halves decoder (GROUPED_HALVES)."""
    return bool(V.env_int(GROUPED_HALVES_ENV, int(GROUPED_HALVES.get(_platform.family_of(t), False))))


def _grouped_block_k(t: torch.Tensor, tiles: GroupedTiles, k: int) -> tuple[int, bool]:
    """(BLOCK_K, HALVES) of a grouped launch over K on ``t``'s device."""
    if grouped_halves(t):
        return HALVES_BLOCK_K, True
    return min(tiles.block_k, triton.next_power_of_2(k)), False


def grouped_tiles(t: torch.Tensor, m: int, topk: int, num_experts: int) -> GroupedTiles:
    """The grouped kernels' tiles for M tokens routed top-``topk`` over ``num_experts`` experts on
    ``t``'s device: $VLLM_SM121_MOE_GROUPED_TILE if set (read now), else the first GROUPED_TILES[family]
    entry whose bound covers the average pairs per expert. From shapes only: graph-capturable."""
    env = os.environ.get(GROUPED_TILE_ENV, "").strip()
    if env:
        return GroupedTiles.parse(env)
    avg = m * topk / max(num_experts, 1)
    return next(tiles for bound, tiles in GROUPED_TILES[_platform.family_of(t)] if avg <= bound)


def _grouped_align(align, topk_ids: torch.Tensor, e: int, tiles: GroupedTiles):
    """``align`` (checked to be moe_align's map for tiles.block_m), or a new one."""
    if align is None:
        return moe_align(topk_ids, e, tiles.block_m)
    p = topk_ids.numel()
    want = -(-p // tiles.block_m) + min(e, p)  # differs for every other block_m that could overfill a tile
    if align[1].numel() != want:
        raise ValueError(f"align holds {align[1].numel()} tiles, moe_align(..., block_m={tiles.block_m}) gives "
                         f"{want}: build it with the tiles' block_m")
    return align


# Expert weight-scale tensors known to hold no e8m0 byte above 128, as (data_ptr, numel, device) keys:
# their grouped GEMMs run without the F2 multiply (``register_weight_scales``; sm_90a SASS of the K loop
# at 16,128,64,4,4: FC1 605 -> 518, FC2 616 -> 531 instructions). An unknown tensor keeps F2 (exact for
# every byte). A stale entry (weights reloaded in place with larger scales, or a reused address) cannot
# give wrong finite values: the kernels then track the largest scale byte and write NaN (FC2's output,
# FC1's e8m0 scales, which FC2 turns into NaN) for the tiles whose weights needed F2.
_F2_FREE_SCALES: set[tuple[int, int, str]] = set()


def _scales_key(w_scale: torch.Tensor) -> tuple[int, int, str]:
    return (w_scale.data_ptr(), w_scale.numel(), str(w_scale.device))


def register_weight_scales(*w_scales: torch.Tensor) -> tuple[bool, ...]:
    """Record, for each expert weight-scale tensor, whether its grouped GEMMs need the F2 multiply
    (``weight_scales_need_f2``: one host sync each; for ``process_weights_after_loading``, when the
    weights are final). Returns the decisions (True: F2 kept)."""
    need = tuple(weight_scales_need_f2(s) for s in w_scales)
    for s, n in zip(w_scales, need):
        (_F2_FREE_SCALES.discard if n else _F2_FREE_SCALES.add)(_scales_key(s))
    return need


def weight_scales_f2(w_scale: torch.Tensor) -> bool:
    """Whether the grouped GEMMs over ``w_scale`` keep the F2 multiply: unless ``register_weight_scales``
    found all its bytes <= 128."""
    return _scales_key(w_scale) not in _F2_FREE_SCALES


def weight_scales_need_f2(w_scale: torch.Tensor) -> bool:
    """Whether some e8m0 byte of ``w_scale`` exceeds 128 (a block scale above 2): only then do the
    grouped GEMMs' weight decoders need their second power-of-two factor (``mxfp4_tile_bf16``'s
    F2; checkpoints' expert scales stay far below, dummy weights are 0). One host sync: for a
    caller that knows when the weights are final (``w_f2`` of the grouped launchers). Not decided
    per call: vLLM reloads weights in place (through ``.data``, which no version counter of the
    parameter sees) into tensors that captured graphs keep."""
    return bool((w_scale.view(torch.uint8).max() > 128).item()) if w_scale.numel() else False


def act_halves_bf16_torch(a: torch.Tensor, a_scale: torch.Tensor) -> torch.Tensor:
    """MXFP8 activations (e4m3 [M, K] + e8m0 [M, K / 32]) as the grouped FC1's A_HALVES operand: their
    values in bf16 (exact, as ``mxfp8_tile_bf16`` decodes them), each 128-value block in the halves
    order (its even values in ``_mx.act_halves``'s logical order, then its odd ones), rows zero-padded
    to whole blocks: bf16 [M, ceil(K / 128) * 128]. Differs from the in-loop decode only where the
    plugin's quantizers never write for finite inputs: e4m3 NaN codes (NaN here, a finite value there)
    and e8m0 byte 255 (inf / NaN here; FC1's guard, which FC2's NAN_SCALES check turns into NaN either
    way). Temporaries: an fp32 and two bf16 copies of the activations (a prefill chunk's, briefly)."""
    from .norm_mxfp8 import mxfp8_dequantize_torch

    m, k = a.shape
    kp = -(-k // 128) * 128
    v = torch.nn.functional.pad(mxfp8_dequantize_torch(a, a_scale.clamp(min=1)).bfloat16(), (0, kp - k))
    # k = 2 * slot + half, slot bits (5, 4, 3..1, 0) -> [half, slot bits 3..1, 5, 4, 0] (lane_order's logical k)
    v = v.view(m, kp // 128, 2, 2, 8, 2, 2).permute(0, 1, 6, 4, 2, 3, 5)
    return v.reshape(m, kp).contiguous()


# Prefill FC1 with its MXFP8 activations handed over as bf16 in the halves order (one torch pre-pass, then no
# decode, permutation or shared-memory store of them in the K loop): opt-in (stop 42; docs/mxfp4-layout-design.md
# "Stop 42"). 0 / 1, read at call time; tiles of at least this many tokens take it when set to a number > 1
# (1: every grouped FC1 with MXFP8 input). Timed in stop 43 (H200, 23085b8, moe_block µs off / on): M = 64
# 795.9 / 751.1, M = 512 1,194.6 / 1,183.5, M = 2048 2,521.8 / 2,559.5, where the outputs were also wrong
# (relL2 0.17). Cause, read off the sm_90a SASS (tests/test_aot_compile.py checks every sm_90a kernel for it):
# with the bf16 operand streamed by cp.async, Triton 3.6 pipelines the wgmma and leaves the K step's second
# wgmma in flight across the loop's back-edge, while the next step rewrites its A-operand registers (the
# decoded weights) before the wait: undefined behaviour per the PTX ISA, wrong products when the wgmma reads
# late (seen at M = 2048 on the 8-warp tile; the 4-warp builds have the same pattern). The MXFP8 operand path
# waits inside the loop (its B operand is stored from registers each step). So sm_90 (wgmma) refuses the opt-in;
# sm_12x builds use the synchronous mma.sync (no such hazard; not run on a GB10).
GROUPED_ACT_BF16_ENV = "VLLM_SM121_MOE_GROUPED_ACT_BF16"
GROUPED_ACT_BF16_UNSAFE = (_platform.SM90,)
ACT_BF16_UNSAFE_WHY = ("Triton 3.6's pipelined wgmma leaves a register-operand MMA in flight across the K loop "
                       "while its registers are rewritten (wrong outputs measured on an H200); the MXFP8 operand "
                       "path runs instead")


def grouped_act_bf16(tiles: GroupedTiles, t: torch.Tensor) -> bool:
    """Whether a grouped FC1 / FC2 with ``tiles`` on ``t``'s device takes bf16 halves-order activations when it
    runs the halves decoder ($VLLM_SM121_MOE_GROUPED_ACT_BF16: 0 off (default), 1 always, N > 1 for tiles of
    >= N tokens; the launchers check the decoder). Never on the families of GROUPED_ACT_BF16_UNSAFE (see above;
    logged once when the variable asks for it there)."""
    n = V.env_int(GROUPED_ACT_BF16_ENV, 0)
    if not (n > 0 and tiles.block_m >= n):
        return False
    if _platform.family_of(t) in GROUPED_ACT_BF16_UNSAFE:
        _log_once(f"${GROUPED_ACT_BF16_ENV}={n} is not applied on {_platform.family_of(t)}: {ACT_BF16_UNSAFE_WHY}")
        return False
    return True


def _act_bf16(tiles: GroupedTiles, t: torch.Tensor, act_bf16: bool | None) -> bool:
    """The launchers' choice: ``act_bf16`` if given (True refused where unsafe), else ``grouped_act_bf16``."""
    if act_bf16 is None:
        return grouped_act_bf16(tiles, t)
    if act_bf16 and _platform.family_of(t) in GROUPED_ACT_BF16_UNSAFE:
        raise ValueError(f"act_bf16=True is not supported on {_platform.family_of(t)}: {ACT_BF16_UNSAFE_WHY}")
    return act_bf16


@functools.lru_cache(maxsize=None)
def _log_once(msg: str) -> None:
    """A warning under vLLM's ``vllm.sm121`` logger, once per message."""
    logging.getLogger("vllm.sm121").warning(msg)


def moe_fc1_swiglu_grouped(a, a_scale, w13, w13_scale, bias, topk_ids, align=None, tiles: GroupedTiles | None = None,
                           w_f2: bool = True, act_bf16: bool | None = None):
    """Prefill FC1: same contract as ``moe_fc1_swiglu``; grouped GEMM over expert-sorted pairs.

    ``align``: ``moe_align(topk_ids, E, tiles.block_m)`` if already built; ``tiles``: default
    ``grouped_tiles(a, M, topk, E)``. bf16 ``a`` is quantized to MXFP8 and back in
    registers by every program (``moe_block`` quantizes once, in the routing launch, instead).
    ``w_f2=False``: the caller knows every byte of ``w13_scale`` is <= 128 (``weight_scales_need_f2``)
    and the weight decoder skips its second multiply (the same values). Guarded: a tile whose weights
    hold a larger byte writes e8m0 NaN (255) as its output scales, which ``moe_fc2_grouped(...,
    nan_scales=True)`` turns into NaN outputs (never a wrong finite value).
    ``act_bf16`` (MXFP8 ``a``, halves decoder; default ``grouped_act_bf16``): the activations go to the
    kernel as ``act_halves_bf16_torch(a, a_scale)`` (the same values and products).
    """
    m, k, e, i, topk = _check_fc1(a, a_scale, w13, w13_scale, bias, topk_ids)
    mxfp8 = a.dtype != torch.bfloat16
    tiles = tiles or grouped_tiles(a, m, topk, e)
    block_n = tiles.block_n // 2  # SwiGLU outputs per program
    out = torch.empty(m * topk, i, dtype=torch.uint8, device=a.device)
    out_scale = torch.empty(m * topk, i // 32, dtype=torch.uint8, device=a.device)
    if m:
        order, tile_e, tile_s, tile_t = _grouped_align(align, topk_ids, e, tiles)
        block_k, halves = _grouped_block_k(a, tiles, k)
        a_halves = mxfp8 and halves and _act_bf16(tiles, a, act_bf16)
        if a_halves:
            a_in, a_s = act_halves_bf16_torch(a, a_scale), out_scale
        else:
            a_in, a_s = (a.view(torch.uint8), a_scale) if mxfp8 else (a, out_scale)
        _moe_fc1_grouped_kernel[(tile_e.numel(), -(-i // block_n))](
            a_in, a_s, w13, w13_scale, bias, order, tile_e, tile_s, tile_t, out, out_scale,
            K=k, I=i, TOPK=topk, BLOCK_M=tiles.block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, ALPHA=SWIGLU_ALPHA, LIMIT=SWIGLU_LIMIT,
            A_MXFP8=mxfp8 and not a_halves, DOT_FP32=_platform.family_of(a) == _platform.INTERPRETER,
            HW_FP8=_gpu_flags(a)["HW_FP8"], W_F2=w_f2, HALVES=halves, A_HALVES=a_halves,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out.view(torch.float8_e4m3fn), out_scale


def _check_fc2(h, h_scale, w2, w2_scale, bias, topk_ids, topk_weights) -> tuple[int, int, int, int, int]:
    V.check_ndim("w2", w2, 3, "[num_experts, hidden, intermediate / 2]")
    V.check_dtype("h", h, V.FP8_DTYPES)
    V.check_dtype("topk_ids", topk_ids, (torch.int32,))
    V.check_dtype("topk_weights", topk_weights, (torch.float32,))
    m, topk = topk_ids.shape
    e, hidden, i_half = w2.shape
    i = h.shape[1]
    if i % 64 or i_half * 2 != i or h.shape[0] != m * topk:
        raise ValueError(f"h {tuple(h.shape)} disagrees with w2 {tuple(w2.shape)} / topk_ids {tuple(topk_ids.shape)}; "
                         "intermediate must be a multiple of 64")
    if w2_scale.shape != (e, hidden, i // 32) or bias.shape != (e, hidden) or topk_weights.shape != (m, topk):
        raise ValueError(f"w2_scale {tuple(w2_scale.shape)}, bias {tuple(bias.shape)} or topk_weights "
                         f"{tuple(topk_weights.shape)} disagree with w2 {tuple(w2.shape)}")
    if h_scale.shape != (m * topk, i // 32):
        raise ValueError(f"h_scale {tuple(h_scale.shape)} must be [{m * topk}, {i // 32}]")
    return m, topk, e, hidden, i


def moe_fc2_grouped(h, h_scale, w2, w2_scale, bias, topk_ids, topk_weights, align=None,
                    tiles: GroupedTiles | None = None, out_dtype: torch.dtype = torch.bfloat16,
                    w_f2: bool = True, nan_scales: bool = True, act_bf16: bool | None = None) -> torch.Tensor:
    """Prefill FC2 + combine: same contract as ``moe_fc2_combine`` (bf16 [M, H], or fp32 for
    ``out_dtype``); ``align``, ``tiles`` and ``w_f2`` (for ``w2_scale``) as in ``moe_fc1_swiglu_grouped``
    (``w_f2=False`` guarded the same way: NaN outputs for a tile whose weights needed F2).
    ``nan_scales`` (default): an ``h_scale`` byte 255 (FC1's guard; MXFP8 quantizers write at most 254)
    makes its pair's output NaN. Pairs of routing weight 0 (EP slots of other ranks) are never set NaN.
    ``act_bf16`` as in ``moe_fc1_swiglu_grouped`` (h as ``act_halves_bf16_torch(h, h_scale)``)."""
    out_dtype = _out_dtype(out_dtype)
    m, topk, e, hidden, i = _check_fc2(h, h_scale, w2, w2_scale, bias, topk_ids, topk_weights)
    tiles = tiles or grouped_tiles(h, m, topk, e)
    part = torch.empty(m, topk, hidden, dtype=torch.float32, device=h.device)
    if m:
        order, tile_e, tile_s, tile_t = _grouped_align(align, topk_ids, e, tiles)
        block_k, halves = _grouped_block_k(h, tiles, i)
        a_halves = halves and _act_bf16(tiles, h, act_bf16)
        _moe_fc2_grouped_kernel[(tile_e.numel(), -(-hidden // tiles.block_n))](
            act_halves_bf16_torch(h, h_scale) if a_halves else h.view(torch.uint8), h_scale, w2, w2_scale, bias,
            topk_weights, order, tile_e, tile_s, tile_t, part,
            H=hidden, I=i, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
            DOT_FP32=_platform.family_of(h) == _platform.INTERPRETER, W_F2=w_f2, HALVES=halves,
            NAN_SCALES=nan_scales, A_HALVES=a_halves, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    # fp32 sum over the top-k slots, one rounding to bf16 (as the decode kernel)
    return part.sum(1).to(out_dtype)


# ---- the whole block ---------------------------------------------------------------------------

# Path by token count (performance hyper-parameters; benchmarks/moe.py times every path in one
# run: providers sm121_fma, sm121_decode, sm121_grouped): M <= FMA_MAX_TOKENS -> the CUDA-core
# GEMVs ("fma"), M <= DECODE_MAX_TOKENS -> the tl.dot_scaled GEMVs ("decode"), else the grouped
# GEMMs. FMA_MAX_TOKENS <= FMA_KERNEL_MAX_TOKENS; 0 turns the FMA path off. The environment
# variable VLLM_SM121_MOE_FMA_MAX_TOKENS, read at call time, overrides it (A/B runs).
FMA_MAX_TOKENS = 4
FMA_MAX_TOKENS_ENV = "VLLM_SM121_MOE_FMA_MAX_TOKENS"
# Windowed FMA: M up to the family's FMA_WINDOW_MAX_TOKENS (<= FMA_LAUNCH_MAX_TOKENS) runs the FMA
# GEMVs in one launch each after one routing launch, every program serving up to
# FMA_KERNEL_MAX_TOKENS of its expert's tokens (each token's output depends on its own slots
# only). An expert is streamed once per 4 of its tokens: with uniform top-4-of-128 routing an
# expert rarely has more than 4 tokens up to M = 16, so the weight bytes are the grouped GEMMs'.
# (Stop 38 ran chunks of 4 tokens, one launch pair each, which read an expert routed in two chunks
# twice: ~6% more bytes at M = 8, ~20% at M = 16.) Performance hyper-parameters, per family:
# * sm_90: the grouped GEMMs are instruction-bound there (25-35% of the copy bandwidth), the FMA
#   GEMVs less so. H200, same run (39c665f, docs/moe-window-h200-39c665f.json, gpt-oss-120b layer,
#   random routing): windowed M = 5 / 8 / 16 / 32 / 64 took 142.6 / 206.1 / 344.0 / 566.3 / 1032.9 us
#   vs 238.4 / 316.0 / 466.3 / 723.2 / 1014.1 us grouped (vLLM's triton_kernels 136.6 / 192.2 /
#   289.2 / 431.7 / 603.1), hence 32 at stop 39. (Stop 38's chunks, 318e2f3: 147.6 / 221.8 / 439.9 / 855.2 at
#   M = 5 / 8 / 16 / 32.)
#   Stop 42 (c27ad1a, gpt-oss-120b end to end, --random-router, one H200): with the grouped GEMMs' halves
#   decoder (stop 41) and routing that follows the tokens (experts reused more than uniformly), batch 32 ran
#   13.44-13.75 ms/step through the grouped GEMMs vs 17.83 windowed; batch 8 7.02-7.08 windowed vs 7.57
#   grouped (docs/e2e-120b-window-h200-c27ad1a.json; the 16 A/B next to upstream in
#   docs/e2e-120b-window16-h200-c27ad1a.json): hence 16 (uniform routing at M = 16: 342.9 us
#   windowed vs 367.2 grouped, stop 41).
# * sm_12x: 0 (the grouped GEMMs from M = 5). Not timed (no GB10); an estimate: GB10 has ~0.44x an
#   H200's instruction rate but 273 GB/s, so both paths would be bound by the bytes they read
#   there (M = 8 grouped: ~0.7 ms of instructions vs ~1.7 ms of DRAM time at 85% of 273 GB/s).
#   With uniform routing those bytes are equal, but an expert with more than 4 tokens (skewed
#   routing; dummy weights send every token to the same 4) is read once per 4 of them here and
#   once per 16 by the grouped GEMMs.
# $VLLM_SM121_MOE_FMA_WINDOW_MAX_TOKENS (read at call time) overrides it (A/B runs; 0: off).
FMA_WINDOW_MAX_TOKENS: dict[str, int] = {_platform.SM90: 16, _platform.SM12X: 0, _platform.INTERPRETER: 0}
FMA_WINDOW_MAX_TOKENS_ENV = "VLLM_SM121_MOE_FMA_WINDOW_MAX_TOKENS"
# H100 at 8e7d4de (docs/moe-grouped-sweep-h100-8e7d4de.json): the swap-AB grouped GEMMs take
# M = 8 in 375 us against 675 us for the dot_scaled decode GEMVs, which keep M <= 4 only (122 us
# at M = 1 vs 155 us grouped) for when the FMA path is switched off.
DECODE_MAX_TOKENS = 4
PATHS = ("auto", "fma", "decode", "grouped")


@dataclasses.dataclass(frozen=True)
class L2Plan:
    """L2 prefetches of ``moe_block``'s one-chunk FMA path (``l2_prefetch``): FC2 prefetches
    ``next_weight`` (the next layer's qkv weight; after its own stream with ``next_late``); with
    ``w2``, FC1 prefetches the routed experts' FC2 rows (after its own stream with ``w2_late``)."""

    next_weight: torch.Tensor | None = None
    next_late: bool = False
    w2: bool = False
    w2_late: bool = False


def fma_window_max_tokens(t: torch.Tensor | None = None) -> int:
    """The largest M the windowed FMA path takes on ``t``'s device: $VLLM_SM121_MOE_FMA_WINDOW_MAX_TOKENS
    if set (read now), else FMA_WINDOW_MAX_TOKENS of its family (0, off, without a tensor); at
    most FMA_LAUNCH_MAX_TOKENS."""
    default = 0 if t is None else FMA_WINDOW_MAX_TOKENS.get(_platform.family_of(t), 0)
    return min(V.env_int(FMA_WINDOW_MAX_TOKENS_ENV, default), FMA_LAUNCH_MAX_TOKENS)


def select_path(m: int, t: torch.Tensor | None = None) -> str:
    """The path ``moe_block(path="auto")`` takes for M tokens on ``t``'s device (from M and the
    device alone: graph-capturable)."""
    fma_max = min(V.env_int(FMA_MAX_TOKENS_ENV, FMA_MAX_TOKENS), FMA_KERNEL_MAX_TOKENS)
    window_max = fma_window_max_tokens(t)
    if m <= fma_max or (fma_max >= FMA_KERNEL_MAX_TOKENS and m <= window_max):  # (windows only above a whole one)
        return "fma"
    return "decode" if m <= DECODE_MAX_TOKENS else "grouped"


def moe_block(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
              w13_bias: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w2_bias: torch.Tensor, topk: int,
              x_scale: torch.Tensor | None = None, path: str = "auto",
              expert_map: torch.Tensor | None = None, l2: L2Plan | None = None,
              next_norm: NextNorm | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """gpt-oss routed experts: bf16 [M, H] = sum over the top-k experts of w_j * FFN_j(x).

    x: bf16 [M, H] (quantized to MXFP8 inside FC1) or e4m3 [M, H] with x_scale [M, H/32] e8m0
    (from the fused norm). router_logits: [M, E]. The path is chosen from M alone
    (``select_path``), so a captured CUDA graph always replays the same kernels; ``path`` forces
    one ("fma" above FMA_KERNEL_MAX_TOKENS tokens: windowed FMA GEMVs, one launch each per
    FMA_LAUNCH_MAX_TOKENS tokens, after one routing launch for all of them).

    Parallel ranks: under tensor parallelism the weights are this rank's intermediate shard (w2
    bias on one rank only, as vLLM loads it); under expert parallelism they are the rank's experts
    and ``expert_map`` ([E] int32, global -> local or -1; ``moe_route``) routes. Either way the
    result is this rank's share, summed across ranks by the caller's all-reduce. ``out_dtype``
    torch.float32 returns that share unrounded (fp32 sums of the fp32 partials), so that an fp32
    all-reduce and one rounding to bf16 after it give one rank's result up to fp32 summation order
    (``vllm_sm121/moe/hook.py``, exact TP reductions).

    ``l2``: L2 prefetches of the FMA path up to FMA_KERNEL_MAX_TOKENS (``L2Plan``; ignored otherwise).

    ``next_norm`` (at most NEXT_NORM_MAX_T tokens): also writes the next layer's carried input norm
    of ``out + next_norm.residual`` (``kernels/next_norm.py``): in FC2's combine on the FMA path,
    else by ``next_norm_torch`` after the block.
    """
    if _out_dtype(out_dtype) != torch.bfloat16 and next_norm is not None:
        raise ValueError("next_norm needs the bf16 output (out_dtype=torch.bfloat16)")
    out, carried = _moe_block(x, router_logits, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias, topk, x_scale, path,
                              expert_map, l2, next_norm, out_dtype)
    if next_norm is not None and not carried:
        next_norm.check(out)
        if out.shape[0]:
            next_norm_torch(out, next_norm)
    return out


def _moe_block(x, router_logits, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias, topk, x_scale, path, expert_map,
               l2, next_norm, out_dtype=torch.bfloat16) -> tuple[torch.Tensor, bool]:
    """``moe_block``'s output and whether FC2's combine wrote ``next_norm``."""
    if path not in PATHS:
        raise ValueError(f"path={path!r} is not supported; supported: {', '.join(PATHS)}")
    m = x.shape[0]
    if path == "auto":
        path = select_path(m, x)
    # routing inside FC1 (opt-in, one chunk of MXFP8 tokens): FC1 fills topk_w / topk_ids
    fuse = path == "fma" and 0 < m <= FMA_KERNEL_MAX_TOKENS and x.dtype != torch.bfloat16 and fused_route(m, x)
    # otherwise, every path: routing and the MXFP8 quantization of bf16 x in one launch (not per FC1 program)
    if fuse:
        topk_w = torch.empty(m, topk, dtype=torch.float32, device=x.device)
        topk_ids = torch.empty(m, topk, dtype=torch.int32, device=x.device)
    elif x.dtype == torch.bfloat16:
        topk_w, topk_ids, x, x_scale = moe_route(router_logits, topk, x.contiguous(), expert_map)
    else:
        topk_w, topk_ids = moe_route(router_logits, topk, expert_map=expert_map)
    if path in ("fma", "decode"):
        if path == "fma":
            outs = []
            pf = l2 if l2 is not None and m <= FMA_KERNEL_MAX_TOKENS else L2Plan()  # not windowed
            for c in range(0, max(m, 1), FMA_LAUNCH_MAX_TOKENS):  # one launch pair for M <= FMA_LAUNCH_MAX_TOKENS
                sl = slice(c, c + FMA_LAUNCH_MAX_TOKENS)
                tiles = fma_tiles(x, x[sl].shape[0])
                h, h_scale = moe_fc1_swiglu_fma(x[sl], x_scale[sl], w13, w13_scale, w13_bias, topk_ids[sl], tiles,
                                                route=(router_logits, expert_map, topk_w) if fuse else None,
                                                l2_w2=(w2, w2_scale) if pf.w2 else None, l2_late=pf.w2_late)
                nn = next_norm if m <= FMA_KERNEL_MAX_TOKENS else None  # (not windowed)
                outs.append(moe_fc2_combine_fma(h, h_scale, w2, w2_scale, w2_bias, topk_ids[sl], topk_w[sl], tiles,
                                                l2_next=pf.next_weight, l2_late=pf.next_late, next_norm=nn,
                                                out_dtype=out_dtype))
            return (outs[0], nn is not None) if len(outs) == 1 else (torch.cat(outs), False)
        h, h_scale = moe_fc1_swiglu(x, x_scale, w13, w13_scale, w13_bias, topk_ids)
        return moe_fc2_combine(h, h_scale, w2, w2_scale, w2_bias, topk_ids, topk_w, out_dtype), False
    # one choice for moe_align and both GEMMs; under EP each local expert sees the pairs of a global one
    # (m * topk / E on average), and the same tiles as at EP = 1 keep the same summation order
    tiles = grouped_tiles(x, m, topk, expert_map.numel() if expert_map is not None else w13.shape[0])
    align = moe_align(topk_ids, w13.shape[0], tiles.block_m) if m else None
    f2_13, f2_2 = weight_scales_f2(w13_scale), weight_scales_f2(w2_scale)  # register_weight_scales
    h, h_scale = moe_fc1_swiglu_grouped(x, x_scale, w13, w13_scale, w13_bias, topk_ids, align, tiles, w_f2=f2_13)
    return moe_fc2_grouped(h, h_scale, w2, w2_scale, w2_bias, topk_ids, topk_w, align, tiles, out_dtype,
                           w_f2=f2_2), False


def moe_block_torch(x, router_logits, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias, topk: int,
                    x_scale=None, activations: str = "mxfp8", expert_map=None) -> torch.Tensor:
    """Reference of ``moe_block`` in fp32 ([M, H]), one expert at a time (bounded memory at gpt-oss sizes).

    activations="mxfp8": the kernels' numerics (MXFP8 into FC1 and into FC2). "bf16": the same
    MXFP4 weights with bf16 activations (x as given, SwiGLU output rounded to bf16: what a
    bf16-activation backend computes), to measure what the MXFP8 activations cost.
    """
    from .norm_mxfp8 import mxfp8_dequantize_torch, mxfp8_quantize_torch

    if activations not in ("mxfp8", "bf16"):
        raise ValueError(f"activations={activations!r} is not supported; supported: mxfp8, bf16")
    if x.dtype != torch.bfloat16:
        xf = mxfp8_dequantize_torch(x, x_scale.clamp(min=1))
    elif activations == "mxfp8":
        xf = mxfp8_dequantize_torch(*mxfp8_quantize_torch(x.float()))
    else:
        xf = x.float()
    topk_w, topk_ids = moe_route_torch(router_logits, topk, expert_map)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = xf[tok] @ dequant_mxfp4_torch(w13[e], w13_scale[e]).T + w13_bias[e].float()
        gate, up = h[:, 0::2].clamp(max=SWIGLU_LIMIT), h[:, 1::2].clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        act = (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)
        if activations == "mxfp8":
            q, s = mxfp8_quantize_torch(act)
            act = mxfp8_dequantize_torch(q, s.clamp(min=1))
        else:
            act = act.bfloat16().float()
        o = act @ dequant_mxfp4_torch(w2[e], w2_scale[e]).T + w2_bias[e].float()
        out.index_add_(0, tok, o * topk_w[tok, slot, None])
    return out
