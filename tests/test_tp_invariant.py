"""The TP-invariant mode ($VLLM_SM121_TP_INVARIANT=tp2 / ep2) on CPU: a one-rank engine computes
o_proj and the MoE as the two ranks of TP=2 (EP=2) do, so that TP=1 and TP=2 give the same bits.

* ``rank_shards`` cuts the expert weights as vLLM 0.26's gpt-oss loader gives them to each rank
  (the loader's index arithmetic is restated here, independently of the implementation) and pads
  them as the plugin's method does; the shards' fp32 outputs sum to the unsharded block's;
* o_proj's simulated ranks are bit-equal to two real ranks' fp32 shares summed by the all-reduce
  (the stand-in used by ``test_moe_hook``), for bf16 and FP8 weights;
* the MoE method builds the shards and releases the unsharded weights; the hook's simulated path
  equals the two shares summed in fp32 and stays within the kernels' tolerance of the reference;
* the attention builder chooses decode splits from a TP=2 rank's KV heads in the mode;
* a bad mode value is an error naming the variable (``test_config``); the mode refuses an engine
  that already has two ranks, a weight reload and the non-hooked MoE call.
GPU (two GPUs): ``tests/test_tp_gpu.py::test_tp_invariant_tp1_matches_tp2_and_ep2`` and
``test_tp2_divergence_per_layer_reported``.
"""

from __future__ import annotations

import types

import pytest
import torch
from test_moe_block import Case, build_layer

from vllm_sm121.kernels.moe import moe_block_torch
from vllm_sm121.kernels.norm_mxfp8 import mxfp8_quantize_torch
from vllm_sm121.moe import hook  # registers the sm121:: ops
from vllm_sm121.moe.method import SHARDED_WEIGHTS, rank_shards


def _loader_cut(w: dict, rank: int, tp: int, padded: int) -> dict:
    """vLLM 0.26 gpt_oss.py ``_load_weights_mxfp4`` (non-EP): rank r gets intermediate units
    [r * per, min((r + 1) * per, I)) with per = cdiv(I / 32, tp) * 32 -- w13 rows 2 * start .. 2 * end,
    w2 bytes start / 2 .., w2 scales start / 32 .. -- copied into the leading part of zero parameters
    of ``padded`` units; w2_bias zeroed on ranks other than 0."""
    e, two_i, _ = w["w13_weight"].shape
    inter = two_i // 2
    per = -(-(inter // 32) // tp) * 32
    start, end = rank * per, min((rank + 1) * per, inter)
    out = {}
    for name, t in w.items():
        if name.startswith("w13"):
            z = t.new_zeros((e, 2 * padded) + tuple(t.shape[2:]))
            z[:, :2 * (end - start)] = t[:, 2 * start:2 * end]
        elif name == "w2_weight":
            z = t.new_zeros(e, t.shape[1], padded // 2)
            z[..., :(end - start) // 2] = t[..., start // 2:end // 2]
        elif name == "w2_weight_scale":
            z = t.new_zeros(e, t.shape[1], padded // 32)
            z[..., :(end - start) // 32] = t[..., start // 32:end // 32]
        else:  # w2_bias
            z = t.clone() if rank == 0 else torch.zeros_like(t)
        out[name] = z
    return out


@pytest.mark.parametrize("inter", [128, 96], ids=["even", "padded"])
def test_tp2_shards_are_the_loaders_and_sum_to_the_block(inter):
    c = Case(6, 64, inter, 4, 2)
    _, layer = build_layer(c, "cpu", seed=1)
    w = {name: getattr(layer, name).data for name in SHARDED_WEIGHTS}
    padded = -(-(inter // 2) // 64) * 64  # maybe_roundup_sizes of the rank's intermediate_size_per_partition
    shards = rank_shards(w, "tp2", parts=2, align=64)
    for r, shard in enumerate(shards):
        want = _loader_cut(w, r, 2, padded)
        assert shard.keys() == want.keys() and all(torch.equal(shard[k], want[k]) for k in want), r
    g = torch.Generator().manual_seed(2)
    xq, xs = mxfp8_quantize_torch(torch.randn(c.m, c.hidden, generator=g))
    logits = torch.randn(c.m, c.experts, generator=g)
    full = moe_block_torch(xq, logits, *w.values(), c.topk, x_scale=xs)
    parts = [moe_block_torch(xq, logits, *(s[k] for k in SHARDED_WEIGHTS), c.topk, x_scale=xs) for s in shards]
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(parts[0], full, rtol=1e-2, atol=1e-2)  # each shard is a real share


def test_ep2_shards_hold_half_the_experts_and_sum_to_the_block():
    c = Case(6, 64, 64, 4, 2)
    _, layer = build_layer(c, "cpu", seed=3)
    w = {name: getattr(layer, name).data for name in SHARDED_WEIGHTS}
    shards = rank_shards(w, "ep2", parts=2)
    assert [s["expert_map"].tolist() for s in shards] == [[0, 1, -1, -1], [-1, -1, 0, 1]]
    assert torch.equal(shards[1]["w2_bias"], w["w2_bias"][2:]) and shards[0]["w13_weight"].shape[0] == 2
    g = torch.Generator().manual_seed(4)
    xq, xs = mxfp8_quantize_torch(torch.randn(c.m, c.hidden, generator=g))
    logits = torch.randn(c.m, c.experts, generator=g)
    full = moe_block_torch(xq, logits, *w.values(), c.topk, x_scale=xs)
    parts = [moe_block_torch(xq, logits, *(s[k] for k in SHARDED_WEIGHTS), c.topk, x_scale=xs,
                             expert_map=s["expert_map"]) for s in shards]
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mode='tp4' is not supported; supported: tp2, ep2"):
        rank_shards(w, "tp4")


@pytest.mark.parametrize("dense", ["bf16", "fp8"])
def test_o_proj_simulated_ranks_equal_two_real_ranks(monkeypatch, dense):
    import vllm.distributed
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from vllm_sm121.dense.method import Sm121DenseFp8LinearMethod
    from vllm_sm121.kernels import dense as D

    g = torch.Generator().manual_seed(5)
    n, k = 48, 128
    x = torch.randn(2, 5, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.2).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    q, scale = D.fp8_per_channel_quantize(w)
    method = Sm121DenseFp8LinearMethod() if dense == "fp8" else UnquantizedLinearMethod()

    def o_proj(r, weight, **kw):
        o = types.SimpleNamespace(tp_rank=r, bias=b, quant_method=method, weight=weight, weight_scale=scale, **kw)
        return o

    full_w = q if dense == "fp8" else w
    shares = []
    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_reduce", lambda t: shares.append(t) or t)
    for r in (0, 1):
        sl = slice(r * k // 2, (r + 1) * k // 2)
        hook.o_proj_fp32_reduce(o_proj(r, full_w[:, sl].contiguous()), x[..., sl].contiguous())
    two_ranks = (shares[0] + shares[1]).bfloat16()
    extra = {"sm121_sim_parts": 2}
    if dense == "fp8":
        from vllm_sm121.dense import method as M

        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(q.clone(), requires_grad=False)
        layer.tp_size = 1
        M._simulated_rank_parts(layer)
        assert not hasattr(layer, "sm121_w_parts")  # mode off (the block did not flag this layer)
        layer.sm121_sim_parts = 2  # what the gpt-oss block sets on o_proj in the mode
        M._simulated_rank_parts(layer)
        assert layer.sm121_w_parts.shape == (2, n, k // 2) and torch.equal(layer.sm121_w_parts[1].view(torch.uint8),
                                                                            q[:, k // 2:].contiguous().view(torch.uint8))
        extra["sm121_w_parts"] = layer.sm121_w_parts
    sim = hook.o_proj_fp32_reduce(o_proj(0, full_w, **extra), x)
    assert len(shares) == 2  # the simulated ranks never all-reduce
    assert sim.dtype == torch.bfloat16 and sim.shape == (2, 5, n) and torch.equal(sim, two_ranks)


@pytest.mark.parametrize("mode", ["tp2", "ep2"])
def test_moe_method_builds_the_ranks_and_the_hook_sums_them(monkeypatch, mode):
    from test_moe_block import make_moe_config

    from vllm_sm121.moe.method import Sm121Mxfp4MoEMethod

    c = Case(3, 64, 128, 4, 2)
    _, layer = build_layer(c, "cpu", seed=6)
    w = {name: getattr(layer, name).data.clone() for name in SHARDED_WEIGHTS}
    method = Sm121Mxfp4MoEMethod(make_moe_config(c))
    method._build_simulated_ranks(layer)
    assert layer.sm121_sim_parts == 0 and getattr(layer, "w13_weight").numel()  # not flagged: untouched
    layer.sm121_sim_mode = mode  # what the gpt-oss block sets from its recorded choice
    method._build_simulated_ranks(layer)
    assert layer.sm121_sim_parts == 2 and all(getattr(layer, n).numel() == 0 for n in SHARDED_WEIGHTS)
    shards = rank_shards(w, mode)
    for r, shard in enumerate(shards):
        assert all(torch.equal(getattr(layer, f"sm121_sim{r}_{k}"), t) for k, t in shard.items())
    layer.quant_method = method
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(c.m, c.hidden, generator=g).bfloat16()
    residual = torch.randn(c.m, c.hidden, generator=g).bfloat16()
    norm = types.SimpleNamespace(weight=torch.ones(c.hidden, dtype=torch.bfloat16), variance_epsilon=1e-5)
    router = torch.nn.Linear(c.hidden, c.experts, dtype=torch.bfloat16)
    mlp = types.SimpleNamespace(router=router, experts=types.SimpleNamespace(routed_experts=layer))
    out, res = hook.hooked_mlp_forward(hidden, residual.clone(), norm, mlp)
    y, xq, xs = hook.add_rmsnorm_mxfp8(hidden, residual.clone(), norm.weight, norm.variance_epsilon)
    logits = router(y)
    shares = [hook.gpt_oss_moe_mxfp8(xq, xs, logits, *(s[k] for k in SHARDED_WEIGHTS), c.topk,
                                     s.get("expert_map"), f32_out=True) for s in shards]
    assert torch.equal(out, (shares[0] + shares[1]).bfloat16())
    ref = moe_block_torch(xq, logits, *w.values(), c.topk, x_scale=xs)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="VLLM_SM121_TP_INVARIANT: these experts hold simulated ranks' shards"):
        method.apply_monolithic(layer, xq, logits)
    with pytest.raises(ValueError, match="VLLM_SM121_TP_INVARIANT: .* reloading weights is not supported"):
        method.process_weights_after_loading(layer)
    monkeypatch.setattr(method.moe, "moe_parallel_config",
                        types.SimpleNamespace(tp_size=2, ep_size=1, use_ep=False))
    with pytest.raises(ValueError, match="VLLM_SM121_TP_INVARIANT=.* one-rank engine; this one already runs tp=2"):
        method._build_simulated_ranks(layer)


def test_attention_builder_splits_as_a_tp2_rank_in_the_mode(monkeypatch):
    """Decode attention splits its KV by a count chosen from a rank's KV heads: in the mode, from
    TP=2's half, so the split sums (and their order) are TP=2's."""
    import vllm.config

    from vllm_sm121.attention.metadata import SM121AttentionMetadataBuilder
    from vllm_sm121.kernels.paged_attention import choose_num_splits

    monkeypatch.setattr(vllm.config, "get_layers_from_vllm_config", lambda cfg, cls, names: {
        "l": types.SimpleNamespace(num_heads=16, impl=types.SimpleNamespace(sliding_window=None))})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(multi_processor_count=8))
    spec = types.SimpleNamespace(num_kv_heads=4, head_size=64, block_size=16)

    def builder(mode):
        monkeypatch.setenv("VLLM_SM121_TP_INVARIANT", mode)
        cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=8192),
                                    parallel_config=types.SimpleNamespace(tensor_parallel_size=1))
        return SM121AttentionMetadataBuilder(spec, ["l"], cfg, torch.device("cpu"))

    off, on = builder(""), builder("tp2")
    assert (off.split_kv_heads, on.split_kv_heads) == (4, 2)
    want = {h: choose_num_splits(num_seqs=1, num_kv_heads=h, max_query_len=1, max_seq_len=4096, num_q_per_kv=4,
                                 sm_count=8) for h in (4, 2)}
    assert want[2] != want[4]  # the case tells the two apart
    assert on._num_splits(1, 1, 1, 4096)[None] == want[2] and off._num_splits(1, 1, 1, 4096)[None] == want[4]


def test_divergence_probe_token_count(monkeypatch):
    """$SM121_DUMP_TOKENS sets the forward the GPU divergence test records (the last chunk of a
    long prompt with $SM121_DIVERGENCE_PROMPT); a bad value names the variable."""
    from vllm_sm121.testing import probes

    monkeypatch.delenv(probes.DUMP_TOKENS_ENV, raising=False)
    assert probes.dump_tokens() == probes.DUMP_TOKENS == 200
    monkeypatch.setenv(probes.DUMP_TOKENS_ENV, "110")
    assert probes.dump_tokens() == 110
    for bad in ("1", "x", "-5"):
        monkeypatch.setenv(probes.DUMP_TOKENS_ENV, bad)
        with pytest.raises(ValueError, match=probes.DUMP_TOKENS_ENV):
            probes.dump_tokens()
