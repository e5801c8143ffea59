"""`vllm-sm121 doctor` without a GPU: reports that, exits non-zero, still sees the plugin."""

import json
import subprocess
import sys



def _doctor(*args):
    return subprocess.run([sys.executable, "-m", "vllm_sm121.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})


def test_doctor_without_gpu_reports_and_fails():
    proc = _doctor("--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["gpu"]["available"] is False and "no CUDA GPU" in report["gpu"]["why"]
    assert report["plugin"]["loaded"] is True, report["plugin"]
    assert "SM121AttentionBackend" in report["plugin"]["detail"]
    backend = report["features"]["SM121 attention backend (--attention-backend SM121)"]
    assert backend["available"] is False and "no CUDA GPU" in backend["detail"]
    assert report["versions"]["vllm"] == "0.26.0"


def test_doctor_text_output():
    proc = _doctor()
    assert proc.returncode == 1
    assert "GPU: none usable" in proc.stdout and "plugin: loaded" in proc.stdout


def test_doctor_on_unsupported_capability(monkeypatch):
    from vllm_sm121 import cli

    monkeypatch.setattr(cli, "_gpu", lambda: {"available": True, "name": "A100", "capability": "8.0"})
    monkeypatch.setattr(cli, "_plugin_loaded", lambda: (True, "ok"))
    report = cli.diagnose()
    assert report["ok"] is False
    detail = report["features"]["SM121 attention backend (--attention-backend SM121)"]["detail"]
    assert "8.0 is not supported" in detail and "12.x" in detail
    monkeypatch.setattr(cli, "_gpu", lambda: {"available": True, "name": "GB10", "capability": "12.1"})
    assert cli.diagnose()["ok"] is True
