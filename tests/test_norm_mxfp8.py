"""Fused add+RMSNorm -> MXFP8 (gpt-oss hidden 2880): residual exact, bf16 output and MXFP8 values
against the torch reference; scales are powers of two that never saturate e4m3."""

import pytest
import torch

from vllm_sm121.kernels import norm_mxfp8 as N
from vllm_sm121.kernels.norm_mxfp8 import (
    fused_add_rmsnorm_mxfp8,
    fused_add_rmsnorm_mxfp8_router,
    fused_add_rmsnorm_mxfp8_router_torch,
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


def _close_mxfp8(q, s, q_ref, s_ref):
    assert torch.equal(s.cpu(), s_ref)
    deq, deq_ref = mxfp8_dequantize_torch(q.cpu(), s.cpu()), mxfp8_dequantize_torch(q_ref, s_ref)
    step = torch.exp2(s_ref.float() - 127 - 3).repeat_interleave(32, dim=1) * 2 ** 8
    assert ((deq - deq_ref).abs() <= step).all()


# (hidden, experts, tokens): the fused kernel (tokens <= ROUTER_FUSED_MAX_TOKENS) and the fallback
# (more tokens, or experts the router tiles do not divide)
@pytest.mark.parametrize("hidden,experts,t,scale", [(64, 8, 3, 1.0), (96, 16, 1, 1e-3), (64, 8, 9, 30.0),
                                                    (64, 7, 2, 1.0), (2880, 128, 2, 1.0)])
def test_router_fused_into_norm_matches_reference(device, hidden, experts, t, scale):
    if hidden == 2880 and device == "cpu":
        pytest.skip("gpt-oss shape: GPU only (the interpreter takes minutes)")
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(t, hidden, generator=g) * scale).bfloat16()
    res = (torch.randn(t, hidden, generator=g) * scale).bfloat16()
    w = (1 + 0.02 * torch.randn(hidden, generator=g)).bfloat16()
    rw = (torch.randn(experts, hidden, generator=g) * hidden ** -0.5).bfloat16()
    rb = (0.1 * torch.randn(experts, generator=g)).bfloat16()
    ref = fused_add_rmsnorm_mxfp8_router_torch(x, res, w, rw, rb)
    res_dev = res.to(device)
    out = fused_add_rmsnorm_mxfp8_router(x.to(device), res_dev, w.to(device), rw.to(device), rb.to(device))
    assert torch.equal(res_dev.cpu(), res)  # the input residual is left alone
    assert torch.equal(out[0].cpu(), ref[0])  # x + residual, rounded once
    _close_mxfp8(out[1], out[2], ref[1], ref[2])
    # logits: fp32 sums of the same bf16 products in another order, then bf16 (1 ulp = 2**-8 relative)
    torch.testing.assert_close(out[3].cpu().float(), ref[3].float(), rtol=8e-3, atol=2e-3)
    assert out[3].dtype == torch.bfloat16 and out[3].shape == (t, experts)


def test_router_fused_bad_input():
    x = torch.zeros(2, 64).bfloat16()
    w = torch.ones(64).bfloat16()
    with pytest.raises(ValueError, match="router weight must be bf16"):
        fused_add_rmsnorm_mxfp8_router(x, x.clone(), w, torch.zeros(8, 64), torch.zeros(8).bfloat16())
    rw = torch.zeros(8, 64).bfloat16()
    for bad_bias in (torch.zeros(4).bfloat16(), torch.zeros(8), torch.zeros(16).bfloat16()[::2]):
        with pytest.raises(ValueError, match="router bias must be contiguous"):
            fused_add_rmsnorm_mxfp8_router(x, x.clone(), w, rw, bad_bias)
    assert N.ROUTER_FUSED_MAX_TOKENS >= 1 and 128 % N.ROUTER_BLOCK_E == 0
    with pytest.raises(ValueError, match="residual_out"):
        fused_add_rmsnorm_mxfp8(x, x.clone(), w, residual_out=torch.zeros(2, 32).bfloat16())


def test_residual_out_leaves_the_input_residual(device):
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(2, 64, generator=g).bfloat16() for _ in range(2))
    w = torch.ones(64).bfloat16()
    res_ref = res.clone()
    y_ref, q_ref, s_ref = fused_add_rmsnorm_mxfp8_torch(x, res_ref, w)
    res_dev, out = res.to(device), torch.empty(2, 64, dtype=torch.bfloat16, device=device)
    y, q, s = fused_add_rmsnorm_mxfp8(x.to(device), res_dev, w.to(device), residual_out=out)
    assert torch.equal(res_dev.cpu(), res) and torch.equal(out.cpu(), res_ref)
    assert torch.equal(s.cpu(), s_ref)
    # mx=False (the qkv op's own input norm): the same y and residual, no MXFP8 outputs
    out2 = torch.empty_like(out)
    y2, q2, s2 = fused_add_rmsnorm_mxfp8(x.to(device), res_dev, w.to(device), residual_out=out2, mx=False)
    assert q2 is None and s2 is None and torch.equal(y2.cpu(), y.cpu()) and torch.equal(out2.cpu(), out.cpu())


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


# router kernel tiles: (block_e, warps, qblocks); None = defaults (blocks spread over the programs)
@pytest.mark.parametrize("tiles", [None, "8,1", "4,1,4", "2,2,1"])
def test_router_kernel_mxfp8_is_the_norm_kernels_bit_for_bit(device, tiles, monkeypatch):
    """However the row's MXFP8 blocks are split between the router kernel's programs (each
    quantizes its share), the residual, values and scales equal the plain norm kernel's bytes."""
    if tiles:
        monkeypatch.setenv(N.NORM_ROUTER_TILES_ENV, tiles)
    g = torch.Generator().manual_seed(4)
    hidden, experts, t = 96, 16, 2
    x, res = ((torch.randn(t, hidden, generator=g) * 3).bfloat16().to(device) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16().to(device)
    rw = (torch.randn(experts, hidden, generator=g) * 0.1).bfloat16().to(device)
    rb = torch.zeros(experts).bfloat16().to(device)
    r_ref = res.clone()
    _, q_ref, s_ref = fused_add_rmsnorm_mxfp8(x, r_ref, w)
    r, q, s, _ = fused_add_rmsnorm_mxfp8_router(x, res, w, rw, rb)
    assert torch.equal(r.cpu(), r_ref.cpu())
    assert torch.equal(q.view(torch.uint8).cpu(), q_ref.view(torch.uint8).cpu())
    assert torch.equal(s.cpu(), s_ref.cpu())


def test_router_tiles_env():
    assert N.router_tiles(2880, 128) == (2, N.ROUTER_WARPS, 2)  # 90 blocks over 64 programs
    import os

    for bad in ("3,4", "4,3", "4", "a,b", "4,4,3", "32,4,1", "0,4"):
        os.environ[N.NORM_ROUTER_TILES_ENV] = bad
        try:
            with pytest.raises(ValueError, match=N.NORM_ROUTER_TILES_ENV):
                N.router_tiles(2880, 128)
        finally:
            del os.environ[N.NORM_ROUTER_TILES_ENV]
