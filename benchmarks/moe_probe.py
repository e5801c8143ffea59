"""Where the FMA MoE decode GEMVs lose time at M = 1..4 (a diagnostic, GPU only).

For the gpt-oss-120b layer (H = I = 2880, 128 experts, top-4, random MXFP4 weights) it times, with
the L2 flushed before every replay of a one-launch CUDA graph:

* ``stream``: a kernel that only reads the weights the FC1 (or FC2) kernel reads, with the same
  rows per program and the same 16-byte words per thread, XOR-folds them and writes one word per
  program: the memory-side ceiling of that access pattern for a given grid. Split along K by
  ``--splits`` (more programs, fewer sequential steps each), so the grid's effect shows apart
  from the math's.
* ``fc1`` / ``fc2``: the shipped FMA kernels (``kernels/moe.py``), the same weights.

Each line: µs (median of --reps), GB/s, % of the copy bandwidth measured in the same run. Run it
under ``ncu`` (``--ncu``: few replays, no timing loop) to read the stall reasons of each kernel:
``scripts/gpu_session.sh moeprobe``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from moe import FLUSH_BYTES, _replay_us, measure_copy_bandwidth, time_graph  # noqa: E402  (one call per graph replay)


@triton.jit
def _stream_kernel(w_ptr, ids_ptr, out_ptr, ROWS_TOTAL: tl.constexpr, KW: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr, SPLIT: tl.constexpr):
    """Program (slot, row tile, K split): XOR of the int32 words [BLOCK_R rows, its K range] of
    expert ids[slot]'s rows (matrix [E, ROWS_TOTAL, KW] int32)."""
    slot = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS_TOTAL
    per = (KW + SPLIT - 1) // SPLIT
    per = (per + BLOCK_C - 1) // BLOCK_C * BLOCK_C
    offs_c = tl.arange(0, BLOCK_C)
    base = w_ptr + (expert * ROWS_TOTAL + rows[:, None]) * KW + offs_c[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    for c0 in range(split * per, split * per + per, BLOCK_C):
        ok = row_ok[:, None] & (c0 + offs_c[None, :] < KW)
        acc ^= tl.load(base + c0, mask=ok, other=0)
    x = tl.reduce(tl.reshape(acc, [BLOCK_R * BLOCK_C]), 0, _xor)
    tl.store(out_ptr + (slot * tl.num_programs(1) + tile) * SPLIT + split, x)


@triton.jit
def _xor(a, b):
    return a ^ b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,4")
    ap.add_argument("--splits", default="1,2,3,6")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ncu", action="store_true", help="3 launches of each kernel, no timing (run under ncu)")
    ap.add_argument("--no-stream", dest="stream", action="store_false", help="only the shipped FMA kernels")
    ap.add_argument("--rotate", action="store_true",
                    help="no L2 flush: one graph of 128 / (M * top-k) calls, each on experts no other call of the "
                         "graph reads (cold weights, clean L2, as in a decode step); also 'hot' (one call's "
                         "experts again and again)")
    ap.add_argument("--fma-tiles", default="", help="';'-separated $VLLM_SM121_MOE_FMA_TILES values to time the FMA "
                    "kernels with (each optionally '@<maxnreg>'); '' = the shipped tiles only")
    ap.add_argument("--block-c", default="64", help="stream kernel: int32 words per row per step (comma list)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_probe: needs a CUDA GPU")
        return 2
    from vllm_sm121.kernels import moe as K

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    e, h, i, topk = 128, 2880, 2880, 4
    w13 = torch.randint(0, 256, (e, 2 * i, h // 2), generator=g, dtype=torch.uint8).to(dev)
    w13s = torch.randint(118, 122, (e, 2 * i, h // 32), generator=g, dtype=torch.uint8).to(dev)
    b13 = (torch.randn(e, 2 * i, generator=g) * 0.1).bfloat16().to(dev)
    w2 = torch.randint(0, 256, (e, h, i // 2), generator=g, dtype=torch.uint8).to(dev)
    w2s = torch.randint(118, 122, (e, h, i // 32), generator=g, dtype=torch.uint8).to(dev)
    b2 = (torch.randn(e, h, generator=g) * 0.1).bfloat16().to(dev)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    copy_gbps = measure_copy_bandwidth(dev)
    print(f"device {torch.cuda.get_device_name()} copy {copy_gbps:.0f} GB/s")
    reps = 3 if args.ncu else args.reps
    recs = []

    def graph_us(fns) -> float:
        for f in fns:
            f()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        graph.replay()
        torch.cuda.synchronize()
        return statistics.median(_replay_us(graph) for _ in range(reps)) / len(fns)

    def report(name, m, nbytes, fn, sets=None):
        """fn(): one call; with --rotate, fn(j) is the call on expert set j of ``sets``."""
        if args.rotate:
            t = graph_us([lambda j=j: fn(j) for j in range(sets)])
            hot = graph_us([lambda: fn(0)] * sets)
            recs.append(dict(name=name + " [hot]", m=m, us=hot, bytes=nbytes, gbps=nbytes / hot / 1e3,
                             pct_copy_bw=100 * nbytes / hot / 1e3 / copy_gbps))
            print(f"{name + ' [hot, L2]':44s} M={m}  {hot:8.1f} us  {nbytes / hot / 1e3:7.0f} GB/s")
            name += " [cold, rotating]"
        else:
            t = statistics.median(time_graph(fn, reps, flush)[0])
        gbps = nbytes / t / 1e3
        rec = dict(name=name, m=m, us=t, bytes=nbytes, gbps=gbps, pct_copy_bw=100 * gbps / copy_gbps)
        recs.append(rec)
        print(f"{name:44s} M={m}  {t:8.1f} us  {gbps:7.0f} GB/s  {rec['pct_copy_bw']:5.1f}%")

    for m in [int(x) for x in args.m.split(",")]:
        ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(m)]).to(dev, torch.int32)
        sets = e // (m * topk)  # --rotate: disjoint expert sets, every expert once per graph replay
        perm = torch.randperm(e, generator=g)
        ids_j = [perm[j * m * topk:(j + 1) * m * topk].view(m, topk).to(dev, torch.int32) for j in range(sets)]
        uniq_j = [t.flatten().sort().values for t in ids_j]
        slots = ids.flatten()
        nexp = len(set(slots.tolist()))
        fc1_bytes = nexp * (2 * i * (h // 2 + h // 32))
        fc2_bytes = nexp * (h * (i // 2 + i // 32))
        uniq = torch.tensor(sorted(set(slots.tolist())), dtype=torch.int32, device=dev)
        for what, w, rows_total, kw, nbytes in (("fc1", w13, 2 * i, h // 8, fc1_bytes), ("fc2", w2, h, i // 8, fc2_bytes))[
                :2 if args.stream else 0]:
            wi = w.view(torch.int32)
            for split, warps, bc in itertools.product([int(x) for x in args.splits.split(",")],
                                                       [int(x) for x in args.warps.split(",")],
                                                       [int(x) for x in args.block_c.split(",")]):
                tiles = -(-rows_total // 64)
                out = torch.empty(len(uniq) * tiles * split, dtype=torch.int32, device=dev)

                def fn(j=None, wi=wi, out=out, tiles=tiles, split=split, warps=warps, rows_total=rows_total, kw=kw,
                       bc=bc):
                    _stream_kernel[(len(uniq), tiles, split)](wi, uniq if j is None else uniq_j[j], out,
                                                              ROWS_TOTAL=rows_total, KW=kw, BLOCK_R=64, BLOCK_C=bc,
                                                              SPLIT=split, num_warps=warps)
                report(f"stream {what} 64x{bc * 4}B split {split} w{warps}", m, nbytes, fn, sets)
        x = torch.randn(m, h, generator=g).bfloat16().to(dev)
        a, a_s = K.mxfp8_quantize(x)
        wts = torch.full((m, topk), 0.25, dtype=torch.float32, device=dev)
        hq, hs = K.moe_fc1_swiglu_fma(a, a_s, w13, w13s, b13, ids)
        for tile in [""] + [t.strip() for t in args.fma_tiles.split(";") if t.strip()]:
            spec, _, nreg = tile.partition("@")
            env = {K.FMA_TILES_ENV: spec} if spec else {}
            if nreg:
                env[K.FMA_MAXNREG_ENV] = nreg
            os.environ.update(env)
            try:
                label = f"[{tile}]" if tile else "(shipped tiles)"
                report(f"fc1 fma {label}", m, fc1_bytes,
                       lambda j=None: K.moe_fc1_swiglu_fma(a, a_s, w13, w13s, b13, ids if j is None else ids_j[j]),
                       sets)
                report(f"fc2+combine fma {label}", m, fc2_bytes,
                       lambda j=None: K.moe_fc2_combine_fma(hq, hs, w2, w2s, b2, ids if j is None else ids_j[j], wts),
                       sets)
            except Exception as e:  # noqa: BLE001 - a tile that cannot compile or run is a result
                print(f"fma [{tile}]: error {type(e).__name__}: {str(e)[:200]}")
            finally:
                for key in env:
                    os.environ.pop(key)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps,
                                              "records": recs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
