"""benchmarks/kv_accuracy.py: the accuracy table's numbers come from the real nvfp4 write path."""

import importlib.util
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("kv_accuracy", ROOT / "benchmarks" / "kv_accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_nvfp4_error_is_between_fp8_and_garbage():
    m = _load()
    g = torch.Generator().manual_seed(0)
    k, v = m.make_kv(64, "gaussian", g)
    q = torch.randn(m.HQ, 64, generator=g)
    ref = m.attend(q, k, v, 0.125)
    k4, v4, _ = m.nvfp4_roundtrip(k, v, torch.device("cpu"))
    rel = lambda o: ((o - ref).norm(dim=-1) / ref.norm(dim=-1)).mean().item()  # noqa: E731
    fp8 = rel(m.attend(q, k.float().to(torch.float8_e4m3fn).float(), v.float().to(torch.float8_e4m3fn).float(), 0.125))
    nv = rel(m.attend(q, k4, v4, 0.125))
    noise = rel(m.attend(q, torch.randn_like(k4), torch.randn_like(v4), 0.125))
    assert 0 < fp8 < nv < 0.3 < noise, (fp8, nv, noise)
    # Tiny (dummy-weight) magnitudes: the calibrated global scale keeps the same relative error.
    k4s, v4s, _ = m.nvfp4_roundtrip((k.float() * 1e-3).bfloat16(), (v.float() * 1e-3).bfloat16(), torch.device("cpu"))
    assert abs(rel(m.attend(q, k4s * 1e3, v4s * 1e3, 0.125)) - nv) < 0.05
