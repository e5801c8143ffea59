"""benchmarks/profile_step.py without a GPU: the per-step arithmetic, API grouping, the
standalone-quantization filter and the dry run."""

import collections
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import profile_step as P  # noqa: E402


def test_per_step_difference_cancels_prefill_and_setup():
    short = collections.Counter({"cudaGraphLaunch": 3, "cudaMemcpyAsync": 10, "once": 5})
    long = collections.Counter({"cudaGraphLaunch": 3 + 32, "cudaMemcpyAsync": 10 + 64, "once": 5, "new": 16})
    assert P.per_step(short, long, 32) == {"cudaMemcpyAsync": 2.0, "cudaGraphLaunch": 1.0, "new": 0.5}


def test_api_groups_and_summary():
    assert [P.api_group(n) for n in ("cudaGraphLaunch_v10000", "cuLaunchKernelEx", "cudaLaunchKernel",
                                     "cudaMemcpyAsync", "cudaMemsetAsync", "cudaEventRecord")] == [
        "graph launches", "kernel launches", "kernel launches", "copies", "memsets", "other"]
    api = {"cudaGraphLaunch": 1.0, "cudaMemcpyAsync": 2.0, "cudaEventRecord": 4.0}
    kernels = {"_paged_attention_kernel": 4.0, "_add_rmsnorm_mxfp8_kernel": 8.0, "_moe_route_kernel": 4.0,
               "scaled_fp8_quant_kernel": 4.0, "_downcast_to_mxfp": 4.0}
    s = P.summarize(api, kernels, layers=4)
    assert s["launches_copies_memsets_per_step"] == 3.0
    assert s["api_groups_per_step"]["other"] == 4.0
    assert s["kernels_per_layer"]["_add_rmsnorm_mxfp8_kernel"] == 2.0
    # the fused producer is not flagged; standalone quantizers are
    assert s["standalone_quant_kernels"] == {"scaled_fp8_quant_kernel": 4.0, "_downcast_to_mxfp": 4.0}
    assert "kernel_us_per_step" not in s
    us = {"_paged_attention_kernel": 20.0, "_add_rmsnorm_mxfp8_kernel": 12.0, "_moe_route_kernel": 48.0}
    t = P.summarize(api, kernels, layers=4, kernel_us=us)
    assert list(t["kernel_us_per_step"]) == ["_moe_route_kernel", "_paged_attention_kernel",
                                             "_add_rmsnorm_mxfp8_kernel"]  # largest first
    assert t["kernel_us_per_step_total"] == 80.0


def test_dry_run_prints_kwargs_and_bad_input():
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_step.py"), "--dry-run", "--eager",
                        "--moe-experimental", "--dense-fp8"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"enforce_eager": true' in r.stdout and '"attention_backend": "SM121"' in r.stdout
    assert '"dense_weights": "fp8"' in r.stdout and "VLLM_SM121_MOE_EXPERIMENTAL" in r.stdout
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_step.py"), "--dry-run",
                        "--backend", "default"], capture_output=True, text=True)
    assert r.returncode == 0 and "attention_backend" not in r.stdout
    with pytest.raises(SystemExit):
        P.main(["--dry-run", "--backend", "FLASHINFER"])
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_step.py"), "--dry-run",
                        "--kv-cache-dtype", "nvfp4"], capture_output=True, text=True)
    assert r.returncode == 0 and '"kv_cache_dtype": "nvfp4"' in r.stdout, r.stderr[-2000:]
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_step.py"), "--dry-run", "--batch", "8",
                        "--random-router"], capture_output=True, text=True)
    assert r.returncode == 0 and "VLLM_ALLOW_INSECURE_SERIALIZATION" in r.stdout, r.stderr[-2000:]
    assert P.main(["--dry-run", "--eager", "--batch", "32"]) == 0  # eager: any batch
    for bad in (["--steps", "0"], ["--capture-size", "0"], ["--top", "0"], ["--batch", "0"],
                ["--batch", "16"],  # above the default capture size 8: the steps would not replay a graph
                ["--moe-experimental", "--backend", "TRITON_ATTN"], ["--kv-cache-dtype", "nvfp4", "--backend", "default"],
                ["--kv-cache-dtype", "fp4"]):
        with pytest.raises(SystemExit):
            P.main(["--dry-run", *bad])
    with pytest.raises(SystemExit):
        P.main(["--dry-run", "--model", str(REPO)])


def test_scope_timers_wrap_measure_and_restore():
    class Runner:
        def work(self, x):
            return x + 1

    mod = type(sys)("fake_runner_mod")
    mod.Runner = Runner
    sys.modules["fake_runner_mod"] = mod
    ticks = iter(range(100))
    try:
        orig = Runner.__dict__["work"]
        timers = P.ScopeTimers([("work", "fake_runner_mod", "Runner", "work")], clock=lambda: next(ticks))
        before = timers.snapshot()
        assert Runner().work(1) == 2 and Runner().work(2) == 3
        after = timers.snapshot()
        assert after[1]["work"] == 2 and after[0]["work"] == 2  # two calls, one fake tick each
        rows = P.scope_table(before, after, 2, ["work", "absent"])
        assert rows == [{"scope": "work", "ms_per_step": 1000.0, "calls_per_step": 1.0},
                        {"scope": "absent", "ms_per_step": 0.0, "calls_per_step": 0.0}]
        timers.restore()
        assert Runner.__dict__["work"] is orig
        with pytest.raises(AttributeError, match="fake_runner_mod.Runner.missing does not exist"):
            P.ScopeTimers([("x", "fake_runner_mod", "Runner", "missing")])
    finally:
        del sys.modules["fake_runner_mod"]


def test_every_scope_exists_in_the_installed_vllm():
    """The scopes name vLLM 0.26 internals: a rename would otherwise time nothing, silently."""
    import importlib

    for label, module, cls_name, method in P.SCOPES:
        cls = getattr(importlib.import_module(module), cls_name)
        assert method in cls.__dict__, (label, module, cls_name, method)
