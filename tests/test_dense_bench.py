"""CPU checks of benchmarks/dense.py: the bytes model, the weight rotation that defeats L2, the
argument checks, the no-GPU exit and the ``--dry-run`` (Triton interpreter, tiny shapes)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "dense.py"


def _load():
    spec = importlib.util.spec_from_file_location("dense_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dense_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load()


def test_shapes_are_gpt_oss_120b():
    assert bench.SHAPES == {"qkv": (5120, 2880, True), "o": (2880, 4096, True), "lm_head": (201088, 2880, False)}


def test_bytes_moved():
    n, k = bench.SHAPES["qkv"][:2]
    act = 2 * 8 * k + 2 * 8 * n
    assert bench.bytes_moved("cublas_bf16", n, k, True, 8) == 2 * n * k + 2 * n + act
    assert bench.bytes_moved("sm121", n, k, True, 8) == n * k + 4 * n + 2 * n + act
    assert bench.bytes_moved("vllm_fp8_marlin", n, k, False, 8) == n * k + 2 * n + act
    assert bench.weight_bytes("cublas_bf16", 201088, 2880, False) / 1e9 == pytest.approx(1.158, abs=1e-3)


def test_weight_copies_exceed_l2():
    l2 = 50 << 20  # H100
    for name, (n, k, bias) in bench.SHAPES.items():
        for p in bench.PROVIDERS:
            c = bench._copies(p, n, k, bias, l2)
            assert c >= 2 and c * bench.weight_bytes(p, n, k, bias) >= bench.L2_MULTIPLE * l2, (name, p, c)
    assert bench._copies("sm121", 5120, 2880, True, l2) >= 14  # qkv: 14.7 MB e4m3 (29.5 MB bf16)
    assert bench._copies("sm121", 5120, 2880, True, None) == 1  # CPU


def test_arguments():
    a = bench.parse_args(["--m", "1,4", "--shapes", "o", "--providers", "sm121,cublas_bf16"])
    assert (a.m, a.shapes, a.providers) == ([1, 4], ["o"], ["sm121", "cublas_bf16"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--providers", "cudnn"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "mlp"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_gpu_says_so_and_exits_2(capsys):
    assert bench.main(["--out", "/nonexistent/x.json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_dry_run(tmp_path):
    out = tmp_path / "dense.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--m", "1,3", "--fma-tiles", "16,16,1;8,16,2",
                           "--out", str(out)], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    head = data["header"]
    assert head["benchmark"] == "dense" and head["dry_run"] is True
    assert set(head["versions"]) == {"vllm", "torch", "triton", "vllm-sm121"} and "commit" in head
    assert set(head["config"]["shapes"]) == {"qkv", "o", "lm_head"}
    sweep = [r for r in data["records"] if "tile" in r]
    recs = [r for r in data["records"] if "tile" not in r]
    assert len(recs) == 3 * len(bench.PROVIDERS) * 2
    ran = ("sm121", "sm121_fma", "sm121_mma", "cublas_bf16")  # all run without a GPU too
    ours = [r for r in recs if r["provider"] in ("sm121", "sm121_fma", "sm121_mma")]
    # sm121 records say which path "auto" took: the FMA GEMV for these few-token calls
    assert {(r["shape"], r["m"], r["path"]) for r in recs if r["provider"] == "sm121"} == {
        (s, m, "fma") for s in ("qkv", "o", "lm_head") for m in (1, 3)}
    assert all(r["status"] == "ok" for r in ours)
    assert all(r["rel_l2_vs_own_weights"] < 1e-2 and r["rel_l2_vs_bf16"] < 0.05 for r in ours)
    assert all(r["status"] == "ok" for r in recs if r["provider"] == "cublas_bf16")
    assert all(r["status"].startswith("unavailable") for r in recs if r["provider"] not in ran)
    # the tile sweep: every tile x shape x M (<= 4), each checked against its reference
    assert sorted({(r["tile"], r["shape"], r["m"]) for r in sweep}) == sorted(
        (t, s, m) for t in ("16,16,1", "8,16,2") for s in ("qkv", "o", "lm_head") for m in (1, 3))
    assert all(r["status"] == "ok" and r["rel_l2_vs_own_weights"] < 1e-2 for r in sweep)
    assert data["header"]["config"]["fma_tiles"] == ["16,16,1", "8,16,2"]
    assert "fastest FMA tile for qkv M=1" in proc.stdout
    with pytest.raises(SystemExit):
        bench.parse_args(["--fma-tiles", "16,16"])
    assert "sm121 vs cuBLAS bf16" in proc.stdout


def test_path_limits_follow_the_kernels():
    """The benchmark's copies of the kernels' token limits (it loads without vLLM) stay in sync."""
    from kernels import dense as D

    assert (bench.FMA_MAX_M, bench.MMAV_MAX_M) == (D.DENSE_FMA_KERNEL_MAX_M, D.DENSE_MMAV_KERNEL_MAX_M)
    assert "sm121_mmav" in bench.PROVIDERS
