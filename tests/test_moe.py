"""MoE FC1 + SwiGLU -> MXFP8 (decode kernel) vs the torch reference on random real-format weights."""

import pytest
import torch

from vllm_sm121.kernels.moe import dequant_mxfp4_torch, moe_fc1_swiglu, moe_fc1_swiglu_torch
from vllm_sm121.kernels.norm_mxfp8 import mxfp8_dequantize_torch, mxfp8_quantize_torch

pytestmark = pytest.mark.interpreter


def test_dequant_mxfp4_matches_checkpoint_helper():
    from vllm_sm121.testing.checkpoint import dequant_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(115, 125, (3, 4), generator=g, dtype=torch.uint8)
    ref = dequant_mxfp4(blocks, scales)
    torch.testing.assert_close(dequant_mxfp4_torch(blocks.flatten(-2), scales), ref, rtol=0, atol=0)


@pytest.mark.parametrize("m,k,i,e,topk", [(1, 128, 64, 4, 2), (2, 192, 96, 3, 3)])
def test_fc1_swiglu_matches_reference(device, m, k, i, e, topk):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g)
    a, a_scale = mxfp8_quantize_torch(x)
    w13 = torch.randint(0, 256, (e, 2 * i, k // 2), generator=g, dtype=torch.uint8)
    w13_scale = torch.randint(118, 122, (e, 2 * i, k // 32), generator=g, dtype=torch.uint8)  # |w| ~ 0.02-0.1
    bias = (torch.randn(e, 2 * i, generator=g) * 0.5).bfloat16()
    topk_ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(m)]).int()
    (ref_q, ref_s), y_ref = moe_fc1_swiglu_torch(a, a_scale, w13, w13_scale, bias, topk_ids)
    dev = lambda t: t.to(device)  # noqa: E731
    q, s = moe_fc1_swiglu(dev(a), dev(a_scale), dev(w13), dev(w13_scale), dev(bias), dev(topk_ids))
    deq = mxfp8_dequantize_torch(q.cpu(), s.cpu())
    assert torch.isfinite(deq).all() and y_ref.abs().max() > 0.5  # SwiGLU saw real values
    # Same block scales; each value within one e4m3 step of the reference's (the kernel sums in
    # another order, which can move a value across an e4m3 rounding boundary).
    assert torch.equal(s.cpu(), ref_s)
    deq_ref = mxfp8_dequantize_torch(ref_q, ref_s)
    scale = torch.exp2(ref_s.float() - 127).repeat_interleave(32, dim=1)
    ulp = torch.maximum(torch.exp2(torch.floor(torch.log2(deq_ref.abs().clamp(min=1e-30))) - 3), scale * 2**-9)
    assert ((deq - deq_ref).abs() <= ulp).all()
    assert (deq == deq_ref).float().mean() > 0.95

def test_bad_input():
    a = torch.zeros(1, 100).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="hidden=100"):
        moe_fc1_swiglu(a, torch.zeros(1, 3, dtype=torch.uint8), torch.zeros(2, 64, 50, dtype=torch.uint8),
                       torch.zeros(2, 64, 3, dtype=torch.uint8), torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32))
