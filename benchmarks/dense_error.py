"""Weight-format error table for gpt-oss's dense projections (issue 8): fp8 per-channel, MXFP8, MXFP4 vs bf16.

    python benchmarks/dense_error.py                 # CPU, torch references, reduced shapes (seconds)
    python benchmarks/dense_error.py --full          # gpt-oss-120b shapes (lm_head N reduced to 16384)
    python benchmarks/dense_error.py --kernel        # GPU: also the Triton kernel vs its reference
    python benchmarks/dense_error.py --dry-run       # print the plan only

Method
    For each shape (qkv N=5120 K=2880, o N=2880 K=4096, lm_head N=201088 K=2880; reduced by
    default) and weight statistics -- Gaussian; Gaussian with outlier rows (2 % of output
    channels x10, 0.5 % x50); with outlier columns (the same on input channels) -- W is drawn
    in fp32 and rounded to bf16 (the checkpoint format), x ~ N(0, 1) bf16 with M = 4 tokens.
    Error = ||x Wq^T - x W^T||_F / ||x W^T||_F in fp64, Wq the dequantized format: "fp8" e4m3
    + fp32 scale per output channel (``kernels.dense.fp8_per_channel_quantize``), "mxfp8" e4m3 +
    e8m0 per 32 along K, "mxfp4" e2m1 + e8m0 per 32 (gpt-oss's expert format). ``--kernel``
    (CUDA) adds the kernel error of ``dense_fp8_linear`` (bf16 output) vs
    ``dense_fp8_linear_torch`` on the same dequantized weights. Prints a markdown table and
    writes JSON (default results/dense_error.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

FULL_SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "lm_head": (16384, 2880)}
SMALL_SHAPES = {"qkv": (640, 576), "o": (576, 1024), "lm_head": (2048, 576)}
STATS = ("gaussian", "outlier_rows", "outlier_cols")
FORMATS = ("fp8", "mxfp8", "mxfp4")
M_TOKENS = 4


def make_weight(n: int, k: int, stats: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    if stats != "gaussian":
        dim = n if stats == "outlier_rows" else k
        perm = torch.randperm(dim, generator=g)
        n10, n50 = max(1, dim // 50), max(1, dim // 200)
        mult = torch.ones(dim)
        mult[perm[:n10]] = 10.0
        mult[perm[n10:n10 + n50]] = 50.0
        w = w * (mult[:, None] if stats == "outlier_rows" else mult[None, :])
    return w.bfloat16()


def dequantized(w: torch.Tensor, fmt: str) -> torch.Tensor:
    from vllm_sm121.kernels import dense as D

    if fmt == "fp8":
        return D.fp8_per_channel_dequantize(*D.fp8_per_channel_quantize(w))
    if fmt == "mxfp8":
        return D.mxfp8_weight_dequantize(*D.mxfp8_weight_quantize(w))
    if fmt == "mxfp4":
        return D.mxfp4_weight_dequantize(*D.mxfp4_weight_quantize(w))
    raise ValueError(f"fmt={fmt!r}; supported: {', '.join(FORMATS)}")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def run(shapes: dict, device: str, kernel: bool, seed: int = 0) -> list[dict]:
    from vllm_sm121.kernels import dense as D

    rows = []
    for i, (name, (n, k)) in enumerate(shapes.items()):
        for j, stats in enumerate(STATS):
            w = make_weight(n, k, stats, seed + 10 * i + j).to(device)
            x = torch.randn(M_TOKENS, k, generator=torch.Generator().manual_seed(seed + 100 + i)).bfloat16().to(device)
            ref = x.double() @ w.double().T
            row = {"layer": name, "N": n, "K": k, "M": M_TOKENS, "weights": stats}
            for fmt in FORMATS:
                row[fmt] = rel_err(x.double() @ dequantized(w, fmt).double().T, ref)
            if kernel:
                q, s = D.fp8_per_channel_quantize(w)
                row["fp8_kernel_vs_ref"] = rel_err(D.dense_fp8_linear(x, q, s), D.dense_fp8_linear_torch(x, q, s))
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    extra = ["fp8_kernel_vs_ref"] if rows and "fp8_kernel_vs_ref" in rows[0] else []
    cols = ["layer", "N x K", "weights", *FORMATS, *extra]
    out = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        vals = [r["layer"], f"{r['N']} x {r['K']}", r["weights"]] + [f"{r[c]:.2e}" for c in (*FORMATS, *extra)]
        out.append("| " + " | ".join(vals) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="gpt-oss-120b shapes (lm_head N reduced to 16384)")
    ap.add_argument("--kernel", action="store_true", help="CUDA: also the Triton kernel vs its reference")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, compute nothing")
    ap.add_argument("--out", default="results/dense_error.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shapes = FULL_SHAPES if args.full else SMALL_SHAPES
    if args.kernel and not torch.cuda.is_available():
        print("--kernel needs a CUDA GPU", file=sys.stderr)
        return 2
    device = "cuda" if args.kernel else "cpu"
    print(f"relative error of y = x W^T (M={M_TOKENS}) vs bf16 weights; shapes {shapes}; device {device}")
    if args.dry_run:
        print(f"dry run: {len(shapes) * len(STATS)} cases x formats {FORMATS}")
        return 0
    rows = run(shapes, device, args.kernel, args.seed)
    print(markdown(rows))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "shapes": shapes, "M": M_TOKENS, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
