"""End-to-end gpt-oss benchmark, llama-bench style: upstream vLLM 0.26 at its best vs the
SM121 plugin with each of its switches, one card, one run, dummy weights, token-id prompts.

Usage (needs a CUDA GPU with vLLM 0.26.0; without one it says so and exits 2)::

    python benchmarks/e2e.py --quick                        # 20b, pp2048 + tg128 b1/b8, ~6-8 min
    python benchmarks/e2e.py --model <dir>/gpt-oss-120b      # full: all points, defaults
    python benchmarks/e2e.py --model gpt-oss-20b --configs sm121,upstream-triton --iters 5
    python benchmarks/e2e.py --merge a.json b.json --out all.json   # one table from split runs
    python benchmarks/e2e.py --dry-run --model gpt-oss-20b  # no GPU: plan, LLM kwargs, bytes
    python benchmarks/e2e.py --model <dir>/gpt-oss-120b --tensor-parallel-size 2 [--enable-expert-parallel]

    On the GPU machine: ``bash scripts/gpu_session.sh <part-dir> e2equick`` (or ``e2e120b``,
    ``e2e20b``; ``e2etp``: 120b at ``--tensor-parallel-size ${E2E_TP:-2}``); ``E2E_CONFIGS=a,b``
    picks configurations and ``E2E_TAG`` suffixes the output names, so a run longer than one call
    is split over calls and joined with ``--merge``.
    Set ``VLLM_SM121_COMMIT`` where the tree has no .git.

Models
    ``--model`` (repeatable): a shipped config name (``gpt-oss-20b``, ``gpt-oss-tiny`` under
    models/) or any gpt-oss config directory (the 120b config: ../shared/models/gpt-oss-120b
    here, .bundle/part2/models/gpt-oss-120b on the GPU machine). Default: gpt-oss-20b.
    Weights are vLLM's ``load_format="dummy"``; no tokenizer (``skip_tokenizer_init``).

Configurations (``CONFIGS`` below; ``--configs a,b``; a new plugin switch is one more line)
    Each configuration runs in a fresh Python process (vLLM engines do not give all GPU
    memory back); results come back through a JSON file; a configuration whose engine fails
    to start is recorded with its error and the run goes on. The exact LLM(...) kwargs of
    each are printed and stored. ``--llm-kwargs JSON`` is merged into every configuration
    (dicts merged recursively; ``null`` deletes a key).

Tensor / expert parallelism (``--tensor-parallel-size N``, ``--enable-expert-parallel``)
    Apply to every configuration (upstream and plugin alike: the comparison stays same machine,
    same settings): ``tensor_parallel_size=N`` / ``enable_expert_parallel=True`` go into the base
    LLM kwargs (N = 1 adds nothing: vLLM's default). N > 1: the child's environment gets
    ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unless the caller set it (forked workers break once
    the child process has initialized CUDA; spawned ones do not care), and a child with fewer than N
    GPUs refuses before loading anything. Bytes per token are then stated per GPU (total / N:
    TP shards qkv / o by heads, lm_head by vocab rows, each expert's intermediate dimension, the
    KV by heads; EP spreads whole experts, the same 1/N in expectation; the replicated router and
    norms are < 1% of it), % BW is against one GPU's copy bandwidth (all N read at once), and
    the GB10 projection is for N GB10s ("2x GB10": 273 GB/s x efficiency / per-GPU bytes).

Points (``POINTS`` below; ``--points a,b``)
    pp2048      batch-1 prefill: 2048 / t(2048-token prompt, max_tokens=1) tok/s (includes the
                ~10 ms per-request overhead, as the upstream baseline does).
    tg128       decode after a 16-token prompt, batch 1 / 8 / 32 (tg128-b8, tg128-b32):
                ms/step = (t(max_tokens=128) - t(max_tokens=1)) / 127 on the same prompts,
                tok/s = batch / ms/step (prefill and request overhead cancel out).
    tg128@32k   the same at batch 1 after a 32768-token prompt (needs max_model_len >= 32896:
                the plan sets it; a smaller one given with --llm-kwargs skips the point, noted).
    tg128-b8@32k, tg128-b16@32k
                the same at batch 8 / 16 (opt-in: not in the default points); a point whose
                batch x length exceeds the KV capacity vLLM reports is flagged suspect (preemption).
                With chunked prefill, early requests decode while later ones still prefill, so
                the estimate also carries those mixed steps, unless --cached-prompts.
    --cached-prompts
                vLLM's prefix caching on (every configuration): each decode point's prompts are
                prefilled once, untimed ("prime_s": the cold t(1)), and every later run finds
                them cached (it recomputes only the last partial block), so all requests decode
                together from the first step and each run skips the long prefill. Prefill points
                get fresh prompts on every run (no cache hits). Off by default (earlier results
                were measured without it; caching adds block hashing to the host's step).
    --random-router
                after the engine starts, every MoE layer's router weight is refilled with
                N(0, ROUTER_STD^2) values (seeded per layer, the same in every configuration and
                on every TP rank) and the biases that add the same vector to every token's
                residual are zeroed: the routers', o_proj's and the experts' (``randomize_routers``).
                With dummy weights the router bias (+-1e-3) outweighs W.y (the norm's dummy weight
                makes y ~1e-3), so every token routes to the same 4 experts. Refilling the router
                alone is not enough (stop 40, H200: upstream's batch-32 step stayed at 4.9 ms,
                the batch-1 step plus little): each layer's o_proj and expert biases add one
                token-independent vector to the residual, which after a few layers outweighs the
                embedding (the only token-dependent part with dummy weights), and the deeper
                layers' routers again pick one top-4 set. With those biases zeroed the residual
                stays ~the token's embedding and routing follows the tokens, as real weights'
                routing does (~28 distinct experts per layer at batch 8, ~81 at 32 with uniform
                routing). Off by default (earlier results were measured without it).
    Every point: --warmup untimed runs of each timed shape (Triton JIT, autotuning), then
    --iters timed repetitions (t(1) and t(128) interleaved per repetition); decode ms/step =
    (min t(128) - min t(1)) / 127 (host stalls of 1-3 s hit random iterations on H100, upstream
    and plugin alike, and only ever add time), with the min-max spread of the per-repetition
    differences; it is confirmed when two repetitions' own differences lie within 5% of it, and
    up to --extra-iters more pairs (default 4) run until then; an unconfirmed point is flagged
    "suspect" ("!" in the table). Prefill: median. Greedy, ignore_eos, prefix caching
    off, fixed random token ids per point. ``--quick``: 20b, pp2048 / tg128 / tg128-b8,
    ``compilation_config={"max_cudagraph_capture_size": 8}``, 1 warm-up, 3 iters (functional
    numbers); the full run keeps vLLM's default compilation config (numbers to report).

Bytes per decoded token (``decode_bytes``; from the model's config.json)
    weights read per step: qkv / o projections (bf16; fp8 or mxfp4 with the plugin's
    dense_weights switch) with their biases and the fp32 sinks; router bf16; the experts
    touched, MXFP4 = 4.25 bits/param (e2m1 + one e8m0 scale per 32) plus their fp32 biases (as
    vLLM's MXFP4 MoE holds them) -- at batch B the expected number of distinct experts per layer
    E * (1 - (1 - k/E)^B); norms; lm_head (same format as the dense projections); one embedding
    row per sequence. KV read at the mean context of the timed decode steps (prompt + 64):
    sliding-window layers min(ctx, window) tokens, full layers ctx; bytes per element bf16 2,
    fp8 1, nvfp4 0.5625 (e2m1 + an e4m3 scale per 16). Per decoded token = per step / batch.
    gpt-oss-120b at batch 1, short context: 1.94 GB attention projections + router, 1.91 GB
    experts, 1.16 GB lm_head = 5.0 GB (the 1.9 + 1.9 + 1.2 GB of the design notes).

Bandwidth and the GB10 projection
    The card's copy bandwidth is measured in the same run (its own process, before the
    configurations: device-to-device copy of 1 GiB, (read + written bytes) / time, median of 10).
    % BW = (bytes per step / measured step time) / copy bandwidth. GB10 projection =
    273 GB/s x that efficiency / bytes per token, i.e. assuming the same fraction of copy
    bandwidth on GB10 (where batch-1 decode is far more bandwidth-bound than on H100/H200, so
    the projection is a floor). Printed beside the published GB10 figures for gpt-oss-120b:
    llama.cpp tg32 57.8-59.0 and pp2048 ~2,450 tok/s; vLLM in eager mode 29-31 tok/s.

Output
    A table per model (config x point: tok/s, ms/step with spread, GB/token, % BW, GB10
    projection, ratio to the best upstream configuration), JSON (--out; header with device,
    capability, versions, git commit (VLLM_SM121_COMMIT or git rev-parse), copy bandwidth; per
    configuration the exact LLM kwargs, the engine's resolved settings, the backend lines of its
    log, per-point raw samples) and a PNG next to it when matplotlib is importable. Each
    configuration's full log goes to <out>.logs/.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import datetime
import gc
import importlib.metadata
import inspect
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_MODELS_DIR = REPO_ROOT / "models"
SHIPPED_MODELS = ("gpt-oss-20b", "gpt-oss-tiny")
DEFAULT_MODEL = "gpt-oss-20b"

GB10_BANDWIDTH_GBPS = 273.0
# Published GB10 (DGX Spark) figures for gpt-oss-120b, quoted beside the projection.
PUBLISHED_GB10 = {
    "gpt-oss-120b": {
        "pp2048": "llama.cpp pp2048 ~2,450",
        "tg128": "llama.cpp tg32 57.8-59.0; vLLM eager 29-31",
    }
}

CHILD_FLAG = "--_child"
LOG_PREFIX = "[e2e]"
COPY_BYTES = 1 << 30
SHORT_PROMPT = 16
GEN = 128
LONG_PROMPT = 32768


# ---------------------------------------------------------------------------------------------
# configurations and points: data tables
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    llm_kwargs: dict[str, Any]  # merged over the base kwargs (see llm_kwargs_for)
    note: str
    upstream: bool = False  # a baseline: "vs up" divides by the best of these
    default: bool = True  # in the default --configs
    env: tuple[tuple[str, str], ...] = ()  # environment of its process (engine core included)


SM121 = {"attention_backend": "SM121"}
UP, OFF = {"upstream": True}, {"default": False}


def _all_on() -> dict:
    """SM121 + NVFP4 KV + FP8 dense + whole-model graph mode: a fresh dict per configuration
    (vLLM records choices into additional_config)."""
    return {**SM121, "kv_cache_dtype": "nvfp4",
            "additional_config": {"sm121": {"dense_weights": "fp8", "cudagraph": "whole_model"}}}


MOE_ON = ("VLLM_SM121_MOE_EXPERIMENTAL", "1")
# fmt: off
CONFIGS: tuple[Config, ...] = (
    Config("upstream-default", {}, "stock vLLM selection (FLASH_ATTN = FA3 on sm_90)", **UP),
    Config("upstream-triton", {"attention_backend": "TRITON_ATTN"}, "stock TRITON_ATTN", **UP),
    Config("sm121", {**SM121}, "plugin, its defaults (bf16 KV)"),
    Config("sm121-fp8kv", {**SM121, "kv_cache_dtype": "fp8"}, "SM121, fp8-e4m3 KV cache"),
    Config("sm121-nvfp4kv", {**SM121, "kv_cache_dtype": "nvfp4"}, "SM121, NVFP4 KV cache"),
    # Plugin switches of design.md's table go through additional_config: one line each.
    Config("sm121-upstream-moe", {**SM121, "additional_config": {"sm121": {"moe": "upstream"}}},
           "SM121 attention with vLLM's own MoE (isolates the backend)", **OFF),
    Config("sm121-fp8dense", {**SM121, "additional_config": {"sm121": {"dense_weights": "fp8"}}},
           "SM121, FP8 (e4m3, per-output-channel) qkv/o/lm_head weights"),
    # Off by default: batches of >= 5 tokens through vLLM's W8A8 GEMM (kernels/dense.py, opt-in).
    Config("sm121-fp8dense-w8a8", {**SM121, "additional_config": {"sm121": {"dense_weights": "fp8"}}},
           "SM121 + FP8 dense, M >= 5 via vLLM's cutlass W8A8 GEMM", **OFF,
           env=(("VLLM_SM121_DENSE_W8A8_MIN_M", "5"),)),
    # Off by default: the plugin's MoE is gated off (vllm_sm121.moe.READY) and this opts in.
    Config("sm121-moe", {**SM121}, "SM121 + the plugin's MXFP4 x MXFP8 MoE (experimental opt-in)", **OFF,
           env=(MOE_ON,)),
    Config("sm121-fp8dense-moe", {**SM121, "additional_config": {"sm121": {"dense_weights": "fp8"}}},
           "SM121 + FP8 dense weights + the plugin's MoE (experimental opt-in)", **OFF,
           env=(MOE_ON,)),
    # Off by default: issue 7's whole-model graph mode, stage A (lm_head + greedy sampling in the
    # graph) + B (steady decode steps skip stock's input preparation); "-a": stage A alone.
    Config("sm121-graph", {**SM121, "additional_config": {"sm121": {"cudagraph": "whole_model"}}},
           "SM121, whole-model graph mode (in-graph lm_head + greedy sampling; steady steps on device inputs)", **OFF),
    Config("sm121-graph-a", {**SM121, "additional_config": {"sm121": {"cudagraph": "whole_model"}}},
           "SM121, whole-model graph mode stage A only (every step through stock's input preparation)", **OFF,
           env=(("VLLM_SM121_GRAPH_FAST_PATH", "0"),)),
    Config("sm121-graph-sample", {**SM121, "additional_config": {"sm121": {"cudagraph": "whole_model"}}},
           "SM121, whole-model graph mode + in-graph temperature sampling (opt-in)", **OFF,
           env=(("VLLM_SM121_GRAPH_SAMPLE", "1"),)),
    Config("sm121-all", _all_on(),
           "SM121 + NVFP4 KV + FP8 dense + whole-model graph mode, stages A + B (the MoE stays vLLM's)", **OFF),
    Config("sm121-all-moe", _all_on(),
           "sm121-all + the plugin's MXFP4 x MXFP8 MoE (experimental opt-in)", **OFF,
           env=(MOE_ON,)),
    Config("sm121-all-moe-pdl", _all_on(),
           "sm121-all-moe + the MoE's FC1 -> FC2 -> combine as programmatic dependent launches (opt-in)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_MOE_PDL", "1"))),
    Config("sm121-all-moe-tma", _all_on(),
           "sm121-all-moe + the MoE GEMVs' weight tiles through a 4-stage TMA pipeline (opt-in, sm_90)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_MOE_FMA_TILES", "64,256,32,256,4,4"))),
    Config("sm121-all-moe-fused", _all_on(),
           "sm121-all-moe + routing inside FC1 and the combine inside FC2 for every decode batch of <= 4 tokens "
           "(the default fuses them at one token only)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_MOE_FUSED_ROUTE", "1"),
                ("VLLM_SM121_MOE_FUSED_COMBINE", "1"))),
    Config("sm121-all-moe-f16x2", _all_on(),
           "sm121-all-moe-fused with the packed fp16 products pinned on (their default on a GPU)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_MOE_FUSED_ROUTE", "1"),
                ("VLLM_SM121_MOE_FUSED_COMBINE", "1"), ("VLLM_SM121_MOE_FMA_F16X2", "1"))),
    Config("sm121-all-moe-rope", _all_on(),
           "sm121-all-moe with gpt-oss's rotary embedding inside the FP8 qkv GEMV's epilogue pinned on (the "
           "default since stop 27)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_ROPE_IN_QKV", "1"))),
    # Opt-in (stop 27; GPU-tested in stop 28, no gain measured): the qkv GEMV also writes the nvfp4 KV cache.
    Config("sm121-all-moe-kvqkv", _all_on(),
           "sm121-all-moe + the k / v heads written to the nvfp4 KV cache by the qkv GEMV (opt-in)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_KV_IN_QKV", "1"))),
    # Opt-in (stop 43; interpreter- and AOT-tested, not yet run on a GPU): a decode step's nvfp4 KV write inside the
    # attention kernel (one launch per layer fewer than the default's write kernel; compatible with the carried norm)
    Config("sm121-all-moe-kvattn", _all_on(),
           "sm121-all-moe + decode steps' nvfp4 KV write inside the attention kernel (opt-in)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_KV_IN_ATTN", "1"))),
    Config("sm121-all-moe-minsplit", _all_on(),
           "sm121-all-moe with live attention splits of >= $E2E_MIN_SPLIT_TOKENS (default 128) KV tokens",
           **OFF, env=(MOE_ON, ("VLLM_SM121_ATTN_MIN_SPLIT_TOKENS", os.environ.get("E2E_MIN_SPLIT_TOKENS", "128")))),
    # L2 prefetch of the next GEMV's weights (kernels/l2_prefetch.py): the attention prefetches o_proj;
    # "-l2": the targets in $E2E_L2_PREFETCH (default: o, the next qkv by FC2 and FC2's rows by FC1, late)
    Config("sm121-all-moe-l2o", _all_on(),
           "sm121-all-moe + the attention kernel prefetching o_proj's weight into L2", **OFF,
           env=(MOE_ON, ("VLLM_SM121_L2_PREFETCH", "o"))),
    # The tensor-core decode GEMV for the FP8 dense layers (kernels/dense_details/_dense_mmav.py) at
    # M <= $E2E_MMAV_MAX_M (default 16) tokens, one token included (the FMA GEMV off)
    Config("sm121-all-moe-mmav", _all_on(),
           "sm121-all-moe + the tensor-core dense GEMV (qkv, o, lm_head) at every M <= 16, the FMA GEMV off", **OFF,
           env=(MOE_ON, ("VLLM_SM121_DENSE_MMAV_MAX_M", os.environ.get("E2E_MMAV_MAX_M", "16")),
                ("VLLM_SM121_DENSE_FMA_MAX_M", "0"))),
    # Prefill-sized chunks (>= 64 tokens) of the FP8 dense layers through vLLM's W8A8 GEMM (per-token e4m3
    # activations): the MMA kernel there is 2-3x slower than cuBLAS bf16 (issue 8's prefill item); decode
    # batches keep the W8A16 paths. For pp2048 / b32 A/B runs with its drift (`w8a8drift`) next to them
    Config("sm121-all-moe-w8a8pf", _all_on(),
           "sm121-all-moe + vLLM's W8A8 GEMM for the dense layers' chunks of >= 64 tokens", **OFF,
           env=(MOE_ON, ("VLLM_SM121_DENSE_W8A8_MIN_M", "64"))),
    # Stop 40's default on sm_90 (the tensor-core GEMV at 3-16 tokens, lm_head 2-16) off: the FMA GEMV for
    # 1-2 tokens (lm_head 1) as in the default, the MMA kernel above (stop 39 had FMA up to 4 on qkv / o:
    # one environment limit cannot give both, and the A/B here is the tensor-core GEMV's)
    Config("sm121-all-moe-nommav", _all_on(),
           "sm121-all-moe with the dense layers' 3-32-token batches on the MMA kernel instead of the tensor-core GEMV",
           **OFF, env=(MOE_ON, ("VLLM_SM121_DENSE_MMAV_MAX_M", "0"))),
    # Every plugin kernel of the decode step launched as a programmatic dependent ($VLLM_SM121_PDL)
    Config("sm121-all-moe-steppdl", _all_on(),
           "sm121-all-moe + the decode step's plugin kernels launched with PDL (weights before the wait)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_PDL", "1"))),
    # A/B of stop 31's attention change: a query tile with one live split finishes its rows itself
    # (default); "-merge1": through the in-kernel merge as before
    Config("sm121-all-moe-merge1", _all_on(),
           "sm121-all-moe with the attention's single live split merged as before stop 31", **OFF,
           env=(MOE_ON, ("VLLM_SM121_ATTN_ONE_SPLIT_FINISH", "0"))),
    # The opt-ins that each measured within the noise, together: PDL through the step and the KV
    # write inside the qkv GEMV
    Config("sm121-all-moe-pdlkv", _all_on(),
           "sm121-all-moe + VLLM_SM121_PDL=1 + VLLM_SM121_KV_IN_QKV=1", **OFF,
           env=(MOE_ON, ("VLLM_SM121_PDL", "1"), ("VLLM_SM121_KV_IN_QKV", "1"))),
    # Stop 31's MoE opt-ins: whole-group fp16 chains (FC1 -1.5 us on an H200) and the scale bytes as int32 loads
    Config("sm121-all-moe-f16group", _all_on(),
           "sm121-all-moe + each 32-value group of the MoE GEMVs summed in one fp16 chain (opt-in)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_MOE_FMA_F16X2", "2"))),
    Config("sm121-all-moe-scaleldg", _all_on(),
           "sm121-all-moe + f16group + the MoE GEMVs' scale bytes one step ahead as int32 loads (opt-in)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_MOE_FMA_F16X2", "2"), ("VLLM_SM121_MOE_SCALE_LDG", "1"))),
    # Every opt-in above that timed faster alone, together (stop 32's A/B run)
    Config("sm121-all-moe-optins", _all_on(),
           "sm121-all-moe + f16group + scale-byte loads + PDL through the step + the KV write in the qkv GEMV",
           **OFF, env=(MOE_ON, ("VLLM_SM121_MOE_FMA_F16X2", "2"), ("VLLM_SM121_MOE_SCALE_LDG", "1"),
                       ("VLLM_SM121_PDL", "1"), ("VLLM_SM121_KV_IN_QKV", "1"))),
    # The nvfp4 decode attention with 32- / 64-token KV tiles instead of 128: a short context (tg128:
    # 16..144 tokens) then spreads over several splits per KV head instead of one program each
    Config("sm121-all-moe-tile32", _all_on(),
           "sm121-all-moe with the nvfp4 decode attention on 32-token KV tiles (more splits live at short contexts)",
           **OFF, env=(MOE_ON, ("VLLM_SM121_ATTN_TILE", "decode_nvfp4=16,32,4,2"))),
    Config("sm121-all-moe-tile64", _all_on(),
           "sm121-all-moe with the nvfp4 decode attention on 64-token KV tiles", **OFF,
           env=(MOE_ON, ("VLLM_SM121_ATTN_TILE", "decode_nvfp4=16,64,4,3"))),
    # A/B of stop 32's default: the nvfp4 pages' block scales as byte loads again
    Config("sm121-all-moe-scalebytes", _all_on(),
           "sm121-all-moe with the nvfp4 attention's block scales loaded as bytes (before stop 32)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_ATTN_SCALE_WORDS", "0"))),
    # Stop 33: the next layer's input add + RMSNorm carried from FC2's combine into the qkv GEMV (measured
    # as an opt-in, then the default at one token), alone, with f16group, and off (A/B of the default)
    Config("sm121-all-moe-normqkv", _all_on(),
           "sm121-all-moe + the input norm carried from FC2 into the qkv GEMV (explicitly on)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_NORM_IN_QKV", "1"))),
    Config("sm121-all-moe-nonorm", _all_on(),
           "sm121-all-moe with the input norm as a kernel of its own again (before stop 33)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_NORM_IN_QKV", "0"))),
    Config("sm121-all-moe-normf16", _all_on(),
           "sm121-all-moe + the carried input norm + f16group (opt-in): the best measured (stop 33)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_NORM_IN_QKV", "1"), ("VLLM_SM121_MOE_FMA_F16X2", "2"))),
    # A/B of stop 34's default: the MoE GEMVs' packed fp16 products per 8-value word (mode 1) again
    Config("sm121-all-moe-f16word", _all_on(),
           "sm121-all-moe with the MoE GEMVs' fp16 products summed per word (mode 1, before stop 34)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_MOE_FMA_F16X2", "1"))),
    # A/B of the windowed FMA default (stop 39; chunks of 4 at stop 38): M = 5-16 (5-32 before stop 42) through the grouped GEMMs again (sm_90)
    Config("sm121-all-moe-nowindow", _all_on(),
           "sm121-all-moe with the MoE's FMA GEMVs for M <= 4 only (M = 5-16 through the grouped GEMMs too, "
           "before stop 38)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_MOE_FMA_WINDOW_MAX_TOKENS", "0"))),
    # Stop 41: the grouped GEMMs' halves decoder (M > 32 on sm_90, prefill) took M = 32 in 567.9 us vs 724.0 in
    # checkpoint order, equal to the windowed FMA (566.3, uniform routing): with routing that reuses experts more
    # than uniform, the grouped GEMMs (one read per 16-token tile) may win from fewer tokens on
    Config("sm121-all-moe-window16", _all_on(),
           "sm121-all-moe with the windowed FMA GEMVs up to M = 16 (17-32 through the grouped GEMMs, halves decoder)",
           **OFF, env=(MOE_ON, ("VLLM_SM121_MOE_FMA_WINDOW_MAX_TOKENS", "16"))),
    # Stop 42 made 16 the sm_90 default (batch 32: 13.44 vs 17.83 ms/step windowed): the stop-39..41 default, for A/B runs
    Config("sm121-all-moe-window32", _all_on(),
           "sm121-all-moe with the windowed FMA GEMVs up to M = 32 (the sm_90 default of stops 39-41)",
           **OFF, env=(MOE_ON, ("VLLM_SM121_MOE_FMA_WINDOW_MAX_TOKENS", "32"))),
    Config("sm121-all-moe-bytes", _all_on(),
           "sm121-all-moe with the grouped GEMMs' checkpoint-order weight decoder (before stop 41)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_MOE_GROUPED_HALVES", "0"))),
    # A/B of stop 34's TP default (--tensor-parallel-size 2): o_proj / MoE shares all-reduced in bf16 as upstream
    Config("sm121-all-moe-bf16reduce", _all_on(),
           "sm121-all-moe with upstream's bf16 all-reduces of the o_proj and MoE shares under TP / EP "
           "(before stop 34; no effect on one rank)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_TP_FP32_REDUCE", "0"))),
    Config("sm121-all-moe-l2", _all_on(),
           "sm121-all-moe + L2 prefetches $E2E_L2_PREFETCH (default o,qkv_late,w2_late)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_L2_PREFETCH", os.environ.get("E2E_L2_PREFETCH", "o,qkv_late,w2_late")))),
    # A/B against the defaults that stop 27 switched on: the rotation inside the qkv GEMV, the
    # MoE's routing / combine inside FC1 / FC2 at one token, the attention's split merge in-kernel.
    Config("sm121-all-moe-stop26", _all_on(),
           "sm121-all-moe with stop 26's defaults (rotation, MoE routing and combine, attention split merge as "
           "their own launches)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_ROPE_IN_QKV", "0"), ("VLLM_SM121_MOE_FUSED_ROUTE", "0"),
                ("VLLM_SM121_MOE_FUSED_COMBINE", "0"), ("VLLM_SM121_ATTN_FUSED_COMBINE", "0"))),
    Config("sm121-all-moe-exact", _all_on(),
           "sm121-all-moe with the exact fp32 products and the router as its own GEMM (the defaults before "
           "packed fp16 products and the router inside the norm)", **OFF,
           env=(MOE_ON, ("VLLM_SM121_MOE_FMA_F16X2", "0"),
                ("VLLM_SM121_ROUTER_IN_NORM", "0"))),
)
# fmt: on
CONFIG_NAMES = tuple(c.name for c in CONFIGS)
DEFAULT_CONFIGS = tuple(c.name for c in CONFIGS if c.default)


@dataclasses.dataclass(frozen=True)
class Point:
    name: str
    kind: str  # "pp": prefill tok/s; "tg": step time from the max_tokens difference
    batch: int
    prompt_len: int
    gen_len: int  # max_tokens of the long run (tg); pp: 1

    @property
    def decode_ctx(self) -> int:
        """Mean context (KV tokens per sequence) of the timed decode steps."""
        return self.prompt_len + self.gen_len // 2

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.gen_len


POINTS: tuple[Point, ...] = (
    Point("pp2048", "pp", 1, 2048, 1),
    Point("tg128", "tg", 1, SHORT_PROMPT, GEN),
    Point("tg128-b8", "tg", 8, SHORT_PROMPT, GEN),
    Point("tg128-b32", "tg", 32, SHORT_PROMPT, GEN),
    Point("tg128@32k", "tg", 1, LONG_PROMPT, GEN),
    # batch decode at long context, where the KV cache is most of the bytes (the nvfp4 KV issue);
    # a KV cache too small for batch x length preempts, and the point is flagged suspect
    Point("tg128-b8@32k", "tg", 8, LONG_PROMPT, GEN),
    Point("tg128-b16@32k", "tg", 16, LONG_PROMPT, GEN),
    Point("tg128@2k", "tg", 1, 2048, GEN),  # the upstream baseline's tg128@2048
)
POINT_NAMES = tuple(p.name for p in POINTS)
FULL_POINTS = ("pp2048", "tg128", "tg128-b8", "tg128-b32", "tg128@32k")
QUICK_POINTS = ("pp2048", "tg128", "tg128-b8")
QUICK_COMPILATION = {"max_cudagraph_capture_size": 8}


# ---------------------------------------------------------------------------------------------
# bytes per decoded token
# ---------------------------------------------------------------------------------------------

KV_BYTES_PER_ELEM = {
    "bf16": 2.0,
    "fp8": 1.0,
    "nvfp4": 0.5625,
}  # nvfp4: (D/2 + D/16) / D
DENSE_BYTES_PER_PARAM = {"bf16": 2.0, "fp8": 1.0, "mxfp4": 4.25 / 8}  # mxfp4: 0.5 + one e8m0 per 32
# fp8 (vllm_sm121/dense/): one fp32 scale per output channel (row) of qkv / o / lm_head
DENSE_BYTES_PER_ROW = {"bf16": 0.0, "fp8": 4.0, "mxfp4": 0.0}
MXFP4_BYTES_PER_PARAM = (
    4.25 / 8
)  # e2m1 (4 bits) + one e8m0 scale (8 bits) per 32 values


def model_shape(cfg: dict) -> dict[str, Any]:
    """The numbers of a gpt-oss hf config.json that decide the bytes read per step."""
    try:
        nq = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
        shape = {
            "layers": layers,
            "hidden": hidden,
            "q_heads": nq,
            "kv_heads": int(cfg["num_key_value_heads"]),
            "head_dim": int(cfg.get("head_dim") or hidden // nq),
            "experts": int(cfg["num_local_experts"]),
            "top_k": int(top_k),
            "intermediate": int(cfg["intermediate_size"]),
            "vocab": int(cfg["vocab_size"]),
            "window": cfg.get("sliding_window"),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a gpt-oss config (missing or bad field {e})") from e
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    shape["sliding_layers"] = sum(t == "sliding_attention" for t in types)
    shape["full_layers"] = layers - shape["sliding_layers"]
    return shape


def expected_distinct_experts(experts: int, top_k: int, batch: int) -> float:
    """E * (1 - (1 - k/E)^B): distinct experts a batch of B tokens touches per layer."""
    return experts * (1.0 - (1.0 - top_k / experts) ** batch)


def decode_bytes(
    cfg: dict, *, batch: int = 1, ctx: int = 1, kv: str = "bf16", dense: str = "bf16"
) -> dict[str, float]:
    """Bytes one decode step of ``batch`` sequences at context ``ctx`` reads (see docstring)."""
    s = model_shape(cfg)
    if kv not in KV_BYTES_PER_ELEM:
        raise ValueError(f"kv: {kv!r}; supported: {', '.join(KV_BYTES_PER_ELEM)}")
    if dense not in DENSE_BYTES_PER_PARAM:
        raise ValueError(
            f"dense: {dense!r}; supported: {', '.join(DENSE_BYTES_PER_PARAM)}"
        )
    if batch < 1 or ctx < 1:
        raise ValueError(f"batch and ctx must be >= 1, got {batch}, {ctx}")
    layers, h, hd = s["layers"], s["hidden"], s["head_dim"]
    nq, nkv, n_exp, inter = s["q_heads"], s["kv_heads"], s["experts"], s["intermediate"]
    dense_b, row_b = DENSE_BYTES_PER_PARAM[dense], DENSE_BYTES_PER_ROW[dense]
    qkv_out = (nq + 2 * nkv) * hd
    attn = layers * (
        (h * qkv_out + nq * hd * h) * dense_b  # qkv_proj, o_proj weights
        + (qkv_out + h) * row_b  # their per-output-channel scales (fp8)
        + (qkv_out + h) * 2  # their bf16 biases
        + nq * 4  # fp32 sinks
    )
    router = layers * (h * n_exp + n_exp) * 2
    per_expert = (h * 2 * inter + inter * h) * MXFP4_BYTES_PER_PARAM + (
        2 * inter + h
    ) * 4
    distinct = expected_distinct_experts(n_exp, s["top_k"], batch)
    experts = layers * distinct * per_expert
    norms = (2 * layers + 1) * h * 2
    lm_head = s["vocab"] * (h * dense_b + row_b)
    embed = batch * h * 2
    window = s["window"]
    sliding_ctx = min(ctx, int(window)) if window else ctx
    kv_tokens = s["full_layers"] * ctx + s["sliding_layers"] * sliding_ctx
    kv_bytes = batch * kv_tokens * 2 * nkv * hd * KV_BYTES_PER_ELEM[kv]
    weights = attn + router + experts + norms + lm_head + embed
    total = weights + kv_bytes
    return {
        "batch": batch,
        "ctx": ctx,
        "kv_dtype": kv,
        "dense_weights": dense,
        "distinct_experts_per_layer": distinct,
        "attention_proj": attn,
        "router": router,
        "experts": experts,
        "norms": norms,
        "lm_head": lm_head,
        "embed": embed,
        "weights": weights,
        "kv": kv_bytes,
        "per_step": total,
        "per_token": total / batch,
    }


def kv_kind(kv_cache_dtype: str | None) -> str:
    """LLM(kv_cache_dtype=...) -> the bytes model's kv format."""
    v = (kv_cache_dtype or "auto").lower()
    if v in ("auto", "bfloat16", "float16", "bf16", "fp16"):
        return "bf16"  # gpt-oss activations are bf16
    if v.startswith("fp8"):
        return "fp8"
    if v == "nvfp4":
        return "nvfp4"
    raise ValueError(
        f"kv_cache_dtype {kv_cache_dtype!r}: the bytes model knows auto/bf16/fp8*/nvfp4"
    )


def dense_kind(llm_kwargs: dict) -> str:
    extra = (llm_kwargs.get("additional_config") or {}).get("sm121") or {}
    return extra.get("dense_weights", "bf16")


def tp_size(llm_kwargs: dict) -> int:
    """GPUs one engine spreads the model over (LLM(tensor_parallel_size=...); 1 when unset)."""
    return int(llm_kwargs.get("tensor_parallel_size") or 1)


def with_tp(b: dict[str, float], n: int) -> dict[str, float]:
    """``b`` plus the per-GPU bytes at TP=n (total / n, see the docstring); n = 1: ``b`` as is,
    so single-GPU records stay what they were."""
    if n > 1:
        b.update(tensor_parallel_size=n, per_gpu_step=b["per_step"] / n, per_gpu_token=b["per_token"] / n)
    return b


def per_gpu(b: dict) -> tuple[float, float]:
    """(bytes per step, bytes per token) one GPU reads: the totals unless ``with_tp`` split them."""
    return b.get("per_gpu_step", b["per_step"]), b.get("per_gpu_token", b["per_token"])


def point_bytes(cfg: dict, pt: Point, llm_kwargs: dict) -> dict[str, float] | None:
    """decode_bytes for a decode point under these LLM kwargs, with the per-GPU share at TP > 1
    (None: prefill, or a format the bytes model does not know)."""
    if pt.kind != "tg":
        return None
    try:
        kv = kv_kind(llm_kwargs.get("kv_cache_dtype"))
        b = decode_bytes(
            cfg, batch=pt.batch, ctx=pt.decode_ctx, kv=kv, dense=dense_kind(llm_kwargs)
        )
        return with_tp(b, tp_size(llm_kwargs))
    except ValueError:
        return None


def model_key(cfg: dict) -> str | None:
    """gpt-oss-120b / gpt-oss-20b by shape (the published GB10 figures are per model)."""
    try:
        s = model_shape(cfg)
    except ValueError:
        return None
    if s["hidden"] == 2880 and s["layers"] == 36 and s["experts"] == 128:
        return "gpt-oss-120b"
    if s["hidden"] == 2880 and s["layers"] == 24 and s["experts"] == 32:
        return "gpt-oss-20b"
    return None


# ---------------------------------------------------------------------------------------------
# plan: models x configs x points, LLM kwargs
# ---------------------------------------------------------------------------------------------


def deep_merge(base: dict, over: dict) -> dict:
    """``over`` into a copy of ``base``: dicts recursively, ``None`` deletes the key."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def base_llm_kwargs(
    model_dir: Path, hf: dict, points: list[Point], quick: bool, seed: int, tp: int = 1, ep: bool = False,
    engine_timestamps: bool = False, cached_prompts: bool = False,
) -> dict:
    needed = max(4096, round_up(max(p.max_len for p in points), 1024))
    positions = int(hf.get("max_position_embeddings") or 0)
    kw: dict[str, Any] = {
        "model": str(model_dir),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "seed": seed,
        # the timed runs repeat their prompts; --cached-prompts relies on exactly that
        "enable_prefix_caching": bool(cached_prompts),
        # longest point; the model's limit caps it (points beyond it are skipped, noted)
        "max_model_len": min(needed, positions) if positions else needed,
    }
    if quick:
        kw["compilation_config"] = dict(QUICK_COMPILATION)
    # in the base: every configuration, upstream included, runs at the same parallelism
    if tp > 1:
        kw["tensor_parallel_size"] = tp
    if ep:
        kw["enable_expert_parallel"] = True
    if engine_timestamps:  # RequestOutput.metrics: the engine core's per-token timestamps
        kw["disable_log_stats"] = False
    return kw


SPAWN_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
NO_COMPILE_CACHE_ENV = "VLLM_DISABLE_COMPILE_CACHE"


def engine_env(config_env: Mapping[str, str], llm_kwargs: dict, base: Mapping[str, str]) -> dict[str, str]:
    """A configuration's own environment, plus ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unless
    ``base`` (the caller's environment) sets it: the child's torch.cuda checks (``start_engine``)
    initialize CUDA, and a forked engine core then fails with "Cannot re-initialize CUDA in
    forked subprocess" (seen at TP = 1 on an H100, 8e7d4de); spawned processes do not care.
    ``llm_kwargs`` is kept for callers (the TP size once decided it).

    A configuration that sets VLLM_SM121_* variables also gets ``VLLM_DISABLE_COMPILE_CACHE=1``
    (unless ``base`` sets it): vLLM's compile-cache key does not hash those variables, so a
    configuration that differs from an earlier one only by its environment could load that one's
    compiled graph (seen at 56c2045: ``sm121-all-moe-exact`` compiled in 5.7 s after
    ``sm121-all-moe`` took 20.2 s)."""
    del llm_kwargs
    env = dict(config_env)
    if SPAWN_ENV not in base:
        env.setdefault(SPAWN_ENV, "spawn")
    if any(k.startswith("VLLM_SM121_") for k in config_env) and NO_COMPILE_CACHE_ENV not in base:
        env.setdefault(NO_COMPILE_CACHE_ENV, "1")
    return env


def llm_kwargs_for(config: Config, base: dict, override: dict) -> dict:
    return deep_merge(deep_merge(base, config.llm_kwargs), override)


@dataclasses.dataclass
class ModelPlan:
    name: str
    path: Path
    hf_config: dict
    key: str | None
    # per configuration: {"config", "note", "upstream", "llm_kwargs", "points", "skipped"}
    runs: list[dict]


def resolve_model(text: str) -> Path:
    """A shipped config name or a config directory; ValueError names the option and choices."""
    p = Path(text).expanduser()
    candidates = (
        [p]
        if p.is_absolute()
        else [Path.cwd() / p, REPO_ROOT / p, SHIPPED_MODELS_DIR / p]
    )
    for c in candidates:
        if (c / "config.json").is_file():
            return c.resolve()
    raise ValueError(
        f"--model: {text!r} is not a directory holding a config.json; use a shipped config "
        f"({', '.join(SHIPPED_MODELS)}, under {SHIPPED_MODELS_DIR}) or the path of a gpt-oss "
        "config directory (e.g. ../shared/models/gpt-oss-120b)"
    )


def build_plan(args) -> list[ModelPlan]:
    plans = []
    points = [p for p in POINTS if p.name in args.point_list]
    for text in args.model_list:
        path = resolve_model(text)
        hf = json.loads((path / "config.json").read_text())
        try:
            shape = model_shape(hf)
        except ValueError as e:
            raise ValueError(f"--model {text!r}: {path / 'config.json'}: {e}") from e
        base = base_llm_kwargs(path, hf, points, args.quick, args.seed,
                               getattr(args, "tensor_parallel_size", 1), getattr(args, "enable_expert_parallel", False),
                               getattr(args, "engine_timestamps", False), getattr(args, "cached_prompts", False))
        runs = []
        for cfg in args.config_objs:
            kw = llm_kwargs_for(cfg, base, args.llm_kwargs_obj)
            max_len = int(kw.get("max_model_len") or 0)
            pos_limit = int(hf.get("max_position_embeddings") or 0)
            skipped = {}
            for p in points:
                if max_len and p.max_len > max_len:
                    skipped[p.name] = (
                        f"skipped: needs max_model_len >= {p.max_len}, the LLM kwargs give {max_len}"
                    )
                elif pos_limit and p.max_len > pos_limit:
                    skipped[p.name] = (
                        f"skipped: needs {p.max_len} positions, the model has {pos_limit}"
                    )
            runs.append(
                {
                    "config": cfg.name,
                    "note": cfg.note,
                    "upstream": cfg.upstream,
                    "llm_kwargs": kw,
                    "env": engine_env(dict(cfg.env), kw, os.environ),
                    "points": [dataclasses.asdict(p) for p in points],
                    "skipped": skipped,
                }
            )
        name, used = path.name, {m.name for m in plans}
        name = (
            next(f"{name}-{i}" for i in range(2, 99) if f"{name}-{i}" not in used)
            if name in used
            else name
        )
        plans.append(ModelPlan(name, path, hf, model_key(hf), runs))
        if shape["top_k"] > shape["experts"]:
            raise ValueError(
                f"--model {text!r}: top-k {shape['top_k']} > {shape['experts']} experts"
            )
    return plans


# ---------------------------------------------------------------------------------------------
# the child process: one configuration (or the copy-bandwidth measurement)
# ---------------------------------------------------------------------------------------------


def _short_error(e: BaseException) -> str:
    msg = " ".join(f"{type(e).__name__}: {e}".split())
    return msg if len(msg) <= 600 else msg[:597] + "..."


def _write_json(path: str | Path, obj: Any) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def _fmt_dur(s: float) -> str:
    s = round(s)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def make_prompts(pt: Point, vocab: int, seed: int, run: int | None = None) -> list[dict]:
    """Fixed random token ids per point (TokensPrompt dicts), distinct per sequence; ``run``
    (prefill points under --cached-prompts) makes them distinct per run too."""
    rng = random.Random(f"{seed}:{pt.name}" if run is None else f"{seed}:{pt.name}:{run}")
    return [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(pt.prompt_len)]}
        for _ in range(pt.batch)
    ]


# Every request's temperature (--temperature; the child process sets it from its spec): 0 = greedy.
SAMPLING_TEMPERATURE = 0.0

# --random-router: std of the refilled router weights. The router input y = rmsnorm(h) * w has
# elements of ~1e-3 / sqrt(3) with vLLM's dummy norm weight (uniform +-1e-3), so each logit has a
# std of ~ROUTER_STD * 5.8e-4 * sqrt(hidden) (~1 for gpt-oss's 2880): softmax weights that are
# neither one-hot nor flat. Which experts win does not depend on the scale.
ROUTER_STD = 32.0


# --random-router also zeroes these biases (parameter names): each adds the same vector to every
# token's residual stream (dummy values +-1e-3, the experts' w2 bias through every routed expert).
# The qkv bias stays: it keeps the K / V values (and the KV-cache scales) at their usual dummy size,
# and what it adds to the residual passes o_proj's dummy weight (~1e-3 x the bias), far below the
# embedding.
TOKEN_INDEPENDENT_BIASES = ("o_proj.bias", "w13_bias", "w2_bias")


def randomize_routers(model, seed: int, std: float = ROUTER_STD) -> int:
    """Refill every ``*.mlp.router`` linear's weight of ``model`` in place with N(0, std^2) values
    (layer i from seed + i, generated in fp32 on the weight's device, then cast), zero its bias and
    every TOKEN_INDEPENDENT_BIASES parameter; returns how many routers it refilled. In place, so
    CUDA graphs, compiled code and kernel configurations that hold these tensors see the new
    values. Raises if the model has no such router (not a gpt-oss MoE)."""
    import torch

    n = 0
    with torch.no_grad():
        for name, mod in model.named_modules():
            w = getattr(mod, "weight", None)
            if not name.endswith("mlp.router") or not isinstance(w, torch.Tensor) or w.dim() != 2:
                continue
            g = torch.Generator(device=w.device).manual_seed(seed + n)
            w.copy_(torch.randn(w.shape, generator=g, device=w.device, dtype=torch.float32).mul_(std))
            if getattr(mod, "bias", None) is not None:
                mod.bias.zero_()
            n += 1
        if not n:
            raise RuntimeError("--random-router: the model has no '*.mlp.router' linear (gpt-oss MoE layers expected)")
        # parameters and buffers (the TP-invariant mode keeps its simulated ranks' expert biases in
        # buffers named sm121_sim{r}_w13_bias / _w2_bias)
        for name, p in (*model.named_parameters(), *model.named_buffers()):
            if name.endswith(TOKEN_INDEPENDENT_BIASES) and p.is_floating_point():
                p.zero_()
    return n


def make_sampling_params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=SAMPLING_TEMPERATURE, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )


def measure_copy_bandwidth(reps: int = 10) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"error": "no CUDA GPU: torch.cuda.is_available() is False"}
    dev = torch.device("cuda", torch.cuda.current_device())
    p = torch.cuda.get_device_properties(dev)
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    ts = []
    for i in range(reps + 2):
        s, e = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        if i >= 2:
            ts.append(s.elapsed_time(e) / 1000.0)
    t = statistics.median(ts)
    return {
        "gbps": 2 * COPY_BYTES / t / 1e9,
        "gbps_min": 2 * COPY_BYTES / max(ts) / 1e9,
        "gbps_max": 2 * COPY_BYTES / min(ts) / 1e9,
        "bytes": COPY_BYTES,
        "median_s": t,
        "reps": reps,
        "method": "dst.copy_(src) device-to-device, (read + written bytes) / time, median",
        "device": p.name,
        "capability": f"{p.major}.{p.minor}",
        "sm_count": p.multi_processor_count,
        "device_count": torch.cuda.device_count(),  # --tensor-parallel-size needs that many
        "total_memory_gib": round(p.total_memory / 2**30, 2),
        "torch_cuda": torch.version.cuda,
    }


def engine_info(llm) -> dict:
    """What the engine resolved (each field best-effort: private-ish vLLM attributes)."""
    info: dict[str, Any] = {}
    try:
        vc = llm.llm_engine.vllm_config
    except Exception as e:  # noqa: BLE001
        return {"error": _short_error(e)}
    getters = {
        "compilation_mode": lambda: str(vc.compilation_config.mode),
        "cudagraph_mode": lambda: str(vc.compilation_config.cudagraph_mode),
        "max_cudagraph_capture_size": lambda: (
            vc.compilation_config.max_cudagraph_capture_size
        ),
        "num_cudagraph_capture_sizes": lambda: len(
            vc.compilation_config.cudagraph_capture_sizes
        ),
        "attention_backend": lambda: str(vc.attention_config.backend),
        "kv_cache_dtype": lambda: vc.cache_config.cache_dtype,
        "block_size": lambda: vc.cache_config.block_size,
        "num_gpu_blocks": lambda: vc.cache_config.num_gpu_blocks,
        "gpu_memory_utilization": lambda: vc.cache_config.gpu_memory_utilization,
        "max_model_len": lambda: vc.model_config.max_model_len,
        "max_num_seqs": lambda: vc.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": lambda: vc.scheduler_config.max_num_batched_tokens,
        "tensor_parallel_size": lambda: vc.parallel_config.tensor_parallel_size,
        "enable_expert_parallel": lambda: vc.parallel_config.enable_expert_parallel,
        "async_scheduling": lambda: vc.scheduler_config.async_scheduling,
        "quantization": lambda: vc.model_config.quantization,
        "additional_config": lambda: vc.additional_config,
    }
    for k, g in getters.items():
        try:
            info[k] = g()
        except Exception as e:  # noqa: BLE001
            info[k] = f"n/a ({type(e).__name__})"
    return info


def engine_step_s(outs, n: int) -> float | None:
    """Decode seconds per step on the engine core's clock: the median over requests of
    (last token time - first token time) / (n - 1), from ``RequestOutput.metrics`` (vLLM fills
    it when stats are on: ``--engine-timestamps``). Prefill and everything in this front-end
    process (IPC, output processing, this script) are outside that interval; stalls inside the
    engine core are not. None without metrics or with n < 2."""
    if n < 2:
        return None
    vals = []
    for o in outs:
        m = getattr(o, "metrics", None)
        first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
        if not first or not last or last <= first:
            return None
        vals.append((last - first) / (n - 1))
    return statistics.median(vals) if vals else None


def _timed_generate(llm, prompts: list[dict], max_tokens: int, engine_steps: list | None = None) -> float:
    """Wall seconds of one ``generate``; with ``engine_steps``, also appends ``engine_step_s``."""
    sp = make_sampling_params(max_tokens)
    # A collection of this (front-end) process's garbage now rather than inside the timed call:
    # 1-3 s stalls hit random timed calls on the H100 (cause not identified; the engine core is
    # another process), and tg_estimate's minima absorb whatever remains.
    gc.collect()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if len(outs) != len(prompts) or any(n != max_tokens for n in got):
        raise RuntimeError(f"expected {len(prompts)} x {max_tokens} tokens, got {got}")
    if engine_steps is not None:
        engine_steps.append(engine_step_s(outs, max_tokens))
    return dt


def flag_over_capacity(res: dict, kv_tokens: int) -> None:
    """Mark decode points whose batch x (prompt + generated) tokens exceed the KV capacity vLLM
    reported: the scheduler then preempts and recomputes, and the number is not a decode rate."""
    by_name = {p.name: p for p in POINTS}
    for name, rec in (res.get("points") or {}).items():
        pt = by_name.get(name)
        if pt is None or pt.kind != "tg" or rec.get("status") != "ok" or pt.batch * pt.max_len <= kv_tokens:
            continue
        note = f"batch x length {pt.batch * pt.max_len:,} tokens > KV capacity {kv_tokens:,} (vLLM preempts)"
        rec["suspect"] = f"{rec['suspect']}; {note}" if rec.get("suspect") else note


CONFIRM_TOL = 0.05  # a decode estimate is confirmed by 2 iterations within 5% of it


def tg_estimate(t1s: list[float], tns: list[float], n: int, batch: int) -> dict:
    """Decode ms/step and tok/s from the raw t(max_tokens=1) / t(max_tokens=n) timings.

    The estimate uses the fastest t(1) and the fastest t(n): a host stall (1-3 s ones hit random
    iterations on H100, upstream and plugin alike) only ever adds time, and one inside t(1) makes
    that iteration's difference meaningless, even negative. The per-iteration differences give
    the spread. ``--merge`` re-applies this to older JSON files from their raw timings.
    """
    steps = [(tn - t1) / (n - 1) for t1, tn in zip(t1s, tns)]
    step = (min(tns) - min(t1s)) / (n - 1)
    rec: dict[str, Any] = {"t_1_s": t1s, "t_n_s": tns, "n": n, "step_s": steps,
                           "estimator": "(min t(N) - min t(1)) / (N - 1)", "ms_per_step": step * 1e3,
                           "ms_per_step_min": min(steps) * 1e3, "ms_per_step_max": max(steps) * 1e3}
    if step <= 0:
        rec.update(tok_s=None, suspect="min t(max_tokens=N) - min t(max_tokens=1) is <= 0")
        return rec
    pos = [x for x in steps if x > 0]
    rec.update(tok_s=batch / step, tok_s_min=batch / max(steps) if pos else None,
               tok_s_max=batch / min(pos) if pos else None)
    # Confirmed: at least two iterations' own differences within CONFIRM_TOL of the estimate
    # (two stall-free pairs agree with it); stalls elsewhere then do not matter.
    agree = sum(1 for x in steps if abs(x - step) <= CONFIRM_TOL * step)
    rec["agreeing_iters"] = agree
    if agree < 2:
        rec["suspect"] = (f"fewer than 2 iterations within {CONFIRM_TOL:.0%} of the min-based estimate "
                          "(host stalls); the estimate uses the minima")
    return rec


def run_tg_pairs(measure_pair, iters: int, extra: int, n: int, batch: int, say) -> dict:
    """``iters`` timed (t(1), t(n)) pairs, then up to ``extra`` more while the estimate is not
    confirmed (``tg_estimate``): host stalls cost a few extra pairs instead of a flagged point."""
    t1s, tns = [], []
    for i in range(iters + extra):
        if i >= iters:
            if "suspect" not in tg_estimate(t1s, tns, n, batch):
                break
            say(f"extra iter {i - iters + 1}/{extra} (not confirmed yet)")
        else:
            say(f"iter {i + 1}/{iters}")
        t1, tn = measure_pair()
        t1s.append(t1)
        tns.append(tn)
    rec = tg_estimate(t1s, tns, n, batch)
    rec["extra_iters"] = max(0, len(t1s) - iters)
    return rec


def run_point(llm, pt: Point, vocab: int, spec: dict, say) -> dict:
    prompts = make_prompts(pt, vocab, spec["seed"])
    warmup, iters = spec["warmup"], spec["iters"]
    cached = bool(spec.get("cached_prompts"))
    rec: dict[str, Any] = {"status": "ok", "warmup_s": [], "cached_prompts": cached}
    if pt.kind == "pp":
        # under --cached-prompts every prefill run gets prompts never seen before
        fresh = (lambda r: make_prompts(pt, vocab, spec["seed"], run=r)) if cached else (lambda r: prompts)
        for i in range(warmup):
            say(f"warm-up {i + 1}/{warmup}")
            rec["warmup_s"].append(_timed_generate(llm, fresh(i), 1))
        ts = []
        for i in range(iters):
            say(f"iter {i + 1}/{iters}")
            ts.append(_timed_generate(llm, fresh(warmup + i), 1))
        toks = [pt.batch * pt.prompt_len / t for t in ts]
        rec.update(
            t_s=ts,
            tok_s=statistics.median(toks),
            tok_s_min=min(toks),
            tok_s_max=max(toks),
            ms_per_step=None,
        )
        return rec
    n = pt.gen_len
    if cached:  # the one cold prefill of these prompts; every later run finds them cached
        say("priming the prefix cache")
        rec["prime_s"] = _timed_generate(llm, prompts, 1)
    for i in range(warmup):
        say(f"warm-up {i + 1}/{warmup}")
        rec["warmup_s"].append(
            [_timed_generate(llm, prompts, 1), _timed_generate(llm, prompts, n)]
        )
    steps: list = []
    rec.update(run_tg_pairs(lambda: (_timed_generate(llm, prompts, 1), _timed_generate(llm, prompts, n, steps)),
                            iters, spec.get("extra_iters", 0), n, pt.batch, say))
    if any(x is not None for x in steps):  # --engine-timestamps: a second, stall-resistant estimate
        ok = [x for x in steps if x is not None]
        rec["engine_ms_per_step"] = [None if x is None else x * 1e3 for x in steps]
        rec["engine_ms_per_step_median"] = statistics.median(ok) * 1e3
        rec["engine_tok_s"] = pt.batch / statistics.median(ok)
        say(f"engine-core clock: {rec['engine_ms_per_step_median']:.3f} ms/step median over {len(ok)} iterations")
    return rec


def tp_gpu_problem(tp: int, device_count: int) -> str | None:
    """Why a TP=``tp`` engine cannot start on ``device_count`` GPUs (None: it can)."""
    if tp <= device_count:
        return None
    return (f"--tensor-parallel-size {tp} needs {tp} GPUs, this machine has {device_count} "
            "(torch.cuda.device_count(), after CUDA_VISIBLE_DEVICES); use a larger machine or a smaller size")


def start_engine(llm_kwargs: dict, res: dict, result_path: str, log):
    """``LLM(**llm_kwargs)`` in a configuration's child process, timed into ``res["startup_s"]``;
    on failure records the error in ``res``, writes it to ``result_path`` and returns None."""
    log(f"starting the engine: LLM(**{json.dumps(llm_kwargs)})")
    t0 = time.perf_counter()
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU: torch.cuda.is_available() is False")
        problem = tp_gpu_problem(tp_size(llm_kwargs), torch.cuda.device_count())
        if problem:  # before importing vLLM and starting workers that cannot exist
            raise RuntimeError(problem)
        from vllm import LLM

        llm = LLM(**llm_kwargs)
    except Exception as e:  # noqa: BLE001
        res["error"] = f"engine start-up failed: {_short_error(e)}"
        res["startup_s"] = time.perf_counter() - t0
        log(res["error"])
        _write_json(result_path, res)
        return None
    res["startup_s"] = time.perf_counter() - t0
    return llm


def child_main(spec_path: str, result_path: str) -> int:
    global SAMPLING_TEMPERATURE
    spec = json.loads(Path(spec_path).read_text())
    SAMPLING_TEMPERATURE = float(spec.get("temperature", 0.0))
    if spec.get("mode") == "copy_bandwidth":
        try:
            res = measure_copy_bandwidth()
        except Exception as e:  # noqa: BLE001
            res = {"error": _short_error(e)}
        _write_json(result_path, res)
        return 0 if "error" not in res else 2

    name = spec["config"]
    t_total0 = spec.get("t0") or time.time()
    res: dict[str, Any] = {
        "config": name,
        "llm_kwargs": spec["llm_kwargs"],
        "points": {},
    }
    res["error"] = None
    _write_json(result_path, res)

    def log(msg: str) -> None:
        print(
            f"{LOG_PREFIX} {name}: {msg}  [total {_fmt_dur(time.time() - t_total0)}]",
            flush=True,
        )

    if spec.get("random_router"):  # LLM.apply_model ships a function to the workers
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = start_engine(spec["llm_kwargs"], res, result_path, log)
    if llm is None:
        return 3
    res["engine"] = engine_info(llm)
    log(
        f"engine up in {res['startup_s']:.1f}s: {json.dumps(res['engine'], default=str)}"
    )
    if spec.get("random_router"):
        import functools

        try:
            counts = llm.apply_model(functools.partial(randomize_routers, seed=int(spec["seed"])))
        except Exception as e:  # noqa: BLE001
            res["error"] = f"--random-router failed: {_short_error(e)}"
            log(res["error"])
            _write_json(result_path, res)
            return 3
        res["random_router"] = {"routers_per_rank": counts, "std": ROUTER_STD}
        log(f"router weights refilled (N(0, {ROUTER_STD}^2), bias 0; o_proj / expert biases 0): {counts} layers per rank")
    try:
        vocab = int(llm.llm_engine.vllm_config.model_config.get_vocab_size())
    except Exception:  # noqa: BLE001
        vocab = int(spec["vocab"])
    res["vocab"] = vocab
    _write_json(result_path, res)

    points = [Point(**p) for p in spec["points"]]
    for i, pt in enumerate(points):
        tag = f"[{i + 1}/{len(points)}] {pt.name}"
        if pt.name in spec["skipped"]:
            res["points"][pt.name] = {
                "status": "skipped",
                "note": spec["skipped"][pt.name],
            }
            log(f"{tag}: {spec['skipped'][pt.name]}")
            _write_json(result_path, res)
            continue
        tp = time.perf_counter()

        def say(msg: str, tag=tag, tp=tp) -> None:
            log(f"{tag}: {msg} ({time.perf_counter() - tp:.1f}s)")

        try:
            rec = run_point(llm, pt, vocab, spec, say)
        except Exception as e:  # noqa: BLE001
            rec = {"status": "error", "error": _short_error(e)}
        rec["elapsed_s"] = time.perf_counter() - tp
        res["points"][pt.name] = rec
        _write_json(result_path, res)
        if rec["status"] != "ok":
            log(f"{tag}: ERROR {rec['error']}")
        elif pt.kind == "pp":
            log(f"{tag}: {rec['tok_s']:,.0f} tok/s ({rec['elapsed_s']:.1f}s)")
        else:
            tok = f"{rec['tok_s']:,.1f} tok/s, " if rec["tok_s"] else ""
            log(
                f"{tag}: {tok}{rec['ms_per_step']:.3f} ms/step "
                f"({rec['ms_per_step_min']:.3f}-{rec['ms_per_step_max']:.3f}) "
                f"({rec['elapsed_s']:.1f}s){' SUSPECT: ' + rec['suspect'] if 'suspect' in rec else ''}"
            )
    try:  # give the engine core's GPU memory back before this process exits
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001
        log(f"engine shutdown: {_short_error(e)}")
    return 0


# ---------------------------------------------------------------------------------------------
# the parent: run children, collect
# ---------------------------------------------------------------------------------------------

BACKEND_LINE = re.compile(
    r"Using .*(backend|Backend)|SM121 attention layer|FlashAttention version|vllm-sm121 .* loaded"
    r"|Mxfp4 MoE|cudagraph_mode|Capturing CUDA graphs|init engine"
)
ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b: ")
# vLLM's startup line with the KV-cache capacity: "GPU KV cache size: 1,234,567 tokens"
KV_CAPACITY_LINE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def kv_capacity_tokens(line: str) -> int | None:
    """The token count of vLLM's "GPU KV cache size" log line, else None."""
    m = KV_CAPACITY_LINE.search(line)
    return int(m.group(1).replace(",", "")) if m else None


def wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> tuple[int | None, bool]:
    """Wait for a child started with ``start_new_session=True``; past ``timeout_s`` kill its
    whole process group (SIGTERM, then SIGKILL). Always reaps group leftovers (an engine core
    whose parent died). Returns (returncode, timed_out)."""
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=20)
                break
            except subprocess.TimeoutExpired:
                continue
        rc = proc.returncode
    try:  # leftovers of its group: ours, by group id
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    return rc, timed_out


# Environment variables only a configuration's own ``env`` sets for its child process.
ISOLATED_ENV = ("VLLM_SM121_MOE_EXPERIMENTAL",)


def child_env(base: Mapping[str, str], extra: dict | None) -> dict[str, str]:
    """A configuration's process environment: ``base`` without ISOLATED_ENV (the MoE opt-in belongs
    to the configurations that name it: one exported in the caller's shell would silently switch
    every plugin configuration), unbuffered output, then the configuration's own ``extra``."""
    return {**{k: v for k, v in base.items() if k not in ISOLATED_ENV}, "PYTHONUNBUFFERED": "1", **(extra or {})}


def run_child(
    spec: dict, log_path: Path | None, timeout_s: float, verbose: bool, env: dict | None = None
) -> dict:
    """Run one child process (``env`` added to its environment); its stdout+stderr go to
    log_path, [e2e] lines are echoed."""
    with tempfile.TemporaryDirectory(prefix="e2e_bench_") as td:
        spec_path, res_path = Path(td) / "spec.json", Path(td) / "result.json"
        spec_path.write_text(json.dumps(spec, default=str))
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            CHILD_FLAG,
            str(spec_path),
            str(res_path),
        ]
        env = child_env(os.environ, env)
        sm121_env = {k: v for k, v in env.items() if k.startswith("VLLM_SM121_")}
        tail: collections.deque[str] = collections.deque(maxlen=60)
        backend_lines: list[str] = []
        error_lines: list[str] = []
        capacity: list[int] = []
        seen: collections.Counter[str] = collections.Counter()
        logf = log_path.open("w") if log_path else None
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,  # a timeout kills its whole group (engine core included)
        )

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if logf:
                    logf.write(line)
                line = line.rstrip("\n")
                tail.append(line)
                if line.startswith(LOG_PREFIX) or verbose:
                    print(line, flush=True)
                hit = BACKEND_LINE.search(line)
                if hit and line not in backend_lines and seen[hit.group(0)] < 3:
                    # a few lines of each kind (one per layer would be too many)
                    seen[hit.group(0)] += 1
                    backend_lines.append(line)
                tokens = kv_capacity_tokens(line)
                if tokens is not None:
                    capacity.append(tokens)
                ours = line.startswith(LOG_PREFIX)
                if not ours and ERROR_LINE.search(line) and len(error_lines) < 20:
                    error_lines.append(line.strip())

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        rc, timed_out = wait_or_kill(proc, timeout_s)
        reader.join(timeout=10)
        if logf:
            logf.close()
        try:
            res = json.loads(res_path.read_text())
        except (OSError, ValueError):
            res = {"error": f"child exited rc={rc} without a result"}
    res["returncode"] = rc
    res["sm121_env"] = sm121_env  # the plugin's environment the child ran with
    res["backend_log_lines"] = backend_lines
    if capacity:  # KV-cache capacity vLLM reported at startup (bf16 vs fp8 vs nvfp4 pages)
        res["kv_cache_tokens"] = capacity[-1]
        flag_over_capacity(res, capacity[-1])
    if log_path:
        res["log"] = str(log_path)
    if timed_out:
        msg = f"timed out after {timeout_s:.0f}s (killed)"
        res["error"] = f"{res['error']}; {msg}" if res.get("error") else msg
    if res.get("error") or rc not in (0, None):
        # vLLM's engine core logs the real cause; LLM() only raises "initialization failed".
        res["error_log_lines"] = error_lines
        res["log_tail"] = list(tail)[-30:]
        if not res.get("error"):
            res["error"] = f"child exited rc={rc}"
    return res


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_info() -> dict:
    info: dict[str, Any] = {
        "commit": os.environ.get("VLLM_SM121_COMMIT"),
        "dirty": None,
    }
    # the GPU machine receives the tree without .git: the caller passes the commit
    if info["commit"]:
        return info
    try:
        git = ["git", "-C", str(REPO_ROOT)]
        info["commit"] = (
            subprocess.run(
                [*git, "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
            or None
        )
        st = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        info["dirty"] = bool(st.strip())
    except (OSError, subprocess.SubprocessError) as e:
        info["error"] = _short_error(e)
    return info


def parallel_label(tp: int, ep: bool) -> str:
    """", TP=2, EP" for the report's header lines; "" at TP=1 (the single-GPU lines as they were)."""
    return f", TP={tp}{', EP' if ep else ''}" if tp > 1 or ep else ""


def make_header(args, copy_bw: dict | None) -> dict:
    tp = getattr(args, "tensor_parallel_size", 1)
    h: dict[str, Any] = {
        "benchmark": "e2e",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "argv": sys.argv[1:],
        "dry_run": bool(args.dry_run),
        "mode": "quick" if args.quick else "full",
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "triton": _version("triton"),
        "vllm": _version("vllm"),
        "vllm_sm121": _version("vllm-sm121"),
        "git": git_info(),
        "iters": args.iters,
        "extra_iters": args.extra_iters,
        "warmup": args.warmup,
        "seed": args.seed,
        "temperature": args.temperature,
        # every configuration's LLM kwargs carry them too (tensor_parallel_size only when > 1)
        "tensor_parallel_size": tp,
        "enable_expert_parallel": bool(getattr(args, "enable_expert_parallel", False)),
        "engine_timestamps": bool(getattr(args, "engine_timestamps", False)),
        "cached_prompts": bool(getattr(args, "cached_prompts", False)),
        "random_router": bool(getattr(args, "random_router", False)),
        "copy_bandwidth": copy_bw,
        "copy_bandwidth_gbps": (copy_bw or {}).get("gbps"),
        "gb10": {"bandwidth_gbps": GB10_BANDWIDTH_GBPS, "published": PUBLISHED_GB10},
        "method": {
            "pp": "batch * prompt_len / t(max_tokens=1), median of iters",
            "tg": "(min over iters of t(max_tokens=N) - min of t(max_tokens=1)) / (N - 1), same prompts",
            "bytes": "decode_bytes(): weights read per step + KV at the mean decode context",
            "pct_bw": "bytes per step / step time / copy bandwidth",
            "gb10_projection": "273 GB/s * (pct_bw / 100) / bytes per token",
        },
    }
    if tp > 1:
        h["method"]["per_gpu"] = (f"TP={tp}: bytes are per GPU (model total / {tp}), pct_bw against one GPU's "
                                  f"copy bandwidth, gb10_projection for {tp} GB10s")
    h["git_commit"] = h["git"]["commit"]
    if copy_bw and "device" in copy_bw:
        h.update(device=copy_bw["device"], capability=copy_bw["capability"])
    else:
        h.update(device="none (dry run)" if args.dry_run else None, capability=None)
    return h


def derive(
    point: dict, rec: dict, hf: dict, llm_kwargs: dict, copy_gbps: float | None
) -> None:
    """Add bytes, % of copy bandwidth and the GB10 projection to a point record (in place).
    TP > 1: per GPU (each GPU reads its share at the same time), projected for as many GB10s."""
    pt = Point(**point)
    b = point_bytes(hf, pt, llm_kwargs)
    rec["bytes"] = b
    step_b, tok_b = per_gpu(b) if b else (None, None)
    rec["gb10_ceiling_tok_s"] = (
        GB10_BANDWIDTH_GBPS * 1e9 / tok_b if b else None
    )
    rec["achieved_gbps"] = rec["pct_copy_bw"] = rec["gb10_projection_tok_s"] = None
    if (
        not b
        or rec.get("status") != "ok"
        or not rec.get("ms_per_step")
        or rec["ms_per_step"] <= 0
    ):
        return
    gbps = step_b / (rec["ms_per_step"] / 1e3) / 1e9
    rec["achieved_gbps"] = gbps
    if copy_gbps:
        eff = gbps / copy_gbps
        rec["pct_copy_bw"] = 100 * eff
        rec["gb10_projection_tok_s"] = GB10_BANDWIDTH_GBPS * 1e9 * eff / tok_b


def derive_all(result: dict) -> None:
    copy_gbps = result["header"].get("copy_bandwidth_gbps")
    for m in result["models"]:
        for run in m["runs"]:
            for p in run["plan"]["points"]:
                rec = run.setdefault("points", {}).get(p["name"])
                if rec is not None:
                    derive(p, rec, m["hf_config"], run["plan"]["llm_kwargs"], copy_gbps)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def print_plan(plans: list[ModelPlan], args) -> None:
    print(
        f"plan: {'quick' if args.quick else 'full'} mode, warm-up {args.warmup}, iters {args.iters}, "
        f"{sum(len(m.runs) for m in plans)} configuration process(es)"
        f"{parallel_label(getattr(args, 'tensor_parallel_size', 1), getattr(args, 'enable_expert_parallel', False))}"
    )
    for m in plans:
        print(f"\nmodel {m.name} ({m.path})")
        for run in m.runs:
            names = [p["name"] for p in run["points"]]
            pts = ", ".join(
                n + (" (skip)" if n in run["skipped"] else "") for n in names
            )
            print(f"  {run['config']:<18} {run['note']}")
            print(f"  {'':<18} points: {pts}")
            print(f"  {'':<18} LLM(**{json.dumps(run['llm_kwargs'])})")
            for why in run["skipped"].values():
                print(f"  {'':<18} note: {why}")


def bytes_table(m: ModelPlan) -> list[dict]:
    rows = []
    seen = set()
    for run in m.runs:
        kv, dense = (
            run["llm_kwargs"].get("kv_cache_dtype"),
            dense_kind(run["llm_kwargs"]),
        )
        for p in run["points"]:
            pt = Point(**p)
            key = (pt.name, kv, dense, tp_size(run["llm_kwargs"]))
            if pt.kind != "tg" or key in seen:
                continue
            seen.add(key)
            b = point_bytes(m.hf_config, pt, run["llm_kwargs"])
            if b is None:
                continue
            rows.append(
                {
                    "point": pt.name,
                    **b,
                    "gb10_ceiling_tok_s": GB10_BANDWIDTH_GBPS * 1e9 / per_gpu(b)[1],
                }
            )
    return rows


def _gpus_label(ns: set[int]) -> str:
    """"2" for one TP size over the table's rows, "N" for a mix (a --merge of different runs)."""
    return str(next(iter(ns))) if len(ns) == 1 else "N"


def print_bytes_table(m: ModelPlan) -> None:
    gb = 1e9
    rows = bytes_table(m)
    ns = {r.get("tensor_parallel_size", 1) for r in rows} or {1}
    tp = ns != {1}  # TP > 1: the model totals, then one GPU's share and N GB10s
    n = _gpus_label(ns)
    gb10 = f"{n}x GB10 max tok/s" if tp else "GB10 max tok/s"
    print(f"\nbytes read per decode step, {m.name} (model config; GB = 1e9 bytes)"
          + (f"; TP={n}: model totals, GB/tok/GPU = GB/token / {n}" if tp else ""))
    head = (
        f"{'point':<10} {'kv':<6} {'weights':<6} {'B':>3} {'ctx':>6} {'attn+rtr':>9} {'experts':>8} "
        f"{'lm_head':>8} {'KV':>8} {'GB/step':>8} {'GB/token':>9}{' GB/tok/GPU' if tp else ''} "
        f"{gb10:>15}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['point']:<10} {r['kv_dtype']:<6} {r['dense_weights']:<6} {r['batch']:>3} {r['ctx']:>6} "
            f"{(r['attention_proj'] + r['router']) / gb:>9.3f} {r['experts'] / gb:>8.3f} "
            f"{r['lm_head'] / gb:>8.3f} {r['kv'] / gb:>8.4f} {r['per_step'] / gb:>8.3f} "
            f"{r['per_token'] / gb:>9.3f}{f' {per_gpu(r)[1] / gb:>10.3f}' if tp else ''} "
            f"{r['gb10_ceiling_tok_s']:>{len(gb10) if tp else 15}.1f}"
        )
    print(
        f"({n} GB10s max = {n} x {GB10_BANDWIDTH_GBPS:.0f} GB/s / GB per token, i.e. 100% of their bandwidth)"
        if tp else f"(GB10 max = {GB10_BANDWIDTH_GBPS:.0f} GB/s / GB per token, i.e. 100% of its bandwidth)"
    )
    rows = dense_what_if(m)
    if rows:
        r0 = rows[0]
        print(
            f"\ndense weight formats (qkv / o / lm_head; router bf16), batch {r0['batch']}, ctx {r0['ctx']}, "
            f"kv {r0['kv_dtype']} -- computed (fp8 runs as sm121-fp8dense; mxfp4 is not implemented)"
        )
        n = r0.get("tensor_parallel_size", 1)
        for r in rows:
            print(
                f"  {r['dense_weights']:<6} attn+rtr {(r['attention_proj'] + r['router']) / gb:6.3f}  "
                f"lm_head {r['lm_head'] / gb:6.3f}  GB/token {r['per_token'] / gb:6.3f}  "
                + (f"GB/tok/GPU {per_gpu(r)[1] / gb:6.3f}  {n}x GB10 max tok/s " if n > 1 else "GB10 max tok/s ")
                + f"{r['gb10_ceiling_tok_s']:6.1f}"
            )


def dense_what_if(m: ModelPlan) -> list[dict]:
    """decode_bytes of the model's first batch-1 decode point (else its first decode point)
    for every dense weight format (issue 8: <= 3.6 GB/token for gpt-oss-120b with fp8)."""
    pts = [
        (Point(**p), run["llm_kwargs"])
        for run in m.runs
        for p in run["points"]
        if p.get("kind") == "tg"
    ]
    if not pts:
        return []
    pt, kw = min(pts, key=lambda t: t[0].batch != 1)
    try:
        kv = kv_kind(kw.get("kv_cache_dtype"))
        return [
            {
                **(b := with_tp(decode_bytes(m.hf_config, batch=pt.batch, ctx=pt.decode_ctx, kv=kv, dense=d),
                                tp_size(kw))),
                "gb10_ceiling_tok_s": GB10_BANDWIDTH_GBPS * 1e9 / per_gpu(b)[1],
            }
            for d in DENSE_BYTES_PER_PARAM
        ]
    except ValueError:
        return []


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def print_results(result: dict) -> None:
    hdr = result["header"]
    copy_gbps = hdr.get("copy_bandwidth_gbps")
    temp_label = f", temperature {hdr['temperature']}" if hdr.get("temperature") else ""
    print(
        f"\ndevice {hdr.get('device')} (capability {hdr.get('capability')}), vllm {hdr.get('vllm')}, "
        f"torch {hdr.get('torch')}, triton {hdr.get('triton')}, vllm-sm121 {hdr.get('vllm_sm121')}, "
        f"commit {hdr.get('git_commit')}, copy bandwidth {_num(copy_gbps, '.0f')} GB/s, "
        f"{hdr.get('mode')} mode, iters {hdr.get('iters')}{temp_label}"
        f"{parallel_label(hdr.get('tensor_parallel_size') or 1, bool(hdr.get('enable_expert_parallel')))}"
    )
    for m in result["models"]:
        published = PUBLISHED_GB10.get(m.get("key") or "", {})
        ns = {tp_size(run["plan"]["llm_kwargs"]) for run in m["runs"]} or {1}
        tp, n = ns != {1}, _gpus_label(ns)  # TP > 1: per GPU, projected for N GB10s (derive)
        gb10 = f"{n}x GB10 tok/s" if tp else "GB10 tok/s"
        print(
            f"\n{m['name']}: tok/s ([min-max] over iterations), ms/step (decode: min-based estimate; min-max), GB read per token"
            + (f" per GPU (TP={n}: model total / {n})," if tp else ",")
        )
        print(
            ("% of one GPU's copy bandwidth (the GPUs read at once), "
             f"{n}x GB10 projection ({n} GB10s: 273 GB/s x that efficiency / GB per GPU), " if tp else
             "% of the copy bandwidth, GB10 projection (273 GB/s x that efficiency), ")
            + "vs up = tok/s over the best upstream configuration; ! = suspect (see JSON)"
        )
        head = (
            f"{'config':<18} {'point':<10} {'tok/s':>22} {'ms/step':>22} {'GB/GPU' if tp else 'GB/tok':>7} {'%BW':>5} "
            f"{gb10:>10} {'vs up':>6}  published GB10"
        )
        print(head)
        print("-" * (len(head) + 20))
        best_up: dict[str, float] = {}
        for run in m["runs"]:
            if run["plan"].get("upstream"):
                for name, rec in (run.get("points") or {}).items():
                    if rec.get("tok_s"):
                        best_up[name] = max(best_up.get(name, 0.0), rec["tok_s"])
        errors = []
        for run in m["runs"]:
            cname = run["plan"]["config"]
            if run.get("error") and not run.get("points"):
                print(f"{cname:<18} {'(all)':<10} ERROR: {run['error'][:150]}")
                errors.append(run)
                continue
            if run.get("error"):
                errors.append(run)
            for p in run["plan"]["points"]:
                rec = (run.get("points") or {}).get(p["name"])
                name = p["name"]
                if rec is None:
                    print(f"{cname:<18} {name:<10} (not run)")
                    continue
                if rec.get("status") != "ok":
                    print(
                        f"{cname:<18} {name:<10} {rec.get('note') or 'ERROR: ' + str(rec.get('error'))}"
                    )
                    continue
                tok = rec.get("tok_s")
                tok_c = (
                    "-"
                    if tok is None
                    else f"{tok:,.1f} [{rec['tok_s_min']:,.0f}-{rec['tok_s_max']:,.0f}]"
                )
                ms = rec.get("ms_per_step")
                ms_c = (
                    "-"
                    if ms is None
                    else (
                        f"{ms:.3f} ({rec['ms_per_step_min']:.2f}-{rec['ms_per_step_max']:.2f})"
                    )
                )
                b = rec.get("bytes")
                vs = f"{tok / best_up[name]:.2f}x" if tok and best_up.get(name) else "-"
                flag = "!" if rec.get("suspect") else ""
                print(
                    f"{cname:<18} {name + flag:<10} {tok_c:>22} {ms_c:>22} "
                    f"{_num(per_gpu(b)[1] / 1e9 if b else None, '.3f'):>7} "
                    f"{_num(rec.get('pct_copy_bw'), '.0f'):>5} "
                    f"{_num(rec.get('gb10_projection_tok_s'), '.1f'):>{len(gb10) if tp else 10}} {vs:>6}  "
                    f"{published.get(name, '')}"
                )
        for run in errors:
            print(f"\n{run['plan']['config']}: {run['error']}")
            for line in run.get("error_log_lines") or []:
                print(f"    {line[:300]}")
    routing = ("the routers were refilled (--random-router), so routing follows the tokens as the model "
               "assumes" if result.get("header", {}).get("random_router") else
               "dummy weights route nearly every token to the same experts, so GB/tok, %BW and the projection "
               "are upper bounds there (a %BW over 100 is that artifact; --random-router avoids it)")
    print(
        "\nGB10 projection assumes the efficiency (% of copy bandwidth) measured here; on H100/H200 "
        "batch-1 decode is latency-bound, so the projection is a floor for a bandwidth-bound GB10."
        f"\nBatch > 1: the bytes model counts the distinct experts of uniform top-k routing; {routing}."
    )


def write_plot(result: dict, png: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not importable (pip install matplotlib)"
    models = result["models"]

    def measured(run: dict, pname: str) -> float | None:
        rec = (run.get("points") or {}).get(pname) or {}
        return rec.get("tok_s") if rec.get("status") == "ok" else None

    names = [
        p for p in POINT_NAMES if any(measured(r, p) for m in models for r in m["runs"])
    ]
    if not names:
        return "plot skipped: no measured points"
    fig, axes = plt.subplots(
        len(models),
        len(names),
        figsize=(3.2 * len(names), 3.4 * len(models)),
        squeeze=False,
    )
    for i, m in enumerate(models):
        for j, pname in enumerate(names):
            ax = axes[i][j]
            labels, vals, errs, colors = [], [], [], []
            for run in m["runs"]:
                rec = (run.get("points") or {}).get(pname) or {}
                labels.append(run["plan"]["config"])
                colors.append("0.6" if run["plan"].get("upstream") else "C0")
                tok = measured(run, pname)
                vals.append(tok or 0.0)
                lo, hi = rec.get("tok_s_min") or tok, rec.get("tok_s_max") or tok
                # the per-iteration range need not bracket the min-based estimate (host stalls)
                errs.append([max(tok - lo, 0.0), max(hi - tok, 0.0)] if tok else [0.0, 0.0])
            ax.bar(
                range(len(vals)), vals, yerr=list(zip(*errs)), capsize=3, color=colors
            )
            for k, v in enumerate(vals):
                text = "n/a" if not v else f"{v / 1e3:.1f}k" if v >= 1e4 else f"{v:.0f}"
                ax.text(k, v, text, ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
            ax.set_title(f"{m['name']} {pname}", fontsize=9)
            ax.set_ylabel("tok/s", fontsize=8)
    hdr = result["header"]
    fig.suptitle(
        f"vllm-sm121 e2e, {hdr.get('device')}, commit {str(hdr.get('git_commit'))[:10]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return f"wrote {png}"


# ---------------------------------------------------------------------------------------------
# dry run: check the LLM kwargs against the installed vLLM
# ---------------------------------------------------------------------------------------------


def check_llm_kwargs(plans: list[ModelPlan]) -> tuple[list[str], list[str]]:
    """(problems, notes): every kwarg an LLM(...) / EngineArgs field, compilation_config keys,
    kv_cache_dtype, attention backend names, SamplingParams and the plugin's sm121 options."""
    import typing

    from vllm import LLM
    from vllm.config import CompilationConfig
    from vllm.config.cache import CacheDType
    from vllm.engine.arg_utils import EngineArgs

    import vllm_sm121
    from vllm_sm121 import config as sm121_config

    vllm_sm121.register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    problems, notes = [], []
    allowed = {f.name for f in dataclasses.fields(EngineArgs)}
    allowed |= set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"}
    cc_fields = {f.name for f in dataclasses.fields(CompilationConfig) if f.init}
    cache_dtypes = set(typing.get_args(CacheDType))
    make_sampling_params(GEN)  # the child's SamplingParams(...) is valid here
    for m in plans:
        for run in m.runs:
            kw, where = run["llm_kwargs"], f"{m.name}/{run['config']}"
            for k in kw:
                if k not in allowed:
                    problems.append(f"{where}: LLM(...) has no argument {k!r}")
            cc = kw.get("compilation_config")
            if isinstance(cc, dict):
                for k in cc:
                    if k not in cc_fields:
                        problems.append(
                            f"{where}: compilation_config has no field {k!r}"
                        )
            dt = kw.get("kv_cache_dtype")
            if dt is not None and dt not in cache_dtypes:
                problems.append(
                    f"{where}: kv_cache_dtype {dt!r} not in {sorted(cache_dtypes)}"
                )
            be = kw.get("attention_backend")
            if be is not None and be not in AttentionBackendEnum._member_map_:
                problems.append(
                    f"{where}: attention_backend {be!r} is not a vLLM backend name"
                )
            try:
                sm121_config.parse(kw.get("additional_config"))
            except ValueError as e:
                notes.append(f"{where}: the engine will refuse this at start-up: {e}")
    return problems, notes


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="benchmarks/e2e.py",
        description="End-to-end gpt-oss benchmark: upstream vLLM 0.26 vs the SM121 plugin, same card, same run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Method (points, timing, bytes model, projection): the docstring at the top of benchmarks/e2e.py.",
    )
    ap.add_argument(
        "--model",
        action="append",
        default=None,
        help=f"shipped config ({', '.join(SHIPPED_MODELS)}) or a gpt-oss config dir; repeatable "
        f"(default {DEFAULT_MODEL})",
    )
    ap.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"comma list from {','.join(CONFIG_NAMES)} (default {','.join(DEFAULT_CONFIGS)})",
    )
    ap.add_argument(
        "--points",
        default=None,
        help=f"comma list from {','.join(POINT_NAMES)} (default {','.join(FULL_POINTS)}; "
        f"--quick: {','.join(QUICK_POINTS)})",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="functional numbers in a few minutes: 20b, quick points, max_cudagraph_capture_size 8, "
        "1 warm-up, 3 iters",
    )
    ap.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed repetitions per point (default 3, also with --quick: the decode estimate takes minima, and host stalls hit 2-iteration runs)",
    )
    ap.add_argument(
        "--extra-iters",
        type=int,
        default=4,
        help="decode points: up to this many more (t(1), t(N)) pairs while fewer than 2 iterations "
        "agree with the min-based estimate within 5%% (default 4; 0 = off)",
    )
    ap.add_argument(
        "--cached-prompts",
        action="store_true",
        help="prefix caching on: decode points prefill their prompts once (untimed, JSON prime_s) "
        "and then run from the cache, so every request decodes from the first step (clean batch "
        "decode after long prompts, no repeated long prefills); prefill points get fresh prompts "
        "per run. Off by default",
    )
    ap.add_argument(
        "--random-router",
        action="store_true",
        help="refill every MoE router with seeded N(0, 32^2) weights and zero the router, o_proj and expert "
        "biases after start-up, so that batched decode routes like real weights (dummy weights send every "
        "token to the same 4 experts). Off by default",
    )
    ap.add_argument(
        "--engine-timestamps",
        action="store_true",
        help="turn vLLM's request stats on (disable_log_stats=False, every configuration) and also "
        "record decode ms/step on the engine core's clock (first -> last token of each request; "
        "host stalls in this front-end process do not enter it). Off by default: not yet compared "
        "with the default estimator on a GPU",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed runs of each shape first (default 2; --quick 1)",
    )
    ap.add_argument(
        "--llm-kwargs",
        default="{}",
        help="JSON merged into every configuration's LLM kwargs",
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="every configuration (upstream included) on N GPUs: LLM(tensor_parallel_size=N); bytes, %%BW "
        "and the GB10 projection then per GPU / for N GB10s (default 1)",
    )
    ap.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="every configuration: LLM(enable_expert_parallel=True), experts spread over the N GPUs "
        "(needs --tensor-parallel-size > 1)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's sampling temperature (default 0: greedy; 1.0 is gpt-oss's usual serving "
        "setting, which the whole-model mode samples inside its graph with VLLM_SM121_GRAPH_SAMPLE=1, "
        "e2e config sm121-graph-sample)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="JSON output (default results/e2e.json; --dry-run: results/e2e_dryrun.json)",
    )
    ap.add_argument(
        "--timeout-per-config",
        type=float,
        default=1800.0,
        help="seconds (default 1800)",
    )
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="echo every vLLM log line (always kept in <out>.logs/)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU: print the plan and bytes per token, write JSON",
    )
    ap.add_argument(
        "--no-vllm-check",
        action="store_true",
        help="dry run: skip checking the LLM kwargs against the installed vLLM (saves its ~15 s import)",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="combine earlier --out files into one report",
    )
    args = ap.parse_args(argv)
    if args.tensor_parallel_size < 1:
        ap.error(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.enable_expert_parallel and args.tensor_parallel_size == 1:
        ap.error("--enable-expert-parallel needs --tensor-parallel-size N > 1 (it spreads the experts over "
                 "the N GPUs; with one GPU there is nothing to spread)")
    if args.merge:
        if args.out is None:
            ap.error("--merge needs --out")
        missing = [p for p in args.merge if not Path(p).is_file()]
        if missing:
            ap.error(f"--merge: no such file(s): {', '.join(missing)}")
        return args
    args.config_list = _csv(args.configs)
    bad = [c for c in args.config_list if c not in CONFIG_NAMES]
    if bad or not args.config_list:
        ap.error(
            f"--configs: unknown {', '.join(map(repr, bad)) or '(empty)'}; valid names: {', '.join(CONFIG_NAMES)}"
        )
    by_name = {c.name: c for c in CONFIGS}
    # in the order given
    args.config_objs = [by_name[c] for c in dict.fromkeys(args.config_list)]
    args.point_list = (
        _csv(args.points)
        if args.points
        else list(QUICK_POINTS if args.quick else FULL_POINTS)
    )
    bad = [p for p in args.point_list if p not in POINT_NAMES]
    if bad or not args.point_list:
        ap.error(
            f"--points: unknown {', '.join(map(repr, bad)) or '(empty)'}; valid names: {', '.join(POINT_NAMES)}"
        )
    args.model_list = args.model or [DEFAULT_MODEL]
    try:
        args.llm_kwargs_obj = json.loads(args.llm_kwargs)
    except ValueError as e:
        ap.error(
            f"--llm-kwargs: not JSON ({e}); e.g. '{{\"gpu_memory_utilization\": 0.85}}'"
        )
    if not isinstance(args.llm_kwargs_obj, dict):
        ap.error("--llm-kwargs: must be a JSON object of LLM(...) keyword arguments")
    if args.iters is None:
        args.iters = 3
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.iters < 1 or args.warmup < 0 or args.extra_iters < 0:
        ap.error("--iters must be >= 1, --warmup >= 0 and --extra-iters >= 0")
    if args.out is None:
        args.out = "results/e2e_dryrun.json" if args.dry_run else "results/e2e.json"
    try:
        args.plans = build_plan(args)
    except ValueError as e:
        ap.error(str(e))
    return args


def _out_path(text: str) -> Path:
    out = Path(text)
    out = out if out.is_absolute() else Path.cwd() / out
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _model_entry(m: ModelPlan) -> dict:
    return {
        "name": m.name,
        "path": str(m.path),
        "key": m.key,
        "hf_config": m.hf_config,
        "shape": model_shape(m.hf_config),
        "bytes_table": bytes_table(m),
        "dense_weights_what_if": dense_what_if(m),
        "runs": [{"plan": run, "config": run["config"]} for run in m.runs],
    }


def _finish(result: dict, out: Path, plot: bool) -> None:
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out}")
    if plot:
        note = write_plot(result, out.with_suffix(".png"))
        result["plot"] = note
        out.write_text(json.dumps(result, indent=1, default=str))
        print(note)


def merge_main(args) -> int:
    results = [json.loads(Path(p).read_text()) for p in args.merge]
    first = results[0]
    merged = {"header": dict(first["header"]), "models": [], "merged_from": []}
    for key in ("device", "mode", "vllm"):
        values = {str(r["header"].get(key)) for r in results}
        if len(values) > 1:
            print(f"WARNING: merging results with different {key}: {sorted(values)}")
    # files from before --tensor-parallel-size ran at TP=1
    tps = {(r["header"].get("tensor_parallel_size") or 1, bool(r["header"].get("enable_expert_parallel")))
           for r in results}
    if len(tps) > 1:
        print(f"WARNING: merging results with different (tensor_parallel_size, enable_expert_parallel): {sorted(tps)}")
    bws = [
        r["header"].get("copy_bandwidth_gbps")
        for r in results
        if r["header"].get("copy_bandwidth_gbps")
    ]
    merged["header"]["copy_bandwidth_gbps"] = statistics.median(bws) if bws else None
    by_name: dict[str, dict] = {}
    for path, r in zip(args.merge, results):
        h = r["header"]
        merged["merged_from"].append(
            {
                "file": path,
                "timestamp": h.get("timestamp"),
                "device": h.get("device"),
                "copy_bandwidth_gbps": h.get("copy_bandwidth_gbps"),
                "git_commit": h.get("git_commit"),
            }
        )
        for m in r["models"]:
            if m["path"] not in by_name:
                by_name[m["path"]] = dict(m, runs=[])
                merged["models"].append(by_name[m["path"]])
            by_name[m["path"]]["runs"].extend(m["runs"])
    for m in merged["models"]:  # re-estimate decode points from their raw timings (tg_estimate)
        for run in m["runs"]:
            batch = {p["name"]: p["batch"] for p in run["plan"]["points"]}
            for name, rec in (run.get("points") or {}).items():
                if rec.get("status") == "ok" and rec.get("t_n_s"):
                    for k in ("suspect", "tok_s_min", "tok_s_max"):
                        rec.pop(k, None)
                    rec.update(tg_estimate(rec["t_1_s"], rec["t_n_s"], rec["n"], batch[name]))
    derive_all(merged)
    print_results(merged)
    _finish(merged, _out_path(args.out), plot=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == CHILD_FLAG:
        return child_main(argv[1], argv[2])
    args = parse_args(argv)
    if args.merge:
        return merge_main(args)
    t_start = time.time()
    out = _out_path(args.out)
    plans: list[ModelPlan] = args.plans
    print_plan(plans, args)
    for m in plans:
        print_bytes_table(m)

    if args.dry_run:
        result = {
            "header": make_header(args, None),
            "models": [_model_entry(m) for m in plans],
        }
        rc = 0
        if not args.no_vllm_check:
            problems, notes = check_llm_kwargs(plans)
            result["vllm_check"] = {"problems": problems, "notes": notes}
            print(
                "\nLLM kwargs checked against the installed vLLM: "
                f"{'ok' if not problems else f'{len(problems)} problem(s)'}"
            )
            for line in problems + notes:
                print(f"  {line}")
            rc = 1 if problems else 0
        _finish(result, out, plot=False)
        print("dry run: nothing measured, no plot")
        return rc

    print("\nmeasuring the copy bandwidth ...", flush=True)
    copy_bw = run_child({"mode": "copy_bandwidth"}, None, 300, args.verbose)
    if copy_bw.get("error") or not copy_bw.get("gbps"):
        print(
            "benchmarks/e2e.py needs a CUDA GPU with vLLM 0.26.0 to measure anything "
            f"({copy_bw.get('error')}). Use --dry-run for the plan and the bytes model.",
            file=sys.stderr,
        )
        return 2
    print(f"copy bandwidth {copy_bw['gbps']:.0f} GB/s on {copy_bw['device']}")
    tp = max(tp_size(run["llm_kwargs"]) for m in plans for run in m.runs)
    problem = tp_gpu_problem(tp, copy_bw.get("device_count") or 1)
    if problem:  # each child would refuse the same way, after importing vLLM
        print(f"benchmarks/e2e.py: {problem}", file=sys.stderr)
        return 2
    result = {
        "header": make_header(args, copy_bw),
        "models": [_model_entry(m) for m in plans],
    }
    log_dir = out.with_suffix(".logs")
    log_dir.mkdir(exist_ok=True)
    total = sum(len(m.runs) for m in plans)
    done = 0
    for m, entry in zip(plans, result["models"]):
        for run in entry["runs"]:
            plan = run["plan"]
            bar = "#" * done + "-" * (total - done)
            print(
                f"\n{LOG_PREFIX} [{bar}] {done + 1}/{total} {m.name} / {plan['config']} "
                f"(elapsed {_fmt_dur(time.time() - t_start)})",
                flush=True,
            )
            spec = {
                "config": plan["config"],
                "llm_kwargs": plan["llm_kwargs"],
                "points": plan["points"],
                "skipped": plan["skipped"],
                "iters": args.iters,
                "extra_iters": args.extra_iters,
                "warmup": args.warmup,
                "seed": args.seed,
                "temperature": args.temperature,
                "cached_prompts": bool(getattr(args, "cached_prompts", False)),
                "random_router": bool(getattr(args, "random_router", False)),
                "vocab": m.hf_config["vocab_size"],
                "t0": t_start,
            }
            log_path = log_dir / f"{m.name}.{plan['config']}.log"
            res = run_child(spec, log_path, args.timeout_per_config, args.verbose, plan.get("env"))
            res.pop("config", None)
            res.pop("llm_kwargs", None)  # == plan["llm_kwargs"]
            run.update(res)
            done += 1
            derive_all(result)
            # after every configuration: partial results survive a killed run
            out.write_text(json.dumps(result, indent=1, default=str))
            if run.get("kv_cache_tokens"):
                print(f"{LOG_PREFIX} {plan['config']}: vLLM KV cache capacity {run['kv_cache_tokens']:,} tokens",
                      flush=True)
            if run.get("error"):
                print(f"{LOG_PREFIX} {plan['config']}: {run['error']}", flush=True)
                for line in run.get("error_log_lines") or []:
                    print(f"    {line[:300]}")
    result["header"]["elapsed_s"] = time.time() - t_start
    derive_all(result)
    print_results(result)
    _finish(result, out, plot=True)
    print(f"logs in {log_dir}; total {_fmt_dur(time.time() - t_start)}")
    ok = any(
        r.get("points") and not r.get("error")
        for m in result["models"]
        for r in m["runs"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
