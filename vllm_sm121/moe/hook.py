"""Model-level hook for gpt-oss: the post-attention add+RMSNorm emits MXFP8 straight into the experts.

Architecture
    ``Sm121GptOssBlock`` subclasses vLLM's gpt-oss ``TransformerBlock`` and is installed as
    ``GptOssModel.block_cls`` (the documented override point; shim ``compat.register_gpt_oss_fused_moe_block``,
    upstream proposal ``patches/vllm/0004-gpt-oss-fused-norm-mxfp8-moe-hook.patch``). After the
    upstream constructor ran, it decides once per layer (``fused_moe_unsupported_reason``) whether
    its experts run ``Sm121Mxfp4MoEMethod`` in a configuration the fused path covers. If so,
    ``forward`` runs attention as upstream (under TP with o_proj's share all-reduced in fp32,
    ``o_proj_fp32_reduce``), then ``hooked_mlp_forward``:

        sm121::add_rmsnorm_mxfp8  residual += x; y = rmsnorm(residual) * w  -> y bf16 (router),
                                  y MXFP8 (e4m3 values + e8m0 scale per 32, experts); one kernel
        router                    upstream's bf16 ReplicatedLinear on y; for batches of up to 8 tokens
                                  computed inside the norm kernel instead (sm121::add_rmsnorm_mxfp8_router,
                                  which returns a new residual rather than updating it in place;
                                  $VLLM_SM121_ROUTER_IN_NORM=0 turns that off)
        sm121::gpt_oss_moe_mxfp8  ``kernels.moe.moe_block`` on the MXFP8 activations (routing,
                                  FC1+SwiGLU, FC2+combine; no quantization kernel in between)

    Otherwise ``forward`` is upstream's (``super().forward``), so installing the class changes
    nothing for layers on any other MoE method.

    With ``"dense_weights": "fp8"`` (default on since stop 27; $VLLM_SM121_ROPE_IN_QKV=0 turns it
    off): the attention's rotary embedding runs inside the FP8 qkv GEMV (``hooked_attn_forward``, op
    ``sm121::dense_fp8_linear_rope``) instead of as upstream's ``rotary_emb`` after it; opt-in
    ($VLLM_SM121_KV_IN_QKV=1, nvfp4 cache) the same GEMV also writes the KV cache
    (``sm121::dense_fp8_linear_rope_kv``).

    Both ops are torch custom ops (``direct_register_custom_op``, library ``sm121``) with fake
    implementations, taking the weights as tensor arguments, so vLLM's torch.compile and
    piecewise/full CUDA graphs trace them; outputs are allocated from input shapes only.
    ``add_rmsnorm_mxfp8`` updates ``residual`` in place (declared as mutated), as vLLM's own
    ``fused_add_rms_norm`` does.

Constraints
    The fused path takes tensor parallelism (each rank's intermediate shard) and expert
    parallelism (the rank's experts, ``expert_map``) over one TP group, and then all-reduces the
    experts' output itself, as vLLM's MoE runner would (``tensor_model_parallel_all_reduce``): by
    default in fp32, each rank's share unrounded and the sum rounded to bf16 once, and likewise
    o_proj's (``o_proj_fp32_reduce``; $VLLM_SM121_TP_FP32_REDUCE=0 gives upstream's bf16 reduces;
    upstream proposal ``patches/vllm/0008-row-parallel-fp32-all-reduce.patch``). It
    needs DP = PCP = 1 and no sequence-parallel MoE (no token dispatch/combine), no LoRA, no
    batch-invariant mode,
    bf16 activations, not ROCm (upstream's router uses a ROCm-only GEMM there), and upstream's
    ``MLPBlock``/``RMSNorm`` forward (no subclass overriding them). Any other configuration falls
    back to upstream's block (``super().forward``); ``Sm121Mxfp4MoEMethod`` then still runs the
    experts through vLLM's ``moe_forward`` op from bf16.

Limitations
    The decision is taken at construction: later replacements of the experts' quant method
    (EPLB, MoE LoRA) are excluded by the checks above rather than detected. Gated with the rest of
    the MoE (``vllm_sm121.moe.READY``; ``$VLLM_SM121_MOE_EXPERIMENTAL=1`` opts in). Run on an H100
    at bd8218e: gpt-oss-120b end to end and the decode-step profile (README); at TP=2 and EP=2 on
    two H100s at 8d2b6c6 (``tests/test_tp_gpu.py``, eager; under graphs at TP=2 not run yet).

upstream file: ``vllm/model_executor/models/gpt_oss.py`` (``TransformerBlock``, ``MLPBlock``,
``GptOssModel.block_cls``).
"""

from __future__ import annotations

import os

import torch
from vllm.model_executor.models.gpt_oss import MLPBlock, TransformerBlock

from vllm_sm121.config import (  # noqa: F401 (re-exported)
    ROUTER_IN_NORM_ENV, TRACED_KEY, record_traced_choices, traced_choices, traced_env_choices)

from .method import local_expert_map


# ---- custom ops ------------------------------------------------------------------------------

def _add_rmsnorm_mxfp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from vllm_sm121.kernels.norm_mxfp8 import fused_add_rmsnorm_mxfp8

    return fused_add_rmsnorm_mxfp8(x, residual, weight, eps)


def _add_rmsnorm_mxfp8_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, h = x.shape
    return (torch.empty_like(x), torch.empty(t, h, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty(t, h // 32, dtype=torch.uint8, device=x.device))


def _add_rmsnorm_mxfp8_router(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              router_w: torch.Tensor, router_b: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from vllm_sm121.kernels.norm_mxfp8 import fused_add_rmsnorm_mxfp8_router

    return fused_add_rmsnorm_mxfp8_router(x, residual, weight, router_w, router_b, eps)


def _add_rmsnorm_mxfp8_router_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                   router_w: torch.Tensor, router_b: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    t, h = x.shape
    return (torch.empty_like(x), torch.empty(t, h, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty(t, h // 32, dtype=torch.uint8, device=x.device),
            torch.empty(t, router_w.shape[0], dtype=torch.bfloat16, device=x.device))


def _gpt_oss_moe_mxfp8(x: torch.Tensor, x_scale: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                       w13_scale: torch.Tensor, w13_bias: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                       w2_bias: torch.Tensor, topk: int, expert_map: torch.Tensor | None = None,
                       l2_key: str = "", residual: torch.Tensor | None = None, norm_key: str = "",
                       f32_out: bool = False) -> torch.Tensor:
    from vllm_sm121 import l2_plan
    from vllm_sm121.kernels.moe import moe_block
    from vllm_sm121.kernels.next_norm import NextNorm, carry_tokens

    nn = None
    if norm_key and residual is not None and 0 < x.shape[0] <= carry_tokens():  # (vllm_sm121/moe/carry.py)
        from . import carry

        nn = NextNorm(residual, carry.norm_weight(norm_key), carry.buffers(norm_key, w2.shape[1], x.device))
    return moe_block(x, router_logits.contiguous(), w13, w13_scale, w13_bias, w2, w2_scale, w2_bias, topk,
                     x_scale=x_scale, expert_map=expert_map, l2=l2_plan.moe_plan(l2_key), next_norm=nn,
                     out_dtype=torch.float32 if f32_out else torch.bfloat16)


def _gpt_oss_moe_mxfp8_fake(x: torch.Tensor, x_scale: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                            w13_scale: torch.Tensor, w13_bias: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                            w2_bias: torch.Tensor, topk: int, expert_map: torch.Tensor | None = None,
                            l2_key: str = "", residual: torch.Tensor | None = None, norm_key: str = "",
                            f32_out: bool = False) -> torch.Tensor:
    return torch.empty(x.shape[0], w2.shape[1], dtype=torch.float32 if f32_out else torch.bfloat16, device=x.device)


def _linear_f32(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 [M, N] = x [M, K] @ w [N, K]^T (+ bias), bf16 inputs, fp32 accumulation, no rounding to bf16."""
    if x.is_cuda:
        y = torch.mm(x, w.t(), out_dtype=torch.float32)
    else:
        y = x.float() @ w.float().t()
    return y + bias.float() if bias is not None else y


def _linear_f32_fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)


def _register_ops() -> None:
    from vllm_sm121.ops import register_op

    register_op("add_rmsnorm_mxfp8", _add_rmsnorm_mxfp8, _add_rmsnorm_mxfp8_fake, mutates_args=["residual"])
    register_op("add_rmsnorm_mxfp8_router", _add_rmsnorm_mxfp8_router, _add_rmsnorm_mxfp8_router_fake)
    register_op("gpt_oss_moe_mxfp8", _gpt_oss_moe_mxfp8, _gpt_oss_moe_mxfp8_fake)
    register_op("linear_f32", _linear_f32, _linear_f32_fake)


_register_ops()  # once per process (module import); the dispatch key is the current platform's


def add_rmsnorm_mxfp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(y bf16 [T, H], e4m3 [T, H], e8m0 [T, H/32]); ``residual += x`` in place."""
    return torch.ops.sm121.add_rmsnorm_mxfp8(x, residual, weight, eps)


def add_rmsnorm_mxfp8_router(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             router_w: torch.Tensor, router_b: torch.Tensor):
    """(x + residual bf16 [T, H], e4m3 [T, H], e8m0 [T, H/32], router logits bf16 [T, E]); ``residual``
    is not modified (small batches: one kernel, the router GEMV inside the norm)."""
    return torch.ops.sm121.add_rmsnorm_mxfp8_router(x, residual, weight, eps, router_w, router_b)


def gpt_oss_moe_mxfp8(x, x_scale, router_logits, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias, topk: int,
                      expert_map: torch.Tensor | None = None, l2_key: str = "", residual: torch.Tensor | None = None,
                      norm_key: str = "", f32_out: bool = False) -> torch.Tensor:
    """bf16 [T, H]: gpt-oss routed experts on MXFP8 activations (``kernels.moe.moe_block``); under
    expert parallelism this rank's share (``expert_map`` int32 [E], global -> local or -1). ``l2_key``:
    the block's key in ``vllm_sm121.l2_plan`` (its L2 prefetches; "" none). ``norm_key`` (with the
    block's ``residual``): the next layer's carried input norm (``vllm_sm121/moe/carry.py``) is
    written too, for up to ``kernels.next_norm.carry_tokens()`` tokens. ``f32_out``: the rank's share
    in fp32, unrounded (for an fp32 all-reduce; ``fp32_reduce``)."""
    return torch.ops.sm121.gpt_oss_moe_mxfp8(x, x_scale, router_logits, w13, w13_scale, w13_bias, w2, w2_scale,
                                             w2_bias, topk, expert_map, l2_key, residual, norm_key, f32_out)


# ---- the block -------------------------------------------------------------------------------

def routed_experts_of(mlp: torch.nn.Module):
    """The RoutedExperts layer (weights + quant method) behind ``MLPBlock.experts`` (a MoERunner)."""
    experts = getattr(mlp, "experts", None)
    return getattr(experts, "routed_experts", None)


def hooked_mlp_forward(hidden_states: torch.Tensor, residual: torch.Tensor, norm: torch.nn.Module,
                       mlp: torch.nn.Module, router_in_norm: bool = False,
                       l2_key: str = "", norm_out_key: str = "",
                       fp32_reduce: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's ``post_attention_layernorm(h, residual)`` + ``mlp(h)``, with the norm emitting MXFP8
    for the experts (and, ``router_in_norm``, the router's logits): returns (MoE output bf16 [T, H],
    the updated residual). ``norm_out_key``: FC2 also writes the next layer's carried input norm
    (one rank only: no all-reduce follows). ``fp32_reduce`` (TP / EP): the ranks' shares are
    all-reduced in fp32 and rounded to bf16 once after it, as one rank rounds its whole sum. On a
    one-rank engine in the TP-invariant mode (experts' ``sm121_sim_parts``, method.py): the
    simulated ranks' fp32 shares, one after another, summed in fp32 and rounded once."""
    if router_in_norm:
        residual, xq, xs, router_logits = add_rmsnorm_mxfp8_router(
            hidden_states, residual, norm.weight, norm.variance_epsilon, mlp.router.weight, mlp.router.bias)
    else:
        y, xq, xs = add_rmsnorm_mxfp8(hidden_states, residual, norm.weight, norm.variance_epsilon)
        router_logits = mlp.router(y)
    e = routed_experts_of(mlp)
    parts = getattr(e, "sm121_sim_parts", 0)
    if parts:  # $VLLM_SM121_TP_INVARIANT: the ranks' fp32 shares, summed as the fp32 all-reduce sums them
        from .method import SHARDED_WEIGHTS

        out = None
        for r in range(parts):
            w = [getattr(e, f"sm121_sim{r}_{name}") for name in SHARDED_WEIGHTS]
            share = gpt_oss_moe_mxfp8(xq, xs, router_logits, *w, e.quant_method.topk,
                                      getattr(e, f"sm121_sim{r}_expert_map", None), "", None, "", True)
            out = share if out is None else out + share
        return out.to(torch.bfloat16), residual
    par = e.moe_config.moe_parallel_config
    shared = par.tp_size > 1 or par.ep_size > 1  # each rank holds a share of the experts' sum
    out = gpt_oss_moe_mxfp8(xq, xs, router_logits, e.w13_weight, e.w13_weight_scale, e.w13_bias, e.w2_weight,
                            e.w2_weight_scale, e.w2_bias, e.quant_method.topk, local_expert_map(e), l2_key,
                            residual if norm_out_key else None, norm_out_key, shared and fp32_reduce)
    if shared:
        from vllm.distributed import tensor_model_parallel_all_reduce

        out = tensor_model_parallel_all_reduce(out).to(torch.bfloat16)
    return out, residual


def o_proj_fp32_reduce_unsupported_reason(attn: torch.nn.Module, one_rank: bool = False) -> str | None:
    """Why this attention's o_proj cannot take ``o_proj_fp32_reduce`` (None: it can): it must be
    upstream's RowParallelLinear over a TP group of more than one rank (any, ``one_rank``: the
    TP-invariant mode), reducing its own result, on bf16 weights or the plugin's FP8 ones, inside
    upstream's OAIAttention."""
    from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod
    from vllm.model_executor.models.gpt_oss import OAIAttention

    from vllm_sm121.dense.method import Sm121DenseFp8LinearMethod

    o = getattr(attn, "o_proj", None)
    checks = (
        (not isinstance(attn, OAIAttention) or type(attn).forward is not OAIAttention.forward,
         "attention is not upstream's OAIAttention"),
        (not isinstance(o, RowParallelLinear) or type(o).forward is not RowParallelLinear.forward,
         "o_proj is not upstream's RowParallelLinear"),
        (getattr(o, "tp_size", 1) <= 1 and not one_rank, "one rank"),
        (not getattr(o, "reduce_results", False) or not getattr(o, "input_is_parallel", False)
         or getattr(o, "skip_bias_add", False), "o_proj does not reduce its own full result"),
        (type(getattr(o, "quant_method", None)) not in (UnquantizedLinearMethod, Sm121DenseFp8LinearMethod),
         "o_proj weights neither bf16 nor the plugin's FP8"),
    )
    for bad, what in checks:
        if bad:
            return what
    return None


def o_proj_fp32_reduce(o_proj: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``o_proj(x)[0]`` of a row-parallel o_proj (``o_proj_fp32_reduce_unsupported_reason``) with the
    rank's partial product in fp32 (bias on rank 0, as upstream), all-reduced in fp32 over vLLM's TP
    group and rounded to bf16 once: what one rank computes, up to fp32 summation order, where
    upstream rounds each rank's partial and then their bf16 sum.

    On a one-rank engine in the TP-invariant mode (``o_proj.sm121_sim_parts`` = 2, set by the block):
    the two K halves' fp32 products, as the two ranks compute them (the FP8 weight's halves from
    ``sm121_w_parts``), summed in fp32 and rounded once, the fp32 all-reduce's sum."""
    parts = getattr(o_proj, "sm121_sim_parts", 0)
    if not parts:
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(_o_proj_share_f32(o_proj, x, o_proj.weight,
                                                                  o_proj.tp_rank == 0)).to(x.dtype)
    k = x.shape[-1] // parts
    fp8_parts = getattr(o_proj, "sm121_w_parts", None)
    out = None
    for r in range(parts):
        # (bf16: the half copied per call, so cuBLAS sees the contiguous operand a rank holds; slow, opt-in)
        w = fp8_parts[r] if fp8_parts is not None else o_proj.weight[:, r * k:(r + 1) * k].contiguous()
        share = _o_proj_share_f32(o_proj, x[..., r * k:(r + 1) * k], w, r == 0)
        out = share if out is None else out + share
    return out.to(x.dtype)


def _o_proj_share_f32(o_proj: torch.nn.Module, x: torch.Tensor, w: torch.Tensor, with_bias: bool) -> torch.Tensor:
    """One rank's fp32 o_proj share x @ w^T (+ bias where ``with_bias``), leading dims kept."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from vllm_sm121.dense.method import Sm121DenseFp8LinearMethod, dense_fp8_linear

    bias = o_proj.bias if with_bias else None
    qm = o_proj.quant_method  # (read at run time: the FP8 conversion swaps it after the block's construction)
    if isinstance(qm, Sm121DenseFp8LinearMethod):
        return dense_fp8_linear(x.contiguous(), w, o_proj.weight_scale, bias, f32_out=True)
    if type(qm) is UnquantizedLinearMethod:
        y = torch.ops.sm121.linear_f32(x.reshape(-1, x.shape[-1]).contiguous(), w, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    flag = ("unset VLLM_SM121_TP_INVARIANT" if getattr(o_proj, "sm121_sim_parts", 0)
            else "set VLLM_SM121_TP_FP32_REDUCE=0")
    raise ValueError(f"o_proj's fp32 all-reduce takes bf16 or the plugin's FP8 weights, not "
                     f"{type(qm).__name__}; {flag}")


def fused_moe_unsupported_reason(block: torch.nn.Module, vllm_config) -> str | None:
    """Why this block cannot take the fused norm->MXFP8->MoE path (None: it can)."""
    from vllm import envs
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.platforms import current_platform

    from .method import Sm121Mxfp4MoEMethod

    mlp, norm = block.mlp, block.post_attention_layernorm
    experts = routed_experts_of(mlp)
    if experts is None or not isinstance(getattr(experts, "quant_method", None), Sm121Mxfp4MoEMethod):
        return "experts not on Sm121Mxfp4MoEMethod"
    par = experts.moe_config.moe_parallel_config
    runner = mlp.experts
    checks = (
        (type(mlp).forward is not MLPBlock.forward, f"MLP {type(mlp).__name__} overrides forward"),
        (not isinstance(norm, RMSNorm) or type(norm).forward_native is not RMSNorm.forward_native
         or not norm.has_weight or norm.variance_size_override is not None,
         "post-attention norm is not upstream's weighted RMSNorm"),
        (getattr(mlp, "is_sequence_parallel", False), "sequence-parallel MoE"),
        (par.dp_size != 1 or par.pcp_size != 1 or par.use_all2all_kernels,
         f"data/context-parallel MoE (dp={par.dp_size}, pcp={par.pcp_size})"),
        (getattr(experts.moe_config, "skip_final_all_reduce", False), "MoE output reduced downstream"),
        (getattr(vllm_config, "lora_config", None) is not None, "LoRA"),
        (envs.VLLM_BATCH_INVARIANT, "VLLM_BATCH_INVARIANT"),
        (current_platform.is_rocm(), "ROCm"),
        (getattr(runner, "shared_experts", None) is not None or getattr(runner, "gate", None) is not None,
         "shared experts or a runner-held gate"),
        (getattr(getattr(vllm_config, "model_config", None), "dtype", torch.bfloat16) != torch.bfloat16,
         "activations not bf16"),
        (experts.w2_weight.shape[1] != norm.weight.shape[0], "padded hidden size"),
    )
    for bad, what in checks:
        if bad:
            return what
    return None


# The router GEMV inside the post-attention norm kernel (``kernels.norm_mxfp8.fused_add_rmsnorm_mxfp8_router``)
# for batches of up to ROUTER_FUSED_MAX_TOKENS tokens: on by default where the router qualifies
# (``router_in_norm_unsupported_reason``); VLLM_SM121_ROUTER_IN_NORM=0 keeps upstream's router GEMM
# after the norm. Read when the config is checked and recorded in it (``config.record_traced_choices``:
# vLLM's compile-cache key must see it), else when the model is built.


def router_in_norm_unsupported_reason(mlp: torch.nn.Module, hidden_size: int | None = None) -> str | None:
    """Why gpt-oss's router cannot run inside the norm kernel (None: it can): it must be upstream's
    unquantized bf16 linear over the hidden size, replicated, adding a bf16 bias of its own."""
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod

    router = getattr(mlp, "router", None)
    if not isinstance(router, ReplicatedLinear) or type(router).forward is not ReplicatedLinear.forward:
        return "router is not upstream's ReplicatedLinear"
    if not isinstance(getattr(router, "quant_method", None), UnquantizedLinearMethod):
        return "quantized router"
    if getattr(router, "skip_bias_add", False):
        return "router returns its bias separately"
    w, b = router.weight, getattr(router, "bias", None)
    if (w.dtype != torch.bfloat16 or w.ndim != 2 or w.stride(-1) != 1
            or (hidden_size is not None and w.shape[1] != hidden_size)):
        return "router weight not bf16 [E, hidden] with a contiguous last dimension"
    if b is None or b.shape != (w.shape[0],) or b.dtype != w.dtype or b.stride(0) != 1:
        return "router bias not a contiguous bf16 [E]"
    return None


# gpt-oss's rotary embedding inside the FP8 qkv GEMV's epilogue (default on, VLLM_SM121_ROPE_IN_QKV=0
# turns it off; recorded with the other traced choices): the two rotation kernels Inductor makes of upstream's
# ``rotary_emb(positions, q, k)`` go; decode batches rotate in the GEMV (``kernels.dense``), larger
# ones right after it in torch (``rope_neox_``). Needs ``"dense_weights": "fp8"`` (the GEMV is the
# plugin's), upstream's OAIAttention forward and a plain NeoX rotation over whole heads.


def rope_in_qkv_unsupported_reason(attn: torch.nn.Module, vllm_config) -> str | None:
    """Why this attention layer's rotation cannot run in the qkv GEMV (None: it can)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.models.gpt_oss import OAIAttention

    from vllm_sm121.config import parse

    try:
        dense = parse(getattr(vllm_config, "additional_config", None)).dense_weights
    except ValueError:
        dense = None
    rope = getattr(attn, "rotary_emb", None)
    qkv = getattr(attn, "qkv_proj", None)
    checks = (
        (dense != "fp8", '"dense_weights" is not "fp8" (the rotation runs in the plugin\'s FP8 qkv GEMV)'),
        (not isinstance(attn, OAIAttention) or type(attn).forward is not OAIAttention.forward,
         "attention is not upstream's OAIAttention"),
        (not isinstance(rope, RotaryEmbedding) or type(rope).forward_native is not RotaryEmbedding.forward_native
         or type(rope).forward_cuda is not RotaryEmbedding.forward_cuda, "rotary embedding is not upstream's plain one"),
        (rope is not None and (not rope.is_neox_style or rope.rotary_dim != rope.head_size
                               or rope.head_size != getattr(attn, "head_dim", None)),
         "rotation not NeoX over whole heads"),
        (qkv is None or getattr(qkv, "skip_bias_add", False) or getattr(qkv, "bias", None) is None,
         "qkv projection without its own bias"),
    )
    for bad, what in checks:
        if bad:
            return what
    return None


def kv_in_qkv_unsupported_reason(attn: torch.nn.Module, vllm_config) -> str | None:
    """Why the qkv GEMV cannot also write this layer's KV cache (None: it can). Asked only where
    the rotation runs in the GEMV already."""
    from vllm_sm121.attention.impl import SM121AttentionImpl

    layer = getattr(attn, "attn", None)
    impl = getattr(layer, "impl", None)
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    checks = (
        (cache_dtype != "nvfp4", f"--kv-cache-dtype is {cache_dtype!r}, not nvfp4"),
        (not isinstance(impl, SM121AttentionImpl), "the attention backend is not SM121"),
        (getattr(layer, "kv_sharing_target_layer_name", None) is not None, "the layer shares another's KV cache"),
        (getattr(layer, "calculate_kv_scales", False), "the layer calculates KV scales"),
        (getattr(layer, "attn_backend", None) is not None and layer.attn_backend.forward_includes_kv_cache_update,
         "the backend writes the cache in its forward"),
    )
    for bad, what in checks:
        if bad:
            return what
    return None


def norm_in_qkv_unsupported_reason(block: torch.nn.Module) -> str | None:
    """Why this block cannot take part in carrying the input norm from the previous layer's FC2 into
    its qkv GEMV (None: it can). Asked where the rotation runs in the GEMV and the KV write does not."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    from vllm_sm121.kernels.next_norm import NEXT_NORM_CHUNK

    norm = block.input_layernorm
    par = routed_experts_of(block.mlp).moe_config.moe_parallel_config
    checks = (
        (par.tp_size != 1 or par.ep_size != 1,
         f"tensor/expert parallel MoE (tp={par.tp_size}, ep={par.ep_size}): the all-reduce comes between FC2 and the add"),
        (not isinstance(norm, RMSNorm) or type(norm).forward_native is not RMSNorm.forward_native
         or type(norm).forward_cuda is not RMSNorm.forward_cuda or not norm.has_weight
         or norm.variance_size_override is not None, "input norm is not upstream's weighted RMSNorm"),
        (norm.weight.shape[0] % NEXT_NORM_CHUNK, f"hidden size not a multiple of {NEXT_NORM_CHUNK}"),
    )
    for bad, what in checks:
        if bad:
            return what
    return None


def hooked_attn_forward(attn: torch.nn.Module, hidden_states: torch.Tensor, positions: torch.Tensor,
                        kv_in_qkv: bool = False, norm: tuple | None = None, fp32_reduce: bool = False):
    """Upstream's ``OAIAttention.forward`` with the rotation inside the qkv GEMV
    (``sm121::dense_fp8_linear_rope``); with ``kv_in_qkv`` the GEMV writes the KV cache too
    (``sm121::dense_fp8_linear_rope_kv``) and the attention op runs without vLLM's own
    ``unified_kv_cache_update`` (``Attention.forward`` otherwise, for this backend and layer).
    ``norm=(residual, input_layernorm, key)``: ``hidden_states`` is the previous layer's output and
    the input norm runs in the same op (``sm121::dense_fp8_linear_rope_norm``, carried from the
    previous FC2 under ``key`` at decode); returns (output, the new residual) then. ``fp32_reduce``:
    o_proj through ``o_proj_fp32_reduce``."""
    from vllm_sm121.dense.method import dense_fp8_linear_rope, dense_fp8_linear_rope_kv, dense_fp8_linear_rope_norm

    def o_proj(x):
        return o_proj_fp32_reduce(attn.o_proj, x) if fp32_reduce else attn.o_proj(x)[0]

    qkv_proj = attn.qkv_proj
    args = (hidden_states, qkv_proj.weight, qkv_proj.weight_scale, qkv_proj.bias, positions,
            attn.rotary_emb.cos_sin_cache, attn.q_size + attn.kv_size, attn.head_dim)
    if norm is not None:
        residual, layernorm, key = norm
        qkv, residual = dense_fp8_linear_rope_norm(hidden_states, residual, layernorm.weight, layernorm.variance_epsilon,
                                                   *args[1:], key)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        return o_proj(attn.attn(q, k, v)), residual
    if not kv_in_qkv:
        q, k, v = dense_fp8_linear_rope(*args).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        return o_proj(attn.attn(q, k, v))
    from vllm.utils.torch_utils import _encode_layer_name

    layer = attn.attn
    qkv, dep = dense_fp8_linear_rope_kv(*args, layer.layer_name)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    out = torch.empty(q.shape[0], layer.num_heads * layer.head_size_v, dtype=q.dtype, device=q.device)
    torch.ops.vllm.unified_attention_with_output(
        q.view(-1, layer.num_heads, layer.head_size), k.view(-1, layer.num_kv_heads, layer.head_size),
        v.view(-1, layer.num_kv_heads, layer.head_size_v), out.view(-1, layer.num_heads, layer.head_size_v),
        _encode_layer_name(layer.layer_name), kv_cache_dummy_dep=dep)
    return o_proj(out)


def attn_forward_fp32_reduce(attn: torch.nn.Module, hidden_states: torch.Tensor, positions: torch.Tensor):
    """Upstream's ``OAIAttention.forward`` with o_proj through ``o_proj_fp32_reduce``."""
    qkv, _ = attn.qkv_proj(hidden_states)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = attn.rotary_emb(positions, q, k)
    return o_proj_fp32_reduce(attn.o_proj, attn.attn(q, k, v))


class Sm121GptOssBlock(TransformerBlock):
    """gpt-oss ``TransformerBlock`` whose post-attention norm feeds MXFP8 to ``Sm121Mxfp4MoEMethod``."""

    def __init__(self, vllm_config, quant_config, prefix: str = ""):
        super().__init__(vllm_config, quant_config, prefix=prefix)
        reason = fused_moe_unsupported_reason(self, vllm_config)
        self.sm121_fused_moe = reason is None  # decided once; forward branches on this constant
        choices = traced_choices(vllm_config)
        self.sm121_router_in_norm = (
            self.sm121_fused_moe and choices["router_in_norm"]
            and router_in_norm_unsupported_reason(self.mlp, self.post_attention_layernorm.weight.shape[0]) is None)
        if reason is not None and routed_experts_of(self.mlp) is not None and reason != (
                "experts not on Sm121Mxfp4MoEMethod"):
            from vllm.logger import init_logger

            init_logger("vllm.sm121").warning_once(
                "gpt-oss MoE: the fused norm->MXFP8 path is off (%s); the experts quantize bf16 inputs", reason)
        # The rotation inside the qkv GEMV: decided here from the config (the FP8 conversion of
        # qkv_proj happens after construction; forward also checks that it did).
        self.sm121_rope_in_qkv = False
        from vllm_sm121.dense.method import Sm121DenseFp8LinearMethod

        self._sm121_dense_fp8 = Sm121DenseFp8LinearMethod  # (a class: forward's check stays a traced constant)
        if self.sm121_fused_moe and choices.get("rope_in_qkv", False):
            why = rope_in_qkv_unsupported_reason(self.attn, vllm_config)
            self.sm121_rope_in_qkv = why is None
            if why is not None:  # a warning where asked for explicitly; the default just notes it
                from vllm.logger import init_logger

                from vllm_sm121.config import ROPE_IN_QKV_ENV

                log = init_logger("vllm.sm121")
                (log.warning_once if os.environ.get(ROPE_IN_QKV_ENV, "").strip() else log.info_once)(
                    "gpt-oss: the rotation inside the qkv GEMV ($VLLM_SM121_ROPE_IN_QKV) is not applied (%s); "
                    "it runs as upstream's", why)
        # L2 prefetches of the next GEMV's weights ($VLLM_SM121_L2_PREFETCH; vllm_sm121/l2_plan.py)
        self.sm121_l2_key = ""
        if self.sm121_fused_moe:
            from vllm_sm121 import l2_plan

            targets = l2_plan.targets_from(choices.get("l2_prefetch", ""))
            if targets:
                self.sm121_l2_key = l2_plan.install(self, prefix, targets)
        # The KV-cache write inside the same GEMV (opt-in $VLLM_SM121_KV_IN_QKV=1; a traced choice).
        self.sm121_kv_in_qkv = False
        if choices.get("kv_in_qkv", False):
            why = (kv_in_qkv_unsupported_reason(self.attn, vllm_config) if self.sm121_rope_in_qkv
                   else "the rotation does not run inside the qkv GEMV")
            self.sm121_kv_in_qkv = why is None
            if why is not None:
                from vllm.logger import init_logger

                init_logger("vllm.sm121").warning_once(
                    "gpt-oss: $VLLM_SM121_KV_IN_QKV=1 is not applied (%s); vLLM writes the KV cache", why)
        # fp32 all-reduces of the o_proj and MoE shares under TP / EP (default on since stop 34,
        # $VLLM_SM121_TP_FP32_REDUCE=0 turns it off; a traced choice): TP=1's bf16 roundings at TP=2.
        self.sm121_fp32_reduce_moe = self.sm121_fp32_reduce_o = False
        self.sm121_tp_invariant = choices.get("tp_invariant", "")
        if self.sm121_tp_invariant:
            self._simulate_two_ranks(vllm_config)
        elif self.sm121_fused_moe and choices.get("tp_fp32_reduce", True):
            par = routed_experts_of(self.mlp).moe_config.moe_parallel_config
            self.sm121_fp32_reduce_moe = par.tp_size > 1 or par.ep_size > 1
            why = o_proj_fp32_reduce_unsupported_reason(self.attn)
            self.sm121_fp32_reduce_o = why is None
            if why is not None and why != "one rank":
                from vllm.logger import init_logger

                init_logger("vllm.sm121").info_once(
                    "gpt-oss: o_proj's all-reduce stays upstream's bf16 one (%s)", why)
        # The input norm carried from the previous layer's FC2 into the qkv GEMV (default on since stop 33,
        # $VLLM_SM121_NORM_IN_QKV=0 turns it off; a traced choice): vllm_sm121/moe/carry.py links consecutive blocks.
        self.sm121_norm_in_key = ""  # this block's qkv op reads the carried norm under this key
        self.sm121_norm_out_key = ""  # this block's FC2 writes it (set when the next block links)
        if choices.get("norm_in_qkv", False):
            why = ("the rotation does not run inside the qkv GEMV" if not self.sm121_rope_in_qkv
                   else "the TP-invariant mode computes as two ranks" if self.sm121_tp_invariant
                   else "the KV write runs inside the qkv GEMV" if self.sm121_kv_in_qkv
                   else norm_in_qkv_unsupported_reason(self))
            if why is None:
                from . import carry

                self.sm121_norm_in_key = carry.link(self, vllm_config, prefix)
            else:  # a warning where asked for explicitly; the default just notes it
                from vllm.logger import init_logger

                from vllm_sm121.config import NORM_IN_QKV_ENV

                log = init_logger("vllm.sm121")
                (log.warning_once if os.environ.get(NORM_IN_QKV_ENV, "").strip() else log.info_once)(
                    "gpt-oss: the input norm carried into the qkv GEMV ($VLLM_SM121_NORM_IN_QKV) is not applied "
                    "(%s); it runs on its own", why)

    def _simulate_two_ranks(self, vllm_config) -> None:
        """$VLLM_SM121_TP_INVARIANT ("tp2" / "ep2") on a one-rank engine: o_proj and the MoE compute
        each of the two ranks' fp32 shares and sum them as the fp32 all-reduce does (o_proj: the K
        halves, ``o_proj_fp32_reduce``; MoE: the shards ``Sm121Mxfp4MoEMethod`` builds), and the
        lm_head its two vocabulary shards (``vllm_sm121/tp_invariant.py``), so this engine's
        results are TP=2's (EP=2's), bit for bit. Anything else is an error here."""
        from vllm_sm121.config import TP_INVARIANT_ENV

        mode = self.sm121_tp_invariant
        par = vllm_config.parallel_config
        why = ("needs the plugin's fused MoE (moe: mxfp8) on this block" if not self.sm121_fused_moe
               else f"the engine already runs tensor_parallel_size={par.tensor_parallel_size}"
               if par.tensor_parallel_size != 1 else o_proj_fp32_reduce_unsupported_reason(self.attn, one_rank=True))
        heads = (self.attn.num_attention_heads, self.attn.num_key_value_heads)
        if why is None and any(h % 2 for h in heads):
            why = f"(q, kv) heads {heads} do not split over two ranks"
        if why is not None:
            raise ValueError(f"${TP_INVARIANT_ENV}={mode}: {why}; unset it")
        self.sm121_fp32_reduce_moe = self.sm121_fp32_reduce_o = True
        # One source for the mode: the quant methods read these at load (process_weights_after_loading)
        self.attn.o_proj.sm121_sim_parts = 2
        routed_experts_of(self.mlp).sm121_sim_mode = mode

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.sm121_fused_moe:
            return super().forward(hidden_states, positions, residual)
        # Self attention: upstream's (with the rotation inside the qkv GEMV where sm121_rope_in_qkv).
        rope_in_qkv = self.sm121_rope_in_qkv and isinstance(self.attn.qkv_proj.quant_method, self._sm121_dense_fp8)
        if residual is not None and rope_in_qkv and self.sm121_norm_in_key:  # the input norm inside the qkv op
            hidden_states, residual = hooked_attn_forward(
                self.attn, hidden_states, positions, norm=(residual, self.input_layernorm, self.sm121_norm_in_key),
                fp32_reduce=self.sm121_fp32_reduce_o)
        else:
            if residual is None:
                residual = hidden_states
                hidden_states = self.input_layernorm(hidden_states)
            else:
                hidden_states, residual = self.input_layernorm(hidden_states, residual)
            if rope_in_qkv:
                hidden_states = hooked_attn_forward(self.attn, hidden_states, positions, self.sm121_kv_in_qkv,
                                                    fp32_reduce=self.sm121_fp32_reduce_o)
            elif self.sm121_fp32_reduce_o:
                hidden_states = attn_forward_fp32_reduce(self.attn, hidden_states, positions)
            else:
                hidden_states = self.attn(hidden_states, positions)
        # Fully connected: one norm kernel (bf16 + MXFP8), router, MoE on MXFP8 (which carries the
        # next layer's input norm where sm121_norm_out_key).
        return hooked_mlp_forward(hidden_states, residual, self.post_attention_layernorm, self.mlp,
                                  self.sm121_router_in_norm, self.sm121_l2_key, self.sm121_norm_out_key,
                                  self.sm121_fp32_reduce_moe)
