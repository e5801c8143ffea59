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


@pytest.mark.parametrize("m,hidden,i,e,topk", [(1, 96, 128, 4, 2), (2, 64, 192, 3, 3)])
def test_fc2_combine_matches_reference(device, m, hidden, i, e, topk):
    from vllm_sm121.kernels.moe import moe_fc2_combine, moe_fc2_combine_torch

    g = torch.Generator().manual_seed(2)
    h, h_scale = mxfp8_quantize_torch(torch.randn(m * topk, i, generator=g) * 3)
    w2 = torch.randint(0, 256, (e, hidden, i // 2), generator=g, dtype=torch.uint8)
    w2_scale = torch.randint(118, 122, (e, hidden, i // 32), generator=g, dtype=torch.uint8)
    bias = (torch.randn(e, hidden, generator=g) * 0.5).bfloat16()
    topk_ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(m)]).int()
    topk_w = torch.softmax(torch.randn(m, topk, generator=g), -1)
    ref = moe_fc2_combine_torch(h, h_scale, w2, w2_scale, bias, topk_ids, topk_w)
    dev = lambda t: t.to(device)  # noqa: E731
    out = moe_fc2_combine(dev(h), dev(h_scale), dev(w2), dev(w2_scale), dev(bias), dev(topk_ids), dev(topk_w))
    assert ref.abs().max() > 0.5
    # fp32 accumulation in another order, then one bf16 rounding.
    torch.testing.assert_close(out.cpu().float(), ref, rtol=2**-8, atol=1e-5)
    # The routing weights matter: a uniform mix must differ.
    uniform = moe_fc2_combine_torch(h, h_scale, w2, w2_scale, bias, topk_ids, torch.full_like(topk_w, 1 / topk))
    assert (uniform - ref).abs().max() > 1e-2


def test_decode_moe_chain_close_to_unquantized_activations(device):
    """norm -> MXFP8 -> FC1+SwiGLU -> MXFP8 -> FC2 combine, against the same weights with fp32
    activations: the two activation quantizations (e4m3, 3 mantissa bits) cost well under 2% (L2)."""
    from vllm_sm121.kernels.moe import SWIGLU_ALPHA, SWIGLU_LIMIT, moe_fc2_combine
    from vllm_sm121.kernels.norm_mxfp8 import fused_add_rmsnorm_mxfp8

    g = torch.Generator().manual_seed(3)
    m, hidden, i, e, topk = 2, 128, 128, 4, 2
    x = torch.randn(m, hidden, generator=g).bfloat16()
    res = torch.randn(m, hidden, generator=g).bfloat16()
    norm_w = torch.ones(hidden).bfloat16()
    w13 = torch.randint(0, 256, (e, 2 * i, hidden // 2), generator=g, dtype=torch.uint8)
    w13_s = torch.randint(117, 120, (e, 2 * i, hidden // 32), generator=g, dtype=torch.uint8)
    b13 = (torch.randn(e, 2 * i, generator=g) * 0.1).bfloat16()
    w2 = torch.randint(0, 256, (e, hidden, i // 2), generator=g, dtype=torch.uint8)
    w2_s = torch.randint(117, 120, (e, hidden, i // 32), generator=g, dtype=torch.uint8)
    b2 = (torch.randn(e, hidden, generator=g) * 0.1).bfloat16()
    topk_ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(m)]).int()
    topk_w = torch.softmax(torch.randn(m, topk, generator=g), -1)
    dev = lambda t: t.to(device)  # noqa: E731

    y, a, a_s = fused_add_rmsnorm_mxfp8(dev(x), dev(res.clone()), dev(norm_w))
    h, h_s = moe_fc1_swiglu(a, a_s, dev(w13), dev(w13_s), dev(b13), dev(topk_ids))
    out = moe_fc2_combine(h, h_s, dev(w2), dev(w2_s), dev(b2), dev(topk_ids), dev(topk_w)).cpu().float()

    # Reference with unquantized (fp32) activations and the same MXFP4 weights.
    yf = y.cpu().float().repeat_interleave(topk, dim=0)
    ids = topk_ids.long().flatten()
    h_ref = torch.einsum("pnk,pk->pn", dequant_mxfp4_torch(w13[ids], w13_s[ids]), yf) + b13[ids].float()
    gate, up = h_ref[:, 0::2].clamp(max=SWIGLU_LIMIT), h_ref[:, 1::2].clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    act = (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)
    o = torch.einsum("phk,pk->ph", dequant_mxfp4_torch(w2[ids], w2_s[ids]), act) + b2[ids].float()
    ref = (o.view(m, topk, -1) * topk_w[..., None]).sum(1)
    rel = (out - ref).norm() / ref.norm()
    print(f"\nMXFP8 activations vs fp32 activations, same MXFP4 weights: relative L2 error {rel:.4f}")
    assert rel < 0.02  # measured 0.0024 here
