"""Sweep paged-attention tile configurations on the current GPU; print the best per point.

Feeds the tables in ``vllm_sm121/platform.py`` (sm_90 numbers are measured with this script;
sm_12x has no GPU here). gpt-oss layer shape: 64 q heads, 8 KV heads, head_dim 64, sinks, full
and 128-token sliding-window layers. Timing: ``benchmarks/attention.py``'s Timer (cold L2, launch
cost hidden behind a GPU sleep, so the numbers are GPU time only), median.

    python benchmarks/tune_attention.py [--out tune.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch


def setup(batch, ctx, q_len, window, device="cuda", block_size=16, hq=64, hkv=8, d=64):
    g = torch.Generator(device="cpu").manual_seed(0)
    pages = math.ceil(ctx / block_size)
    num_blocks = batch * pages + 1
    kv = torch.randn(num_blocks, 2, hkv, block_size, d, generator=g).to(device, torch.bfloat16)
    bt = (torch.randperm(num_blocks - 1, generator=g)[: batch * pages] + 1).view(batch, pages).int().to(device)
    q = torch.randn(batch * q_len, hq, d, generator=g).to(device, torch.bfloat16)
    qsl = (torch.arange(batch + 1, dtype=torch.int32) * q_len).to(device)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    sinks = torch.randn(hq, generator=g).to(device)
    return dict(q=q, key_cache=kv[:, 0], value_cache=kv[:, 1], block_table=bt, query_start_loc=qsl,
                seq_lens=seq_lens, max_query_len=q_len, max_seq_len=ctx, scale=0.125,
                sliding_window=window, sinks=sinks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/tune_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import statistics

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from attention import Timer  # noqa: E402  (benchmarks/attention.py)

    from vllm_sm121.kernels.paged_attention import choose_num_splits, paged_attention
    from vllm_sm121.platform import AttnTile, family_of

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    decode_points = [(b, c, None) for b in (1, 8, 32) for c in (2048, 8192, 32768)] + [(b, 8192, 128) for b in (1, 8, 32)]
    prefill_points = [(1, 2048, 2048, None), (1, 2048, 2048, 128), (1, 32768, 2048, None)]
    if args.quick:
        decode_points = [(1, 8192, None), (8, 8192, None), (32, 2048, 128)]
        prefill_points = prefill_points[:1]
    records = []

    timer = Timer("cuda", reps=10 if args.quick else 20)

    def bench(inputs, tile, splits):
        fn = lambda: paged_attention(**inputs, tile=tile, num_splits=splits)  # noqa: E731
        try:
            fn()
            return statistics.median(timer.run(fn, host_us=timer.host_us(fn, n=2)))
        except Exception as e:  # out of resources etc.
            return float("inf") if "OutOfResources" in type(e).__name__ or "resources" in str(e) else _raise(e)

    def _raise(e):
        raise e

    print(f"device {torch.cuda.get_device_name()} family {family_of(torch.empty(1, device='cuda'))} SMs {sms}")
    for batch, ctx, window in decode_points:
        inputs = setup(batch, ctx, 1, window)
        auto = choose_num_splits(num_seqs=batch, num_kv_heads=8, max_query_len=1,
                                 max_seq_len=ctx, num_q_per_kv=8, sm_count=sms)
        results = []
        for tile_n, warps, stages in itertools.product((32, 64, 128), (2, 4), (2, 3)):
            for splits in sorted({max(1, auto // 2), auto, min(64, auto * 2), min(64, auto * 4)}):
                t = bench(inputs, AttnTile(16, tile_n, warps, stages), splits)
                results.append((t, tile_n, warps, stages, splits))
        results.sort()
        best = results[0]
        default = bench(inputs, None, None)
        print(f"decode b{batch} ctx{ctx} w{window}: best {best[0]:.1f} us tile_n={best[1]} warps={best[2]} "
              f"stages={best[3]} splits={best[4]} (auto splits {auto}); current defaults {default:.1f} us")
        records.append(dict(kind="decode", batch=batch, ctx=ctx, window=window, default_us=default,
                            top5=[dict(us=r[0], tile_n=r[1], warps=r[2], stages=r[3], splits=r[4]) for r in results[:5]]))
        del inputs
    for batch, ctx, q_len, window in prefill_points:
        inputs = setup(batch, ctx, q_len, window)
        results = []
        for block_m, tile_n, warps, stages in itertools.product((64, 128), (32, 64), (4, 8), (2, 3)):
            t = bench(inputs, AttnTile(block_m, tile_n, warps, stages), 1)
            results.append((t, block_m, tile_n, warps, stages))
        results.sort()
        best = results[0]
        default = bench(inputs, None, None)
        print(f"prefill ctx{ctx} q{q_len} w{window}: best {best[0]:.1f} us block_m={best[1]} tile_n={best[2]} "
              f"warps={best[3]} stages={best[4]}; current defaults {default:.1f} us")
        records.append(dict(kind="prefill", batch=batch, ctx=ctx, q_len=q_len, window=window, default_us=default,
                            top5=[dict(us=r[0], block_m=r[1], tile_n=r[2], warps=r[3], stages=r[4]) for r in results[:5]]))
        del inputs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
