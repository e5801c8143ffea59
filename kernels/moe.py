"""gpt-oss MoE, decode path: FC1 (MXFP8 x MXFP4) + bias + SwiGLU -> MXFP8; FC2 + bias, routing-weighted sum over the top-k -> bf16; references.

Architecture
    ``moe_fc1_swiglu`` takes the MXFP8 activations the fused norm emits (``norm_mxfp8.py``), the
    experts' MXFP4 weights in the gpt-oss checkpoint layout as loaded (``w13_weight`` [E, 2I,
    K/2] uint8 e2m1 pairs, low nibble first; ``w13_weight_scale`` [E, 2I, K/32] e8m0; bias
    [E, 2I]; gate/up rows interleaved), and writes the SwiGLU output already in MXFP8 for FC2, so
    no quantization kernel runs between FC1 and FC2. SwiGLU is gpt-oss's: gate clamped to <= 7,
    up to [-7, 7], ``(up + 1) * gate * sigmoid(1.702 * gate)``.

Limitations
    Status: first kernel, CPU-tested, not run on a GPU, not tuned, not wired into vLLM. One
    program per (token, expert slot, BLOCK_N outputs): CUDA-core dot products, i.e. a decode
    (small-M) kernel; prefill needs the tensor-core path (``tl.dot_scaled``). e8m0 byte 0
    (2**-127) is read as 2**-126 (only all-zero blocks use it).
"""

from __future__ import annotations

import torch

from . import _validate as V
from .moe_details._moe_fc1 import _moe_fc1_swiglu_kernel
from .moe_details._moe_fc2 import _moe_fc2_combine_kernel
from .nvfp4 import E2M1_VALUES

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def moe_fc1_swiglu(a: torch.Tensor, a_scale: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                   bias: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [M, K] e4m3 + a_scale [M, K/32] e8m0; returns (h [M*topk, I] e4m3, h_scale [M*topk, I/32] e8m0)."""
    V.check_ndim("a", a, 2, "[num_tokens, hidden]")
    V.check_ndim("w13", w13, 3, "[num_experts, 2 * intermediate, hidden / 2]")
    V.check_ndim("topk_ids", topk_ids, 2, "[num_tokens, topk]")
    V.check_dtype("a", a, V.FP8_DTYPES)
    V.check_dtype("w13", w13, (torch.uint8,))
    V.check_dtype("topk_ids", topk_ids, (torch.int32,))
    m, k = a.shape
    e, two_i, k_half = w13.shape
    i = two_i // 2
    if k % 64 or k_half * 2 != k or i % 32:
        raise ValueError(f"hidden={k} (w13 holds {k_half * 2}) and intermediate={i} are not supported; "
                         "supported: hidden a multiple of 64 matching w13, intermediate a multiple of 32")
    if a_scale.shape != (m, k // 32) or w13_scale.shape != (e, two_i, k // 32) or bias.shape != (e, two_i):
        raise ValueError(f"scales/bias shapes a_scale={tuple(a_scale.shape)} w13_scale={tuple(w13_scale.shape)} "
                         f"bias={tuple(bias.shape)} disagree with a={tuple(a.shape)}, w13={tuple(w13.shape)}")
    topk = topk_ids.shape[1]
    out = torch.empty(m * topk, i, dtype=torch.uint8, device=a.device)
    out_scale = torch.empty(m * topk, i // 32, dtype=torch.uint8, device=a.device)
    # performance hyper-parameters (not tuned yet): 64 SwiGLU outputs (128 weight rows) x 64 of K per step
    block_n = 64 if i % 64 == 0 else 32
    if m:
        _moe_fc1_swiglu_kernel[(m * topk, i // block_n)](
            a.view(torch.uint8), a_scale, w13, w13_scale, bias, topk_ids, out, out_scale,
            K=k, I=i, TOPK=topk, BLOCK_N=block_n, BLOCK_K=64, ALPHA=SWIGLU_ALPHA, LIMIT=SWIGLU_LIMIT, num_warps=4)
    return out.view(torch.float8_e4m3fn), out_scale


def dequant_mxfp4_torch(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., K/2] e2m1 pairs (low nibble first) + [..., K/32] e8m0 -> fp32 [..., K]."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=blocks.device)
    b = blocks.long()
    vals = torch.stack([lut[b & 15], lut[b >> 4]], dim=-1).flatten(-2)
    s = torch.exp2(scales.float().clamp(min=1) - 127)  # byte 0 read as 2**-126, like the kernel
    return (vals.unflatten(-1, (-1, 32)) * s[..., None]).flatten(-2)


def moe_fc1_swiglu_torch(a, a_scale, w13, w13_scale, bias, topk_ids):
    from .norm_mxfp8 import mxfp8_dequantize_torch, mxfp8_quantize_torch

    x = mxfp8_dequantize_torch(a, a_scale.clamp(min=1))  # [M, K]
    m, topk = topk_ids.shape
    ids = topk_ids.long().flatten()
    w = dequant_mxfp4_torch(w13[ids], w13_scale[ids])  # [M*topk, 2I, K]
    h = torch.einsum("pnk,pk->pn", w, x.repeat_interleave(topk, dim=0)) + bias[ids].float()
    gate, up = h[:, 0::2], h[:, 1::2]
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    y = (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)
    return mxfp8_quantize_torch(y), y


def moe_fc2_combine(h: torch.Tensor, h_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                    bias: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """h [M*topk, I] e4m3 + h_scale [M*topk, I/32]; returns bf16 [M, H] = sum_j w_j (h_j W2[e_j]^T + b2[e_j])."""
    V.check_ndim("w2", w2, 3, "[num_experts, hidden, intermediate / 2]")
    V.check_dtype("h", h, V.FP8_DTYPES)
    V.check_dtype("topk_ids", topk_ids, (torch.int32,))
    V.check_dtype("topk_weights", topk_weights, (torch.float32,))
    m, topk = topk_ids.shape
    e, hidden, i_half = w2.shape
    i = h.shape[1]
    if i % 64 or i_half * 2 != i or h.shape[0] != m * topk:
        raise ValueError(f"h {tuple(h.shape)} disagrees with w2 {tuple(w2.shape)} / topk_ids {tuple(topk_ids.shape)}; "
                         "intermediate must be a multiple of 64")
    if w2_scale.shape != (e, hidden, i // 32) or bias.shape != (e, hidden) or topk_weights.shape != (m, topk):
        raise ValueError(f"w2_scale {tuple(w2_scale.shape)}, bias {tuple(bias.shape)} or topk_weights "
                         f"{tuple(topk_weights.shape)} disagree with w2 {tuple(w2.shape)}")
    out = torch.empty(m, hidden, dtype=torch.bfloat16, device=h.device)
    block_n = 64  # performance hyper-parameter (not tuned yet)
    if m:
        _moe_fc2_combine_kernel[(m, -(-hidden // block_n))](
            h.view(torch.uint8), h_scale, w2, w2_scale, bias, topk_ids, topk_weights, out,
            H=hidden, I=i, TOPK=topk, BLOCK_N=block_n, BLOCK_K=64, num_warps=4)
    return out


def moe_fc2_combine_torch(h, h_scale, w2, w2_scale, bias, topk_ids, topk_weights):
    from .norm_mxfp8 import mxfp8_dequantize_torch

    x = mxfp8_dequantize_torch(h, h_scale.clamp(min=1))  # [M*topk, I]
    ids = topk_ids.long().flatten()
    w = dequant_mxfp4_torch(w2[ids], w2_scale[ids])  # [M*topk, H, I]
    y = torch.einsum("phk,pk->ph", w, x) + bias[ids].float()
    m, topk = topk_ids.shape
    return (y.view(m, topk, -1) * topk_weights.float()[..., None]).sum(1)
