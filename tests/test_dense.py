"""FP8-weight dense linear: conversion guards, MX conversions, kernel vs reference (interpreter on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assert_close

from vllm_sm121.kernels import dense as D


@dataclasses.dataclass(frozen=True)
class Case:
    m: int
    n: int
    k: int
    bias: bool


CASES = [Case(1, 40, 96, True), Case(3, 33, 64, False), Case(16, 48, 80, True), Case(33, 20, 48, True),
         Case(0, 16, 32, True)]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES, ids=str)
def test_dense_fp8_linear_matches_reference(case, device):
    g = torch.Generator().manual_seed(case.m * 1000 + case.n)
    x = torch.randn(case.m, case.k, generator=g).bfloat16().to(device)
    w = (torch.randn(case.n, case.k, generator=g) * torch.rand(case.n, 1, generator=g) * 4).bfloat16().to(device)
    b = torch.randn(case.n, generator=g).bfloat16().to(device) if case.bias else None
    q, s = D.fp8_per_channel_quantize(w)
    out = D.dense_fp8_linear(x, q, s, b)
    ref = D.dense_fp8_linear_torch(x, q, s, b)
    assert out.dtype == torch.bfloat16 and out.shape == (case.m, case.n)
    # Kernel error only: fp32 accumulation order + one bf16 rounding of the output.
    assert_close(out, ref, atol=1e-2, rtol=1e-2, what=str(case))


@pytest.mark.interpreter
def test_dense_fp8_linear_strided_activations(device):
    x = torch.randn(5, 128).bfloat16().to(device)[:, :64]  # row stride 128
    w = torch.randn(24, 64).bfloat16().to(device)
    q, s = D.fp8_per_channel_quantize(w)
    assert_close(D.dense_fp8_linear(x, q, s), D.dense_fp8_linear_torch(x, q, s), atol=1e-2, rtol=1e-2)


def test_dense_fp8_linear_argument_errors():
    x = torch.randn(2, 32).bfloat16()
    q, s = D.fp8_per_channel_quantize(torch.randn(8, 32))
    with pytest.raises(ValueError, match="x.dtype"):
        D.dense_fp8_linear(x.float(), q, s)
    with pytest.raises(ValueError, match="in_features"):
        D.dense_fp8_linear(torch.randn(2, 16).bfloat16(), q, s)
    with pytest.raises(ValueError, match="scale"):
        D.dense_fp8_linear(x, q, s[:4])
    with pytest.raises(ValueError, match="bias"):
        D.dense_fp8_linear(x, q, s, torch.zeros(3, dtype=torch.bfloat16))


def test_fp8_per_channel_guards():
    w = torch.randn(6, 64)
    w[1] = 0.0  # zero row: scale 1, zero codes
    w[2] = 3.0e38  # near the fp32 / bf16 maximum
    w[3, 5] = -1e-30  # tiny lone value: scale clamped to a normal fp32
    w[4] *= 1e-39
    q, s = D.fp8_per_channel_quantize(w.bfloat16(), chunk_rows=4)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(q.float()).all()
    assert s[1] == 1.0 and (q[1].float() == 0).all()
    deq = D.fp8_per_channel_dequantize(q, s)
    assert torch.isfinite(deq).all()
    ref = w.bfloat16().float()
    for r in (0, 2, 5):  # per-row amax maps to 448: relative error within e4m3's half-ulp (2**-4)
        rel = (deq[r] - ref[r]).abs().max() / ref[r].abs().max()
        assert rel <= 2.0**-4, (r, rel)
    assert (q[0].float().abs().max() == 448.0)
    with pytest.raises(ValueError, match="non-finite"):
        D.fp8_per_channel_quantize(torch.tensor([[1.0, float("inf")] * 16]))
    with pytest.raises(ValueError, match="w must be 2-D"):
        D.fp8_per_channel_quantize(torch.zeros(4))


def test_mx_weight_roundtrips():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)
    w[3] = 0.0
    c8, s8 = D.mxfp8_weight_quantize(w)
    d8 = D.mxfp8_weight_dequantize(c8, s8)
    assert (d8[3] == 0).all() and ((d8 - w).abs() <= w.abs().unflatten(1, (2, 32)).amax(-1).repeat_interleave(32, 1)
                                   * 2.0**-4 + 1e-30).all()
    c4, s4 = D.mxfp4_weight_quantize(w)
    assert c4.shape == (8, 32) and s4.shape == (8, 2)
    d4 = D.mxfp4_weight_dequantize(c4, s4)
    assert (d4[3] == 0).all()
    # e2m1 grid values at scale 1 come back exactly
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0] * 4).repeat(2, 1)
    c, s = D.mxfp4_weight_quantize(grid)
    assert (s == 127).all() and torch.equal(D.mxfp4_weight_dequantize(c, s), grid)
    rel = ((d4 - w).norm() / w.norm()).item()
    assert 0.03 < rel < 0.2, rel
    with pytest.raises(ValueError, match="in_features"):
        D.mxfp4_weight_quantize(torch.zeros(2, 48))
