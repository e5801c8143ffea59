"""MoE FC1 + SwiGLU -> MXFP8 (decode kernel) vs the torch reference on random real-format weights."""

import pytest
import torch
from test_moe_block import random_moe_weights

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
    w13, w13_s, b13, w2, w2_s, b2 = random_moe_weights(e, hidden, i, g, exp=(117, 120), bias_std=0.1)
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


# ---- the CUDA-core (FMA) decode GEMVs for M <= 4 tokens --------------------------------------------

def _ids_with_shared_experts(m: int, e: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """Distinct experts within a token (as routing gives); every token routes to expert ids[0, 0]
    too, in slot t % topk, so one program serves several tokens (and finds them in other slots)."""
    shared = int(torch.randint(0, e, (1,), generator=g))
    rows = []
    for t in range(m):
        others = [x for x in torch.randperm(e, generator=g).tolist() if x != shared][:topk - 1]
        others.insert(t % topk, shared)
        rows.append(others)
    return torch.tensor(rows, dtype=torch.int32)


def _assert_mxfp8_close(q, s, ref_q, ref_s):
    """The FC1 output rule of test_fc1_swiglu_matches_reference: same scales, values within one
    e4m3 step (another summation order can cross a rounding boundary), >= 95% identical."""
    assert torch.equal(s.cpu(), ref_s)
    deq, deq_ref = mxfp8_dequantize_torch(q.cpu(), s.cpu()), mxfp8_dequantize_torch(ref_q, ref_s)
    assert torch.isfinite(deq).all()
    scale = torch.exp2(ref_s.float() - 127).repeat_interleave(32, dim=1)
    ulp = torch.maximum(torch.exp2(torch.floor(torch.log2(deq_ref.abs().clamp(min=1e-30))) - 3), scale * 2**-9)
    assert ((deq - deq_ref).abs() <= ulp).all()
    assert (deq == deq_ref).float().mean() > 0.95


def _fc1_case(m, k, i, e, topk, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    a, a_scale = mxfp8_quantize_torch(x)
    w13 = torch.randint(0, 256, (e, 2 * i, k // 2), generator=g, dtype=torch.uint8)
    w13_scale = torch.randint(118, 122, (e, 2 * i, k // 32), generator=g, dtype=torch.uint8)
    bias = (torch.randn(e, 2 * i, generator=g) * 0.5).bfloat16()
    return x, a, a_scale, w13, w13_scale, bias, _ids_with_shared_experts(m, e, topk, g)


@pytest.mark.parametrize("m,k,i,e,topk,tiles", [
    (1, 128, 64, 4, 2, None),
    (2, 64, 64, 4, 3, None),
    (3, 192, 96, 8, 4, "128,64,16,32,4,2"),  # 2 K steps (last one half masked), rows past 2I masked, prefetch
    (4, 64, 64, 4, 4, "64,16,32,16,2,2"),  # every token shares expert ids[0, 0]
])
def test_fma_fc1_matches_reference(device, m, k, i, e, topk, tiles):
    from vllm_sm121.kernels.moe import FmaTiles, moe_fc1_swiglu_fma

    x, a, a_scale, w13, w13_scale, bias, topk_ids = _fc1_case(m, k, i, e, topk, seed=10 + m)
    (ref_q, ref_s), y_ref = moe_fc1_swiglu_torch(a, a_scale, w13, w13_scale, bias, topk_ids)
    assert y_ref.abs().max() > 0.5
    dev = lambda t: t.to(device)  # noqa: E731
    t = FmaTiles.parse(tiles) if tiles else None
    q, s = moe_fc1_swiglu_fma(dev(a), dev(a_scale), dev(w13), dev(w13_scale), dev(bias), dev(topk_ids), t)
    _assert_mxfp8_close(q, s, ref_q, ref_s)
    if m <= 2:  # bf16 activations: quantized to MXFP8 first (mxfp8_quantize), the same numbers
        qb, sb = moe_fc1_swiglu_fma(dev(x.bfloat16()), None, dev(w13), dev(w13_scale), dev(bias), dev(topk_ids), t)
        (rq, rs), _ = moe_fc1_swiglu_torch(x.bfloat16(), None, w13, w13_scale, bias, topk_ids)
        _assert_mxfp8_close(qb, sb, rq, rs)


@pytest.mark.parametrize("m,hidden,i,e,topk,tiles", [
    (1, 96, 128, 4, 2, None),  # rows past H masked (96 = 16 * 6)
    (3, 64, 64, 3, 3, "64,16,64,32,2,2"),  # one tile of 64 rows, prefetch
    (4, 96, 192, 8, 4, "64,16,64,64,4,1"),  # H masked in a 64-row tile, 2 K steps (last half masked)
    (2, 64, 192, 4, 2, "64,16,32,32,2,2,0,0,2"),  # split-K: 2 splits of 4 groups (the last one 2), prefetch
    (3, 64, 128, 4, 3, "64,16,64,16,2,1,4,1,3"),  # split-K asked 3 for 4 groups: 2 splits of 2 steps
])
def test_fma_fc2_matches_reference(device, m, hidden, i, e, topk, tiles):
    from vllm_sm121.kernels.moe import FmaTiles, moe_fc2_combine_fma, moe_fc2_combine_torch

    g = torch.Generator().manual_seed(20 + m)
    h, h_scale = mxfp8_quantize_torch(torch.randn(m * topk, i, generator=g) * 3)
    w2 = torch.randint(0, 256, (e, hidden, i // 2), generator=g, dtype=torch.uint8)
    w2_scale = torch.randint(118, 122, (e, hidden, i // 32), generator=g, dtype=torch.uint8)
    bias = (torch.randn(e, hidden, generator=g) * 0.5).bfloat16()
    topk_ids = _ids_with_shared_experts(m, e, topk, g)
    topk_w = torch.softmax(torch.randn(m, topk, generator=g), -1)
    ref = moe_fc2_combine_torch(h, h_scale, w2, w2_scale, bias, topk_ids, topk_w)
    dev = lambda t: t.to(device)  # noqa: E731
    t = FmaTiles.parse(tiles) if tiles else None
    out = moe_fc2_combine_fma(dev(h), dev(h_scale), dev(w2), dev(w2_scale), dev(bias), dev(topk_ids), dev(topk_w), t)
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(out.cpu().float(), ref, rtol=2**-8, atol=1e-5)  # as test_fc2_combine_matches_reference


def test_fma_block_matches_decode_path_with_repeated_and_garbage_ids(device):
    """A token routed twice to one expert (garbage ids, clamped into [0, E)): the FMA kernels
    follow the decode kernels' convention (FC1 writes the first slot, FC2 sums the repeated
    slots' weights there and writes zeros to the others), so both chains give the same output."""
    from vllm_sm121.kernels.moe import moe_fc1_swiglu_fma, moe_fc2_combine, moe_fc2_combine_fma, moe_fc1_swiglu

    m, k, i, e, topk = 3, 64, 64, 4, 2
    x, a, a_scale, w13, w13_scale, b13, _ = _fc1_case(m, k, i, e, topk, seed=31)
    g = torch.Generator().manual_seed(32)
    w2 = torch.randint(0, 256, (e, k, i // 2), generator=g, dtype=torch.uint8)
    w2_scale = torch.randint(118, 122, (e, k, i // 32), generator=g, dtype=torch.uint8)
    b2 = (torch.randn(e, k, generator=g) * 0.5).bfloat16()
    ids = torch.tensor([[2, 2], [-3, 1], [1, 99]], dtype=torch.int32)  # -> [2, 2], [0, 1], [1, 3]
    w = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.5, 0.5]])
    dev = lambda t: t.to(device)  # noqa: E731
    outs = []
    for fc1, fc2 in ((moe_fc1_swiglu_fma, moe_fc2_combine_fma), (moe_fc1_swiglu, moe_fc2_combine)):
        h, hs = fc1(dev(a), dev(a_scale), dev(w13), dev(w13_scale), dev(b13), dev(ids))
        outs.append(fc2(h, hs, dev(w2), dev(w2_scale), dev(b2), dev(ids), dev(w)).cpu().float())
    assert torch.isfinite(outs[0]).all() and outs[1].abs().max() > 0.5
    torch.testing.assert_close(outs[0], outs[1], rtol=2**-7, atol=1e-5)


def test_fma_tiles_parse_env_and_path_selection(monkeypatch):
    from vllm_sm121.kernels import moe as K

    t = K.FmaTiles.parse("64,256,32,128,8,2")
    assert (t.fc1_rows, t.fc1_kb, t.fc2_rows, t.fc2_kb, t.num_warps, t.num_stages) == (64, 256, 32, 128, 8, 2)
    assert t.fc2_launch() == (8, 2) and K.FmaTiles.parse(t.spec()) == t
    t8 = K.FmaTiles.parse("128,512,16,256,8,1,4,2")
    assert t8.fc2_launch() == (4, 2) and K.FmaTiles.parse(t8.spec()) == t8
    t9 = K.FmaTiles.parse("64,256,32,256,8,2,0,0,3")
    assert t9.fc2_launch() == (8, 2) and t9.fc2_split == 3 and K.FmaTiles.parse(t9.spec()) == t9
    assert K.fc2_split_k(2880, 16, 1) == (1, 96) and K.fc2_split_k(2880, 16, 2) == (2, 48)
    assert K.fc2_split_k(2880, 16, 8) == (6, 16)  # whole K steps per split, no empty split
    for bad in ("32,256,32,256,8,1", "64,100,32,256,8,1", "64,256,32,256,3,1", "64,256,32", "64,8,32,256,8,1",
                "64,256,32,256,8,1,4,1,0"):
        with pytest.raises(ValueError):
            K.FmaTiles.parse(bad)
    cpu = torch.empty(0)
    monkeypatch.delenv(K.FMA_TILES_ENV, raising=False)
    assert K.fma_tiles(cpu) == K.FMA_TILES[("interpreter", 1)]
    assert K.fma_tiles(cpu, 3) == K.FMA_TILES[("interpreter", 2)]
    monkeypatch.setenv(K.FMA_TILES_ENV, "128,64,16,32,4,2")
    assert K.fma_tiles(cpu) == K.FmaTiles(128, 64, 16, 32, 4, 2)
    # every family has tiles; the path switch
    from vllm_sm121 import platform as P

    assert {(f, n) for f in (P.SM90, P.SM12X, P.INTERPRETER) for n in (1, 2)} <= set(K.FMA_TILES)
    monkeypatch.delenv(K.FMA_MAX_TOKENS_ENV, raising=False)
    assert [K.select_path(m) for m in (1, K.FMA_MAX_TOKENS, K.FMA_MAX_TOKENS + 1, K.DECODE_MAX_TOKENS + 1)] == [
        "fma", "fma", "decode", "grouped"]
    monkeypatch.setenv(K.FMA_MAX_TOKENS_ENV, "0")
    assert K.select_path(1) == "decode"
    monkeypatch.setenv(K.FMA_MAX_TOKENS_ENV, "99")  # capped at what the kernels take
    assert K.select_path(K.FMA_KERNEL_MAX_TOKENS + 1) == "decode"
    # chunked FMA: off by default (untimed), on for M up to its limit while the FMA path is on
    monkeypatch.delenv(K.FMA_MAX_TOKENS_ENV)
    assert K.FMA_CHUNK_MAX_TOKENS == 0
    monkeypatch.setenv(K.FMA_CHUNK_MAX_TOKENS_ENV, "16")
    assert [K.select_path(m) for m in (4, 5, 16, 17)] == ["fma", "fma", "fma", "grouped"]
    monkeypatch.setenv(K.FMA_MAX_TOKENS_ENV, "0")
    assert K.select_path(5) == "decode"
    with pytest.raises(ValueError, match="at most 4 tokens"):
        K.moe_fc1_swiglu_fma(torch.zeros(5, 64).bfloat16(), None, torch.zeros(2, 64, 32, dtype=torch.uint8),
                             torch.zeros(2, 64, 2, dtype=torch.uint8), torch.zeros(2, 64).bfloat16(),
                             torch.zeros(5, 2, dtype=torch.int32))


@pytest.mark.parametrize("m", [4, 9])
def test_fma_block_path_matches_reference(device, m):
    """moe_block(path="fma") end to end (routing + MXFP8 quantization of bf16 x, FC1, FC2, combine)
    and with MXFP8 input, against the fp32 reference, at M = 4 (the largest FMA batch) and M = 9
    (chunks of 4, 4 and 1 tokens after one routing launch)."""
    from vllm_sm121.kernels import moe as K

    hidden, i, e, topk = 64, 64, 8, 2
    g = torch.Generator().manual_seed(40)
    w13 = torch.randint(0, 256, (e, 2 * i, hidden // 2), generator=g, dtype=torch.uint8)
    w13_s = torch.randint(118, 122, (e, 2 * i, hidden // 32), generator=g, dtype=torch.uint8)
    b13 = (torch.randn(e, 2 * i, generator=g) * 0.5).bfloat16()
    w2 = torch.randint(0, 256, (e, hidden, i // 2), generator=g, dtype=torch.uint8)
    w2_s = torch.randint(118, 122, (e, hidden, i // 32), generator=g, dtype=torch.uint8)
    b2 = (torch.randn(e, hidden, generator=g) * 0.5).bfloat16()
    x = torch.randn(m, hidden, generator=g).bfloat16()
    logits = torch.randn(m, e, generator=g).bfloat16()
    logits[2] = logits[0]  # tokens 0 and 2 share both experts
    args = [w13, w13_s, b13, w2, w2_s, b2]
    ref = K.moe_block_torch(x, logits, *args, topk)
    dev = lambda t: t.to(device)  # noqa: E731
    out = K.moe_block(dev(x), dev(logits), *map(dev, args), topk, path="fma").cpu()
    assert out.dtype == torch.bfloat16 and ref.abs().max() > 0.3
    assert ((out.float() - ref).norm() / ref.norm()) < 5e-3
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
    q, s = mxfp8_quantize_torch(x.float())
    out_q = K.moe_block(dev(q), dev(logits), *map(dev, args), topk, x_scale=dev(s), path="fma").cpu()
    assert torch.equal(out_q, out)
    if m > K.FMA_KERNEL_MAX_TOKENS:  # a chunk's tokens get exactly what they get alone
        first = K.moe_block(dev(x[:4]), dev(logits[:4]), *map(dev, args), topk, path="fma").cpu()
        assert torch.equal(out[:4], first)


# ---- GPU: the FMA path at gpt-oss shapes ----------------------------------------------------------

def _gpt_oss_layer(experts: int, seed: int, hidden: int = 2880, inter: int = 2880):
    """Random valid MXFP4 expert weights (e8m0 2**-9..2**-6, as benchmarks/moe.py) on the GPU."""
    g = torch.Generator().manual_seed(seed)
    e, h, i = experts, hidden, inter

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).cuda()

    def scales(*shape):
        return torch.randint(118, 122, shape, generator=g, dtype=torch.uint8).cuda()

    def bias(*shape):
        return (torch.randn(shape, generator=g) * 0.1).bfloat16().cuda()

    return [codes(e, 2 * i, h // 2), scales(e, 2 * i, h // 32), bias(e, 2 * i), codes(e, h, i // 2),
            scales(e, h, i // 32), bias(e, h)]


@pytest.mark.gpu
@pytest.mark.parametrize("model,experts", [("gpt-oss-120b", 128), ("gpt-oss-20b", 32)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_fma_path_gpt_oss_shapes_on_gpu(model, experts, m):
    """moe_block(path="fma") vs the fp32 reference and vs the dot_scaled decode path; FC1 alone vs
    its reference; CUDA-graph replay equals eager. For m >= 2 the last token copies token 0's
    router logits, so one program serves two tokens."""
    from vllm_sm121.kernels import moe as K

    args = _gpt_oss_layer(experts, seed=m)
    g = torch.Generator().manual_seed(500 + m)
    x = torch.randn(m, 2880, generator=g).bfloat16().cuda()
    logits = torch.randn(m, experts, generator=g).bfloat16().cuda()
    if m >= 2:
        logits[m - 1] = logits[0]
    out = K.moe_block(x, logits, *args, 4, path="fma")
    ref = K.moe_block_torch(x, logits, *args, 4)
    dec = K.moe_block(x, logits, *args, 4, path="decode")
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    rel_dec = ((out.float() - dec.float()).norm() / dec.float().norm()).item()
    print(f"\n{model} M={m} fma: rel L2 vs MXFP8 reference {rel:.2e}, vs decode path {rel_dec:.2e}")
    assert torch.isfinite(out.float()).all() and ref.abs().max() > 0.1
    assert rel < 5e-3 and rel_dec < 5e-3
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
    # FC1 alone (MXFP8 output) against its reference
    topk_w, topk_ids, xq, xs = K.moe_route(logits, 4, x)
    q, s = K.moe_fc1_swiglu_fma(xq, xs, *args[:3], topk_ids)
    (ref_q, ref_s), _ = K.moe_fc1_swiglu_torch(xq, xs, *args[:3], topk_ids)
    first = [t * 4 + j for t in range(m) for j in range(4)]  # routing gives distinct experts per token
    _assert_mxfp8_close(q[first], s[first], ref_q[first].cpu(), ref_s[first].cpu())
    # graph capture replays the same kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = K.moe_block(x, logits, *args, 4, path="fma")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_g, out)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", ["64,256,32,256,8,1", "64,128,16,128,4,2", "128,512,64,512,8,2,4,1",
                                   "64,64,16,64,2,2", "64,256,32,256,4,1,4,1,2", "64,256,32,128,8,2,4,2,4"])
def test_fma_tiles_on_gpu(tiles, monkeypatch):
    """Every tile shape the sweep may pick gives the same block output at gpt-oss-120b shapes
    (only the fp32 summation order differs)."""
    from vllm_sm121.kernels import moe as K

    args = _gpt_oss_layer(128, seed=7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 2880, generator=g).bfloat16().cuda()
    logits = torch.randn(4, 128, generator=g).bfloat16().cuda()
    logits[3] = logits[1]
    ref = K.moe_block_torch(x, logits, *args, 4)
    for m in (1, 4):
        monkeypatch.setenv(K.FMA_TILES_ENV, tiles)
        out = K.moe_block(x[:m], logits[:m], *args, 4, path="fma")
        rel = ((out.float() - ref[:m]).norm() / ref[:m].norm()).item()
        assert rel < 5e-3, (tiles, m, rel)
