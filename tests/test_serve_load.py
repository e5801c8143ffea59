"""CPU checks of scripts/serve_load.py: the dry run (seeded plan, JSON, exit 0), clear errors for
bad options, the request plan's bounds, and the response / logprob bookkeeping on synthetic data."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "serve_load.py"


def _load():
    spec = importlib.util.spec_from_file_location("serve_load_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_load_script"] = mod
    spec.loader.exec_module(mod)
    return mod


sl = _load()


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO, check=False)


def test_dry_run_writes_plan(tmp_path):
    out = tmp_path / "sl.json"
    r = _run("--dry-run", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["header"]["dry_run"] and res["header"]["requests"] == 200 and "git_commit" in res["header"]
    plan = res["plan"]
    assert len(plan) == 200 and sum(p["sample"] for p in plan) == 8
    assert all(1 <= p["prompt_len"] <= 2048 and 1 <= p["max_tokens"] <= 256 for p in plan)
    cmd = res["serve_cmd"]
    assert cmd[:2] == ["vllm", "serve"] and "--skip-tokenizer-init" in cmd
    assert cmd[cmd.index("--attention-backend") + 1] == "SM121" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "no server started" in r.stdout


def test_dry_run_dummy_weights_and_extra_args(tmp_path):
    out = tmp_path / "sl.json"
    r = _run("--dry-run", "--weights", "dummy", "--requests", "20", "--sample", "3", "--out", str(out),
             "--", "--max-cudagraph-capture-size", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["serve_cmd"][-4:] == ["--load-format", "dummy", "--max-cudagraph-capture-size", "8"]
    assert "dummy weights" in res["header"]["weights"]
    assert len(res["plan"]) == 20 and sum(p["sample"] for p in res["plan"]) == 3


def test_plan_is_seeded():
    a = sl.make_plan(50, 2048, 256, 8192, 0, 8)
    assert a == sl.make_plan(50, 2048, 256, 8192, 0, 8)
    assert a != sl.make_plan(50, 2048, 256, 8192, 1, 8)
    assert all(10 <= t < 8182 for r in a for t in r["prompt"])
    assert all(r["prompt_len"] >= 2 for r in a if r["sample"])


@pytest.mark.parametrize("args,words", [
    (["--requests", "0"], "--requests"),
    (["--concurrency", "0"], "--concurrency"),
    (["--max-prompt", "4000"], "--max-model-len"),
    (["--sample", "300"], "--sample"),
    (["--tol", "0"], "--tol"),
    (["--model", "no/such/dir"], "--model"),
    (["--model", "tests/eagle3-gpt-oss-tiny"], "--model"),
    (["--weights", "fp8"], "--weights"),
    (["--num-layers", "2", "--weights", "dummy"], "--num-layers"),
])
def test_bad_options_name_the_option(args, words, tmp_path):
    r = _run("--dry-run", "--out", str(tmp_path / "x.json"), *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr


def test_response_checks_and_logprobs():
    req = {"id": 0, "prompt": [11, 12, 13], "prompt_len": 3, "max_tokens": 4, "sample": True}
    pl = [None, {"12": {"logprob": -1.5, "rank": 3}}, {"13": {"logprob": -0.25, "rank": 1}}]
    resp = {"usage": {"completion_tokens": 4}, "choices": [{"prompt_logprobs": pl}]}
    assert sl.check_response(req, resp, None) is None
    assert sl.prompt_logprobs_of(req, resp) == [-1.5, -0.25]
    assert "completion_tokens 3" in sl.check_response(req, {**resp, "usage": {"completion_tokens": 3}}, None)
    assert sl.check_response(req, None, "HTTP 500: boom") == "HTTP 500: boom"
    assert "prompt_logprobs" in sl.check_response(req, {"usage": {"completion_tokens": 4}, "choices": [{}]}, None)
    body = sl.body_for(req, "m")
    assert body["prompt_logprobs"] == 0 and body["ignore_eos"] and body["prompt"] == [11, 12, 13]


def test_summary_counts_mismatches(capsys):
    import argparse

    plan = [{"id": i, "prompt": [1] * 5, "prompt_len": 5, "max_tokens": 2, "sample": i < 2} for i in range(3)]
    records = [{"id": 0, "error": None, "latency_s": 1.0, "prompt_logprobs": [-1.0, -2.0, -3.0, -4.0]},
               {"id": 1, "error": None, "latency_s": 2.0, "prompt_logprobs": [-1.0, -2.0, -3.0, -4.0]},
               {"id": 2, "error": "HTTP 500: x", "latency_s": 0.1}]
    alone = [{"id": 0, "error": None, "prompt_logprobs": [-1.0, -2.01, -3.0, -4.0]},
             {"id": 1, "error": None, "prompt_logprobs": [-1.0, -2.0, -3.0, -5.0]}]
    result = {"server_up": True, "load_wall_s": 2.0, "header": {"weights": "w"}}
    sl.summarize(argparse.Namespace(tol=0.05), result, plan, records, alone)
    s = result["summary"]
    assert s["requests_sent"] == 3 and s["failures"] == 1 and s["mismatches"] == 1
    assert s["max_abs_delta"] == pytest.approx(1.0)
    assert [c["status"] for c in result["comparisons"]] == ["ok", "mismatch"]
    assert "failures 1, mismatches 1" in capsys.readouterr().out
