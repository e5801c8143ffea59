"""$VLLM_SM121_PDL: the decode step's kernels launched as programmatic dependents.

CPU: the switch (off on the CPU, a bad value named). GPU: a chain in the order of one gpt-oss-120b
decode layer (qkv GEMV with the rotation -> nvfp4 KV write -> paged attention -> o GEMV -> norm +
router -> MoE FC1 with routing inside -> FC2 with the combine inside), each kernel's output the
next one's input, gives the same bytes with every launch a programmatic dependent as without,
eagerly and replayed in a CUDA graph.
"""

import pytest
import torch
from helpers import graph_replayed, make_paged_batch
from vllm_sm121.kernels import _validate as V


def test_switch_is_off_on_the_cpu(monkeypatch):
    monkeypatch.setenv(V.PDL_ENV, "1")
    assert V.pdl_launch(torch.zeros(1)) == {}


@pytest.mark.gpu
def test_switch_on_a_gpu_and_checked(monkeypatch):
    monkeypatch.delenv(V.PDL_ENV, raising=False)
    assert V.pdl_launch(torch.zeros(1, device="cuda")) == {}
    monkeypatch.setenv(V.PDL_ENV, "1")
    assert V.pdl_launch(torch.zeros(1, device="cuda")) == dict(PDL=True, launch_pdl=True)
    monkeypatch.setenv(V.PDL_ENV, "yes")
    with pytest.raises(ValueError, match=r"\$VLLM_SM121_PDL='yes': expected an integer"):
        V.pdl_launch(torch.zeros(1, device="cuda"))


def _layer_chain():
    from test_l2_prefetch import _moe_inputs
    from test_moe_block import Case
    from vllm_sm121.kernels import dense as D
    from vllm_sm121.kernels.fp4_kv import Nvfp4Pages, fp4_kv_write, nvfp4_full_dim
    from vllm_sm121.kernels.moe import moe_block
    from vllm_sm121.kernels.norm_mxfp8 import fused_add_rmsnorm_mxfp8_router
    from vllm_sm121.kernels.paged_attention import SplitWorkspace, paged_attention

    g = torch.Generator().manual_seed(0)
    dev = "cuda"
    h, hq, hkv, d = 2880, 64, 8, 64
    x = torch.randn(1, h, generator=g).bfloat16().to(dev)
    resid = torch.randn(1, h, generator=g).bfloat16().to(dev)
    qkv_q, qkv_s = D.fp8_per_channel_quantize((torch.randn((hq + 2 * hkv) * d, h, generator=g) * 0.05).bfloat16().to(dev))
    qkv_b = (torch.randn((hq + 2 * hkv) * d, generator=g) * 0.1).bfloat16().to(dev)
    o_q, o_s = D.fp8_per_channel_quantize((torch.randn(h, hq * d, generator=g) * 0.05).bfloat16().to(dev))
    o_b = (torch.randn(h, generator=g) * 0.1).bfloat16().to(dev)
    ang = torch.rand(4096, d // 2, generator=g) * 6.3
    rope_cache = torch.cat((ang.cos(), ang.sin()), dim=-1).to(dev)
    pos = torch.tensor([700], device=dev)
    b = make_paged_batch([1], [701], num_q_heads=hq, num_kv_heads=hkv, head_size=d, block_size=16, device=dev,
                         seed=5)  # (its page table and lengths; the pages are nvfp4, filled below)
    nb = b.key_cache.shape[0]
    cache = torch.zeros(nb, 2, hkv * 16 * nvfp4_full_dim(d), dtype=torch.uint8, device=dev)
    one = torch.ones(1, device=dev)
    k_pages, v_pages = (Nvfp4Pages.view(cache[:, i], hkv, 16, d, one) for i in (0, 1))
    pos_all = torch.arange(701, device=dev)
    slot_all = (b.block_table[0, pos_all // 16].long() * 16 + pos_all % 16)
    fp4_kv_write(torch.randn(701, hkv, d, generator=g).bfloat16().to(dev),
                 torch.randn(701, hkv, d, generator=g).bfloat16().to(dev), k_pages, v_pages, slot_all)
    slots = slot_all[700:]  # the new token's slot
    sinks = torch.randn(hq, device=dev)
    ws = SplitWorkspace.allocate(1, hq, d, 64, dev)
    norm_w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16().to(dev)
    router_w = (torch.randn(128, h, generator=g) * 0.02).bfloat16().to(dev)
    router_b = (torch.randn(128, generator=g) * 0.1).bfloat16().to(dev)
    args, _s = _moe_inputs(Case(1, h, h, 128, 4), dev, 7)
    _q, _logits, w13, s13, b13, w2, s2, b2, topk = args
    attn_out = torch.empty(1, hq, d, dtype=torch.bfloat16, device=dev)

    def chain():
        qkv = D.dense_fp8_linear_rope(x, qkv_q, qkv_s, qkv_b, pos, rope_cache, (hq + hkv) * d, d)
        q = qkv[:, :hq * d].view(1, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(1, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(1, hkv, d)
        fp4_kv_write(k, v, k_pages, v_pages, slots)
        paged_attention(q, k_pages, v_pages, b.block_table, b.query_start_loc, b.seq_lens, max_query_len=1,
                        max_seq_len=1024, scale=0.125, sinks=sinks, out=attn_out, num_splits=64, workspace=ws)
        o = D.dense_fp8_linear(attn_out.view(1, hq * d), o_q, o_s, o_b)
        res, xq, xs, logits = fused_add_rmsnorm_mxfp8_router(o, resid, norm_w, router_w, router_b)
        return qkv, o, res, moe_block(xq, logits, w13, s13, b13, w2, s2, b2, topk, x_scale=xs)

    return chain


@pytest.mark.gpu
def test_decode_layer_chain_gives_the_same_bytes_with_pdl(monkeypatch):
    monkeypatch.delenv(V.PDL_ENV, raising=False)
    chain = _layer_chain()
    plain = [t.clone() for t in chain()]
    monkeypatch.setenv(V.PDL_ENV, "1")
    assert V.pdl_launch(torch.zeros(1, device="cuda")) == dict(PDL=True, launch_pdl=True)
    for outs in (chain(), graph_replayed(chain)):
        for a, b in zip(outs, plain):
            assert torch.equal(a, b)
