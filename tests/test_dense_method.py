"""The FP8 dense linear methods on CPU: weights as upstream, conversion after loading, apply, routing."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import assert_close

from vllm_sm121.config import Sm121Config
from vllm_sm121.dense import method as M
from vllm_sm121.kernels.dense import dense_fp8_linear_torch


class FakeLinear(torch.nn.Module):
    """A LinearBase-shaped layer: bf16 ``weight`` [N, K] (+ bias) and a quant method."""

    def __init__(self, n: int, k: int, quant_method):
        super().__init__()
        self.quant_method = quant_method
        self.register_parameter("weight", torch.nn.Parameter(torch.randn(n, k).bfloat16(), requires_grad=False))

    def forward(self, x, bias=None):
        return self.quant_method.apply(self, x, bias)


@pytest.mark.interpreter
@pytest.mark.parametrize("method_cls", [M.Sm121DenseFp8LinearMethod, M.Sm121DenseFp8LMHeadMethod])
def test_process_weights_after_loading_then_apply(method_cls, device):
    torch.manual_seed(0)
    layer = FakeLinear(40, 64, method_cls()).to(device)
    w_bf16 = layer.weight.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.shape == (40, 64)
    assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (40,)
    assert not layer.weight.requires_grad
    assert [n for n, p in layer.named_parameters() if p.dtype == torch.bfloat16] == []  # bf16 copy freed
    layer.quant_method.process_weights_after_loading(layer)  # idempotent
    x = torch.randn(2, 3, 64).bfloat16().to(device)
    bias = torch.randn(40).bfloat16().to(device)
    out = layer(x, bias)
    assert out.shape == (2, 3, 40) and out.dtype == torch.bfloat16
    ref = dense_fp8_linear_torch(x.view(6, 64), layer.weight, layer.weight_scale, bias).view(2, 3, 40)
    assert_close(out, ref, atol=1e-2, rtol=1e-2)
    # weight error vs the bf16 layer stays at e4m3's level
    rel = ((out.float() - (x.float() @ w_bf16.float().T + bias.float())).norm() / ref.norm()).item()
    assert rel < 0.05, rel


def test_create_weights_is_upstreams(monkeypatch):
    import vllm.model_executor.parameter as P

    monkeypatch.setattr(P, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(P, "get_tensor_model_parallel_world_size", lambda: 1)
    layer = torch.nn.Module()
    loader = lambda param, w: param.data.copy_(w)  # noqa: E731
    M.Sm121DenseFp8LinearMethod().create_weights(layer, 64, [32, 16, 16], 64, 64, torch.bfloat16,
                                                 weight_loader=loader)
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.shape == (64, 64)
    assert layer.weight.weight_loader is loader
    head = torch.nn.Module()
    M.Sm121DenseFp8LMHeadMethod().create_weights(head, 64, [128], 64, 128, torch.bfloat16, weight_loader=loader)
    assert head.weight.shape == (128, 64) and head.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="tied"):
        M.Sm121DenseFp8LMHeadMethod().embedding(head, torch.zeros(1, dtype=torch.long))


def _bare(cls):
    return cls.__new__(cls)  # isinstance is all the routing looks at (no TP group needed)


def test_dense_quant_method_for():
    from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    fp8, bf16 = Sm121Config(dense_weights="fp8"), Sm121Config()
    qkv, o = _bare(QKVParallelLinear), _bare(RowParallelLinear)
    head, router = _bare(ParallelLMHead), _bare(ReplicatedLinear)
    assert isinstance(M.dense_quant_method_for(qkv, "model.layers.0.attn.qkv_proj", fp8), M.Sm121DenseFp8LinearMethod)
    assert isinstance(M.dense_quant_method_for(o, "model.layers.3.attn.o_proj", fp8), M.Sm121DenseFp8LinearMethod)
    assert isinstance(M.dense_quant_method_for(head, "lm_head", fp8), M.Sm121DenseFp8LMHeadMethod)
    assert M.dense_quant_method_for(router, "model.layers.0.mlp.router", fp8) is None
    assert M.dense_quant_method_for(_bare(VocabParallelEmbedding), "model.embedding", fp8) is None
    assert M.dense_quant_method_for(head, "model.drafter.head", fp8) is None
    for layer, prefix in ((qkv, "x.qkv_proj"), (o, "x.o_proj"), (head, "lm_head")):
        assert M.dense_quant_method_for(layer, prefix, bf16) is None


def test_option_fp8_accepted_mxfp4_refused():
    from vllm_sm121 import config

    assert config.OPTIONS["dense_weights"].implemented == ("bf16", "fp8")
    assert config.parse({"sm121": {"dense_weights": "fp8"}}).dense_weights == "fp8"
    with pytest.raises(ValueError, match=r"""'dense_weights': 'mxfp4' is not implemented in this vllm-sm121 release; """
                                         r"supported now: bf16, fp8"):
        config.parse({"sm121": {"dense_weights": "mxfp4"}})


def test_tensor_parallel_shards_convert_like_tp1():
    """Under TP each rank converts its own shard. Column-parallel (qkv, lm_head rows): a shard's
    per-row codes and scales are exactly the unsharded ones. Row-parallel (o_proj, K split): each
    shard is scaled by its whole rows' max (``row_amax``, all-reduced over the TP group), so its
    codes are exactly the unsharded codes' columns and its scales the unsharded scales; the
    all-reduced sum of the shards' outputs (bias on rank 0, as vLLM's RowParallelLinear adds it)
    then equals the unsharded product up to summation order. A shard scaled by its own max
    instead (the old behaviour) gets other codes wherever the row's max sits in another shard."""
    from vllm_sm121.kernels.dense import fp8_per_channel_quantize, fp8_row_amax

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(48, 128, generator=g) * 0.02).bfloat16()
    w[5, 70] = 1.0  # an outlier in the second K half
    x = torch.randn(4, 128, generator=g).bfloat16()
    bias = torch.randn(48, generator=g).bfloat16()
    codes, scale = fp8_per_channel_quantize(w)
    for r in range(2):
        c, s = fp8_per_channel_quantize(w[24 * r:24 * (r + 1)])
        assert torch.equal(c.view(torch.uint8), codes[24 * r:24 * (r + 1)].view(torch.uint8))
        assert torch.equal(s, scale[24 * r:24 * (r + 1)])
    halves = [w[:, 64 * r:64 * (r + 1)].contiguous() for r in range(2)]
    whole = torch.maximum(fp8_row_amax(halves[0]), fp8_row_amax(halves[1]))  # the MAX all-reduce
    assert torch.equal(whole, fp8_row_amax(w))
    shares = []
    for r in range(2):
        c, s = fp8_per_channel_quantize(halves[r], row_amax=whole)
        assert torch.equal(c.view(torch.uint8), codes[:, 64 * r:64 * (r + 1)].view(torch.uint8))
        assert torch.equal(s, scale)
        shares.append(dense_fp8_linear_torch(x[:, 64 * r:64 * (r + 1)], c, s, bias if r == 0 else None).float())
    unsharded = dense_fp8_linear_torch(x, codes, scale, bias).float()
    assert torch.allclose(shares[0] + shares[1], unsharded, rtol=2e-2, atol=2e-2)
    own = fp8_per_channel_quantize(halves[0])[0]  # row 5's max lives in the other half
    assert not torch.equal(own[5].view(torch.uint8), codes[5, :64].view(torch.uint8))
    with pytest.raises(ValueError, match="row_amax is below"):
        fp8_per_channel_quantize(halves[1], row_amax=fp8_row_amax(halves[0]))
    with pytest.raises(ValueError, match="row_amax has shape"):
        fp8_per_channel_quantize(halves[1], row_amax=whole[:3])
    # a non-finite value in one shard reaches every rank through the MAX (+inf), so all ranks refuse
    # together (none waits in the next collective for a rank that raised)
    bad = halves[0].clone()
    bad[7, 3] = float("nan")
    whole_bad = torch.maximum(fp8_row_amax(bad), fp8_row_amax(halves[1]))
    assert whole_bad[7] == float("inf") and torch.isfinite(whole_bad[torch.arange(48) != 7]).all()
    with pytest.raises(ValueError, match=r"row_amax is not finite in rows \[7\]"):
        fp8_per_channel_quantize(halves[1], row_amax=whole_bad)


def test_row_parallel_conversion_all_reduces_the_row_max(monkeypatch):
    """``convert_layer_weight_`` on an o_proj-like RowParallelLinear at TP=2 takes the MAX of its
    rows' max over vLLM's TP group (faked here: the other rank's shard) before quantizing; other
    layers and TP=1 do not communicate."""
    import torch.distributed as dist
    import vllm.distributed as vd
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    from vllm_sm121.dense import method as M
    from vllm_sm121.kernels.dense import fp8_per_channel_quantize, fp8_row_amax

    g = torch.Generator().manual_seed(4)
    full = (torch.randn(16, 64, generator=g) * 0.02).bfloat16()
    full[3, 50] = 0.9  # in rank 1's half
    mine, other = full[:, :32].contiguous(), full[:, 32:].contiguous()
    calls = []

    def fake_all_reduce(t, op=None, group=None):
        calls.append((op, group))
        t.copy_(torch.maximum(t, fp8_row_amax(other)))

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(vd, "get_tp_group", lambda: types.SimpleNamespace(device_group="tp-group"))

    def layer(cls, w, tp):
        m = torch.nn.Module.__new__(cls)
        torch.nn.Module.__init__(m)
        m.tp_size = tp
        m.register_parameter("weight", torch.nn.Parameter(w.clone(), requires_grad=False))
        return m

    row = layer(RowParallelLinear, mine, 2)
    M.convert_layer_weight_(row)
    codes, scale = fp8_per_channel_quantize(full)
    assert calls == [(dist.ReduceOp.MAX, "tp-group")]
    assert torch.equal(row.weight.view(torch.uint8), codes[:, :32].view(torch.uint8))
    assert torch.equal(row.weight_scale, scale)
    for other_layer in (layer(RowParallelLinear, mine, 1), layer(ColumnParallelLinear, mine, 2)):
        M.convert_layer_weight_(other_layer)
        assert torch.equal(other_layer.weight_scale, fp8_per_channel_quantize(mine)[1])
    assert len(calls) == 1




@pytest.mark.interpreter
@pytest.mark.parametrize("m,calibrated", [(1, True), (2, True), (1, False), (6, True)])
def test_qkv_op_writes_the_layers_nvfp4_cache(m, calibrated, device, monkeypatch):
    """``sm121::dense_fp8_linear_rope_kv`` (opt-in $VLLM_SM121_KV_IN_QKV): the rotated qkv of
    ``dense_fp8_linear_rope`` and, in the attention layer's nvfp4 cache, exactly the bytes the
    layer's own ``do_kv_cache_update`` writes from it (vLLM's ``unified_kv_cache_update``): fused
    into the GEMV once the layer's global scales are set, through the layer's write (which sets
    them) before that; a profiling run (no slots) writes nothing."""
    from vllm.model_executor.layers.attention import attention as A

    from vllm_sm121.attention.impl import SM121AttentionImpl
    from vllm_sm121.kernels import dense as D

    head, hq, hkv, k = 32, 4, 2, 64
    g = torch.Generator().manual_seed(40 + m)
    n, rope_rows = (hq + 2 * hkv) * head, (hq + hkv) * head
    q8, s8 = D.fp8_per_channel_quantize((torch.randn(n, k, generator=g) * 0.5).bfloat16())
    bias = torch.randn(n, generator=g).bfloat16()
    ang = torch.rand(512, head // 2, generator=g) * 6.3
    cos_sin = torch.cat((ang.cos(), ang.sin()), dim=-1)
    x = torch.randn(m, k, generator=g).bfloat16()
    pos = torch.randint(0, 512, (m,), generator=g)
    slots = torch.tensor([3, 20, -1, 7, 50, 33][:m], dtype=torch.int64)
    args = [t.to(device) for t in (x, q8, s8, bias, pos, cos_sin)]

    def layer_and_cache():
        impl = SM121AttentionImpl(hq, head, 0.125, hkv, kv_cache_dtype="nvfp4")
        cache = torch.zeros(4, 2, hkv * 16 * (head // 2 + head // 16), dtype=torch.uint8, device=device)
        impl._kv(cache)  # the layer's pages and global scales
        if calibrated:
            impl._g.copy_(torch.tensor([2.0 ** -8, 2.0 ** -6], device=device))
            impl._calibrating = False
        return types.SimpleNamespace(impl=impl), cache

    ref_layer, ref_cache = layer_and_cache()
    ref = D.dense_fp8_linear_rope(*args, rope_rows, head)
    q0 = hq * head
    ref_layer.impl.do_kv_cache_update(ref_layer, ref[:, q0:rope_rows].reshape(m, hkv, head),
                                      ref[:, rope_rows:].reshape(m, hkv, head), ref_cache, slots.to(device))
    layer, cache = layer_and_cache()
    monkeypatch.setattr(A, "get_attention_context", lambda name: (None, layer, cache, slots.to(device)))
    out, dep = M.dense_fp8_linear_rope_kv(*args, rope_rows, head, "model.layers.0.attn")
    assert torch.equal(out, ref) and dep.numel() == 0
    assert ref_cache.count_nonzero() > 0 and torch.equal(cache, ref_cache)
    assert torch.equal(layer.impl._g, ref_layer.impl._g)  # calibrated alike where it was not yet
    layer, cache = layer_and_cache()
    monkeypatch.setattr(A, "get_attention_context", lambda name: (None, layer, cache, None))
    out, _ = M.dense_fp8_linear_rope_kv(*args, rope_rows, head, "model.layers.0.attn")
    assert torch.equal(out, ref) and cache.count_nonzero() == 0
