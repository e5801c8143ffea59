"""NVFP4 KV-cache pages: views over vLLM's nvfp4 page, the quantize-on-write kernel and references.

Layout (vLLM 0.26 ``nvfp4_kv_cache_full_dim``, data-then-scales like ``nvfp4_split_data_scale``):
each side (K, V) of a page holds ``block_size * num_kv_heads * (head_size/2 + head_size/16)``
bytes: first all e2m1 data ``[Hkv][block_size][head_size/2]``, then all e4m3 block scales
``[Hkv][block_size][head_size/16]``. A per-layer fp32 global scale per side completes the format
(see ``kernels/nvfp4.py``). ``Nvfp4Pages`` are strided tensor views of that page, so kernels
address data and scales with ordinary strides.

Global scales (``calibrate_global_scales``): gpt-oss ships no KV scales, so each layer's K and V
scale is set from the first batch it writes: ``g = 2 ** ceil(log2(amax * HEADROOM / (6 * 448)))``,
so that a block as large as that batch's largest gets an e4m3 block scale in (3.5, 7] and blocks up
to HEADROOM (64) times larger still fit before the block scale saturates; blocks down to ~3e-4 of
it keep a non-zero (sub)normal scale. ``g`` is a power of two so that the cache's values do not
depend on it: e4m3 rounding commutes with powers of two, so any two such scales store the same
dequantized values for every block whose scale stays in e4m3's normal range. That makes them
independent of which batch calibrated the layer and of how heads are split across tensor-parallel
ranks (each rank calibrates on its own heads). All on the device, no host synchronization: a zero or non-finite amax
(e.g. an all-padding batch) leaves the scale unset for the next batch to set.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _validate as V
from .fp4_kv_details._fp4_kv import _fp4_kv_write_kernel
from .nvfp4 import nvfp4_dequantize_torch, nvfp4_quantize_torch


def nvfp4_full_dim(head_size: int) -> int:
    """Bytes per (token, head) of one side: vLLM's ``nvfp4_kv_cache_full_dim``."""
    return head_size // 2 + head_size // 16


@dataclasses.dataclass
class Nvfp4Pages:
    data: torch.Tensor  # [num_blocks, Hkv, block_size, head_size // 2] uint8
    scales: torch.Tensor  # [num_blocks, Hkv, block_size, head_size // 16] float8_e4m3fn
    global_scale: torch.Tensor  # [1] fp32

    @classmethod
    def view(cls, side: torch.Tensor, num_kv_heads: int, block_size: int, head_size: int,
             global_scale: torch.Tensor) -> "Nvfp4Pages":
        """Views of one side ``[num_blocks, page_bytes]`` (uint8) of the nvfp4 cache."""
        if side.dtype != torch.uint8 or side.dim() != 2:
            raise ValueError(f"nvfp4 cache side must be a [num_blocks, bytes] uint8 tensor, got {side.dtype} {tuple(side.shape)}")
        need = num_kv_heads * block_size * nvfp4_full_dim(head_size)
        if side.shape[1] != need:
            raise ValueError(f"nvfp4 page side holds {side.shape[1]} bytes; num_kv_heads={num_kv_heads}, "
                             f"block_size={block_size}, head_size={head_size} need {need}")
        nb = side.shape[0]
        split = num_kv_heads * block_size * head_size // 2
        data = side[:, :split].unflatten(1, (num_kv_heads, block_size, head_size // 2))
        scales = side[:, split:].unflatten(1, (num_kv_heads, block_size, head_size // 16)).view(torch.float8_e4m3fn)
        assert data.shape[0] == scales.shape[0] == nb
        return cls(data, scales, global_scale.reshape(1).float())

    @property
    def shape(self):  # (num_blocks, Hkv, block_size, head_size)
        nb, h, n, half = self.data.shape
        return (nb, h, n, 2 * half)

    def dequantize(self) -> torch.Tensor:
        """fp32 [num_blocks, Hkv, block_size, head_size] (tests and references only)."""
        nb, h, n, d = self.shape
        rows = self.data.reshape(-1, d // 2)
        out = nvfp4_dequantize_torch(rows, self.scales.reshape(-1, d // 16), float(self.global_scale))
        return out.view(nb, h, n, d)


def _check(key, value, k_pages: Nvfp4Pages, v_pages: Nvfp4Pages, slot_mapping):
    V.check_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    V.check_dtype("key", key, V.ACT_DTYPES)
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"value {tuple(value.shape)} {value.dtype} must match key {tuple(key.shape)} {key.dtype}")
    _, num_kv_heads, head_size = key.shape
    if head_size % 16 or head_size & (head_size - 1):
        raise ValueError(f"head_size={head_size} is not supported by the nvfp4 KV cache; supported: 16, 32, 64, 128, 256")
    if num_kv_heads & (num_kv_heads - 1):
        raise ValueError(f"num_kv_heads={num_kv_heads} is not supported by the nvfp4 KV write; supported: powers of two")
    for name, p in (("k_pages", k_pages), ("v_pages", v_pages)):
        if p.shape[1] != num_kv_heads or p.shape[3] != head_size:
            raise ValueError(f"{name} {p.shape} disagrees with key: num_kv_heads={num_kv_heads}, head_size={head_size}")
    V.check_block_size(k_pages.shape[2])
    if slot_mapping.shape[0] < key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")


# A block as large as the calibration batch's largest gets e4m3 block scale 448 / HEADROOM.
HEADROOM = 64.0
E4M3_MAX = 448.0
DEFAULT_AMAX = 1.0  # the scale an uncalibrated layer writes with (amax assumed 1)


def default_global_scale() -> float:
    return float(global_scale_for(torch.tensor(DEFAULT_AMAX)))


def global_scale_for(amax: torch.Tensor) -> torch.Tensor:
    """The power-of-two global scale for a calibration amax (fp32, elementwise; amax > 0)."""
    return torch.exp2(torch.ceil(torch.log2(amax.float() * (HEADROOM / (6.0 * E4M3_MAX)))))


def calibrate_global_scales(key: torch.Tensor, value: torch.Tensor, global_scales: torch.Tensor,
                            done: torch.Tensor | None, reduce_amax=None, rows: torch.Tensor | None = None) -> None:
    """Set ``global_scales`` [2] (K, V; fp32) from this batch unless ``done`` [2] (bool) says set.

    Device-only (graph-safe, no host sync): ``g = global_scale_for(amax)`` where amax is finite
    and > 0; otherwise the scale is left as it was and ``done`` stays False. ``reduce_amax``: maps
    this batch's [2] amax to the whole layer's (tensor parallelism: the max over the ranks' heads,
    so every rank calibrates as one unsharded layer would, and all ranks agree on ``done``).
    ``rows`` [T] (bool): only these tokens count (the others may hold anything); ``done=None``:
    set regardless of earlier calibrations (nothing recorded).
    """
    if not key.numel():
        return
    if rows is None:
        amax = torch.stack([key.abs().amax(), value.abs().amax()]).float()
    else:
        per_row = torch.stack([key.abs().amax(dim=(1, 2)), value.abs().amax(dim=(1, 2))]).float()  # [2, T]
        amax = torch.where(rows[None, :], per_row, torch.zeros_like(per_row)).amax(dim=1)
    if reduce_amax is not None:
        amax = reduce_amax(amax)
    ok = torch.isfinite(amax) & (amax > 0)
    if done is not None:
        ok &= ~done
    safe = torch.where(ok, amax, 1.0)  # log2 of 0 / inf / NaN never reaches the result
    global_scales.copy_(torch.where(ok, global_scale_for(safe), global_scales))
    if done is not None:
        done.logical_or_(ok)


def fp4_kv_write(key, value, k_pages: Nvfp4Pages, v_pages: Nvfp4Pages, slot_mapping: torch.Tensor, *,
                 check: bool = True) -> None:
    """Quantize ``key``/``value`` [T, Hkv, D] to NVFP4 into their page slots (one program per token
    and side, K or V).

    ``check=False`` skips argument validation (callers that validated the same layer before).
    """
    if check:
        _check(key, value, k_pages, v_pages, slot_mapping)
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    _fp4_kv_write_kernel[(num_tokens, 2)](
        key, value, k_pages.data, k_pages.scales.view(torch.uint8), v_pages.data, v_pages.scales.view(torch.uint8),
        slot_mapping, k_pages.global_scale, v_pages.global_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_pages.data.stride(0), k_pages.scales.stride(0), v_pages.data.stride(0), v_pages.scales.stride(0),
        NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=k_pages.shape[2], HEAD=head_size, num_warps=1, **V.pdl_launch(key),
    )


def fp4_kv_write_torch(key, value, k_pages: Nvfp4Pages, v_pages: Nvfp4Pages, slot_mapping: torch.Tensor) -> None:
    """Reference of ``fp4_kv_write`` (same bytes)."""
    _check(key, value, k_pages, v_pages, slot_mapping)
    block_size = k_pages.shape[2]
    for t in range(key.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        page, off = divmod(slot, block_size)
        for x, p in ((key[t], k_pages), (value[t], v_pages)):
            packed, scales = nvfp4_quantize_torch(x.float(), float(p.global_scale))
            p.data[page, :, off] = packed
            p.scales[page, :, off] = scales
