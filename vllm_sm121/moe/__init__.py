"""gpt-oss MXFP4 experts with MXFP8 activations (design.md: ``--additional-config '{"sm121": {"moe": ...}}'``).

Architecture
    ``register()`` (from the general plugin, every process) registers the quantization config
    ``sm121_mxfp4`` through vLLM's public ``register_quantization_config``. The registered class
    (``quant_config.Sm121Mxfp4Config``) is import-light; ``from_config`` builds the real config,
    ``method.Sm121GptOssMxfp4Config``, a subclass of vLLM's ``GptOssMxfp4Config`` (weights are
    created and loaded exactly as upstream, ``--load-format dummy`` included), whose
    ``get_quant_method`` hands the gpt-oss experts to ``method.Sm121Mxfp4MoEMethod`` (kernels in
    ``vllm_sm121.kernels.moe``) or, when the option resolves to "upstream", to vLLM's own
    ``GptOssMxfp4MoEMethod``.

When the option is decided (``resolve_moe``)
    vLLM probes ``override_quantization_method`` from ``ModelConfig.__post_init__``
    (``_verify_quantization``), i.e. inside ``EngineArgs.create_model_config``, before the
    ``VllmConfig`` exists: neither ``additional_config`` nor ``--attention-backend`` is visible
    there and ``get_current_vllm_config()`` is unset (it raises). So the override claims every
    gpt-oss MXFP4 checkpoint provisionally, and the decision is taken where the whole config is
    current: ``get_quant_method`` during model construction (under ``set_current_vllm_config``,
    in the worker) -- the same lazy pattern as vLLM's ``DeepseekV4FP8Config``. If the option
    resolves to "upstream" there, the layer gets upstream's method and everything runs as stock
    vLLM (the config keeps upstream's name ``gpt_oss_mxfp4``, which the expert weight loader keys
    on); only ``model_config.quantization`` reads "sm121_mxfp4". Where a vLLM config is current
    at probe time (tests, later vLLM versions), the override decides exactly.

Constraints
    No vLLM private surface is touched here (the hook's class-attribute swap is compat shim
    0004). No expert parallelism; hidden and per-rank intermediate sizes must be multiples of 64
    (gpt-oss: 2880).

Model-level hook (``hook.py``)
    ``register()`` also installs ``hook.Sm121GptOssBlock`` as gpt-oss's ``GptOssModel.block_cls``
    (compat shim 0004, when gpt_oss.py is imported): in layers whose experts run
    ``Sm121Mxfp4MoEMethod`` at TP=1 without sequence-parallel MoE, the post-attention
    add+RMSNorm emits bf16 for the router and MXFP8 for the experts in one kernel
    (``kernels/norm_mxfp8.py``), and the MoE op takes the MXFP8 directly. Elsewhere the block is
    upstream's, and the MoE receives bf16 that FC1 quantizes to MXFP8 in registers (no standalone
    quantization kernel, no quantized copy).

upstream files: ``vllm/model_executor/layers/quantization/mxfp4.py``, ``vllm/config/model.py``
(``_verify_quantization``), ``vllm/model_executor/layers/fused_moe/routed_experts.py``.
"""

from __future__ import annotations

import os
from typing import Any

QUANT_NAME = "sm121_mxfp4"

# Not enabled by default in this release: the block matches its reference on GPU at every M, and
# at M = 1 the FMA decode beats vLLM's MoE (H100, same run: 52 vs 66 µs per 120b layer), but at
# M >= 2 it is slower (M = 8: 670 vs 204 µs) and the grouped GEMMs of prefill are ~10x slower
# (benchmarks/moe.py). While False the plugin registers nothing for the MoE (stock vLLM MoE,
# stock quantization name) and "moe": "mxfp8" is refused as not implemented. Tests flip it to
# exercise the wiring; $VLLM_SM121_MOE_EXPERIMENTAL=1 (read at import, so set it for every
# process: vllm serve and its engine core inherit it) turns it on to measure it end to end
# (benchmarks/e2e.py --configs sm121-moe).
EXPERIMENTAL_ENV = "VLLM_SM121_MOE_EXPERIMENTAL"
READY = os.environ.get(EXPERIMENTAL_ENV, "").strip() == "1"
GPT_OSS_QUANT_METHODS = ("mxfp4", "gpt_oss_mxfp4")


def is_gpt_oss_mxfp4(hf_quant_cfg: Any, hf_config: Any) -> bool:
    """The checkpoint is gpt-oss with MXFP4 experts (vLLM rewrites "mxfp4" to "gpt_oss_mxfp4")."""
    return (isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") in GPT_OSS_QUANT_METHODS
            and getattr(hf_config, "model_type", None) == "gpt_oss")


def resolve_moe(vllm_config: Any, hf_config: Any = None, hf_quant_cfg: Any = None) -> str:
    """The value the ``moe`` option takes for this config: "mxfp8" or "upstream".

    Explicit values win ("mxfp8" still needs a gpt-oss MXFP4 checkpoint: anything else keeps
    upstream's MoE). Default: "mxfp8" for gpt-oss MXFP4 checkpoints served with
    ``--attention-backend SM121``, else "upstream".
    """
    from vllm_sm121 import compat, config

    moe = config.from_vllm_config(vllm_config).moe
    if not READY:
        return "upstream"
    if moe == "upstream":
        return "upstream"
    if hf_config is None:  # the model of this config (an override probe passes the checkpoint's)
        hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    if hf_quant_cfg is None:
        hf_quant_cfg = getattr(hf_config, "quantization_config", None)
    if not is_gpt_oss_mxfp4(hf_quant_cfg, hf_config):
        return "upstream"
    if moe == "mxfp8":
        return "mxfp8"
    attention = getattr(vllm_config, "attention_config", None)
    return "mxfp8" if attention is not None and compat._target_runs_sm121(vllm_config) else "upstream"


def register() -> str:
    """Register the ``sm121_mxfp4`` quantization config with vLLM (idempotent, import-light)."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_sm121 import compat

    from .quant_config import Sm121Mxfp4Config

    register_quantization_config(QUANT_NAME)(Sm121Mxfp4Config)
    compat.register_gpt_oss_fused_moe_block()  # the model-level hook (hook.py), on gpt_oss.py's import
    return (f"MXFP4 MoE with MXFP8 activations (quantization {QUANT_NAME}: gpt-oss MXFP4 checkpoints, "
            '--additional-config \'{"sm121": {"moe": "mxfp8"}}\', default on with --attention-backend SM121)')
