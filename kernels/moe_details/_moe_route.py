"""Triton code for gpt-oss routing: top-k of the router logits, softmax over the selected, and
(optionally, same launch) the MXFP8 quantization of the token's activations (launcher: ``kernels/moe.py``).

Robust to what CUDA-graph padding and dummy runs feed it: NaN logits count as the lowest value,
+-inf are clamped to +-FLT_MAX, so every row yields TOPK distinct ids in [0, E) and finite
weights summing to 1 (a row of NaN picks experts 0..TOPK-1 with equal weights).

Expert parallelism (HAS_MAP): ``expert_map[global id]`` is the rank's local id or -1 (vLLM's
``RoutedExperts.expert_map``). A slot whose expert lives on another rank gets weight 0 and the
local id of the token's first local slot (the expert kernels already merge a token's slots that
share an expert, so it reads no extra weights), or local expert 0 when the token has none here;
the ranks' outputs are then summed by the all-reduce vLLM runs after the experts.
"""

import triton
import triton.language as tl

from ._mx import mxfp8_quantize_rows_fast

FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def route_rows(logits_ptr, stride_l, rows, rows_ok, expert_map_ptr, E: tl.constexpr, E_PAD: tl.constexpr,
               TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, HAS_MAP: tl.constexpr):
    """Routing of the router-logit rows ``rows`` [R] (``rows_ok`` masks them): (weights fp32 [R,
    TOPK_PAD], ids int32 [R, TOPK_PAD]); slots >= TOPK have weight 0 (their ids are 0, or with
    HAS_MAP the borrowed local id: callers mask them). Shared by ``_moe_route_kernel`` (one row per
    program) and the FMA FC1 with fused routing (every program routes the M <= 4 tokens)."""
    offs = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + offs[None, :],
                     mask=rows_ok[:, None] & (offs[None, :] < E), other=0.0).to(tl.float32)
    logits = tl.where(logits != logits, -FLT_MAX, logits)  # NaN -> lowest
    logits = tl.minimum(tl.maximum(logits, -FLT_MAX), FLT_MAX)  # all finite from here
    avail = (offs[None, :] < E) & rows_ok[:, None]
    slots = tl.arange(0, TOPK_PAD)[None, :]
    vals = tl.zeros([rows.shape[0], TOPK_PAD], dtype=tl.float32)
    ids = tl.zeros([rows.shape[0], TOPK_PAD], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.max(tl.where(avail, logits, -FLT_MAX), axis=1)
        idx = tl.min(tl.where(avail & (logits == best[:, None]), offs[None, :], E_PAD), axis=1)
        idx = tl.minimum(idx, E - 1)  # unreachable (avail holds >= 1 expert while j < TOPK <= E)
        vals = tl.where(slots == j, best[:, None], vals)
        ids = tl.where(slots == j, idx[:, None], ids)
        avail = avail & (offs[None, :] != idx[:, None])
    top = tl.max(tl.where(slots < TOPK, vals, -FLT_MAX), axis=1)
    p = tl.where(slots < TOPK, tl.exp(vals - top[:, None]), 0.0)
    # the denominator in slot order whatever the layout (tl.sum's order follows the layout, i.e. the
    # rows and warps of the caller: the routing launch and the fused FC1 must give the same bits);
    # picking one slot out of zeros is exact
    den = tl.zeros([rows.shape[0]], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        den += tl.sum(tl.where(slots == j, p, 0.0), axis=1)
    p = p / den[:, None]  # den >= 1: the best slot contributes exp(0)
    if HAS_MAP:
        loc = tl.load(expert_map_ptr + ids, mask=(slots < TOPK) & rows_ok[:, None], other=-1)
        here = (loc >= 0) & (slots < TOPK)
        p = tl.where(here, p, 0.0)
        first_here = tl.min(tl.where(here, slots, TOPK_PAD), axis=1)
        borrow = tl.sum(tl.where(slots == first_here[:, None], loc, 0), axis=1)  # 0 when no slot is here
        ids = tl.where(here, loc, borrow[:, None])
    return p, ids


@triton.jit
def _moe_route_kernel(
    logits_ptr,  # [M, E] router logits (bf16/fp16/fp32)
    topk_w_ptr,  # [M, TOPK] fp32: softmax over the selected logits (= softmax over all, renormalized)
    topk_ids_ptr,  # [M, TOPK] int32, in descending logit order (ties: lowest expert id first)
    x_ptr,  # [M, K] bf16 activations (QUANT only)
    xq_ptr,  # [M, K] uint8 e4m3 out (QUANT only)
    xs_ptr,  # [M, K / 32] uint8 e8m0 out (QUANT only)
    expert_map_ptr,  # [E] int32: global -> local expert id, -1 elsewhere (HAS_MAP only)
    stride_l: tl.int64,
    E: tl.constexpr,
    E_PAD: tl.constexpr,  # power of two >= E
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,  # power of two >= TOPK
    K: tl.constexpr,  # hidden size (QUANT only; a multiple of 32)
    BLOCK_K: tl.constexpr,  # power of two >= 32
    ROUTE: tl.constexpr,
    QUANT: tl.constexpr,
    HW_FP8: tl.constexpr,
    HAS_MAP: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    if ROUTE:
        rows = row + tl.arange(0, 1)
        p, ids = route_rows(logits_ptr, stride_l, rows, rows == row, expert_map_ptr, E, E_PAD, TOPK, TOPK_PAD,
                            HAS_MAP)
        slots = tl.arange(0, TOPK_PAD)[None, :]
        tl.store(topk_w_ptr + rows[:, None] * TOPK + slots, p, mask=slots < TOPK)
        tl.store(topk_ids_ptr + rows[:, None] * TOPK + slots, ids, mask=slots < TOPK)
    if QUANT:
        for k0 in tl.static_range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * K + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            codes, scales = mxfp8_quantize_rows_fast(x[None, :], 1, BLOCK_K // 32, HW_FP8)
            tl.store(xq_ptr + row * K + offs_k[None, :], codes, mask=offs_k[None, :] < K)
            offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            tl.store(xs_ptr + row * (K // 32) + offs_g[None, :], scales, mask=offs_g[None, :] < K // 32)
