"""benchmarks/dense_error.py runs on the CPU (torch references) and writes its table."""

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(*args):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "dense_error.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_dry_run():
    r = _run("--dry-run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dry run" in r.stdout


def test_cpu_table(tmp_path):
    out = tmp_path / "e.json"
    r = _run("--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| layer | N x K | weights | fp8 | mxfp8 | mxfp4 |" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 9
    for row in rows:
        assert 0 < row["fp8"] < 0.05 and 0 < row["mxfp8"] < 0.05 and row["fp8"] < row["mxfp4"] < 0.3, row
