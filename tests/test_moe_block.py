"""The whole gpt-oss MoE block (routing -> FC1+SwiGLU -> FC2 combine) through our vLLM MoE method.

CPU (Triton interpreter): ``Sm121Mxfp4MoEMethod`` built with vLLM's own ``FusedMoEConfig`` and
upstream's weight creation, filled with random valid e2m1 codes and e8m0 scales, against the
dequantized pure-torch reference, for the decode (M <= DECODE_MAX_TOKENS) and grouped paths.
GPU (``-m gpu``): gpt-oss-120b / 20b layer shapes, M up to 2048; the error of MXFP8 activations
against a bf16-activation reference is reported separately from the kernel error.
"""

import dataclasses

import pytest
import torch
from vllm_sm121.kernels import moe as K


# the exact products' rules here (test_gpt_oss_shapes_on_gpu checks the packed ones too)
pytestmark = pytest.mark.usefixtures("exact_moe_products")


@dataclasses.dataclass(frozen=True)
class Case:
    m: int
    hidden: int
    inter: int
    experts: int
    topk: int


CPU_CASES = [Case(1, 64, 64, 4, 2), Case(3, 64, 64, 8, 4), Case(17, 64, 128, 8, 4), Case(0, 64, 64, 4, 2)]


def make_moe_config(c: Case):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    return FusedMoEConfig(num_experts=c.experts, experts_per_token=c.topk, hidden_dim=c.hidden,
                          intermediate_size=c.inter, num_local_experts=c.experts, num_logical_experts=c.experts,
                          activation=MoEActivation.SWIGLUOAI, device="cpu", routing_method=RoutingMethodType.Renormalize,
                          moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16,
                          has_bias=True)


def random_moe_weights(e: int, hidden: int, inter: int, g: torch.Generator, exp: tuple[int, int] = (118, 122),
                       bias_std: float = 0.5):
    """(w13, w13_scale, w13_bias, w2, w2_scale, w2_bias) in the checkpoint layout: random e2m1 bytes
    (every code), e8m0 exponents in [exp[0], exp[1]), bf16 biases N(0, bias_std)."""
    w13 = torch.randint(0, 256, (e, 2 * inter, hidden // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(*exp, (e, 2 * inter, hidden // 32), generator=g, dtype=torch.uint8)
    b13 = (torch.randn(e, 2 * inter, generator=g) * bias_std).bfloat16()
    w2 = torch.randint(0, 256, (e, hidden, inter // 2), generator=g, dtype=torch.uint8)
    s2 = torch.randint(*exp, (e, hidden, inter // 32), generator=g, dtype=torch.uint8)
    b2 = (torch.randn(e, hidden, generator=g) * bias_std).bfloat16()
    return w13, s13, b13, w2, s2, b2


def fill_random_mxfp4_(layer: torch.nn.Module, seed: int, base_exp: int = 118) -> None:
    """What ``--load-format dummy`` does not do: random valid e2m1 codes (both nibbles, every code)
    and e8m0 scales 2**-9..2**-6 (weights ~0.01-0.1), biases N(0, 0.25)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("w13_weight", "w2_weight"):
            p = getattr(layer, name)
            p.copy_(torch.randint(0, 256, p.shape, generator=g, dtype=torch.uint8))
        for name in ("w13_weight_scale", "w2_weight_scale"):
            p = getattr(layer, name)
            p.copy_(torch.randint(base_exp, base_exp + 4, p.shape, generator=g, dtype=torch.uint8))
        for name in ("w13_bias", "w2_bias"):
            p = getattr(layer, name)
            p.copy_((torch.randn(p.shape, generator=g) * 0.5).bfloat16())


def build_layer(c: Case, device: str, seed: int = 0, fill: bool = True):
    from vllm_sm121.moe.method import Sm121Mxfp4MoEMethod

    moe = make_moe_config(c)
    method = Sm121Mxfp4MoEMethod(moe)
    layer = torch.nn.Module()
    layer.moe_config = moe
    method.create_weights(layer, c.experts, c.hidden, moe.intermediate_size_per_partition, torch.bfloat16)
    if fill:
        fill_random_mxfp4_(layer, seed)
    layer.to(device)
    method.process_weights_after_loading(layer)
    return method, layer


def reference(layer, x, logits, topk, activations="mxfp8"):
    return K.moe_block_torch(x, logits, layer.w13_weight, layer.w13_weight_scale, layer.w13_bias, layer.w2_weight,
                             layer.w2_weight_scale, layer.w2_bias, topk, activations=activations)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def assert_block_close(out: torch.Tensor, ref: torch.Tensor, what: str):
    """bf16 output of fp32 sums in another order than the reference; a few MXFP8 roundings of the
    SwiGLU output can land on the other side of a tie (one e4m3 step of one element)."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    assert torch.isfinite(out.float()).all(), f"{what}: non-finite output"
    if ref.numel():
        assert rel_l2(out, ref) < 5e-3, f"{what}: relative L2 {rel_l2(out, ref):.2e}"
        torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2,
                                   msg=lambda m: f"{what}: {m}")


@pytest.mark.interpreter
@pytest.mark.parametrize("c", CPU_CASES, ids=lambda c: f"M{c.m}-H{c.hidden}-I{c.inter}-E{c.experts}-top{c.topk}")
def test_method_matches_dequantized_reference(device, c):
    method, layer = build_layer(c, device, seed=c.m)
    g = torch.Generator().manual_seed(100 + c.m)
    x = torch.randn(c.m, c.hidden, generator=g).bfloat16().to(device)
    logits = torch.randn(c.m, c.experts, generator=g).bfloat16().to(device)
    out = method.apply_monolithic(layer, x, logits)
    ref = reference(layer, x, logits, c.topk)
    assert_block_close(out, ref, f"{c}")
    if c.m:
        assert ref.abs().max() > 0.3  # the GEMMs saw real values
        ref_bf16 = reference(layer, x, logits, c.topk, activations="bf16")
        err = rel_l2(ref, ref_bf16)
        print(f"\n{c}: kernel vs MXFP8 ref {rel_l2(out, ref):.2e}; MXFP8 vs bf16 activations {err:.2e} (rel L2)")
        assert err < 8e-2  # the format's error, reported; the kernel's is assert_block_close's


@pytest.mark.interpreter
def test_decode_and_grouped_paths_agree(device):
    c = Case(5, 64, 64, 4, 2)
    _method, layer = build_layer(c, device, seed=7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(c.m, c.hidden, generator=g).bfloat16().to(device)
    logits = torch.randn(c.m, c.experts, generator=g).bfloat16().to(device)
    args = (layer.w13_weight, layer.w13_weight_scale, layer.w13_bias, layer.w2_weight, layer.w2_weight_scale,
            layer.w2_bias, c.topk)
    dec = K.moe_block(x, logits, *args, path="decode")
    grp = K.moe_block(x, logits, *args, path="grouped")
    assert rel_l2(dec, grp) < 5e-3
    # MXFP8 input (what the fused norm will hand over) gives the same result as bf16 quantized in FC1.
    from vllm_sm121.kernels.norm_mxfp8 import mxfp8_quantize_torch

    q, s = mxfp8_quantize_torch(x.float().cpu())
    for path in ("decode", "grouped"):
        out = K.moe_block(q.to(device), logits, *args, x_scale=s.to(device), path=path)
        assert rel_l2(out, dec) < 5e-3, path


@pytest.mark.interpreter
def test_dummy_weights_give_finite_bias_only_output(device):
    """--load-format dummy leaves codes and scales at 0 and activations ~1e-3: output is the
    routing-weighted w2 bias, no NaN/inf from scales."""
    c = Case(2, 64, 64, 4, 2)
    method, layer = build_layer(c, device, fill=False)
    with torch.no_grad():
        layer.w13_bias.uniform_(-1e-3, 1e-3)
        layer.w2_bias.uniform_(-1e-3, 1e-3)
    x = (torch.rand(c.m, c.hidden) * 2e-3 - 1e-3).bfloat16().to(device)
    logits = (torch.rand(c.m, c.experts) * 2e-3 - 1e-3).bfloat16().to(device)
    out = method.apply_monolithic(layer, x, logits)
    w, ids = K.moe_route_torch(logits.cpu(), c.topk)
    expect = (layer.w2_bias.cpu().float()[ids.long()] * w[..., None]).sum(1)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.cpu().float(), expect, atol=1e-5, rtol=1e-2)


@pytest.mark.interpreter
def test_routing_kernel_matches_topk_softmax(device):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 32, generator=g).bfloat16()
    w, ids = K.moe_route(logits.to(device), 4)
    rw, rids = K.moe_route_torch(logits, 4)
    assert torch.equal(ids.cpu(), rids)
    torch.testing.assert_close(w.cpu(), rw, rtol=1e-6, atol=1e-7)
    # vLLM's gpt-oss routing: softmax over all experts, top-k, renormalize -- the same weights.
    full = torch.softmax(logits.float(), -1).gather(1, rids.long())
    torch.testing.assert_close(w.cpu(), full / full.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


@pytest.mark.interpreter
def test_routing_survives_nan_and_inf_logits(device):
    """Padded rows of a captured CUDA graph can hold NaN / inf / garbage logits: every row still
    yields distinct ids in [0, E) and finite weights summing to 1; ordinary rows are unchanged."""
    g = torch.Generator().manual_seed(5)
    e, topk = 16, 4
    logits = torch.randn(6, e, generator=g)
    logits[1] = float("nan")
    logits[2, ::3] = float("nan")
    logits[3] = float("-inf")
    logits[4, 5] = float("inf")
    logits[4, 9] = float("inf")
    logits[5, :] = 0.0
    w, ids = K.moe_route(logits.bfloat16().to(device), topk)
    w, ids = w.cpu(), ids.cpu()
    assert ((ids >= 0) & (ids < e)).all()
    assert all(len(set(r.tolist())) == topk for r in ids)
    assert torch.isfinite(w).all() and (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(6), rtol=1e-6, atol=1e-6)
    rw, rids = K.moe_route_torch(logits[0:1].bfloat16(), topk)
    assert torch.equal(ids[0:1], rids)
    assert torch.equal(ids[1], torch.arange(topk, dtype=torch.int32))  # all NaN: experts 0..topk-1
    assert set(ids[4, :2].tolist()) == {5, 9}  # +inf ranks first
    assert not set(ids[2].tolist()) & set(range(0, e, 3))  # NaN ranks last


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["decode", "grouped"])
def test_block_with_nan_logit_rows_and_garbage_ids(device, path):
    """NaN rows (padding) give finite output and leave the other rows exact; the FC kernels and
    moe_align clamp out-of-range expert ids instead of indexing out of bounds."""
    c = Case(5, 64, 64, 4, 2)
    _method, layer = build_layer(c, device, seed=9)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(c.m, c.hidden, generator=g).bfloat16()
    logits = torch.randn(c.m, c.experts, generator=g).bfloat16()
    logits[1] = float("nan")
    logits[3, 0] = float("nan")
    args = (layer.w13_weight, layer.w13_weight_scale, layer.w13_bias, layer.w2_weight, layer.w2_weight_scale,
            layer.w2_bias, c.topk)
    out = K.moe_block(x.to(device), logits.to(device), *args, path=path).cpu()
    assert torch.isfinite(out.float()).all()
    ok = [0, 2, 4]
    ref = reference(layer, x[ok].to(device), logits[ok].to(device), c.topk).cpu()
    assert_block_close(out[ok], ref, path)
    # Garbage ids straight into the kernels: clamped, finite, no out-of-bounds access.
    ids = torch.tensor([[-3, 1], [2, 99], [0, 0], [7, -1], [1, 2]], dtype=torch.int32)
    w = torch.full((c.m, c.topk), 0.5)
    h, hs = K.moe_fc1_swiglu(x.to(device), None, *args[:3], ids.to(device))
    y = K.moe_fc2_combine(h, hs, *args[3:6], ids.to(device), w.to(device))
    assert torch.isfinite(y.float()).all()
    order, te, ts, tt = K.moe_align(ids, c.experts, 2)
    assert ((te >= 0) & (te < c.experts)).all() and sorted(order.tolist()) == list(range(ids.numel()))


@pytest.mark.interpreter
def test_decode_path_over_several_token_blocks(device):
    """The decode kernels take any M (token blocks of DECODE_BLOCK_M): forced at M=18 they agree
    with the grouped path."""
    c = Case(K.DECODE_BLOCK_M + 2, 64, 64, 4, 2)
    _method, layer = build_layer(c, device, seed=11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(c.m, c.hidden, generator=g).bfloat16().to(device)
    logits = torch.randn(c.m, c.experts, generator=g).bfloat16().to(device)
    args = (layer.w13_weight, layer.w13_weight_scale, layer.w13_bias, layer.w2_weight, layer.w2_weight_scale,
            layer.w2_bias, c.topk)
    dec = K.moe_block(x, logits, *args, path="decode")
    assert_block_close(dec, reference(layer, x, logits, c.topk), "decode M=18")
    assert rel_l2(dec, K.moe_block(x, logits, *args, path="grouped")) < 5e-3


def test_align_tiles_cover_every_pair_once():
    g = torch.Generator().manual_seed(4)
    for m, e, topk, bm in ((1, 4, 2, 16), (37, 8, 4, 16), (64, 128, 4, 64), (5, 3, 3, 2)):
        ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(m)]).int()
        order, te, ts, tt = K.moe_align(ids, e, bm)
        seen = []
        for t in range(te.numel()):
            rows = order[ts[t]:tt[t]].long()
            assert tt[t] - ts[t] <= bm
            assert (ids.flatten()[rows] == te[t]).all()
            seen += rows.tolist()
        assert sorted(seen) == list(range(m * topk))


# ---- GPU: gpt-oss shapes ------------------------------------------------------------------------

GPU_MS = (1, 2, 4, 8, 16, 32, 64, 256, 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("model,experts", [("gpt-oss-120b", 128), ("gpt-oss-20b", 32)])
@pytest.mark.parametrize("m", GPU_MS)
def test_gpt_oss_shapes_on_gpu(model, experts, m, monkeypatch):
    c = Case(m, 2880, 2880, experts, 4)
    method, layer = build_layer(c, "cuda", seed=m)
    g = torch.Generator().manual_seed(1000 + m)
    x = torch.randn(m, c.hidden, generator=g).bfloat16().cuda()
    logits = torch.randn(m, experts, generator=g).bfloat16().cuda()
    out = method.apply_monolithic(layer, x, logits)
    ref = reference(layer, x, logits, c.topk)
    ref_bf16 = reference(layer, x, logits, c.topk, activations="bf16")
    print(f"\n{model} M={m}: kernel vs MXFP8 reference rel L2 {rel_l2(out, ref):.2e}, max|d| "
          f"{(out.float() - ref).abs().max().item():.3e} (max|ref| {ref.abs().max().item():.3f}); "
          f"MXFP8 vs bf16 activations rel L2 {rel_l2(ref, ref_bf16):.2e}, kernel vs bf16-activation ref "
          f"{rel_l2(out, ref_bf16):.2e}")
    # The kernel is held to the MXFP8-activation reference (assert_block_close: < 5e-3; measured
    # 1.7e-3 on H200; the FMA GEMVs' packed fp16 products at M <= 4 passed it too). Since stop 38 M <= 16 (stop 39: 32)
    # takes them on sm_90 (chunks of 4 then, windowed since stop 39: the same products per token), measured
    # 4.4e-3 / 5.2e-3 from the reference at M = 8 / 16 (benchmarks/moe.py, H200, chunks): 1e-2 there, the
    # bound of tests/test_moe.py's packed-product tests. Against bf16 activations the error is
    # the format's (e4m3 activations at hidden 2880 on random data: ~0.042 measured), reported above and
    # only loosely bounded.
    windowed = m > K.FMA_KERNEL_MAX_TOKENS and K.select_path(m, x) == "fma"
    if windowed:
        assert torch.isfinite(out.float()).all() and rel_l2(out, ref) < 1e-2, rel_l2(out, ref)
        torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
    else:
        assert_block_close(out, ref, f"{model} M={m}")
    assert rel_l2(out, ref_bf16) < 8e-2
    if m <= K.FMA_MAX_TOKENS:  # the default products on a GPU: packed fp16 (about 3e-3 from the exact ones)
        monkeypatch.setenv(K.FMA_F16X2_ENV, "1")
        out16 = method.apply_monolithic(layer, x, logits)
        monkeypatch.setenv(K.FMA_F16X2_ENV, "0")
        print(f"{model} M={m}: packed fp16 products vs MXFP8 reference rel L2 {rel_l2(out16, ref):.2e}")
        assert torch.isfinite(out16.float()).all() and rel_l2(out16, ref) < 1e-2
    # Both paths at the decode/grouped boundary give the same answer.
    if m <= 16:
        args = (layer.w13_weight, layer.w13_weight_scale, layer.w13_bias, layer.w2_weight, layer.w2_weight_scale,
                layer.w2_bias, c.topk)
        grouped = K.moe_block(x, logits, *args, path="grouped")
        assert rel_l2(grouped, out) < (1e-2 if windowed else 5e-3)


@pytest.mark.gpu
def test_decode_block_is_graph_capturable():
    c = Case(4, 2880, 2880, 128, 4)
    method, layer = build_layer(c, "cuda")
    x = torch.randn(c.m, c.hidden, device="cuda").bfloat16()
    logits = torch.randn(c.m, c.experts, device="cuda").bfloat16()
    for path_m in (4, 256):  # decode and grouped
        xs, ls = x.repeat(path_m // 4, 1), logits.repeat(path_m // 4, 1)
        eager = method.apply_monolithic(layer, xs, ls)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = method.apply_monolithic(layer, xs, ls)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), path_m
