"""Fused add+RMSNorm -> MXFP8 (gpt-oss hidden 2880): residual exact, bf16 output and MXFP8 values
against the torch reference; scales are powers of two that never saturate e4m3."""

import pytest
import torch

from vllm_sm121.kernels.norm_mxfp8 import (
    fused_add_rmsnorm_mxfp8,
    fused_add_rmsnorm_mxfp8_torch,
    mxfp8_dequantize_torch,
    mxfp8_quantize_torch,
)

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("hidden,scale", [(2880, 1.0), (64, 1e-3), (96, 300.0)])
def test_matches_reference(device, hidden, scale):
    g = torch.Generator().manual_seed(0)
    t = 3
    x = (torch.randn(t, hidden, generator=g) * scale).bfloat16()
    res = (torch.randn(t, hidden, generator=g) * scale).bfloat16()
    w = (1 + 0.02 * torch.randn(hidden, generator=g)).bfloat16()
    res_ref = res.clone()
    y_ref, q_ref, s_ref = fused_add_rmsnorm_mxfp8_torch(x, res_ref, w)
    res_dev = res.to(device)
    y, q, s = fused_add_rmsnorm_mxfp8(x.to(device), res_dev, w.to(device))
    assert torch.equal(res_dev.cpu(), res_ref)  # the residual add rounds once, like vLLM's fused op
    torch.testing.assert_close(y.cpu().float(), y_ref.float(), rtol=8e-3, atol=0)
    # Same block scales; values within one e4m3 step (the norm sum order may move a rounding).
    assert torch.equal(s.cpu(), s_ref)
    deq, deq_ref = mxfp8_dequantize_torch(q.cpu(), s.cpu()), mxfp8_dequantize_torch(q_ref, s_ref)
    step = torch.exp2(s_ref.float() - 127 - 3).repeat_interleave(32, dim=1) * 2 ** 8  # e4m3 ulp at the top binade
    assert ((deq - deq_ref).abs() <= step).all()
    assert torch.isfinite(deq).all()


def test_quantizer_scale_rule_and_zero_blocks():
    y = torch.zeros(1, 96)
    y[0, :32] = torch.linspace(-448.0, 448.0, 32)  # amax exactly 448 -> scale 2**0
    y[0, 32:64] = 449.0  # just above -> scale 2**1
    vals, scales = mxfp8_quantize_torch(y)
    assert scales.tolist() == [[127, 128, 0]]
    assert (vals.float()[0, 64:] == 0).all() and vals.float()[0, 31] == 448.0


def test_bad_input():
    x = torch.zeros(2, 40).bfloat16()
    with pytest.raises(ValueError, match="hidden size 40 is not supported"):
        fused_add_rmsnorm_mxfp8(x, x.clone(), torch.ones(40).bfloat16())
