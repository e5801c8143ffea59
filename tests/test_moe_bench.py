"""CPU checks of benchmarks/moe.py: the vLLM config each provider's layer is built under (a real
gpt-oss MXFP4 ModelConfig, so vLLM's MXFP4 oracle can read ``model_config.quantization_config``;
on an H100 the upstream providers died on ``None.quantization_config`` without it), the
``FusedMoE`` arguments (gpt_oss.py MLPBlock's), and the ``--dry-run``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "moe.py"


def _load():
    spec = importlib.util.spec_from_file_location("moe_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["moe_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load()


@pytest.fixture(scope="module")
def args():
    return bench.parse_args(["--experts", "32", "--m", "1"])


@pytest.fixture(scope="module")
def model_config(args):
    return bench.build_model_config(args)


def test_model_config_is_gpt_oss_mxfp4_with_requested_shape(args, model_config):
    assert model_config.quantization in ("mxfp4", "gpt_oss_mxfp4")
    hf = model_config.hf_config
    assert hf.model_type == "gpt_oss"
    assert hf.quantization_config["quant_method"] in ("mxfp4", "gpt_oss_mxfp4")  # vLLM normalizes it
    assert (hf.num_local_experts, hf.num_experts_per_tok) == (32, 4)
    assert (hf.hidden_size, hf.intermediate_size) == (2880, 2880)
    small = bench.build_model_config(bench.parse_args(["--experts", "8", "--hidden", "128", "--inter", "64"]))
    assert (small.hf_config.num_local_experts, small.hf_config.hidden_size, small.hf_config.intermediate_size) == (8, 128, 64)
    assert model_config.hf_config.num_local_experts == 32  # its own temp dir, untouched


@pytest.mark.parametrize("provider", ["triton", "marlin"])
def test_upstream_provider_config(args, model_config, provider):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        Mxfp4MoeBackend,
        _user_moe_activation_override,
        map_mxfp4_backend,
    )
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config

    vc = bench.build_vllm_config(provider, args, model_config, device="cpu")
    assert vc.model_config is model_config
    assert vc.kernel_config.moe_backend == provider
    assert map_mxfp4_backend(vc.kernel_config.moe_backend) == [Mxfp4MoeBackend[provider.upper()]]
    assert isinstance(vc.quant_config, GptOssMxfp4Config)
    assert vc.quant_config.get_name() == "gpt_oss_mxfp4"  # the name the expert weight_loader keys on
    with set_current_vllm_config(vc):
        assert _user_moe_activation_override() is None  # the read that raised AttributeError on the H100

    kw = bench.layer_kwargs(vc, "model.layers.0.mlp.experts")
    assert kw["quant_config"] is vc.quant_config
    assert {k: kw[k] for k in ("num_experts", "top_k", "hidden_size", "intermediate_size")} == {
        "num_experts": 32, "top_k": 4, "hidden_size": 2880, "intermediate_size": 2880}
    assert (kw["activation"], kw["has_bias"], kw["renormalize"], kw["apply_router_weight_on_input"]) == (
        "swigluoai", True, True, False)


def test_sm121_provider_config(args, model_config):
    from vllm_sm121.moe.method import Sm121GptOssMxfp4Config

    vc = bench.build_vllm_config("sm121", args, model_config, device="cpu")
    assert isinstance(vc.quant_config, Sm121GptOssMxfp4Config)
    assert vc.quant_config.resolved_moe() == "mxfp8"
    assert vc.kernel_config.moe_backend == "auto"
    assert vc.model_config.hf_config.num_local_experts == 32


def test_dry_run_exits_0(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--m", "1", "--providers", "sm121,triton",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Sm121Mxfp4MoEMethod" in proc.stdout  # sm121 ran through vLLM's FusedMoE layer
    assert "config ok: quantization gpt_oss_mxfp4, --moe-backend triton, 8 experts" in proc.stdout
    assert out.exists()


def test_fma_provider_and_tile_sweep_options():
    from vllm_sm121.kernels import moe as K

    assert {"sm121", "sm121_fma", "sm121_decode"} <= set(bench.PROVIDERS)
    a = bench.parse_args(["--m", "1,4", "--providers", "sm121_fma,sm121_decode",
                          "--fma-tiles", "64,256,32,256,8,1; 128,128,16,128,4,2"])
    assert a.fma_tiles == ["64,256,32,256,8,1", "128,128,16,128,4,2"]
    assert all(K.FmaTiles.parse(t) for t in a.fma_tiles)
    assert bench.fc1_expert_bytes(a) + bench.fc2_expert_bytes(a) == bench.expert_bytes(a)


def test_dry_run_fma_sweep(tmp_path):
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--m", "1,5", "--providers", "sm121_fma",
                           "--no-refcheck", "--fma-tiles", "64,32,16,32,4,2", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "moe_block(path=fma)" in proc.stdout
    assert "fastest FMA tile at M=1: 64,32,16,32,4,2" in proc.stdout
    recs = json.loads(out.read_text())["records"]
    # M = 5 runs the FMA path windowed (one launch each); the tile sweep covers it too
    assert [r["status"] for r in recs if r["provider"] == "sm121_fma" and "tile" not in r] == ["ok", "ok"]
    assert {r["m"] for r in recs if r.get("tile")} == {1, 5}
    assert any(r.get("tile") == "64,32,16,32,4,2" and r["status"] == "ok" for r in recs)


def test_grouped_tile_sweep_option():
    from vllm_sm121.kernels import moe as K

    a = bench.parse_args(["--m", "8,512", "--providers", "sm121_grouped,triton",
                          "--grouped-tiles", "16,128,128,4,3; 32,128,64,8,2"])
    assert a.grouped_tiles == ["16,128,128,4,3", "32,128,64,8,2"]
    assert [K.GroupedTiles.parse(t).block_m for t in a.grouped_tiles] == [16, 32]
    assert bench.parse_args(["--m", "1"]).grouped_tiles == []


def test_dry_run_grouped_sweep(tmp_path):
    """Both tiles run at both M (M = 3: one pair per expert or so; 20: experts over several 16-token
    tiles), with FC1 / FC2 split times and the error against the reference in each record."""
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = tmp_path / "moe.json"
    tiles = ["16,64,64,4,1", "32,64,32,2,1"]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--m", "3,20", "--providers", "sm121_grouped",
                           "--grouped-tiles", ";".join(tiles), "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "moe_block(path=grouped)" in proc.stdout and "Grouped (prefill) tile sweep" in proc.stdout
    assert "fastest grouped tile at M=3: " in proc.stdout and "fastest grouped tile at M=20: " in proc.stdout
    recs = [r for r in json.loads(out.read_text())["records"] if r["provider"] == "sm121_grouped_tile"]
    assert sorted((r["tile"], r["m"]) for r in recs) == sorted((t, m) for t in tiles for m in (3, 20))
    for r in recs:
        assert r["status"] == "ok", r
        assert r["fc1_us_p50"] > 0 and r["fc2_us_p50"] > 0 and r["fc1_bytes"] + r["fc2_bytes"] < r["bytes"]
        assert r["rel_l2_vs_ref"] < 5e-3, r


def test_dry_run_norm_router(tmp_path):
    """--norm-router: both producers run at a fused M and a fallback M; same residual and scales, and
    the logits agree to bf16 rounding."""
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--m", "2,9", "--providers", "sm121",
                           "--norm-router", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["header"]["fma_products"] == "exact fp32"  # the interpreter never runs the packed products
    recs = [r for r in doc["records"] if r["provider"] in ("norm+linear", "norm_router")]
    assert sorted((r["provider"], r["m"]) for r in recs) == [("norm+linear", 2), ("norm+linear", 9),
                                                             ("norm_router", 2), ("norm_router", 9)]
    for r in recs:
        assert r["residual_and_scales_equal"] and r["logits_max_abs_diff"] < 2e-2, r


def test_moe_probe_stream_kernel_reads_each_tile_once_per_split():
    """benchmarks/moe_probe.py's read-only kernel (the FMA GEMVs' memory-side ceiling): every
    (slot, row tile) XOR over its K splits equals the XOR of that expert's rows (rows past the
    matrix and words past K masked), so it reads exactly the bytes the GEMV reads."""
    import functools
    import operator

    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from moe_probe import _stream_kernel

    g = torch.Generator().manual_seed(3)
    w = torch.randint(-2**31, 2**31 - 1, (4, 96, 100), generator=g, dtype=torch.int32)
    ids = torch.tensor([2, 0], dtype=torch.int32)
    for split in (1, 3):
        out = torch.empty(2 * 2 * split, dtype=torch.int32)
        _stream_kernel[(2, 2, split)](w, ids, out, ROWS_TOTAL=96, KW=100, BLOCK_R=64, BLOCK_C=64, SPLIT=split)
        got = [functools.reduce(operator.xor, r) for r in out.view(4, split).tolist()]
        ref = [functools.reduce(operator.xor, w[int(ids[s]), t * 64:(t + 1) * 64].flatten().tolist())
               for s in range(2) for t in range(2)]
        assert got == ref, split
