"""benchmarks/tune_kv.py --prefill on the CPU (Triton interpreter, tiny shapes): the sweep runs every
kv dtype over the prefill tile grid through the real kernel and records what it measured."""

import functools
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter (CPU) test"),
]

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prefill_sweep_runs_each_dtype_and_tile(monkeypatch):
    tune_kv, tune_attention = _load("tune_kv"), _load("tune_attention")
    from vllm_sm121.kernels.paged_attention import paged_attention
    from vllm_sm121.platform import AttnTile

    monkeypatch.setattr(tune_kv, "PREFILL_TILES", ((64, 32, 4, 2),))
    calls = []
    timer = types.SimpleNamespace(host_us=lambda fn, n: 0.0,
                                  run=lambda fn, host_us: calls.append(fn()) or [10.0, 20.0, 30.0])
    setup = functools.partial(tune_attention.setup, device="cpu")
    recs = tune_kv._prefill_sweep(paged_attention, setup, timer, AttnTile, ctx=40, chunk=8)
    assert len(recs) == 2 * 3  # windows x kv dtypes (x 1 tile)
    assert {r["kv"] for r in recs} == {"bf16", "fp8", "nvfp4"} and {r["window"] for r in recs} == {None, 128}
    assert all(r["error"] is None and r["us"] == 20.0 and r["tok_s"] == pytest.approx(4e5) for r in recs), recs
    assert len(calls) == len(recs) and all(c.shape == (8, 64, 64) for c in calls)
