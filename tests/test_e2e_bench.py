"""CPU checks of benchmarks/e2e.py: the dry run (plan, LLM kwargs checked against the installed
vLLM, JSON), the bytes-per-token model, the report/merge path on synthetic numbers, and its
errors for bad input. Uses only the repo's models/ configs (the 120b shape is built inline)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "e2e.py"


def _load():
    spec = importlib.util.spec_from_file_location("e2e_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["e2e_bench"] = mod  # dataclasses resolve string annotations through it
    spec.loader.exec_module(mod)
    return mod


e2e = _load()


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
        check=False,
    )


def gpt_oss_120b() -> dict:
    """The gpt-oss-120b config.json fields the bytes model reads."""
    return {
        "model_type": "gpt_oss",
        "num_hidden_layers": 36,
        "hidden_size": 2880,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "intermediate_size": 2880,
        "vocab_size": 201088,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
        "max_position_embeddings": 131072,
    }


# ---------------------------------------------------------------------------------------------
# bytes per decoded token
# ---------------------------------------------------------------------------------------------


def test_bytes_120b_batch1_is_5gb():
    b = e2e.decode_bytes(gpt_oss_120b(), batch=1, ctx=80)
    assert b["per_token"] == pytest.approx(5.0e9, rel=0.10)
    # the design notes' split: 1.9 GB attention projections (+ router), 1.9 GB experts, 1.2 GB lm_head
    assert b["attention_proj"] + b["router"] == pytest.approx(1.94e9, rel=0.03)
    assert b["experts"] == pytest.approx(1.90e9, rel=0.03)
    assert b["lm_head"] == pytest.approx(1.16e9, rel=0.03)
    assert b["distinct_experts_per_layer"] == pytest.approx(4.0)
    assert b["kv"] < 0.01e9
    # GB10: 273 GB/s over ~5.0 GB -> the 54.6 tok/s ceiling of design.md
    assert 273e9 / b["per_token"] == pytest.approx(54.6, rel=0.02)


def test_bytes_kv_scales_with_context_and_dtype():
    cfg = gpt_oss_120b()
    kv = {
        d: e2e.decode_bytes(cfg, ctx=32768, kv=d)["kv"]
        for d in ("bf16", "fp8", "nvfp4")
    }
    # 18 full layers read 32768 tokens, 18 sliding ones 128; K and V, 8 heads x 64, 2 bytes
    assert kv["bf16"] == (18 * 32768 + 18 * 128) * 2 * 8 * 64 * 2
    assert kv["fp8"] == kv["bf16"] / 2
    assert kv["nvfp4"] == pytest.approx(kv["bf16"] * 0.5625 / 2)
    tok = {d: e2e.decode_bytes(cfg, ctx=32768, kv=d)["per_token"] for d in kv}
    assert tok["nvfp4"] < tok["fp8"] < tok["bf16"]
    # the full layers' KV grows linearly; sliding layers stop at the window
    k1 = e2e.decode_bytes(cfg, ctx=4096)["kv"]
    k2 = e2e.decode_bytes(cfg, ctx=8192)["kv"]
    assert k2 - k1 == 18 * 4096 * 2 * 8 * 64 * 2
    small = e2e.decode_bytes(cfg, ctx=100)["kv"]
    assert small == 36 * 100 * 2 * 8 * 64 * 2
    # weights do not depend on the KV format or context
    assert (
        e2e.decode_bytes(cfg, ctx=32768, kv="nvfp4")["weights"]
        == e2e.decode_bytes(cfg)["weights"]
    )


def test_bytes_batch_distinct_experts():
    cfg = gpt_oss_120b()
    b1, b8, b32 = (e2e.decode_bytes(cfg, batch=b, ctx=80) for b in (1, 8, 32))
    assert b8["distinct_experts_per_layer"] == pytest.approx(
        128 * (1 - (1 - 4 / 128) ** 8)
    )
    assert (
        4
        < b8["distinct_experts_per_layer"]
        < 32
        < b32["distinct_experts_per_layer"]
        < 128
    )
    assert b1["per_step"] < b8["per_step"] < b32["per_step"]
    assert b1["per_token"] > b8["per_token"] > b32["per_token"]
    assert b8["kv"] == pytest.approx(8 * b1["kv"])
    # a few experts: B=32 touches nearly all of them
    tiny = json.loads((REPO / "models" / "gpt-oss-tiny" / "config.json").read_text())
    assert e2e.decode_bytes(tiny, batch=32)[
        "distinct_experts_per_layer"
    ] == pytest.approx(8, abs=0.01)


def test_bytes_formats_and_bad_values():
    cfg = gpt_oss_120b()
    fp8w = e2e.decode_bytes(cfg, dense="fp8")
    bf16w = e2e.decode_bytes(cfg)
    # 1 byte per parameter + one fp32 scale per output channel (vocab rows)
    assert fp8w["lm_head"] == bf16w["lm_head"] / 2 + cfg["vocab_size"] * 4
    assert fp8w["router"] == bf16w["router"]  # the router stays bf16
    assert e2e.kv_kind(None) == e2e.kv_kind("auto") == "bf16"
    assert e2e.kv_kind("fp8_e4m3") == "fp8"
    assert e2e.kv_kind("nvfp4") == "nvfp4"
    with pytest.raises(ValueError, match="bf16, fp8, nvfp4"):
        e2e.decode_bytes(cfg, kv="int3")
    with pytest.raises(ValueError, match="not a gpt-oss config"):
        e2e.model_shape({"hidden_size": 8})


def test_bytes_120b_fp8_dense_meets_issue_8_target():
    """Issue 8: fp8 qkv / o / lm_head take gpt-oss-120b at batch 1 from ~5.0 to <= 3.6 GB/token."""
    cfg = gpt_oss_120b()
    fp8w = e2e.decode_bytes(cfg, batch=1, ctx=80, dense="fp8")
    assert fp8w["per_token"] <= 3.6e9
    assert e2e.decode_bytes(cfg, batch=1, ctx=80, dense="mxfp4")["per_token"] < fp8w["per_token"]


def test_model_key_and_shipped_20b():
    assert e2e.model_key(gpt_oss_120b()) == "gpt-oss-120b"
    cfg20 = json.loads((REPO / "models" / "gpt-oss-20b" / "config.json").read_text())
    assert e2e.model_key(cfg20) == "gpt-oss-20b"
    b = e2e.decode_bytes(cfg20, batch=1, ctx=80)
    assert 3.5e9 < b["per_token"] < 3.9e9


# ---------------------------------------------------------------------------------------------
# plan / kwargs
# ---------------------------------------------------------------------------------------------


def test_deep_merge_and_quick_override():
    base = {
        "a": 1,
        "compilation_config": {"max_cudagraph_capture_size": 8},
        "b": {"x": 1},
    }
    out = e2e.deep_merge(base, {"compilation_config": None, "b": {"y": 2}, "c": 3})
    assert out == {"a": 1, "b": {"x": 1, "y": 2}, "c": 3}
    assert base["b"] == {"x": 1}  # not mutated


def test_small_max_model_len_skips_the_32k_point():
    args = e2e.parse_args(["--dry-run", "--llm-kwargs", '{"max_model_len": 4096}'])
    run = args.plans[0].runs[0]
    assert run["llm_kwargs"]["max_model_len"] == 4096
    assert set(run["skipped"]) == {"tg128@32k"}
    assert "max_model_len" in run["skipped"]["tg128@32k"]
    args = e2e.parse_args(["--dry-run"])
    assert args.plans[0].runs[0]["skipped"] == {}
    assert args.plans[0].runs[0]["llm_kwargs"]["max_model_len"] >= 32768 + 128


def test_configs_table():
    names = e2e.CONFIG_NAMES
    for n in (
        "upstream-default",
        "upstream-triton",
        "sm121",
        "sm121-fp8kv",
        "sm121-nvfp4kv",
    ):
        assert n in e2e.DEFAULT_CONFIGS
    assert len(set(names)) == len(names)
    by = {c.name: c for c in e2e.CONFIGS}
    assert "attention_backend" not in by["upstream-default"].llm_kwargs
    assert by["upstream-triton"].llm_kwargs == {"attention_backend": "TRITON_ATTN"}
    assert by["sm121-nvfp4kv"].llm_kwargs == {
        "attention_backend": "SM121",
        "kv_cache_dtype": "nvfp4",
    }
    # the gated MoE is measured through its environment opt-in, off the default list
    moe_on = ("sm121-moe", "sm121-fp8dense-moe", "sm121-all-moe")
    for name in moe_on:
        assert dict(by[name].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1"}
        assert name not in e2e.DEFAULT_CONFIGS
    assert dict(by["sm121-fp8dense-w8a8"].env) == {"VLLM_SM121_DENSE_W8A8_MIN_M": "5"}
    assert "sm121-fp8dense-w8a8" not in e2e.DEFAULT_CONFIGS
    assert dict(by["sm121-all-moe-pdl"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_MOE_PDL": "1"}
    assert dict(by["sm121-all-moe-tma"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1",
                                                 "VLLM_SM121_MOE_FMA_TILES": "64,256,32,256,4,4"}
    assert "sm121-all-moe-tma" not in e2e.DEFAULT_CONFIGS
    assert dict(by["sm121-all-moe-fused"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_MOE_FUSED_ROUTE": "1",
                                                   "VLLM_SM121_MOE_FUSED_COMBINE": "1"}
    assert dict(by["sm121-all-moe-f16x2"].env) == {**dict(by["sm121-all-moe-fused"].env), "VLLM_SM121_MOE_FMA_F16X2": "1"}
    assert "sm121-all-moe-f16x2" not in e2e.DEFAULT_CONFIGS
    assert by["sm121-all-moe-f16x2"].llm_kwargs == by["sm121-all-moe"].llm_kwargs  # only the environment differs
    assert dict(by["sm121-all-moe-exact"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_MOE_FMA_F16X2": "0",
                                                   "VLLM_SM121_ROUTER_IN_NORM": "0"}
    assert by["sm121-all-moe-exact"].llm_kwargs == by["sm121-all-moe"].llm_kwargs
    assert "sm121-all-moe-exact" not in e2e.DEFAULT_CONFIGS
    assert dict(by["sm121-all-moe-rope"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_ROPE_IN_QKV": "1"}
    assert by["sm121-all-moe-rope"].llm_kwargs == by["sm121-all-moe"].llm_kwargs
    assert "sm121-all-moe-rope" not in e2e.DEFAULT_CONFIGS
    assert dict(by["sm121-all-moe-stop26"].env) == {
        "VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_ROPE_IN_QKV": "0", "VLLM_SM121_MOE_FUSED_ROUTE": "0",
        "VLLM_SM121_MOE_FUSED_COMBINE": "0", "VLLM_SM121_ATTN_FUSED_COMBINE": "0"}
    assert by["sm121-all-moe-stop26"].llm_kwargs == by["sm121-all-moe"].llm_kwargs
    assert dict(by["sm121-all-moe-kvqkv"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_KV_IN_QKV": "1"}
    assert by["sm121-all-moe-kvqkv"].llm_kwargs == by["sm121-all-moe"].llm_kwargs
    assert dict(by["sm121-all-moe-kvattn"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_KV_IN_ATTN": "1"}
    assert by["sm121-all-moe-kvattn"].llm_kwargs == by["sm121-all-moe"].llm_kwargs
    assert dict(by["sm121-all-moe-minsplit"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1",
                                                      "VLLM_SM121_ATTN_MIN_SPLIT_TOKENS": "128"}
    assert by["sm121-all-moe-minsplit"].llm_kwargs == by["sm121-all-moe"].llm_kwargs
    assert "sm121-all-moe-minsplit" not in e2e.DEFAULT_CONFIGS
    assert dict(by["sm121-all-moe-l2o"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_L2_PREFETCH": "o"}
    if "E2E_L2_PREFETCH" not in os.environ:
        assert dict(by["sm121-all-moe-l2"].env)["VLLM_SM121_L2_PREFETCH"] == "o,qkv_late,w2_late"
    assert by["sm121-all-moe-l2"].llm_kwargs == by["sm121-all-moe-l2o"].llm_kwargs == by["sm121-all-moe"].llm_kwargs
    dense_env = ("sm121-fp8dense-w8a8", "sm121-graph-a", "sm121-graph-sample", "sm121-all-moe-pdl", "sm121-all-moe-tma",
                 "sm121-all-moe-fused", "sm121-all-moe-f16x2", "sm121-all-moe-exact", "sm121-all-moe-rope",
                 "sm121-all-moe-stop26", "sm121-all-moe-kvqkv", "sm121-all-moe-kvattn", "sm121-all-moe-minsplit",
                 "sm121-all-moe-l2o",
                 "sm121-all-moe-l2", "sm121-all-moe-mmav", "sm121-all-moe-steppdl", "sm121-all-moe-merge1",
                 "sm121-all-moe-pdlkv", "sm121-all-moe-f16group", "sm121-all-moe-scaleldg", "sm121-all-moe-optins",
                 "sm121-all-moe-tile32", "sm121-all-moe-tile64", "sm121-all-moe-scalebytes", "sm121-all-moe-normqkv",
                 "sm121-all-moe-normf16", "sm121-all-moe-nonorm", "sm121-all-moe-f16word",
                 "sm121-all-moe-bf16reduce", "sm121-all-moe-nowindow", "sm121-all-moe-nommav",
                 "sm121-all-moe-w8a8pf", "sm121-all-moe-window16", "sm121-all-moe-bytes", "sm121-all-moe-window32")
    # stop 42: the window's old default (32) for A/B runs against the new one (16)
    assert dict(by["sm121-all-moe-window32"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1",
                                                      "VLLM_SM121_MOE_FMA_WINDOW_MAX_TOKENS": "32"}
    # stop 41: the grouped GEMMs' halves decoder and a shorter FMA window, each against the default
    assert dict(by["sm121-all-moe-window16"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1",
                                                      "VLLM_SM121_MOE_FMA_WINDOW_MAX_TOKENS": "16"}
    assert dict(by["sm121-all-moe-bytes"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1",
                                                   "VLLM_SM121_MOE_GROUPED_HALVES": "0"}
    # stop 39: the windowed FMA MoE's A/B (grouped GEMMs from M = 5 again)
    assert dict(by["sm121-all-moe-nowindow"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1",
                                                      "VLLM_SM121_MOE_FMA_WINDOW_MAX_TOKENS": "0"}
    # stop 35: the TP fp32 reduces' A/B
    assert dict(by["sm121-all-moe-bf16reduce"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1",
                                                        "VLLM_SM121_TP_FP32_REDUCE": "0"}
    # stop 34: f16group the default; mode 1 for the A/B
    assert dict(by["sm121-all-moe-f16word"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_MOE_FMA_F16X2": "1"}
    # stop 33: the carried input norm, alone and with f16group
    assert dict(by["sm121-all-moe-normqkv"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_NORM_IN_QKV": "1"}
    assert dict(by["sm121-all-moe-normf16"].env) == {**dict(by["sm121-all-moe-normqkv"].env),
                                                     "VLLM_SM121_MOE_FMA_F16X2": "2"}
    assert dict(by["sm121-all-moe-nonorm"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_NORM_IN_QKV": "0"}
    # stop 32: every timed opt-in together, smaller nvfp4 decode tiles, the byte scale loads again
    assert dict(by["sm121-all-moe-optins"].env) == {**dict(by["sm121-all-moe-scaleldg"].env),
                                                    **dict(by["sm121-all-moe-pdlkv"].env)}
    assert dict(by["sm121-all-moe-tile32"].env)["VLLM_SM121_ATTN_TILE"] == "decode_nvfp4=16,32,4,2"
    assert dict(by["sm121-all-moe-tile64"].env)["VLLM_SM121_ATTN_TILE"] == "decode_nvfp4=16,64,4,3"
    assert dict(by["sm121-all-moe-scalebytes"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1",
                                                        "VLLM_SM121_ATTN_SCALE_WORDS": "0"}
    for name in ("sm121-all-moe-optins", "sm121-all-moe-tile32", "sm121-all-moe-tile64", "sm121-all-moe-scalebytes"):
        assert by[name].llm_kwargs == by["sm121-all-moe"].llm_kwargs and name not in e2e.DEFAULT_CONFIGS
    assert dict(by["sm121-all-moe-f16group"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_MOE_FMA_F16X2": "2"}
    assert dict(by["sm121-all-moe-scaleldg"].env) == {**dict(by["sm121-all-moe-f16group"].env),
                                                      "VLLM_SM121_MOE_SCALE_LDG": "1"}
    assert by["sm121-all-moe-f16group"].llm_kwargs == by["sm121-all-moe-scaleldg"].llm_kwargs == \
        by["sm121-all-moe"].llm_kwargs
    assert dict(by["sm121-all-moe-merge1"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1",
                                                    "VLLM_SM121_ATTN_ONE_SPLIT_FINISH": "0"}
    assert dict(by["sm121-all-moe-pdlkv"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_PDL": "1",
                                                   "VLLM_SM121_KV_IN_QKV": "1"}
    assert by["sm121-all-moe-merge1"].llm_kwargs == by["sm121-all-moe-pdlkv"].llm_kwargs == by["sm121-all-moe"].llm_kwargs
    assert dict(by["sm121-all-moe-steppdl"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_PDL": "1"}
    assert by["sm121-all-moe-steppdl"].llm_kwargs == by["sm121-all-moe"].llm_kwargs
    assert "sm121-all-moe-steppdl" not in e2e.DEFAULT_CONFIGS
    if "E2E_MMAV_MAX_M" not in os.environ:
        assert dict(by["sm121-all-moe-mmav"].env)["VLLM_SM121_DENSE_MMAV_MAX_M"] == "16"
    assert dict(by["sm121-all-moe-mmav"].env)["VLLM_SM121_DENSE_FMA_MAX_M"] == "0"
    assert dict(by["sm121-all-moe-nommav"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_DENSE_MMAV_MAX_M": "0"}
    assert dict(by["sm121-all-moe-w8a8pf"].env) == {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_DENSE_W8A8_MIN_M": "64"}
    assert dict(by["sm121-graph-a"].env) == {"VLLM_SM121_GRAPH_FAST_PATH": "0"}
    assert dict(by["sm121-graph-sample"].env) == {"VLLM_SM121_GRAPH_SAMPLE": "1"}
    assert "sm121-graph-sample" not in e2e.DEFAULT_CONFIGS
    assert all(c.env == () for c in e2e.CONFIGS if c.name not in moe_on + dense_env)


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------


def test_dry_run_20b_writes_json(tmp_path):
    out = tmp_path / "e2e.json"
    r = _run("--dry-run", "--model", "models/gpt-oss-20b", "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bytes read per decode step" in r.stdout
    assert "LLM kwargs checked against the installed vLLM: ok" in r.stdout
    res = json.loads(out.read_text())
    h = res["header"]
    assert h["dry_run"] is True and h["mode"] == "full"
    for k in (
        "torch",
        "triton",
        "vllm",
        "vllm_sm121",
        "git_commit",
        "device",
        "capability",
        "timestamp",
    ):
        assert k in h
    assert h["vllm"] == "0.26.0"
    assert res["vllm_check"]["problems"] == []
    (m,) = res["models"]
    assert m["name"] == "gpt-oss-20b" and m["key"] == "gpt-oss-20b"
    assert [r["config"] for r in m["runs"]] == list(e2e.DEFAULT_CONFIGS)
    for run in m["runs"]:
        kw = run["plan"]["llm_kwargs"]
        assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True
        assert kw["enable_prefix_caching"] is False
        assert Path(kw["model"]) == REPO / "models" / "gpt-oss-20b"
        assert "compilation_config" not in kw  # full mode: vLLM's defaults
        assert [p["name"] for p in run["plan"]["points"]] == list(e2e.FULL_POINTS)
        assert run["plan"]["skipped"] == {}
    kws = {r["config"]: r["plan"]["llm_kwargs"] for r in m["runs"]}
    assert "attention_backend" not in kws["upstream-default"]
    assert kws["upstream-triton"]["attention_backend"] == "TRITON_ATTN"
    assert kws["sm121-fp8kv"]["kv_cache_dtype"] == "fp8"
    assert kws["sm121-nvfp4kv"]["kv_cache_dtype"] == "nvfp4"
    rows = {(r["point"], r["kv_dtype"]): r for r in m["bytes_table"] if r["dense_weights"] == "bf16"}
    fp8dense = [r for r in m["bytes_table"] if r["dense_weights"] == "fp8"]
    assert fp8dense and all(r["per_token"] < rows[(r["point"], r["kv_dtype"])]["per_token"] for r in fp8dense)
    assert (
        rows[("tg128@32k", "nvfp4")]["per_token"]
        < rows[("tg128@32k", "fp8")]["per_token"]
    )
    assert (
        rows[("tg128@32k", "fp8")]["per_token"]
        < rows[("tg128@32k", "bf16")]["per_token"]
    )
    assert rows[("tg128", "bf16")]["per_token"] == pytest.approx(3.71e9, rel=0.02)


def test_quick_dry_run_plan(tmp_path):
    out = tmp_path / "q.json"
    r = _run(
        "--dry-run",
        "--quick",
        "--no-vllm-check",
        "--configs",
        "sm121,upstream-triton",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["header"]["mode"] == "quick" and res["header"]["iters"] == 3 and res["header"]["warmup"] == 1
    (m,) = res["models"]
    assert m["name"] == "gpt-oss-20b"
    assert [run["config"] for run in m["runs"]] == ["sm121", "upstream-triton"]
    for run in m["runs"]:
        kw = run["plan"]["llm_kwargs"]
        assert kw["compilation_config"] == {"max_cudagraph_capture_size": 8}
        assert [p["name"] for p in run["plan"]["points"]] == list(e2e.QUICK_POINTS)


@pytest.mark.parametrize(
    ("args", "option", "valid"),
    [
        (["--configs", "sm121,bogus"], "--configs", "CONFIG_NAMES"),
        (["--points", "tg999"], "--points", "POINT_NAMES"),
        (["--model", "/nonexistent/gpt-oss-7b"], "--model", "SHIPPED_MODELS"),
        (["--llm-kwargs", "{not json"], "--llm-kwargs", None),
    ],
)
def test_bad_input_is_a_clear_error(args, option, valid):
    r = _run("--dry-run", "--no-vllm-check", *args, timeout=60)
    assert r.returncode != 0
    assert option in r.stderr
    for name in getattr(e2e, valid) if valid else ():
        assert name in r.stderr
    assert "Traceback" not in r.stderr


def test_report_and_merge_on_synthetic_numbers(tmp_path):
    """The table / derived columns / merge path, with made-up timings (no GPU)."""
    dry = tmp_path / "dry.json"
    r = _run(
        "--dry-run",
        "--no-vllm-check",
        "--model",
        "gpt-oss-tiny",
        "--configs",
        "upstream-triton,sm121",
        "--points",
        "pp2048,tg128,tg128-b8",
        "--out",
        str(dry),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(dry.read_text())
    res["header"].update(copy_bandwidth_gbps=4000.0, device="FakeGPU", capability="9.0")
    for i, run in enumerate(res["models"][0]["runs"]):
        step = 0.002 * (1 - 0.1 * i)  # sm121 10% faster
        run["points"] = {
            "pp2048": {
                "status": "ok",
                "tok_s": 20000.0,
                "tok_s_min": 19000.0,
                "tok_s_max": 21000.0,
                "ms_per_step": None,
                "t_s": [0.1],
            },
            "tg128": {
                "status": "ok",
                "tok_s": 1 / step,
                "tok_s_min": 0.9 / step,
                "tok_s_max": 1.1 / step,
                "ms_per_step": step * 1e3,
                "ms_per_step_min": step * 900,
                "ms_per_step_max": step * 1100,
            },
            "tg128-b8": {"status": "error", "error": "RuntimeError: boom"},
        }
    a = tmp_path / "a.json"
    a.write_text(json.dumps(res))
    merged = tmp_path / "merged.json"
    r = _run("--merge", str(a), "--out", str(merged))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FakeGPU" in r.stdout and "ERROR: RuntimeError: boom" in r.stdout
    assert "1.11x" in r.stdout  # sm121 vs the best upstream configuration at tg128
    out = json.loads(merged.read_text())
    tg = out["models"][0]["runs"][1]["points"]["tg128"]
    b = tg["bytes"]["per_step"]
    assert tg["achieved_gbps"] == pytest.approx(b / 0.0018 / 1e9)
    assert tg["pct_copy_bw"] == pytest.approx(100 * tg["achieved_gbps"] / 4000.0)
    assert tg["gb10_projection_tok_s"] == pytest.approx(
        273e9 * tg["pct_copy_bw"] / 100 / tg["bytes"]["per_token"]
    )
    assert out["models"][0]["runs"][1]["points"]["pp2048"]["pct_copy_bw"] is None
    assert "plot" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_gpu_says_so(tmp_path):
    r = _run(
        "--model",
        "gpt-oss-tiny",
        "--configs",
        "sm121",
        "--out",
        str(tmp_path / "x.json"),
        timeout=120,
    )
    assert r.returncode == 2
    assert "needs a CUDA GPU" in r.stderr and "--dry-run" in r.stderr


def test_kv_capacity_line_is_parsed():
    """The suite records vLLM's startup KV capacity per configuration (bf16 vs fp8 vs nvfp4)."""
    mod = _load()
    line = "(EngineCore pid=1) INFO 11-26 08:30:03 [kv_cache_utils.py:1234] GPU KV cache size: 1,234,567 tokens"
    assert mod.kv_capacity_tokens(line) == 1234567
    assert mod.kv_capacity_tokens("Maximum concurrency for 4,096 tokens per request: 3.2x") is None


def test_tg_estimate_ignores_host_stalls():
    """A 1.4 s stall inside one t(1) made that iteration's difference negative on H100; the
    min-based estimate recovers the true step time, flags the point and keeps the raw timings."""
    step, n, batch = 0.0047, 128, 8
    t1 = [1.41, 0.104, 0.106]
    tn = [0.104 + (n - 1) * step, 0.104 + (n - 1) * step + 0.002, 2.47]
    rec = e2e.tg_estimate(t1, tn, n, batch)
    assert rec["ms_per_step"] == pytest.approx(step * 1e3, rel=1e-6)
    assert rec["tok_s"] == pytest.approx(batch / step, rel=1e-6)
    assert "suspect" in rec and rec["t_1_s"] == t1 and rec["ms_per_step_min"] < 0
    clean = e2e.tg_estimate([0.1, 0.1], [0.1 + (n - 1) * step] * 2, n, 1)
    assert "suspect" not in clean and clean["ms_per_step"] == pytest.approx(step * 1e3)
    assert e2e.tg_estimate([1.0], [0.5], n, 1)["tok_s"] is None


def test_greedy_agreement_tolerates_near_tie_flips_only():
    """The nvfp4 prefix-cache GPU test's comparison: positions up to each sequence's first flip,
    and a flip must be a near-tie in both passes."""
    import types

    from helpers import greedy_agreement

    lp = lambda **d: {int(k[1:]): types.SimpleNamespace(logprob=v) for k, v in d.items()}  # noqa: E731
    same = [[(5, lp(t5=-0.1, t7=-2.0)), (7, lp(t7=-0.2))]]
    d, bad = greedy_agreement(same, same)
    assert d.tolist() == [0.0, 0.0] and bad == []
    tie0 = [[(5, lp(t5=-0.69, t7=-0.70)), (1, lp(t1=-0.1))]]
    tie1 = [[(7, lp(t7=-0.69, t5=-0.70)), (2, lp(t2=-0.1))]]
    d, bad = greedy_agreement(tie0, tie1)
    assert d.numel() == 1 and bad == []  # compared up to the flip only
    far1 = [[(7, lp(t7=-0.1, t5=-3.0)), (2, lp(t2=-0.1))]]
    _, bad = greedy_agreement(tie0, far1)
    assert bad and bad[0][:2] == (0, 0)
    # tie=None: a flip's margins are judged against the two passes' noise where they agree
    noisy0 = [[(5, lp(t5=-1.0)), (5, lp(t5=-0.5, t7=-0.58)), (1, lp(t1=-0.1))]]
    noisy1 = [[(5, lp(t5=-1.1)), (7, lp(t7=-0.5, t5=-0.55)), (2, lp(t2=-0.1))]]  # agree with |delta| 0.1, then flip
    assert greedy_agreement(noisy0, noisy1)[1]  # margins 0.08 + 0.05 > twice the fixed 0.05
    d, bad = greedy_agreement(noisy0, noisy1, tie=None)
    assert bad == [] and d.numel() == 2  # 0.08 + 0.05 are within twice that run's 0.1
    quiet1 = [[(5, lp(t5=-1.0)), (7, lp(t7=-0.5, t5=-0.55)), (2, lp(t2=-0.1))]]  # no noise: the 0.05 floor
    assert greedy_agreement(noisy0, quiet1, tie=None)[1]
    # the H200 run of stop 39: agreeing positions up to 0.0624, a flip of margins 0.0625 / 0.03125
    # (one margin a hair above the noise, their sum well inside twice it): explained by that noise
    h0 = [[(5, lp(t5=-1.0)), (5, lp(t5=-0.5, t7=-0.5625)), (1, lp(t1=-0.1))]]
    h1 = [[(5, lp(t5=-1.0624)), (7, lp(t7=-0.5, t5=-0.53125)), (2, lp(t2=-0.1))]]
    assert greedy_agreement(h0, h1, tie=None)[1] == []
    lopsided1 = [[(5, lp(t5=-1.0624)), (7, lp(t7=-0.5, t5=-0.6)), (2, lp(t2=-0.1))]]  # 0.0625 + 0.1 > 0.1248
    assert greedy_agreement(h0, lopsided1, tie=None)[1]


def test_dry_run_plan_carries_the_config_environment(tmp_path):
    out = tmp_path / "e2e.json"
    r = _run("--dry-run", "--no-vllm-check", "--model", "models/gpt-oss-tiny", "--configs", "sm121,sm121-moe",
             "--points", "tg128", "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (m,) = json.loads(out.read_text())["models"]
    envs = {run["config"]: run["plan"]["env"] for run in m["runs"]}
    spawn = {} if "VLLM_WORKER_MULTIPROC_METHOD" in os.environ else {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    nocache = {} if "VLLM_DISABLE_COMPILE_CACHE" in os.environ else {"VLLM_DISABLE_COMPILE_CACHE": "1"}
    assert envs == {"sm121": spawn, "sm121-moe": {"VLLM_SM121_MOE_EXPERIMENTAL": "1", **spawn, **nocache}}


def test_child_env_isolates_the_moe_opt_in():
    base = {"PATH": "/bin", "VLLM_SM121_MOE_EXPERIMENTAL": "1", "VLLM_SM121_DENSE_FMA_MAX_M": "2"}
    env = e2e.child_env(base, {})
    assert "VLLM_SM121_MOE_EXPERIMENTAL" not in env  # only a config's own env turns the MoE on
    assert env["PATH"] == "/bin" and env["VLLM_SM121_DENSE_FMA_MAX_M"] == "2" and env["PYTHONUNBUFFERED"] == "1"
    on = e2e.child_env(base, {"VLLM_SM121_MOE_EXPERIMENTAL": "1", "PYTHONUNBUFFERED": "0"})
    assert on["VLLM_SM121_MOE_EXPERIMENTAL"] == "1" and on["PYTHONUNBUFFERED"] == "0"


def test_run_tg_pairs_adds_iterations_until_two_agree():
    """A stall in the first pairs costs extra pairs instead of a flagged point; clean runs stop at
    --iters; a run that never confirms stops at the extra budget, flagged."""
    step, n, batch = 0.004, 128, 8
    clean = (0.1, 0.1 + (n - 1) * step)

    def pairs(seq):
        it = iter(seq)
        return lambda: next(it)

    stalled = [(1.5, clean[1]), (clean[0], clean[1] + 2.0), clean, (clean[0], clean[1] + 1.0), clean, clean]
    rec = e2e.run_tg_pairs(pairs(stalled), 3, 4, n, batch, lambda msg: None)
    assert rec["extra_iters"] == 2 and len(rec["t_1_s"]) == 5  # the 5th pair is the 2nd clean one
    assert "suspect" not in rec and rec["agreeing_iters"] == 2
    assert rec["ms_per_step"] == pytest.approx(step * 1e3)
    rec = e2e.run_tg_pairs(pairs([clean] * 9), 3, 4, n, batch, lambda msg: None)
    assert rec["extra_iters"] == 0 and "suspect" not in rec
    never = [(clean[0] + 0.01 * i, clean[1] + 0.5 * i) for i in range(1, 9)]
    rec = e2e.run_tg_pairs(pairs(never), 3, 2, n, batch, lambda msg: None)
    assert rec["extra_iters"] == 2 and "suspect" in rec


# ---------------------------------------------------------------------------------------------
# tensor / expert parallelism
# ---------------------------------------------------------------------------------------------


def _tp_args(*extra: str):
    return e2e.parse_args(["--dry-run", "--no-vllm-check", "--model", "gpt-oss-tiny", "--configs",
                           "upstream-default,upstream-triton,sm121-nvfp4kv,sm121-fp8dense", *extra])


def test_parallel_flags_defaults_add_nothing():
    """TP=1: the kwargs stay what they were (vLLM's defaults); the environment only gains the
    spawn method every engine child gets (``engine_env``)."""
    args = _tp_args()
    assert args.tensor_parallel_size == 1 and args.enable_expert_parallel is False
    for run in args.plans[0].runs:
        assert "tensor_parallel_size" not in run["llm_kwargs"]
        assert "enable_expert_parallel" not in run["llm_kwargs"]
        assert run["env"].get(e2e.SPAWN_ENV, "spawn") == "spawn"


def test_parallel_flags_reach_every_configuration(monkeypatch):
    monkeypatch.delenv(e2e.SPAWN_ENV, raising=False)
    args = _tp_args("--tensor-parallel-size", "2", "--enable-expert-parallel",
                    "--llm-kwargs", '{"gpu_memory_utilization": 0.8, "additional_config": {"x": 1}}')
    runs = {r["config"]: r for r in args.plans[0].runs}
    assert len(runs) == 4
    for run in runs.values():  # upstream and plugin alike
        kw = run["llm_kwargs"]
        assert kw["tensor_parallel_size"] == 2 and kw["enable_expert_parallel"] is True
        assert kw["gpu_memory_utilization"] == 0.8  # --llm-kwargs still merged over it
        assert run["env"][e2e.SPAWN_ENV] == "spawn"
    # the deep merge keeps a configuration's own nested kwargs
    assert runs["sm121-fp8dense"]["llm_kwargs"]["additional_config"] == {"sm121": {"dense_weights": "fp8"}, "x": 1}
    assert runs["sm121-nvfp4kv"]["llm_kwargs"]["kv_cache_dtype"] == "nvfp4"
    # --llm-kwargs still has the last word (null deletes)
    args = _tp_args("--tensor-parallel-size", "2", "--llm-kwargs", '{"tensor_parallel_size": 4}')
    assert {r["llm_kwargs"]["tensor_parallel_size"] for r in args.plans[0].runs} == {4}
    assert all("enable_expert_parallel" not in r["llm_kwargs"] for r in args.plans[0].runs)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
        (["--tensor-parallel-size", "-2"], "--tensor-parallel-size must be >= 1"),
        (["--enable-expert-parallel"], "--enable-expert-parallel needs --tensor-parallel-size"),
        (["--enable-expert-parallel", "--tensor-parallel-size", "1"], "--enable-expert-parallel needs"),
    ],
)
def test_bad_parallel_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        e2e.parse_args(["--dry-run", "--no-vllm-check", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_engine_env_spawns_engine_processes():
    tp2 = {"tensor_parallel_size": 2}
    assert e2e.engine_env({}, {}, {}) == {e2e.SPAWN_ENV: "spawn"}  # TP = 1 too: the child initialized CUDA
    assert e2e.engine_env({"A": "1"}, tp2, {}) == {"A": "1", e2e.SPAWN_ENV: "spawn"}
    # plugin switches: no compile cache (its key does not hash VLLM_SM121_*), unless the caller decides
    assert e2e.engine_env({"VLLM_SM121_X": "1"}, {}, {}) == {"VLLM_SM121_X": "1", e2e.SPAWN_ENV: "spawn",
                                                             e2e.NO_COMPILE_CACHE_ENV: "1"}
    assert e2e.NO_COMPILE_CACHE_ENV not in e2e.engine_env({"VLLM_SM121_X": "1"}, {}, {e2e.NO_COMPILE_CACHE_ENV: "0"})
    # the caller's own choice stands (child_env passes it through)
    assert e2e.engine_env({}, tp2, {e2e.SPAWN_ENV: "fork"}) == {}
    assert e2e.child_env({e2e.SPAWN_ENV: "fork"}, e2e.engine_env({}, tp2, {e2e.SPAWN_ENV: "fork"}))[
        e2e.SPAWN_ENV] == "fork"


def test_child_refuses_tp_beyond_the_gpus(monkeypatch, tmp_path):
    """The check runs where torch.cuda is available (faked here), before vLLM is imported."""
    assert e2e.tp_gpu_problem(2, 2) is None and e2e.tp_gpu_problem(1, 1) is None
    msg = e2e.tp_gpu_problem(4, 2)
    assert "--tensor-parallel-size 4" in msg and "has 2" in msg
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    res: dict = {}
    out = tmp_path / "res.json"
    llm = e2e.start_engine({"model": "x", "tensor_parallel_size": 2}, res, str(out), lambda msg: None)
    assert llm is None
    assert "--tensor-parallel-size 2 needs 2 GPUs, this machine has 1" in res["error"]
    assert json.loads(out.read_text())["error"] == res["error"]


def test_per_gpu_bytes_halve_at_tp2():
    cfg = gpt_oss_120b()
    pt = next(p for p in e2e.POINTS if p.name == "tg128-b32")
    b1 = e2e.point_bytes(cfg, pt, {})
    b2 = e2e.point_bytes(cfg, pt, {"tensor_parallel_size": 2, "enable_expert_parallel": True})
    assert "per_gpu_token" not in b1 and e2e.per_gpu(b1) == (b1["per_step"], b1["per_token"])
    assert b2["per_step"] == b1["per_step"]  # the model total is unchanged
    assert b2["per_gpu_step"] == b1["per_step"] / 2 and b2["per_gpu_token"] == b1["per_token"] / 2
    assert b2["tensor_parallel_size"] == 2
    # derive: per-GPU bandwidth against one GPU's copy bandwidth; the projection is for 2 GB10s
    point = dataclasses.asdict(pt)
    r1 = {"status": "ok", "ms_per_step": 5.0}
    r2 = dict(r1)
    e2e.derive(point, r1, cfg, {}, 3000.0)
    e2e.derive(point, r2, cfg, {"tensor_parallel_size": 2}, 3000.0)
    assert r2["achieved_gbps"] == pytest.approx(r1["achieved_gbps"] / 2)
    assert r2["achieved_gbps"] == pytest.approx(b1["per_step"] / 2 / 5e-3 / 1e9)
    assert r2["pct_copy_bw"] == pytest.approx(r1["pct_copy_bw"] / 2)
    assert r2["gb10_ceiling_tok_s"] == pytest.approx(2 * r1["gb10_ceiling_tok_s"])
    assert r2["gb10_projection_tok_s"] == pytest.approx(273e9 * r2["pct_copy_bw"] / 100 / (b1["per_token"] / 2))


def _synthetic_report(args) -> dict:
    """make_header + the plan with one made-up decode timing per run (no GPU)."""
    result = {"header": e2e.make_header(args, None), "models": [e2e._model_entry(m) for m in args.plans]}
    result["header"].update(copy_bandwidth_gbps=3000.0, device="FakeCard", capability="9.0")
    for run in result["models"][0]["runs"]:
        run["points"] = {"tg128": {"status": "ok", "tok_s": 400.0, "tok_s_min": 390.0, "tok_s_max": 410.0,
                                   "ms_per_step": 2.5, "ms_per_step_min": 2.4, "ms_per_step_max": 2.6}}
    e2e.derive_all(result)
    return result


def test_header_and_report_record_parallelism(capsys):
    args = _tp_args("--tensor-parallel-size", "2", "--enable-expert-parallel", "--points", "tg128")
    result = _synthetic_report(args)
    h = result["header"]
    assert h["tensor_parallel_size"] == 2 and h["enable_expert_parallel"] is True
    assert "per GPU" in h["method"]["per_gpu"]
    for run in result["models"][0]["runs"]:  # the exact flags recorded per configuration
        assert run["plan"]["llm_kwargs"]["tensor_parallel_size"] == 2
        assert run["plan"]["llm_kwargs"]["enable_expert_parallel"] is True
    capsys.readouterr()
    e2e.print_results(result)
    e2e.print_bytes_table(args.plans[0])
    out = capsys.readouterr().out
    assert "iters 3, TP=2, EP" in out
    assert "per GPU (TP=2: model total / 2)" in out and "2x GB10 tok/s" in out and "GB/GPU" in out
    assert "GB/tok/GPU" in out and "2x GB10 max tok/s" in out
    # TP=1: recorded as such, none of the per-GPU labels
    args = _tp_args("--points", "tg128")
    result = _synthetic_report(args)
    assert result["header"]["tensor_parallel_size"] == 1 and result["header"]["enable_expert_parallel"] is False
    assert "per_gpu" not in result["header"]["method"]
    e2e.print_results(result)
    e2e.print_bytes_table(args.plans[0])
    out = capsys.readouterr().out
    assert "TP=" not in out and "per GPU" not in out and "GPU " not in out and "/GPU" not in out and "2x" not in out


# engine-core timestamps (--engine-timestamps)


def test_engine_step_s_uses_the_engine_clock_and_refuses_missing_metrics():
    import types

    def out(first, last):
        return types.SimpleNamespace(metrics=types.SimpleNamespace(first_token_ts=first, last_token_ts=last))

    n = 128
    outs = [out(10.0, 10.0 + 0.004 * (n - 1)), out(10.0, 10.0 + 0.005 * (n - 1)), out(10.0, 10.0 + 0.0045 * (n - 1))]
    assert abs(e2e.engine_step_s(outs, n) - 0.0045) < 1e-12  # the median request
    assert e2e.engine_step_s(outs, 1) is None
    assert e2e.engine_step_s([types.SimpleNamespace(metrics=None)], n) is None  # stats off
    assert e2e.engine_step_s([out(0.0, 0.0)], n) is None


def test_engine_timestamps_flag_turns_stats_on_for_every_config(tmp_path):
    args = e2e.parse_args(["--model", "gpt-oss-tiny", "--engine-timestamps", "--configs", "upstream-default,sm121"])
    plans = e2e.build_plan(args)
    for run in plans[0].runs:
        assert run["llm_kwargs"]["disable_log_stats"] is False
    default = e2e.build_plan(e2e.parse_args(["--model", "gpt-oss-tiny", "--configs", "sm121"]))
    assert "disable_log_stats" not in default[0].runs[0]["llm_kwargs"]


def test_run_point_records_engine_clock_steps_next_to_the_wall_clock_estimate():
    """A fake LLM whose wall time carries a 1.5 s front-end stall in one t(N) while its engine-core
    timestamps show the true 4 ms step: the engine-clock estimate is recorded beside the default."""
    import types

    step, n, batch = 0.004, 128, 2
    calls = []

    class FakeLLM:
        def generate(self, prompts, sp, use_tqdm=False):
            calls.append(sp.max_tokens)
            metrics = types.SimpleNamespace(first_token_ts=5.0, last_token_ts=5.0 + step * (sp.max_tokens - 1))
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1] * sp.max_tokens)],
                                          metrics=metrics) for _ in prompts]

    pt = e2e.Point("tg128-b2", "tg", batch, 16, n)
    spec = {"seed": 0, "warmup": 0, "iters": 2, "extra_iters": 0}
    rec = e2e.run_point(FakeLLM(), pt, 1000, spec, lambda msg: None)
    assert calls == [1, n, 1, n]
    assert rec["engine_ms_per_step"] == pytest.approx([step * 1e3] * 2)
    assert rec["engine_ms_per_step_median"] == pytest.approx(step * 1e3)
    assert rec["engine_tok_s"] == pytest.approx(batch / step)


def test_points_over_the_kv_capacity_are_flagged_suspect():
    """A batch-x-length decode point the KV cache cannot hold preempts: flagged, never silent."""
    res = {"points": {"tg128-b16@32k": {"status": "ok", "tok_s": 1.0},
                      "tg128-b8@32k": {"status": "ok", "tok_s": 1.0, "suspect": "spread"},
                      "tg128@32k": {"status": "ok", "tok_s": 1.0},
                      "pp2048": {"status": "ok", "tok_s": 1.0}}}
    e2e.flag_over_capacity(res, 300_000)
    p = res["points"]
    assert "KV capacity 300,000" in p["tg128-b16@32k"]["suspect"] and "(vLLM preempts)" in p["tg128-b16@32k"]["suspect"]
    assert p["tg128-b8@32k"]["suspect"] == "spread"  # 8 x 32896 fits 300k
    assert "suspect" not in p["tg128@32k"] and "suspect" not in p["pp2048"]
    e2e.flag_over_capacity(res, 200_000)
    assert p["tg128-b8@32k"]["suspect"].startswith("spread; batch x length 263,168")


def test_cached_prompts_prime_decode_points_and_refresh_prefill_points():
    """--cached-prompts: prefix caching on in every configuration; a decode point prefills its
    prompts once, untimed (prime_s), then times runs on the same (now cached) prompts; a prefill
    point sends prompts never seen before on every run, so no run hits the cache."""
    import types

    args = e2e.parse_args(["--model", "gpt-oss-tiny", "--cached-prompts", "--configs", "upstream-default,sm121"])
    for run in e2e.build_plan(args)[0].runs:
        assert run["llm_kwargs"]["enable_prefix_caching"] is True
    default = e2e.build_plan(e2e.parse_args(["--model", "gpt-oss-tiny", "--configs", "sm121"]))
    assert default[0].runs[0]["llm_kwargs"]["enable_prefix_caching"] is False
    assert e2e.make_header(args, None)["cached_prompts"] is True

    seen = []

    class FakeLLM:
        def generate(self, prompts, sp, use_tqdm=False):
            seen.append((sp.max_tokens, tuple(tuple(p["prompt_token_ids"]) for p in prompts)))
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1] * sp.max_tokens)], metrics=None)
                    for _ in prompts]

    spec = {"seed": 0, "warmup": 1, "iters": 2, "extra_iters": 0, "cached_prompts": True}
    tg = e2e.Point("tg8-b2", "tg", 2, 20, 8)
    rec = e2e.run_point(FakeLLM(), tg, 1000, spec, lambda msg: None)
    assert [n for n, _ in seen] == [1, 1, 8, 1, 8, 1, 8]  # prime, warm-up pair, 2 timed pairs
    assert len({p for _, p in seen}) == 1 and rec["cached_prompts"] is True and rec["prime_s"] >= 0
    seen.clear()
    pp = e2e.Point("pp20", "pp", 1, 20, 1)
    rec = e2e.run_point(FakeLLM(), pp, 1000, spec, lambda msg: None)
    assert len(seen) == 3 and len({p for _, p in seen}) == 3  # warm-up + 2 iters, all fresh
    seen.clear()
    e2e.run_point(FakeLLM(), pp, 1000, dict(spec, cached_prompts=False), lambda msg: None)
    assert len({p for _, p in seen}) == 1  # without the flag: the same prompts every run


def test_temperature_reaches_the_header_and_the_sampling_params(tmp_path, monkeypatch):
    """--temperature: recorded in the JSON header; the child's SamplingParams use it."""
    out = tmp_path / "e2e.json"
    r = _run("--dry-run", "--no-vllm-check", "--model", "models/gpt-oss-tiny", "--temperature", "1.0",
             "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads(out.read_text())["header"]["temperature"] == 1.0
    monkeypatch.setattr(e2e, "SAMPLING_TEMPERATURE", 1.0)
    assert e2e.make_sampling_params(4).temperature == 1.0


class _Experts(torch.nn.Module):
    def __init__(self, e: int, h: int):
        super().__init__()
        self.w13_bias = torch.nn.Parameter(torch.empty(e, 2 * h))
        self.w2_bias = torch.nn.Parameter(torch.empty(e, h))
        # as the TP-invariant mode keeps a simulated rank's expert biases (vllm_sm121/moe/method.py)
        self.register_buffer("sm121_sim0_w2_bias", torch.full((e, h), 1e-3))


class _Attn(torch.nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(h, 3 * h)
        self.o_proj = torch.nn.Linear(h, h)


class _Mlp(torch.nn.Module):
    def __init__(self, h: int, e: int):
        super().__init__()
        self.router = torch.nn.Linear(h, e)
        self.experts = _Experts(e, h)


class _Layer(torch.nn.Module):
    def __init__(self, h: int, e: int):
        super().__init__()
        self.attn = _Attn(h)
        self.mlp = _Mlp(h, e)
        self.norm = torch.nn.Parameter(torch.empty(h))


def _dummy_moe_model(layers: int = 2, h: int = 64, e: int = 8) -> torch.nn.Module:
    """gpt-oss-like parameter names, every value vLLM's dummy uniform(-1e-3, 1e-3)."""
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([_Layer(h, e) for _ in range(layers)])
    for p in m.parameters():
        torch.nn.init.uniform_(p, -1e-3, 1e-3)
    return m


def _decode_distinct_experts(m: torch.nn.Module, steps: int = 4, seqs: int = 32, vocab: int = 4096) -> tuple[int, float]:
    """Greedy decode of ``seqs`` sequences through ``m`` as a gpt-oss decoder with dummy weights
    runs: the experts' MXFP4 blocks are zero, so an expert outputs its w2 bias; the attention's
    value path is the qkv bias (o_proj's dummy weight times it) plus o_proj's bias; dummy
    embedding, final norm and lm_head. Returns the last step's distinct next tokens and distinct
    experts per layer (mean over the layers)."""
    h_dim = m.layers[0].norm.numel()
    emb, lm = (torch.rand(vocab, h_dim) * 2e-3 - 1e-3 for _ in range(2))
    g_final = torch.rand(h_dim) * 2e-3 - 1e-3
    tok = torch.randint(0, vocab, (seqs,))

    def norm(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g

    for _ in range(steps):
        h, experts = emb[tok], []
        for ly in m.layers:
            h = h + ly.attn.o_proj(ly.attn.qkv_proj.bias[-h_dim:])[None, :]  # the same for every token
            w, ids = ly.mlp.router(norm(h, ly.norm)).topk(4)
            h = h + (w.softmax(-1)[..., None] * ly.mlp.experts.w2_bias[ids]).sum(1)
            experts.append(ids.unique().numel())
        tok = (norm(h, g_final) @ lm.T).argmax(-1)
    return tok.unique().numel(), sum(experts) / len(experts)


def test_random_router_refills_gpt_oss_routers_only():
    """--random-router: every ``*.mlp.router`` weight refilled with seeded N(0, 32^2) values (the
    same for the same seed, so every configuration and TP rank routes alike; another layer, another
    draw), its bias, o_proj's and the experts' biases zeroed, the qkv bias and every weight
    untouched, in place (captured graphs hold these tensors); a model without routers is an error,
    not a silent no-op; the flag reaches the header."""
    a, b = _dummy_moe_model(), _dummy_moe_model()
    storage = a.layers[0].mlp.router.weight.data_ptr()
    keep = {n: p.clone() for n, p in a.named_parameters()
            if not n.endswith(("router.weight",) + e2e.TOKEN_INDEPENDENT_BIASES + ("router.bias",))}
    assert e2e.randomize_routers(a, seed=5) == 2 and e2e.randomize_routers(b, seed=5) == 2
    r0, r1 = a.layers[0].mlp.router, a.layers[1].mlp.router
    assert r0.weight.data_ptr() == storage
    params = dict(a.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in keep.items()) and "layers.0.attn.qkv_proj.bias" in keep
    for n in ("mlp.router.bias", "attn.o_proj.bias", "mlp.experts.w13_bias", "mlp.experts.w2_bias"):
        assert params[f"layers.1.{n}"].abs().max() == 0, n
    assert a.layers[1].mlp.experts.sm121_sim0_w2_bias.abs().max() == 0  # buffers too
    assert torch.equal(r0.weight, b.layers[0].mlp.router.weight) and not torch.equal(r0.weight, r1.weight)
    assert 28 < r0.weight.std().item() < 36
    # routing now follows the input: distinct inputs pick different top-4 sets (with the dummy
    # bias it did not: the bias outweighs W.y at these scales)
    y = torch.rand(32, 64) * 2e-3 - 1e-3
    fresh = _dummy_moe_model().layers[0].mlp.router
    assert len({tuple(sorted(t.tolist())) for t in fresh(y).topk(4).indices}) == 1
    assert len({tuple(sorted(t.tolist())) for t in r0(y).topk(4).indices}) > 8
    with pytest.raises(RuntimeError, match="no '\\*.mlp.router'"):
        e2e.randomize_routers(torch.nn.Linear(4, 4), seed=0)
    args = e2e.parse_args(["--model", "gpt-oss-tiny", "--random-router", "--configs", "sm121"])
    assert e2e.make_header(args, None)["random_router"] is True
    assert e2e.make_header(e2e.parse_args(["--model", "gpt-oss-tiny", "--configs", "sm121"]), None)["random_router"] is False


def test_random_router_keeps_decoded_tokens_and_routing_apart():
    """Why --random-router zeroes the token-independent biases (stop 40: with the routers alone,
    upstream's batch-32 step on an H200 stayed at the batch-1 step plus little). With dummy
    weights every layer's o_proj and expert biases add one vector to every token's residual, which
    outweighs the embedding after a few layers: greedy decode then gives 32 sequences a handful of
    distinct next tokens, and those tokens route alike. Zeroing those biases keeps each residual
    ~its token's embedding: 32 distinct tokens and ~81 distinct experts per layer (uniform top-4
    of 128 over 32 tokens), against 4 with the dummy routers."""
    torch.manual_seed(1)
    with torch.no_grad():
        dummy = _dummy_moe_model(layers=36, h=256, e=128)
        routers_only = _dummy_moe_model(layers=36, h=256, e=128)
        for i, ly in enumerate(routers_only.layers):  # the first version of --random-router
            g = torch.Generator().manual_seed(i)
            ly.mlp.router.weight.copy_(torch.randn(ly.mlp.router.weight.shape, generator=g) * e2e.ROUTER_STD)
            ly.mlp.router.bias.zero_()
        full = _dummy_moe_model(layers=36, h=256, e=128)
        e2e.randomize_routers(full, seed=0)
        (t_dummy, e_dummy), (t_ro, e_ro), (t_full, e_full) = (
            _decode_distinct_experts(m) for m in (dummy, routers_only, full))
    assert e_dummy == 4 and t_ro <= 8 and e_ro < 20, (t_dummy, e_dummy, t_ro, e_ro)
    assert t_full >= 28 and 70 <= e_full <= 90, (t_full, e_full)
