"""The gpt-oss MXFP4 config that vLLM instantiates for ``sm121_mxfp4``, and our fused-MoE method.

Architecture
    ``Sm121GptOssMxfp4Config`` subclasses vLLM's ``GptOssMxfp4Config`` (same name, same weight
    creation and loading; linear and attention layers as upstream). Its ``get_quant_method``
    resolves the ``moe`` option once, with the model's VllmConfig current (``resolve_moe``), and
    gives each gpt-oss ``RoutedExperts`` either ``Sm121Mxfp4MoEMethod`` or upstream's
    ``GptOssMxfp4MoEMethod``.

    ``Sm121Mxfp4MoEMethod`` is monolithic (vLLM hands it the router logits): ``apply_monolithic``
    runs ``kernels.moe.moe_block`` -- routing (top-k, softmax over the selected), FC1 + SwiGLU
    with MXFP8 activations, FC2 + routing-weighted sum to bf16 -- with decode kernels for small
    token counts and grouped GEMMs for large ones, graph-capturable throughout.

Constraints
    Weights stay in the checkpoint layout (``w13_weight`` [E, 2I, H/2] e2m1 pairs with gate/up
    rows interleaved, ``*_weight_scale`` e8m0 per 32, bf16 biases), which is what the kernels
    read: ``process_weights_after_loading`` only validates and makes them contiguous once.

Parallelism
    Tensor parallel: each rank holds an intermediate shard as vLLM's gpt-oss loader cuts it
    (whole MXFP4 blocks; ``w2_bias`` on rank 0 only). ``maybe_roundup_sizes`` pads the shard to a
    multiple of 64 (gpt-oss-120b at TP=2: 1440 -> 1472, at TP=4: 720 -> 768, as upstream's Triton
    backend does). vLLM's loader gives each rank whole MXFP4 blocks (at TP=4: 736 columns to ranks
    0-2 and 672 to rank 3), never more than that padded size, and copies them into the leading
    rows/columns; the rest stays zero, which the SwiGLU maps to 0 and FC2 multiplies by zero
    weights, so it adds nothing. Expert parallel:
    the rank holds its experts and ``layer.expert_map`` routes (``kernels.moe.moe_route``).
    Either way ``moe_block`` returns the rank's share and vLLM's MoE runner (or the fused hook,
    ``hook.py``) all-reduces it. EPLB is refused (expert maps would change under the kernels).

upstream file: ``vllm/model_executor/layers/quantization/mxfp4.py`` (``GptOssMxfp4Config``,
``GptOssMxfp4MoEMethod``).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe import (
    FusedMoEConfig,
    FusedMoEMethodBase,
    RoutedExperts,
)
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.quantization.mxfp4 import (
    GptOssMxfp4Config,
    GptOssMxfp4MoEMethod,
)

from . import resolve_moe

_ALIGN = 64  # hidden and (padded) per-rank intermediate sizes are multiples of this (kernel tiles)


def unsupported_reason(layer: torch.nn.Module) -> str | None:
    """Why this RoutedExperts layer cannot use our method (None: it can)."""
    moe: FusedMoEConfig = layer.moe_config
    checks = (
        (moe.moe_parallel_config.enable_eplb, "EPLB (expert load balancing)"),
        (moe.activation != MoEActivation.SWIGLUOAI, f"activation {moe.activation}"),
        (not moe.has_bias, "experts without biases"),
        (not getattr(layer, "renormalize", True) or getattr(layer, "scoring_func", "softmax") != "softmax"
         or getattr(layer, "use_grouped_topk", False) or getattr(layer, "custom_routing_function", None) is not None
         or getattr(layer, "e_score_correction_bias", None) is not None,
         "routing other than softmax top-k renormalized"),
        (getattr(layer, "apply_router_weight_on_input", False), "router weight applied on the input"),
        # The per-rank intermediate size needs no check: maybe_roundup_sizes pads it to a multiple
        # of 64, which is >= the whole MXFP4 blocks vLLM's loader gives any rank.
        (moe.hidden_dim % _ALIGN, f"hidden {moe.hidden_dim} not a multiple of {_ALIGN}"),
    )
    for bad, what in checks:
        if bad:
            return what
    return None


def local_expert_map(layer: torch.nn.Module) -> torch.Tensor | None:
    """vLLM's global -> local expert id map under expert parallelism (int32 [E], -1: another rank);
    None without it."""
    if not layer.moe_config.moe_parallel_config.use_ep:
        return None
    return getattr(layer, "expert_map", None)


SHARDED_WEIGHTS = ("w13_weight", "w13_weight_scale", "w13_bias", "w2_weight", "w2_weight_scale", "w2_bias")


def rank_shards(weights: dict[str, torch.Tensor], mode: str, parts: int = 2,
                align: int = _ALIGN) -> list[dict[str, torch.Tensor]]:
    """The expert weights each of ``parts`` ranks holds, cut from one rank's full (checkpoint
    layout) ``weights`` {name in SHARDED_WEIGHTS: tensor} exactly as vLLM 0.26's gpt-oss loader and
    this method's padding give them to rank r:

    * "tp2" (tensor parallel): whole MXFP4 blocks of the intermediate dimension, ``cdiv(I/32,
      parts) * 32`` units per rank (gate/up rows interleaved: 2 rows a unit), copied into the leading
      part of a zero shard of ``round_up(I // parts, align)`` units; ``w2_bias`` on rank 0 only;
    * "ep2" (expert parallel): experts ``r * E/parts ..`` (vLLM's linear placement) with their
      biases, and ``expert_map`` (int32 [E]: global -> local id, -1 elsewhere).
    """
    w13, w13s, w13b = weights["w13_weight"], weights["w13_weight_scale"], weights["w13_bias"]
    w2, w2s, w2b = weights["w2_weight"], weights["w2_weight_scale"], weights["w2_bias"]
    e, two_i = w13.shape[:2]
    inter = two_i // 2
    shards = []
    if mode == "ep2":
        if e % parts:
            raise ValueError(f"$VLLM_SM121_TP_INVARIANT=ep2: {e} experts do not split over {parts} ranks")
        n = e // parts
        for r in range(parts):
            sl = slice(r * n, (r + 1) * n)
            emap = torch.full((e,), -1, dtype=torch.int32, device=w13.device)
            emap[sl] = torch.arange(n, dtype=torch.int32, device=w13.device)
            shards.append({name: t[sl].contiguous() for name, t in weights.items()} | {"expert_map": emap})
        return shards
    if mode != "tp2":
        raise ValueError(f"$VLLM_SM121_TP_INVARIANT mode={mode!r} is not supported; supported: tp2, ep2")
    per = -(-(inter // 32) // parts) * 32  # the loader's units per rank (whole MXFP4 blocks)
    padded = -(-(inter // parts) // align) * align  # the rank's parameter size (maybe_roundup_sizes)
    for r in range(parts):
        lo, hi = r * per, min((r + 1) * per, inter)
        shard = {
            "w13_weight": w13.new_zeros(e, 2 * padded, w13.shape[2]),
            "w13_weight_scale": w13s.new_zeros(e, 2 * padded, w13s.shape[2]),
            "w13_bias": w13b.new_zeros(e, 2 * padded),
            "w2_weight": w2.new_zeros(e, w2.shape[1], padded // 2),
            "w2_weight_scale": w2s.new_zeros(e, w2s.shape[1], padded // 32),
            "w2_bias": w2b.clone() if r == 0 else torch.zeros_like(w2b),
        }
        shard["w13_weight"][:, :2 * (hi - lo)] = w13[:, 2 * lo:2 * hi]
        shard["w13_weight_scale"][:, :2 * (hi - lo)] = w13s[:, 2 * lo:2 * hi]
        shard["w13_bias"][:, :2 * (hi - lo)] = w13b[:, 2 * lo:2 * hi]
        shard["w2_weight"][..., :(hi - lo) // 2] = w2[..., lo // 2:hi // 2]
        shard["w2_weight_scale"][..., :(hi - lo) // 32] = w2s[..., lo // 32:hi // 32]
        shards.append(shard)
    return shards


class Sm121GptOssMxfp4Config(GptOssMxfp4Config):
    """vLLM's gpt-oss MXFP4 config whose experts run our kernels when the ``moe`` option says so.

    ``get_name()`` stays "gpt_oss_mxfp4": vLLM's expert weight loader
    (``RoutedExperts.weight_loader``) loads the combined gpt-oss expert tensors only for that name.
    """

    def __init__(self, ignored_layers: list[str] | None = None):
        super().__init__(ignored_layers)
        self._moe: str | None = None  # resolved on first get_quant_method (config current then)

    def resolved_moe(self) -> str:
        if self._moe is None:
            from vllm.config import get_current_vllm_config

            self._moe = resolve_moe(get_current_vllm_config())
            from vllm.logger import init_logger

            init_logger("vllm.sm121").info("gpt-oss MoE: %s", {
                "mxfp8": "vllm-sm121 MXFP4 x MXFP8 kernels", "upstream": "upstream vLLM MXFP4 MoE"}[self._moe])
        return self._moe

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, RoutedExperts) and self.resolved_moe() == "mxfp8":
            reason = unsupported_reason(layer)
            if reason is None:
                return Sm121Mxfp4MoEMethod(layer.moe_config)
            from vllm.config import get_current_vllm_config

            from vllm_sm121 import config as sm121_config

            if sm121_config.from_vllm_config(get_current_vllm_config()).moe == "mxfp8":
                raise ValueError(f'--additional-config \'{{"sm121": {{"moe": "mxfp8"}}}}\': {prefix} is not '
                                 f"supported ({reason}); use \"moe\": \"upstream\"")
            from vllm.logger import init_logger

            init_logger("vllm.sm121").warning_once("gpt-oss MoE %s: %s not supported, using upstream's", prefix, reason)
        return super().get_quant_method(layer, prefix)


class Sm121Mxfp4MoEMethod(FusedMoEMethodBase):
    """gpt-oss MXFP4 experts with MXFP8 activations (``vllm_sm121.kernels.moe.moe_block``)."""

    def __init__(self, moe: FusedMoEConfig):
        super().__init__(moe)
        self.weight_dtype = "gpt_oss_mxfp4"  # gpt_oss.py's loader keys on "mxfp4" in this string
        self.topk = moe.experts_per_token

    @property
    def is_monolithic(self) -> bool:
        return True  # routing is ours too: vLLM hands apply_monolithic the router logits

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config):
        hidden_size, inter = super().maybe_roundup_sizes(hidden_size, intermediate_size_per_partition, act_dtype,
                                                         moe_parallel_config)
        return hidden_size, -(-inter // _ALIGN) * _ALIGN  # zero padding: see "Parallelism" above

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        # Exactly upstream's parameters (names, shapes, dtypes, loader attributes), so the
        # checkpoint and --load-format dummy load unchanged. It reads only self.moe.
        GptOssMxfp4MoEMethod.create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                                            params_dtype, **extra_weight_attrs)

    def process_weights_after_loading(self, layer) -> None:
        if getattr(layer, "sm121_sim_parts", 0):
            raise ValueError("$VLLM_SM121_TP_INVARIANT: these experts' weights were already cut into the "
                             "simulated ranks' shards; reloading weights is not supported in that mode")
        e, hidden, inter = self.num_experts, self.hidden_size, self.intermediate_size
        expected = {
            "w13_weight": ((e, 2 * inter, hidden // 2), torch.uint8),
            "w13_weight_scale": ((e, 2 * inter, hidden // 32), torch.uint8),
            "w13_bias": ((e, 2 * inter), torch.bfloat16),
            "w2_weight": ((e, hidden, inter // 2), torch.uint8),
            "w2_weight_scale": ((e, hidden, inter // 32), torch.uint8),
            "w2_bias": ((e, hidden), torch.bfloat16),
        }
        for name, (shape, dtype) in expected.items():
            p = getattr(layer, name)
            if tuple(p.shape) != shape or p.dtype != dtype:
                raise ValueError(f"{name}: expected {shape} {dtype}, got {tuple(p.shape)} {p.dtype}")
            if not p.is_contiguous():
                p.data = p.data.contiguous()
        if layer.w13_weight.is_cuda:  # the FMA FC1's split-K counters, before any graph capture
            from vllm_sm121.kernels.moe import split_counters

            split_counters(layer.w13_weight.device)
            split_counters(layer.w13_weight.device, purpose="fc2")
        emap = local_expert_map(layer)
        if emap is not None and (emap.dtype != torch.int32 or emap.shape != (self.moe.num_experts,)):
            raise ValueError(f"expert_map: expected int32 [{self.moe.num_experts}] (global -> local expert), got "
                             f"{emap.dtype} {tuple(emap.shape)}")
        self._build_simulated_ranks(layer)
        from vllm_sm121.kernels.moe import register_weight_scales

        # The grouped GEMMs drop their second scale multiply for scales that never need it (guarded: NaN
        # where weights reloaded in place later would, kernels/moe.py); again on every reload through here.
        # In the TP-invariant mode the simulated ranks' shards are what the kernels read.
        parts = [f"sm121_sim{r}_" for r in range(layer.sm121_sim_parts)] or [""]
        register_weight_scales(*(getattr(layer, f"{p}{name}") for p in parts
                                 for name in ("w13_weight_scale", "w2_weight_scale")))

    def _build_simulated_ranks(self, layer) -> None:
        """$VLLM_SM121_TP_INVARIANT on a one-rank engine (``layer.sm121_sim_mode``, set by the gpt-oss
        block from its recorded choice, ``hook.Sm121GptOssBlock._simulate_two_ranks``): the two ranks'
        weight shards of TP=2 ("tp2") or EP=2 ("ep2") as buffers ``sm121_sim{r}_<weight>`` (and
        ``sm121_sim{r}_expert_map`` for ep2), ``layer.sm121_sim_parts`` = 2 (0: mode off); the
        unsharded weights are released (the block's hook reads the shards only)."""
        from vllm_sm121.config import TP_INVARIANT_ENV

        layer.sm121_sim_parts = 0
        mode = getattr(layer, "sm121_sim_mode", "")
        if not mode:
            return
        par = self.moe.moe_parallel_config
        if par.tp_size > 1 or par.ep_size > 1:
            raise ValueError(f"${TP_INVARIANT_ENV}={mode} computes two ranks' shards on a one-rank engine; this one "
                             f"already runs tp={par.tp_size}, ep={par.ep_size}: unset it")
        weights = {name: getattr(layer, name).data for name in SHARDED_WEIGHTS}
        for r, shard in enumerate(rank_shards(weights, mode, parts=2, align=_ALIGN)):
            for name, t in shard.items():
                layer.register_buffer(f"sm121_sim{r}_{name}", t, persistent=False)
        for name in SHARDED_WEIGHTS:
            p = getattr(layer, name)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        layer.sm121_sim_parts = 2

    def get_fused_moe_quant_config(self, layer):
        return None  # no modular kernel: apply_monolithic runs the whole block

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None) -> torch.Tensor:
        from vllm_sm121.kernels.moe import moe_block

        if getattr(layer, "sm121_sim_parts", 0):
            raise ValueError("$VLLM_SM121_TP_INVARIANT: these experts hold simulated ranks' shards, which only "
                             "the plugin's gpt-oss block reads; unset it for this model")
        return moe_block(x.contiguous(), router_logits.contiguous(), layer.w13_weight, layer.w13_weight_scale,
                         layer.w13_bias, layer.w2_weight, layer.w2_weight_scale, layer.w2_bias, self.topk,
                         expert_map=local_expert_map(layer))

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        raise NotImplementedError("Sm121Mxfp4MoEMethod is monolithic: vLLM calls apply_monolithic")
