"""Fused residual-add + RMSNorm producing MXFP8 for gpt-oss's experts and bf16 for its router.

One kernel does what the design's decode step asks before the MoE (design.md): ``residual +=
x``; ``y = rmsnorm(residual) * weight``; ``y`` in bf16 for the router GEMM and in MXFP8 (e4m3
values, one e8m0 power-of-two scale per 32 along the hidden size) for the expert GEMMs, so no
standalone quantization kernel runs between layers. ``fused_add_rmsnorm_mxfp8_router`` also
computes the router's logits in the same kernel (small batches), which removes the router GEMM's
launches (cuBLAS GEMV + split-K reduce) from each decode layer.

Wired into gpt-oss by ``vllm_sm121/moe/hook.py``.
"""

from __future__ import annotations

import os

import torch
import triton

from . import _validate as V
from .norm_mxfp8_details._norm_mxfp8 import _add_rmsnorm_mxfp8_kernel, _add_rmsnorm_mxfp8_router_kernel

MX_BLOCK = 32

# The router fused into the norm (``fused_add_rmsnorm_mxfp8_router``) for batches of at most this many
# tokens; larger ones run the norm kernel and then the router as a bf16 GEMM (torch.nn.functional.linear):
# each fused program re-reads its BLOCK_E router rows per token, which only pays while T is small.
ROUTER_FUSED_MAX_TOKENS = 8
# performance hyper-parameters of the router kernel: router outputs per program (gpt-oss: 128
# experts -> 64 programs per token) and warps; each program also quantizes its share of the row's
# MXFP8 blocks (router_tiles). $VLLM_SM121_NORM_ROUTER_TILES="block_e,warps[,qblocks]" overrides
# them at call time (qblocks: MXFP8 blocks per program, a power of two; default: the row's blocks
# spread over its programs; the row's block count rounded up to a power of two puts them all on
# program 0, as before 006c509). H200, gpt-oss-120b (H 2880, E 128), in-graph, L2 flushed
# (gpu_session.sh normroutersweep, docs/logs/normroutersweep-h200-006c509.log), us at M = 1 / 2 / 4:
#   4,4 with all blocks on program 0: 5.4 / 5.3 / 5.7     4,4 spread (4 blocks each): 3.7 / 3.7 / 3.6
#   2,4 (2 blocks each): 3.4 / 3.5 / 3.7                   1,4: 3.4 / 3.7 / 4.0    4,8: 3.6 / 3.7 / 3.6
# (norm kernel + cuBLAS router: 10.7 / 11.9 / 11.9). sm_12x takes the same tiles (not measured there).
ROUTER_BLOCK_E = 2
ROUTER_WARPS = 4
NORM_ROUTER_TILES_ENV = "VLLM_SM121_NORM_ROUTER_TILES"


def router_tiles(h: int, e: int) -> tuple[int, int, int]:
    """(block_e, num_warps, qblocks) of the router kernel for hidden size ``h`` and ``e`` experts."""
    block_e, warps, qblocks = ROUTER_BLOCK_E, ROUTER_WARPS, 0
    env = os.environ.get(NORM_ROUTER_TILES_ENV, "").strip()
    if env:
        try:
            vals = [int(v) for v in env.split(",")]
            block_e, warps = vals[:2]
            qblocks = vals[2] if len(vals) > 2 else 0
        except ValueError:
            vals = []
        if len(vals) not in (2, 3) or block_e < 1 or e % block_e or block_e & (block_e - 1) or warps not in (1, 2, 4, 8, 16) or (
                qblocks & (qblocks - 1)):
            raise ValueError(f"{NORM_ROUTER_TILES_ENV}={env!r}: expected block_e,warps[,qblocks] (block_e a power of "
                             f"two dividing {e}, warps in 1..16, qblocks a power of two)")
    if e % block_e:
        return block_e, warps, 0  # (no fused kernel: fused_add_rmsnorm_mxfp8_router takes the fallback)
    programs = e // block_e
    need = triton.next_power_of_2(triton.cdiv(h // MX_BLOCK, programs))
    if qblocks < need:
        if qblocks:
            raise ValueError(f"{NORM_ROUTER_TILES_ENV}={env!r}: {programs} programs x {qblocks} blocks do not cover "
                             f"{h // MX_BLOCK} MXFP8 blocks")
        qblocks = need
    return block_e, warps, qblocks


def _check_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    V.check_ndim("x", x, 2, "[num_tokens, hidden]")
    V.check_dtype("x", x, (torch.bfloat16,))
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    h = x.shape[1]
    if h % MX_BLOCK:
        raise ValueError(f"hidden size {h} is not supported; supported: multiples of {MX_BLOCK}")
    if weight.shape != (h,):
        raise ValueError(f"weight must have shape [{h}], got {tuple(weight.shape)}")
    for name, a in (("x", x), ("residual", residual)):
        V.check_last_dim_contiguous(name, a)


def fused_add_rmsnorm_mxfp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
                            residual_out: torch.Tensor | None = None, mx: bool = True):
    """Returns (y bf16 [T, H], values float8_e4m3fn [T, H], scales uint8 e8m0 [T, H/32]); writes
    ``x + residual`` to ``residual_out`` (default: ``residual``, updated in place). ``mx=False``:
    the add + RMSNorm alone, returning (y, None, None)."""
    _check_norm(x, residual, weight)
    if residual_out is None:
        residual_out = residual
    elif (residual_out.shape != x.shape or residual_out.dtype != x.dtype or residual_out.stride(-1) != 1
          or residual_out.device != x.device):
        raise ValueError(f"residual_out {tuple(residual_out.shape)} {residual_out.dtype} on {residual_out.device} "
                         f"must match x {tuple(x.shape)} {x.dtype} on {x.device} with a contiguous last dimension")
    t, h = x.shape
    y = torch.empty_like(x)
    q = torch.empty(t if mx else 0, h, dtype=torch.uint8, device=x.device)
    s = torch.empty(t if mx else 0, h // MX_BLOCK, dtype=torch.uint8, device=x.device)
    if t:
        block_h = triton.next_power_of_2(h)
        # performance hyper-parameters: one row per program; 2880 bf16 = 5.6 KB per row.
        _add_rmsnorm_mxfp8_kernel[(t,)](x, residual, residual_out, weight, y, q, s, float(eps), x.stride(0),
                                        residual.stride(0), residual_out.stride(0), y.stride(0), q.stride(0),
                                        s.stride(0), H=h, BLOCK_H=block_h, num_warps=4 if block_h >= 2048 else 2,
                                        MX=mx, **V.pdl_launch(x))
    return (y, q.view(torch.float8_e4m3fn), s) if mx else (y, None, None)


def _check_router(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor) -> None:
    h = x.shape[1]
    if router_w.ndim != 2 or router_w.shape[1] != h or router_w.dtype != torch.bfloat16:
        raise ValueError(f"router weight must be bf16 [num_experts, {h}], got {tuple(router_w.shape)} {router_w.dtype}")
    if router_b.shape != (router_w.shape[0],) or router_b.dtype != router_w.dtype or router_b.stride(0) != 1:
        raise ValueError(f"router bias must be contiguous {router_w.dtype} [{router_w.shape[0]}], got "
                         f"{tuple(router_b.shape)} {router_b.dtype} stride {tuple(router_b.stride())}")
    V.check_last_dim_contiguous("router weight", router_w)


def fused_add_rmsnorm_mxfp8_router(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                   router_w: torch.Tensor, router_b: torch.Tensor, eps: float = 1e-5):
    """The post-attention norm with gpt-oss's router: returns (x + residual bf16 [T, H], values
    float8_e4m3fn [T, H], scales uint8 e8m0 [T, H/32], router logits bf16 [T, E]); ``residual`` is
    not modified. Up to ROUTER_FUSED_MAX_TOKENS tokens it is one kernel (the router GEMV inside the
    norm); beyond, ``fused_add_rmsnorm_mxfp8`` and a bf16 linear."""
    _check_norm(x, residual, weight)
    _check_router(x, router_w, router_b)
    t, h = x.shape
    e = router_w.shape[0]
    res = torch.empty_like(x)
    block_e, warps, qblocks = router_tiles(h, e)
    if t > ROUTER_FUSED_MAX_TOKENS or e % block_e:
        y, q, s = fused_add_rmsnorm_mxfp8(x, residual, weight, eps, residual_out=res)
        return res, q, s, torch.nn.functional.linear(y, router_w, router_b)
    q = torch.empty(t, h, dtype=torch.uint8, device=x.device)
    s = torch.empty(t, h // MX_BLOCK, dtype=torch.uint8, device=x.device)
    g = torch.empty(t, e, dtype=torch.bfloat16, device=x.device)
    if t:
        block_h = triton.next_power_of_2(h)
        _add_rmsnorm_mxfp8_router_kernel[(t, e // block_e)](
            x, residual, weight, router_w, router_b, res, q, s, g, float(eps), x.stride(0), residual.stride(0),
            router_w.stride(0), res.stride(0), q.stride(0), s.stride(0), g.stride(0), H=h, E=e, BLOCK_H=block_h,
            BLOCK_E=block_e, QBLOCKS=qblocks, num_warps=warps, **V.pdl_launch(x))
    return res, q.view(torch.float8_e4m3fn), s, g


def fused_add_rmsnorm_mxfp8_router_torch(x, residual, weight, router_w, router_b, eps: float = 1e-5):
    """Reference of ``fused_add_rmsnorm_mxfp8_router`` (router logits from bf16 y in fp32, rounded to bf16)."""
    res = residual.clone()
    y, q, s = fused_add_rmsnorm_mxfp8_torch(x, res, weight, eps)
    g = (y.float() @ router_w.float().t() + router_b.float()).to(torch.bfloat16)
    return res, q, s, g


def mxfp8_quantize_torch(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference MXFP8 of fp32 ``y`` [T, H]: (float8_e4m3fn values, uint8 e8m0 scales)."""
    t, h = y.shape
    yb = y.float().view(t, h // MX_BLOCK, MX_BLOCK)
    amax = yb.abs().amax(-1)
    k = torch.floor(torch.log2(amax.clamp(min=2.0**-126))).to(torch.int32)
    # log2 on exact powers of two is exact; guard the float's floor against rounding just below.
    k = torch.where(torch.exp2(k.float() + 1) <= amax, k + 1, k)
    e = torch.where(amax > 1.75 * torch.exp2(k.float()), k - 7, k - 8)
    e = torch.where(amax > 0, e.clamp(-127, 127), torch.full_like(e, -127))
    vals = (yb * torch.exp2(-e.float())[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return vals.view(t, h), (e + 127).to(torch.uint8)


def fused_add_rmsnorm_mxfp8_torch(x, residual, weight, eps: float = 1e-5):
    """Reference of ``fused_add_rmsnorm_mxfp8`` (same outputs; updates ``residual``)."""
    r = (x.float() + residual.float()).to(x.dtype)
    residual.copy_(r)
    rf = r.float()
    y = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    vals, scales = mxfp8_quantize_torch(y)
    return y.to(x.dtype), vals, scales


def mxfp8_dequantize_torch(vals: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    t, h = vals.shape
    return (vals.float().view(t, h // MX_BLOCK, MX_BLOCK) * torch.exp2(scales.float() - 127)[..., None]).view(t, h)
