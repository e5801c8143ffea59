"""NVFP4 codec (the FP4 KV-cache format): ``nvfp4_quantize`` / ``nvfp4_dequantize`` and references.

Format (design.md, Formats): e2m1 values packed two per byte (element 2i in the low nibble), one
fp8-e4m3 scale per 16 elements, and a per-tensor fp32 global scale ``g`` chosen by the caller
(gpt-oss ships no KV scales). Per block: ``s = e4m3(amax / (6 g))``; elements are
``e2m1(x / (s g))`` (round to nearest even, saturating); decoding is ``e2m1 * s * g``. A block
whose scale underflows to 0 stores zeros (no division by zero, no NaN), which is why the global
scale matters for gpt-oss's tiny dummy-weight activations.

Status: codec only. The nvfp4 KV-cache write and the in-register dequantization inside the
attention kernel build on these jit helpers (``kv_cache_details/_codecs.py``) in the nvfp4
issue; ``--kv-cache-dtype nvfp4`` is still refused by the SM121 backend.
"""

from __future__ import annotations

import torch

from . import _validate as V
from .nvfp4_details._nvfp4 import _nvfp4_dequantize_kernel, _nvfp4_quantize_kernel

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK = 16


def _check_rows(name: str, x: torch.Tensor, last: int | None = None):
    V.check_ndim(name, x, 2, "[rows, elements]")
    V.check_last_dim_contiguous(name, x)
    if last is not None and x.shape[-1] != last:
        raise ValueError(f"{name} has {x.shape[-1]} columns, expected {last}")


def _check_d(d: int):
    if d % BLOCK or d < BLOCK or d & (d - 1):
        raise ValueError(f"row length {d} is not supported; supported: powers of two >= {BLOCK}")


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [R, D] -> (packed uint8 [R, D/2], block scales float8_e4m3fn [R, D/16])."""
    _check_rows("x", x)
    V.check_dtype("x", x, V.ACT_DTYPES + (torch.float32,))
    rows, d = x.shape
    _check_d(d)
    g = V.scale_tensor("global_scale", global_scale, x.device)
    packed = torch.empty(rows, d // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, d // BLOCK, dtype=torch.uint8, device=x.device)
    if rows:
        _nvfp4_quantize_kernel[(rows,)](x, packed, scales, g, x.stride(0), packed.stride(0), scales.stride(0),
                                        NUM_BLOCKS=d // BLOCK, num_warps=1)
    return packed, scales.view(torch.float8_e4m3fn)


def nvfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``nvfp4_quantize``: fp32 [R, D]."""
    _check_rows("packed", packed)
    d = packed.shape[1] * 2
    _check_d(d)
    _check_rows("scales", scales, d // BLOCK)
    g = V.scale_tensor("global_scale", global_scale, packed.device)
    out = torch.empty(packed.shape[0], d, dtype=torch.float32, device=packed.device)
    if packed.shape[0]:
        _nvfp4_dequantize_kernel[(packed.shape[0],)](packed, scales.view(torch.uint8), g, out, packed.stride(0),
                                                     scales.stride(0), out.stride(0), NUM_BLOCKS=d // BLOCK, num_warps=1)
    return out


def _e2m1_codes_torch(q: torch.Tensor) -> torch.Tensor:
    """Round |q| to the nearest e2m1 magnitude, ties to the even code; sign in bit 3."""
    a = q.abs()
    bounds = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)]
    code = torch.zeros_like(a, dtype=torch.int32)
    for i, (b, inclusive) in enumerate(bounds):
        code = torch.where(a >= b if inclusive else a > b, i + 1, code)
    neg = torch.signbit(q) & (code > 0)
    return torch.where(neg, code | 8, code)


def nvfp4_quantize_torch(x: torch.Tensor, global_scale) -> tuple[torch.Tensor, torch.Tensor]:
    rows, d = x.shape
    _check_d(d)
    g = float(global_scale)
    xb = x.float().view(rows, d // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)
    s = (amax / torch.tensor(6.0 * g)).clamp(max=448.0).to(torch.float8_e4m3fn)
    denom = s.float() * g
    q = torch.where(denom[..., None] > 0, xb / torch.where(denom > 0, denom, 1.0)[..., None], 0.0)
    codes = _e2m1_codes_torch(q).view(rows, d // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return packed, s


def nvfp4_dequantize_torch(packed: torch.Tensor, scales: torch.Tensor, global_scale) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=packed.device)
    p = packed.long()
    vals = torch.stack([lut[p & 15], lut[p >> 4]], dim=-1).view(packed.shape[0], -1)
    # (e2m1 * block scale) is exact in fp32; the global scale is applied last (one rounding), as the kernels do.
    blocks = vals.view(packed.shape[0], -1, BLOCK) * scales.float()[..., None]
    return (blocks * float(global_scale)).view(packed.shape[0], -1)
