"""``vllm-sm121`` command line: ``vllm-sm121 doctor`` reports what the plugin can do on this machine.

Exit code 0 when the SM121 backend can run here, 1 when it cannot (no GPU, unsupported GPU,
plugin not loadable by vLLM). Works without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gpu() -> dict:
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return {"available": False, "why": f"torch does not import: {e}"}
    info = {"torch_cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        return {**info, "available": False, "why": "no CUDA GPU visible (torch.cuda.is_available() is False)"}
    major, minor = torch.cuda.get_device_capability(0)
    info.update(available=True, name=torch.cuda.get_device_name(0), capability=f"{major}.{minor}")
    try:
        import subprocess

        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        info["driver"] = "unknown (nvidia-smi not runnable)"
    return info


def _plugin_loaded() -> tuple[bool, str]:
    eps = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "sm121"]
    if not eps:
        return False, "entry point vllm.general_plugins:sm121 is not installed (pip install vllm-sm121)"
    try:
        from vllm.plugins import load_general_plugins
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        load_general_plugins()
        cls = AttentionBackendEnum["SM121"].get_class()
        return True, f"vLLM loads it; --attention-backend SM121 -> {cls.__module__}.{cls.__name__}"
    except Exception as e:  # noqa: BLE001
        return False, f"vLLM could not load it: {type(e).__name__}: {e}"


def diagnose() -> dict:
    from vllm_sm121 import __version__, moe, platform

    gpu = _gpu()
    loaded, how = _plugin_loaded()
    family = None
    if gpu.get("available"):
        major, minor = (int(x) for x in gpu["capability"].split("."))
        family = platform.arch_family(major, minor)

    def runs_here() -> tuple[bool, str]:
        if not loaded:
            return False, how
        if not gpu.get("available"):
            return False, gpu["why"]
        if family is None:
            return False, f"compute capability {gpu['capability']} is not supported ({platform.SUPPORTED_CAPABILITIES})"
        return True, f"{family} kernels (Triton)"

    backend_ok, backend_why = runs_here()
    not_yet = "not implemented in this version (see README feature table)"
    features = {
        "SM121 attention backend (--attention-backend SM121)": (backend_ok, backend_why),
        "fp8 KV cache (--kv-cache-dtype fp8 with SM121)": (backend_ok, backend_why),
        "nvfp4 KV cache (--kv-cache-dtype nvfp4 with SM121)": (backend_ok, backend_why),
        "MXFP4 MoE with MXFP8 activations": (backend_ok, backend_why) if moe.READY else (
            False, f"built but gated off (vllm_sm121.moe.READY is False; ${moe.EXPERIMENTAL_ENV}=1 opts in): "
                   "not yet faster than vLLM's MoE beyond one token; see README feature table"),
        "whole-model CUDA graph mode": (False, not_yet),
        "FP8 dense weights (sm121.dense_weights = fp8)": (backend_ok, backend_why),
    }
    return {
        "versions": {"vllm-sm121": __version__, "vllm": _version("vllm"), "torch": _version("torch"),
                     "triton": _version("triton")},
        "gpu": gpu,
        "plugin": {"loaded": loaded, "detail": how},
        "features": {k: {"available": ok, "detail": why} for k, (ok, why) in features.items()},
        "ok": backend_ok,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="vllm-sm121", description="vllm-sm121 tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    doc = sub.add_parser("doctor", help="report GPU, versions and which plugin features work here")
    doc.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = ap.parse_args(argv)
    report = diagnose()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        v = report["versions"]
        print("vllm-sm121 doctor")
        print("  versions: " + ", ".join(f"{k} {x}" for k, x in v.items()))
        g = report["gpu"]
        if g.get("available"):
            print(f"  GPU: {g['name']} (compute capability {g['capability']}), driver {g.get('driver')}, CUDA {g.get('torch_cuda')}")
        else:
            print(f"  GPU: none usable: {g['why']}")
        print(f"  plugin: {'loaded' if report['plugin']['loaded'] else 'NOT loaded'}: {report['plugin']['detail']}")
        for name, f in report["features"].items():
            print(f"  [{'yes' if f['available'] else 'no '}] {name}: {f['detail']}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
