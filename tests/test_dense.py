"""FP8-weight dense linear: conversion guards, MX conversions, kernel vs reference (interpreter on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assert_close, graph_replayed, rotation_in_epilogue_diff

from vllm_sm121.kernels import dense as D


@dataclasses.dataclass(frozen=True)
class Case:
    m: int
    n: int
    k: int
    bias: bool


CASES = [Case(1, 40, 96, True), Case(3, 33, 64, False), Case(16, 48, 80, True), Case(33, 20, 48, True),
         Case(0, 16, 32, True)]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES, ids=str)
def test_dense_fp8_linear_matches_reference(case, device):
    g = torch.Generator().manual_seed(case.m * 1000 + case.n)
    x = torch.randn(case.m, case.k, generator=g).bfloat16().to(device)
    w = (torch.randn(case.n, case.k, generator=g) * torch.rand(case.n, 1, generator=g) * 4).bfloat16().to(device)
    b = torch.randn(case.n, generator=g).bfloat16().to(device) if case.bias else None
    q, s = D.fp8_per_channel_quantize(w)
    out = D.dense_fp8_linear(x, q, s, b)
    ref = D.dense_fp8_linear_torch(x, q, s, b)
    assert out.dtype == torch.bfloat16 and out.shape == (case.m, case.n)
    # Kernel error only: fp32 accumulation order + one bf16 rounding of the output.
    assert_close(out, ref, atol=1e-2, rtol=1e-2, what=str(case))


@pytest.mark.interpreter
def test_dense_fp8_linear_strided_activations(device):
    x = torch.randn(5, 128).bfloat16().to(device)[:, :64]  # row stride 128
    w = torch.randn(24, 64).bfloat16().to(device)
    q, s = D.fp8_per_channel_quantize(w)
    assert_close(D.dense_fp8_linear(x, q, s), D.dense_fp8_linear_torch(x, q, s), atol=1e-2, rtol=1e-2)


def test_dense_fp8_linear_argument_errors():
    x = torch.randn(2, 32).bfloat16()
    q, s = D.fp8_per_channel_quantize(torch.randn(8, 32))
    with pytest.raises(ValueError, match="x.dtype"):
        D.dense_fp8_linear(x.float(), q, s)
    with pytest.raises(ValueError, match="in_features"):
        D.dense_fp8_linear(torch.randn(2, 16).bfloat16(), q, s)
    with pytest.raises(ValueError, match="scale"):
        D.dense_fp8_linear(x, q, s[:4])
    with pytest.raises(ValueError, match="bias"):
        D.dense_fp8_linear(x, q, s, torch.zeros(3, dtype=torch.bfloat16))


def test_fp8_per_channel_guards():
    w = torch.randn(6, 64)
    w[1] = 0.0  # zero row: scale 1, zero codes
    w[2] = 3.0e38  # near the fp32 / bf16 maximum
    w[3, 5] = -1e-30  # tiny lone value: scale clamped to a normal fp32
    w[4] *= 1e-39
    q, s = D.fp8_per_channel_quantize(w.bfloat16(), chunk_rows=4)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(q.float()).all()
    assert s[1] == 1.0 and (q[1].float() == 0).all()
    deq = D.fp8_per_channel_dequantize(q, s)
    assert torch.isfinite(deq).all()
    ref = w.bfloat16().float()
    for r in (0, 2, 5):  # per-row amax maps to 448: relative error within e4m3's half-ulp (2**-4)
        rel = (deq[r] - ref[r]).abs().max() / ref[r].abs().max()
        assert rel <= 2.0**-4, (r, rel)
    assert (q[0].float().abs().max() == 448.0)
    with pytest.raises(ValueError, match="non-finite"):
        D.fp8_per_channel_quantize(torch.tensor([[1.0, float("inf")] * 16]))
    with pytest.raises(ValueError, match="w must be 2-D"):
        D.fp8_per_channel_quantize(torch.zeros(4))


def test_mx_weight_roundtrips():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)
    w[3] = 0.0
    c8, s8 = D.mxfp8_weight_quantize(w)
    d8 = D.mxfp8_weight_dequantize(c8, s8)
    assert (d8[3] == 0).all() and ((d8 - w).abs() <= w.abs().unflatten(1, (2, 32)).amax(-1).repeat_interleave(32, 1)
                                   * 2.0**-4 + 1e-30).all()
    c4, s4 = D.mxfp4_weight_quantize(w)
    assert c4.shape == (8, 32) and s4.shape == (8, 2)
    d4 = D.mxfp4_weight_dequantize(c4, s4)
    assert (d4[3] == 0).all()
    # e2m1 grid values at scale 1 come back exactly
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0] * 4).repeat(2, 1)
    c, s = D.mxfp4_weight_quantize(grid)
    assert (s == 127).all() and torch.equal(D.mxfp4_weight_dequantize(c, s), grid)
    rel = ((d4 - w).norm() / w.norm()).item()
    assert 0.03 < rel < 0.2, rel
    with pytest.raises(ValueError, match="in_features"):
        D.mxfp4_weight_quantize(torch.zeros(2, 48))


# ---- the FMA (CUDA-core) decode path, M <= 4 ---------------------------------------------------

def _fma_case(m, n, k, bias, seed, device):
    """Activations and weights with the awkward rows: all-zero, large (scale >> 1), tiny, denormal codes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 3] = 0.0
    if m > 1:
        x[1] *= 1e-12  # a tiny token (~2**-40): its products stay normal fp32 only thanks to the 2**64 pre-scale
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4
    w[0] = 0.0  # zero row: scale 1, zero codes
    w[1] *= 1e5  # large row: scale ~ 1e3 (scale * 2**56 alone would overflow fp32 if folded)
    w[2, ::2] = 0.0
    w[3] = torch.where(torch.arange(k) % 3 == 0, 1.0, 1e-5)  # e4m3 denormal codes (1e-5 * 448 < 2**-6)
    b = (torch.randn(n, generator=g) * 2).bfloat16().to(device) if bias else None
    q, s = D.fp8_per_channel_quantize(w.bfloat16())
    return x.bfloat16().to(device), q.to(device), s.to(device), b


@pytest.mark.interpreter
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (48, 64)], ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_dense_fma_matches_reference(n, k, m, bias, device):
    x, q, s, b = _fma_case(m, n, k, bias, seed=m * 100 + n + k, device=device)
    u = q[3].view(torch.uint8)
    assert (((u & 0x78) == 0) & ((u & 0x07) != 0)).any()  # denormal codes present
    out = D.dense_fp8_linear(x, q, s, b, path="fma")
    ref = D.dense_fp8_linear_torch(x, q, s, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert (out[:, 0].float() == (b[0].float() if bias else 0.0)).all()  # zero row: exactly the bias
    # Kernel error only, element by element: one bf16 rounding (<= 2**-9 |ref|) + fp32 sums
    # (<= K * 2**-24 * sum |x w|), so the large row and the tiny token get the same relative bound.
    absref = x.float().abs() @ D.fp8_per_channel_dequantize(q, s).abs().T
    tol = ref.abs() * 2.0**-8 + absref * 2.0**-14
    err = (out.float() - ref).abs()
    assert (err <= tol).all(), ((err - tol).max(), err.max())


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("tiles", ["4,32,1", "8,64,2"])
def test_dense_fma_activation_rows_change_no_bit(m, tiles, device, monkeypatch):
    """X_ROWS (the activation words loaded in the weight tile's layout, stop 40) where the tile's K step
    spans >= 32 words per warp (``fma_x_rows``; the sm_90 one-token 8,256,8): the same bits as the
    activation row broadcast over the tile's rows, with a bias, a masked K tail (K = 160: 40 words,
    steps of 32 / 64) and rows past N masked (N = 37); the launcher's rule picks it exactly there."""
    x, q, s, b = _fma_case(m, 37, 160, True, seed=7 + m, device=device)  # K = 160: 40 words, steps of 32 / 64
    monkeypatch.setenv(D.DENSE_FMA_TILES_ENV, tiles)
    t = D.dense_fma_tiles(x)
    kw = min(t.kw, 64)  # the launcher's clip to next_pow2(K / 4)
    assert D.fma_x_rows(t, kw) and not D.fma_x_rows(D.DenseFmaTiles(16, 128, 8), 128)
    assert not D.fma_x_rows(D.DenseFmaTiles(8, 256, 8), 128) and D.fma_x_rows(D.DenseFmaTiles(8, 256, 8), 256)
    on = D.dense_fp8_linear(x, q, s, b, path="fma")
    monkeypatch.setenv(D.DENSE_X_ROWS_ENV, "0")  # the A/B switch: the broadcast row as before
    assert not D.fma_x_rows(t, kw)
    off = D.dense_fp8_linear(x, q, s, b, path="fma")
    assert torch.equal(on, off)
    assert_close(on.float(), D.dense_fp8_linear_torch(x, q, s, b).float(), atol=2e-2, rtol=1e-2)


@pytest.mark.interpreter
def test_dense_paths_and_selection(device, monkeypatch):
    x, q, s, b = _fma_case(4, 48, 96, True, seed=7, device=device)
    ref = D.dense_fp8_linear_torch(x, q, s, b)
    for path in ("auto", "fma", "mma"):
        assert_close(D.dense_fp8_linear(x, q, s, b, path=path), ref, atol=2e-2, rtol=1e-2, what=path)
    monkeypatch.delenv(D.DENSE_FMA_MAX_M_ENV, raising=False)
    monkeypatch.delenv(D.DENSE_MMAV_MAX_M_ENV, raising=False)
    assert [D.select_path(m, 5120) for m in (0, 1, 4, 5, 16)] == ["mma", "fma", "fma", "mma", "mma"]
    # sm_90 (stops 40-41, H200): FMA for 1-2 tokens (lm_head 1), the tensor-core GEMV for 3-32, MMA above;
    # sm_12x keeps FMA up to 4 and MMA above (not measured on GB10)
    sm90, sm12x = D._platform.SM90, D._platform.SM12X
    assert [D.select_path(m, 5120, sm90) for m in (0, 1, 2, 3, 16, 17, 32, 33)] == [
        "mma", "fma", "fma", "mmav", "mmav", "mmav", "mmav", "mma"]
    assert [D.select_path(m, D.WIDE_N, sm90) for m in (1, 2, 16, 17, 32)] == ["fma", "mmav", "mmav", "mma", "mma"]
    assert [D.select_path(m, 5120, sm12x) for m in (1, 4, 5, 16)] == ["fma", "fma", "mma", "mma"]
    wide = D.WIDE_N  # lm_head: FMA only up to DENSE_FMA_WIDE_MAX_M tokens (timed on H100)
    assert [D.select_path(m, wide) for m in (1, 2)] == ["fma", "mma"]
    assert D.select_path(2, wide - 1) == "fma"
    monkeypatch.setenv(D.DENSE_FMA_MAX_M_ENV, "4")  # the environment sets the limit for every N and family
    assert [D.select_path(m, wide) for m in (1, 4, 5, 16)] == ["fma", "fma", "mma", "mma"]
    assert [D.select_path(m, 5120, sm90) for m in (4, 5)] == ["fma", "mmav"]
    monkeypatch.setenv(D.DENSE_FMA_MAX_M_ENV, "0")
    assert D.select_path(1) == "mma"
    monkeypatch.delenv(D.DENSE_FMA_MAX_M_ENV)
    assert D.DENSE_W8A8_MIN_M == 0 and D.select_path(64) == "mma"  # vLLM's W8A8 GEMM: opt-in
    monkeypatch.setenv(D.DENSE_W8A8_MIN_M_ENV, "8")
    assert [D.select_path(m, 5120) for m in (1, 4, 5, 7, 8, 2048)] == ["fma", "fma", "mma", "mma", "w8a8", "w8a8"]
    assert [D.select_path(m, 5120, sm90) for m in (2, 3, 7, 8)] == ["fma", "mmav", "mmav", "w8a8"]  # opt-in wins
    monkeypatch.setenv(D.DENSE_W8A8_MIN_M_ENV, "eight")
    with pytest.raises(ValueError, match="VLLM_SM121_DENSE_W8A8_MIN_M='eight': expected an integer"):
        D.select_path(8)
    monkeypatch.delenv(D.DENSE_W8A8_MIN_M_ENV)
    if device == "cpu":  # refused with the reason, never rerouted to another path
        with pytest.raises(ValueError, match="path 'w8a8'.*needs a CUDA device"):
            D.dense_fp8_linear(x, q, s, b, path="w8a8")
    monkeypatch.setenv(D.DENSE_FMA_MAX_M_ENV, "2")
    assert [D.select_path(m) for m in (2, 3)] == ["fma", "mma"]
    monkeypatch.setenv(D.DENSE_FMA_MAX_M_ENV, "99")  # capped at what the kernel unrolls
    assert D.select_path(5) == "mma"
    with pytest.raises(ValueError, match="path='fma' takes at most 4"):
        D.dense_fp8_linear(torch.zeros(5, 96, dtype=torch.bfloat16, device=device), q, s, path="fma")
    with pytest.raises(ValueError, match="path="):
        D.dense_fp8_linear(x, q, s, path="dot")
    assert D.dense_fp8_linear(x[:0], q, s, path="fma").shape == (0, 48)


@pytest.mark.interpreter
def test_dense_fma_strided_tiles_env_and_fp32_bias(device, monkeypatch):
    x = torch.randn(3, 80).bfloat16().to(device)[:, 2:66]  # row stride 80, offset 2: not int64-aligned -> copy
    w = torch.randn(40, 64).bfloat16().to(device)
    bias = torch.randn(40).to(device)  # fp32 bias
    q, s = D.fp8_per_channel_quantize(w)
    ref = D.dense_fp8_linear_torch(x, q, s, bias)
    assert_close(D.dense_fp8_linear(x, q, s, bias, path="fma"), ref, atol=2e-2, rtol=1e-2)
    monkeypatch.setenv(D.DENSE_FMA_TILES_ENV, "32,4,2")  # 4-word steps: 4 steps, rows past N masked
    assert D.dense_fma_tiles(x) == D.DenseFmaTiles(32, 4, 2)
    assert_close(D.dense_fp8_linear(x, q, s, bias, path="fma"), ref, atol=2e-2, rtol=1e-2)
    monkeypatch.setenv(D.DENSE_FMA_TILES_ENV, "16,6,4")
    with pytest.raises(ValueError, match="power of two"):
        D.dense_fma_tiles(x)
    monkeypatch.setenv(D.DENSE_FMA_TILES_ENV, "16,64")
    with pytest.raises(ValueError, match="rows,kw,warps"):
        D.dense_fma_tiles(x)


def test_dense_fma_tiles_per_token_count_and_width(monkeypatch):
    """One and two tokens on sm_90 take the swept tiles (one-token lm_head its own); more tokens,
    other families and the environment override take theirs."""
    cpu = torch.empty(0)
    monkeypatch.delenv(D.DENSE_FMA_TILES_ENV, raising=False)
    assert D.dense_fma_tiles(cpu, 1, 5120) == D.DENSE_FMA_TILES["interpreter"]  # no one-token entry
    with monkeypatch.context() as mp:
        mp.setattr(D._platform, "family_of", lambda t: D._platform.SM90)
        assert D.dense_fma_tiles(cpu, 1, 5120) == D.DenseFmaTiles(8, 256, 8)
        assert D.dense_fma_tiles(cpu, 1, 201088) == D.DenseFmaTiles(32, 128, 8)
        assert D.dense_fma_tiles(cpu, 2, 5120) == D.DenseFmaTiles(8, 256, 8)  # stop 40: two tokens too
        assert D.dense_fma_tiles(cpu, 3, 5120) == D.dense_fma_tiles(cpu) == D.DENSE_FMA_TILES[D._platform.SM90]
        assert D.dense_fma_tiles(cpu, 2, 201088) == D.DENSE_FMA_TILES[D._platform.SM90]
        mp.setattr(D._platform, "family_of", lambda t: D._platform.SM12X)
        assert D.dense_fma_tiles(cpu, 1, 5120) == D.DENSE_FMA_TILES[D._platform.SM12X]
        mp.setenv(D.DENSE_FMA_TILES_ENV, "32,4,2")
        assert D.dense_fma_tiles(cpu, 1, 201088) == D.DenseFmaTiles(32, 4, 2)


@pytest.mark.aot
def test_dense_fma_ptx_keeps_denormals_and_no_barrier_in_the_k_loop(tmp_path):
    """sm_121a / sm_90a builds of the FMA kernel (AOT, no GPU): no .ftz anywhere (e4m3 denormal
    codes are fp32 denormals after the bit-trick decode), no MMA, and no bar.sync inside the K loop:
    where the tile would make Triton broadcast activation words through shared memory (kw >= 32 *
    warps, barriers in the loop until stop 40), the kernel loads them in the weight tile's layout
    (X_ROWS)."""
    import os
    import subprocess
    import sys

    script = (
        "import re, json\n"
        "from vllm_sm121.kernels import aot\n"
        "out = {}\n"
        "for arch in (121, 90):\n"
        "    for s in aot.dense_specs(aot.ARCHS[arch]):\n"
        "        if s.name.startswith('dense_fp8_fma[') and s.name.startswith(('dense_fp8_fma[qkv', 'dense_fp8_fma[o')):\n"
        "            p = aot.compile_spec(s, arch).ptx\n"
        "            i = p.index('Loop Header'); loop = p[i:p.index('bra', i)]\n"
        "            kv = 'kv write' in s.name  # its epilogue quantizes as the nvfp4 KV write kernel (.ftz there)\n"
        "            out[f'{arch}:{s.name}'] = dict(ftz='.ftz' in (loop if kv else p), bar=loop.count('bar.sync'),\n"
        "                mma=bool(re.search(r'\\b(mma|wgmma|ldmatrix|cp\\.async)', p)), ffma='fma.rn.f32' in p,\n"
        "                broadcast=s.constexprs['BLOCK_KW'] >= 32 * s.num_warps, x_rows=s.constexprs['X_ROWS'])\n"
        "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    res = json.loads(proc.stdout.strip().splitlines()[-1])
    # qkv (plain, with the rotation, + the carried norm, + the nvfp4 KV write) and o, M = 1 and 4 on both
    # archs, M = 2 on sm_90a (its own two-token tile)
    assert len(res) == 25 and sum(k.startswith("90:") and ", M2" in k for k in res) == 5
    assert any(r["broadcast"] for r in res.values())  # the sm_90 one-token tiles (8,256,8)
    for name, r in res.items():
        assert r.pop("x_rows") == r.pop("broadcast"), name
        assert r == dict(ftz=False, mma=False, ffma=True, bar=0), (name, r)


def _gpt_oss_case(shape: str, m: int):
    """(x, e4m3 weights, scales, bias) on the GPU at a gpt-oss-120b layer shape."""
    n, k = {"qkv": (5120, 2880), "o": (2880, 4096)}[shape]
    g = torch.Generator(device="cuda").manual_seed(m)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    b = (torch.randn(n, generator=g, device="cuda") * 0.02).bfloat16()
    q, s = D.fp8_per_channel_quantize(w)
    return x, q, s, b


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qkv", "o"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_dense_fma_gpt_oss_120b_shapes(shape, m):
    """FMA vs MMA vs the fp32 reference at gpt-oss-120b shapes (qkv N5120 K2880, o N2880 K4096)."""
    x, q, s, b = _gpt_oss_case(shape, m)
    ref = D.dense_fp8_linear_torch(x, q, s, b)
    fma = D.dense_fp8_linear(x, q, s, b, path="fma")
    mma = D.dense_fp8_linear(x, q, s, b, path="mma")
    for what, out in (("fma", fma), ("mma", mma)):
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 4e-3, (what, rel)
    assert_close(fma, ref, atol=2e-2, rtol=1e-2, what="fma")
    assert ((fma.float() - mma.float()).norm() / mma.float().norm()).item() < 4e-3
    auto = D.select_path(m, q.shape[0], D._platform.family_of(x))  # fma, or mmav at M >= 3 on sm_90 (stop 40)
    if auto == "fma":
        assert torch.equal(D.dense_fp8_linear(x, q, s, b), fma)
    else:
        assert torch.equal(D.dense_fp8_linear(x, q, s, b), D.dense_fp8_linear(x, q, s, b, path=auto))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qkv", "o"])
@pytest.mark.parametrize("m", [8, 64, 2048])
def test_dense_w8a8_path_gpt_oss_120b_shapes(shape, m, monkeypatch):
    """vLLM's W8A8 GEMM on our e4m3 weights: kernel error against the product of the per-token
    e4m3 activations and the dequantized weights; its W8A8 error against the W8A16 reference is
    printed (the price of quantizing activations). Auto takes it only when the env says so."""
    x, q, s, b = _gpt_oss_case(shape, m)
    n, k = q.shape
    if D.w8a8_unsupported_reason(x, n, k):
        pytest.skip(D.w8a8_unsupported_reason(x, n, k))
    out = D.dense_fp8_linear(x, q, s, b, path="w8a8")
    ref = D.dense_fp8_linear_torch(D.w8a8_activation_quantize_torch(x), q, s, b)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    w8a16 = D.dense_fp8_linear_torch(x, q, s, b)
    rel_a = ((out.float() - w8a16).norm() / w8a16.norm()).item()
    print(f"\n{shape} M={m}: w8a8 kernel error {rel:.2e}; vs W8A16 reference {rel_a:.2e}")
    assert rel < 4e-3, rel
    monkeypatch.setenv(D.DENSE_W8A8_MIN_M_ENV, "8")
    assert torch.equal(D.dense_fp8_linear(x, q, s, b), out)


def _rope_case(m, heads_q, heads_kv, head, k, device, seed, cache_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n = (heads_q + 2 * heads_kv) * head
    x = torch.randn(m, k, generator=g).bfloat16().to(device)
    w = (torch.randn(n, k, generator=g) * 0.5).bfloat16().to(device)
    b = torch.randn(n, generator=g).bfloat16().to(device)
    q, s = D.fp8_per_channel_quantize(w)
    max_pos = 4096
    ang = torch.rand(max_pos, head // 2, generator=g) * 6.3
    cache = torch.cat((ang.cos(), ang.sin()), dim=-1).to(cache_dtype).to(device)
    pos = torch.randint(0, max_pos, (m,), generator=g).to(device)
    return x, q, s, b, pos, cache, (heads_q + heads_kv) * head


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32cache", "bf16cache"])
def test_rope_in_the_fma_epilogue_matches_linear_then_rotation(m, cache_dtype, device):
    """The qkv GEMV with gpt-oss's NeoX rotation in its epilogue (rows paired inside each head's halves)
    against the same GEMV unrotated and then rotated (``rope_neox_``): the projection is the same
    kernel's, so only the rotation's fp32 arithmetic may differ (fused multiply-adds): at most one bf16
    step, almost everywhere equal. v rows (past rope_rows) are not rotated."""
    head = 64
    x, q, s, b, pos, cache, rope_rows = _rope_case(m, 4, 2, head, 96, device, 7 + m, cache_dtype)
    fused = D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head, path="fma")
    plain = D.dense_fp8_linear(x, q, s, b, path="fma")
    ref = D.rope_neox_(plain.clone(), pos, cache, rope_rows, head)
    assert torch.equal(fused[:, rope_rows:], plain[:, rope_rows:])  # v: as the plain GEMV
    assert not torch.equal(ref[:, :rope_rows], plain[:, :rope_rows])  # (the rotation did something)
    diff = (fused.float() - ref.float()).abs()
    step = ref.float().abs().clamp(min=2.0 ** -126) * 2.0 ** -7
    assert bool((diff <= step).all()), float((diff / step).max())
    assert float((diff == 0).float().mean()) > 0.97


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [6, 20])
@pytest.mark.parametrize("head,heads_q", [(8, 4), (8, 3), (16, 4), (64, 4)])
def test_rope_in_the_mma_epilogue_matches_linear_then_rotation(m, head, heads_q, device, monkeypatch):
    """The MMA kernel with gpt-oss's NeoX rotation in its epilogue (stop 41; before, torch rotated its
    output in ~10 kernels) against the same kernel unrotated, then ``rope_neox_``: at most one bf16
    step apart, v rows untouched. Head sizes below, at and above the kernel's BLOCK_N (16 in the
    interpreter): whole heads per program (8; with 3 q heads a program holds rotated and v rows) and
    pairs of runs inside a head's halves (16, 64)."""
    x, q, s, b, pos, cache, rope_rows = _rope_case(m, heads_q, 2, head, 64, device, 11 + m + head + heads_q)
    assert D._mma_rope_fits(D._mma_tiles(x, m, q.shape[0], 64)[1], rope_rows, head)
    diff = rotation_in_epilogue_diff(monkeypatch, "mma", x, q, s, b, pos, cache, rope_rows, head)
    assert float((diff == 0).float().mean()) > 0.97
    # a tile that does not fit (rope_rows not a multiple of BLOCK_N): the rotation after the projection
    assert not D._mma_rope_fits(32, 48, 64) and not D._mma_rope_fits(128, 192, 48)
    assert D._mma_rope_fits(128, 256, 64) and D._mma_rope_fits(128, 576, 64)  # (whole heads: TP=8's 9 heads too)


@pytest.mark.interpreter
def test_rope_off_the_fma_path_and_bad_input(device):
    """More tokens than the FMA GEMV takes: the MMA kernel with the rotation in its epilogue (the
    reference: the unrotated projection, then ``rope_neox_``); bad shapes are refused by name."""
    head = 64
    x, q, s, b, pos, cache, rope_rows = _rope_case(6, 2, 1, head, 64, device, 3)
    out = D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head)
    ref = D.rope_neox_(D.dense_fp8_linear(x, q, s, b), pos, cache, rope_rows, head)
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs().clamp(min=2.0 ** -126) * 2.0 ** -7).all()), float(diff.max())
    for path in ("mmav", "mma"):  # the carried norm is the FMA epilogue's: refused elsewhere, never ignored
        with pytest.raises(ValueError, match="FMA path only"):
            D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head, path=path, norm=("bufs", 1e-5, None))
    with pytest.raises(ValueError, match="rope_rows"):
        D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows + 32, head)
    with pytest.raises(ValueError, match="positions"):
        D.dense_fp8_linear_rope(x, q, s, b, pos[:2], cache, rope_rows, head)
    with pytest.raises(ValueError, match="head_size"):
        D.dense_fp8_linear_rope(x, q, s, b, pos, cache[:, :32], rope_rows, head)


def _nvfp4_kv_pages(heads_kv, head, device, block=16, blocks=6):
    from vllm_sm121.kernels.fp4_kv import Nvfp4Pages

    cache = torch.zeros(blocks, 2, heads_kv * block * (head // 2 + head // 16), dtype=torch.uint8, device=device)
    g = torch.tensor([2.0 ** -9, 2.0 ** -7], device=device)
    return cache, tuple(Nvfp4Pages.view(cache[:, i], heads_kv, block, head, g[i:i + 1]) for i in (0, 1))


@pytest.mark.interpreter
@pytest.mark.parametrize("m,path", [(1, "fma"), (3, "fma"), (6, "auto"), (3, "mmav"), (20, "mmav")])
def test_qkv_gemv_writes_the_nvfp4_kv_cache(m, path, device, monkeypatch):
    """``kv_write``: the qkv GEMV (+ rotation) also writes each token's k and v heads to the NVFP4 KV
    pages. On the FMA path each head's last program to finish does it (no write launch: the write
    kernel is not called), elsewhere the write kernel runs after the projection; either way the
    projection is the one without ``kv_write`` and the pages hold exactly the bytes ``fp4_kv_write``
    writes from it, a padded token (slot -1) writes nothing, and the arrival counters end at 0."""
    import importlib

    from vllm_sm121.kernels.fp4_kv import fp4_kv_write

    fp4 = importlib.import_module("vllm_sm121.kernels.fp4_kv")
    head, hkv = 32, 2
    x, q, s, b, pos, cache, rope_rows = _rope_case(m, 4, hkv, head, 64, device, 21 + m)
    slots = torch.tensor(([5, 40, -1, 17, 66, 3] + list(range(70, 84)))[:m], dtype=torch.int64, device=device)
    out = D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head, path=path)
    ref_cache, (kp, vp) = _nvfp4_kv_pages(hkv, head, device)
    qr = rope_rows - hkv * head
    fp4_kv_write(out[:, qr:rope_rows].reshape(m, hkv, head), out[:, rope_rows:].reshape(m, hkv, head), kp, vp, slots)
    kv_cache, pages = _nvfp4_kv_pages(hkv, head, device)
    if path == "fma":  # the write kernel must not run
        with monkeypatch.context() as mp:
            mp.setattr(fp4, "fp4_kv_write", lambda *a, **k: (_ for _ in ()).throw(AssertionError("write launched")))
            fused = D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head, path=path,
                                            kv_write=(*pages, slots))
        from vllm_sm121.kernels import moe as K

        assert int(K.split_counters(x.device, purpose="qkv_kv").abs().sum()) == 0
    else:
        fused = D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head, path=path, kv_write=(*pages, slots))
    assert torch.equal(fused, out)
    assert ref_cache.count_nonzero() > 0
    assert torch.equal(kv_cache.cpu(), ref_cache.cpu())


@pytest.mark.interpreter
def test_qkv_gemv_kv_write_bad_input(device):
    """Pages that do not fit the projection's heads, or bad slots, are refused by name."""
    head = 32
    x, q, s, b, pos, cache, rope_rows = _rope_case(1, 4, 2, head, 64, device, 5)
    _, pages3 = _nvfp4_kv_pages(3, head, device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="KV heads"):
        D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head, kv_write=(*pages3, slots))
    _, pages = _nvfp4_kv_pages(2, head, device)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head, kv_write=(*pages, slots.int()))
    with pytest.raises(ValueError, match="Nvfp4Pages"):
        D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head, kv_write=(pages[0], cache, slots))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
def test_rope_in_the_fma_epilogue_gpt_oss_120b_qkv(m):
    """gpt-oss-120b's qkv (64 q + 8 kv heads of 64, K 2880) with the rotation fused, on the GPU."""
    x, q, s, b, pos, cache, rope_rows = _rope_case(m, 64, 8, 64, 2880, "cuda", 11 + m)
    fused = D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, 64, path="fma")
    plain = D.dense_fp8_linear(x, q, s, b, path="fma")
    ref = D.rope_neox_(plain.clone(), pos, cache, rope_rows, 64)
    assert torch.equal(fused[:, rope_rows:], plain[:, rope_rows:])
    diff = (fused.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs().clamp(min=2.0 ** -126) * 2.0 ** -7).all())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_qkv_gemv_kv_write_gpt_oss_120b_graph_replay_on_gpu(m):
    """gpt-oss-120b's qkv (64 q + 8 kv heads of 64, K 2880) with the rotation and the nvfp4 KV write
    fused, captured in a CUDA graph and replayed with new slots: each replay's pages hold exactly the
    bytes ``fp4_kv_write`` writes from the same projection, and the arrival counters end at 0."""
    from vllm_sm121.kernels import moe as K
    from vllm_sm121.kernels.fp4_kv import fp4_kv_write

    head, hkv = 64, 8
    x, q, s, b, pos, cache, rope_rows = _rope_case(m, 64, hkv, head, 2880, "cuda", 31 + m)
    qr = rope_rows - hkv * head
    kv_cache, pages = _nvfp4_kv_pages(hkv, head, "cuda", blocks=64)
    slots = torch.arange(m, dtype=torch.int64, device="cuda") * 37 + 5
    D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head, path="fma", kv_write=(*pages, slots))  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head, path="fma", kv_write=(*pages, slots))
    for step in range(2):
        slots.copy_(torch.arange(m, dtype=torch.int64, device="cuda") * 37 + 5 + 200 * step)
        kv_cache.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref_cache, ref_pages = _nvfp4_kv_pages(hkv, head, "cuda", blocks=64)
        fp4_kv_write(out[:, qr:rope_rows].reshape(m, hkv, head), out[:, rope_rows:].reshape(m, hkv, head), *ref_pages,
                     slots)
        assert ref_cache.count_nonzero() > 0 and torch.equal(kv_cache, ref_cache), step
        assert int(K.split_counters(x.device, purpose="qkv_kv").abs().sum()) == 0
    plain = D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head, path="fma")
    assert torch.equal(out, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_dense_fma_pdl_chain_matches(m, monkeypatch):
    """$VLLM_SM121_PDL=1: a graph of dependent GEMVs (each one's output the next one's input,
    every launch a programmatic dependent of the one before, the rotation on qkv) gives the same bits
    as the plain launches."""
    x, q, s, b = _gpt_oss_case("o", m)
    xq, qq, sq, bq = _gpt_oss_case("qkv", m)
    g = torch.Generator().manual_seed(3)
    ang = torch.rand(4096, 32, generator=g) * 6.3
    cache = torch.cat((ang.cos(), ang.sin()), dim=-1).cuda()
    pos = torch.randint(0, 4096, (m,), generator=g).cuda()

    def chain():  # three GEMV launches back to back, nothing in between
        h = D.dense_fp8_linear(x, q, s, b, path="fma")  # [m, 2880]
        qkv = D.dense_fp8_linear_rope(h, qq, sq, bq, pos, cache, 72 * 64, 64, path="fma")  # [m, 5120]
        return D.dense_fp8_linear(qkv[:, :4096], q, s, b, path="fma")  # (a strided view: read in place)

    monkeypatch.delenv(D.V.PDL_ENV, raising=False)
    plain = chain()
    monkeypatch.setenv(D.V.PDL_ENV, "1")
    assert D.V.pdl_launch(x) == dict(PDL=True, launch_pdl=True)
    assert torch.equal(chain(), plain)
    assert torch.equal(graph_replayed(chain), plain)


@pytest.mark.interpreter
@pytest.mark.parametrize("m,path", [(1, "fma"), (3, "fma"), (2, "mmav"), (6, "mma"), (6, "auto")])
def test_dense_fp32_out_is_the_bf16_result_before_its_rounding(m, path, device):
    """out_dtype=torch.float32 (a row-parallel shard's partial under TP, all-reduced in fp32): the
    same kernel's sums, unrounded; rounding them to bf16 gives the bf16 output bit for bit."""
    x, q, s, b = _fma_case(m, 48, 96, True, seed=11 + m, device=device)
    f32 = D.dense_fp8_linear(x, q, s, b, path=path, out_dtype=torch.float32)
    bf = D.dense_fp8_linear(x, q, s, b, path=path)
    assert f32.dtype == torch.float32 and f32.shape == (m, 48)
    assert torch.equal(f32.bfloat16(), bf)
    assert (f32 != f32.bfloat16().float()).any()  # not rounded
    with pytest.raises(ValueError, match="out_dtype"):
        D.dense_fp8_linear(x, q, s, b, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="w8a8"):
        D.dense_fp8_linear(x, q, s, b, path="w8a8", out_dtype=torch.float32)
