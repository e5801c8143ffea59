"""Paged attention over ragged batches: launcher ``paged_attention`` and reference ``paged_attention_torch``.

Architecture
    One Triton kernel (``paged_attention_details/_paged_attention.py``) for prefill chunks,
    decode, mixed batches and spec-verify (query length 1+k): GQA-packed query tiles, causal
    masking at absolute positions, and per-call hyperparameters (scale, sliding window,
    logits soft-cap, attention sinks, fp8 KV scales), so layers that differ in any of them
    share one backend. A split-KV (flash-decoding) mode cuts each sequence's KV range in
    ``num_splits`` parts for long contexts at small batch, merged by a second kernel or, by default
    where the workspace has arrival counters, by each query tile's last split program
    (``$VLLM_SM121_ATTN_FUSED_COMBINE``, below).

Cache layout
    ``key_cache`` / ``value_cache``: ``[num_blocks, num_kv_heads, block_size, head_size]``
    (any strides, last dim contiguous) -- the two halves of the SM121 backend's cache
    ``[num_blocks, 2, num_kv_heads, block_size, head_size]``. bf16/fp16, or fp8-e4m3 with
    per-tensor ``k_scale``/``v_scale`` (stored = x / scale).

Constraints
    * ``seq_lens[i]`` counts the context plus the new tokens of sequence i; its queries sit at
      the last ``q_len`` positions.
    * ``sliding_window=W`` lets a query at position p see keys at positions k with p - k < W
      (vLLM's convention); pages wholly outside the window may be vLLM's null block 0.
    * CUDA graphs: no host synchronisation, no data-dependent launch shape; the grid depends
      only on ``q.shape[0]`` and ``num_seqs`` and the number of splits on the host-side
      ``max_seq_len`` (fix ``num_splits`` when capturing).

Limitations
    No ALiBi, no non-causal (encoder) attention, no per-head KV scales.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_sm121 import platform as _platform

from . import _validate as V
from . import l2_prefetch
from ._validate import _dummy, _next_pow2, pdl_launch
from .fp4_kv import Nvfp4Pages
from .fp4_kv import _check as _fp4_write_check
from .paged_attention_details._paged_attention import _combine_splits_kernel, _paged_attention_kernel

MAX_SPLITS = 64
# A split below this many KV tokens costs more in the merge than it saves.
MIN_TOKENS_PER_SPLIT = 64
# Queries of at most this many rows (query tokens x q heads per KV head) may split their KV.
SPLIT_MAX_QUERY_ROWS = 64
# Programs per SM the split count aims for. H200 sweep (benchmarks/tune_attention.py, gpt-oss
# decode): best at 4-8 programs per SM for batch 1-8 (b1 ctx8k: 64 splits 15.7 us vs 32 splits
# 18.1 us), 2 splits at batch 32.
PROGRAMS_PER_SM = 4
# Batches of up to this many sequences load the per-sequence lists whole in each program (_locate).
SEQ_CHUNK_MAX = 256
# With the GPU already filled (>= 1 program per SM), split only contexts at least this long:
# H200, window-128 layers at batch 32: 1 split 11.4 us vs 2 splits 15.7 us (the merge launch).
FILLED_GPU_MIN_SPLIT_TOKENS = 2048
# nvfp4 pages are decoded as even/odd head-dim halves, each multiplied by its own half of q (no
# in-register re-layout). benchmarks/tune_kv.py on an H100: 1.4-1.8x faster than decoding whole
# rows and joining them (b32 ctx32k 896 vs 1599 us at the best tile of each), which was removed.
# nvfp4: load page rows contiguously (K bytes transposed in registers, block scales
# broadcast in registers) instead of the strided byte gathers the AOT PTX shows
# (ld.global.b8). Compiled and CPU-tested, not yet timed on a GPU: off until tune_kv says so.
NVFP4_VEC = False
# nvfp4, sm_90 only (measured there; sm_12x keeps the per-element bit trick until a GB10 run, as
# its hardware e2m1 conversion, platform.NVFP4_HW_E2M1, does): decode 4 cache bytes per inline-PTX block (_e2m1_words_times_scale_f16: ~2.9 instead of ~4.5
# sm_90a instructions per value; `python -m vllm_sm121.kernels.aot --sass-loop nvfp4`). GPU test
# tests/test_fp4_kv.py "asm" passed on an H100 (2026-11-27, commit 9757ff3), and
# benchmarks/tune_kv.py there, at the (16, 128, 4, 3) tile: b8 ctx32k 168.4 us (gather 191.7,
# bf16 200.2), b32 ctx32k 631.2 (726.6; bf16 732.2), b1 ctx128k 92.4 (103.6; bf16 111.0).
# The interpreter cannot run inline PTX: it always takes the per-element decode.
NVFP4_ASM = True
# nvfp4 page reads of every kind (decode and prefill), sm_90 only (as NVFP4_ASM), OFF: the pages
# as 32-bit words (8 values each, one address per word), decoded through e4m3 bytes and
# cvt.rn.f16x2.e4m3x2 (_e2m1_word_e4m3_times_scale_f16), V decoded as V^T. Fewer static
# instructions (all-features d64 decode: 1214 sm_90a instructions per loop iteration vs 1572 for
# NVFP4_ASM alone) but slower when timed (H100, commit 93825e5, tune_kv, tile (16, 128, 4, 3)):
# B=8 ctx 32k 209.4 us vs 170.6, B=32 ctx 32k 792.7 vs 632.5, B=1 ctx 128k 97.6 vs 93.7. In that
# run (on by default) the nvfp4 + FP8-dense TP=1 engine with other prefill tiles
# ($VLLM_SM121_ATTN_TILE prefill=32,32,4,2;prefill_sw=32,16,4,2) moved teacher-forced (prefill)
# logprobs by 1.15 mean against the default tiles (0.14 with NVFP4_ASM alone; which tile set is
# wrong is not known). tests/test_fp4_kv.py "words" and "words-triton" (its Triton form,
# NVFP4_ASM off) have since passed on an H200 (commit 09758ed), so that disagreement is
# unexplained; off because slower. Needs 4-byte aligned page rows (checked per call).
NVFP4_WORDS = False
# nvfp4 gathers (the default page reads), head size 64: each token's four e4m3 block scales of K
# and of V as one int32 load, the bytes picked in registers (_scale_bytes), instead of byte loads.
# Why: a byte load is below cp.async's 4-byte minimum, so Triton's pipeline left the scale loads in
# the loop body after the stage wait (the stop-32 ncu of the short-context decode, H200: LDG.E.U8
# issued after the DEPBAR that waits for the page data, one more dependent DRAM round trip per
# tile), and their layout went through shared memory (sm_90a, the 120b full-layer decode loop:
# 1240 -> 1044 instructions per iteration, STS 78 -> 22, LDS 72 -> 54). Timed at e62c454 on two
# H200s of one machine (benchmarks/attention.py, tile (16, 128, 4, 3), us, off / on): full B=1
# ctx 128 10.1 / 9.6, ctx 8k 32.9 / 28.5, B=8 ctx 32k 229.3 / 151.1; window-128 layers 10.0 / 9.6
# (ctx 128) and 9.8 / 9.3 (ctx 8k); GPU kernel tests passed there (tests/test_fp4_kv.py
# "scale-words", 16 passed). So it is the default for decode launches on every GPU family (plain
# loads and shifts: nothing sm_90-only; sm_12x not timed). Prefill launches keep the byte loads
# until timed. $VLLM_SM121_ATTN_SCALE_WORDS (read at call time): 1 = every launch, 0 = none.
# Needs 4-byte aligned scale rows (checked per call; else byte loads).
NVFP4_SCALE_WORDS = True  # (the decode default; tests monkeypatch it to pin a variant)
ATTN_SCALE_WORDS_ENV = "VLLM_SM121_ATTN_SCALE_WORDS"


def nvfp4_scale_words(head_size: int, *scales: torch.Tensor, kind: str = "decode") -> bool:
    """Whether the nvfp4 gathers load each token's block scales as one int32 (NVFP4_SCALE_WORDS):
    unset -> decode launches when NVFP4_SCALE_WORDS; 1 -> every launch; 0 -> none."""
    on = V.env_int(ATTN_SCALE_WORDS_ENV, -1)  # -1: unset
    if on == -1:
        on = int(NVFP4_SCALE_WORDS and kind.startswith("decode"))
    elif on not in (0, 1):
        raise ValueError(f"${ATTN_SCALE_WORDS_ENV}={on}: supported: 0 (byte loads), 1 (one int32 per token, "
                         "every launch); unset: decode launches only")
    return bool(on) and head_size == 64 and _word_aligned(*scales)
# The split-KV merge inside the attention kernel ($VLLM_SM121_ATTN_FUSED_COMBINE, read at call time;
# default 1, 0: the separate ``_combine_splits_kernel`` launch): the split program of each query
# tile that finishes last (an acq_rel arrival counter, as the MoE's fused combine) merges the
# tile's partials, reading only the splits that saw KV, so a graph captured for long contexts (64
# splits at 4k for gpt-oss-120b's full layers) merges a short context's few. Needs the workspace's
# counters (``SplitWorkspace.cnt``). One launch fewer per layer: the stop-25 120b profile had the
# separate merge at ~1.5 us per layer. Kernel tests passed on an H200 (68ee231); not timed alone
# (it is one of three defaults that took 120b batch 1 from 380.2 to 409.5 tok/s there).
ATTN_FUSED_COMBINE_ENV = "VLLM_SM121_ATTN_FUSED_COMBINE"


def attn_fused_combine() -> bool:
    return V.env_int(ATTN_FUSED_COMBINE_ENV, 1) != 0


# Under the fused merge, a query tile whose KV one split covers (a short context under a graph
# captured with many splits: gpt-oss-120b's full layers run 64 splits, its tg128 contexts fit one
# 128-token tile) is finished by that split: no partials, no arrival counter, no merge round trip;
# the same bits as the merge (``_finish_rows``). $VLLM_SM121_ATTN_ONE_SPLIT_FINISH=0 (read at call
# time) keeps the merge for A/B runs.
ATTN_ONE_SPLIT_FINISH_ENV = "VLLM_SM121_ATTN_ONE_SPLIT_FINISH"


def attn_one_split_finish() -> bool:
    return V.env_int(ATTN_ONE_SPLIT_FINISH_ENV, 1) != 0


# The fewest KV tokens a live split covers ($VLLM_SM121_ATTN_MIN_SPLIT_TOKENS, read at call time;
# rounded up to whole KV tiles): the kernel cuts the KV a query tile sees into NUM_SPLITS parts of
# max(ceil(tiles / NUM_SPLITS), this) tiles, so a graph captured with 64 splits (long contexts) runs
# a short context on a few splits (with the fused merge the rest exit at once, without arriving at
# its counter) rather than on up to 64 one-tile splits whose partials the merge must then all read.
# 0: one tile (before this knob). H200, 2981c45: 128 gave no gain (120b batch 1 415.4 vs 425.6
# tok/s; docs/logs/minsplit-h200-2981c45.log), so the default stays 0.
ATTN_MIN_SPLIT_TOKENS_ENV = "VLLM_SM121_ATTN_MIN_SPLIT_TOKENS"
ATTN_MIN_SPLIT_TOKENS = 0


def min_split_tiles(tile_n: int) -> int:
    n = V.env_int(ATTN_MIN_SPLIT_TOKENS_ENV, ATTN_MIN_SPLIT_TOKENS)
    if n < 0:
        raise ValueError(f"{ATTN_MIN_SPLIT_TOKENS_ENV}={n}: must be >= 0 (KV tokens; 0: one tile)")
    return max(1, -(-n // tile_n))


@dataclasses.dataclass
class SplitWorkspace:
    """Persistent partial-result buffers for the split-KV path (allocate once for CUDA graphs)."""

    acc: torch.Tensor  # [max_tokens, Hq, num_splits, head_pad] fp32
    ml: torch.Tensor  # [max_tokens, Hq, num_splits, 2] fp32
    # int32 arrival counters of the fused merge, zero between launches (the kernel resets them);
    # one per (query tile, KV head): 2 * max_tokens * Hq covers any grid. None: the merge launch.
    cnt: torch.Tensor | None = None

    @staticmethod
    def counters_needed(num_tokens: int, num_q_heads: int) -> int:
        return 2 * num_tokens * num_q_heads

    @classmethod
    def allocate(cls, max_tokens: int, num_q_heads: int, num_splits: int, head_size: int, device) -> "SplitWorkspace":
        pad = max(16, _next_pow2(head_size))
        return cls(
            acc=torch.empty(max_tokens, num_q_heads, num_splits, pad, dtype=torch.float32, device=device),
            ml=torch.empty(max_tokens, num_q_heads, num_splits, 2, dtype=torch.float32, device=device),
            cnt=torch.zeros(cls.counters_needed(max_tokens, num_q_heads), dtype=torch.int32, device=device),
        )

    @classmethod
    def view_of(cls, acc_flat: torch.Tensor, ml_flat: torch.Tensor, num_tokens: int, num_q_heads: int,
                num_splits: int, head_size: int, cnt_flat: torch.Tensor | None = None) -> "SplitWorkspace | None":
        """Views at the start of persistent flat buffers (same addresses every step), or None if too
        small; the counters only where ``cnt_flat`` holds enough (else the merge is a launch)."""
        pad = max(16, _next_pow2(head_size))
        n = num_tokens * num_q_heads * num_splits
        if n * pad > acc_flat.numel() or n * 2 > ml_flat.numel():
            return None
        need = cls.counters_needed(num_tokens, num_q_heads)
        return cls(acc=acc_flat[: n * pad].view(num_tokens, num_q_heads, num_splits, pad),
                   ml=ml_flat[: n * 2].view(num_tokens, num_q_heads, num_splits, 2),
                   cnt=cnt_flat[:need] if cnt_flat is not None and cnt_flat.numel() >= need else None)


def choose_num_splits(
    *,
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    num_q_per_kv: int,
    sm_count: int,
    sliding_window: int | None = None,
) -> int:
    """Splits for flash-decoding: ~PROGRAMS_PER_SM programs per SM, >= MIN_TOKENS_PER_SPLIT KV tokens each.

    Only query-light batches (decode, spec-verify) split; prefill already has programs to spare.
    A sliding window bounds the KV a query block reads, whatever the context length.
    """
    if max_query_len * num_q_per_kv > SPLIT_MAX_QUERY_ROWS:
        return 1
    visible = max_seq_len
    if sliding_window is not None:
        visible = min(visible, sliding_window + max_query_len - 1)
    programs = num_seqs * num_kv_heads
    if programs >= sm_count and visible < FILLED_GPU_MIN_SPLIT_TOKENS:
        return 1  # every SM busy and little KV per program: the merge launch would cost more
    want = -(-PROGRAMS_PER_SM * sm_count // max(programs, 1))  # ceil
    cap = max(1, visible // MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(want, cap, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)  # power of two: few kernel specialisations


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: SplitWorkspace | None = None,
    tile: _platform.AttnTile | None = None,
    check: bool = True,
    prefetch: torch.Tensor | None = None,
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [T, Hq, D] against paged KV; returns ``out`` [T, Hq, D].

    Rows of ``out`` past ``query_start_loc[-1]`` (graph padding) are left untouched.
    ``tile`` overrides the per-architecture tile table (tuning, tests). ``check=False`` skips
    argument validation (~25 µs of host time a call): only for callers that validated the same
    layer's arguments before (the SM121 backend does on each layer's first call). ``prefetch``: a
    contiguous tensor whose bytes the splits that see no KV (split launches with the in-kernel
    merge: a decode graph's 64 splits at a short context) prefetch into L2 for the kernel after it,
    instead of exiting at once; other launches prefetch nothing (``l2_prefetch``; GPU only,
    results unchanged). Programs with work never issue the hints: an H100 probe
    (``benchmarks/l2_probe.py``) showed a kernel's programs waiting ~5 us for 14.7 MB of them.
    ``kv_write=(key, value, slot_mapping)`` (nvfp4 pages, ``max_query_len == 1``): the step's new
    tokens are not in the cache yet; the kernel writes them (each sequence's token, the same bytes as
    ``fp4_kv_write``) before it reads them, so no write launch precedes it (``kv_write_check``).
    """
    kv_nvfp4 = isinstance(key_cache, Nvfp4Pages)
    if kv_write is not None and not kv_nvfp4:
        raise ValueError("kv_write takes nvfp4 pages (Nvfp4Pages); the bf16 / fp8 caches are written by "
                         "write_kv_cache")
    if not check:
        if out is None:
            out = torch.empty_like(q)
        if kv_nvfp4:
            return _launch(q, key_cache.data, value_cache.data, key_cache.scales.view(torch.uint8),
                           value_cache.scales.view(torch.uint8), block_table, query_start_loc, seq_lens,
                           kv_fp8=False, kv_nvfp4=True, k_scale=key_cache.global_scale,
                           v_scale=value_cache.global_scale, max_query_len=max_query_len, max_seq_len=max_seq_len,
                           scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks, out=out,
                           num_splits=num_splits, workspace=workspace, tile=tile, prefetch=prefetch,
                           kv_write=kv_write)
        return _launch(q, key_cache, value_cache, None, None, block_table, query_start_loc, seq_lens,
                       kv_fp8=key_cache.dtype in V.FP8_DTYPES, kv_nvfp4=False, k_scale=k_scale, v_scale=v_scale,
                       max_query_len=max_query_len, max_seq_len=max_seq_len, scale=scale,
                       sliding_window=sliding_window, softcap=softcap, sinks=sinks, out=out,
                       num_splits=num_splits, workspace=workspace, tile=tile, prefetch=prefetch)
    # ---- validation ---------------------------------------------------------------------------
    if kv_nvfp4 != isinstance(value_cache, Nvfp4Pages):
        raise ValueError("key_cache and value_cache must both be Nvfp4Pages or both be tensors")
    if kv_nvfp4:
        if kv_write is not None:
            kv_write_check(q, key_cache, value_cache, max_query_len, *kv_write)
        return _paged_attention_nvfp4(q, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                                      max_query_len=max_query_len, max_seq_len=max_seq_len, scale=scale,
                                      sliding_window=sliding_window, softcap=softcap, sinks=sinks, out=out,
                                      num_splits=num_splits, workspace=workspace, tile=tile, prefetch=prefetch,
                                      kv_write=kv_write)
    V.check_ndim("q", q, 3, "[num_tokens, num_q_heads, head_size]")
    V.check_ndim("key_cache", key_cache, 4, "[num_blocks, num_kv_heads, block_size, head_size]")
    V.check_ndim("value_cache", value_cache, 4, "[num_blocks, num_kv_heads, block_size, head_size]")
    V.check_dtype("q", q, V.ACT_DTYPES)
    V.check_dtype("key_cache", key_cache, V.ACT_DTYPES + V.FP8_DTYPES)
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache.dtype={value_cache.dtype} must equal key_cache.dtype={key_cache.dtype}")
    kv_fp8 = key_cache.dtype in V.FP8_DTYPES
    if not kv_fp8 and key_cache.dtype != q.dtype:
        raise ValueError(f"key_cache.dtype={key_cache.dtype} must equal q.dtype={q.dtype} (or be float8_e4m3fn)")
    head_size = q.shape[2]
    num_kv_heads, block_size, kv_head_size = key_cache.shape[1:]
    V.check_head_size(head_size)
    V.check_block_size(block_size)
    if kv_head_size != head_size or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"cache shapes key_cache={tuple(key_cache.shape)}, value_cache={tuple(value_cache.shape)} "
            f"disagree with q head_size={head_size}"
        )
    out = _check_common(q, num_kv_heads, block_table, query_start_loc, seq_lens, sliding_window, softcap, sinks, out)
    if kv_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("k_scale and v_scale are required for an fp8 KV cache")
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        V.check_last_dim_contiguous(name, t)
    V.check_same_device(q=q, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
                        query_start_loc=query_start_loc, seq_lens=seq_lens, sinks=sinks)
    return _launch(q, key_cache, value_cache, None, None, block_table, query_start_loc, seq_lens,
                   kv_fp8=kv_fp8, kv_nvfp4=False, k_scale=k_scale, v_scale=v_scale, max_query_len=max_query_len,
                   max_seq_len=max_seq_len, scale=scale, sliding_window=sliding_window, softcap=softcap,
                   sinks=sinks, out=out, num_splits=num_splits, workspace=workspace, tile=tile, prefetch=prefetch)


def _check_common(q, num_kv_heads, block_table, query_start_loc, seq_lens, sliding_window, softcap, sinks, out):
    """Checks shared by every cache format; returns ``out`` (allocated if None)."""
    V.check_ndim("block_table", block_table, 2, "[num_seqs, max_blocks_per_seq]")
    V.check_ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    V.check_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    for name, t in (("block_table", block_table), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        V.check_dtype(name, t, (torch.int32,))
    num_q_heads = q.shape[1]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_table.shape[0] < num_seqs:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries and block_table {block_table.shape[0]} rows; "
            f"need num_seqs + 1 = {num_seqs + 1} and >= {num_seqs} for seq_lens of {num_seqs} sequences"
        )
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be a positive int or None")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap={softcap} must be > 0 or None")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != num_q_heads):
        raise ValueError(f"sinks must have shape [num_q_heads={num_q_heads}], got {tuple(sinks.shape)}")
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must match q: shape {tuple(q.shape)} dtype {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    return out


def kv_write_check(q, k_pages: Nvfp4Pages, v_pages: Nvfp4Pages, max_query_len: int, key, value, slot_mapping) -> None:
    """Why ``paged_attention(..., kv_write=(key, value, slot_mapping))`` cannot write the new tokens itself:
    raises ValueError naming what (else returns)."""
    if max_query_len != 1:
        raise ValueError(f"kv_write needs one query token per sequence (max_query_len=1), got max_query_len="
                         f"{max_query_len}: write the cache with fp4_kv_write first")
    _fp4_write_check(key, value, k_pages, v_pages, slot_mapping)
    for name, t in (("key", key), ("value", value)):
        V.check_last_dim_contiguous(name, t)
    if key.shape[0] < q.shape[0]:
        raise ValueError(f"kv_write: key has {key.shape[0]} rows for {q.shape[0]} query tokens")
    V.check_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    bs, d = k_pages.shape[2], k_pages.shape[3]
    for name, p in (("k_pages", k_pages), ("v_pages", v_pages)):  # the write's in-page layout
        if p.data.stride()[1:] != (bs * d // 2, d // 2, 1) or p.scales.stride()[1:] != (bs * d // 16, d // 16, 1):
            raise ValueError(f"kv_write: {name} is not [Hkv][block][head] within a page (data strides "
                             f"{p.data.stride()}, scale strides {p.scales.stride()})")


def _paged_attention_nvfp4(q, k: Nvfp4Pages, v: Nvfp4Pages, block_table, query_start_loc, seq_lens, *,
                           max_query_len, max_seq_len, scale, sliding_window, softcap, sinks, out, num_splits,
                           workspace, tile, prefetch=None, kv_write=None):
    V.check_ndim("q", q, 3, "[num_tokens, num_q_heads, head_size]")
    V.check_dtype("q", q, V.ACT_DTYPES)
    head_size = q.shape[2]
    if k.shape != v.shape or k.shape[3] != head_size:
        raise ValueError(f"nvfp4 pages k={k.shape} v={v.shape} disagree with q head_size={head_size}")
    if head_size % 16 or head_size & (head_size - 1):
        raise ValueError(f"head_size={head_size} is not supported by the nvfp4 KV cache; supported: 16, 32, 64, 128, 256")
    V.check_block_size(k.shape[2])
    V.check_last_dim_contiguous("q", q)
    out = _check_common(q, k.shape[1], block_table, query_start_loc, seq_lens, sliding_window, softcap, sinks, out)
    return _launch(q, k.data, v.data, k.scales.view(torch.uint8), v.scales.view(torch.uint8), block_table,
                   query_start_loc, seq_lens, kv_fp8=False, kv_nvfp4=True, k_scale=k.global_scale,
                   v_scale=v.global_scale, max_query_len=max_query_len, max_seq_len=max_seq_len, scale=scale,
                   sliding_window=sliding_window, softcap=softcap, sinks=sinks, out=out, num_splits=num_splits,
                   workspace=workspace, tile=tile, prefetch=prefetch, kv_write=kv_write)


def _word_aligned(*pages: torch.Tensor) -> bool:
    """Whether every (page, head, token) row of these uint8 nvfp4 data views starts 4-byte aligned."""
    return all(p.data_ptr() % 4 == 0 and all(p.stride(i) % 4 == 0 for i in range(3)) for p in pages)


def _launch(q, key_cache, value_cache, k_bscale, v_bscale, block_table, query_start_loc, seq_lens, *, kv_fp8,
            kv_nvfp4, k_scale, v_scale, max_query_len, max_seq_len, scale, sliding_window, softcap, sinks, out,
            num_splits, workspace, tile, prefetch=None, kv_write=None):
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    # ---- performance hyper-parameters ---------------------------------------------------------
    family = _platform.family_of(q)
    num_q_per_kv = num_q_heads // num_kv_heads
    head_pad = max(16, _next_pow2(head_size))
    kind = "decode" if max_query_len * num_q_per_kv <= 16 else ("prefill" if sliding_window is None else "prefill_sw")
    if kv_nvfp4:  # nvfp4 pages: the kind's own tiles where measured (platform.attn_tile)
        kind += "_nvfp4"
    tile = tile or _platform.attn_tile(family, kind, head_pad)
    # Never more rows than the longest query needs (spec-verify 1+k would waste half a tile).
    rows = _next_pow2(max(1, max_query_len) * num_q_per_kv)
    block_m = max(16, _next_pow2(num_q_per_kv), min(tile.block_m, rows))
    block_q = block_m // num_q_per_kv
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_query_len=max_query_len,
            max_seq_len=max_seq_len, num_q_per_kv=num_q_per_kv, sm_count=_platform.sm_count(q),
            sliding_window=sliding_window,
        )
    if num_splits < 1 or num_splits > MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits={num_splits} is not supported; supported: powers of two 1..{MAX_SPLITS}")

    # ---- launch -------------------------------------------------------------------------------
    dummy = _dummy(q.device)
    scaled = kv_fp8 or kv_nvfp4
    k_scale_t = V.scale_tensor("k_scale", k_scale, q.device) if scaled else dummy
    v_scale_t = V.scale_tensor("v_scale", v_scale, q.device) if scaled else dummy
    k_bs = k_bscale if kv_nvfp4 else dummy
    v_bs = v_bscale if kv_nvfp4 else dummy
    sinks_t = sinks if sinks is not None else dummy
    if num_splits > 1:
        if workspace is None:
            workspace = SplitWorkspace.allocate(num_tokens, num_q_heads, num_splits, head_size, q.device)
        ws_shape = tuple(workspace.acc.shape)
        if ws_shape[0] < num_tokens or ws_shape[1:] != (num_q_heads, num_splits, head_pad):
            raise ValueError(
                f"workspace.acc has shape {ws_shape}; need [>= {num_tokens}, {num_q_heads}, {num_splits}, {head_pad}]"
            )
        part_acc, part_ml = workspace.acc, workspace.ml
    else:
        part_acc = part_ml = dummy

    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    fused = num_splits > 1 and workspace.cnt is not None and attn_fused_combine()
    if fused and (workspace.cnt.dtype != torch.int32 or workspace.cnt.numel() < grid[0] * grid[1]):
        raise ValueError(f"workspace.cnt must be int32 with >= {grid[0] * grid[1]} counters (one per query tile "
                         f"and KV head), got {workspace.cnt.dtype} [{workspace.cnt.numel()}]")
    # Decode batches of up to SEQ_CHUNK_MAX sequences find their sequence in one memory round trip
    # (_locate); a power of two >= 16 (few specialisations). Prefill keeps the binary search: its
    # programs amortize it, and the lookup costs the prefill tile registers (sm_90a: 157 -> 206, one
    # program fewer per SM; decode 92 -> 112, where shared memory already allows only 2 per SM).
    # only the fused merge's idle splits issue the hints: other launches compile without them
    pf_ptr, pf_bytes, pf_kw = l2_prefetch.launch_args(prefetch if fused else None, q)
    seq_chunk = max(16, _next_pow2(num_seqs)) if kind.startswith("decode") and num_seqs <= SEQ_CHUNK_MAX else 0
    if kv_write is not None:
        kw_key, kw_value, kw_slot = kv_write
        kw_strides = (kw_key.stride(0), kw_key.stride(1), kw_value.stride(0), kw_value.stride(1))
    else:
        kw_key = kw_value = kw_slot = dummy
        kw_strides = (0, 0, 0, 0)
    _paged_attention_kernel[grid](
        out, part_acc, part_ml, workspace.cnt if fused else dummy, q, key_cache, value_cache, k_bs, v_bs,
        block_table, seq_lens, query_start_loc, sinks_t, k_scale_t, v_scale_t,
        float(scale), float(softcap or 0.0), num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        k_bs.stride(0) if kv_nvfp4 else 0, k_bs.stride(1) if kv_nvfp4 else 0,
        v_bs.stride(0) if kv_nvfp4 else 0, v_bs.stride(1) if kv_nvfp4 else 0,
        block_table.stride(0), pf_ptr, pf_bytes, kw_key, kw_value, kw_slot, *kw_strides,
        NUM_Q_PER_KV=num_q_per_kv, HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile.tile_n,
        SLIDING_WINDOW=int(sliding_window or 0), USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None, KV_FP8=kv_fp8, KV_NVFP4=kv_nvfp4, NUM_SPLITS=num_splits,
        DOT_FP32=family == _platform.INTERPRETER and q.dtype == torch.bfloat16,
        E2M1_HW=kv_nvfp4 and _platform.NVFP4_HW_E2M1.get(family, False),
        NVFP4_VEC=kv_nvfp4 and NVFP4_VEC,
        NVFP4_ASM=kv_nvfp4 and NVFP4_ASM and family == _platform.SM90,
        NVFP4_WORDS=kv_nvfp4 and NVFP4_WORDS and family in (_platform.SM90, _platform.INTERPRETER)
        and _word_aligned(key_cache, value_cache),
        NVFP4_SCALE_WORDS=kv_nvfp4 and not NVFP4_VEC and nvfp4_scale_words(head_size, k_bs, v_bs, kind=kind),
        SEQ_CHUNK=seq_chunk, FUSED_COMBINE=fused,
        ONE_SPLIT_FINISH=fused and attn_one_split_finish(),
        MIN_SPLIT_TILES=min_split_tiles(tile.tile_n) if num_splits > 1 else 1, **pf_kw, **pdl_launch(q),
        KV_WRITE=kv_write is not None,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    if num_splits > 1 and not fused:
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_ml, query_start_loc, sinks_t, v_scale_t,
            num_seqs, num_q_heads, out.stride(0), out.stride(1),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SPLITS=num_splits,
            USE_SINKS=sinks is not None, KV_FP8=scaled, **pdl_launch(q),
            num_warps=1 if head_pad <= 64 else 2,
        )
    return out


def paged_attention_torch(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    **_perf_args,
) -> torch.Tensor:
    """Pure-torch reference (fp32 math), same arguments as ``paged_attention``."""
    if isinstance(key_cache, Nvfp4Pages):
        key_cache, value_cache = key_cache.dequantize(), value_cache.dequantize()
        k_scale = v_scale = None
    out = torch.zeros_like(q)
    num_q_heads, num_kv_heads = q.shape[1], key_cache.shape[1]
    group = num_q_heads // num_kv_heads
    block_size = key_cache.shape[2]
    ks = float(k_scale) if k_scale is not None else 1.0
    vs = float(v_scale) if v_scale is not None else 1.0
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_lo, q_hi = qsl[i], qsl[i + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        pages = block_table[i, pos // block_size].long()
        k = key_cache[pages, :, pos % block_size].float() * ks  # [S, Hkv, D]
        v = value_cache[pages, :, pos % block_size].float() * vs
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qi = q[q_lo:q_hi].float()  # [L, Hq, D]
        s = torch.einsum("lhd,shd->hls", qi, k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= (q_pos[:, None] - pos[None, :]) < sliding_window
        s = s.masked_fill(~visible[None], float("-inf"))
        v = v.masked_fill(~visible.any(0)[:, None, None], 0.0)  # null-block pages may hold NaN
        if sinks is not None:
            sink_col = sinks.float()[:, None, None].expand(num_q_heads, q_len, 1)
            p = torch.softmax(torch.cat([s, sink_col], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hls,shd->lhd", p, v).to(q.dtype)
    return out
