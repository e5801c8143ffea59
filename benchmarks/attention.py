"""Paged-attention benchmark, gpt-oss shapes: ours (``sm121``) vs vLLM 0.26's Triton
``unified_attention`` (``triton_unified``) and FlashAttention-3 (``fa3``), same card, same run.

Usage (needs a CUDA GPU with vLLM 0.26.0; without one it says so and exits 2)::

    python benchmarks/attention.py --quick          # ~1 min: fewer points, 15 reps
    python benchmarks/attention.py                  # ~4 min: all points, 50 reps
    python benchmarks/attention.py --kv-dtype fp8 --providers sm121,fa3 --ctx 8k,128k --batch 1,32
    python benchmarks/attention.py --kv-dtype nvfp4 # ours only: upstream rows say "not supported"
    python benchmarks/attention.py --dry-run        # CPU, Triton interpreter: API/layout check only

Shapes
    gpt-oss attention: 64 query heads, 8 KV heads, head_dim 64, scale 1/8, attention sinks
    (random, one fp32 per query head, rounded to bf16 so FA3's bf16 ``s_aux`` sees the same
    values), block_size 16 (vLLM's default; FA3 paged KV wants a multiple of 16). Both layer
    kinds of the model: ``full`` and ``sliding`` (window 128).

Points
    decode            q_len 1 per sequence, seq_len (context incl. the new token) in --ctx
                      (default 2k,8k,32k,128k), batch in --batch (default 1,8,32), equal lengths.
    prefill           1 and 4 sequences of a 2048-token prompt (q_len == seq_len).
    chunked_prefill   1 sequence, 2048 new tokens after 30720 cached (seq_len 32768).
    kv_cache_write    decode batch sizes: each provider's cache write (ours ``write_kv_cache``;
                      vLLM's Triton backend ``triton_reshape_and_cache_flash``; vLLM's FLASH_ATTN
                      backend ``reshape_and_cache_flash`` CUDA op), one token per sequence.
    --quick           decode seq 8k,128k x batch 1,32; prefill 1 x 2048 and the chunked case;
                      cache write batch 1,32; 15 reps.

Data (one data set per point, shared by all providers)
    Random q/k/v (N(0,1), bf16 by default), a random permutation of the physical pages, block 0
    is vLLM's null block (zeros). For sliding layers the pages wholly before the first position any
    query can see point at block 0, as vLLM's sliding-window KV manager does, so a 128k sliding
    decode point holds only the last ~9 pages per sequence in memory.
    Layouts: ours ``kv = [num_blocks, 2, num_kv_heads, block_size, head_size]`` (key_cache =
    kv[:, 0]); vLLM 0.26's Triton and FLASH_ATTN backends share one layout, logical
    ``[num_blocks, num_kv_heads, block_size, 2*head_size]`` with the default NHD stride order, i.e.
    physical ``[num_blocks, block_size, num_kv_heads, 2*head_size]`` with key_cache / value_cache
    the ``[..., :D]`` / ``[..., D:]`` halves (shape ``[num_blocks, block_size, num_kv_heads, D]``),
    built here with the same numbers (one copy serves both upstream providers).
    ``--kv-dtype fp8``: e4m3 with per-tensor k/v scale 1/16 (stored = x / scale). vLLM 0.26 on
    CUDA then also quantizes the query to fp8 for both of its backends (``Attention.query_quant``,
    q_scale 1.0); we do the same for triton_unified (unless --no-fp8-query) and always for fa3
    (FA3 needs q dtype == KV dtype). Ours keeps the bf16 query.
    ``--kv-dtype nvfp4`` (ours only; vLLM 0.26 has no nvfp4 KV for triton_unified or fa3 on this
    GPU, so their rows record "nvfp4 KV not supported by this provider in vLLM 0.26"): the same
    random bf16 K/V, quantized page row by page row with ``nvfp4_quantize`` (CPU: its bit-exact
    torch reference) into vLLM's nvfp4 page
    ``kv = uint8[num_blocks, 2, Hkv * block_size * (D/2 + D/16)]`` (``Nvfp4Pages.view`` of kv[:, 0]
    and kv[:, 1]); per-side fp32 global scale amax / (6 * 448) of the generated K (resp. V). The
    cache-write point times ``fp4_kv_write`` (its global scales from the written key / value; its
    cache starts zeroed: only the written slots are read back).

Calls (mirroring how vLLM 0.26's backends call them for gpt-oss)
    sm121           paged_attention(..., scale=1/8, sliding_window=128|None, sinks=fp32[64],
                    k_scale/v_scale 0-d tensors (fp8; nvfp4: Nvfp4Pages as key/value_cache, which
                    carry the global scales, no k_scale/v_scale), num_splits=choose_num_splits(...) for the
                    point's max_seq_len (or --sm121-split-seq-len), workspace=SplitWorkspace
                    preallocated: as vllm_sm121/attention (impl.py, metadata.py) calls it.
    triton_unified  unified_attention(..., causal=True, window_size=(127, 0)|(-1, -1), softcap=0,
                    sinks, 3D/segment buffers as TritonAttentionMetadataBuilder allocates them:
                    seq_threshold_3D = 128 // num_kv_heads = 16, 16 segments -> batches <= 16 decode
                    with the 3D (split) kernel + reduce_segments, others with the 2D kernel).
    fa3             flash_attn_varlen_func(..., fa_version=3, causal=True, window_size=[127, 0]|
                    [-1, -1], block_table, seqused_k, s_aux=bf16 sinks, num_splits=--fa3-num-splits
                    (0 = FA3's heuristic; vLLM passes 32 under full CUDA graphs), scheduler_metadata
                    None: gpt-oss mixes two windows, so vLLM 0.26 turns FA3's AOT scheduling off
                    (--fa3-aot-schedule precomputes it with get_scheduler_metadata instead)).

Correctness (--refcheck, default on)
    The first call's output of each provider is compared with ours: max |diff| printed per
    provider (tolerance --tol 2e-2; fp8 with an fp8 query: compared with ours run on the
    dequantized query, tolerance --tol-fp8, as those kernels also round P to fp8). Where cheap,
    ours is also compared with the fp32 torch reference ``paged_attention_torch`` (column ``ref``).
    nvfp4: only that reference check, on the SAME Nvfp4Pages (the reference dequantizes them), so
    --tol bounds the kernel's error, not the quantization error; the cache write is compared with
    ``fp4_kv_write_torch`` (dequantized written slots).

Dry run (--dry-run, no GPU needed)
    Triton interpreter on the CPU, tiny fp16 points (the interpreter's bf16 ``tl.dot`` is wrong in
    vLLM's kernel; ours casts), window 32: runs ours and ``unified_attention`` through the same
    code paths (layouts, window convention, sinks, 3D/2D buffers) and compares them with each other
    and the torch reference; checks the kwargs of every upstream call (FA3, the cache writes)
    against the installed vLLM's signatures. Exit 1 if anything disagrees. With --kv-dtype fp8 the
    fp8-query comparisons are not judged: the interpreter's fp32->fp8 cast and fp8 dot are inexact.
    With --kv-dtype nvfp4 ours runs (and is checked against the torch reference) alone.

Timing
    Per provider: 2 warm-up calls (Triton JIT), then --reps timed calls, each preceded by a
    256 MB memset (cold L2: H100 L2 is 50 MB) and a ``torch.cuda._sleep`` long enough that the
    host has queued the call before the GPU reaches it, so CUDA events bracket GPU time only (the
    host launch cost, which CUDA graphs remove in serving, is reported separately as
    ``host_us``). Reported: p20/p50/p80 of the per-call times in µs (one call = one layer).
    Bytes = KV bytes actually needed given the window (per sequence: full -> seq_len tokens,
    sliding -> min(seq_len, q_len + 127) tokens; x 8 KV heads x 64 x 2 (K and V) x bytes per
    element: bf16 2, fp8 1, nvfp4 (D/2 + D/16) / D = 0.5625 incl. its block scales) + query and
    output bytes; GB/s = bytes / p50; % BW = that over the card's copy bandwidth measured in the
    same run (device-to-device ``copy_`` of a 1 GiB buffer, read + written bytes / time, median
    of 10). Prefill rows also give TFLOP/s (4 * head_dim * q heads per visible query-key pair).

Output
    A table (providers side by side per point, winner, ours vs the best other) and a JSON file
    (--out, default results/attention.json): a header (device, capability, versions, git commit,
    copy bandwidth, upstream function locations) and one record per (point, provider).
"""

from __future__ import annotations

import os
import sys

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:
    # Must precede any triton import. Hiding the GPUs makes vLLM keep Triton enabled without an
    # active driver (its "distributed" leniency), so unified_attention runs under the interpreter.
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import argparse  # noqa: E402
import ast  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

# gpt-oss attention shapes
NUM_Q_HEADS = 64
NUM_KV_HEADS = 8
HEAD_SIZE = 64
SCALE = 0.125  # 1 / sqrt(64)
WINDOW = 128
BLOCK_SIZE = 16
KV_FP8_SCALE = 1.0 / 16  # per-tensor k/v scale for --kv-dtype fp8 (stored = x / scale)
Q_FP8_SCALE = 1.0  # vLLM's default layer._q_scale

FP8 = torch.float8_e4m3fn
INTERP_FP8 = "n/a (interpreter fp8)"
NVFP4_UNSUPPORTED = "nvfp4 KV not supported by this provider in vLLM 0.26"
OK_STATUSES = (None, "ok", INTERP_FP8)
PROVIDERS = ("sm121", "triton_unified", "fa3")
FLUSH_BYTES = 256 << 20
COPY_BYTES = 1 << 30

# vLLM 0.26 TritonAttentionMetadataBuilder defaults (read from the module when importable).
_MIN_LAUNCH_GRID_SIZE_2D = 128
_NUM_PAR_SOFTMAX_SEGMENTS = 16

NO_CUDA_MESSAGE = (
    "benchmarks/attention.py needs a CUDA GPU (H100/H200 with vLLM 0.26.0) to measure anything; "
    "torch.cuda.is_available() is False here. Use --dry-run for a CPU check of the call plumbing."
)


# ---------------------------------------------------------------------------------------------
# points
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    kernel: str  # "decode" | "prefill" | "chunked_prefill" | "kv_cache_write"
    batch: int
    q_len: int  # new tokens per sequence
    seq_len: int  # context + new tokens per sequence
    layer: str  # "full" | "sliding" | "-" (cache write)
    window_size: int = WINDOW  # used when layer == "sliding"

    @property
    def window(self) -> int | None:
        return self.window_size if self.layer == "sliding" else None

    @property
    def num_tokens(self) -> int:
        return self.batch * self.q_len

    @property
    def label(self) -> str:
        layer = f"sliding({self.window_size})" if self.layer == "sliding" else self.layer
        return f"{self.kernel} {layer} B={self.batch} q={self.q_len} seq={self.seq_len}"


def _parse_size(text: str) -> int:
    t = text.strip().lower()
    mult = 1
    if t.endswith("k"):
        t, mult = t[:-1], 1024
    elif t.endswith("m"):
        t, mult = t[:-1], 1024 * 1024
    value = int(float(t) * mult)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return value


def _parse_list(text: str) -> list[int]:
    return [_parse_size(x) for x in text.split(",") if x.strip()]


def build_points(args) -> list[Point]:
    layers = [x for x in args.layers.split(",") if x]
    kinds = set(x for x in args.kinds.split(",") if x)
    window = args.window
    pts: list[Point] = []
    if args.dry_run:
        ctxs, batches = args.ctx or [70], args.batch or [2]
        prefill = [("prefill", 1, 24, 24), ("chunked_prefill", 2, 16, 60)]
        write_batches = args.batch or [3]
    elif args.quick:
        ctxs, batches = args.ctx or [8192, 131072], args.batch or [1, 32]
        prefill = [("prefill", 1, 2048, 2048), ("chunked_prefill", 1, 2048, 30720 + 2048)]
        write_batches = args.batch or [1, 32]
    else:
        ctxs, batches = args.ctx or [2048, 8192, 32768, 131072], args.batch or [1, 8, 32]
        prefill = [
            ("prefill", 1, 2048, 2048),
            ("prefill", 4, 2048, 2048),
            ("chunked_prefill", 1, 2048, 30720 + 2048),
        ]
        write_batches = args.batch or [1, 8, 32]
    if "decode" in kinds:
        for ctx in ctxs:
            for b in batches:
                for layer in layers:
                    pts.append(Point("decode", b, 1, ctx, layer, window))
    if "prefill" in kinds:
        for kernel, b, q_len, seq_len in prefill:
            for layer in layers:
                pts.append(Point(kernel, b, q_len, seq_len, layer, window))
    if "write" in kinds:
        for b in write_batches:
            pts.append(Point("kv_cache_write", b, 1, 1, "-", window))
    return pts


# ---------------------------------------------------------------------------------------------
# bytes / flops
# ---------------------------------------------------------------------------------------------


def kv_tokens_needed(pt: Point) -> int:
    """KV tokens one sequence's queries can see (each read once)."""
    if pt.window is None:
        return pt.seq_len
    return min(pt.seq_len, pt.q_len + pt.window - 1)


def kv_bytes_per_elem(kv_dtype: str) -> float:
    """KV-cache bytes per K (or V) element; nvfp4: (D/2 data + D/16 e4m3 scales) / D."""
    if kv_dtype == "nvfp4":
        from vllm_sm121.kernels.fp4_kv import nvfp4_full_dim

        return nvfp4_full_dim(HEAD_SIZE) / HEAD_SIZE
    return 1 if kv_dtype == "fp8" else 2


def attention_bytes(pt: Point, kv_elem: float, q_elem: int = 2, out_elem: int = 2) -> int:
    kv = round(pt.batch * kv_tokens_needed(pt) * NUM_KV_HEADS * HEAD_SIZE * 2 * kv_elem)
    q = pt.num_tokens * NUM_Q_HEADS * HEAD_SIZE * q_elem
    out = pt.num_tokens * NUM_Q_HEADS * HEAD_SIZE * out_elem
    return kv + q + out


def write_bytes(pt: Point, kv_elem: float) -> int:
    n = pt.num_tokens * NUM_KV_HEADS * HEAD_SIZE * 2  # K and V elements
    return n * 2 + round(n * kv_elem) + pt.num_tokens * 8  # read bf16 K/V, write cache, slot_mapping


def attention_flops(pt: Point) -> int:
    pairs = 0
    for p in range(pt.seq_len - pt.q_len, pt.seq_len):  # query positions
        pairs += min(p + 1, pt.window) if pt.window is not None else p + 1
    return 4 * HEAD_SIZE * NUM_Q_HEADS * pairs * pt.batch


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class Layout:
    num_blocks: int
    pages_per_seq: int
    first_page: int  # pages before it point at the null block 0 (sliding layers)


def layout_for(pt: Point) -> Layout:
    pages = _cdiv(pt.seq_len, BLOCK_SIZE)
    if pt.kernel == "kv_cache_write":
        return Layout(num_blocks=max(2048, 4 * pt.batch + 1), pages_per_seq=1, first_page=0)
    first_pos = 0 if pt.window is None else max(0, pt.seq_len - pt.q_len - (pt.window - 1))
    first_page = first_pos // BLOCK_SIZE
    return Layout(num_blocks=1 + pt.batch * (pages - first_page), pages_per_seq=pages, first_page=first_page)


def cache_bytes(num_blocks: int, kv_elem: float) -> int:
    return round(num_blocks * 2 * NUM_KV_HEADS * BLOCK_SIZE * HEAD_SIZE * kv_elem)


class Inputs:
    """One data set for one point; every provider reads the same numbers.

    ``nvfp4=True`` (with ``kv_dtype`` the activation dtype the K/V are generated in): the cache
    becomes vLLM's nvfp4 page (``_to_nvfp4``) and key_cache / value_cache are ``Nvfp4Pages``.
    """

    def __init__(self, pt: Point, *, kv_dtype: torch.dtype, act_dtype: torch.dtype, device, seed: int,
                 nvfp4: bool = False):
        self.pt = pt
        self.device = torch.device(device)
        self.act_dtype = act_dtype
        self.kv_dtype = kv_dtype
        self.kv_fp8 = kv_dtype == FP8
        self.kv_nvfp4 = nvfp4
        self.nvfp4_global_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.layout = lay = layout_for(pt)
        gen_cpu = torch.Generator().manual_seed(seed)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        B, L, S = pt.batch, pt.q_len, pt.seq_len
        T = B * L

        # ours: [num_blocks, 2, Hkv, block_size, D]
        shape = (lay.num_blocks, 2, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
        self.kv = torch.empty(shape, dtype=kv_dtype, device=self.device)
        chunk = max(1, (256 << 20) // (2 * NUM_KV_HEADS * BLOCK_SIZE * HEAD_SIZE * 2))
        for c0 in range(0, lay.num_blocks, chunk):
            c1 = min(lay.num_blocks, c0 + chunk)
            tmp = torch.randn((c1 - c0,) + shape[1:], generator=gen, device=self.device, dtype=torch.float32)
            if self.kv_fp8:
                tmp = (tmp / KV_FP8_SCALE).clamp(-448.0, 448.0)
            self.kv[c0:c1] = tmp.to(kv_dtype)
            del tmp
        self.kv[0].view(torch.uint8).zero_()  # null block
        self.key_cache = self.kv[:, 0]
        self.value_cache = self.kv[:, 1]
        if nvfp4 and pt.kernel != "kv_cache_write":
            self._to_nvfp4(src=self.kv)
        self._upstream: tuple[torch.Tensor, torch.Tensor] | None = None

        self.k_scale = KV_FP8_SCALE if self.kv_fp8 else None
        self.v_scale = KV_FP8_SCALE if self.kv_fp8 else None
        # vLLM keeps layer._k_scale/_v_scale/_q_scale as 0-d fp32 tensors (1.0 for bf16 KV).
        self.k_scale_t = torch.tensor(KV_FP8_SCALE if self.kv_fp8 else 1.0, dtype=torch.float32, device=self.device)
        self.v_scale_t = self.k_scale_t.clone()
        self.q_scale_t = torch.tensor(Q_FP8_SCALE, dtype=torch.float32, device=self.device)

        if pt.kernel == "kv_cache_write":
            self.key = torch.randn(T, NUM_KV_HEADS, HEAD_SIZE, generator=gen, device=self.device).to(act_dtype)
            self.value = torch.randn(T, NUM_KV_HEADS, HEAD_SIZE, generator=gen, device=self.device).to(act_dtype)
            blocks = torch.randperm(lay.num_blocks - 1, generator=gen_cpu)[:T] + 1
            offs = torch.randint(0, BLOCK_SIZE, (T,), generator=gen_cpu)
            self.slot_mapping = (blocks * BLOCK_SIZE + offs).to(torch.int64).to(self.device)
            if nvfp4:
                self._to_nvfp4(amax=torch.stack([self.key.abs().amax(), self.value.abs().amax()]))
            return

        # pages: a random permutation of the physical blocks
        live = lay.pages_per_seq - lay.first_page
        perm = torch.randperm(lay.num_blocks - 1, generator=gen_cpu).to(torch.int32) + 1
        bt = torch.zeros(B, lay.pages_per_seq, dtype=torch.int32)
        bt[:, lay.first_page:] = perm.view(B, live)
        self.block_table = bt.to(self.device)
        self.query_start_loc = (torch.arange(B + 1, dtype=torch.int32) * L).to(self.device)
        self.seq_lens = torch.full((B,), S, dtype=torch.int32, device=self.device)
        self.max_query_len = L
        self.max_seq_len = S
        self.q = torch.randn(T, NUM_Q_HEADS, HEAD_SIZE, generator=gen, device=self.device).to(act_dtype)
        sinks = torch.randn(NUM_Q_HEADS, generator=gen_cpu)
        self.sinks_bf16 = sinks.to(torch.bfloat16).to(self.device).contiguous()  # FA3's s_aux dtype
        self.sinks = self.sinks_bf16.float()  # same values, fp32
        if self.kv_fp8:
            self.q8 = (self.q.float() / Q_FP8_SCALE).clamp(-448.0, 448.0).to(FP8)
            self.q_deq = (self.q8.float() * Q_FP8_SCALE).to(act_dtype)  # exact in bf16/fp16
        else:
            self.q8 = self.q_deq = None

    def _to_nvfp4(self, src: torch.Tensor | None = None, amax: torch.Tensor | None = None) -> None:
        """Replace the cache by vLLM's nvfp4 page ``uint8[num_blocks, 2, Hkv * block_size * (D/2 + D/16)]``.

        ``src`` [num_blocks, 2, Hkv, block_size, D] (the generated K/V) is quantized page row by page
        row with ``nvfp4_quantize`` (on the CPU with its bit-exact torch reference: the interpreter
        needs ~16 ms a row); without it the pages stay zeroed (cache-write points). Global scale per
        side: amax / (6 * 448) as an fp32 [1] tensor, amax = [K amax, V amax] of ``src`` (the null
        block 0 excluded) unless given.
        """
        from vllm_sm121.kernels.fp4_kv import Nvfp4Pages, nvfp4_full_dim
        from vllm_sm121.kernels.nvfp4 import nvfp4_quantize, nvfp4_quantize_torch

        quantize = nvfp4_quantize if self.device.type == "cuda" else nvfp4_quantize_torch  # same bytes
        nb = self.layout.num_blocks
        chunk = max(1, (256 << 20) // (2 * NUM_KV_HEADS * BLOCK_SIZE * HEAD_SIZE * 2))  # blocks per chunk
        chunks = [(c0, min(nb, c0 + chunk)) for c0 in range(1, nb, chunk)]  # block 0 (null) stays zero
        if amax is None:
            amax = torch.stack([src[c0:c1].abs().amax(dim=(0, 2, 3, 4)) for c0, c1 in chunks]).amax(0)
        scales = tuple((amax[i].float() / (6.0 * 448.0)).reshape(1) for i in range(2))
        side_bytes = NUM_KV_HEADS * BLOCK_SIZE * nvfp4_full_dim(HEAD_SIZE)
        kv4 = torch.zeros(nb, 2, side_bytes, dtype=torch.uint8, device=self.device)
        pages = [Nvfp4Pages.view(kv4[:, i], NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, scales[i]) for i in range(2)]
        if src is not None:
            for c0, c1 in chunks:
                for i, pg in enumerate(pages):
                    packed, bscales = quantize(src[c0:c1, i].reshape(-1, HEAD_SIZE), pg.global_scale)
                    pg.data[c0:c1].copy_(packed.view(c1 - c0, NUM_KV_HEADS, BLOCK_SIZE, -1))
                    pg.scales.view(torch.uint8)[c0:c1].copy_(
                        bscales.view(torch.uint8).view(c1 - c0, NUM_KV_HEADS, BLOCK_SIZE, -1))
        self.kv = kv4  # the bf16 source is dropped: only ours runs on nvfp4
        self.key_cache, self.value_cache = pages
        self.nvfp4_global_scales = scales

    def upstream_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM 0.26 Triton/FLASH_ATTN layout (NHD): [nb, bs, Hkv, 2D]; K = [..., :D], V = [..., D:]."""
        if self.kv_nvfp4:
            raise RuntimeError(NVFP4_UNSUPPORTED)
        if self._upstream is None:
            nb = self.layout.num_blocks
            packed = torch.empty(nb, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE, dtype=self.kv_dtype, device=self.device)
            dst = packed.view(torch.uint8).view(nb, BLOCK_SIZE, NUM_KV_HEADS, 2, HEAD_SIZE * self.kv.element_size())
            src = self.kv.view(torch.uint8).view(nb, 2, NUM_KV_HEADS, BLOCK_SIZE, -1).permute(0, 3, 2, 1, 4)
            dst.copy_(src)
            self._upstream = (packed[..., :HEAD_SIZE], packed[..., HEAD_SIZE:])
        return self._upstream


# ---------------------------------------------------------------------------------------------
# providers: each returns (fn, out, info); fn() runs one layer call writing into out
# ---------------------------------------------------------------------------------------------


def _sm_count(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    from vllm_sm121 import platform as _platform

    return _platform.DEFAULT_SM_COUNT[_platform.INTERPRETER]


def make_sm121(inp: Inputs, args, *, q: torch.Tensor | None = None):
    from vllm_sm121.kernels import SplitWorkspace, choose_num_splits, paged_attention

    pt = inp.pt
    q = inp.q if q is None else q
    # As the SM121 backend's metadata builder: splits for max_seq_len (eager) or, under CUDA
    # graphs, for max_model_len (--sm121-split-seq-len).
    split_len = args.sm121_split_seq_len or inp.max_seq_len
    num_splits = choose_num_splits(
        num_seqs=pt.batch, num_kv_heads=NUM_KV_HEADS, max_query_len=inp.max_query_len,
        max_seq_len=split_len, num_q_per_kv=NUM_Q_HEADS // NUM_KV_HEADS, sm_count=_sm_count(inp.device),
        sliding_window=pt.window,
    )
    workspace = (
        SplitWorkspace.allocate(pt.num_tokens, NUM_Q_HEADS, num_splits, HEAD_SIZE, inp.device) if num_splits > 1 else None
    )
    out = torch.empty_like(q)
    kwargs = dict(
        max_query_len=inp.max_query_len, max_seq_len=inp.max_seq_len, scale=SCALE, sliding_window=pt.window,
        softcap=None, sinks=inp.sinks, k_scale=inp.k_scale_t if inp.kv_fp8 else None,
        v_scale=inp.v_scale_t if inp.kv_fp8 else None, out=out,
        num_splits=num_splits, workspace=workspace,
    )

    def fn():
        paged_attention(q, inp.key_cache, inp.value_cache, inp.block_table, inp.query_start_loc, inp.seq_lens, **kwargs)

    info = {"num_splits": num_splits, "split_seq_len": split_len, "query_dtype": str(q.dtype).replace("torch.", "")}
    return fn, out, info | _nvfp4_info(inp)


def _nvfp4_info(inp: Inputs) -> dict:
    if not inp.kv_nvfp4:
        return {}
    k, v = (float(g) for g in inp.nvfp4_global_scales)
    return {"nvfp4_global_scale_k": k, "nvfp4_global_scale_v": v}


def _triton_attn_constants() -> tuple[int, int]:
    try:
        from vllm.v1.attention.backends import triton_attn

        return triton_attn.MIN_LAUNCH_GRID_SIZE_2D, triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
    except Exception:  # noqa: BLE001 - fall back to the 0.26 values
        return _MIN_LAUNCH_GRID_SIZE_2D, _NUM_PAR_SOFTMAX_SEGMENTS


def unified_kwargs(inp: Inputs, args, out: torch.Tensor, segm: dict, kv_quant_mode) -> dict:
    """Keyword arguments for vllm.v1.attention.ops.triton_unified_attention.unified_attention."""
    pt = inp.pt
    key_cache, value_cache = inp.upstream_caches()
    fp8_q = inp.kv_fp8 and args.fp8_query
    descale_shape = (pt.batch, NUM_KV_HEADS)
    return dict(
        q=inp.q8 if fp8_q else inp.q,
        k=key_cache,
        v=value_cache,
        out=out,
        cu_seqlens_q=inp.query_start_loc,
        max_seqlen_q=inp.max_query_len,
        seqused_k=inp.seq_lens,
        max_seqlen_k=inp.max_seq_len,
        softmax_scale=SCALE,
        causal=True,
        window_size=(pt.window - 1, 0) if pt.window is not None else (-1, -1),
        block_table=inp.block_table,
        softcap=0,
        q_descale=inp.q_scale_t if fp8_q else None,
        k_descale=inp.k_scale_t.expand(descale_shape),
        v_descale=inp.v_scale_t.expand(descale_shape),
        seq_threshold_3D=segm["seq_threshold_3D"],
        num_par_softmax_segments=segm["num_par_softmax_segments"],
        softmax_segm_output=segm["softmax_segm_output"],
        softmax_segm_max=segm["softmax_segm_max"],
        softmax_segm_expsum=segm["softmax_segm_expsum"],
        sinks=inp.sinks,
        kv_quant_mode=kv_quant_mode,
    )


def make_triton_unified(inp: Inputs, args):
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import KVQuantMode

    pt = inp.pt
    min_grid, nseg = _triton_attn_constants()
    threshold = min_grid // NUM_KV_HEADS  # TritonAttentionMetadataBuilder.seq_threshold_3D (16 for 8 KV heads)
    pad = 1 << (HEAD_SIZE - 1).bit_length()
    f32 = dict(dtype=torch.float32, device=inp.device)
    segm = dict(
        seq_threshold_3D=threshold,
        num_par_softmax_segments=nseg,
        softmax_segm_output=torch.empty(threshold, NUM_Q_HEADS, nseg, pad, **f32),
        softmax_segm_max=torch.empty(threshold, NUM_Q_HEADS, nseg, **f32),
        softmax_segm_expsum=torch.empty(threshold, NUM_Q_HEADS, nseg, **f32),
    )
    out = torch.empty_like(inp.q)
    mode = KVQuantMode.FP8_PER_TENSOR if inp.kv_fp8 else KVQuantMode.NONE
    kwargs = unified_kwargs(inp, args, out, segm, mode)

    def fn():
        unified_attention(**kwargs)

    path = "3D" if (inp.max_query_len <= 1 and pt.batch <= threshold) else "2D"
    info = {"path": path, "seq_threshold_3D": threshold, "segments": nseg,
            "query_dtype": str(kwargs["q"].dtype).replace("torch.", "")}
    return fn, out, info


def fa3_kwargs(inp: Inputs, args, out: torch.Tensor, scheduler_metadata) -> dict:
    """Keyword arguments for vllm.vllm_flash_attn.flash_attn_varlen_func (fa_version=3)."""
    pt = inp.pt
    key_cache, value_cache = inp.upstream_caches()
    descale_shape = (pt.batch, NUM_KV_HEADS)
    fp8 = inp.kv_fp8
    return dict(
        q=inp.q8 if fp8 else inp.q,
        k=key_cache,
        v=value_cache,
        out=out,
        cu_seqlens_q=inp.query_start_loc,
        max_seqlen_q=inp.max_query_len,
        seqused_k=inp.seq_lens,
        max_seqlen_k=inp.max_seq_len,
        softmax_scale=SCALE,
        causal=True,
        alibi_slopes=None,
        window_size=[pt.window - 1, 0] if pt.window is not None else [-1, -1],
        block_table=inp.block_table,
        softcap=0,
        scheduler_metadata=scheduler_metadata,
        fa_version=3,
        q_descale=inp.q_scale_t.expand(descale_shape) if fp8 else None,
        k_descale=inp.k_scale_t.expand(descale_shape) if fp8 else None,
        v_descale=inp.v_scale_t.expand(descale_shape) if fp8 else None,
        num_splits=args.fa3_num_splits,
        s_aux=inp.sinks_bf16,
    )


def fa3_scheduler_kwargs(inp: Inputs, args) -> dict:
    """Keyword arguments for vllm.vllm_flash_attn.get_scheduler_metadata (as FlashAttentionMetadataBuilder)."""
    pt = inp.pt
    return dict(
        batch_size=pt.batch,
        max_seqlen_q=inp.max_query_len,
        max_seqlen_k=inp.max_seq_len,
        num_heads_q=NUM_Q_HEADS,
        num_heads_kv=NUM_KV_HEADS,
        headdim=HEAD_SIZE,
        cache_seqlens=inp.seq_lens,
        qkv_dtype=FP8 if inp.kv_fp8 else inp.act_dtype,
        cu_seqlens_q=inp.query_start_loc,
        page_size=BLOCK_SIZE,
        causal=True,
        window_size=(pt.window - 1, 0) if pt.window is not None else (-1, -1),
        num_splits=args.fa3_num_splits,
    )


def make_fa3(inp: Inputs, args):
    from vllm.vllm_flash_attn import (
        fa_version_unsupported_reason,
        flash_attn_varlen_func,
        get_scheduler_metadata,
        is_fa_version_supported,
    )

    if not is_fa_version_supported(3):
        raise RuntimeError(f"FA3 unavailable: {fa_version_unsupported_reason(3)}")
    out = torch.empty_like(inp.q)  # bf16 output also for an fp8 query, as in vLLM
    sched = get_scheduler_metadata(**fa3_scheduler_kwargs(inp, args)) if args.fa3_aot_schedule else None
    kwargs = fa3_kwargs(inp, args, out, sched)

    def fn():
        flash_attn_varlen_func(**kwargs)

    info = {"num_splits_arg": args.fa3_num_splits, "aot_schedule": bool(args.fa3_aot_schedule),
            "query_dtype": str(kwargs["q"].dtype).replace("torch.", "")}
    return fn, out, info


# ---- KV-cache write -------------------------------------------------------------------------


def _written_ours(inp: Inputs) -> torch.Tensor:
    s = inp.slot_mapping
    if inp.kv_nvfp4:
        return _written_nvfp4(inp.key_cache, inp.value_cache, s)
    return torch.stack([inp.kv[s // BLOCK_SIZE, 0, :, s % BLOCK_SIZE], inp.kv[s // BLOCK_SIZE, 1, :, s % BLOCK_SIZE]])


def _written_nvfp4(k_pages, v_pages, slots: torch.Tensor) -> torch.Tensor:
    """The written slots of nvfp4 pages, dequantized: fp32 [2, T, Hkv, D]."""
    from vllm_sm121.kernels.nvfp4 import nvfp4_dequantize_torch

    b, o = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    sides = []
    for pg in (k_pages, v_pages):
        data = pg.data[b, :, o].reshape(-1, HEAD_SIZE // 2)  # [T * Hkv, D/2]
        bscales = pg.scales.view(torch.uint8)[b, :, o].reshape(-1, HEAD_SIZE // 16).view(torch.float8_e4m3fn)
        sides.append(nvfp4_dequantize_torch(data, bscales, float(pg.global_scale)).view(-1, NUM_KV_HEADS, HEAD_SIZE))
    return torch.stack(sides)


def _written_nvfp4_torch(inp: Inputs) -> torch.Tensor:
    """What ``fp4_kv_write_torch`` writes (on the CPU) for the same key/value/slots, dequantized."""
    from vllm_sm121.kernels.fp4_kv import Nvfp4Pages, fp4_kv_write_torch

    kv4 = torch.zeros(inp.kv.shape, dtype=torch.uint8)
    pages = [Nvfp4Pages.view(kv4[:, i], NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, inp.nvfp4_global_scales[i].cpu())
             for i in range(2)]
    slots = inp.slot_mapping.cpu()
    fp4_kv_write_torch(inp.key.cpu(), inp.value.cpu(), *pages, slots)
    return _written_nvfp4(*pages, slots)


def _written_upstream(inp: Inputs) -> torch.Tensor:
    kc, vc = inp.upstream_caches()
    s = inp.slot_mapping
    return torch.stack([kc[s // BLOCK_SIZE, s % BLOCK_SIZE], vc[s // BLOCK_SIZE, s % BLOCK_SIZE]])


def write_upstream_args(inp: Inputs) -> tuple:
    kc, vc = inp.upstream_caches()
    return (inp.key, inp.value, kc, vc, inp.slot_mapping, "fp8" if inp.kv_fp8 else "auto", inp.k_scale_t, inp.v_scale_t)


def make_write_sm121(inp: Inputs, args):
    from vllm_sm121.kernels import write_kv_cache

    if inp.kv_nvfp4:
        from vllm_sm121.kernels.fp4_kv import fp4_kv_write

        def fn4():
            fp4_kv_write(inp.key, inp.value, inp.key_cache, inp.value_cache, inp.slot_mapping)

        return fn4, (lambda: _written_ours(inp)), {"op": "vllm_sm121.kernels.fp4_kv.fp4_kv_write"} | _nvfp4_info(inp)

    def fn():
        write_kv_cache(inp.key, inp.value, inp.key_cache, inp.value_cache, inp.slot_mapping,
                       k_scale=inp.k_scale_t if inp.kv_fp8 else None, v_scale=inp.v_scale_t if inp.kv_fp8 else None)

    return fn, (lambda: _written_ours(inp)), {"op": "vllm_sm121.kernels.write_kv_cache"}


def make_write_triton(inp: Inputs, args):
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

    a = write_upstream_args(inp)

    def fn():
        triton_reshape_and_cache_flash(*a)

    return fn, (lambda: _written_upstream(inp)), {"op": "triton_reshape_and_cache_flash (TRITON_ATTN backend)"}


def make_write_fa3(inp: Inputs, args):
    from vllm import _custom_ops as ops

    a = write_upstream_args(inp)

    def fn():
        ops.reshape_and_cache_flash(*a)

    return fn, (lambda: _written_upstream(inp)), {"op": "_custom_ops.reshape_and_cache_flash (FLASH_ATTN backend)"}


ATTN_MAKERS = {"sm121": make_sm121, "triton_unified": make_triton_unified, "fa3": make_fa3}
WRITE_MAKERS = {"sm121": make_write_sm121, "triton_unified": make_write_triton, "fa3": make_write_fa3}


# ---------------------------------------------------------------------------------------------
# upstream signature check (also the file:line report)
# ---------------------------------------------------------------------------------------------


def _vllm_file(rel: str) -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / rel


def _ast_params(path: Path, func: str) -> tuple[set[str], int] | None:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == func:
            a = node.args
            names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
            return names, node.lineno
    return None


UPSTREAM = {
    # name: (module, function, file relative to the vllm package)
    "unified_attention": ("vllm.v1.attention.ops.triton_unified_attention", "unified_attention",
                          "v1/attention/ops/triton_unified_attention.py"),
    "flash_attn_varlen_func": ("vllm.vllm_flash_attn.flash_attn_interface", "flash_attn_varlen_func",
                               "vllm_flash_attn/flash_attn_interface.py"),
    "get_scheduler_metadata": ("vllm.vllm_flash_attn.flash_attn_interface", "get_scheduler_metadata",
                               "vllm_flash_attn/flash_attn_interface.py"),
    "triton_reshape_and_cache_flash": ("vllm.v1.attention.ops.triton_reshape_and_cache_flash",
                                       "triton_reshape_and_cache_flash",
                                       "v1/attention/ops/triton_reshape_and_cache_flash.py"),
    "reshape_and_cache_flash": ("vllm._custom_ops", "reshape_and_cache_flash", "_custom_ops.py"),
}


def upstream_params(name: str) -> tuple[set[str] | None, str]:
    """Parameter names and 'file:line' of an upstream function (import, else parse its source)."""
    module, func, rel = UPSTREAM[name]
    path = _vllm_file(rel)
    try:
        mod = __import__(module, fromlist=[func])
        fobj = getattr(mod, func)
        params = set(inspect.signature(fobj).parameters)
        line = inspect.getsourcelines(fobj)[1]
        return params, f"{inspect.getsourcefile(fobj)}:{line}"
    except Exception:  # noqa: BLE001 - e.g. the FA .so cannot load without CUDA: read the source
        if path is None or not path.exists():
            return None, f"{rel}: not found"
        found = _ast_params(path, func)
        if found is None:
            return None, f"{path}: {func} not found"
        return found[0], f"{path}:{found[1]} (parsed)"


def check_kwargs(name: str, kwargs: dict | None = None, nargs: int | None = None) -> tuple[bool, str]:
    params, where = upstream_params(name)
    if params is None:
        return False, where
    if kwargs is not None:
        missing = sorted(set(kwargs) - params)
        if missing:
            return False, f"{where}: unknown kwargs {missing}"
    if nargs is not None and nargs > len(params):
        return False, f"{where}: {nargs} positional args for {len(params)} parameters"
    return True, where


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


class Timer:
    def __init__(self, device, reps: int):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.reps = reps
        if self.cuda:
            self.flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=self.device)
            self.cycles_per_us = self._calibrate_sleep()

    def _calibrate_sleep(self) -> float:
        torch.cuda._sleep(1000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 2_000_000
        s.record()
        torch.cuda._sleep(cycles)
        e.record()
        torch.cuda.synchronize()
        return cycles / max(s.elapsed_time(e) * 1000.0, 1e-3)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def host_us(self, fn: Callable[[], Any], n: int = 5) -> float:
        """Host-side cost of one call (launch overhead), median of n."""
        ts = []
        for _ in range(n):
            self.sync()
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        self.sync()
        return statistics.median(ts)

    def run(self, fn: Callable[[], Any], host_us: float) -> list[float]:
        if not self.cuda:  # dry run: wall clock, no flush
            ts = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
            return ts
        sleep_cycles = int(self.cycles_per_us * min(5000.0, max(50.0, 1.5 * host_us + 30.0)))
        events = []
        for _ in range(self.reps):
            self.flush.zero_()
            torch.cuda._sleep(sleep_cycles)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            events.append((s, e))
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) * 1000.0 for s, e in events]


def percentile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    if len(ys) == 1:
        return ys[0]
    k = (len(ys) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


def measure_copy_bandwidth(device, reps: int = 10) -> dict:
    dev = torch.device(device)
    nbytes = COPY_BYTES if dev.type == "cuda" else 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    ts = []
    for i in range(reps + 2):
        if dev.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src)
            e.record()
            e.synchronize()
            t = s.elapsed_time(e) / 1000.0
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            t = time.perf_counter() - t0
        if i >= 2:
            ts.append(t)
    del src, dst
    t = statistics.median(ts)
    return {"gbps": 2 * nbytes / t / 1e9, "bytes": nbytes, "median_s": t, "reps": reps,
            "method": "dst.copy_(src) device-to-device, (read + written bytes) / time, median"}


# ---------------------------------------------------------------------------------------------
# one point
# ---------------------------------------------------------------------------------------------


def _short_error(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip()
    msg = " ".join(msg.split())
    return msg if len(msg) <= 400 else msg[:397] + "..."


def _torch_ref_affordable(pt: Point, device) -> bool:
    if torch.device(device).type != "cuda":
        return True
    per_seq = pt.seq_len * NUM_Q_HEADS * HEAD_SIZE * 4 * 3 + NUM_Q_HEADS * pt.q_len * pt.seq_len * 4 * 4
    return per_seq <= (8 << 30) and pt.batch * pt.seq_len <= (1 << 19)


def memory_needed(pt: Point, kv_elem: float, upstream: bool) -> int:
    lay = layout_for(pt)
    kv = cache_bytes(lay.num_blocks, kv_elem)
    small = pt.num_tokens * NUM_Q_HEADS * HEAD_SIZE * 2 * 8 + (512 << 20)
    return kv * (2 if upstream else 1) + small


def run_point(pt: Point, args, timer: Timer, copy_gbps: float, device) -> list[dict]:
    nvfp4 = args.kv_dtype == "nvfp4"  # generated in the activation dtype, then quantized (Inputs._to_nvfp4)
    kv_dtype = FP8 if args.kv_dtype == "fp8" else args.act_dtype
    kv_elem = kv_bytes_per_elem(args.kv_dtype)
    providers = args.provider_list
    upstream = not nvfp4 and any(p != "sm121" for p in providers)  # nvfp4: upstream rows are not run
    base_config = {
        "phase": pt.kernel, "layer": pt.layer, "window": pt.window, "batch": pt.batch, "q_len": pt.q_len,
        "seq_len": pt.seq_len, "context_len": pt.seq_len - pt.q_len, "kv_dtype": args.kv_dtype,
        "act_dtype": str(args.act_dtype).replace("torch.", ""), "block_size": BLOCK_SIZE,
        "num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE, "scale": SCALE,
        "sinks": pt.kernel != "kv_cache_write", "reps": timer.reps,
    }
    is_write = pt.kernel == "kv_cache_write"
    nbytes = write_bytes(pt, kv_elem) if is_write else attention_bytes(pt, kv_elem)
    flops = None if (is_write or pt.kernel == "decode") else attention_flops(pt)
    kernel_name = "kv_cache_write" if is_write else f"paged_attention.{pt.kernel}"

    def record(provider: str) -> dict:
        return {"kernel": kernel_name, "provider": provider, "point": pt.label, "metric": "latency", "unit": "us",
                "p20": None, "p50": None, "p80": None, "bytes": nbytes, "gbps": None, "pct_bw": None,
                "tflops": None, "host_us": None, "max_abs_diff_vs_sm121": None, "max_abs_diff_vs_torch": None,
                "refcheck": None, "error": None, "config": dict(base_config)}

    records = {p: record(p) for p in providers}

    # memory
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # nvfp4: the generated bf16 cache and its nvfp4 form coexist while it is built
        need = memory_needed(pt, kv_elem + (2 if nvfp4 else 0), upstream)
        if need > free - (1 << 30):
            note = f"skipped: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
            for r in records.values():
                r["error"] = note
            return list(records.values())
    try:
        inp = Inputs(pt, kv_dtype=kv_dtype, act_dtype=args.act_dtype, device=device, seed=args.seed, nvfp4=nvfp4)
        if upstream:
            inp.upstream_caches()
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: note it, go on with the next point
        for r in records.values():
            r["error"] = f"skipped (building inputs failed): {_short_error(e)}"
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        return list(records.values())

    outputs: dict[str, torch.Tensor] = {}
    makers = WRITE_MAKERS if is_write else ATTN_MAKERS
    if DRY_RUN and is_write:
        providers = [p for p in providers if p == "sm121"]
        records = {p: r for p, r in records.items() if p in providers}
    for prov in providers:
        rec = records[prov]
        if nvfp4 and prov != "sm121":
            rec["error"] = NVFP4_UNSUPPORTED
            continue
        try:
            fn, out, info = makers[prov](inp, args)
            rec["config"].update(info)
            t0 = time.perf_counter()
            fn()  # first call: Triton JIT compile, and the output the refcheck uses
            timer.sync()
            first_us = (time.perf_counter() - t0) * 1e6
            if args.refcheck:
                outputs[prov] = out().float().cpu() if is_write else out.float().clone()
            if DRY_RUN:  # interpreter: one call is all we can afford; its wall time stands in
                host, ts = first_us, [first_us]
            else:
                fn()
                host = timer.host_us(fn)
                ts = timer.run(fn, host)
            p20, p50, p80 = percentile(ts, 0.2), percentile(ts, 0.5), percentile(ts, 0.8)
            gbps = nbytes / (p50 * 1e-6) / 1e9
            rec.update(p20=p20, p50=p50, p80=p80, host_us=host, gbps=gbps, pct_bw=100.0 * gbps / copy_gbps)
            if flops is not None:
                rec["tflops"] = flops / (p50 * 1e-6) / 1e12
        except Exception as e:  # noqa: BLE001 - record and go on with the next provider
            rec["error"] = _short_error(e)
            if args.verbose:
                import traceback

                traceback.print_exc()
        timer.sync()

    if args.refcheck:
        refcheck(pt, inp, args, outputs, records)
    del inp, outputs
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return list(records.values())


def refcheck(pt: Point, inp: Inputs, args, outputs: dict, records: dict) -> None:
    if pt.kernel == "kv_cache_write":
        base = outputs.get("sm121")
        for prov, out in outputs.items():
            r = records[prov]
            if base is not None:
                d = (out - base).abs().max().item()
                r["max_abs_diff_vs_sm121"] = d
                r["refcheck"] = "ok" if d == 0.0 or d <= args.tol else "MISMATCH"
        if inp.kv_nvfp4 and base is not None:  # no other provider: check ours against the torch writer
            r = records["sm121"]
            try:
                d = (_written_nvfp4_torch(inp) - base).abs().max().item()
                r["max_abs_diff_vs_torch"] = d
                if d > args.tol:
                    r["refcheck"] = "MISMATCH(ref)"
                r["config"]["refcheck_baseline"] = "fp4_kv_write_torch, written slots dequantized"
            except Exception as e:  # noqa: BLE001
                print(f"  note: torch reference failed: {_short_error(e)}")
        return
    fp8_q = {p: inp.kv_fp8 and (p == "fa3" or (p == "triton_unified" and args.fp8_query)) for p in outputs}
    ours = outputs.get("sm121")
    ours_deq = None
    if any(fp8_q.values()) and ours is not None:
        try:  # ours on the same (dequantized fp8) query the fp8-query providers saw
            fn, out, _ = make_sm121(inp, args, q=inp.q_deq)
            fn()
            ours_deq = out.float()
        except Exception as e:  # noqa: BLE001
            print(f"  note: ours on the dequantized query failed: {_short_error(e)}")
    # fp32 torch reference for ours, where affordable
    ref = None
    if _torch_ref_affordable(pt, inp.device) and ours is not None:
        try:
            from vllm_sm121.kernels import paged_attention_torch

            ref = paged_attention_torch(
                inp.q, inp.key_cache, inp.value_cache, inp.block_table, inp.query_start_loc, inp.seq_lens,
                scale=SCALE, sliding_window=pt.window, sinks=inp.sinks, k_scale=inp.k_scale, v_scale=inp.v_scale,
            ).float()
        except Exception as e:  # noqa: BLE001
            print(f"  note: torch reference failed: {_short_error(e)}")
    for prov, out in outputs.items():
        r = records[prov]
        if not torch.isfinite(out).all():
            r["refcheck"] = "NON-FINITE"
            continue
        base = ours_deq if fp8_q[prov] else ours
        tol = args.tol_fp8 if fp8_q[prov] else args.tol
        if base is not None:
            d = (out - base).abs().max().item()
            r["max_abs_diff_vs_sm121"] = d
            r["refcheck"] = "ok" if d <= tol else "MISMATCH"
            if DRY_RUN and fp8_q[prov] and d > tol:
                r["refcheck"] = INTERP_FP8  # the interpreter's fp32->fp8 cast and fp8 dot are inexact
            r["config"]["refcheck_tol"] = tol
            if fp8_q[prov]:
                r["config"]["refcheck_baseline"] = "sm121 on the dequantized fp8 query"
        if ref is not None and prov == "sm121":
            d = (out - ref).abs().max().item()
            r["max_abs_diff_vs_torch"] = d
            if d > args.tol:
                r["refcheck"] = "MISMATCH(ref)"
            if inp.kv_nvfp4:
                r["config"]["refcheck_baseline"] = "paged_attention_torch on the same Nvfp4Pages (kernel error only)"


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


_MISSING = {"error": None, "p50": None, "refcheck": None, "max_abs_diff_vs_sm121": None, "max_abs_diff_vs_torch": None}


def _fmt_cell(r: dict, prefill: bool) -> str:
    if r["error"]:
        if r["error"] == NVFP4_UNSUPPORTED:
            return "n/a"
        return "skip" if r["error"].startswith("skipped") else "ERR"
    if r["p50"] is None:
        return "-"
    extra = f"{r['tflops']:.0f}TF" if prefill and r["tflops"] is not None else f"{r['pct_bw']:.0f}%"
    flag = "" if r["refcheck"] in OK_STATUSES else "!"
    return f"{r['p50']:.1f} ({extra}){flag}"


def print_table(points: list[Point], by_point: list[list[dict]], providers: list[str], copy_gbps: float) -> None:
    w = max([len(pt.label) for pt in points] + [5])
    others = [p for p in providers if p != "sm121"]
    head = f"{'point':<{w}} " + " ".join(f"{p + ' µs':>20}" for p in providers) + f" {'best':>15} {'ours/best':>9}"
    head += "".join(f" {'Δ' + p[:8]:>9}" for p in others) + f" {'Δref':>9}"
    print()
    print(f"µs per layer call, median of the reps; (x%) = achieved GB/s over the copy bandwidth "
          f"({copy_gbps:.0f} GB/s); prefill: (TFLOP/s); ! = refcheck failed")
    print("ours/best = best other provider's µs / ours (> 1: ours faster); Δx = max |x - ours|; "
          "Δref = max |ours - fp32 torch reference|")
    print(head)
    print("-" * len(head))
    errors = []
    for pt, recs in zip(points, by_point):
        r = {x["provider"]: x for x in recs}
        g = {p: r.get(p, _MISSING) for p in providers}
        prefill = pt.kernel in ("prefill", "chunked_prefill")
        cells = " ".join(f"{_fmt_cell(g[p], prefill):>20}" for p in providers)
        ok = {p: g[p]["p50"] for p in providers if g[p]["p50"] is not None}
        best = min(ok, key=ok.get) if ok else "-"
        other_times = [v for p, v in ok.items() if p != "sm121"]
        ratio = f"{min(other_times) / ok['sm121']:.2f}x" if "sm121" in ok and other_times else "-"

        def num(x):
            return f" {x:>9.1e}" if x is not None else f" {'-':>9}"

        diffs = "".join(num(g[p]["max_abs_diff_vs_sm121"]) for p in others)
        print(f"{pt.label:<{w}} {cells} {best:>15} {ratio:>9}{diffs}{num(g.get('sm121', _MISSING)['max_abs_diff_vs_torch'])}")
        for p in providers:
            if p not in r:
                continue
            if g[p]["error"]:
                errors.append(f"{pt.label} [{p}]: {g[p]['error']}")
            elif g[p]["refcheck"] not in OK_STATUSES:
                errors.append(f"{pt.label} [{p}]: refcheck {g[p]['refcheck']} "
                              f"(Δ={g[p]['max_abs_diff_vs_sm121']}, Δref={g[p]['max_abs_diff_vs_torch']})")
    if errors:
        print("\nErrors / skips / refcheck failures:")
        for e in errors:
            print("  " + e)


def git_info() -> dict:
    info: dict[str, Any] = {"commit": os.environ.get("VLLM_SM121_COMMIT"), "dirty": None}
    if info["commit"]:  # the GPU machine receives the tree without .git: the caller passes it
        return info
    try:
        info["commit"] = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                                        text=True, timeout=10, check=True).stdout.strip() or None
        st = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=10, check=True).stdout
        info["dirty"] = bool(st.strip())
    except Exception as e:  # noqa: BLE001
        info["error"] = _short_error(e)
    return info


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except Exception:  # noqa: BLE001
        return None


def header(args, device, copy: dict) -> dict:
    import triton

    h: dict[str, Any] = {
        "benchmark": "attention",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "argv": sys.argv[1:],
        "dry_run": DRY_RUN,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": getattr(triton, "__version__", None),
        "vllm": _version("vllm"),
        "vllm_sm121": _version("vllm-sm121"),
        "git": git_info(),
        "copy_bandwidth_gbps": copy["gbps"],
        "copy_bandwidth": copy,
        "shapes": {"num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE,
                   "block_size": BLOCK_SIZE, "window": args.window, "scale": SCALE},
        "kv_dtype": args.kv_dtype,
        "fp8_query_for_upstream": bool(args.fp8_query),
        "providers": args.provider_list,
        "timing": {"reps": args.reps, "l2_flush_bytes": FLUSH_BYTES, "stat": "p20/p50/p80 of CUDA-event times"},
        "upstream": {name: upstream_params(name)[1] for name in UPSTREAM},
    }
    h["git_commit"] = h["git"]["commit"]
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        h.update(device=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                 total_memory_gib=p.total_memory / 2**30, l2_cache_bytes=getattr(p, "L2_cache_size", None))
    else:
        h.update(device="cpu (dry run, Triton interpreter)", capability=None, sm_count=None)
    return h


# ---------------------------------------------------------------------------------------------
# dry run: API checks on the CPU
# ---------------------------------------------------------------------------------------------


def dry_run_checks(args) -> list[str]:
    """Check every upstream call's kwargs against its signature (FA3 cannot run without CUDA)."""
    problems = []
    dev = "cpu"
    pt = Point("decode", 2, 1, 40, "sliding", 32)
    inp = Inputs(pt, kv_dtype=FP8 if args.kv_dtype == "fp8" else args.act_dtype, act_dtype=args.act_dtype,
                 device=dev, seed=0)
    out = torch.empty_like(inp.q)
    segm = dict(seq_threshold_3D=16, num_par_softmax_segments=16, softmax_segm_output=None,
                softmax_segm_max=None, softmax_segm_expsum=None)
    checks = [
        ("unified_attention", unified_kwargs(inp, args, out, segm, 0), None),
        ("flash_attn_varlen_func", fa3_kwargs(inp, args, out, None), None),
        ("get_scheduler_metadata", fa3_scheduler_kwargs(inp, args), None),
    ]
    wpt = Point("kv_cache_write", 3, 1, 1, "-")
    winp = Inputs(wpt, kv_dtype=inp.kv_dtype, act_dtype=args.act_dtype, device=dev, seed=0)
    nargs = len(write_upstream_args(winp))
    checks += [("triton_reshape_and_cache_flash", None, nargs), ("reshape_and_cache_flash", None, nargs)]
    print("Upstream signature checks (kwargs we pass vs the installed vLLM):")
    for name, kw, n in checks:
        ok, where = check_kwargs(name, kw, n)
        print(f"  {'ok ' if ok else 'BAD'} {name:<32} {where}")
        if not ok:
            problems.append(f"{name}: {where}")
    return problems


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="benchmarks/attention.py",
        description="Paged attention, gpt-oss shapes: sm121 (ours) vs vLLM 0.26 triton unified_attention and FA3.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Method (data, calls, timing, bytes): see the docstring at the top of benchmarks/attention.py.",
    )
    ap.add_argument("--quick", action="store_true", help="fewer points (ctx 8k,128k; batch 1,32; 2 prefill) and 15 reps")
    ap.add_argument("--ctx", type=_parse_list, default=None,
                    help="decode seq lengths, e.g. 2k,8k,32k,128k (default; --quick: 8k,128k)")
    ap.add_argument("--batch", type=_parse_list, default=None,
                    help="decode (and cache-write) batch sizes, e.g. 1,8,32 (default; --quick: 1,32)")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8", "nvfp4"), default="bf16",
                    help="KV-cache dtype (default bf16); nvfp4: ours only, upstream rows recorded as not supported")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per provider and point (default 50; --quick 15)")
    ap.add_argument("--out", default=None, help="JSON output (default results/attention.json; --dry-run: "
                                                  "results/attention_dryrun.json)")
    ap.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma list from {','.join(PROVIDERS)}")
    ap.add_argument("--kinds", default="decode,prefill,write", help="point kinds: decode,prefill,write")
    ap.add_argument("--layers", default="full,sliding", help="layer kinds: full,sliding")
    ap.add_argument("--window", type=int, default=None,
                    help=f"sliding window of the sliding layers (default {WINDOW}; --dry-run: 32)")
    ap.add_argument("--refcheck", action=argparse.BooleanOptionalAction, default=True,
                    help="compare every provider's output with ours (default on)")
    ap.add_argument("--tol", type=float, default=2e-2, help="refcheck max |diff| tolerance (default 2e-2)")
    ap.add_argument("--tol-fp8", type=float, default=1e-1,
                    help="tolerance for fp8-query providers (they also round P to fp8; default 0.1)")
    ap.add_argument("--fp8-query", action=argparse.BooleanOptionalAction, default=True,
                    help="with --kv-dtype fp8, give triton_unified an fp8 query as vLLM 0.26 does on CUDA "
                         "(FA3 always gets one: it needs q dtype == KV dtype)")
    ap.add_argument("--fa3-num-splits", type=int, default=0,
                    help="FA3 num_splits (0 = FA3 heuristic, default; vLLM passes 32 under full CUDA graphs)")
    ap.add_argument("--fa3-aot-schedule", action="store_true",
                    help="precompute FA3 scheduler_metadata (vLLM does not for gpt-oss: two window sizes)")
    ap.add_argument("--sm121-split-seq-len", type=_parse_size, default=None,
                    help="choose our split-KV count for this length instead of the point's seq_len, as the "
                         "SM121 backend does under CUDA graphs (its max_model_len), e.g. 128k")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of provider errors")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU only, Triton interpreter, tiny fp16 points: checks layouts/conventions of ours and "
                         "triton_unified numerically and the kwargs of every upstream call; times nothing real")
    args = ap.parse_args(argv)
    args.provider_list = [p for p in args.providers.split(",") if p]
    bad = [p for p in args.provider_list if p not in PROVIDERS]
    if bad or not args.provider_list:
        ap.error(f"--providers: unknown {bad}; choose from {','.join(PROVIDERS)}")
    for name in args.layers.split(","):
        if name and name not in ("full", "sliding"):
            ap.error(f"--layers: unknown {name!r}; choose from full,sliding")
    for name in args.kinds.split(","):
        if name and name not in ("decode", "prefill", "write"):
            ap.error(f"--kinds: unknown {name!r}; choose from decode,prefill,write")
    if args.window is None:
        args.window = 32 if args.dry_run else WINDOW
    if args.window < 1:
        ap.error("--window must be >= 1")
    if args.reps is None:
        args.reps = 1 if args.dry_run else (15 if args.quick else 50)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if args.out is None:
        args.out = "results/attention_dryrun.json" if args.dry_run else "results/attention.json"
    # Dry run: fp16, because the interpreter's bf16 tl.dot is wrong in vLLM's kernel (ours casts).
    args.act_dtype = torch.float16 if args.dry_run else torch.bfloat16
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else f"cuda:{torch.cuda.current_device()}"
    t_start = time.perf_counter()

    problems: list[str] = []
    if args.dry_run:
        problems = dry_run_checks(args)
        print("Dry run: fa3 and the upstream cache writes are signature-checked only (CUDA-only code).")
        args.provider_list = [p for p in args.provider_list if p != "fa3"] or ["sm121"]

    copy = measure_copy_bandwidth(device)
    timer = Timer(device, args.reps)
    hdr = header(args, device, copy)
    print(f"device: {hdr['device']} (capability {hdr['capability']}), torch {hdr['torch']}, triton {hdr['triton']}, "
          f"vllm {hdr['vllm']}, commit {hdr['git_commit']}")
    print(f"copy bandwidth: {copy['gbps']:.0f} GB/s; kv dtype {args.kv_dtype}; reps {args.reps}; "
          f"providers {','.join(args.provider_list)}")

    points = build_points(args)
    by_point: list[list[dict]] = []
    for i, pt in enumerate(points):
        t0 = time.perf_counter()
        recs = run_point(pt, args, timer, copy["gbps"], device)
        by_point.append(recs)
        brief = "  ".join(
            f"{r['provider']}={r['p50']:.1f}µs" if r["p50"] is not None
            else f"{r['provider']}={'n/a' if r['error'] == NVFP4_UNSUPPORTED else 'ERR'}" for r in recs
        )
        print(f"[{i + 1}/{len(points)}] {pt.label}: {brief}  ({time.perf_counter() - t0:.1f}s)", flush=True)

    print_table(points, by_point, args.provider_list, copy["gbps"])
    hdr["elapsed_s"] = time.perf_counter() - t_start
    result = {"header": hdr, "records": [r for recs in by_point for r in recs]}
    out = Path(args.out)
    if not out.is_absolute():
        out = Path.cwd() / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out} ({len(result['records'])} records) in {hdr['elapsed_s']:.0f}s")
    if args.dry_run:
        bad = [r for r in result["records"]
               if (r["error"] and r["error"] != NVFP4_UNSUPPORTED) or r["refcheck"] not in OK_STATUSES]
        if problems or bad:
            print(f"dry run: {len(problems)} signature problem(s), {len(bad)} failing record(s)")
            return 1
        print("dry run: all signature checks and CPU refchecks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
