"""Environment variables of vllm-sm121 (all prefixed VLLM_SM121_), read in one place."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    VLLM_SM121_FAULT: str = ""

# VLLM_SM121_FAULT (tests only): deliberately break one attention hyperparameter so end-to-end
# numerics checks can prove they detect it (negative control). "drop_sinks" ignores attention
# sinks; "no_window" ignores sliding windows. Unset in normal use; a set value is logged loudly.
FAULTS = ("", "drop_sinks", "no_window")

environment_variables = {
    "VLLM_SM121_FAULT": lambda: os.environ.get("VLLM_SM121_FAULT", ""),
}


# Every VLLM_SM121_* variable the package reads, declared here (design.md: one place), with the
# module that reads it and what it does; tests/test_envs.py checks that the package reads no other.
# Defaults and measurements: the comments next to each reader and the README's variable list.
DECLARED: dict[str, tuple[str, str]] = {
    "VLLM_SM121_FAULT": ("vllm_sm121/envs.py", "tests only: break one attention hyperparameter (negative control)"),
    "VLLM_SM121_MOE_EXPERIMENTAL": ("vllm_sm121/moe/__init__.py", "turn the plugin's MoE method on (opt-in gate)"),
    "VLLM_SM121_ROUTER_IN_NORM": ("vllm_sm121/config.py", "gpt-oss's router inside the post-attention norm (traced)"),
    "VLLM_SM121_ROPE_IN_QKV": ("vllm_sm121/config.py", "the rotary embedding inside the FP8 qkv GEMV (traced)"),
    "VLLM_SM121_KV_IN_QKV": ("vllm_sm121/config.py", "the nvfp4 KV write inside the qkv GEMV (opt-in, traced)"),
    "VLLM_SM121_NORM_IN_QKV": ("vllm_sm121/config.py", "the next layer's input norm carried from FC2 (traced)"),
    "VLLM_SM121_L2_PREFETCH": ("vllm_sm121/config.py", "L2 prefetches of the next GEMV's weights (traced)"),
    "VLLM_SM121_TP_FP32_REDUCE": ("vllm_sm121/config.py", "fp32 all-reduces of o_proj / MoE shares under TP (traced)"),
    "VLLM_SM121_TP_INVARIANT": ("vllm_sm121/config.py", "one rank computing as TP=2 / EP=2 (tp2, ep2; traced)"),
    "VLLM_SM121_KV_SCALE_TP_MAX": ("vllm_sm121/config.py", "nvfp4 scales from the max over all TP ranks' heads"),
    "VLLM_SM121_KV_SCALE_REAL": ("vllm_sm121/config.py", "nvfp4 scales reset from the first real tokens (opt-in)"),
    "VLLM_SM121_KV_IN_ATTN": ("vllm_sm121/attention/impl.py",
                              "decode steps' nvfp4 KV write inside the attention kernel (opt-in)"),
    "VLLM_SM121_ATTN_TILE": ("vllm_sm121/platform.py", "attention tile overrides per kernel kind"),
    "VLLM_SM121_MIXED_SPLIT": ("vllm_sm121/attention/metadata.py", "a mixed batch's decodes in their own launch"),
    "VLLM_SM121_ATTN_FUSED_COMBINE": ("kernels/paged_attention.py", "split merge inside the attention kernel"),
    "VLLM_SM121_ATTN_MIN_SPLIT_TOKENS": ("kernels/paged_attention.py", "minimum KV tokens per split"),
    "VLLM_SM121_ATTN_ONE_SPLIT_FINISH": ("kernels/paged_attention.py", "one-split rows finished without the merge"),
    "VLLM_SM121_ATTN_SCALE_WORDS": ("kernels/paged_attention.py", "nvfp4 scales loaded as int32 words"),
    "VLLM_SM121_DENSE_FMA_MAX_M": ("kernels/dense.py", "largest M on the FP8 FMA GEMV"),
    "VLLM_SM121_DENSE_FMA_TILES": ("kernels/dense.py", "FP8 FMA GEMV tiles"),
    "VLLM_SM121_DENSE_X_ROWS": ("kernels/dense.py", "FP8 FMA GEMV activations in the weight tile's layout (0: off)"),
    "VLLM_SM121_DENSE_MMAV_MAX_M": ("kernels/dense.py", "largest M on the FP8 MMA GEMV"),
    "VLLM_SM121_DENSE_MMAV_TILES": ("kernels/dense.py", "FP8 MMA GEMV tiles"),
    "VLLM_SM121_DENSE_W8A8_MIN_M": ("kernels/dense.py", "smallest M sent to vLLM's W8A8 GEMM"),
    "VLLM_SM121_GRAPH_FAST_PATH": ("vllm_sm121/graph/steady.py", "whole-model mode stage B (steady steps)"),
    "VLLM_SM121_GRAPH_FAST_SAMPLED": ("vllm_sm121/graph/steady.py", "stage B for sampled / logprob batches"),
    "VLLM_SM121_GRAPH_PATCH_PAGES": ("vllm_sm121/graph/steady.py", "new KV pages from pinned memory"),
    "VLLM_SM121_GRAPH_SAMPLE": ("vllm_sm121/graph/tail.py", "sampling inside the graph (1, 2; opt-in)"),
    "VLLM_SM121_MOE_ACT_LDG": ("kernels/moe.py", "MoE activation loads through the non-coherent path"),
    "VLLM_SM121_MOE_FMA_WINDOW_MAX_TOKENS": ("kernels/moe.py", "largest M of the windowed FMA MoE path (per family by default; 0: off)"),
    "VLLM_SM121_MOE_FMA_F16X2": ("kernels/moe.py", "MoE GEMV products in fp16 (0 exact, 1 word, 2 group)"),
    "VLLM_SM121_MOE_FMA_MAXNREG": ("kernels/moe.py", "ptxas register cap for the MoE GEMVs"),
    "VLLM_SM121_MOE_FMA_MAX_TOKENS": ("kernels/moe.py", "largest M on the MoE FMA path"),
    "VLLM_SM121_MOE_FMA_TILES": ("kernels/moe.py", "MoE FMA GEMV tiles"),
    "VLLM_SM121_MOE_FUSED_COMBINE": ("kernels/moe.py", "the combine inside FC2"),
    "VLLM_SM121_MOE_FUSED_ROUTE": ("kernels/moe.py", "the routing inside FC1"),
    "VLLM_SM121_MOE_GROUPED_TILE": ("kernels/moe.py", "grouped-GEMM tile override (bk ignored under the halves decoder)"),
    "VLLM_SM121_MOE_GROUPED_HALVES": ("kernels/moe.py", "grouped GEMMs' halves weight decoder (0: checkpoint order)"),
    "VLLM_SM121_MOE_GROUPED_ACT_BF16": ("kernels/moe.py", "grouped FC1 / FC2 with bf16 halves-order activations (opt-in; N: tiles of >= N tokens; not on sm_90)"),
    "VLLM_SM121_MOE_PDL": ("kernels/moe.py", "programmatic dependent launch for the MoE kernels"),
    "VLLM_SM121_MOE_SCALES_AHEAD": ("kernels/moe.py", "next K step's weight scales loaded ahead"),
    "VLLM_SM121_MOE_SCALE_LDG": ("kernels/moe.py", "MoE scale loads through the non-coherent path"),
    "VLLM_SM121_NORM_IN_QKV_MAX_T": ("kernels/next_norm.py", "largest batch carrying the input norm"),
    "VLLM_SM121_NORM_ROUTER_TILES": ("kernels/norm_mxfp8.py", "norm + router kernel tiles"),
    "VLLM_SM121_PDL": ("kernels/_validate.py", "programmatic dependent launch for the GEMVs"),
}


def env_int(name: str, default: int) -> int:
    """Integer environment variable ``name`` (read now), ``default`` when unset or blank; any
    other non-integer text is an error naming the variable."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name}={text!r}: expected an integer") from None


def __getattr__(name: str):
    if name in environment_variables:
        value = environment_variables[name]()
        if name == "VLLM_SM121_FAULT" and value not in FAULTS:
            raise ValueError(f"VLLM_SM121_FAULT={value!r} is not supported; supported: {FAULTS[1:]} or unset")
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return list(environment_variables)
