"""The next layer's input add + RMSNorm carried through FC2's combine into the qkv GEMV
(``kernels/next_norm.py``): each side against torch, and the pair against upstream's norm -> linear."""

from __future__ import annotations

import pytest
import torch
from test_moe import fc2_case

from vllm_sm121.kernels import dense as D
from vllm_sm121.kernels import moe as K
from vllm_sm121.kernels.next_norm import (NEXT_NORM_CHUNK, NextNorm, NextNormBuffers, inv_rms_torch, next_norm_torch,
                                          normed_torch)


def _fc2_case(m, hidden, i, e, topk, seed):
    """FC2's inputs (``test_moe.fc2_case``), the block's residual and the next layer's norm weight."""
    g = torch.Generator().manual_seed(seed)
    args = fc2_case(m, hidden, i, e, topk, g)
    residual = (torch.randn(m, hidden, generator=g) * 4).bfloat16()
    norm_w = (1 + 0.3 * torch.randn(hidden, generator=g)).bfloat16()
    return args, residual, norm_w


def _assert_carried(bufs: NextNormBuffers, ref: NextNormBuffers, m: int):
    """s and u bit for bit (the same bf16 output, the same arithmetic); the sums of squares within fp32
    summation order."""
    assert torch.equal(bufs.s[:m].cpu(), ref.s[:m].cpu())
    assert torch.equal(bufs.u[:m].cpu(), ref.u[:m].cpu())
    torch.testing.assert_close(bufs.psum[:m].cpu(), ref.psum[:m].cpu(), rtol=1e-6, atol=0)


@pytest.mark.interpreter
@pytest.mark.usefixtures("exact_moe_products")
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused_combine", "combine_kernel"])
def test_fc2_combine_carries_the_next_norm(m, fused, device, monkeypatch):
    """FC2 + combine with ``next_norm``: the block output is the one without it (bit for bit), and the
    carried buffers are ``next_norm_torch`` of that output, whether the last program of each row tile
    combines (``fused``) or the combine kernel does. Rows past M stay untouched."""
    monkeypatch.setenv(K.FUSED_COMBINE_ENV, fused)
    hidden = 96
    args, residual, norm_w = _fc2_case(m, hidden, 128, 4, 2, 50 + m)
    dev = [a.to(device) for a in args]
    plain = K.moe_fc2_combine_fma(*dev)
    bufs = NextNormBuffers.alloc(hidden, device)
    bufs.s.fill_(7.0)  # sentinel rows past M
    nn = NextNorm(residual.to(device), norm_w.to(device), bufs)
    out = K.moe_fc2_combine_fma(*dev, next_norm=nn)
    assert torch.equal(out.cpu(), plain.cpu())
    ref = NextNormBuffers.alloc(hidden, "cpu")
    next_norm_torch(plain.cpu(), NextNorm(residual, norm_w, ref))
    _assert_carried(bufs, ref, m)
    assert bool((bufs.s[m:].float() == 7.0).all())
    assert int(K.split_counters(out.device, purpose="fc2").abs().sum()) == 0


@pytest.mark.interpreter
@pytest.mark.usefixtures("exact_moe_products")
def test_fc2_tiles_below_a_chunk_carry_the_norm_in_torch(device, monkeypatch):
    """FC2 row tiles of 8 (a $VLLM_SM121_MOE_FMA_TILES override) with the fused combine: the carried
    norm falls back to ``next_norm_torch`` after the block (the kernel's sums need 16-row tiles)."""
    monkeypatch.setenv(K.FUSED_COMBINE_ENV, "1")
    hidden = 64
    args, residual, norm_w = _fc2_case(1, hidden, 64, 4, 2, 58)
    dev = [a.to(device) for a in args]
    tiles = K.FmaTiles.parse("64,16,8,32,2,1")
    bufs = NextNormBuffers.alloc(hidden, device)
    out = K.moe_fc2_combine_fma(*dev, tiles, next_norm=NextNorm(residual.to(device), norm_w.to(device), bufs))
    assert torch.equal(out.cpu(), K.moe_fc2_combine_fma(*dev, tiles).cpu())
    ref = NextNormBuffers.alloc(hidden, "cpu")
    next_norm_torch(out.cpu(), NextNorm(residual, norm_w, ref))
    _assert_carried(bufs, ref, 1)


@pytest.mark.interpreter
@pytest.mark.usefixtures("exact_moe_products")
@pytest.mark.parametrize("path", ["fma", "decode"])
def test_moe_block_carries_the_next_norm_on_every_path(path, device):
    """``moe_block(next_norm=...)``: on the FMA path FC2's combine writes the buffers, on another path
    ``next_norm_torch`` does after the block; either way they match the block output's reference.
    More tokens than the carried norm takes are refused by name."""
    from test_moe_block import random_moe_weights

    m, hidden, inter, e, topk = 2, 64, 64, 4, 2
    w = random_moe_weights(e, hidden, inter, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(m, hidden, generator=g).bfloat16()
    logits = torch.randn(m, e, generator=g)
    residual = torch.randn(m, hidden, generator=g).bfloat16()
    norm_w = (1 + 0.2 * torch.randn(hidden, generator=g)).bfloat16()
    dev = lambda t: t.to(device)  # noqa: E731
    wd = [dev(t) for t in w]
    out0 = K.moe_block(dev(x), dev(logits), *wd, topk, path=path)
    bufs = NextNormBuffers.alloc(hidden, device)
    out = K.moe_block(dev(x), dev(logits), *wd, topk, path=path, next_norm=NextNorm(dev(residual), dev(norm_w), bufs))
    assert torch.equal(out.cpu(), out0.cpu())
    ref = NextNormBuffers.alloc(hidden, "cpu")
    next_norm_torch(out0.cpu(), NextNorm(residual, norm_w, ref))
    _assert_carried(bufs, ref, m)
    five = torch.zeros(5, hidden, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="up to 4 tokens"):
        K.moe_block(dev(torch.randn(5, hidden).bfloat16()), dev(torch.randn(5, e)), *wd, topk, path=path,
                    next_norm=NextNorm(five, dev(norm_w), bufs))


def _qkv_case(m, hidden, heads_q, heads_kv, head, seed):
    g = torch.Generator().manual_seed(seed)
    n = (heads_q + 2 * heads_kv) * head
    w = (torch.randn(n, hidden, generator=g) * 0.5).bfloat16()
    q, s = D.fp8_per_channel_quantize(w)
    b = torch.randn(n, generator=g).bfloat16()
    ang = torch.rand(512, head // 2, generator=g) * 6.3
    cache = torch.cat((ang.cos(), ang.sin()), dim=-1)
    pos = torch.randint(0, 512, (m,), generator=g)
    moe_out = torch.randn(m, hidden, generator=g).bfloat16()
    residual = (torch.randn(m, hidden, generator=g) * 8).bfloat16()
    norm_w = (1 + 0.3 * torch.randn(hidden, generator=g)).bfloat16()
    return q, s, b, cache, pos, moe_out, residual, norm_w, (heads_q + heads_kv) * head


def _upstream_input_norm(x, residual, weight, eps):
    """vLLM 0.26's ``fused_add_rms_norm`` (vllm/ir/ops/layernorm.py) in fp32: (y, new residual)."""
    s = x.float() + residual.float()
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return (y.to(weight.dtype) * weight).bfloat16(), s.bfloat16()


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [1, 2, 4])
def test_qkv_gemv_takes_the_carried_norm(m, device):
    """``dense_fp8_linear_rope_norm`` on the FMA path (u in, 1 / rms in the epilogue, s copied out)
    against upstream's order (norm -> bf16 y -> the same GEMV): the residual bit for bit, the
    projection within two bf16 steps of its scale (only the bf16 roundings of the norm output move);
    off the FMA path it is the GEMV of upstream's norm output (``normed_torch``) exactly."""
    hidden, head, eps = 128, 32, 1e-5
    q, s, b, cache, pos, moe_out, residual, norm_w, rope_rows = _qkv_case(m, hidden, 4, 2, head, 60 + m)
    dev = lambda t: t.to(device)  # noqa: E731
    bufs = NextNormBuffers.alloc(hidden, device)
    next_norm_torch(dev(moe_out), NextNorm(dev(residual), dev(norm_w), bufs))
    args = (dev(q), dev(s), dev(b), dev(pos), dev(cache), rope_rows, head)
    out, res = D.dense_fp8_linear_rope_norm(bufs, m, dev(norm_w), eps, *args, path="fma")
    y_up, res_up = _upstream_input_norm(moe_out, residual, norm_w, eps)
    assert torch.equal(res.cpu(), res_up)
    ref = D.dense_fp8_linear_rope(dev(y_up), *args, path="fma").cpu().float()
    err = (out.cpu().float() - ref).abs().max() / ref.abs().max()
    assert err < 2 * 2.0 ** -8, float(err)
    assert not torch.equal(out.cpu(), torch.zeros_like(out.cpu()))
    # another path: upstream's norm output rebuilt from the buffers, then that path's GEMV
    out2, res2 = D.dense_fp8_linear_rope_norm(bufs, m, dev(norm_w), eps, *args, path="mma")
    y = normed_torch(bufs, m, dev(norm_w), eps)
    assert torch.equal(out2.cpu(), D.dense_fp8_linear_rope(y, *args, path="mma").cpu())
    assert torch.equal(res2.cpu(), res_up)
    torch.testing.assert_close(y.cpu().float(), y_up.float(), rtol=2.0 ** -6, atol=0)  # two bf16 roundings


def test_carried_norm_reference_and_guards():
    """The sums of squares give upstream's 1 / rms; bad sizes are refused by name."""
    g = torch.Generator().manual_seed(9)
    s = (torch.randn(3, 64, generator=g) * 5).bfloat16()
    psum = s.float().square().view(3, 64 // NEXT_NORM_CHUNK, NEXT_NORM_CHUNK).sum(-1)
    torch.testing.assert_close(inv_rms_torch(psum, 64, 1e-5), torch.rsqrt(s.float().square().mean(-1) + 1e-5))
    with pytest.raises(ValueError, match="multiples of 16"):
        NextNormBuffers.alloc(72, "cpu")
    bufs = NextNormBuffers.alloc(64, "cpu")
    with pytest.raises(ValueError, match="up to 4 tokens"):
        D.dense_fp8_linear_rope_norm(bufs, 5, torch.ones(64), 1e-5, torch.zeros(64, 64), torch.ones(64), None,
                                     torch.zeros(5, dtype=torch.int64), torch.zeros(8, 32), 32, 32)
    with pytest.raises(ValueError, match="residual"):
        NextNorm(torch.zeros(2, 32, dtype=torch.bfloat16), torch.ones(64), bufs).check(
            torch.zeros(2, 64, dtype=torch.bfloat16))


# ---- GPU: gpt-oss-120b shapes --------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
def test_carried_norm_gpt_oss_120b_chain_on_gpu(m, monkeypatch):
    """gpt-oss-120b's layer boundary at decode: FC2 + combine (H 2880, I 2880, 4 of 128 experts;
    the fused combine at M = 1, the combine kernel above) writing the carried norm, then the qkv
    GEMV (64 q + 8 kv heads of 64) taking it, replayed in a CUDA graph: the residual is upstream's
    bit for bit and the projection within two bf16 steps of upstream's norm -> GEMV order."""
    hidden, inter, e, topk, head, eps = 2880, 2880, 128, 4, 64, 1e-5
    args, residual, norm_w = _fc2_case(m, hidden, inter, e, topk, 70 + m)
    dev = [a.cuda() for a in args]
    q, s, b, cache, pos, _x, _r, _w, rope_rows = _qkv_case(m, hidden, 64, 8, head, 80 + m)
    qkv_args = (q.cuda(), s.cuda(), b.cuda(), pos.cuda(), cache.cuda(), rope_rows, head)
    bufs = NextNormBuffers.alloc(hidden, "cuda")
    nn = NextNorm(residual.cuda(), norm_w.cuda(), bufs)

    def step():
        out = K.moe_fc2_combine_fma(*dev, next_norm=nn)
        return out, *D.dense_fp8_linear_rope_norm(bufs, m, nn.weight, eps, *qkv_args, path="fma")

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_out, qkv, res = step()
    bufs.u.zero_()
    bufs.psum.zero_()
    graph.replay()
    torch.cuda.synchronize()
    y_up, res_up = _upstream_input_norm(moe_out, nn.residual, nn.weight, eps)
    assert torch.equal(res, res_up)
    ref = D.dense_fp8_linear_rope(y_up, *qkv_args, path="fma").float()
    err = float((qkv.float() - ref).abs().max() / ref.abs().max())
    print(f"\nM={m}: carried-norm qkv vs upstream order, max error / max |ref| = {err:.2e}")
    assert err < 2 * 2.0 ** -8, err
