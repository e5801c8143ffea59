"""Sweep decode tiles (and the nvfp4 page-load variant) for quantized KV caches on this GPU.

For gpt-oss decode (64 q / 8 KV heads, head_dim 64, sinks, full attention) at a few batch/context
points, times SM121's paged attention with bf16, fp8 and nvfp4 pages over a small tile grid
and, for nvfp4, the page loads (``NVFP4_VEC``: contiguous rows transposed in registers, or
strided gathers), the inline-PTX decode (``NVFP4_ASM``, with gathers) and the 32-bit word
loads with the e4m3-byte decode (``NVFP4_WORDS``, "words"); prints µs, KV bytes read
and % of the copy bandwidth measured in the same run, the best per (kv dtype, point), and the
speed-up of the best fp8/nvfp4 over the best bf16. Feeds ``platform.py`` / ``NVFP4_VEC`` / ``NVFP4_ASM`` / ``NVFP4_WORDS``.

    python benchmarks/tune_kv.py [--out tune_kv.json] [--quick]
    python benchmarks/tune_kv.py --prefill [--out tune_kv_prefill.json]

``--prefill``: instead, the last 4096-token chunk of a 32768-token prompt (batch 1; full
attention, and a 128-token window) over a grid of prefill tiles, bf16 vs fp8 vs nvfp4 pages with
the default nvfp4 decode: µs and query tokens/s, the best per (kv dtype, point). Feeds the
``prefill*`` / ``prefill*_nvfp4`` entries of ``platform.ATTN_TILES`` (long-context prefill with
nvfp4 pages measured 1.9x slower than FA3 end to end, README).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HQ, HKV, D, BS = 64, 8, 64, 16


def _pages(kv_dtype, inputs):
    """Replace bf16 key/value caches in ``inputs`` by fp8 (scale 1) or nvfp4 pages of the same values."""
    from vllm_sm121.kernels.fp4_kv import Nvfp4Pages, nvfp4_full_dim
    from vllm_sm121.kernels.nvfp4 import nvfp4_quantize

    k, v = inputs["key_cache"], inputs["value_cache"]
    if kv_dtype == "fp8":
        one = torch.ones(1, device=k.device)
        return dict(inputs, key_cache=k.to(torch.float8_e4m3fn), value_cache=v.to(torch.float8_e4m3fn),
                    k_scale=one, v_scale=one), 1.0
    if kv_dtype == "nvfp4":
        nb = k.shape[0]
        cache = torch.zeros(nb, 2, HKV * BS * nvfp4_full_dim(D), dtype=torch.uint8, device=k.device)
        pages = []
        for i, x in enumerate((k, v)):
            g = (x.abs().amax().float() * 64 / (6 * 448)).reshape(1)
            p = Nvfp4Pages.view(cache[:, i], HKV, BS, D, g)
            packed, sc = nvfp4_quantize(x.reshape(-1, D), g)
            p.data.copy_(packed.view(nb, HKV, BS, D // 2))
            p.scales.view(torch.uint8).copy_(sc.view(torch.uint8).view(nb, HKV, BS, D // 16))
            pages.append(p)
        return dict(inputs, key_cache=pages[0], value_cache=pages[1]), nvfp4_full_dim(D) / D
    return inputs, 2.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prefill", action="store_true", help="sweep prefill tiles at long context instead")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/tune_kv.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from attention import Timer, measure_copy_bandwidth  # benchmarks/attention.py
    from tune_attention import setup

    from vllm_sm121.kernels.paged_attention import choose_num_splits, paged_attention
    from vllm_sm121.platform import AttnTile

    pa = sys.modules["vllm_sm121.kernels.paged_attention"]
    defaults = (pa.NVFP4_VEC, pa.NVFP4_ASM, pa.NVFP4_WORDS)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = measure_copy_bandwidth(torch.device("cuda"))["gbps"] * 1e9
    points = [(8, 32768), (32, 32768), (1, 131072)] if not args.quick else [(32, 32768)]
    tiles = [AttnTile(16, n, w, s) for n, w, s in ((128, 4, 3), (64, 4, 3), (128, 8, 3), (256, 8, 2))]
    timer = Timer("cuda", reps=20)
    records = []
    print(f"device {torch.cuda.get_device_name()}  SMs {sms}  copy bandwidth {bw / 1e9:.0f} GB/s")
    if args.prefill:
        points, tiles = [], []
        records = _prefill_sweep(paged_attention, setup, timer, AttnTile)
    for batch, ctx in points:
        base = setup(batch, ctx, 1, None)
        splits = choose_num_splits(num_seqs=batch, num_kv_heads=HKV, max_query_len=1, max_seq_len=ctx,
                                   num_q_per_kv=HQ // HKV, sm_count=sms)
        best = {}
        for kv in ("bf16", "fp8", "nvfp4"):
            inputs, elem = _pages(kv, base)
            kv_bytes = 2 * batch * ctx * HKV * D * elem
            for tile, variant in itertools.product(tiles, ("gather", "vec", "asm", "words") if kv == "nvfp4" else ("-",)):
                pa.NVFP4_VEC = variant == "vec"
                pa.NVFP4_ASM = variant in ("asm", "words")
                pa.NVFP4_WORDS = variant == "words"
                fn = lambda: paged_attention(**inputs, tile=tile, num_splits=splits)  # noqa: E731
                try:
                    fn()
                    us = statistics.median(timer.run(fn, host_us=timer.host_us(fn, n=2)))
                except Exception as e:  # noqa: BLE001 (out of shared memory for a tile, etc.)
                    us, err = float("inf"), f"{type(e).__name__}: {str(e)[:80]}"
                else:
                    err = None
                rec = dict(batch=batch, ctx=ctx, kv=kv, tile=dataclasses.astuple(tile), variant=variant, splits=splits,
                           us=us, kv_bytes=kv_bytes, pct_bw=100 * kv_bytes / (us * 1e-6) / bw if us < float("inf")
                           else None, error=err)
                records.append(rec)
                if us < best.get(kv, (float("inf"),))[0]:
                    best[kv] = (us, tile, variant)
                print(f"B={batch:<3} ctx={ctx:<7} {kv:<6} tile={dataclasses.astuple(tile)} {variant}: "
                      + (f"{us:8.1f} us  {rec['pct_bw']:5.1f}% BW" if err is None else err), flush=True)
        pa.NVFP4_VEC, pa.NVFP4_ASM, pa.NVFP4_WORDS = defaults
        b16 = best["bf16"][0]
        print(f"== B={batch} ctx={ctx}: best " + "  ".join(
            f"{kv} {us:.1f} us tile={dataclasses.astuple(t)} variant={h} ({b16 / us:.2f}x bf16)" for kv, (us, t, h) in best.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "commit": os.environ.get(
                "VLLM_SM121_COMMIT", "unknown"), "records": records}, f, indent=1, default=str)
    return 0


PREFILL_TILES = ((64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 4, 2), (128, 64, 4, 2), (64, 32, 4, 2), (64, 128, 4, 2))


def _prefill_sweep(paged_attention, setup, timer, AttnTile, ctx=32768, chunk=4096) -> list:
    """Long-context chunked prefill: the last ``chunk`` queries of a ``ctx``-token prompt."""
    records = []
    for window in (None, 128):
        base = setup(1, ctx, chunk, window)
        best = {}
        for kv in ("bf16", "fp8", "nvfp4"):
            inputs, _ = _pages(kv, base)
            for t in PREFILL_TILES:
                tile = AttnTile(*t)
                fn = lambda: paged_attention(**inputs, tile=tile, num_splits=1)  # noqa: E731
                try:
                    fn()
                    us, err = statistics.median(timer.run(fn, host_us=timer.host_us(fn, n=2))), None
                except Exception as e:  # noqa: BLE001 (out of shared memory for a tile, etc.)
                    us, err = float("inf"), f"{type(e).__name__}: {str(e)[:80]}"
                records.append(dict(kind="prefill", window=window, ctx=ctx, chunk=chunk, kv=kv, tile=t, us=us,
                                    tok_s=chunk / (us * 1e-6) if err is None else None, error=err))
                if us < best.get(kv, (float("inf"),))[0]:
                    best[kv] = (us, t)
                print(f"prefill ctx={ctx} chunk={chunk} window={window} {kv:<6} tile={t}: "
                      + (f"{us:9.1f} us  {chunk / (us * 1e-6):12,.0f} tok/s" if err is None else err), flush=True)
        b16 = best["bf16"][0]
        print(f"== prefill window={window}: best " + "  ".join(
            f"{kv} {us:.1f} us tile={t} ({b16 / us:.2f}x bf16)" for kv, (us, t) in best.items()))
    return records


if __name__ == "__main__":
    sys.exit(main())
