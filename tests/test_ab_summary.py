"""benchmarks/ab_summary.py: per-card paired ratios from e2e JSON files (CPU, synthetic runs)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ab_summary  # noqa: E402


def _run(config: str, steps_ms: list[float], status: str = "ok") -> dict:
    return {"config": config, "points": {"tg128": {"status": status, "step_s": [x / 1e3 for x in steps_ms],
                                                   "ms_per_step": min(steps_ms)}}}


def _write(tmp_path: Path, name: str, runs: list[dict]) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps({"header": {}, "models": [{"name": "m", "runs": runs}]}))
    return p


def test_ratios_are_per_card_medians(tmp_path):
    # card a: base median 2.0, variant median 2.2 (a host stall in one iteration does not move it)
    a = _write(tmp_path, "a.json", [_run("base", [2.0, 2.0, 9.0]), _run("v", [2.2, 2.2, 2.1])])
    # card b: a slower card; the variant is faster there
    b = _write(tmp_path, "b.json", [_run("v", [2.9, 2.9, 2.9]), _run("base", [3.0, 3.0, 3.0])])
    s = ab_summary.summarize([a, b], "base", "tg128")
    v = s["variants"]["v"]
    assert v["ratios"] == pytest.approx([1.1, 2.9 / 3.0])
    assert v["slower_in"] == 1 and v["files"] == 2
    assert v["mean"] == pytest.approx((1.1 + 2.9 / 3.0) / 2)
    assert s["baseline_ms"]["mean"] == pytest.approx(2.5)


def test_failed_runs_are_left_out_and_a_missing_baseline_is_an_error(tmp_path):
    a = _write(tmp_path, "a.json", [_run("base", [2.0]), _run("v", [1.0], status="error")])
    s = ab_summary.summarize([a], "base", "tg128")
    assert s["variants"] == {}
    b = _write(tmp_path, "b.json", [_run("v", [2.0])])
    with pytest.raises(ValueError, match="no 'base' run"):
        ab_summary.summarize([b], "base", "tg128")
    assert ab_summary.main(["--baseline", "base", str(b)]) == 2


def test_cli_prints_and_writes(tmp_path, capsys):
    a = _write(tmp_path, "a.json", [_run("base", [2.0]), _run("v", [2.4])])
    out = tmp_path / "ab.json"
    assert ab_summary.main(["--baseline", "base", str(a), "--out", str(out)]) == 0
    assert "slower in 1 of 1" in capsys.readouterr().out
    assert json.loads(out.read_text())["variants"]["v"]["ratios"] == pytest.approx([1.2])


def test_one_model_per_file(tmp_path):
    p = tmp_path / "two.json"
    p.write_text(json.dumps({"models": [{"runs": [_run("base", [2.0])]}, {"runs": [_run("base", [3.0])]}]}))
    with pytest.raises(ValueError, match="2 models in one file"):
        ab_summary.summarize([p], "base", "tg128")
