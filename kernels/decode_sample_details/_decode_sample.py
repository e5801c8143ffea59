"""Triton kernels of ``kernels/decode_sample.py``: per-block scores and argmax, then per-row reduction."""

import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 lanes (multiplies wrap mod 2**32), as ``graph/sampler.py``'s ``_mix32``."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _lo32(v):
    return (v & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def _decode_sample_partial_kernel(logits_ptr, stride_row, temp_ptr, seed_ptr, step_ptr, part_val_ptr, part_idx_ptr,
                                  V, NB, EPS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, block): the best score of BLOCK vocabulary entries and its lowest index.
    Greedy rows (temperature < EPS) score the raw fp32 logit; the others logit / T + Gumbel noise
    (-log(-log u)), u a pure function of (the row's seed, the step counter, the token index)."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
    t = tl.load(temp_ptr + row)
    if t >= EPS:
        seed = tl.load(seed_ptr + row)
        step = tl.load(step_ptr)
        k = _mix32(_lo32(seed) ^ 0x9E3779B9)
        k = _mix32(k ^ _lo32(seed >> 32))
        k = _mix32(k ^ _lo32(step))
        k1 = _mix32(k ^ _lo32(step >> 32))
        k2 = _mix32(k1 ^ 0x85EBCA6B)
        h = _mix32(_mix32(offs.to(tl.uint32) ^ k1) ^ k2)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        x = tl.where(mask, x / t - tl.log(-tl.log(u)), float("-inf"))
    idx = tl.argmax(x, axis=0, tie_break_left=True)
    best = tl.max(x, axis=0)
    tl.store(part_val_ptr + row * NB + blk, best)
    tl.store(part_idx_ptr + row * NB + blk, blk * BLOCK + idx)


@triton.jit
def _decode_sample_final_kernel(part_val_ptr, part_idx_ptr, out_ptr, step_ptr, NB, NB_P2: tl.constexpr):
    """Program (row): the best block's index (lowest index among equal scores); program 0 then
    advances the step counter (the partial kernel, an earlier launch, has read it)."""
    row = tl.program_id(0)
    offs = tl.arange(0, NB_P2)
    m = offs < NB
    v = tl.load(part_val_ptr + row * NB + offs, mask=m, other=float("-inf"))
    i = tl.load(part_idx_ptr + row * NB + offs, mask=m, other=2147483647)
    best = tl.max(v, axis=0)
    tok = tl.min(tl.where(m & (v == best), i, 2147483647), axis=0)
    tl.store(out_ptr + row, tok.to(out_ptr.dtype.element_ty))
    if row == 0:
        tl.store(step_ptr, tl.load(step_ptr) + 1)
