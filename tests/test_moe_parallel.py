"""The MoE block sharded as vLLM shards it: tensor parallel (intermediate) and expert parallel (experts).

CPU (Triton interpreter), small shapes. Each rank's ``moe_block`` output is its share of the
unsharded block's; the sum over ranks (what vLLM's all-reduce computes) must equal the unsharded
block's output up to the bf16 rounding of each share, on every path (fma, decode, grouped):

* TP: w13 rows / w2 columns cut at whole MXFP4 blocks as ``GptOssModel._load_weights_mxfp4``
  cuts them, ``w2_bias`` on rank 0 only, each shard zero-padded to a multiple of 64 as
  ``Sm121Mxfp4MoEMethod.maybe_roundup_sizes`` pads it (the padding must add nothing);
* EP: contiguous expert ranges with vLLM's ``expert_map`` (global -> local id, -1 elsewhere).
"""

import pytest
import torch
from test_moe_block import random_moe_weights, rel_l2

from vllm_sm121.kernels import moe as K

H, I, E, TOPK = 64, 192, 8, 4  # I = 192: a TP=2 shard of 96 pads to 128 (as 1440 -> 1472 for gpt-oss-120b); TP=4 cuts 64/64/64/0


def _full(seed: int):
    return random_moe_weights(E, H, I, torch.Generator().manual_seed(seed))


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = size - shape[dim]
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype)], dim=dim)


def tp_shards(weights, tp: int, align: int = 64):
    """Rank r's (w13, s13, b13, w2, s2, b2) as vLLM's gpt-oss loader cuts them: whole MXFP4 blocks,
    cdiv(I / 32, tp) of them per rank (the last rank gets what is left, maybe nothing), gate/up
    pairs and the matching w2 columns, zero-padded to ``Sm121Mxfp4MoEMethod.maybe_roundup_sizes``'s
    size (I / tp rounded up to ``align``)."""
    w13, s13, b13, w2, s2, b2 = weights
    per = -(-(I // 32) // tp) * 32
    pad = -(-(I // tp) // align) * align
    assert per <= pad
    for r in range(tp):
        a, b = min(r * per, I), min((r + 1) * per, I)
        yield (_pad(w13[:, 2 * a:2 * b], 1, 2 * pad), _pad(s13[:, 2 * a:2 * b], 1, 2 * pad),
               _pad(b13[:, 2 * a:2 * b], 1, 2 * pad), _pad(w2[:, :, a // 2:b // 2], 2, pad // 2),
               _pad(s2[:, :, a // 32:b // 32], 2, pad // 32),
               b2 if r == 0 else torch.zeros_like(b2))


def ep_shards(weights, ep: int):
    """Rank r's experts [r*E/ep, (r+1)*E/ep) and vLLM's linear expert_map for it."""
    per = E // ep
    for r in range(ep):
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[r * per:(r + 1) * per] = torch.arange(per, dtype=torch.int32)
        yield tuple(w[r * per:(r + 1) * per] for w in weights), emap


def _inputs(m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, H, generator=g).bfloat16(), torch.randn(m, E, generator=g).bfloat16()


@pytest.mark.interpreter
def test_expert_map_routing_matches_reference(device):
    _, logits = _inputs(9, seed=1)
    logits[3] = torch.arange(E).flip(0).bfloat16()  # token 3: its top-4 are experts 0..3, all on rank 0
    for _, emap in ep_shards(_full(0), 2):
        w, ids = K.moe_route(logits.to(device), TOPK, expert_map=emap.to(device))
        rw, rids = K.moe_route_torch(logits, TOPK, emap)
        assert torch.equal(ids.cpu(), rids) and torch.allclose(w.cpu(), rw, atol=1e-6)
        assert ids.min() >= 0 and ids.max() < E // 2
    full_w, _ = K.moe_route_torch(logits, TOPK)
    shares = [K.moe_route_torch(logits, TOPK, emap)[0] for _, emap in ep_shards(_full(0), 2)]
    assert torch.allclose(shares[0] + shares[1], full_w)  # every slot's weight on exactly one rank


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["fma", "decode", "grouped"])
@pytest.mark.parametrize("kind", ["tp", "ep", "tp4"])
def test_rank_shares_sum_to_the_unsharded_block(device, path, kind):
    m = 3
    weights = _full(seed=2)
    x, logits = _inputs(m, seed=3)
    full = K.moe_block(x.to(device), logits.to(device), *[w.to(device) for w in weights], TOPK, path=path)
    shares = []
    if kind.startswith("tp"):
        tp = 4 if kind == "tp4" else 2
        for shard in tp_shards(weights, tp):  # TP=2: 96 -> 128 columns; TP=4: 64, 64, 64, 0 -> 64
            assert shard[3].shape[2] * 2 == (128 if tp == 2 else 64)
            shares.append(K.moe_block(x.to(device), logits.to(device), *[w.to(device) for w in shard], TOPK,
                                      path=path))
    else:
        for shard, emap in ep_shards(weights, 2):
            shares.append(K.moe_block(x.to(device), logits.to(device), *[w.to(device) for w in shard], TOPK,
                                      path=path, expert_map=emap.to(device)))
    total = torch.stack([t.float() for t in shares]).sum(0)
    ref = K.moe_block_torch(x, logits, *weights, TOPK)
    err, ref_err = rel_l2(total.cpu(), full.float().cpu()), rel_l2(full.float().cpu(), ref)
    print(f"\n{kind} {path}: sum of shares vs unsharded {err:.2e} (unsharded vs reference {ref_err:.2e})")
    assert torch.isfinite(total).all() and total.abs().max() > 0.3
    assert err < 1e-2, err


def test_roundup_pads_the_shard_to_64():
    from test_moe_block import Case, make_moe_config

    from vllm_sm121.moe.method import Sm121Mxfp4MoEMethod

    method = Sm121Mxfp4MoEMethod(make_moe_config(Case(1, 64, 64, 4, 2)))
    par = method.moe.moe_parallel_config
    assert method.maybe_roundup_sizes(2880, 1440, torch.bfloat16, par) == (2880, 1472)
    assert method.maybe_roundup_sizes(2880, 720, torch.bfloat16, par) == (2880, 768)  # TP=4: loader gives <= 736
    assert method.maybe_roundup_sizes(2880, 2880, torch.bfloat16, par) == (2880, 2880)


@pytest.mark.interpreter
def test_method_routes_through_vllms_expert_map_under_ep(device):
    """``Sm121Mxfp4MoEMethod`` on an EP rank: it passes the layer's ``expert_map`` to the kernels
    (its output is that rank's share), validates the map once after loading, and refuses EPLB."""
    import dataclasses
    import types

    from test_moe_block import Case, build_layer, make_moe_config

    from vllm_sm121.moe.method import local_expert_map, unsupported_reason

    c = Case(3, 64, 64, 4, 2)
    method, layer = build_layer(c, device, seed=4)
    assert local_expert_map(layer) is None  # no EP: global ids
    x, logits = (torch.randn(c.m, c.hidden).bfloat16().to(device), torch.randn(c.m, 8).bfloat16().to(device))
    emap = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32, device=device)  # rank 1 of 2, 8 experts
    par = layer.moe_config.moe_parallel_config
    layer.moe_config.moe_parallel_config = dataclasses.replace(par, use_ep=True, ep_size=2, ep_rank=1)
    method.moe.num_experts = 8
    layer.expert_map = emap
    method.process_weights_after_loading(layer)
    out = method.apply_monolithic(layer, x, logits)
    ref = K.moe_block(x, logits, layer.w13_weight, layer.w13_weight_scale, layer.w13_bias, layer.w2_weight,
                      layer.w2_weight_scale, layer.w2_bias, c.topk, expert_map=emap)
    assert torch.equal(out, ref)
    layer.expert_map = emap.long()
    with pytest.raises(ValueError, match="expert_map: expected int32"):
        method.process_weights_after_loading(layer)
    eplb = make_moe_config(c)
    eplb.moe_parallel_config = dataclasses.replace(eplb.moe_parallel_config, enable_eplb=True)
    assert unsupported_reason(types.SimpleNamespace(moe_config=eplb)) == "EPLB (expert load balancing)"


class _launched:
    """Stands in for a launcher (or a kernel's [grid]) that must not run."""

    def __init__(self, what):
        self.what = what

    def __call__(self, *a, **k):
        raise AssertionError(f"{self.what} was launched")

    def __getitem__(self, grid):
        return self


@pytest.mark.interpreter
@pytest.mark.parametrize("m,fused,ep,tiles", [
    (1, "route", True, (None,)), (3, "route", True, (None,)),
    (1, "combine", False, (None, "64,16,32,16,2,1,0,0,2")),  # + FC2 split-K
    (3, "combine", False, (None, "64,16,32,16,2,1,0,0,2")),  # 12 slots on 8 experts: duplicate programs
    (4, "route+combine", True, ("64,16,32,16,2,1,0,0,2",)),
])
def test_fused_routing_and_combine_equal_their_launches(device, m, fused, ep, tiles, monkeypatch):
    """$VLLM_SM121_MOE_FUSED_ROUTE=1: FC1 routes the tokens itself (the routing kernel's code) and
    writes ids and weights for FC2; $VLLM_SM121_MOE_FUSED_COMBINE=1: the last FC2 program of each
    row tile sums the partials (the combine kernel's order). Either way, and both, moe_block gives
    bit-identical outputs with fewer launches, also on an EP rank (expert_map: slots routed off the
    rank repeat a local expert, so FC2 has duplicate programs), with a NaN logit row, and with FC2
    split-K; the combine's counters are back at 0 after each launch."""
    weights = _full(seed=5)
    x, logits = _inputs(m, seed=6)
    logits[-1, 7] = float("nan")
    xq, xs = K.mxfp8_quantize(x.to(device))
    dev = [w.to(device) for w in weights]
    cases = [(dev, None)]
    if ep:
        cases += [([w.to(device) for w in shard], emap.to(device)) for shard, emap in ep_shards(weights, 2)][:1]
    for (ws, emap), tile in [(c, t) for c in cases for t in tiles]:
        monkeypatch.delenv(K.FMA_TILES_ENV, raising=False)
        for env in (K.FUSED_ROUTE_ENV, K.FUSED_COMBINE_ENV):  # the separate launches (unset fuses at M = 1)
            monkeypatch.setenv(env, "0")
        if tile:
            monkeypatch.setenv(K.FMA_TILES_ENV, tile)
        plain = K.moe_block(xq, logits.to(device), *ws, TOPK, x_scale=xs, path="fma", expert_map=emap)
        if "route" in fused:
            monkeypatch.setenv(K.FUSED_ROUTE_ENV, "1")
        if "combine" in fused:
            monkeypatch.setenv(K.FUSED_COMBINE_ENV, "1")
        with monkeypatch.context() as mp:  # the fused run must not launch what it fuses
            if "route" in fused:
                mp.setattr(K, "moe_route", _launched("the routing kernel"))
            if "combine" in fused:
                mp.setattr(K, "_moe_combine_kernel", _launched("the combine kernel"))
            out = K.moe_block(xq, logits.to(device), *ws, TOPK, x_scale=xs, path="fma", expert_map=emap)
        assert torch.isfinite(out.float()).all() and out.float().abs().max() > 0.1
        assert torch.equal(out.cpu(), plain.cpu()), (m, emap is not None, tile)
        if "combine" in fused:
            assert int(K.split_counters(xq.device, purpose="fc2").abs().sum()) == 0
    if "route" in fused:
        monkeypatch.setattr(K, "moe_pdl", lambda t: {"PDL": True})
        with pytest.raises(ValueError, match="VLLM_SM121_MOE_PDL"):
            K.moe_block(xq, logits.to(device), *dev, TOPK, x_scale=xs, path="fma")


def test_fused_routing_and_combine_defaults(monkeypatch):
    """Unset, both fusions apply to one token only (measured faster there, slower with more), and
    the fused routing stays off under PDL (it would conflict); "1" / "0" force them for M <= 4."""
    t = torch.zeros(1)
    for env in (K.FUSED_ROUTE_ENV, K.FUSED_COMBINE_ENV, K.PDL_ENV):
        monkeypatch.delenv(env, raising=False)
    assert [K.fused_route(m, t) for m in (1, 2, 4)] == [True, False, False]
    assert [K.fused_combine(m) for m in (1, 2, 4)] == [True, False, False]
    monkeypatch.setattr(K, "moe_pdl", lambda t: {"PDL": True})
    assert not K.fused_route(1, t)
    monkeypatch.undo()
    for value, want in (("1", True), ("0", False)):
        monkeypatch.setenv(K.FUSED_ROUTE_ENV, value)
        monkeypatch.setenv(K.FUSED_COMBINE_ENV, value)
        assert [K.fused_route(m, t) for m in (1, 4)] == [want, want]
        assert [K.fused_combine(m) for m in (1, 4)] == [want, want]


def _shares(weights, x, logits, kind, path, device, out_dtype):
    if kind == "tp":
        return [K.moe_block(x.to(device), logits.to(device), *[w.to(device) for w in shard], TOPK, path=path,
                            out_dtype=out_dtype) for shard in tp_shards(weights, 2)]
    return [K.moe_block(x.to(device), logits.to(device), *[w.to(device) for w in shard], TOPK, path=path,
                        expert_map=emap.to(device), out_dtype=out_dtype) for shard, emap in ep_shards(weights, 2)]


@pytest.mark.interpreter
@pytest.mark.parametrize("path,m", [("fma", 1), ("fma", 2), ("decode", 7), ("grouped", 7)])
@pytest.mark.parametrize("kind", ["tp", "ep"])
def test_fp32_shares_reproduce_the_unsharded_bf16_output(device, path, m, kind):
    """out_dtype=torch.float32 (the hook's fp32 all-reduce under TP / EP): the ranks' unrounded
    shares, summed and rounded to bf16 once, give the unsharded block's bf16 values except where fp32
    summation order crosses a rounding boundary; summing bf16-rounded shares (upstream's bf16
    all-reduce) moves many more elements. Exactly the bf16 output where one rank holds everything.
    At one token both come from the combine fused into FC2 (the default there)."""
    weights = _full(seed=4)
    x, logits = _inputs(m, seed=5)
    full = K.moe_block(x.to(device), logits.to(device), *[w.to(device) for w in weights], TOPK, path=path).cpu()
    one32 = K.moe_block(x.to(device), logits.to(device), *[w.to(device) for w in weights], TOPK, path=path,
                        out_dtype=torch.float32).cpu()
    assert one32.dtype == torch.float32 and torch.equal(one32.bfloat16(), full)
    f32 = _shares(weights, x, logits, kind, path, device, torch.float32)
    bf = _shares(weights, x, logits, kind, path, device, torch.bfloat16)
    assert all(t.dtype == torch.float32 for t in f32) and all(t.dtype == torch.bfloat16 for t in bf)
    same32 = ((f32[0].cpu() + f32[1].cpu()).bfloat16() == full).float().mean().item()
    same16 = ((bf[0].cpu() + bf[1].cpu()) == full).float().mean().item()  # (the bf16 add rounds once more)
    print(f"\n{kind} {path}: elements equal to the unsharded output: fp32 shares {same32:.3f}, bf16 shares {same16:.3f}")
    assert same32 >= 0.97 and same32 > same16, (same32, same16)
    with pytest.raises(ValueError, match="out_dtype"):
        K.moe_block(x.to(device), logits.to(device), *[w.to(device) for w in weights], TOPK, out_dtype=torch.float16)
