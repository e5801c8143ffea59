"""Paired A/B summary of ``benchmarks/e2e.py`` runs: one JSON per card (or per call), each holding
a baseline configuration and variants measured in the same process sequence on the same card.

Why: batch-1 decode on a whole-model graph is ~2.3 ms of GPU work per step, but each iteration's
t(1) and t(N) carry host noise of tens of ms (stop 32, H200 x4: t(1) 62-118 ms, t(128) 357-402 ms
for one engine), so one run's tok/s moves by ±5% and a 2-3% change of the GPU step cannot be read
from one card. Comparing each variant with the baseline *on the same card* and over several cards
(in rotated order, so neither runs first everywhere) separates the two.

Per run it takes the median of the per-iteration step times ``step_s`` = (t(N) - t(1)) / (N - 1)
(robust to the host stalls that hit single iterations; the suite's own estimator, min t(N) - min
t(1), is printed next to it). Per variant it prints, for each file, its step time relative to the
baseline's in that file, then the mean, min and max of those ratios and how many files had the
variant slower. It judges nothing by itself; the sign agreement over cards is the evidence.

    python benchmarks/ab_summary.py --baseline sm121-all-moe [--point tg128] a.json b.json ... [--out ab.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def run_steps(path: Path, point: str) -> dict[str, dict]:
    """{config: {"median_ms", "min_based_ms", "iters"}} of one e2e JSON of one model."""
    data = json.loads(path.read_text())
    out: dict[str, dict] = {}
    models = data.get("models", [])
    if len(models) > 1:
        raise ValueError(f"{path}: {len(models)} models in one file; pass one model's runs per file")
    for model in models:
        for run in model.get("runs", []):
            pt = (run.get("points") or {}).get(point) or {}
            steps = pt.get("step_s") or []
            if pt.get("status") != "ok" or not steps:
                continue
            key = run.get("config") or run.get("plan", {}).get("config")
            if key in out:
                raise ValueError(f"{path}: configuration {key!r} appears twice for point {point!r}")
            out[key] = {"median_ms": 1e3 * statistics.median(steps), "min_based_ms": pt.get("ms_per_step"),
                        "iters": len(steps)}
    return out


def summarize(files: list[Path], baseline: str, point: str) -> dict:
    """Per file the step times; per variant the ratios to the same file's baseline."""
    per_file = {}
    for f in files:
        steps = run_steps(f, point)
        if baseline not in steps:
            raise ValueError(f"{f}: no {baseline!r} run at point {point!r} (configurations: {sorted(steps) or 'none'})")
        per_file[str(f)] = steps
    variants = sorted({c for s in per_file.values() for c in s} - {baseline})
    table = {}
    for v in variants:
        ratios = [s[v]["median_ms"] / s[baseline]["median_ms"] for s in per_file.values() if v in s]
        table[v] = {"files": len(ratios), "ratios": ratios, "mean": statistics.fmean(ratios), "min": min(ratios),
                    "max": max(ratios), "slower_in": sum(r > 1.0 for r in ratios)}
    base = [s[baseline]["median_ms"] for s in per_file.values()]
    return {"baseline": baseline, "point": point, "per_file": per_file,
            "baseline_ms": {"mean": statistics.fmean(base), "min": min(base), "max": max(base)}, "variants": table}


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def print_summary(s: dict) -> None:
    b = s["baseline"]
    print(f"point {s['point']}, baseline {b}: median per-iteration ms/step (min-based estimate in brackets)")
    for f, steps in s["per_file"].items():
        cells = ", ".join(f"{c} {v['median_ms']:.3f} [{_ms(v['min_based_ms'])}]" for c, v in steps.items())
        print(f"  {Path(f).name}: {cells}")
    bm = s["baseline_ms"]
    print(f"{b}: mean {bm['mean']:.3f} ms/step over {len(s['per_file'])} files (min {bm['min']:.3f}, max {bm['max']:.3f})")
    print("variant step time / baseline's in the same file (> 1: slower)")
    for v, t in s["variants"].items():
        rs = " ".join(f"{r:.3f}" for r in t["ratios"])
        print(f"  {v:<28} mean {t['mean']:.3f} (min {t['min']:.3f}, max {t['max']:.3f}), slower in "
              f"{t['slower_in']} of {t['files']}: {rs}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="e2e JSON files, each with the baseline configuration")
    ap.add_argument("--baseline", required=True, help="the configuration every file ran (e.g. sm121-all-moe)")
    ap.add_argument("--point", default="tg128", help="decode point (default tg128)")
    ap.add_argument("--out", type=Path, default=None, help="JSON output")
    args = ap.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        ap.error(f"no such file(s): {', '.join(missing)}")
    try:
        s = summarize(args.files, args.baseline, args.point)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(s)
    if args.out:
        args.out.write_text(json.dumps(s, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
