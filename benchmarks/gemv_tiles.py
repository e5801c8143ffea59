"""One-token dense GEMV per path and tile, cold and hot (the GEMV's own limit against DRAM's).

For gpt-oss-120b's FP8 qkv (with its fused rotation, as the model calls it), o and lm_head, inside
CUDA graphs (no host launch gaps), per call:

    cold   the GEMV over weight copies rotating through >= 4 x the L2 size (each call reads DRAM,
           and L2 holds clean lines, as in a decode step)
    hot    the same GEMV on one copy again and again (its weight stays in L2; not for lm_head)

for the FMA GEMV (``--fma-tiles``: $VLLM_SM121_DENSE_FMA_TILES values, "" = the shipped tiles) and
the tensor-core GEMV (``--mmav-tiles``: $VLLM_SM121_DENSE_MMAV_TILES values), plus cuBLAS bf16 on the
bf16 weight (cold) as upstream's reference point. Prints µs, GB/s and % of the copy bandwidth
measured in the same run, checks each output against the FMA GEMV, and writes JSON (device,
versions, commit, config, records).

    python benchmarks/gemv_tiles.py --mmav-tiles "64,256,0,1,3;64,128,0,1,4" --out results/gemv.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "lm_head": (201088, 2880)}  # N, K
ROPE_ROWS, HEAD = 72 * 64, 64
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import l2_probe as probe  # noqa: E402  (its graph timer, and benchmarks/moe.py as probe._MOE)  # gpt-oss-120b: 64 q + 8 k heads of 64 are rotated


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qkv,o,lm_head")
    p.add_argument("--m", default="1", help="token counts, comma separated")
    p.add_argument("--fma-tiles", default="", help="';'-separated $VLLM_SM121_DENSE_FMA_TILES values; "
                   "'default' = the shipped tiles")
    p.add_argument("--mmav-tiles", default="", help="';'-separated $VLLM_SM121_DENSE_MMAV_TILES values "
                   "(rows,kb,split,warps,stages; split 0 = auto); 'default' = the shipped tiles")
    p.add_argument("--pdl", action="store_true", help="also time each FMA tile launched with PDL ($VLLM_SM121_PDL=1): "
                   "every GEMV of the chain a programmatic dependent of the one before")
    p.add_argument("--no-cublas", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="results/gemv_tiles.json")
    return p.parse_args(argv)


def _tiles(text: str) -> list[str]:
    return [t.strip() for t in text.split(";") if t.strip()]


def candidates(args) -> list[tuple[str, dict, str]]:
    """(path, env vars to set, label)."""
    from vllm_sm121.kernels import dense as D

    out = []
    for path, env, text in (("fma", D.DENSE_FMA_TILES_ENV, args.fma_tiles),
                            ("mmav", D.DENSE_MMAV_TILES_ENV, args.mmav_tiles)):
        for t in _tiles(text):
            tile = {} if t == "default" else {env: t}
            out.append((path, tile, t))
            if path == "fma" and args.pdl:
                out.append((path, {**tile, D.V.PDL_ENV: "1"}, t + "+pdl"))
    return out


def run(args, copy_gbps) -> list[dict]:
    from vllm_sm121.kernels import dense as D

    dev = torch.device("cuda")
    records = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        wbytes = n * k
        g = torch.Generator(device=dev).manual_seed(0)
        copies, ws, scales = probe.weight_copies(n, k, 1, dev, g)
        bias = torch.randn(n, device=dev, generator=g).bfloat16() if shape != "lm_head" else None
        ang = torch.rand(4096, HEAD // 2, device=dev, generator=g) * 6.3
        cache = torch.cat((ang.cos(), ang.sin()), dim=-1)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device=dev, generator=g).bfloat16()
            pos = torch.randint(0, 4096, (m,), device=dev, generator=g)
            moved = wbytes + 4 * n + 2 * m * k + 2 * m * n

            def gemv(i, path, x=x, pos=pos):
                if shape == "qkv":
                    return D.dense_fp8_linear_rope(x, ws[i], scales[i], bias, pos, cache, ROPE_ROWS, HEAD, path=path)
                return D.dense_fp8_linear(x, ws[i], scales[i], bias, path=path)

            ref = None
            for path, env, tile in candidates(args):
                if path == "fma" and m > D.DENSE_FMA_KERNEL_MAX_M:
                    continue
                os.environ.update(env)  # read by the launcher at call time
                try:
                    out = gemv(0, path)
                    if ref is None:
                        ref = out
                    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    # another path's bytes identical to the first path's: as if the kernel stored nothing
                    # into a recycled buffer that held the first path's output (flag, do not trust)
                    suspect = path != candidates(args)[0][0] and rel == 0.0
                    cold = probe._time_graph(lambda: [gemv(i, path) for i in range(copies)], args.reps) / copies
                    hot = (probe._time_graph(lambda: [gemv(0, path) for _ in range(max(copies, 8))], args.reps)
                           / max(copies, 8)) if shape != "lm_head" else None
                except Exception as e:  # noqa: BLE001 - a tile that cannot compile or run is a result
                    print(f"{shape} M={m} {path} [{tile}]: error {type(e).__name__}: {e}")
                    records.append(dict(shape=shape, m=m, path=path, tile=tile,
                                        error=f"{type(e).__name__}: {e}"[:300]))
                    continue
                finally:
                    for key in env:
                        os.environ.pop(key)
                gbps = moved / cold / 1e3
                records.append(dict(shape=shape, m=m, path=path, tile=tile, cold_us=cold, hot_us=hot,
                                    bytes=moved, gbps=gbps, pct_copy_bw=100 * gbps / copy_gbps,
                                    rel_vs_first=rel, suspect=suspect, copies=copies))
                print(f"{shape:<8}M={m:<3}{path:<5}[{tile:<20}] cold {cold:8.2f} us "
                      f"({gbps:6.0f} GB/s, {100 * gbps / copy_gbps:4.1f}% copy)  hot "
                      f"{'-' if hot is None else f'{hot:.2f}'} us  rel vs first {rel:.1e}{'  SUSPECT' if suspect else ''}",
                      flush=True)
            if not args.no_cublas and shape != "lm_head":
                wb = [(ws[i].float() * scales[i][:, None]).bfloat16() for i in range(copies)]
                bf_moved = 2 * wbytes + 2 * m * k + 2 * m * n
                cold = probe._time_graph(lambda: [torch.nn.functional.linear(x, wb[i], bias) for i in range(copies)],
                                   args.reps) / copies
                gbps = bf_moved / cold / 1e3
                records.append(dict(shape=shape, m=m, path="cublas_bf16", tile="-", cold_us=cold, bytes=bf_moved,
                                    gbps=gbps, pct_copy_bw=100 * gbps / copy_gbps, copies=copies))
                print(f"{shape:<8}M={m:<3}cuBLAS bf16 weight          cold {cold:8.2f} us ({gbps:6.0f} GB/s, "
                      f"{100 * gbps / copy_gbps:4.1f}% copy)", flush=True)
                del wb
        ws.clear()
    return records


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gemv_tiles.py needs a CUDA GPU")
        return 2
    copy_gbps = probe._MOE.measure_copy_bandwidth(torch.device("cuda"))
    head = probe._MOE.header(torch.device("cuda"), copy_gbps)
    print(f"device {head['device']}  copy bandwidth {copy_gbps:.0f} GB/s  commit {head['commit']}")
    return probe.write_results("gemv_tiles", head, run(args, copy_gbps), args)


if __name__ == "__main__":
    raise SystemExit(main())
