"""CPU checks of benchmarks/eagle_cost.py and the shipped Eagle3 drafter configs: the dry run
(plan, one process per k, JSON; once with vLLM's own SpeculativeConfig parsing of the drafter),
clear errors for bad options, and the drafter configs' fields against their targets."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "eagle_cost.py"
SHARED_120B = REPO.parent / "shared" / "models" / "gpt-oss-120b"


def _load():
    spec = importlib.util.spec_from_file_location("eagle_cost_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["eagle_cost_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


ec = _load()


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env, check=False)


def _cfg(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


DRAFTERS = [("eagle3-gpt-oss-20b", REPO / "models" / "gpt-oss-20b", 24),
            ("eagle3-gpt-oss-120b", SHARED_120B, 36)]


@pytest.mark.parametrize("name,target,layers", DRAFTERS)
def test_drafter_config_fields(name, target, layers):
    d = _cfg(REPO / "models" / name)
    assert d["architectures"] == ["LlamaForCausalLMEagle3"]
    assert d["model_type"] == "llama"
    assert d["num_hidden_layers"] == 1
    assert d["hidden_size"] == 2880 and d["target_hidden_size"] == 2880
    assert d["num_attention_heads"] % d["num_key_value_heads"] == 0
    assert d["head_dim"] == 64
    for k in ("intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling", "draft_vocab_size"):
        assert k in d, k
    assert "layer_types" not in d and "sliding_window" not in d  # full attention, no sinks
    assert d["vocab_size"] == 201088 and 0 < d["draft_vocab_size"] <= d["vocab_size"]
    ids = d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert len(ids) == 3 and all(0 <= i < layers for i in ids)
    if target.is_dir():  # ../shared is not part of every checkout
        t = _cfg(target)
        assert d["vocab_size"] == t["vocab_size"]
        assert d["hidden_size"] == t["hidden_size"]
        assert d["rope_theta"] == t["rope_theta"] and d["rope_scaling"] == t["rope_scaling"]
        assert t["num_hidden_layers"] == layers
        assert ec.check_drafter_config(d, t, name) == []


def test_default_drafter_by_target_shape():
    assert ec.target_key(_cfg(REPO / "models" / "gpt-oss-20b")) == "gpt-oss-20b"
    assert ec.target_key(_cfg(REPO / "models" / "gpt-oss-tiny")) == "gpt-oss-tiny"
    if SHARED_120B.is_dir():
        assert ec.target_key(_cfg(SHARED_120B)) == "gpt-oss-120b"


def test_check_drafter_config_rejects():
    t = _cfg(REPO / "models" / "gpt-oss-20b")
    d = _cfg(REPO / "models" / "eagle3-gpt-oss-20b")
    for change, words in (({"vocab_size": 8192}, "vocab_size 8192"),
                          ({"architectures": ["LlamaForCausalLM"]}, "Eagle3"),
                          ({"hidden_size": 4096, "target_hidden_size": 4096}, "hidden_size"),
                          ({"draft_vocab_size": 300000}, "draft_vocab_size"),
                          ({"layer_types": ["sliding_attention"], "sliding_window": 128}, "full attention")):
        with pytest.raises(ValueError, match="--drafter") as e:
            ec.check_drafter_config({**d, **change}, t, "x")
        assert words in str(e.value)


def test_dry_run_plan_and_json(tmp_path):
    out = tmp_path / "ec.json"
    r = _run("--dry-run", "--no-vllm-check", "--backend", "SM121,TRITON_ATTN", "--ks", "1,3,7",
             "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    h = res["header"]
    assert h["dry_run"] and h["benchmark"] == "eagle_cost" and "git_commit" in h and "vllm" in h
    assert h["drafter"].endswith("eagle3-gpt-oss-20b")
    names = [run["name"] for run in res["runs"]]
    assert names == ["SM121/plain", "SM121/k1", "SM121/k3", "SM121/k7",
                     "TRITON_ATTN/plain", "TRITON_ATTN/k1", "TRITON_ATTN/k3", "TRITON_ATTN/k7"]
    k3 = res["runs"][2]["llm_kwargs"]
    assert k3["attention_backend"] == "SM121" and k3["load_format"] == "dummy"
    assert k3["speculative_config"] == {"method": "eagle3", "model": h["drafter"], "num_speculative_tokens": 3}
    assert "speculative_config" not in res["runs"][0]["llm_kwargs"]
    assert "SM121/k7" in r.stdout


def test_dry_run_vllm_parses_drafter(tmp_path):
    """vLLM's own SpeculativeConfig (CPU) accepts the shipped 20b head; vocab equals the target's."""
    pytest.importorskip("vllm")
    out = tmp_path / "ec.json"
    r = _run("--dry-run", "--ks", "3", "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    chk = json.loads(out.read_text())["vllm_check"]
    assert chk["problems"] == []
    d = chk["drafter"]
    assert d["architectures"] == ["LlamaForCausalLMEagle3"]
    assert d["vocab_size"] == d["target_vocab_size"] == 201088
    assert d["draft_vocab_size"] == 32000 and d["num_layers"] == 1


@pytest.mark.parametrize("args,words", [
    (["--ks", "0,3"], "--ks"),
    (["--ks", "a"], "--ks"),
    (["--backend", "NOPE"], "--backend"),
    (["--drafter-backend", "NOPE"], "--drafter-backend"),
    (["--model", "no/such/dir"], "--model"),
    (["--drafter", "models/gpt-oss-20b"], "--drafter"),
    (["--model", "gpt-oss-tiny", "--drafter", "models/eagle3-gpt-oss-20b"], "vocab_size"),
    (["--capture-size", "4", "--ks", "7"], "--capture-size"),
    (["--gen", "2"], "--gen"),
    (["--llm-kwargs", "[1]"], "--llm-kwargs"),
])
def test_bad_options_name_the_option(args, words, tmp_path):
    r = _run("--dry-run", "--no-vllm-check", "--out", str(tmp_path / "x.json"), *args, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert words in r.stderr
    assert "Traceback" not in r.stderr


def test_derive_ratios_and_break_even():
    runs = [{"backend": "SM121", "k": 0, "result": {"step_ms": 4.0, "fwd_gpu_ms": 3.0}},
            {"backend": "SM121", "k": 3, "result": {"step_ms": 6.0, "fwd_gpu_ms": 3.6, "draft_gpu_ms": 1.2,
                                                    "spec_counters": {"vllm:spec_decode_num_draft_tokens": 30.0,
                                                                      "vllm:spec_decode_num_accepted_tokens": 3.0}}},
            {"backend": "SM121", "k": 1, "result": {"step_ms": 9.0}}]
    rows = ec.derive(runs)
    assert rows[0]["ratio"] == 1.0 and rows[0]["break_even_tokens_per_step"] is None
    r3 = rows[1]
    assert r3["ratio"] == pytest.approx(1.5) and r3["break_even_tokens_per_step"] == pytest.approx(1.5)
    assert r3["break_even_accepted_drafts"] == pytest.approx(0.5) and r3["can_win"]
    assert r3["verify_ratio"] == pytest.approx(1.2) and r3["draft_ratio"] == pytest.approx(0.4)
    assert r3["dummy_acceptance"] == pytest.approx(0.1)
    assert rows[2]["can_win"] is False  # 2.25 tokens/step needed, at most k + 1 = 2
    ec.print_table(rows)
