"""The next layer's input add + RMSNorm, carried through FC2's combine into the qkv GEMV (gpt-oss decode).

Architecture
    Upstream, a gpt-oss layer boundary is ``h, residual = input_layernorm(moe_out, residual)``
    followed by ``qkv_proj(h)``: an add + RMSNorm kernel of its own (Inductor's, 1.94 us a layer in
    the stop-28 profile of gpt-oss-120b on an H200, plus its launch gap) between FC2 and the qkv
    GEMV. At up to NEXT_NORM_MAX_T tokens the plugin can carry it instead:

    * FC2's combine (``kernels.moe.moe_fc2_combine_fma(next_norm=...)``: the last program of each
      row tile, or the combine kernel), where each bf16 output chunk is finished, adds the residual
      and stores ``s = bf16(out + residual)`` (the next residual), ``u = bf16(s * w)`` (w: the next
      layer's input-norm weight) and the sums of ``s**2`` per NEXT_NORM_CHUNK columns (``psum``).
    * The qkv GEMV (``kernels.dense.dense_fp8_linear_rope(norm=...)``) reads ``u`` as its
      activations and multiplies each token's dot products by ``1 / sqrt(sum(psum) / H + eps)`` in
      its epilogue; its first programs copy ``s`` into the residual it returns.

    Numerics: upstream rounds ``s * inv`` to bf16 and then ``* w`` to bf16 before the GEMV; here
    the GEMV sees ``bf16(s * w)`` and ``inv`` is applied to its fp32 sums, so the two differ by bf16
    rounding placement only (kernel tests bound it). The sum of squares is of the rounded ``s``, as
    the plugin's post-attention norm (``norm_mxfp8``) computes it.

    The three outputs live in ``NextNormBuffers`` of NEXT_NORM_MAX_T rows, one set per layer
    boundary (``vllm_sm121/moe/hook.py``); ``next_norm_torch`` is the reference and the fallback
    of paths without the fused combine.
"""

from __future__ import annotations

import dataclasses

import torch

# Tokens up to which the norm can be carried (the FMA GEMVs' range: FMA_KERNEL_MAX_TOKENS, DENSE_FMA_KERNEL_MAX_M).
NEXT_NORM_MAX_T = 4
NEXT_NORM_CHUNK = 16  # columns per partial sum of squares (``_next_norm.CHUNK``)
# Tokens up to which the model's ops carry it (``carry_tokens``): 1 by default. One layer boundary of
# gpt-oss-120b in CUDA graphs (benchmarks/norm_carry.py, H200, e16211b): 22.05 -> 21.06 us at one
# token, but 41.25 -> 43.23 us at four (the combine kernel and the qkv GEMV's four 1/rms). Read at
# call time (i.e. at graph capture), by the producing and the consuming op alike; 0..NEXT_NORM_MAX_T.
CARRY_TOKENS_ENV = "VLLM_SM121_NORM_IN_QKV_MAX_T"


def carry_tokens() -> int:
    """The largest batch whose input norm the gpt-oss ops carry ($VLLM_SM121_NORM_IN_QKV_MAX_T, default 1)."""
    from vllm_sm121.envs import env_int

    v = env_int(CARRY_TOKENS_ENV, 1)
    if not 0 <= v <= NEXT_NORM_MAX_T:
        raise ValueError(f"${CARRY_TOKENS_ENV}={v} is not supported; supported: 0..{NEXT_NORM_MAX_T} tokens")
    return v


@dataclasses.dataclass(frozen=True)
class NextNormBuffers:
    """What FC2's combine writes for the next layer's qkv GEMV, rows of up to NEXT_NORM_MAX_T tokens."""

    s: torch.Tensor  # [NEXT_NORM_MAX_T, H] bf16: the next residual, bf16(block output + residual)
    u: torch.Tensor  # [NEXT_NORM_MAX_T, H] bf16: bf16(s * w), the qkv GEMV's activations
    psum: torch.Tensor  # [NEXT_NORM_MAX_T, H / NEXT_NORM_CHUNK] fp32: sums of s**2 per chunk

    @classmethod
    def alloc(cls, hidden: int, device) -> NextNormBuffers:
        if hidden % NEXT_NORM_CHUNK:
            raise ValueError(f"hidden size {hidden} is not supported by the carried input norm; supported: "
                             f"multiples of {NEXT_NORM_CHUNK}")
        t = NEXT_NORM_MAX_T
        return cls(torch.zeros(t, hidden, dtype=torch.bfloat16, device=device),
                   torch.zeros(t, hidden, dtype=torch.bfloat16, device=device),
                   torch.zeros(t, hidden // NEXT_NORM_CHUNK, dtype=torch.float32, device=device))


@dataclasses.dataclass(frozen=True)
class NextNorm:
    """FC2's side: the block's residual (read), the next layer's norm weight and where to write."""

    residual: torch.Tensor  # [T, H] bf16 (last dimension contiguous)
    weight: torch.Tensor  # [H] bf16: the next layer's input_layernorm weight
    bufs: NextNormBuffers

    def check(self, out: torch.Tensor) -> None:
        """Against the block output ``out`` [T, H] bf16."""
        t, h = out.shape
        r, w, b = self.residual, self.weight, self.bufs
        if r.shape != (t, h) or r.dtype != torch.bfloat16 or (t and r.stride(-1) != 1):
            raise ValueError(f"next_norm: residual {tuple(r.shape)} {r.dtype} must be bf16 [{t}, {h}] with a "
                             "contiguous last dimension")
        if w.shape != (h,) or w.dtype not in (torch.bfloat16, torch.float32) or w.stride(0) != 1:
            raise ValueError(f"next_norm: norm weight {tuple(w.shape)} {w.dtype} must be a contiguous bf16 or fp32 "
                             f"[{h}]")
        if t > NEXT_NORM_MAX_T or b.s.shape[1] != h:
            raise ValueError(f"next_norm: {t} tokens of hidden size {h} are not supported; supported: up to "
                             f"{NEXT_NORM_MAX_T} tokens, buffers of hidden size {b.s.shape[1]}")


def next_norm_torch(out: torch.Tensor, nn: NextNorm) -> None:
    """Reference (and fallback): fills ``nn.bufs`` rows 0 .. T-1 from the block output ``out``."""
    t, h = out.shape
    s = (out.float() + nn.residual.float()).bfloat16()
    nn.bufs.s[:t] = s
    nn.bufs.u[:t] = (s.float() * nn.weight.float()).bfloat16()
    nn.bufs.psum[:t] = s.float().square().view(t, h // NEXT_NORM_CHUNK, NEXT_NORM_CHUNK).sum(-1)


def inv_rms_torch(psum: torch.Tensor, hidden: int, eps: float) -> torch.Tensor:
    """[T] fp32: 1 / sqrt(mean(s**2) + eps) from the partial sums (the kernels' order of summation
    differs: compare within fp32 rounding)."""
    return 1.0 / torch.sqrt(psum.float().sum(-1) / hidden + eps)


def normed_torch(bufs: NextNormBuffers, t: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Upstream's ``input_layernorm`` output bf16 [T, H] from the carried buffers (``s`` and the sums):
    for a qkv path that does not take the carried form."""
    inv = inv_rms_torch(bufs.psum[:t], bufs.s.shape[1], eps)
    return ((bufs.s[:t].float() * inv[:, None]).bfloat16() * weight).bfloat16()
