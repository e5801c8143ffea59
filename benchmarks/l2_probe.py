"""Does an L2 prefetch make the next one-token GEMV faster? (``kernels/l2_prefetch.py``)

For gpt-oss-120b's qkv / o FP8 weights, inside CUDA graphs (no host launch gaps), per call:

    cold        the plugin's one-token GEMV (``dense_fp8_linear``) on a weight copy not in L2
    hot         the same GEMV on one weight, again and again (the weight stays in L2)
    wait+gemv   a kernel that spins ``--wait-us`` (standing in for the attention kernel, which
                leaves DRAM idle), then the cold GEMV
    pf+wait+gemv  a standalone kernel issuing ``prefetch.global.L2`` hints for the weight (``--lines``
                bytes apart, as the plugin's kernels do), the spin, then the GEMV

and reports the GEMV's share of each (the variant minus the same graph without the GEMV), so
"gemv after prefetch" against "gemv cold" is what a prefetching kernel before it can save. Weight
copies rotate over >= 4 x the L2 size so each "cold" call reads DRAM.

Writes JSON (device, versions, commit, config, records) with ``--out``.

    python benchmarks/l2_probe.py --out results/l2_probe.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096)}  # N, K (e4m3 weights, bias on)
TILES_ENV = "VLLM_SM121_DENSE_FMA_TILES"


def _load_moe_bench():
    spec = importlib.util.spec_from_file_location("_moe_bench", REPO_ROOT / "benchmarks" / "moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qkv,o")
    p.add_argument("--lines", default="32,128", help="bytes between prefetch hints (comma list)")
    p.add_argument("--wait-us", type=float, default=7.0, help="the spin kernel's duration")
    p.add_argument("--programs", type=int, default=512, help="programs of the prefetch kernel")
    p.add_argument("--tiles", default="", help="';'-separated $VLLM_SM121_DENSE_FMA_TILES values (rows,kw,warps) "
                   "to time cold and hot too (the GEMV's own limit per tile)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="results/l2_probe.json")
    return p.parse_args(argv)


def _kernels():
    import triton
    import triton.language as tl

    from vllm_sm121.kernels._prefetch import prefetch_l2

    @triton.jit
    def prefetch_kernel(ptr, nbytes, LANES: tl.constexpr, LINE: tl.constexpr):
        prefetch_l2(ptr, nbytes, tl.program_id(0), tl.num_programs(0), LANES, LINE)

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def spin_kernel(ns):
        start = _now()
        t = start
        while t - start < ns:
            t = _now()

    return prefetch_kernel, spin_kernel


_MOE = _load_moe_bench()


def _time_graph(fn, reps: int) -> float:
    """Median µs of one replay of a graph of ``fn`` (``benchmarks/moe.py``'s replay timer)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return statistics.median(_MOE._replay_us(g) for _ in range(reps))


def weight_copies(n: int, k: int, min_copies: int, dev, g) -> tuple[int, list, list]:
    """Enough random e4m3 [n, k] weight copies (and fp32 row scales) to fill 4x the L2 (at least
    ``min_copies``), so a graph cycling through them reads each from DRAM: (copies, weights, scales)."""
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    copies = max(min_copies, math.ceil(4 * l2 / (n * k)))
    ws = [torch.randint(0, 120, (n, k), dtype=torch.uint8, device=dev, generator=g).view(torch.float8_e4m3fn)
          for _ in range(copies)]
    return copies, ws, [torch.rand(n, device=dev, generator=g) * 1e-2 for _ in range(copies)]


def run(args) -> tuple[list[dict], dict]:
    from vllm_sm121.kernels.dense import dense_fp8_linear

    prefetch_kernel, spin_kernel = _kernels()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    wait_ns = int(args.wait_us * 1e3)
    records = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        wbytes = n * k
        g = torch.Generator(device=dev).manual_seed(0)
        copies, ws, scales = weight_copies(n, k, 4, dev, g)
        bias = torch.randn(n, device=dev, generator=g).bfloat16()
        x = torch.randn(1, k, device=dev, generator=g).bfloat16()

        def gemv(i):
            dense_fp8_linear(x, ws[i], scales[i], bias)

        def pf(i, line):
            prefetch_kernel[(args.programs,)](ws[i].view(-1).view(torch.uint8), wbytes, LANES=128, LINE=line,
                                              num_warps=4)

        def spin():
            spin_kernel[(1,)](wait_ns, num_warps=1)

        per = {}
        per["cold"] = _time_graph(lambda: [gemv(i) for i in range(copies)], args.reps) / copies
        per["hot"] = _time_graph(lambda: [gemv(0) for _ in range(copies)], args.reps) / copies
        per["wait"] = _time_graph(lambda: [spin() for _ in range(copies)], args.reps) / copies
        per["wait+gemv"] = _time_graph(lambda: [(spin(), gemv(i)) for i in range(copies)], args.reps) / copies
        for line in (int(v) for v in args.lines.split(",")):
            per[f"pf{line}+wait"] = _time_graph(lambda: [(pf(i, line), spin()) for i in range(copies)],
                                                args.reps) / copies
            per[f"pf{line}+wait+gemv"] = _time_graph(lambda: [(pf(i, line), spin(), gemv(i)) for i in range(copies)],
                                                     args.reps) / copies
        for tile in (t.strip() for t in args.tiles.split(";") if t.strip()):
            os.environ[TILES_ENV] = tile  # read by the launcher at call time
            try:
                per[f"cold[{tile}]"] = _time_graph(lambda: [gemv(i) for i in range(copies)], args.reps) / copies
                per[f"hot[{tile}]"] = _time_graph(lambda: [gemv(0) for _ in range(copies)], args.reps) / copies
            finally:
                os.environ.pop(TILES_ENV)
            print(f"  tile {tile}: cold {per[f'cold[{tile}]']:.2f} us, hot {per[f'hot[{tile}]']:.2f} us")
        rec = dict(shape=shape, n=n, k=k, weight_bytes=wbytes, copies=copies, us=per,
                   gemv_cold_us=per["cold"], gemv_hot_us=per["hot"],
                   gemv_after_wait_us=per["wait+gemv"] - per["wait"])
        for line in (int(v) for v in args.lines.split(",")):
            rec[f"gemv_after_prefetch{line}_us"] = per[f"pf{line}+wait+gemv"] - per[f"pf{line}+wait"]
            rec[f"prefetch{line}_issue_us"] = per[f"pf{line}+wait"] - per["wait"]
        records.append(rec)
        print(f"{shape}: {wbytes / 1e6:.1f} MB, {copies} copies; gemv cold {per['cold']:.2f} us "
              f"({wbytes / per['cold'] / 1e3:.0f} GB/s), hot (L2) {per['hot']:.2f} us, after a {args.wait_us:.0f} us "
              f"spin {rec['gemv_after_wait_us']:.2f} us")
        for line in (int(v) for v in args.lines.split(",")):
            print(f"  prefetch every {line} B: gemv after prefetch + spin {rec[f'gemv_after_prefetch{line}_us']:.2f} us; "
                  f"the prefetch kernel adds {rec[f'prefetch{line}_issue_us']:.2f} us to the spin")
        ws.clear()  # free the copies before the next shape
    return records, {"l2_cache_bytes": l2}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/l2_probe.py needs a CUDA GPU")
        return 2
    copy_gbps = _MOE.measure_copy_bandwidth(torch.device("cuda"))
    head = _MOE.header(torch.device("cuda"), copy_gbps)
    print(f"device {head['device']}  copy bandwidth {copy_gbps:.0f} GB/s  commit {head['commit']}")
    records, extra = run(args)
    return write_results("l2_probe", head, records, args, extra)


def write_results(name: str, head: dict, records: list[dict], args, extra: dict | None = None) -> int:
    """The JSON (header with the config, records) at ``args.out``."""
    head.update(extra or {}, benchmark=name, config=dict(vars(args)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"header": head, "records": records}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
