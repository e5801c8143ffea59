"""Triton code for gpt-oss routing: top-k of the router logits, softmax over the selected (launcher: ``kernels/moe.py``)."""

import triton
import triton.language as tl


@triton.jit
def _moe_route_kernel(
    logits_ptr,  # [M, E] router logits (bf16/fp16/fp32)
    topk_w_ptr,  # [M, TOPK] fp32: softmax over the selected logits (= softmax over all, renormalized)
    topk_ids_ptr,  # [M, TOPK] int32, in descending logit order (ties: lowest expert id first)
    stride_l: tl.int64,
    E: tl.constexpr,
    E_PAD: tl.constexpr,  # power of two >= E
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,  # power of two >= TOPK
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + row * stride_l + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    slots = tl.arange(0, TOPK_PAD)
    vals = tl.full([TOPK_PAD], float("-inf"), tl.float32)
    ids = tl.zeros([TOPK_PAD], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.max(logits, axis=0)
        idx = tl.min(tl.where(logits == best, offs, E_PAD), axis=0)
        vals = tl.where(slots == j, best, vals)
        ids = tl.where(slots == j, idx, ids)
        logits = tl.where(offs == idx, float("-inf"), logits)
    p = tl.where(slots < TOPK, tl.exp(vals - tl.max(vals, axis=0)), 0.0)
    p = p / tl.sum(p, axis=0)
    tl.store(topk_w_ptr + row * TOPK + slots, p, mask=slots < TOPK)
    tl.store(topk_ids_ptr + row * TOPK + slots, ids, mask=slots < TOPK)
