"""SM121AttentionBackend: paged attention for gpt-oss on sm_121 (and sm_90) through Triton.

Architecture
    Backend (this file) declares what it supports and the cache shape; the builder
    (``metadata.py``) wraps vLLM's persistent metadata tensors; the impl (``impl.py``) holds each
    layer's own hyperparameters (scale, sliding window, soft-cap, sinks), so layers that differ
    share one backend and one builder with no global plan. Kernels: ``vllm_sm121.kernels``.

Constraints
    Decoder self-attention only; head sizes of the kernel library; block sizes multiple of 16;
    compute capability 9.x or 12.x.

Upstream file: vllm/v1/attention/backends/triton_attn.py (the closest in-tree relative).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf

from vllm_sm121 import compat, platform
from vllm_sm121.kernels._validate import SUPPORTED_HEAD_SIZES
from vllm_sm121.kernels.fp4_kv import nvfp4_full_dim

SUPPORTED_KV_CACHE_DTYPES = ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "nvfp4"]
NVFP4_HEAD_SIZES = (16, 32, 64, 128, 256)


class SM121AttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    # Per-layer hyperparameters: a drafter's layers (no window, no sinks) are fine next to the
    # target's. Read by upstream once patch 0002 lands; until then compat shim 0002 does this.
    inherit_for_draft_models: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = SUPPORTED_KV_CACHE_DTYPES

    @staticmethod
    def get_name() -> str:
        return compat.BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        from .impl import SM121AttentionImpl

        return SM121AttentionImpl

    @staticmethod
    def get_builder_cls():
        from .metadata import SM121AttentionMetadataBuilder

        return SM121AttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        if block_size % 16 != 0:
            raise ValueError(f"SM121 attention: block_size={block_size} is not supported; use a multiple of 16")
        if cache_dtype_str not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(
                f"SM121 attention: --kv-cache-dtype {cache_dtype_str} is not supported; "
                f"supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
            )
        if cache_dtype_str == "nvfp4":
            if head_size not in NVFP4_HEAD_SIZES:
                raise ValueError(f"SM121 attention: --kv-cache-dtype nvfp4 needs head_size in {list(NVFP4_HEAD_SIZES)}, "
                                 f"got head_size={head_size}")
            # uint8; per block and side (K, V): e2m1 data [Hkv][block_size][head_size/2], then e4m3
            # scales [Hkv][block_size][head_size/16] -- exactly vLLM's nvfp4 page (9/32 of bf16).
            return (num_blocks, 2, num_kv_heads * block_size * nvfp4_full_dim(head_size))
        # K and V halves; one page of one KV head is a contiguous [block_size, head_size] tile.
        return (num_blocks, 2, num_kv_heads, block_size, head_size)

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size % 16 == 0

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in SUPPORTED_HEAD_SIZES

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return platform.is_supported_capability(capability.major, capability.minor)

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False

    @classmethod
    def validate_configuration(cls, **cfg) -> list[str]:
        """vLLM's checks, with each reason naming the value and what SM121 supports."""
        reasons = super().validate_configuration(**cfg)
        cap = cfg.get("device_capability")
        detail = {
            "head_size not supported": f"head_size={cfg.get('head_size')} not supported (supported: {list(SUPPORTED_HEAD_SIZES)})",
            "dtype not supported": f"dtype={cfg.get('dtype')} not supported (supported: bfloat16, float16)",
            "kv_cache_dtype not supported": f"--kv-cache-dtype {cfg.get('kv_cache_dtype')} not supported "
            f"(supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)})",
            "block_size not supported": f"block_size={cfg.get('block_size')} not supported (supported: multiples of 16)",
            "compute capability not supported": f"compute capability {cap} not supported "
            f"(supported: {platform.SUPPORTED_CAPABILITIES})",
        }
        reasons = [detail.get(r, r) for r in reasons]
        if cfg.get("kv_cache_dtype") == "nvfp4" and cfg.get("head_size") not in NVFP4_HEAD_SIZES:
            reasons.append(f"--kv-cache-dtype nvfp4 needs head_size in {list(NVFP4_HEAD_SIZES)} "
                           f"(got head_size={cfg.get('head_size')})")
        return reasons
