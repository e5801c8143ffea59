"""vLLM linear methods running gpt-oss's dense projections with FP8 (e4m3, per-output-channel) weights.

Architecture
    Weight creation and loading are upstream's (``UnquantizedLinearMethod`` /
    ``UnquantizedEmbeddingMethod``: one bf16 [N, K] parameter), so checkpoints and dummy loading
    are unchanged. ``process_weights_after_loading`` replaces ``layer.weight`` by its e4m3 codes
    ([N, K], 1 byte per parameter) and registers ``layer.weight_scale`` (fp32 [N]); the bf16
    parameter is dropped. ``apply`` flattens the leading dimensions and calls the
    ``sm121::dense_fp8_linear`` custom op (fake implementation: shape only), so vLLM's
    torch.compile and CUDA graphs trace it like the MoE ops.

Constraints
    in_features a multiple of 16 (gpt-oss: 2880 and 4096). Activations are bf16. The methods
    themselves are tensor-parallel-agnostic: each rank converts its own shard (scales are per
    output row; row-parallel o_proj's bias is added on rank 0 only, by vLLM, before its
    all-reduce). The hook (``hook.py``) refuses pipeline parallelism.

Wiring
    ``hook.apply_dense_weights`` installs them on gpt-oss after construction, before loading,
    when ``--additional-config '{"sm121": {"dense_weights": "fp8"}}'`` (``vllm_sm121/dense/__init__.py``).

Limitations
    No "mxfp4" method yet (the option value is refused). A converted layer cannot reload its
    weights in place (the bf16 parameter and its ``weight_loader`` are gone).

upstream file: ``vllm/model_executor/layers/quantization/fp8.py`` (``Fp8LinearMethod``: weights
quantized after loading when the checkpoint is not fp8).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name

# Layers of gpt-oss converted when dense_weights == "fp8" (the router stays bf16).
LINEAR_LAYERS = ("qkv_proj", "o_proj")
LM_HEAD = "lm_head"


# ---- custom op -------------------------------------------------------------------------------

def _dense_fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None, f32_out: bool = False) -> torch.Tensor:
    from vllm_sm121.kernels.dense import dense_fp8_linear

    return dense_fp8_linear(x, w, scale, bias, out_dtype=torch.float32 if f32_out else torch.bfloat16)


def _dense_fp8_linear_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None, f32_out: bool = False) -> torch.Tensor:
    return torch.empty(x.shape[0], w.shape[0], dtype=torch.float32 if f32_out else torch.bfloat16, device=x.device)


def _dense_fp8_linear_rope(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                           positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_rows: int,
                           head_size: int) -> torch.Tensor:
    from vllm_sm121.kernels.dense import dense_fp8_linear_rope as kernel

    return kernel(x, w, scale, bias, positions, cos_sin_cache, rope_rows, head_size)


def _dense_fp8_linear_rope_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                                positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_rows: int,
                                head_size: int) -> torch.Tensor:
    return torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16, device=x.device)


def _dense_fp8_linear_rope_kv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                              positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_rows: int, head_size: int,
                              layer_name: LayerNameType) -> tuple[torch.Tensor, torch.Tensor]:
    """``_dense_fp8_linear_rope`` that also writes the k / v heads into attention layer
    ``layer_name``'s nvfp4 KV cache, as vLLM's ``unified_kv_cache_update`` would (returns its dummy
    too, the dependency vLLM's attention op takes). The GEMV writes them itself once the layer's
    global scales are calibrated and the slots cover the tokens; else the layer's own
    ``do_kv_cache_update`` runs after the projection (its first batches, profiling runs)."""
    from vllm.model_executor.layers.attention.attention import get_attention_context

    from vllm_sm121.kernels.dense import dense_fp8_linear_rope as kernel
    from vllm_sm121.kernels.dense import qkv_kv_heads

    _, layer, kv_cache, slots = get_attention_context(_resolve_layer_name(layer_name))
    dep = torch.empty(0, device=kv_cache.device, dtype=kv_cache.dtype)
    if slots is not None and not layer.impl._calibrating and slots.shape[0] >= x.shape[0]:
        # (the GEMV writes with the current scales, captured or not: no later reset, $VLLM_SM121_KV_SCALE_REAL)
        layer.impl._real_scale_pending = False
        return kernel(x, w, scale, bias, positions, cos_sin_cache, rope_rows, head_size,
                      kv_write=(*layer.impl._kv(kv_cache), slots)), dep
    out = kernel(x, w, scale, bias, positions, cos_sin_cache, rope_rows, head_size)
    if slots is not None:
        layer.impl.do_kv_cache_update(layer, *qkv_kv_heads(out, rope_rows, layer.impl.num_kv_heads, head_size),
                                      kv_cache, slots)
    return out, dep


def _dense_fp8_linear_rope_kv_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                                   positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_rows: int,
                                   head_size: int, layer_name: LayerNameType) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16, device=x.device),
            torch.empty(0, device=x.device, dtype=torch.uint8))


def _dense_fp8_linear_rope_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                                positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_rows: int, head_size: int,
                                norm_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's ``input_layernorm(x, residual)`` then ``_dense_fp8_linear_rope``: returns (qkv, the
    new residual). Up to ``carry_tokens()`` tokens the norm is the one the previous layer's FC2 carried
    under ``norm_key`` (``vllm_sm121/moe/carry.py``; x and residual are then not read); else the
    plugin's add + RMSNorm kernel runs first (bf16 y only)."""
    from vllm_sm121.kernels import dense
    from vllm_sm121.kernels.next_norm import carry_tokens
    from vllm_sm121.kernels.norm_mxfp8 import fused_add_rmsnorm_mxfp8

    m = x.shape[0]
    if norm_key and 0 < m <= carry_tokens():
        from vllm_sm121.moe import carry

        return dense.dense_fp8_linear_rope_norm(carry.buffers(norm_key, x.shape[1], x.device), m, norm_weight, eps, w,
                                                scale, bias, positions, cos_sin_cache, rope_rows, head_size)
    res = torch.empty_like(x)
    y, _, _ = fused_add_rmsnorm_mxfp8(x, residual, norm_weight, eps, residual_out=res, mx=False)
    return dense.dense_fp8_linear_rope(y, w, scale, bias, positions, cos_sin_cache, rope_rows, head_size), res


def _dense_fp8_linear_rope_norm_fake(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                     w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                                     positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_rows: int,
                                     head_size: int, norm_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16, device=x.device), torch.empty_like(x)


def _register_ops() -> None:
    from vllm_sm121.ops import register_op

    register_op("dense_fp8_linear", _dense_fp8_linear, _dense_fp8_linear_fake)
    register_op("dense_fp8_linear_rope", _dense_fp8_linear_rope, _dense_fp8_linear_rope_fake)
    # writes the KV cache as a side effect, as vLLM's own unified_kv_cache_update (mutates nothing
    # it is passed; the returned dummy orders the attention op after it)
    register_op("dense_fp8_linear_rope_kv", _dense_fp8_linear_rope_kv, _dense_fp8_linear_rope_kv_fake)
    # reads the buffers the previous layer's MoE op wrote under norm_key (ordered after it through x, its output)
    register_op("dense_fp8_linear_rope_norm", _dense_fp8_linear_rope_norm, _dense_fp8_linear_rope_norm_fake)


_register_ops()  # once per process (module import)


def dense_fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None, f32_out: bool = False) -> torch.Tensor:
    """bf16 [..., N] = x [..., K] @ (w e4m3 [N, K] * scale [N])^T + bias (``f32_out``: fp32, unrounded)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.ops.sm121.dense_fp8_linear(x2, w, scale, bias, f32_out)
    return out.reshape(*lead, w.shape[0])


def dense_fp8_linear_rope(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_rows: int,
                          head_size: int) -> torch.Tensor:
    """bf16 [T, N]: ``dense_fp8_linear`` with gpt-oss's NeoX rotary embedding applied to its first
    ``rope_rows`` outputs (q and k), in the GEMV's epilogue for few tokens
    (``kernels.dense.dense_fp8_linear_rope``). x: contiguous [T, K]; positions [T]."""
    if x.stride(-1) != 1 or x.stride(0) != x.shape[-1]:
        x = x.contiguous()
    return torch.ops.sm121.dense_fp8_linear_rope(x, w, scale, bias, positions.contiguous(), cos_sin_cache,
                                                 rope_rows, head_size)


def dense_fp8_linear_rope_kv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                             positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_rows: int, head_size: int,
                             layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``dense_fp8_linear_rope`` of gpt-oss's whole qkv (q, k rotated, then v) that also writes k
    and v to attention layer ``layer_name``'s nvfp4 KV cache; returns (qkv, the dependency for
    ``vllm::unified_attention_with_output``)."""
    from vllm.utils.torch_utils import _encode_layer_name

    if x.stride(-1) != 1 or x.stride(0) != x.shape[-1]:
        x = x.contiguous()
    return torch.ops.sm121.dense_fp8_linear_rope_kv(x, w, scale, bias, positions.contiguous(), cos_sin_cache,
                                                    rope_rows, head_size, _encode_layer_name(layer_name))


# ---- weights ---------------------------------------------------------------------------------

def _whole_row_amax(layer: torch.nn.Module, w: torch.Tensor) -> torch.Tensor | None:
    """A row-parallel layer under TP (o_proj: each rank holds a K-slice of every output channel):
    the max |w| of each whole row, all-reduced (MAX) over vLLM's TP group at load time, so each
    rank scales its slice exactly as TP=1 scales the row and the codes are TP=1's. None for every
    other layer (a column-parallel or vocab-parallel shard holds whole rows already)."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    if not isinstance(layer, RowParallelLinear) or getattr(layer, "tp_size", 1) == 1:
        return None
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    from vllm_sm121.kernels.dense import fp8_row_amax

    amax = fp8_row_amax(w)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=get_tp_group().device_group)
    return amax


def convert_layer_weight_(layer: torch.nn.Module) -> None:
    """bf16 ``layer.weight`` [N, K] -> e4m3 ``layer.weight`` + fp32 ``layer.weight_scale`` [N] (in place)."""
    from vllm_sm121.kernels.dense import fp8_per_channel_quantize

    w = layer.weight
    if w.dtype == torch.float8_e4m3fn and hasattr(layer, "weight_scale"):
        return  # converted already (process_weights_after_loading may run again on a reload)
    codes, scale = fp8_per_channel_quantize(w.data, row_amax=_whole_row_amax(layer, w.data))
    del layer.weight  # drop the bf16 parameter (and its storage once nothing else holds it)
    layer.register_parameter("weight", torch.nn.Parameter(codes, requires_grad=False))
    layer.register_parameter("weight_scale", torch.nn.Parameter(scale, requires_grad=False))


class Sm121DenseFp8LinearMethod(LinearMethodBase):
    """qkv_proj / o_proj: bf16 weights loaded as upstream, run as FP8 per-channel."""

    def __init__(self):
        self._bf16 = UnquantizedLinearMethod()

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        self._bf16.create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                                  params_dtype, **extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        convert_layer_weight_(layer)
        _simulated_rank_parts(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return dense_fp8_linear(x, layer.weight, layer.weight_scale, bias)


def _simulated_rank_parts(layer: torch.nn.Module, parts: int = 2) -> None:
    """$VLLM_SM121_TP_INVARIANT on a one-rank engine (``layer.sm121_sim_parts``, set on o_proj by the
    gpt-oss block from its recorded choice): the FP8 codes as the two ranks' contiguous K halves,
    buffer ``sm121_w_parts`` [parts, N, K / parts] (the codes TP=2's ranks hold: their scales come
    from the whole rows, ``_whole_row_amax``), which the hook's ``o_proj_fp32_reduce`` reads; the
    whole weight stays too (o_proj's bytes twice: an opt-in reproducibility mode)."""
    if getattr(layer, "sm121_sim_parts", 0) != parts or getattr(layer, "tp_size", 1) != 1:
        return
    n, k = layer.weight.shape
    w = layer.weight.data.view(n, parts, k // parts).transpose(0, 1).contiguous()
    layer.register_buffer("sm121_w_parts", w, persistent=False)


class Sm121DenseFp8LMHeadMethod(UnquantizedEmbeddingMethod):
    """lm_head (``ParallelLMHead``): upstream's embedding-method weights, FP8 projection.

    ``embedding`` is not supported (an untied head never embeds); ``LogitsProcessor`` calls
    ``apply``. Padded vocabulary rows are zeros: scale 1, zero logits, as upstream.
    """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        convert_layer_weight_(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return dense_fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        raise ValueError("the FP8 lm_head cannot embed tokens (tied embeddings are not supported with "
                         '"dense_weights": "fp8")')


def dense_quant_method_for(layer: torch.nn.Module, prefix: str, sm121_cfg):
    """Our method for gpt-oss's qkv_proj / o_proj (``LinearBase``) and lm_head (``ParallelLMHead``)
    when ``sm121_cfg.dense_weights == "fp8"``; None (upstream decides) for every other layer or format."""
    if getattr(sm121_cfg, "dense_weights", "bf16") != "fp8":
        return None
    name = prefix.rsplit(".", 1)[-1]
    if isinstance(layer, ParallelLMHead):
        return Sm121DenseFp8LMHeadMethod() if name == LM_HEAD else None
    if isinstance(layer, LinearBase) and name in LINEAR_LAYERS:
        return Sm121DenseFp8LinearMethod()
    return None


def dense_fp8_linear_rope_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                               w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                               cos_sin_cache: torch.Tensor, rope_rows: int, head_size: int,
                               norm_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(qkv bf16 [T, N], new residual bf16 [T, K]): upstream's ``input_layernorm(x, residual)`` and
    then ``dense_fp8_linear_rope`` of its output, with the norm carried from the previous layer's
    FC2 (``norm_key``) for up to ``kernels.next_norm.carry_tokens()`` tokens."""
    x = x.contiguous()
    residual = residual.contiguous()
    return torch.ops.sm121.dense_fp8_linear_rope_norm(x, residual, norm_weight, eps, w, scale, bias,
                                                      positions.contiguous(), cos_sin_cache, rope_rows, head_size,
                                                      norm_key)
