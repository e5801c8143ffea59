"""Triton code for paged attention (launcher and reference: ``kernels/paged_attention.py``).

One kernel body serves every batch kind vLLM sends (prefill chunks, decode, mixed, spec-verify):
a program owns BLOCK_Q query tokens of one sequence times the NUM_Q_PER_KV query heads that
share one KV head (GQA packing: BLOCK_M = BLOCK_Q * NUM_Q_PER_KV rows), and streams that
sequence's KV pages through an online softmax. With NUM_SPLITS > 1 (flash-decoding) the KV range
is cut in NUM_SPLITS parts whose partial results ``_combine_splits_kernel`` merges, or, with
FUSED_COMBINE, the split program of each query tile that finishes last (``_merge_splits``: no
second launch).

Instructions (read off the PTX, see tests/test_aot_compile.py): the two tl.dot become
``mma.sync.aligned.m16n8k16`` bf16/fp16 on sm_121a (wgmma on sm_90a for BLOCK_M >= 64); KV pages
are gathered with plain ``ld.global`` / ``cp.async`` (the page table makes rows non-contiguous,
so no TMA).
"""

import triton
import triton.language as tl

from .._sync import last_to_arrive
from ..fp4_kv_details._fp4_kv import nvfp4_store_slot
from ..moe_details._mx import pdl_wait_then_release
from .._prefetch import prefetch_l2

RCP_LN2 = tl.constexpr(1.4426950408889634)


# The bit-trick decode below yields e2m1 * 2**-14; the kernel folds the 2**14 back into the
# QK scale and the output (one multiply per score / output element, not per cache element).
E2M1_BIT_UNIT = tl.constexpr(16384.0)
# The e4m3-byte decode (NVFP4_WORDS) yields e2m1 * 2**-6.
E2M1_E4M3_UNIT = tl.constexpr(64.0)


@triton.jit
def _e2m1_times_scale_f16(codes, scale_f16):
    """e2m1 nibbles (low 4 bits of ``codes``) times fp16 block scales times 2**-14, in fp16.

    The nibble's 3 magnitude bits shifted to fp16 bits 11..9 are an fp16 whose value is the e2m1
    value times 2**-14 (e2m1's subnormal 0.5 lands on fp16's subnormal range, which the hardware
    keeps); the sign goes to bit 15. Products have <= 2 x 4 significant bits (exact unless they
    fall under fp16's subnormal step, 2**-24); the caller multiplies the 2**14
    (``E2M1_BIT_UNIT``) back in after the dot products. A handful of integer ops per element
    instead of a decode table or branches.
    """
    c = codes.to(tl.int32)
    bits = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True) * scale_f16


@triton.jit
def _e2m1x2_hw_times_scale_f16(packed, scale_f16):
    """Both nibbles of each byte through the hardware ``cvt.rn.f16x2.e2m1x2`` (sm_100+/sm_12x
    family-specific targets only; ptxas rejects it for sm_90a), then times the fp16 block scales.
    Low nibble -> low half (element 2i), as the codec packs. Exact, as the bit-trick version."""
    lo, hi = tl.inline_asm_elementwise(
        asm="{ .reg .b8 t; .reg .b32 r; cvt.u8.u16 t, $2; cvt.rn.f16x2.e2m1x2 r, t; mov.b32 {$0, $1}, r; }",
        constraints="=h,=h,h", args=[packed.to(tl.uint16)], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    return lo * scale_f16, hi * scale_f16


@triton.jit
def _e2m1_words_times_scale_f16(packed, scale_f16):
    """``_e2m1_times_scale_f16`` of both nibbles (same values, units of 2**-14), as inline PTX on
    4 bytes per 32-bit register (sm_90+ and sm_12x alike; the interpreter cannot run it).

    In the word w = [b3 b2 b1 b0] the nibbles of b0 and b2 sit 16 bits apart, as do those of b1
    and b3, so each fp16 pair is built by two shifts and masks of w itself: low nibbles of
    (b0, b2) = (w << 9) & 0x0E000E00 | (w << 12) & 0x80008000 (magnitude -> fp16 bits 11..9, sign
    -> 15), high nibbles (w << 5, w << 8), low nibbles of (b1, b3) (w << 1, w << 4), high nibbles
    (w >> 3, w). Two ``prmt`` per output pair put the halves back in element order ((b0, b1),
    (b2, b3)) and ``mul.rn.f16x2`` applies the scales: ~2.9 instructions per value instead of the
    ~4.5 of the per-element version (sm_90a SASS)."""
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 w, a, b, l02, h02, l13, h13;
        mov.b32 w, $4;
        shl.b32 a, w, 9; shl.b32 b, w, 12; and.b32 a, a, 0x0E000E00; and.b32 b, b, 0x80008000; or.b32 l02, a, b;
        shl.b32 a, w, 5; shl.b32 b, w, 8; and.b32 a, a, 0x0E000E00; and.b32 b, b, 0x80008000; or.b32 h02, a, b;
        shl.b32 a, w, 1; shl.b32 b, w, 4; and.b32 a, a, 0x0E000E00; and.b32 b, b, 0x80008000; or.b32 l13, a, b;
        shr.b32 a, w, 3; and.b32 a, a, 0x0E000E00; and.b32 b, w, 0x80008000; or.b32 h13, a, b;
        prmt.b32 a, l02, l13, 0x5410; prmt.b32 b, l02, l13, 0x7632;
        mul.rn.f16x2 $0, a, $5; mul.rn.f16x2 $1, b, $6;
        prmt.b32 a, h02, h13, 0x5410; prmt.b32 b, h02, h13, 0x7632;
        mul.rn.f16x2 $2, a, $5; mul.rn.f16x2 $3, b, $6; }""",
        constraints="=r,=r,=r,=r,r,r,r", args=[packed, scale_f16], dtype=(tl.float16, tl.float16),
        is_pure=True, pack=4)


@triton.jit
def _interleave4(a, b, c, d):
    """[W, N] x 4 -> [4W, N] with row 4w + j from the j-th argument's row w."""
    x = tl.join(tl.join(a, b), tl.join(c, d))  # [W, N, i, k] = argument 2k + i
    x = tl.permute(x, (0, 3, 2, 1))  # [W, k, i, N]
    return tl.reshape(x, [4 * a.shape[0], a.shape[1]])


@triton.jit
def _e2m1_byte_e4m3_f16(words, j: tl.constexpr, scale_f16):
    """(low, high) nibble of byte j of ``words`` times ``scale_f16`` in units of 2**-6: the
    Triton form of ``_e2m1_word_e4m3_times_scale_f16``'s inline PTX (same values)."""
    c = (words >> (8 * j)) & 0xFF
    lo = (((c & 8) << 4) | ((c & 7) << 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    hi = ((c & 0x80) | ((c >> 2) & 0x1C)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return lo * scale_f16, hi * scale_f16


@triton.jit
def _e2m1_word_e4m3_times_scale_f16(words, scale_f16, NVFP4_ASM: tl.constexpr):
    """Low and high nibbles of 32-bit words of packed e2m1 (``words`` [W, N] int32, 8 values
    each, element 2i in the low nibble of byte i) times fp16 block scales ([W, N]), in fp16
    units of 2**-6 (``E2M1_E4M3_UNIT``): returns (low nibbles [4W, N], high nibbles [4W, N]),
    row 4w + j from byte j of word w.

    An e2m1 nibble s|m (sign, 3 magnitude bits) is the e4m3 byte s << 7 | m << 2 of the value
    times 2**-6 (e2m1's exponent bias 1 vs e4m3's 7; its subnormal 0.5 lands on e4m3's
    subnormal 2**-7). With NVFP4_ASM, inline PTX (sm_89+ and sm_12x; the interpreter cannot run
    it): masks and shifts of the whole word make the 4 e4m3 bytes of each nibble half,
    ``cvt.rn.f16x2.e4m3x2`` turns each byte pair into an fp16 pair and ``mul.rn.f16x2``
    scales it, ~2.1 instructions per value (sm_90a SASS) instead of the ~2.9 of
    ``_e2m1_words_times_scale_f16``. Exact: products have <= 2 x 4 significant bits and stay
    above fp16's subnormal step for any e4m3 scale. Without NVFP4_ASM the same values from
    Triton integer ops (the interpreter's path)."""
    if NVFP4_ASM:
        o = tl.inline_asm_elementwise(
            asm="""{ .reg .b32 w, a, b, lo, hi, s2; .reg .b16 l0, l1, h0, h1;
            mov.b32 w, $8;
            mov.b32 s2, {$9, $9};
            and.b32 b, w, 0x80808080; shr.b32 a, w, 2; and.b32 a, a, 0x1C1C1C1C; or.b32 hi, a, b;
            shl.b32 a, w, 4; and.b32 a, a, 0x80808080; shl.b32 b, w, 2; and.b32 b, b, 0x1C1C1C1C; or.b32 lo, a, b;
            mov.b32 {l0, l1}, lo; mov.b32 {h0, h1}, hi;
            cvt.rn.f16x2.e4m3x2 a, l0; mul.rn.f16x2 a, a, s2; mov.b32 {$0, $1}, a;
            cvt.rn.f16x2.e4m3x2 a, l1; mul.rn.f16x2 a, a, s2; mov.b32 {$2, $3}, a;
            cvt.rn.f16x2.e4m3x2 a, h0; mul.rn.f16x2 a, a, s2; mov.b32 {$4, $5}, a;
            cvt.rn.f16x2.e4m3x2 a, h1; mul.rn.f16x2 a, a, s2; mov.b32 {$6, $7}, a; }""",
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h", args=[words, scale_f16], dtype=(tl.float16,) * 8,
            is_pure=True, pack=1)
        return _interleave4(o[0], o[1], o[2], o[3]), _interleave4(o[4], o[5], o[6], o[7])
    l0, h0 = _e2m1_byte_e4m3_f16(words, 0, scale_f16)
    l1, h1 = _e2m1_byte_e4m3_f16(words, 1, scale_f16)
    l2, h2 = _e2m1_byte_e4m3_f16(words, 2, scale_f16)
    l3, h3 = _e2m1_byte_e4m3_f16(words, 3, scale_f16)
    return _interleave4(l0, l1, l2, l3), _interleave4(h0, h1, h2, h3)


@triton.jit
def _e2m1_pairs_times_scale_f16(packed, scale_f16, E2M1_HW: tl.constexpr, NVFP4_ASM: tl.constexpr):
    """(low nibbles, high nibbles) of packed e2m1 bytes times the fp16 block scales: the hardware
    conversion where E2M1_HW (sm_12x; true values), else the bit trick (units of 2**-14), per
    element or, with NVFP4_ASM, 4 bytes per inline-PTX block."""
    if E2M1_HW:
        return _e2m1x2_hw_times_scale_f16(packed, scale_f16)
    if NVFP4_ASM:
        return _e2m1_words_times_scale_f16(packed, scale_f16)
    return _e2m1_times_scale_f16(packed, scale_f16), _e2m1_times_scale_f16(packed >> 4, scale_f16)


@triton.jit
def _token_scale_words(bscale_ptr, kv_head, stride_h, page, stride_b, slot, n_ok, HEAD_SIZE: tl.constexpr):
    """[TILE_N] int32: each token's HEAD_SIZE // 16 = 4 e4m3 block scales (64-wide heads) as one load
    (4 bytes: a load Triton can pipeline, unlike the byte loads)."""
    return tl.load((bscale_ptr + kv_head * stride_h + page * stride_b + slot * (HEAD_SIZE // 16))
                   .to(tl.pointer_type(tl.int32)), mask=n_ok, other=0)


@triton.jit
def _scale_bytes(words, h2):
    """The e4m3 block scale (as uint8) of element pair ``h2`` of a 64-wide nvfp4 head row from its
    token's four scale bytes loaded as one int32 (little-endian: pair h2 uses byte h2 // 8)."""
    return ((words >> ((h2 // 8) * 8)) & 0xFF).to(tl.uint8)


@triton.jit
def _write_token_nvfp4(key_ptr, value_ptr, slot_ptr, row, kv_head, stride_kt, stride_kh, stride_vt, stride_vh,
                       k_data_ptr, k_scale_ptr, v_data_ptr, v_scale_ptr, stride_kd_b, stride_ks_b, stride_vd_b,
                       stride_vs_b, k_global_ptr, v_global_ptr, HEAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """KV_WRITE: token ``row``'s K and V of head ``kv_head`` quantized into its nvfp4 page slot (vLLM's
    ``slot_ptr[row]``; < 0 writes nothing), as ``kernels/fp4_kv.py``'s write kernel stores them."""
    offs_d = tl.arange(0, HEAD)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    k = tl.load(key_ptr + row * stride_kt + kv_head * stride_kh + offs_d).to(tl.float32)
    v = tl.load(value_ptr + row * stride_vt + kv_head * stride_vh + offs_d).to(tl.float32)
    nvfp4_store_slot(k[None, :], tl.load(k_global_ptr), slot, kv_head, k_data_ptr, k_scale_ptr, stride_kd_b,
                     stride_ks_b, 1, HEAD, BLOCK_SIZE)
    nvfp4_store_slot(v[None, :], tl.load(v_global_ptr), slot, kv_head, v_data_ptr, v_scale_ptr, stride_vd_b,
                     stride_vs_b, 1, HEAD, BLOCK_SIZE)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    """Index of the sequence whose query blocks contain program ``q_block_global``.

    Sequence i owns program ids starting at ``query_start_loc[i] // BLOCK_Q + i`` (an upper
    bound of the blocks before it, so no id is shared); binary search over that monotone list.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _locate(query_start_loc_ptr, seq_lens_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr,
            SEQ_CHUNK: tl.constexpr):
    """(sequence, its first query token, its query length, its total length) of program
    ``q_block_global``. SEQ_CHUNK > 0 (a power of two >= num_seqs): the three per-sequence lists are
    loaded whole, at once, and the sequence found by counting (one memory round trip, where the
    binary search makes log2(num_seqs) dependent ones and the two lookups after it two more);
    SEQ_CHUNK = 0: ``_find_seq``'s binary search (batches of more sequences)."""
    if SEQ_CHUNK > 0:
        offs = tl.arange(0, SEQ_CHUNK)
        ok = offs < num_seqs
        starts = tl.load(query_start_loc_ptr + offs, mask=ok, other=0)
        ends = tl.load(query_start_loc_ptr + offs + 1, mask=ok, other=0)
        lens = tl.load(seq_lens_ptr + offs, mask=ok, other=0)
        seq = tl.sum((ok & (starts // BLOCK_Q + offs <= q_block_global)).to(tl.int32)) - 1
        sel = offs == seq
        q_start = tl.sum(tl.where(sel, starts, 0))
        q_len = tl.sum(tl.where(sel, ends, 0)) - q_start
        seq_len = tl.sum(tl.where(sel, lens, 0))
    else:
        seq = _find_seq(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
    return seq, q_start, q_len, seq_len


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, HEAD_SIZE]                (NUM_SPLITS == 1)
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, HEAD_PAD] fp32 (NUM_SPLITS > 1)
    part_ml_ptr,  # [T, Hq, NUM_SPLITS, 2] fp32: running max (log2 domain), sum
    cnt_ptr,  # FUSED_COMBINE: [grid0 * Hkv] int32 arrival counters, zero before and after each launch
    q_ptr,  # [T, Hq, HEAD_SIZE]
    k_cache_ptr,  # [num_blocks, Hkv, BLOCK_SIZE, HEAD_SIZE] (KV_NVFP4: uint8 [.., HEAD_SIZE // 2] data)
    v_cache_ptr,  # [num_blocks, Hkv, BLOCK_SIZE, HEAD_SIZE] (KV_NVFP4: uint8 [.., HEAD_SIZE // 2] data)
    k_bscale_ptr,  # KV_NVFP4: uint8 e4m3 [num_blocks, Hkv, BLOCK_SIZE, HEAD_SIZE // 16] block scales
    v_bscale_ptr,  # KV_NVFP4: same for V
    block_table_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32: context + new tokens
    query_start_loc_ptr,  # [num_seqs + 1] int32
    sinks_ptr,  # [Hq] fp32 (USE_SINKS)
    k_scale_ptr,  # [1] fp32 (KV_FP8: per-tensor scale; KV_NVFP4: global scale)
    v_scale_ptr,  # [1] fp32 (KV_FP8: per-tensor scale; KV_NVFP4: global scale)
    sm_scale,  # fp32: softmax scale
    softcap,  # fp32 (USE_SOFTCAP)
    num_seqs,  # int32
    stride_q_t: tl.int64,
    stride_q_h: tl.int64,
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    stride_k_b: tl.int64,
    stride_k_h: tl.int64,
    stride_k_t: tl.int64,
    stride_v_b: tl.int64,
    stride_v_h: tl.int64,
    stride_v_t: tl.int64,
    stride_kb_b: tl.int64,  # KV_NVFP4 block-scale strides (page, head); token stride is HEAD_SIZE // 16
    stride_kb_h: tl.int64,
    stride_vb_b: tl.int64,
    stride_vb_h: tl.int64,
    stride_bt: tl.int64,
    pf_ptr,  # PF: uint8 bytes to prefetch into L2 for the next kernel (kernels/l2_prefetch.py)
    pf_bytes,  # PF: their count
    kw_key_ptr,  # KV_WRITE: [T, Hkv, HEAD_SIZE] the step's new keys (bf16 / fp16 / fp32)
    kw_value_ptr,  # KV_WRITE: [T, Hkv, HEAD_SIZE] the step's new values
    kw_slot_ptr,  # KV_WRITE: [T] int64 cache slots (< 0: not written), vLLM's slot mapping
    stride_kw_kt: tl.int64,
    stride_kw_kh: tl.int64,
    stride_kw_vt: tl.int64,
    stride_kw_vh: tl.int64,
    NUM_Q_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: none; else a query sees keys with q_pos - k_pos < W
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_NVFP4: tl.constexpr,  # e2m1 pages + e4m3 block scales, dequantized in registers
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # Triton's CPU interpreter mis-computes bf16 tl.dot: upcast there
    E2M1_HW: tl.constexpr,  # nvfp4: hardware e2m1x2 -> f16x2 conversion (sm_12x only; never on sm_90)
    NVFP4_VEC: tl.constexpr,  # nvfp4: contiguous page-row loads (K bytes transposed in registers, scales broadcast) instead of gathers
    NVFP4_ASM: tl.constexpr,  # nvfp4, bit-trick decode: 4 bytes per inline-PTX block (not for the interpreter)
    NVFP4_WORDS: tl.constexpr,  # nvfp4: 32-bit word loads, e4m3-byte decode (inline PTX with NVFP4_ASM), V as V^T
    NVFP4_SCALE_WORDS: tl.constexpr = False,  # nvfp4 gathers, HEAD_SIZE 64: each token's 4 block scales as one int32 load
    SEQ_CHUNK: tl.constexpr = 0,  # > 0: power of two >= num_seqs, the sequence lists loaded whole (_locate)
    FUSED_COMBINE: tl.constexpr = False,  # NUM_SPLITS > 1: the tile's last split merges (no combine launch)
    MIN_SPLIT_TILES: tl.constexpr = 1,  # NUM_SPLITS > 1: the fewest KV tiles a live split covers
    ONE_SPLIT_FINISH: tl.constexpr = True,  # FUSED_COMBINE: a tile's only live split finishes its rows
    PF: tl.constexpr = False,  # FUSED_COMBINE: L2 prefetch of pf_ptr's bytes by the splits that see no KV
    PF_LANES: tl.constexpr = 128,
    PF_LINE: tl.constexpr = 128,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent ($VLLM_SM121_PDL): wait first thing
    KV_WRITE: tl.constexpr = False,  # KV_NVFP4, one query token per sequence: the program that reads the last KV
    # tile writes its sequence's new token (this KV head's K and V) into the cache first (no write launch)
):
    if PDL:
        pdl_wait_then_release()
    tl.static_assert(not KV_WRITE or KV_NVFP4, "KV_WRITE writes nvfp4 pages")
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq, q_start, q_len, seq_len = _locate(query_start_loc_ptr, seq_lens_ptr, q_block_global, num_seqs, BLOCK_Q,
                                           SEQ_CHUNK)
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    ctx_len = seq_len - q_len

    # KV positions this block of queries can see (a query sees at least itself: >= 1 tile).
    first_q_pos = ctx_len + q_block * BLOCK_Q
    kv_end = tl.minimum(first_q_pos + BLOCK_Q, seq_len)
    if SLIDING_WINDOW > 0:
        kv_begin = tl.maximum(first_q_pos - SLIDING_WINDOW + 1, 0)
    else:
        kv_begin = 0
    tile_lo = kv_begin // TILE_N
    tile_hi = tl.cdiv(kv_end, TILE_N)
    last_tile = tile_hi  # (KV_WRITE: the program whose range ends there writes the new token)
    if NUM_SPLITS > 1:
        per_split = tl.maximum(tl.cdiv(tile_hi - tile_lo, NUM_SPLITS), MIN_SPLIT_TILES)
        live_splits = tl.cdiv(tile_hi - tile_lo, per_split)  # the others see no KV
        if FUSED_COMBINE:
            # The fused merge reads (and its counter waits for) the live splits only: a split that
            # sees no KV stops here, before its q loads (a graph captured with 64 splits runs a
            # short context's few, not 64 programs per KV head).
            if split >= live_splits:
                if PF:  # idle: the first query tile's idle splits prefetch the next GEMV's weight (once per launch)
                    if q_block_global == 0:
                        n_idle = (NUM_SPLITS - live_splits) * tl.num_programs(1)
                        prefetch_l2(pf_ptr, pf_bytes, (split - live_splits) * tl.num_programs(1) + kv_head, n_idle,
                                    PF_LANES, PF_LINE)
                return
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)
    if KV_WRITE:
        # One query token per sequence (the launcher checks max_query_len == 1): the new token at position
        # seq_len - 1 lies in the last tile, which exactly one live split reads. That program quantizes its
        # KV head's K and V of the token into the page slot vLLM mapped (the write kernel's arithmetic:
        # the same bytes), then a CTA barrier makes the stores visible to the program's own tile loads.
        if (tile_lo < tile_hi) & (tile_hi == last_tile):
            _write_token_nvfp4(kw_key_ptr, kw_value_ptr, kw_slot_ptr, q_start.to(tl.int64), kv_head, stride_kw_kt,
                               stride_kw_kh, stride_kw_vt, stride_kw_vh, k_cache_ptr, k_bscale_ptr, v_cache_ptr,
                               v_bscale_ptr, stride_k_b, stride_kb_b, stride_v_b, stride_vb_b, k_scale_ptr,
                               v_scale_ptr, HEAD_SIZE, BLOCK_SIZE)
        tl.debug_barrier()

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_tok = q_block * BLOCK_Q + offs_m // NUM_Q_PER_KV  # token index inside the sequence
    q_head = kv_head * NUM_Q_PER_KV + offs_m % NUM_Q_PER_KV
    row_ok = (offs_m < BLOCK_Q * NUM_Q_PER_KV) & (q_tok < q_len)
    d_ok = offs_d < HEAD_SIZE
    q_pos = ctx_len + q_tok  # absolute position of each row's query

    q_rows = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_t + q_head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    offs_h2 = tl.arange(0, HEAD_PAD // 2)
    if KV_NVFP4:
        # Element 2i of a head sits in the low nibble of byte i: split q (and later the output)
        # into even/odd columns so each nibble half of a page multiplies its own half of q.
        q_even = tl.load(q_ptr + q_rows[:, None] * stride_q_t + q_head[:, None] * stride_q_h + 2 * offs_h2[None, :],
                         mask=row_ok[:, None], other=0.0)
        q_odd = tl.load(q_ptr + q_rows[:, None] * stride_q_t + q_head[:, None] * stride_q_h + 2 * offs_h2[None, :] + 1,
                        mask=row_ok[:, None], other=0.0)
        if DOT_FP32:
            q_even = q_even.to(tl.float32)
            q_odd = q_odd.to(tl.float32)
        else:
            # fp16 MMA operands: the dequantized cache is fp16, so q (and p) go to fp16 rather than
            # every cache element to bf16. bf16 -> fp16 is exact in fp16's normal range; |q| is
            # clamped to fp16's largest finite value (a score that large saturates the softmax).
            q_even = tl.minimum(tl.maximum(q_even.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
            q_odd = tl.minimum(tl.maximum(q_odd.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    acc_even = tl.zeros([BLOCK_M, HEAD_PAD // 2], dtype=tl.float32)
    acc_odd = tl.zeros([BLOCK_M, HEAD_PAD // 2], dtype=tl.float32)

    qk_scale = sm_scale
    if KV_FP8 or KV_NVFP4:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    out_unit = 1.0  # what the accumulated P @ V still needs besides 1 / l and the V scale
    if KV_NVFP4 and NVFP4_WORDS:
        qk_scale = qk_scale * E2M1_E4M3_UNIT
        out_unit = E2M1_E4M3_UNIT
    elif KV_NVFP4 and not E2M1_HW:
        qk_scale = qk_scale * E2M1_BIT_UNIT
        out_unit = E2M1_BIT_UNIT
    if not USE_SOFTCAP:
        qk_scale = qk_scale * RCP_LN2  # work in the log2 domain directly

    if USE_SINKS and NUM_SPLITS == 1:
        # The sink is one more logit per head in the softmax denominator.
        m_i = tl.load(sinks_ptr + q_head, mask=row_ok, other=float("-inf")).to(tl.float32) * RCP_LN2
        l_i = tl.where(row_ok, 1.0, 0.0).to(tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    k_base = k_cache_ptr + kv_head * stride_k_h
    v_base = v_cache_ptr + kv_head * stride_v_h
    bt_base = block_table_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        # Outside [kv_begin, kv_end) a page may be vLLM's null block 0 or unallocated: mask the
        # loads too, not only the scores (garbage fp8 bytes can be NaN, and 0 * NaN = NaN).
        n_ok = (offs_n >= kv_begin) & (offs_n < kv_end)
        page = tl.load(bt_base + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        if KV_NVFP4 and NVFP4_WORDS:
            # K^T and V^T as [word, token]: 4 packed bytes (8 values) per int32 (page rows are
            # HEAD_SIZE / 2 bytes; the launcher checks 4-byte alignment), block scale w // 2
            # (Triton loads it once per token and block: the addresses repeat).
            offs_w = tl.arange(0, HEAD_PAD // 8)
            kw = tl.load((k_base + page[None, :] * stride_k_b + slot[None, :] * stride_k_t).to(tl.pointer_type(tl.int32))
                         + offs_w[:, None], mask=n_ok[None, :], other=0)
            ks = tl.load(k_bscale_ptr + kv_head * stride_kb_h + page[None, :] * stride_kb_b
                         + slot[None, :] * (HEAD_SIZE // 16) + offs_w[:, None] // 2, mask=n_ok[None, :], other=0)
            k_lo, k_hi = _e2m1_word_e4m3_times_scale_f16(kw, ks.to(tl.float8e4nv, bitcast=True).to(tl.float16), NVFP4_ASM)
            vw = tl.load((v_base + page[None, :] * stride_v_b + slot[None, :] * stride_v_t).to(tl.pointer_type(tl.int32))
                         + offs_w[:, None], mask=n_ok[None, :], other=0)
            vs = tl.load(v_bscale_ptr + kv_head * stride_vb_h + page[None, :] * stride_vb_b
                         + slot[None, :] * (HEAD_SIZE // 16) + offs_w[:, None] // 2, mask=n_ok[None, :], other=0)
            vt_lo, vt_hi = _e2m1_word_e4m3_times_scale_f16(vw, vs.to(tl.float8e4nv, bitcast=True).to(tl.float16), NVFP4_ASM)
            # V^T decoded, then transposed: decoding V as [token, word] makes Triton store the
            # decoded values to shared memory 2 bytes at a time (sm_90a SASS: 64 STS.U16).
            v_lo = tl.trans(vt_lo)
            v_hi = tl.trans(vt_hi)
            if DOT_FP32:
                k_lo, k_hi, v_lo, v_hi = k_lo.to(tl.float32), k_hi.to(tl.float32), v_lo.to(tl.float32), v_hi.to(tl.float32)
            s = (tl.dot(q_even, k_lo) + tl.dot(q_odd, k_hi)) * qk_scale
        elif KV_NVFP4:
            # K^T halves [D/2, TILE_N] and V halves [TILE_N, D/2] straight from the packed bytes;
            # the e4m3 scale of element pair i is scale (2i) // 16 = i // 8 of its token.
            if NVFP4_VEC:
                offs_s16 = tl.arange(0, HEAD_PAD // 16)
                kq = tl.trans(tl.load(k_base + page[:, None] * stride_k_b + slot[:, None] * stride_k_t
                                      + offs_h2[None, :], mask=n_ok[:, None], other=0))
                ks = tl.trans(tl.load(k_bscale_ptr + kv_head * stride_kb_h + page[:, None] * stride_kb_b
                                      + slot[:, None] * (HEAD_SIZE // 16) + offs_s16[None, :], mask=n_ok[:, None],
                                      other=0))
                ksf = tl.reshape(tl.broadcast_to(ks.to(tl.float8e4nv, bitcast=True).to(tl.float16)[:, None, :],
                                                 [HEAD_PAD // 16, 8, TILE_N]), [HEAD_PAD // 2, TILE_N])
            else:
                kq = tl.load(k_base + page[None, :] * stride_k_b + slot[None, :] * stride_k_t + offs_h2[:, None],
                             mask=n_ok[None, :], other=0)
                if NVFP4_SCALE_WORDS:  # one int32 per token, bytes picked in registers
                    ksw = _token_scale_words(k_bscale_ptr, kv_head, stride_kb_h, page, stride_kb_b, slot, n_ok,
                                             HEAD_SIZE)
                    ks = _scale_bytes(ksw[None, :], offs_h2[:, None])
                else:
                    ks = tl.load(k_bscale_ptr + kv_head * stride_kb_h + page[None, :] * stride_kb_b
                                 + slot[None, :] * (HEAD_SIZE // 16) + offs_h2[:, None] // 8, mask=n_ok[None, :],
                                 other=0)
                ksf = ks.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            k_lo, k_hi = _e2m1_pairs_times_scale_f16(kq, ksf, E2M1_HW, NVFP4_ASM)
            vq = tl.load(v_base + page[:, None] * stride_v_b + slot[:, None] * stride_v_t + offs_h2[None, :],
                         mask=n_ok[:, None], other=0)
            if NVFP4_VEC:
                vs = tl.load(v_bscale_ptr + kv_head * stride_vb_h + page[:, None] * stride_vb_b
                             + slot[:, None] * (HEAD_SIZE // 16) + offs_s16[None, :], mask=n_ok[:, None], other=0)
                vsf = tl.reshape(tl.broadcast_to(vs.to(tl.float8e4nv, bitcast=True).to(tl.float16)[:, :, None],
                                                 [TILE_N, HEAD_PAD // 16, 8]), [TILE_N, HEAD_PAD // 2])
            elif NVFP4_SCALE_WORDS:
                vsw = _token_scale_words(v_bscale_ptr, kv_head, stride_vb_h, page, stride_vb_b, slot, n_ok, HEAD_SIZE)
                vsf = _scale_bytes(vsw[:, None], offs_h2[None, :]).to(tl.float8e4nv, bitcast=True).to(tl.float16)
            else:
                vs = tl.load(v_bscale_ptr + kv_head * stride_vb_h + page[:, None] * stride_vb_b
                             + slot[:, None] * (HEAD_SIZE // 16) + offs_h2[None, :] // 8, mask=n_ok[:, None], other=0)
                vsf = vs.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            v_lo, v_hi = _e2m1_pairs_times_scale_f16(vq, vsf, E2M1_HW, NVFP4_ASM)
            if DOT_FP32:
                k_lo, k_hi, v_lo, v_hi = k_lo.to(tl.float32), k_hi.to(tl.float32), v_lo.to(tl.float32), v_hi.to(tl.float32)
            s = (tl.dot(q_even, k_lo) + tl.dot(q_odd, k_hi)) * qk_scale
        else:
            k = tl.load(
                k_base + page[None, :] * stride_k_b + slot[None, :] * stride_k_t + offs_d[:, None],
                mask=n_ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            v = tl.load(
                v_base + page[:, None] * stride_v_b + slot[:, None] * stride_v_t + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            elif KV_FP8:
                # e4m3 values are exact in bf16/fp16; the per-tensor scales are applied outside.
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            s = tl.dot(q, k) * qk_scale
        if USE_SOFTCAP:
            # softcap * tanh(s / softcap), with tanh(x) = 1 - 2 / (exp(2x) + 1)
            e = tl.exp(2.0 * s / softcap)
            s = (softcap * (1.0 - 2.0 / (e + 1.0))) * RCP_LN2
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & ((q_pos[:, None] - offs_n[None, :]) < SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_NVFP4:
            acc_even = acc_even * alpha[:, None] + tl.dot(p.to(v_lo.dtype), v_lo)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p.to(v_hi.dtype), v_hi)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if KV_NVFP4:
        acc = tl.reshape(tl.join(acc_even, acc_odd), [BLOCK_M, HEAD_PAD]) * out_unit  # columns 2i, 2i + 1

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        if KV_FP8 or KV_NVFP4:
            o = o * tl.load(v_scale_ptr)
        tl.store(
            out_ptr + q_rows[:, None] * stride_o_t + q_head[:, None] * stride_o_h + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    elif FUSED_COMBINE and ONE_SPLIT_FINISH and live_splits == 1:
        # The only split that sees KV (a short context under a graph captured with many splits):
        # it finishes the rows itself, with _merge_splits' arithmetic on its own statistics (the
        # same fp32 operations, so the same bits), and skips the partials' round trip through
        # memory, the arrival counter (which stays 0) and the merge.
        _finish_rows(out_ptr, acc, m_i, l_i, sinks_ptr, v_scale_ptr, q_rows, q_head, row_ok, d_ok, stride_o_t,
                     stride_o_h, HEAD_PAD, USE_SINKS, KV_FP8 or KV_NVFP4)
    else:
        # part_* are contiguous: [T, Hq, NUM_SPLITS, HEAD_PAD] and [T, Hq, NUM_SPLITS, 2]
        row_split = (q_rows * tl.num_programs(1) * NUM_Q_PER_KV + q_head) * NUM_SPLITS + split
        tl.store(
            part_acc_ptr + row_split[:, None] * HEAD_PAD + offs_d[None, :],
            acc,
            mask=row_ok[:, None],
        )
        tl.store(part_ml_ptr + row_split * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row_split * 2 + 1, l_i, mask=row_ok)
        if FUSED_COMBINE:
            if last_to_arrive(cnt_ptr, q_block_global * tl.num_programs(1) + kv_head, live_splits):
                _merge_splits(out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, v_scale_ptr, row_split - split,
                              q_rows, q_head, row_ok, d_ok, live_splits, stride_o_t, stride_o_h, BLOCK_M, HEAD_PAD,
                              NUM_SPLITS, USE_SINKS, KV_FP8 or KV_NVFP4)


@triton.jit
def _merge_scale(m, l, sink, AXIS: tl.constexpr, USE_SINKS: tl.constexpr):
    """The split-KV merge's statistics along AXIS of the splits' running maxima ``m`` (log2 units)
    and sums ``l``: the common maximum (0 where every split and the sink are empty, so no
    -inf - -inf) and the softmax denominator with the sink's share (1 where it would be 0: an empty
    row stays 0). Shared by ``_merge_splits`` (query-tile rows, AXIS 1) and
    ``_combine_splits_kernel`` (one row, AXIS 0)."""
    m_max = tl.max(m, axis=AXIS)
    if USE_SINKS:
        m_max = tl.maximum(m_max, sink)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.sum(l * tl.exp2(m - tl.expand_dims(m_use, AXIS)), axis=AXIS)
    if USE_SINKS:
        denom += tl.exp2(sink - m_use)
    return m_use, tl.where(denom == 0.0, 1.0, denom)


@triton.jit
def _sink_log2(sinks_ptr, q_head, row_ok, USE_SINKS: tl.constexpr):
    """The rows' sink logits in log2 units (-inf for rows past the tile; 0.0, unused, without sinks)."""
    sink = 0.0
    if USE_SINKS:
        sink = tl.load(sinks_ptr + q_head, mask=row_ok, other=float("-inf")).to(tl.float32) * RCP_LN2
    return sink


@triton.jit
def _store_rows(out_ptr, o, denom, v_scale_ptr, q_rows, q_head, row_ok, d_ok, stride_o_t, stride_o_h,
                HEAD_PAD: tl.constexpr, SCALED: tl.constexpr):
    """The merged rows ``o`` [BLOCK_M, HEAD_PAD] / ``denom`` (times the V scale) into ``out``."""
    o = o / denom[:, None]
    if SCALED:
        o = o * tl.load(v_scale_ptr)
    offs_d = tl.arange(0, HEAD_PAD)
    tl.store(out_ptr + q_rows[:, None] * stride_o_t + q_head[:, None] * stride_o_h + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _finish_rows(out_ptr, acc, m, l, sinks_ptr, v_scale_ptr, q_rows, q_head, row_ok, d_ok, stride_o_t, stride_o_h,
                 HEAD_PAD: tl.constexpr, USE_SINKS: tl.constexpr, SCALED: tl.constexpr):
    """``_merge_splits`` for a tile whose only live split is this program: its accumulator ``acc``
    [BLOCK_M, HEAD_PAD] and statistics ``m`` / ``l`` [BLOCK_M] (log2 units, no sink yet) straight
    from registers, merged with the sink and stored exactly as the merge would store them."""
    sink = _sink_log2(sinks_ptr, q_head, row_ok, USE_SINKS)
    m_use, denom = _merge_scale(m[:, None], l[:, None], sink, 1, USE_SINKS)
    o = tl.zeros_like(acc)  # (as the merge: from +0, so a -0 product sums to the merge's +0)
    o += acc * tl.exp2(m - m_use)[:, None]
    _store_rows(out_ptr, o, denom, v_scale_ptr, q_rows, q_head, row_ok, d_ok, stride_o_t, stride_o_h, HEAD_PAD,
                SCALED)


@triton.jit
def _merge_splits(out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, v_scale_ptr, row0, q_rows, q_head, row_ok, d_ok,
                  live_splits, stride_o_t, stride_o_h, BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, USE_SINKS: tl.constexpr, SCALED: tl.constexpr):
    """``_combine_splits_kernel``'s merge for the BLOCK_M rows of one query tile, run by the tile's
    split program that finished last (``row0``: each row's split-0 partial). Splits past
    ``live_splits`` saw no KV (m = -inf, l = 0, acc = 0): their partials are not read, so a short
    context costs a short merge whatever NUM_SPLITS the launch (or a captured graph) fixed."""
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    live = row_ok[:, None] & (offs_s[None, :] < live_splits)
    ml = (row0[:, None] + offs_s[None, :]) * 2
    m = tl.load(part_ml_ptr + ml, mask=live, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_ml_ptr + ml + 1, mask=live, other=0.0, cache_modifier=".cg")
    sink = _sink_log2(sinks_ptr, q_head, row_ok, USE_SINKS)
    m_use, denom = _merge_scale(m, l, sink, 1, USE_SINKS)
    o = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        live_s = row_ok & (s < live_splits)
        m_s = tl.load(part_ml_ptr + (row0 + s) * 2, mask=live_s, other=float("-inf"), cache_modifier=".cg")
        acc_s = tl.load(part_acc_ptr + (row0 + s)[:, None] * HEAD_PAD + offs_d[None, :], mask=live_s[:, None],
                        other=0.0, cache_modifier=".cg")
        o += acc_s * tl.exp2(m_s - m_use)[:, None]
    _store_rows(out_ptr, o, denom, v_scale_ptr, q_rows, q_head, row_ok, d_ok, stride_o_t, stride_o_h, HEAD_PAD,
                SCALED)


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [T, Hq, HEAD_SIZE]
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, HEAD_PAD] fp32
    part_ml_ptr,  # [T, Hq, NUM_SPLITS, 2] fp32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    sinks_ptr,  # [Hq] fp32 (USE_SINKS)
    v_scale_ptr,  # [1] fp32 (KV_FP8)
    num_seqs,
    num_q_heads,
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:
        pdl_wait_then_release()
    tok = tl.program_id(0)
    head = tl.program_id(1)
    row = tok.to(tl.int64) * num_q_heads + head
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    # Every load is issued at once, the token count too: rows past the last real token (CUDA-graph
    # padding) hold no partials, so their store is masked instead of returning early (the compiler
    # would sink the partials' loads below that branch: two memory round trips instead of one). The
    # workspace has a row for every token of the grid, padded ones included.
    real = tok < tl.load(query_start_loc_ptr + num_seqs)
    m = tl.load(part_ml_ptr + (row * NUM_SPLITS + offs_s) * 2)
    l = tl.load(part_ml_ptr + (row * NUM_SPLITS + offs_s) * 2 + 1)
    acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_PAD + offs_d[None, :])
    sink = 0.0
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * RCP_LN2
    if KV_FP8:
        v_scale = tl.load(v_scale_ptr)
    m_use, denom = _merge_scale(m, l, sink, 0, USE_SINKS)
    o = tl.sum(acc * tl.exp2(m - m_use)[:, None], axis=0) / denom
    if KV_FP8:
        o = o * v_scale
    tl.store(
        out_ptr + tok.to(tl.int64) * stride_o_t + head * stride_o_h + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=(offs_d < HEAD_SIZE) & real,
    )
