"""$VLLM_SM121_TP_INVARIANT on a one-rank engine: the lm_head as TP=2's two vocab-parallel ranks.

The mode (``config.TP_INVARIANT_ENV``; o_proj and the MoE in ``moe/hook.py``) makes a one-rank
engine compute what TP=2 / EP=2 computes, bit for bit. The lm_head is the last piece: at TP=2 each
rank multiplies the hidden states by its half of the (padded) vocabulary rows, and vLLM's
``LogitsProcessor`` all-gathers the two [T, V/2] halves. A GEMM over [V/2, K] may pick another
kernel (another K order) than one over [V, K] at the same T, so TP=1's logits then differ from
TP=2's in their last bits at some token counts and the teacher-forced logprobs of those prompt
chunks differ (stop 36: EP=2 against the ep2 mode, whole chunks of 15-17 and 86 tokens differing,
the other chunks bit-equal; EP=2 itself deterministic).

``VocabShardsLMHeadMethod`` wraps the lm_head's method (upstream's bf16 one or the plugin's FP8
one) and computes the logits as the ranks' halves: each half a row view of the weight (and of its
per-row FP8 scales), the same shape, stride and alignment a rank's own tensor has, concatenated
as the all-gather concatenates them. Installed right after ``GptOssForCausalLM.__init__`` (and
after the FP8 swap; ``compat._install_gpt_oss_dense_hook``).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

PARTS = 2  # the modes simulate two ranks


class _RankRows:
    """A rank's view of an lm_head: ``weight`` (and ``weight_scale``, when the method has one)
    restricted to its vocabulary rows; anything else read from the layer."""

    def __init__(self, layer: torch.nn.Module, rows: slice):
        self._layer = layer
        self.weight = layer.weight[rows]
        scale = getattr(layer, "weight_scale", None)
        if scale is not None:
            self.weight_scale = scale[rows]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


class VocabShardsLMHeadMethod(QuantizeMethodBase):
    """The wrapped method's logits as ``PARTS`` vocabulary shards, concatenated (see the module)."""

    def __init__(self, inner: QuantizeMethodBase, parts: int = PARTS):
        self.inner = inner
        self.parts = parts

    def create_weights(self, *args: Any, **kwargs: Any) -> None:
        return self.inner.create_weights(*args, **kwargs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.inner.process_weights_after_loading(layer)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return self.inner.embedding(layer, input_)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if hasattr(layer, "cpu_linear"):  # (vLLM's CPU platform: a pre-packed GEMM that ignores the weight passed)
            raise ValueError("$VLLM_SM121_TP_INVARIANT: vLLM's CPU platform packs the lm_head whole; "
                             "the mode needs a CUDA device")
        n = layer.weight.shape[0] // self.parts
        outs = []
        for r in range(self.parts):
            rows = slice(r * n, (r + 1) * n)
            outs.append(self.inner.apply(_RankRows(layer, rows), x, None if bias is None else bias[rows]))
        return torch.cat(outs, dim=-1)


def lm_head_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the lm_head cannot be computed as two vocabulary shards here (None: it can)."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "quant_method") or not hasattr(head, "num_embeddings_padded"):
        return "the model has no vocab-parallel lm_head (ParallelLMHead)"
    if getattr(head, "tp_size", 1) != 1:
        return f"the engine already runs tensor_parallel_size={head.tp_size}"
    if head.num_embeddings_padded != getattr(head, "org_vocab_size_padded", head.num_embeddings_padded):
        return "it has added (LoRA) vocabulary rows, which TP=2 shards apart from the base vocabulary"
    if head.num_embeddings_padded % PARTS:
        return f"its padded vocabulary ({head.num_embeddings_padded}) does not split over {PARTS} ranks"
    processor = getattr(model, "logits_processor", None)
    head_dtype = getattr(processor, "head_dtype", None)
    if head_dtype is not None and head_dtype != head.weight.dtype:
        return f"the lm_head runs in head_dtype={head_dtype} (a path that bypasses its method)"
    return None


def apply_tp_invariant_lm_head(model: torch.nn.Module, vllm_config: Any) -> bool:
    """Wrap ``model.lm_head``'s method in ``VocabShardsLMHeadMethod`` when the mode is on (the
    config's traced choice). Idempotent. Returns whether the lm_head computes as shards."""
    from vllm_sm121.config import TP_INVARIANT_ENV, traced_choices

    mode = traced_choices(vllm_config).get("tp_invariant", "")
    if not mode:
        return False
    why = lm_head_unsupported_reason(model)
    if why is not None:
        raise ValueError(f"${TP_INVARIANT_ENV}={mode}: {why}; unset it")
    head = model.lm_head
    if not isinstance(head.quant_method, VocabShardsLMHeadMethod):
        head.quant_method = VocabShardsLMHeadMethod(head.quant_method)
    return True
