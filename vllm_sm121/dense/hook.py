"""Model-level hook for gpt-oss: FP8 weights for qkv_proj, o_proj and lm_head (``"dense_weights": "fp8"``).

Architecture
    ``apply_dense_weights(model, vllm_config)`` runs right after ``GptOssForCausalLM.__init__``
    (compat shim ``compat.register_gpt_oss_dense_weights``, upstream proposal
    ``patches/vllm/0005-gpt-oss-lm-head-quant-config.patch``), before any weight is loaded. When
    the config's ``sm121.dense_weights`` is "fp8" it walks the model and, for every layer
    ``method.dense_quant_method_for`` picks (each layer's ``qkv_proj`` / ``o_proj``, the
    ``lm_head``), replaces ``layer.quant_method``:

        qkv_proj, o_proj   upstream's UnquantizedLinearMethod   -> method.Sm121DenseFp8LinearMethod
        lm_head            upstream's UnquantizedEmbeddingMethod -> method.Sm121DenseFp8LMHeadMethod

    The bf16 parameters upstream's methods already created are exactly the ones ours expect
    (ours create them through the same upstream code), so checkpoint and ``--load-format dummy``
    loading are unchanged. vLLM's ``model_loader.utils.process_weights_after_loading`` then calls
    our ``process_weights_after_loading`` (bf16 -> e4m3 + fp32 scale per output channel, bf16
    copy freed, before vLLM sizes the KV cache), the layers' forward and ``LogitsProcessor`` call
    our ``apply`` (``sm121::dense_fp8_linear``). The router stays bf16. One INFO line reports the
    layers converted and the bytes saved. With any other value the hook does nothing.

Refused (``ValueError`` naming the option and what is supported), at model construction
    tied word embeddings (the head would also embed); ``head_dtype`` other than the model dtype
    (``LogitsProcessor`` would multiply the e4m3 codes directly); a model dtype other than bf16;
    LoRA (its wrappers read the bf16 weights); pipeline parallelism > 1 (not run; tensor
    parallelism is supported: each rank converts its shard);
    an EAGLE-style drafter whose head has the target's shape (vLLM's ``_maybe_share_lm_head``
    compares both heads with ``torch.equal``, which cannot compare e4m3 with bf16; gpt-oss's
    Eagle3 drafters have a 32000-token head and are fine); a layer whose quant method is not
    upstream's unquantized one (a checkpoint that already quantizes them).

Limitations
    Only ``GptOssForCausalLM`` (an Eagle3 drafter is another class and keeps its bf16 layers; one
    that shares the target's head uses the FP8 head). The option is ignored by other models.
    In-place weight reloading after conversion (RL weight refit, sleep level 2) is not
    supported: the bf16 parameters no longer exist.

upstream files: ``vllm/model_executor/models/gpt_oss.py`` (``GptOssForCausalLM``),
``vllm/model_executor/model_loader/utils.py`` (``process_weights_after_loading``),
``vllm/v1/spec_decode/llm_base_proposer.py`` (``_maybe_share_lm_head``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

OPTION = '--additional-config \'{"sm121": {"dense_weights": "fp8"}}\''


@dataclasses.dataclass(frozen=True)
class Converted:
    """What ``apply_dense_weights`` swapped: layer names, bytes before and after conversion."""

    layers: tuple[str, ...]
    bf16_bytes: int
    fp8_bytes: int

    @property
    def saved_bytes(self) -> int:
        return self.bf16_bytes - self.fp8_bytes


def _refuse(why: str) -> ValueError:
    return ValueError(f"{OPTION}: {why}; supported: gpt-oss (GptOssForCausalLM) with bf16 dense weights, untied "
                      "embeddings, pipeline_parallel_size 1, no LoRA (or \"dense_weights\": \"bf16\")")


def unsupported_reason(vllm_config: Any) -> str | None:
    """Why this vLLM config cannot run gpt-oss's dense layers in FP8 (None: it can)."""
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    if getattr(hf_config, "tie_word_embeddings", False):
        return "tied word embeddings are not supported (the FP8 lm_head cannot embed tokens)"
    dtype = getattr(model_config, "dtype", torch.bfloat16)
    if dtype != torch.bfloat16:
        return f"model dtype {dtype} is not supported (the FP8 kernels take bf16 activations)"
    head_dtype = getattr(model_config, "head_dtype", None)
    if head_dtype is not None and head_dtype != dtype:
        return (f"head_dtype {head_dtype} is not supported (LogitsProcessor computes a head_dtype head from "
                "the weight itself; only the model dtype goes through the FP8 method)")
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA is not supported (its layers read the bf16 weights)"
    parallel = getattr(vllm_config, "parallel_config", None)
    # Tensor parallel is fine: each rank converts its own shard (per-output-channel scales of
    # column-parallel qkv / vocab-parallel lm_head rows, or of row-parallel o_proj's K shard).
    size = getattr(parallel, "pipeline_parallel_size", 1)
    if size != 1:
        return f"pipeline_parallel_size={size} is not supported (not run with pipeline parallelism)"
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(getattr(spec, "draft_model_config", None), "hf_config", None)
    # EAGLE-style drafters (eagle, eagle3, ...) may share the target's head after an equality
    # check; a separate draft model ("draft_model") never shares it.
    if draft is not None and hf_config is not None and getattr(spec, "method", None) != "draft_model":
        draft_vocab = getattr(draft, "draft_vocab_size", None) or getattr(draft, "vocab_size", None)
        if draft_vocab == getattr(hf_config, "vocab_size", None):
            return (f"a speculative drafter whose lm_head has the target's vocabulary ({draft_vocab}) is not "
                    "supported (vLLM compares the two heads with torch.equal, which cannot compare e4m3 with "
                    "bf16)")
    return None


def _param_bytes(layer: torch.nn.Module) -> tuple[int, int]:
    """(bf16 bytes of ``layer.weight``, bytes once converted: 1 per element + fp32 scale per row)."""
    w = layer.weight
    return w.numel() * w.element_size(), w.numel() + 4 * w.shape[0]


def apply_dense_weights(model: torch.nn.Module, vllm_config: Any) -> Converted | None:
    """Give gpt-oss's qkv_proj / o_proj / lm_head our FP8 methods when ``dense_weights`` is "fp8".

    Call after construction, before loading. Returns the layers on our methods (None: option not
    "fp8"). Idempotent: layers already on our methods are counted, not swapped or logged again.
    """
    from vllm_sm121 import config

    cfg = config.from_vllm_config(vllm_config)
    if cfg.dense_weights != "fp8":
        return None
    reason = unsupported_reason(vllm_config)
    if reason:
        raise _refuse(reason)
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from . import method as M

    upstream = {M.Sm121DenseFp8LinearMethod: UnquantizedLinearMethod,
                M.Sm121DenseFp8LMHeadMethod: UnquantizedEmbeddingMethod}
    swaps = []
    for name, layer in model.named_modules():
        ours = M.dense_quant_method_for(layer, name, cfg)
        if ours is None:
            continue
        current = getattr(layer, "quant_method", None)
        if type(current) is type(ours):
            swaps.append((name, layer, None))  # installed already
            continue
        if type(current) is not upstream[type(ours)]:
            raise _refuse(f"layer {name} has quant method {type(current).__name__} (the checkpoint or "
                          f"--quantization quantizes it already); FP8 conversion needs "
                          f"{upstream[type(ours)].__name__}")
        w = getattr(layer, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] % 16:
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else None
            raise _refuse(f"layer {name} has weight {shape}; the FP8 kernel needs [out_features, in_features] "
                          "with in_features a multiple of 16")
        swaps.append((name, layer, ours))
    if not any(name.rsplit(".", 1)[-1] == M.LM_HEAD for name, _, _ in swaps):
        raise _refuse("no lm_head was found to convert (not a gpt-oss GptOssForCausalLM?)")
    for _, layer, ours in swaps:
        if ours is not None:
            layer.quant_method = ours
    sizes = [_param_bytes(layer) for _, layer, _ in swaps]
    done = Converted(tuple(name for name, _, _ in swaps), sum(b for b, _ in sizes), sum(f for _, f in sizes))
    if all(ours is None for _, _, ours in swaps):
        return done  # installed already (logged then)
    from vllm.logger import init_logger

    kinds = {k: sum(n.rsplit(".", 1)[-1] == k for n in done.layers) for k in (*M.LINEAR_LAYERS, M.LM_HEAD)}
    init_logger("vllm.sm121").info(
        "vllm-sm121 dense_weights fp8: %d layers (%s) get e4m3 weights with per-output-channel scales after "
        "loading: %.1f MB -> %.1f MB (saves %.1f MB)", len(done.layers),
        ", ".join(f"{k} x{v}" for k, v in kinds.items()), done.bf16_bytes / 1e6, done.fp8_bytes / 1e6,
        done.saved_bytes / 1e6)
    return done
