"""Dense linear benchmark, gpt-oss-120b qkv / o / lm_head: ours (``sm121``: FP8 e4m3 weights, bf16
activations) vs cuBLAS bf16 and vLLM 0.26's FP8 GEMMs, same card, same run.

Usage (needs a CUDA GPU with vLLM 0.26.0; without one it says so and exits 2)::

    python benchmarks/dense.py                          # qkv, o, lm_head x M = 1..64, every provider
    python benchmarks/dense.py --shapes qkv,o --m 1,8 --providers sm121,cublas_bf16 --reps 50
    python benchmarks/dense.py --dry-run                # CPU, Triton interpreter: tiny shapes, ours + torch

Shapes (gpt-oss-120b; weights [N, K], vLLM layout: output channels are rows)
    qkv      N = 5120 ((64 + 2 x 8) heads x 64), K = 2880, bias
    o        N = 2880, K = 4096 (64 heads x 64), bias
    lm_head  N = 201088, K = 2880, no bias
    Weights N(0, 0.02) in bf16, converted by each provider from the same numbers; x N(0, 1) bf16.

Providers
    sm121             ``kernels.dense.dense_fp8_linear``: e4m3 weights + one fp32 scale per output
                      channel, bf16 activations (what ``"dense_weights": "fp8"`` runs; path="auto":
                      the FMA GEMV for M <= 4, M <= 1 on lm_head, else the MMA kernel above;
                      $VLLM_SM121_DENSE_FMA_MAX_M overrides the limit, 0 = MMA only).
    sm121_fma         the same with path="fma" (the CUDA-core GEMV; M <= 4 only, larger M are
                      recorded "unavailable").
    sm121_mma         the same with path="mma" (the tl.dot kernel at every M).
                      ``--providers sm121_fma,sm121_mma`` times the two paths; sm121 records carry
                      the path "auto" took ("path").
    cublas_bf16       ``torch.nn.functional.linear`` on the bf16 weights (cuBLAS; stock vLLM).
    torch_scaled_mm   ``torch._scaled_mm`` row-wise: same e4m3 weights and per-channel scales, the
                      activations quantized per token (``vllm._custom_ops.scaled_fp8_quant``, timed).
    vllm_cutlass_fp8  ``vllm._custom_ops.cutlass_scaled_mm`` after ``scaled_fp8_quant`` per token (both
                      timed): vLLM's W8A8 FP8 path for per-channel checkpoints on sm_90.
    vllm_fp8_marlin   ``marlin_utils_fp8.apply_fp8_marlin_linear`` on ``prepare_fp8_layer_for_marlin``'s
                      repack of the same e4m3 weights (weight-only FP8, bf16 activations: vLLM's path on
                      GPUs without FP8 tensor cores).
    A provider that cannot run on the card gets a record "unavailable: <reason>".

Timing
    One CUDA graph per (provider, shape, M) holding R calls that rotate over C copies of the
    weights, C x weight bytes >= 4 x the L2 size (qkv's 29.5 MB bf16 / 14.7 MB e4m3 would
    otherwise stay in the 50 MB L2 of an H100), R >= 16; CUDA events around each replay;
    p20/p50/p80 over --reps of replay time / R. Bytes moved (the format's minimum): weights + per-row scales + bias +
    activations in (bf16) + output (bf16). % of copy bandwidth: bytes / p50 over a
    device-to-device 1 GiB copy measured in this run ((read + written) / time).

Correctness (default on): rel L2 of each output vs the fp32 product with the provider's own
dequantized weights and vs the bf16 weights.

Output: a table and JSON (--out, default results/dense.json): header (device, capability,
versions, commit from VLLM_SM121_COMMIT or git, copy bandwidth, L2 size, config) + one record per
(provider, shape, M).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qkv": (5120, 2880, True), "o": (2880, 4096, True), "lm_head": (201088, 2880, False)}  # N, K, bias
DRY_SHAPES = {"qkv": (80, 64, True), "o": (64, 64, True), "lm_head": (200, 64, False)}
PROVIDERS = ("sm121", "sm121_fma", "sm121_mma", "sm121_mmav", "cublas_bf16", "torch_scaled_mm", "vllm_cutlass_fp8",
             "vllm_fp8_marlin")
SWEEP_MAX_REL_L2 = 1e-2  # a swept tile whose output is farther from its reference is a "mismatch"
DEFAULT_M = (1, 2, 4, 8, 16, 32, 64)
MIN_CALLS = 16
FMA_MAX_M = 4  # kernels.dense.DENSE_FMA_KERNEL_MAX_M (not imported here: the module loads without vLLM)
MMAV_MAX_M = 32  # kernels.dense.DENSE_MMAV_KERNEL_MAX_M (likewise)
L2_MULTIPLE = 4
NO_CUDA_MESSAGE = "benchmarks/dense.py needs a CUDA GPU (use --dry-run on the CPU)"


def _load_moe_bench():
    """benchmarks/moe.py's header / copy-bandwidth / percentile helpers (one house style)."""
    spec = importlib.util.spec_from_file_location("sm121_bench_moe", Path(__file__).with_name("moe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_moe = _load_moe_bench()
measure_copy_bandwidth, pct = _moe.measure_copy_bandwidth, _moe.pct


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default=None,
                    help=f"token counts, comma separated (default {','.join(map(str, DEFAULT_M))})")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-refcheck", dest="refcheck", action="store_false")
    ap.add_argument("--out", default=str(REPO_ROOT / "results" / "dense.json"))
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes: sm121 and torch")
    ap.add_argument("--fma-tiles", default="",
                    help="FMA GEMV tile sweep after the table: 'rows,kw,warps;...' ($VLLM_SM121_DENSE_FMA_TILES "
                         "format), each timed as provider sm121_fma at every M <= 4 of --m and every shape")
    args = ap.parse_args(argv)
    args.m = [int(x) for x in (args.m.split(",") if args.m else DEFAULT_M)]
    if args.dry_run:
        args.m = [m for m in args.m if m <= 8] or [1]
        args.reps = 1
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.providers = [p for p in args.providers.split(",") if p]
    for what, got, known in (("shapes", args.shapes, SHAPES), ("providers", args.providers, PROVIDERS)):
        bad = sorted(set(got) - set(known))
        if bad:
            ap.error(f"unknown {what} {bad}; supported: {', '.join(known)}")
    args.fma_tiles = [t.strip() for t in args.fma_tiles.split(";") if t.strip()]
    if args.fma_tiles:
        from vllm_sm121.kernels.dense import DenseFmaTiles

        for t in args.fma_tiles:
            try:
                DenseFmaTiles.parse(t)
            except (TypeError, ValueError) as e:
                ap.error(f"--fma-tiles {t!r}: {e}")
    return args


# ---- weights and providers ----------------------------------------------------------------------

def weight_bytes(provider: str, n: int, k: int, bias: bool) -> int:
    """Bytes of weights + scales + bias one call reads (the format's minimum)."""
    if provider == "cublas_bf16":
        return 2 * n * k + (2 * n if bias else 0)
    scale = 2 * n if provider == "vllm_fp8_marlin" else 4 * n  # marlin keeps bf16 scales
    return n * k + scale + (2 * n if bias else 0)


def bytes_moved(provider: str, n: int, k: int, bias: bool, m: int) -> int:
    return weight_bytes(provider, n, k, bias) + 2 * m * k + 2 * m * n


def make_weights(n: int, k: int, bias: bool, device, seed: int) -> dict:
    from vllm_sm121.kernels.dense import fp8_per_channel_quantize

    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(n, k, generator=g, device=device) * 0.02).bfloat16()
    codes, scale = fp8_per_channel_quantize(w)
    b = (torch.randn(n, generator=g, device=device) * 0.02).bfloat16() if bias else None
    return {"w": w, "codes": codes, "scale": scale, "bias": b}


def _copies(provider: str, n: int, k: int, bias: bool, l2_bytes: int | None) -> int:
    if not l2_bytes:
        return 1
    return max(2, math.ceil(L2_MULTIPLE * l2_bytes / weight_bytes(provider, n, k, bias)))


def _sets(wts: dict, keys: tuple[str, ...], copies: int, clone_first: bool = False) -> list[dict]:
    """``copies`` dicts of the named tensors: the first shares ``wts``' tensors unless ``clone_first``."""
    def one(i):
        return {key: (wts[key].clone() if (i or clone_first) and wts[key] is not None else wts[key]) for key in keys}

    return [one(i) for i in range(copies)]


def _quant_act(x: torch.Tensor):
    from vllm import _custom_ops as ops

    return ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)


def make_provider(provider: str, wts: dict, copies: int):
    """(fn(x, i) -> bf16 [M, N] using weight copy i % copies, dequantized fp32 weights, info)."""
    from vllm_sm121.kernels.dense import dense_fp8_linear, fp8_per_channel_dequantize

    if provider == "cublas_bf16":
        sets = _sets(wts, ("w", "bias"), copies)
        return (lambda x, i: torch.nn.functional.linear(x, sets[i]["w"], sets[i]["bias"]), None,
                "bf16 W x bf16 A, torch F.linear (cuBLAS)")
    deq8 = fp8_per_channel_dequantize(wts["codes"], wts["scale"])
    sets = _sets(wts, ("codes", "scale", "bias"), copies, clone_first=provider == "vllm_fp8_marlin")
    if provider == "sm121":
        return (lambda x, i: dense_fp8_linear(x, sets[i]["codes"], sets[i]["scale"], sets[i]["bias"]), deq8,
                "e4m3 W x bf16 A, Triton (kernels/dense.py, path=auto)")
    if provider == "sm121_mma":
        return (lambda x, i: dense_fp8_linear(x, sets[i]["codes"], sets[i]["scale"], sets[i]["bias"], path="mma"),
                deq8, "e4m3 W x bf16 A, Triton MMA kernel (kernels/dense.py, path=mma)")
    if provider == "sm121_mmav":  # the tensor-core split-K GEMV, M <= 32 (kernels.dense.DENSE_MMAV_KERNEL_MAX_M)
        return (lambda x, i: dense_fp8_linear(x, sets[i]["codes"], sets[i]["scale"], sets[i]["bias"], path="mmav"),
                deq8, "e4m3 W x bf16 A (fp16 MMAs), Triton split-K tensor-core GEMV (kernels/dense.py, path=mmav)")
    if provider == "sm121_fma":
        return (lambda x, i: dense_fp8_linear(x, sets[i]["codes"], sets[i]["scale"], sets[i]["bias"], path="fma"),
                deq8, "e4m3 W x bf16 A, Triton CUDA-core GEMV (kernels/dense.py, path=fma)")
    if provider == "torch_scaled_mm":
        for s in sets:
            s["wt"], s["sb"] = s["codes"].t(), s["scale"].view(1, -1)

        def scaled_mm(x, i):
            s = sets[i]
            xq, xs = _quant_act(x)
            return torch._scaled_mm(xq, s["wt"], scale_a=xs, scale_b=s["sb"], bias=s["bias"], out_dtype=torch.bfloat16)

        return scaled_mm, deq8, "e4m3 W x e4m3 A (per-token quant timed), torch._scaled_mm row-wise"
    if provider == "vllm_cutlass_fp8":
        from vllm import _custom_ops as ops

        cap = torch.cuda.get_device_capability()
        if not ops.cutlass_scaled_mm_supports_fp8(cap[0] * 10 + cap[1]):
            raise RuntimeError(f"cutlass_scaled_mm_supports_fp8({cap}) is False")
        for s in sets:
            s["wt"], s["sb"] = s["codes"].t(), s["scale"].view(-1, 1)

        def cutlass(x, i):
            s = sets[i]
            xq, xs = _quant_act(x)
            return ops.cutlass_scaled_mm(xq, s["wt"], xs, s["sb"], torch.bfloat16, s["bias"])

        return cutlass, deq8, "e4m3 W x e4m3 A (per-token quant timed), vLLM cutlass_scaled_mm"
    if provider == "vllm_fp8_marlin":
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import (
            apply_fp8_marlin_linear,
            prepare_fp8_layer_for_marlin,
        )

        layers = []
        n, k = wts["codes"].shape
        for s in sets:
            layer = torch.nn.Module()
            layer.output_size_per_partition, layer.input_size_per_partition = n, k
            layer.orig_dtype = torch.bfloat16
            layer.register_parameter("weight", torch.nn.Parameter(s.pop("codes"), requires_grad=False))
            layer.register_parameter("weight_scale", torch.nn.Parameter(s.pop("scale"), requires_grad=False))
            b = s.pop("bias")
            layer.register_parameter("bias", torch.nn.Parameter(b, requires_grad=False) if b is not None else None)
            prepare_fp8_layer_for_marlin(layer, size_k_first=False)
            layers.append(layer)
        sets.clear()

        def marlin(x, i):
            lay = layers[i]
            return apply_fp8_marlin_linear(x, lay.weight, lay.weight_scale, lay.workspace, n, k, lay.bias)

        return marlin, deq8, "e4m3 W x bf16 A, vLLM FP8 Marlin (weight-only)"
    raise ValueError(f"unknown provider {provider!r}; supported: {', '.join(PROVIDERS)}")


# ---- timing -------------------------------------------------------------------------------------

def time_rotating_graph(fn, copies: int, reps: int) -> tuple[list[float], torch.Tensor]:
    """µs per call: one graph of R >= MIN_CALLS calls over the weight copies, timed per replay."""
    calls = copies * math.ceil(MIN_CALLS / copies)
    out = fn(0)  # compile / autotune
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(i % copies) for i in range(calls)]
    graph.replay()  # warm
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return times, outs[0] if outs else out


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


# ---- run ----------------------------------------------------------------------------------------

def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def run(args, device) -> tuple[list[dict], dict]:
    cuda = device.type == "cuda"
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if cuda else None
    records = []
    for si, name in enumerate(args.shapes):
        n, k, bias = shapes[name]
        wts = make_weights(n, k, bias, device, seed=si)
        for p in args.providers:
            base = {"provider": p, "shape": name, "n": n, "k": k, "bias": bias}
            if not cuda and p not in ("sm121", "sm121_fma", "sm121_mma", "cublas_bf16"):
                records += [{**base, "m": m, "status": "unavailable: needs CUDA"} for m in args.m]
                continue
            copies = _copies(p, n, k, bias, l2)
            try:
                fn, deq, info = make_provider(p, wts, copies)
            except Exception as e:  # noqa: BLE001 - a provider that cannot run on this card is a result
                records += [{**base, "m": m, "status": f"unavailable: {_short(e)}"} for m in args.m]
                continue
            for m in args.m:
                if p == "sm121_fma" and m > FMA_MAX_M:
                    records.append({**base, "m": m, "status": f"unavailable: path=fma takes M <= {FMA_MAX_M}"})
                    continue
                if p == "sm121_mmav" and m > MMAV_MAX_M:
                    records.append({**base, "m": m, "status": f"unavailable: path=mmav takes M <= {MMAV_MAX_M}"})
                    continue
                g = torch.Generator(device=device).manual_seed(1000 + m)
                x = torch.randn(m, k, generator=g, device=device).bfloat16()
                nbytes = bytes_moved(p, n, k, bias, m)
                rec = {**base, "m": m, "bytes": nbytes, "weight_copies": copies, "info": info}
                if p == "sm121":
                    from vllm_sm121 import platform as sm121_platform
                    from vllm_sm121.kernels.dense import select_path

                    rec["path"] = select_path(m, n, sm121_platform.family_of(x))
                try:
                    if cuda:
                        times, out = time_rotating_graph(lambda i: fn(x, i), copies, args.reps)  # noqa: B023
                    else:
                        t0 = time.perf_counter()
                        out = fn(x, 0)
                        times = [(time.perf_counter() - t0) * 1e6]
                except Exception as e:  # noqa: BLE001
                    records.append({**rec, "status": f"error: {_short(e)}"})
                    continue
                p50 = pct(times, 0.5)
                rec.update(status="ok", us_p20=pct(times, 0.2), us_p50=p50, us_p80=pct(times, 0.8),
                           gbps=nbytes / p50 / 1e3)
                if args.refcheck:
                    b = wts["bias"].float() if bias else 0.0
                    if deq is not None:
                        rec["rel_l2_vs_own_weights"] = rel_l2(out, x.float() @ deq.T + b)
                    rec["rel_l2_vs_bf16"] = rel_l2(out, x.float() @ wts["w"].float().T + b)
                records.append(rec)
            fn = deq = None
            if cuda:
                torch.cuda.empty_cache()
        del wts
    return records, {"l2_cache_bytes": l2}


def sweep_fma_tiles(args, device) -> list[dict]:
    """--fma-tiles: provider sm121_fma under each tile ($VLLM_SM121_DENSE_FMA_TILES, read per call,
    so each captured graph holds that tile's kernel); records carry "tile"."""
    import argparse as _argparse
    import os

    from vllm_sm121.kernels.dense import DENSE_FMA_TILES_ENV

    sub = _argparse.Namespace(**{**vars(args), "providers": ["sm121_fma"],
                                 "m": [m for m in args.m if m <= FMA_MAX_M] or [1]})
    old = os.environ.get(DENSE_FMA_TILES_ENV)
    records = []
    try:
        for tile in args.fma_tiles:
            os.environ[DENSE_FMA_TILES_ENV] = tile
            for r in run(sub, device)[0]:
                if r.get("status") == "ok" and r.get("rel_l2_vs_own_weights", 0.0) > SWEEP_MAX_REL_L2:
                    r["status"] = f"mismatch: rel L2 {r['rel_l2_vs_own_weights']:.2e} vs its reference"
                records.append(dict(r, tile=tile))
    finally:
        if old is None:
            os.environ.pop(DENSE_FMA_TILES_ENV, None)
        else:
            os.environ[DENSE_FMA_TILES_ENV] = old
    return records


def print_sweep(records: list[dict], copy_gbps: float | None) -> None:
    print("\nFMA GEMV tile sweep (rows,kw,warps): us (% copy BW)")
    best: dict[tuple[str, int], dict] = {}
    for r in records:
        if r.get("status") != "ok":
            print(f"  {r['tile']:<12} {r['shape']:<8} M={r['m']}: {r.get('status')}")
            continue
        bw = f" ({100 * r['gbps'] / copy_gbps:.0f}%)" if copy_gbps else ""
        print(f"  {r['tile']:<12} {r['shape']:<8} M={r['m']}  {r['us_p50']:8.1f}{bw}")
        key = (r["shape"], r["m"])
        if key not in best or r["us_p50"] < best[key]["us_p50"]:
            best[key] = r
    for (shape, m), r in sorted(best.items()):
        print(f"fastest FMA tile for {shape} M={m}: {r['tile']} ({r['us_p50']:.1f} us)")


def print_table(records: list[dict], args, copy_gbps: float | None) -> None:
    cols = args.providers
    print(f"\n{'shape':<8}{'M':>4}  " + "".join(f"{p:>22}" for p in cols) + "   sm121 vs cuBLAS bf16")
    print(f"{'':<8}{'':>4}  " + "".join(f"{'us (% copy BW)':>22}" for _ in cols))
    by = {(r["shape"], r["m"], r["provider"]): r for r in records}
    for shape in args.shapes:
        for m in args.m:
            cells = []
            for p in cols:
                r = by.get((shape, m, p), {})
                if r.get("status") != "ok":
                    cells.append(f"{(r.get('status') or '-')[:20]:>22}")
                    continue
                bw = f" ({100 * r['gbps'] / copy_gbps:4.0f}%)" if copy_gbps else ""
                cells.append(f"{r['us_p50']:>14.1f}{bw:>8}")
            ours, cub = by.get((shape, m, "sm121"), {}), by.get((shape, m, "cublas_bf16"), {})
            speed = (f"{cub['us_p50'] / ours['us_p50']:.2f}x" if ours.get("status") == cub.get("status") == "ok"
                     else "-")
            print(f"{shape:<8}{m:>4}  " + "".join(cells) + f"   {speed:>8}")
    bad = [r for r in records if r.get("status") not in ("ok", None) and r["provider"] != "sm121"]
    for r in {r["provider"]: r for r in bad}.values():
        print(f"  {r['provider']}: {r['status']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = _moe.pick_device(args.dry_run, NO_CUDA_MESSAGE)
    if device is None:
        return 2
    copy_gbps = measure_copy_bandwidth(device) if device.type == "cuda" else None
    head = _moe.header(device, copy_gbps)
    head["benchmark"] = "dense"
    records, extra = run(args, device)
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    head.update(extra, dry_run=args.dry_run, config={
        "shapes": {s: dict(zip(("n", "k", "bias"), shapes[s])) for s in args.shapes}, "m": args.m,
        "providers": args.providers, "reps": args.reps, "min_calls_per_replay": MIN_CALLS,
        "weight_rotation": f">= {L2_MULTIPLE} x L2 bytes of weight copies per graph",
        "stat": "p20/p50/p80 of replay time / calls, CUDA events",
        "bytes": "weights + per-row scales + bias + 2*M*K activations + 2*M*N output"})
    print(f"device {head['device']}  capability {head['capability']}  copy bandwidth "
          f"{copy_gbps or float('nan'):.0f} GB/s  L2 {extra['l2_cache_bytes']}  commit {head['commit']}")
    print_table(records, args, copy_gbps)
    if args.fma_tiles:
        sweep = sweep_fma_tiles(args, device)
        print_sweep(sweep, copy_gbps)
        records += sweep
        head["config"]["fma_tiles"] = args.fma_tiles
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"header": head, "records": records}, indent=1))
    print(f"wrote {out_path}")
    # exit 1 when the shipped path (sm121) or a swept tile failed or mismatched
    return 1 if any(r.get("status") != "ok" and (r["provider"] == "sm121" or "tile" in r) for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
