"""Triton kernels of ``kernels/decode_sample.py``: the top-k / top-p threshold passes (grid (rows,
chunks), per-chunk partials reduced by the next launch), per-block scores and argmax, then the
per-row reduction.

Keys. A *raw key* is an int32 in the order of the logits' values: the order-preserving transform of
the value's bits, 32-bit for fp32 logits, 16-bit for bf16 / fp16 ones (``KB``), -0.0 folded into
+0.0. The filter is searched over raw keys, a radix search from the top digit (4 bits per pass,
``KB // 4`` passes per search); division by the temperature is monotone (IEEE ``div_rn``), so the
k-th largest raw value scaled is the k-th largest scaled value, and a threshold found on raw keys
is turned into one on the scaled logits' 32-bit keys (``_key``) at the end: the sampling kernel
keeps ``_key(logit / T) >= thr``.

Workspace, per row (``decode_sample.workspace``): ``cmax`` [NB] the chunks' largest raw keys;
``cnt`` [2, NB, FAN] int32 and ``mass`` [2, NB, FAN] fp32 per-chunk digit counts / masses of a
pass (two slots: a pass reads the previous pass's slot and writes the other); ``state`` [2, NSTATE]
int32 the search state entering a pass (written by the chunk-0 program, read by the next launch):
0 prefix (the digits chosen so far), 1 count above the prefix's range (top-k), 2 the top-k
threshold (scaled key), 3 the largest raw key, 4 mass below the range (fp32 bits), 5 the top-p
cut (fp32 bits)."""

import triton
import triton.language as tl

INT32_MIN: tl.constexpr = tl.constexpr(-2147483648)


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
def _raw_keys(base, off, V, SUB: tl.constexpr, KB: tl.constexpr):
    """SUB logits from ``off``: fp32 values, raw keys (int32; 32-bit for fp32 logits, 16-bit for
    bf16 / fp16, -0.0 folded into +0.0) and the mask."""
    offs = off + tl.arange(0, SUB)
    m = offs < V
    raw = tl.load(base + offs, mask=m, other=0.0)
    x = raw.to(tl.float32)
    if KB == 32:
        key = _key(x)
    else:
        b = raw.to(tl.int16, bitcast=True).to(tl.int32)
        b = tl.where(b == -32768, 0, b)
        key = b ^ ((b >> 15) & 0x7FFF)
    return x, key, m


@triton.jit
def _key_value(key, DT: tl.constexpr, KB: tl.constexpr):
    """The fp32 value of a raw key (the logits' dtype ``DT``, exact)."""
    if KB == 32:
        v = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    else:
        v = (key ^ ((key >> 15) & 0x7FFF)).to(tl.int16).to(DT, bitcast=True).to(tl.float32)
    return v


@triton.jit
def _digit(key, shift, KB: tl.constexpr):
    """(the bits above the digit, the 4-bit digit at ``shift``) of the raw key read unsigned."""
    if KB == 32:
        u = (key ^ INT32_MIN).to(tl.uint32, bitcast=True) >> shift.to(tl.uint32)
        hi = (u >> 4).to(tl.int32)
        d = (u & 15).to(tl.int32)
    else:
        u = (key + 32768) >> shift
        hi = u >> 4
        d = u & 15
    return hi, d


@triton.jit
def _prefix_key(prefix, d, KB: tl.constexpr):
    """The raw key whose unsigned digits are ``prefix`` (KB - 4 bits) then ``d``."""
    if KB == 32:
        u = prefix.to(tl.uint32) * 16 + d.to(tl.uint32)
        key = (u ^ 0x80000000).to(tl.int32, bitcast=True)
    else:
        key = prefix * 16 + d - 32768
    return key


@triton.jit
def _chunk_sums(part_ptr, NB, NB_P2: tl.constexpr, FAN: tl.constexpr):
    """[FAN]: the per-chunk partials ``part_ptr[0:NB, 0:FAN]`` summed over the chunks (a fixed
    reduction tree: the same sums on every program and every run)."""
    c = tl.arange(0, NB_P2)
    j = tl.arange(0, FAN)
    v = tl.load(part_ptr + c[:, None] * FAN + j[None, :], mask=(c < NB)[:, None], other=0)
    return tl.sum(v, axis=0)


@triton.jit
def _topk_digit(cnt_ptr, k, above, NB, NB_P2: tl.constexpr, FAN: tl.constexpr):
    """The digit holding the k-th largest key (the largest digit d with above + count(digits >= d)
    >= k; the search keeps above < k <= above + count(range)) and the count above it."""
    c = _chunk_sums(cnt_ptr, NB, NB_P2, FAN)
    jj = tl.arange(0, FAN)
    ge = tl.sum(c, axis=0) - tl.cumsum(c, axis=0) + c  # count in digits >= j
    d = tl.max(tl.where(above + ge >= k, jj, 0), axis=0)
    return d, above + tl.sum(tl.where(jj > d, c, 0), axis=0)


@triton.jit
def _topp_digit(mass_ptr, below, cut, FIRST: tl.constexpr, one_minus_p, NB, NB_P2: tl.constexpr,
                FAN: tl.constexpr):
    """(digit, mass below it, cut): the first digit d with below + mass(digits <= d) > cut (the
    last one when rounding leaves none: the answer is then at or above the range's end). FIRST:
    the pass over the whole key range, whose masses sum to the total: cut = (1 - p) * total."""
    m = _chunk_sums(mass_ptr, NB, NB_P2, FAN)
    cs = tl.cumsum(m, axis=0)
    jj = tl.arange(0, FAN)
    if FIRST:
        cut = one_minus_p * tl.sum(tl.where(jj == FAN - 1, cs, 0.0), axis=0)
    d = tl.min(tl.where(below + cs > cut, jj, FAN - 1), axis=0)
    return d, below + tl.sum(tl.where(jj == d - 1, cs, 0.0), axis=0), cut


@triton.jit
def _row_options(temp_ptr, topk_ptr, topp_ptr, row, V, EPS: tl.constexpr):
    t = tl.load(temp_ptr + row)
    k = tl.load(topk_ptr + row)
    p = tl.load(topp_ptr + row)
    k_on = (t >= EPS) & (k > 0) & (k < V)
    p_on = (t >= EPS) & (p < 1.0)
    return t, k, p, k_on, p_on


@triton.jit
def _decode_sample_topk_pass_kernel(logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, cmax_ptr, cnt_ptr,
                                    state_ptr, V, NB, g, EPS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
                                    KB: tl.constexpr, FAN: tl.constexpr, NB_P2: tl.constexpr,
                                    NSTATE: tl.constexpr):
    """Program (row, chunk), pass g of KB // 4: top-k's radix search, one 4-bit digit per pass.
    The prologue reduces pass g - 1's per-chunk digit counts (every program the same way) to the
    digit holding the row's k-th largest raw key; the chunk then counts its entries per next digit
    among those with that prefix (``tl.histogram``). Pass 0 also records the chunk's largest raw
    key (top-p's softmax offset). Rows without top-k (or greedy rows) do nothing past pass 0."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    t, k, p, k_on, p_on = _row_options(temp_ptr, topk_ptr, topp_ptr, row, V, EPS)
    if k_on | ((g == 0) & p_on):
        prev = (g + 1) % 2
        cur = g % 2
        prefix = tl.full([], 0, tl.int32)
        above = tl.full([], 0, tl.int32)
        if (g > 0) & k_on:
            sp = state_ptr + (row * 2 + prev) * NSTATE
            d, above = _topk_digit(cnt_ptr + (row * 2 + prev).to(tl.int64) * NB * FAN, k, tl.load(sp + 1),
                                   NB, NB_P2, FAN)
            prefix = tl.load(sp) * 16 + d
        if blk == 0:
            sp = state_ptr + (row * 2 + cur) * NSTATE
            tl.store(sp, prefix)
            tl.store(sp + 1, above)
        base = logits_ptr + row.to(tl.int64) * stride_row
        shift = KB - 4 * (g + 1)
        hist = tl.zeros([FAN], tl.int32)
        mx = tl.full([SUB], INT32_MIN, tl.int32)
        for off in range(blk * BLOCK, blk * BLOCK + BLOCK, SUB):
            x, key, m = _raw_keys(base, off, V, SUB, KB)
            hi, dig = _digit(key, shift, KB)
            hist += tl.histogram(dig, FAN, mask=m & (hi == prefix))  # rows without top-k: unread
            mx = tl.maximum(mx, tl.where(m, key, INT32_MIN))
        tl.store(cnt_ptr + ((row * 2 + cur).to(tl.int64) * NB + blk) * FAN + tl.arange(0, FAN), hist)
        if g == 0:
            tl.store(cmax_ptr + row * NB + blk, tl.max(mx, axis=0))


@triton.jit
def _decode_sample_topp_pass_kernel(logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, cmax_ptr, cnt_ptr, mass_ptr,
                                    state_ptr, V, NB, j, EPS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
                                    KB: tl.constexpr, FAN: tl.constexpr, NB_P2: tl.constexpr,
                                    NSTATE: tl.constexpr):
    """Program (row, chunk), pass j of KB // 4: top-p's radix search over the top-k survivors.
    Pass 0's prologue finishes top-k (the last count pass's digit: the k-th largest raw key, as a
    scaled-key threshold; none without top-k) and takes the row's largest raw key (``cmax``); later
    prologues reduce pass j - 1's per-chunk digit masses (pass 1 also fixes cut = (1 - p) * the
    total mass) to the digit where the mass at or below reaches past the cut. The chunk then sums
    exp(logit / T - max) per next digit over the survivors with that prefix (one-hot sums in a
    [FAN, SUB] register tile), skipping sub-blocks with no such entry. Rows without top-p carry
    the state only."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    NP: tl.constexpr = KB // 4
    DT: tl.constexpr = logits_ptr.dtype.element_ty
    t, k, p, k_on, p_on = _row_options(temp_ptr, topk_ptr, topp_ptr, row, V, EPS)
    if k_on | p_on:
        prev = (NP + j + 1) % 2
        cur = (NP + j) % 2
        sp = state_ptr + (row * 2 + prev) * NSTATE
        if j == 0:
            thr_k = tl.full([], INT32_MIN, tl.int32)
            if k_on:
                d, _ = _topk_digit(cnt_ptr + (row * 2 + prev).to(tl.int64) * NB * FAN, k, tl.load(sp + 1),
                                   NB, NB_P2, FAN)
                kth = _prefix_key(tl.load(sp), d, KB)
                thr_k = _key(tl.math.div_rn(_key_value(kth, DT, KB), t))
            cb = tl.arange(0, NB_P2)
            maxkey = tl.max(tl.load(cmax_ptr + row * NB + cb, mask=cb < NB, other=INT32_MIN), axis=0)
            prefix = tl.full([], 0, tl.int32)
            below = tl.full([], 0.0, tl.float32)
            cut = tl.full([], 0.0, tl.float32)
        else:
            prefix = tl.load(sp)
            thr_k = tl.load(sp + 2)
            maxkey = tl.load(sp + 3)
            below = tl.load(sp + 4).to(tl.float32, bitcast=True)
            cut = tl.load(sp + 5).to(tl.float32, bitcast=True)
            if p_on:
                mp = mass_ptr + (row * 2 + prev).to(tl.int64) * NB * FAN
                if j == 1:
                    d, below, cut = _topp_digit(mp, below, cut, True, 1.0 - p, NB, NB_P2, FAN)
                else:
                    d, below, cut = _topp_digit(mp, below, cut, False, 1.0 - p, NB, NB_P2, FAN)
                prefix = prefix * 16 + d
        if blk == 0:
            sc = state_ptr + (row * 2 + cur) * NSTATE
            tl.store(sc, prefix)
            tl.store(sc + 2, thr_k)
            tl.store(sc + 3, maxkey)
            tl.store(sc + 4, below.to(tl.int32, bitcast=True))
            tl.store(sc + 5, cut.to(tl.int32, bitcast=True))
        if p_on:
            base = logits_ptr + row.to(tl.int64) * stride_row
            top = tl.math.div_rn(_key_value(maxkey, DT, KB), t)
            shift = KB - 4 * (j + 1)
            jj = tl.arange(0, FAN)
            # [FAN, SUB]: the entries along the threads (no replicated exp), digits in registers
            acc = tl.zeros([FAN, SUB], tl.float32)
            for off in range(blk * BLOCK, blk * BLOCK + BLOCK, SUB):
                x, key, m = _raw_keys(base, off, V, SUB, KB)
                hi, dig = _digit(key, shift, KB)
                live = m & (hi == prefix)
                # the largest live entry, scaled, bounds every live one (division is monotone); none
                # live: INT32_MIN (as a 32-bit key, a NaN's: NaN logits are not handled specially)
                bmax = tl.max(tl.where(live, key, INT32_MIN), axis=0)
                if (bmax > INT32_MIN) & (_key(tl.math.div_rn(_key_value(bmax, DT, KB), t)) >= thr_k):
                    s = tl.math.div_rn(x, t)
                    e = tl.where(live & (_key(s) >= thr_k), tl.exp(s - top), 0.0)
                    acc = tl.where(jj[:, None] == dig[None, :], acc + e[None, :], acc)
            tl.store(mass_ptr + ((row * 2 + cur).to(tl.int64) * NB + blk) * FAN + jj, tl.sum(acc, axis=1))


@triton.jit
def _final_threshold(row, t, p_on, any_on, state_ptr, mass_ptr, NB, DT: tl.constexpr, KB: tl.constexpr,
                     FAN: tl.constexpr, NB_P2: tl.constexpr, NSTATE: tl.constexpr):
    """The row's scaled-key threshold after the last top-p pass (the state and masses it left):
    top-p's digit completes the smallest raw key whose mass at or below exceeds the cut, at most
    the largest key (vLLM keeps the largest value: also when (1 - p) * mass rounds up to the whole
    mass, p below ~1e-7), scaled; top-k's threshold alone without top-p; the smallest key (keep
    everything) on rows with neither or greedy rows."""
    slot = (2 * (KB // 4) - 1) % 2
    thr = tl.full([], INT32_MIN, tl.int32)
    if any_on:
        sp = state_ptr + (row * 2 + slot) * NSTATE
        thr = tl.load(sp + 2)
        if p_on:
            d, _, _ = _topp_digit(mass_ptr + (row * 2 + slot).to(tl.int64) * NB * FAN, tl.load(sp + 4).to(
                tl.float32, bitcast=True), tl.load(sp + 5).to(tl.float32, bitcast=True), False, 0.0, NB, NB_P2, FAN)
            key = tl.minimum(_prefix_key(tl.load(sp), d, KB), tl.load(sp + 3))
            thr = tl.maximum(_key(tl.math.div_rn(_key_value(key, DT, KB), t)), thr)
    return thr


@triton.jit
def _decode_sample_partial_kernel(logits_ptr, stride_row, temp_ptr, seed_ptr, step_ptr, topk_ptr, topp_ptr,
                                  state_ptr, mass_ptr, thr_ptr, part_val_ptr, part_idx_ptr, V, NB,
                                  EPS: tl.constexpr, BLOCK: tl.constexpr, HAS_THR: tl.constexpr, KB: tl.constexpr,
                                  FAN: tl.constexpr, NB_P2: tl.constexpr, NSTATE: tl.constexpr):
    """Program (row, block): the best score of BLOCK vocabulary entries and its lowest index.
    Greedy rows (temperature < EPS) score the raw fp32 logit; the others logit / T + Gumbel noise
    (-log(-log u)), u a pure function of (the row's seed, the step counter, the token index);
    with HAS_THR, only entries whose scaled key reaches the row's top-k / top-p threshold, which
    every program completes from the last threshold pass (``_final_threshold``; block 0 stores it
    in ``thr_ptr``)."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
    t = tl.load(temp_ptr + row)
    if HAS_THR:
        _, _, _, k_on, p_on = _row_options(temp_ptr, topk_ptr, topp_ptr, row, V, EPS)
        thr = _final_threshold(row, t, p_on, k_on | p_on, state_ptr, mass_ptr, NB, logits_ptr.dtype.element_ty,
                               KB, FAN, NB_P2, NSTATE)
        if blk == 0:
            tl.store(thr_ptr + row, thr)
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
            keep = keep & (_key(s) >= thr)
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
