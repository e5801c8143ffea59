"""The tensor-core decode GEMV of the FP8 dense linear (``path="mmav"``): kernel vs reference on
the interpreter (small shapes, split-K, the fused rotation) and at gpt-oss-120b shapes on a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import graph_replayed, load_benchmark, rotation_in_epilogue_diff
from vllm_sm121.kernels import dense as D


def _case(m, n, k, bias, seed, device, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * scale).bfloat16().to(device)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4).bfloat16()
    w[1] = 0.0
    q, s = D.fp8_per_channel_quantize(w.to(device))
    b = torch.randn(n, generator=g).bfloat16().to(device) if bias else None
    return x, q, s, b


def _not_called(*args, **kwargs):
    raise AssertionError("the rotation ran after the GEMV instead of in its epilogue")


def _check(out, x, q, s, b):
    """Kernel error only: fp16 activations (exact for these magnitudes: |x| in the fp16 normal range
    after the 2**-8 pre-scale keeps bf16's 8 bits), fp32 sums, one bf16 rounding."""
    ref = D.dense_fp8_linear_torch(x, q, s, b)
    absref = x.float().abs() @ D.fp8_per_channel_dequantize(q, s).abs().T
    tol = ref.abs() * 2.0**-8 + absref * 2.0**-14
    err = (out.float() - ref).abs()
    assert (err <= tol).all(), ((err - tol).max(), err.max())


@pytest.mark.interpreter
@pytest.mark.parametrize("tiles", ["16,32,1,1,1", "16,32,3,1,1", "32,16,0,1,1", "16,64,2,2,1"])
@pytest.mark.parametrize("m,n,k,bias", [(1, 40, 96, True), (3, 33, 80, False), (16, 48, 64, True),
                                         (17, 40, 96, True), (32, 33, 80, False)])
def test_dense_mmav_matches_reference(tiles, m, n, k, bias, device, monkeypatch):
    """Against the reference, 1-16 tokens in a 16-wide token tile, 17-32 in a 32-wide one (stop 40)."""
    monkeypatch.setenv(D.DENSE_MMAV_TILES_ENV, tiles)
    x, q, s, b = _case(m, n, k, bias, seed=m * 100 + n + k, device=device)
    out = D.dense_fp8_linear(x, q, s, b, path="mmav")
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert (out[:, 1].float() == (b[1].float() if bias else 0.0)).all()  # zero row: exactly the bias
    _check(out, x, q, s, b)
    # a second call gives the same bits (the arrival counters were reset; on the interpreter the
    # programs run in order, so this does not test the order-independence of the split sum: the GPU
    # tests' graph replays do)
    assert torch.equal(D.dense_fp8_linear(x, q, s, b, path="mmav"), out)


@pytest.mark.interpreter
def test_dense_mmav_selection_tiles_and_errors(device, monkeypatch):
    monkeypatch.delenv(D.DENSE_FMA_MAX_M_ENV, raising=False)
    assert D.select_path(1, 5120) == "fma" and D.select_path(3, 5120, D._platform.SM90) == "mmav"
    monkeypatch.setenv(D.DENSE_MMAV_MAX_M_ENV, "8")  # the tokens above the FMA limit, up to 8
    assert [D.select_path(m, 5120) for m in (1, 4, 5, 8, 9)] == ["fma", "fma", "mmav", "mmav", "mma"]
    monkeypatch.setenv(D.DENSE_FMA_MAX_M_ENV, "0")  # one token too once the FMA path is off
    assert [D.select_path(m, 5120) for m in (1, 8, 9)] == ["mmav", "mmav", "mma"]
    monkeypatch.delenv(D.DENSE_FMA_MAX_M_ENV)
    monkeypatch.setenv(D.DENSE_MMAV_MAX_M_ENV, "0")  # off for every family
    assert [D.select_path(m, 5120, D._platform.SM90) for m in (1, 2, 3, 5)] == ["fma", "fma", "mma", "mma"]
    assert [D.mmav_block_t(m) for m in (1, 16, 17, 32)] == [16, 16, 32, 32]
    monkeypatch.setenv(D.DENSE_MMAV_MAX_M_ENV, "16")  # the 16-wide tile only (stop 40's default)
    assert [D.select_path(m, 5120, D._platform.SM90) for m in (2, 16, 17, 32)] == ["fma", "mmav", "mma", "mma"]
    monkeypatch.delenv(D.DENSE_MMAV_MAX_M_ENV)  # since stop 41 the sm_90 default takes the 32-wide tile too
    assert [D.select_path(m, 5120, D._platform.SM90) for m in (2, 17, 32, 33)] == ["fma", "mmav", "mmav", "mma"]
    assert D.select_path(17, 5120, D._platform.SM12X) == "mma"
    x, q, s, b = _case(33, 16, 32, True, 1, device)
    with pytest.raises(ValueError, match="path='mmav' takes at most 32"):
        D.dense_fp8_linear(x, q, s, b, path="mmav")
    for bad in ("8,32,1,1,1", "16,32,1,3,1", "16,32,1,1", "16,24,1,1,1", "a,b,c,d,e"):
        monkeypatch.setenv(D.DENSE_MMAV_TILES_ENV, bad)
        with pytest.raises(ValueError, match="rows|num_warps|rows,kb,split,warps,stages"):
            D.dense_mmav_tiles(x)
    # auto split: enough programs for two per SM, never more splits than K steps
    t = D.DenseMmavTiles(64, 256, 0, 1, 3)
    assert t.splits(5120, 2880, 132) == 4 and t.splits(2880, 4096, 132) == 6 and t.splits(201088, 2880, 132) == 1
    assert D.DenseMmavTiles(64, 256, 8, 1, 3).splits(64, 512, 132) == 2


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [1, 3, 20])
def test_rope_in_the_mmav_epilogue_matches_linear_then_rotation(m, device, monkeypatch):
    """gpt-oss's NeoX rotation fused into the mmav epilogue (split-K on) against the unrotated mmav
    projection rotated by ``rope_neox_``: at most one bf16 step apart, v rows untouched."""
    monkeypatch.setenv(D.DENSE_MMAV_TILES_ENV, "16,32,2,1,1")
    head = 32
    g = torch.Generator().manual_seed(5 + m)
    n, k = (4 + 2 * 2) * head, 64
    x = torch.randn(m, k, generator=g).bfloat16().to(device)
    q, s = D.fp8_per_channel_quantize((torch.randn(n, k, generator=g) * 0.5).bfloat16().to(device))
    b = torch.randn(n, generator=g).bfloat16().to(device)
    ang = torch.rand(512, head // 2, generator=g) * 6.3
    cache = torch.cat((ang.cos(), ang.sin()), dim=-1).to(device)
    pos = torch.randint(0, 512, (m,), generator=g).to(device)
    rope_rows = 6 * head
    rotation_in_epilogue_diff(monkeypatch, "mmav", x, q, s, b, pos, cache, rope_rows, head)


def _gpt_oss(shape, m, seed=0):
    n, k = {"qkv": (5120, 2880), "o": (2880, 4096), "lm_head": (201088, 2880)}[shape]
    return _case(m, n, k, shape != "lm_head", seed, "cuda", scale=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qkv", "o", "lm_head"])
@pytest.mark.parametrize("m", [1, 4, 16, 32])
def test_dense_mmav_gpt_oss_120b_shapes(shape, m):
    """mmav at gpt-oss-120b shapes and the default tiles (auto split) against the fp32 reference,
    element by element, and against the FMA GEMV; in a CUDA graph replay too."""
    x, q, s, b = _gpt_oss(shape, m)
    out = D.dense_fp8_linear(x, q, s, b, path="mmav")
    _check(out, x, q, s, b)
    if m <= D.DENSE_FMA_KERNEL_MAX_M:
        fma = D.dense_fp8_linear(x, q, s, b, path="fma")
        assert ((fma.float() - out.float()).norm() / fma.float().norm()).item() < 4e-3
    assert torch.equal(graph_replayed(lambda: D.dense_fp8_linear(x, q, s, b, path="mmav")), out)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", ["64,256,0,1,3", "64,128,0,1,4", "32,256,0,1,3", "128,128,0,2,3", "64,256,1,4,3",
                                   "64,512,0,1,2"])
def test_dense_mmav_tiles_on_gpu(tiles, monkeypatch):
    """Every tile the sweep times (incl. a wgmma-sized one on sm_90) computes the same product."""
    monkeypatch.setenv(D.DENSE_MMAV_TILES_ENV, tiles)
    for shape in ("qkv", "o"):
        x, q, s, b = _gpt_oss(shape, 1, seed=3)
        _check(D.dense_fp8_linear(x, q, s, b, path="mmav"), x, q, s, b)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 32])
def test_rope_in_the_mmav_epilogue_gpt_oss_120b_qkv(m, monkeypatch):
    g = torch.Generator().manual_seed(11 + m)
    x, q, s, b = _gpt_oss("qkv", m, seed=11 + m)
    ang = torch.rand(4096, 32, generator=g) * 6.3
    cache = torch.cat((ang.cos(), ang.sin()), dim=-1).cuda()
    pos = torch.randint(0, 4096, (m,), generator=g).cuda()
    rope_rows = 72 * 64
    with monkeypatch.context() as mp:
        mp.setattr(D, "rope_neox_", _not_called)
        fused = D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, 64, path="mmav")
    plain = D.dense_fp8_linear(x, q, s, b, path="mmav")
    ref = D.rope_neox_(plain.clone(), pos, cache, rope_rows, 64)
    assert torch.equal(fused[:, rope_rows:], plain[:, rope_rows:])
    diff = (fused.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs().clamp(min=2.0 ** -126) * 2.0 ** -7).all())


def test_gemv_tiles_benchmark_candidates_and_no_gpu_exit(capsys):
    """``benchmarks/gemv_tiles.py``: the candidates it times (env per path, ``+pdl`` copies of the FMA
    tiles) and, without a GPU, exit 2 with the reason."""
    bench = load_benchmark("gemv_tiles")
    args = bench.parse_args(["--fma-tiles", "default;8,256,8", "--mmav-tiles", "64,256,0,1,3", "--pdl"])
    assert bench.candidates(args) == [
        ("fma", {}, "default"), ("fma", {D.V.PDL_ENV: "1"}, "default+pdl"),
        ("fma", {D.DENSE_FMA_TILES_ENV: "8,256,8"}, "8,256,8"),
        ("fma", {D.DENSE_FMA_TILES_ENV: "8,256,8", D.V.PDL_ENV: "1"}, "8,256,8+pdl"),
        ("mmav", {D.DENSE_MMAV_TILES_ENV: "64,256,0,1,3"}, "64,256,0,1,3")]
    assert bench.SHAPES["qkv"] == (5120, 2880) and bench.ROPE_ROWS == 72 * 64
    if not torch.cuda.is_available():
        assert bench.main(["--out", "/dev/null"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out
