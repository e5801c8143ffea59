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
    for bad in (["--steps", "0"], ["--capture-size", "0"], ["--top", "0"],
                ["--moe-experimental", "--backend", "TRITON_ATTN"]):
        with pytest.raises(SystemExit):
            P.main(["--dry-run", *bad])
    with pytest.raises(SystemExit):
        P.main(["--dry-run", "--model", str(REPO)])
