"""KV-cache write: launcher ``write_kv_cache`` and reference ``write_kv_cache_torch``.

Architecture
    One program per token scatters that token's K and V (all KV heads) into its slot of the
    paged cache, quantizing to fp8-e4m3 on the way in when the cache is fp8.

Cache layout
    ``[num_blocks, num_kv_heads, block_size, head_size]`` per side (see ``paged_attention``);
    ``slot_mapping[t] = block * block_size + offset``, negative for padded tokens (skipped).
    fp8: stored = saturate_e4m3(x / scale), per-tensor ``k_scale``/``v_scale``.

Limitations
    Per-tensor scales only (no per-token-head fp8); nvfp4 comes with its own issue.
"""

from __future__ import annotations

import torch

from . import _validate as V
from .kv_cache_details._kv_cache import _write_kv_cache_kernel
from ._validate import _dummy, _next_pow2

FP8_E4M3_MAX = 448.0


def _check(key, value, key_cache, value_cache, slot_mapping):
    V.check_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    V.check_ndim("value", value, 3, "[num_tokens, num_kv_heads, head_size]")
    V.check_ndim("key_cache", key_cache, 4, "[num_blocks, num_kv_heads, block_size, head_size]")
    V.check_ndim("value_cache", value_cache, 4, "[num_blocks, num_kv_heads, block_size, head_size]")
    V.check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    V.check_dtype("key", key, V.ACT_DTYPES)
    V.check_dtype("key_cache", key_cache, V.ACT_DTYPES + V.FP8_DTYPES)
    V.check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    if value.dtype != key.dtype or value.shape != key.shape:
        raise ValueError(f"value {tuple(value.shape)} {value.dtype} must match key {tuple(key.shape)} {key.dtype}")
    if value_cache.dtype != key_cache.dtype or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache {tuple(value_cache.shape)} {value_cache.dtype} must match "
            f"key_cache {tuple(key_cache.shape)} {key_cache.dtype}"
        )
    if key_cache.dtype not in V.FP8_DTYPES and key_cache.dtype != key.dtype:
        raise ValueError(f"key_cache.dtype={key_cache.dtype} must equal key.dtype={key.dtype} (or be float8_e4m3fn)")
    num_tokens, num_kv_heads, head_size = key.shape
    V.check_head_size(head_size)
    V.check_block_size(key_cache.shape[2])
    if key_cache.shape[1] != num_kv_heads or key_cache.shape[3] != head_size:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} disagrees with key: num_kv_heads={num_kv_heads}, head_size={head_size}"
        )
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        V.check_last_dim_contiguous(name, t)
    V.check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    soft_fp8: bool | None = None,
    check: bool = True,
) -> None:
    """Scatter ``key``/``value`` [T, Hkv, D] into the paged caches at ``slot_mapping``.

    ``soft_fp8`` forces the software e4m3 encoder (default: only under the CPU interpreter).
    ``check=False`` skips argument validation, for callers that validated the same layer before
    (the SM121 backend, as for ``paged_attention``).
    """
    kv_fp8 = key_cache.dtype in V.FP8_DTYPES
    if check:
        _check(key, value, key_cache, value_cache, slot_mapping)
        if kv_fp8 and (k_scale is None or v_scale is None):
            raise ValueError("k_scale and v_scale are required for an fp8 KV cache")
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    dummy = _dummy(key.device)
    k_scale_t = V.scale_tensor("k_scale", k_scale, key.device) if kv_fp8 else dummy
    v_scale_t = V.scale_tensor("v_scale", v_scale, key.device) if kv_fp8 else dummy
    # performance hyper-parameters: one program per token; 8 KV heads x 64 dims = 1 KB each way.
    heads_pad = _next_pow2(num_kv_heads)
    head_pad = _next_pow2(head_size)
    num_warps = 1 if heads_pad * head_pad <= 512 else (2 if heads_pad * head_pad <= 2048 else 4)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, k_scale_t, v_scale_t,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=key_cache.shape[2], KV_FP8=kv_fp8,
        SOFT_FP8=kv_fp8 and (soft_fp8 if soft_fp8 is not None else key.device.type != "cuda"),
        num_warps=num_warps,
    )


def write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Reference: the same scatter (and fp8 quantization) in plain torch."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[2]
    slots = slot_mapping[: key.shape[0]].long()
    keep = slots >= 0
    slots, k, v = slots[keep], key[keep], value[keep]
    if key_cache.dtype in V.FP8_DTYPES:
        k = (k.float() / float(k_scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        v = (v.float() / float(v_scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    key_cache[slots // block_size, :, slots % block_size] = k.to(key_cache.dtype)
    value_cache[slots // block_size, :, slots % block_size] = v.to(value_cache.dtype)
