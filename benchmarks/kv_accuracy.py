"""Accuracy of quantized KV caches: attention output error of fp8 and nvfp4 KV against bf16 KV.

    python benchmarks/kv_accuracy.py [--out kv_accuracy.json] [--kernel]

For each head size and data kind, random K/V/Q (gpt-oss decode shape: 64 query / 8 KV heads,
scale 1/sqrt(D), 2048 context tokens, 16-token pages) are stored as bf16, fp8-e4m3 (vLLM's
per-tensor scale for gpt-oss: 1.0, as no checkpoint scales exist) and nvfp4 (the SM121 format:
e2m1 + e4m3 per 16 + per-layer global scale from ``calibrate_global_scales`` on the same data).
Attention is computed in fp32 on the dequantized caches and compared with fp32 attention on the
bf16 K/V: relative error ||o - o_ref|| / ||o_ref|| (mean over heads), and the max abs
error. Data kinds: Gaussian (std 1), and Gaussian with 4 outlier channels per head 10x and 50x
larger (as real K often has). ``--kernel`` (GPU) also runs SM121's paged-attention kernel on the
nvfp4 pages and reports its deviation from the dequantized reference (kernel error only).

Sensitivity (why a quantized cache widens run-to-run spreads, e.g. TP=2 vs TP=1): K and V are
perturbed by what a different reduction order changes upstream (each element moved by one bf16
ulp with probability 1/2, i.e. rounded the other way), then stored again in each format; the
change of the attention output divided by the change with bf16 KV is the format's
amplification of such perturbations (code flips move values by a whole e4m3 / e2m1 step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform as _py_platform
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vllm_sm121.kernels.fp4_kv import (  # noqa: E402
    Nvfp4Pages,
    calibrate_global_scales,
    default_global_scale,
    fp4_kv_write,
    fp4_kv_write_torch,
    nvfp4_full_dim,
)

HQ, HKV, CTX, BS = 64, 8, 2048, 16
KINDS = {"gaussian": None, "outliers-10x": 10.0, "outliers-50x": 50.0}


def make_kv(d: int, kind: str, g: torch.Generator):
    k = torch.randn(CTX, HKV, d, generator=g)
    v = torch.randn(CTX, HKV, d, generator=g)
    factor = KINDS[kind]
    if factor is not None:
        for h in range(HKV):
            ch = torch.randperm(d, generator=g)[:4]
            k[:, h, ch] *= factor
            v[:, h, ch] *= factor
    return k.bfloat16(), v.bfloat16()


def attend(q, k, v, scale):
    """fp32 decode attention of q [HQ, D] over k/v [CTX, HKV, D]."""
    kk = k.float().repeat_interleave(HQ // HKV, dim=1)  # [CTX, HQ, D]
    vv = v.float().repeat_interleave(HQ // HKV, dim=1)
    logits = torch.einsum("hd,thd->ht", q.float(), kk) * scale
    return torch.einsum("ht,thd->hd", logits.softmax(-1), vv)


def nvfp4_roundtrip(k, v, device):
    """Write K/V through the SM121 nvfp4 path (kernel on GPU, its bit-exact reference on CPU)."""
    d = k.shape[-1]
    nb = CTX // BS
    cache = torch.zeros(nb, 2, HKV * BS * nvfp4_full_dim(d), dtype=torch.uint8, device=device)
    gs = torch.full((2,), default_global_scale(), device=device)
    done = torch.zeros(2, dtype=torch.bool, device=device)
    kd, vd = k.to(device), v.to(device)
    calibrate_global_scales(kd, vd, gs, done)
    pk, pv = (Nvfp4Pages.view(cache[:, i], HKV, BS, d, gs[i:i + 1]) for i in (0, 1))
    slots = torch.arange(CTX, device=device)
    (fp4_kv_write if device.type == "cuda" else fp4_kv_write_torch)(kd, vd, pk, pv, slots)
    deq = lambda p: p.dequantize().permute(0, 2, 1, 3).reshape(CTX, HKV, d)  # noqa: E731
    return deq(pk).cpu(), deq(pv).cpu(), (pk, pv)


def kernel_error(q, pages, scale, device):
    from vllm_sm121.kernels import paged_attention, paged_attention_torch

    pk, pv = pages
    nb = CTX // BS
    bt = torch.arange(nb, dtype=torch.int32, device=device)[None]
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    sl = torch.tensor([CTX], dtype=torch.int32, device=device)
    qd = q.to(device).bfloat16()[None]
    out = paged_attention(qd, pk, pv, bt, qsl, sl, max_query_len=1, max_seq_len=CTX, scale=scale)
    ref = paged_attention_torch(qd, pk.dequantize(), pv.dequantize(), bt, qsl, sl, scale=scale)
    return (out.float() - ref.float()).abs().max().item()


def perturb_bf16(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """x (bf16) with about half of its elements moved one bf16 ulp up or down (rounded the other
    way): the difference a different fp32 summation order leaves after rounding to bf16."""
    bits = x.view(torch.int16)
    step = torch.randint(-1, 2, x.shape, generator=g, dtype=torch.int16) * (torch.rand(x.shape, generator=g) < 0.5)
    return (bits + step.to(torch.int16)).view(torch.bfloat16)


def output_change(q, a, b, scale) -> float:
    """Mean over heads of ||attend(a) - attend(b)|| / ||attend(a)||."""
    oa, ob = attend(q, *a, scale), attend(q, *b, scale)
    return ((oa - ob).norm(dim=-1) / oa.norm(dim=-1)).mean().item()


def _commit() -> str:
    if os.environ.get("VLLM_SM121_COMMIT"):
        return os.environ["VLLM_SM121_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-sizes", default="64,128")
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernel", action="store_true", help="also check SM121's kernel on the nvfp4 pages (GPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.kernel and device.type != "cuda":
        print("--kernel needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    rows = []
    g = torch.Generator().manual_seed(args.seed)
    for d in (int(x) for x in args.head_sizes.split(",")):
        if d not in (64, 128):
            print(f"--head-sizes: {d} is not supported; supported: 64, 128", file=sys.stderr)
            return 2
        scale = 1 / math.sqrt(d)
        for kind in KINDS:
            k, v = make_kv(d, kind, g)
            q = torch.randn(HQ, d, generator=g)
            ref = attend(q, k, v, scale)  # bf16 KV: the reference
            k4, v4, pages = nvfp4_roundtrip(k, v, device)
            caches = {
                "fp8": (k.float().to(torch.float8_e4m3fn).float(), v.float().to(torch.float8_e4m3fn).float()),
                "nvfp4": (k4, v4),
            }
            row = {"head_size": d, "data": kind}
            for name, (kc, vc) in caches.items():
                o = attend(q, kc, vc, scale)
                rel = ((o - ref).norm(dim=-1) / ref.norm(dim=-1)).mean().item()
                row[name] = {"rel_err": rel, "max_abs_err": (o - ref).abs().max().item()}
            kp, vp = perturb_bf16(k, g), perturb_bf16(v, g)
            k4p, v4p, _ = nvfp4_roundtrip(kp, vp, device)
            fp8 = lambda x: x.float().to(torch.float8_e4m3fn).float()  # noqa: E731
            base = output_change(q, (k, v), (kp, vp), scale)
            row["sensitivity"] = {"bf16_output_change": base,
                                  "fp8_amplification": output_change(q, (fp8(k), fp8(v)), (fp8(kp), fp8(vp)), scale) / base,
                                  "nvfp4_amplification": output_change(q, (k4, v4), (k4p, v4p), scale) / base}
            if args.kernel:
                row["nvfp4_kernel_vs_dequantized_max_abs"] = kernel_error(q, pages, scale, device)
            rows.append(row)
            print(f"D={d:<4} {kind:<13} rel.err vs bf16 KV:  fp8 {row['fp8']['rel_err']:.2e}  "
                  f"nvfp4 {row['nvfp4']['rel_err']:.2e}" + (f"  (kernel vs dequant {row['nvfp4_kernel_vs_dequantized_max_abs']:.1e})"
                                                              if args.kernel else ""), flush=True)
    print("\nrelative error of the attention output vs bf16 KV, and how much each format amplifies a")
    print("one-ulp bf16 perturbation of K/V (output change / the change with bf16 KV):")
    print("| head size | data | fp8 KV | nvfp4 KV | bf16 change | fp8 amplification | nvfp4 amplification |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        sens = r["sensitivity"]
        print(f"| {r['head_size']} | {r['data']} | {r['fp8']['rel_err']:.2e} | {r['nvfp4']['rel_err']:.2e} | "
              f"{sens['bf16_output_change']:.2e} | {sens['fp8_amplification']:.1f}x | {sens['nvfp4_amplification']:.1f}x |")
    if args.out:
        import vllm_sm121

        meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else _py_platform.processor() or "cpu",
                "torch": torch.__version__, "vllm_sm121": vllm_sm121.__version__, "commit": _commit(),
                "config": {"q_heads": HQ, "kv_heads": HKV, "context": CTX, "block_size": BS, "seed": args.seed,
                           "fp8_scale": 1.0, "nvfp4_global_scale": "calibrate_global_scales on the same data"}}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
