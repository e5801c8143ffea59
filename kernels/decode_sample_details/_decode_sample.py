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
def _key(s):
    """fp32 -> int32 in the order of the values (-0.0 folded into +0.0 first, as they compare equal)."""
    b = (s + 0.0).to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _scaled(base, off, t, V, other, BLOCK: tl.constexpr):
    """BLOCK scaled logits from ``off`` (IEEE division: torch's values) and their mask."""
    offs = off + tl.arange(0, BLOCK)
    m = offs < V
    return tl.math.div_rn(tl.load(base + offs, mask=m, other=other).to(tl.float32), t), m


@triton.jit
def _pivots(lo, span, FAN: tl.constexpr):
    """FAN keys splitting [lo, lo + span) evenly, the first one lo (int64)."""
    return lo + (tl.arange(0, FAN).to(tl.int64) * span) // FAN


@triton.jit
def _counts_ge(base, t, V, piv, BLOCK: tl.constexpr):
    """[FAN]: how many entries of logits / t have a key >= each pivot."""
    cnt = tl.zeros(piv.shape, tl.int32)
    for off in range(0, V, BLOCK):
        x, m = _scaled(base, off, t, V, 0.0, BLOCK)
        k = _key(x).to(tl.int64)
        cnt += tl.sum(((k[:, None] >= piv[None, :]) & m[:, None]).to(tl.int32), axis=0)
    return cnt


@triton.jit
def _masses_le(base, t, V, lo_key, piv, top, BLOCK: tl.constexpr):
    """[FAN]: sums of exp(s - top) over entries s = logits / t with lo_key <= key(s) <= each pivot."""
    acc = tl.zeros(piv.shape, tl.float32)
    for off in range(0, V, BLOCK):
        x, m = _scaled(base, off, t, V, 0.0, BLOCK)
        k = _key(x).to(tl.int64)
        e = tl.where(m & (k >= lo_key), tl.exp(x - top), 0.0)
        acc += tl.sum(tl.where(k[:, None] <= piv[None, :], e[:, None], 0.0), axis=0)
    return acc


@triton.jit
def _decode_sample_threshold_kernel(logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, thr_ptr, V,
                                    EPS: tl.constexpr, BLOCK: tl.constexpr, FAN: tl.constexpr):
    """Program (row): the smallest key a temperature row keeps after top-k then top-p (vLLM's
    order and rules: top-k keeps every value >= the k-th largest; top-p, on the top-k survivors'
    softmax, keeps the values whose mass at or below them exceeds 1 - p), by a FAN-ary search over
    the 32-bit keys of the scaled logits: each pass over the vocabulary evaluates FAN pivots and
    narrows the range FAN-fold (exact after 8 passes with FAN = 16; no sort). Off rows, greedy rows
    and rows with neither option get the smallest key (everything kept)."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    t = tl.load(temp_ptr + row)
    k = tl.load(topk_ptr + row)
    p = tl.load(topp_ptr + row)
    thr = tl.full([], -2147483648, tl.int64)
    if t >= EPS:
        jj = tl.arange(0, FAN).to(tl.int64)
        if (k > 0) & (k < V):  # the largest key T with count(key >= T) >= k; count(key >= lo) >= k holds
            lo = tl.full([], -2147483648, tl.int64)
            hi = tl.full([], 2147483647, tl.int64)
            for _ in range(8):
                span = hi - lo + 1
                cnt = _counts_ge(base, t, V, _pivots(lo, span, FAN), BLOCK)
                j = tl.max(tl.where(cnt >= k, jj, 0), axis=0)  # the last pivot that still holds k
                hi = tl.where(j == FAN - 1, hi, lo + ((j + 1) * span) // FAN - 1)
                lo = lo + (j * span) // FAN
            thr = lo
        if p < 1.0:  # the smallest key T with mass(thr <= key <= T) > (1 - p) * mass(key >= thr)
            top = float("-inf")
            for off in range(0, V, BLOCK):
                x, m = _scaled(base, off, t, V, float("-inf"), BLOCK)
                top = tl.maximum(top, tl.max(x, axis=0))
            total = tl.max(_masses_le(base, t, V, thr, tl.full([FAN], 2147483647, tl.int64), top, BLOCK), axis=0)
            cut = (1.0 - p) * total
            lo = thr
            hi = tl.full([], 2147483647, tl.int64)
            for _ in range(8):  # the answer stays in [lo, hi]
                span = hi - lo + 1
                piv = _pivots(lo, span, FAN)
                j = tl.min(tl.where(_masses_le(base, t, V, thr, piv, top, BLOCK) > cut, jj, FAN), axis=0)
                new_hi = tl.where(j == FAN, hi, lo + (j * span) // FAN)
                lo = tl.where(j == 0, lo, lo + ((j - 1) * span) // FAN + 1)
                hi = new_hi
                lo = tl.minimum(lo, hi)
            # the largest value stays (vLLM's rule), also when (1 - p) * mass rounds up to the whole
            # mass (p below ~1e-7): then no key qualifies and lo ends past every key
            thr = tl.minimum(lo, _key(top).to(tl.int64))
    tl.store(thr_ptr + row, thr.to(tl.int32))


@triton.jit
def _decode_sample_partial_kernel(logits_ptr, stride_row, temp_ptr, seed_ptr, step_ptr, thr_ptr, part_val_ptr,
                                  part_idx_ptr, V, NB, EPS: tl.constexpr, BLOCK: tl.constexpr,
                                  HAS_THR: tl.constexpr):
    """Program (row, block): the best score of BLOCK vocabulary entries and its lowest index.
    Greedy rows (temperature < EPS) score the raw fp32 logit; the others logit / T + Gumbel noise
    (-log(-log u)), u a pure function of (the row's seed, the step counter, the token index);
    with HAS_THR, only entries whose key reaches the row's top-k / top-p threshold."""
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
        s = tl.math.div_rn(x, t)
        keep = mask
        if HAS_THR:
            keep = keep & (_key(s) >= tl.load(thr_ptr + row))
        x = tl.where(keep, s - tl.log(-tl.log(u)), float("-inf"))
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
