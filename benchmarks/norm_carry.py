"""gpt-oss-120b's layer boundary at decode, with and without the carried input norm (kernels/next_norm.py).

One boundary is what runs between the experts' FC1 output and the next layer's attention:

    upstream order   FC2 + combine (the plugin's FMA GEMV) -> add + RMSNorm (Inductor's kernel of
                     vLLM's ``fused_add_rms_norm``, torch.compile'd as vLLM compiles the model)
                     -> the qkv FMA GEMV with the rotation in its epilogue
    carried          FC2 + combine writing the next residual, bf16(s * w) and the sums of s**2 ->
                     the qkv GEMV reading them (no norm kernel)

Each variant is captured in a CUDA graph of ``--layers`` boundaries, each on its own weights (so
every call reads its weights from DRAM, as in the decode step), and replayed ``--reps`` times;
the table gives µs per boundary (median over replays, ``l2_probe._time_graph``) and the bytes the two GEMVs read per
boundary against the card's copy bandwidth measured in the same run. JSON (``--out``): device,
versions, commit, config, records.

    python benchmarks/norm_carry.py --m 1,4 --out results/norm_carry.json
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
H, I, E, TOPK, HEADS_Q, HEADS_KV, HEAD = 2880, 2880, 4, 4, 64, 8, 64  # 4 experts: every token routes to all 4


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_{name}_bench", REPO_ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", default="1,4", help="tokens (comma list, each <= 4)")
    p.add_argument("--layers", type=int, default=24, help="boundaries per graph, each on its own weights")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default="results/norm_carry.json")
    return p.parse_args(argv)


def _layer(g, device):
    from vllm_sm121.kernels import dense as D
    from vllm_sm121.kernels.next_norm import NextNormBuffers

    n = (HEADS_Q + 2 * HEADS_KV) * HEAD
    q, s = D.fp8_per_channel_quantize((torch.randn(n, H, generator=g) * 0.05).bfloat16())
    return dict(
        w2=torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8).to(device),
        w2_scale=torch.randint(118, 122, (E, H, I // 32), generator=g, dtype=torch.uint8).to(device),
        b2=(torch.randn(E, H, generator=g) * 0.5).bfloat16().to(device),
        qkv=q.to(device), qkv_scale=s.to(device), qkv_bias=torch.randn(n, generator=g).bfloat16().to(device),
        norm_w=(1 + 0.1 * torch.randn(H, generator=g)).bfloat16().to(device),
        bufs=NextNormBuffers.alloc(H, device))


def _add_norm(x, r, w):
    """vLLM 0.26's ``fused_add_rms_norm`` (vllm/ir/ops/layernorm.py), which Inductor turns into one kernel."""
    s = x.float() + r.float()
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    return y.to(w.dtype) * w, s.to(x.dtype)


def run(args):
    from vllm_sm121.kernels import dense as D
    from vllm_sm121.kernels import moe as K
    from vllm_sm121.kernels.next_norm import NextNorm
    from vllm_sm121.kernels.norm_mxfp8 import mxfp8_quantize_torch

    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    layers = [_layer(g, device) for _ in range(args.layers)]
    add_norm = torch.compile(_add_norm, dynamic=False)
    cache = torch.rand(4096, HEAD, generator=g).to(device)
    records = []
    for m in (int(v) for v in args.m.split(",")):
        h, h_scale = mxfp8_quantize_torch(torch.randn(m * TOPK, I, generator=g))
        h, h_scale = h.to(device), h_scale.to(device)
        ids = torch.arange(TOPK, dtype=torch.int32).repeat(m, 1).to(device)
        tw = torch.softmax(torch.randn(m, TOPK, generator=g), -1).to(device)
        pos = torch.randint(0, 4096, (m,), generator=g).to(device)
        residual = torch.randn(m, H, generator=g).bfloat16().to(device)
        rope_rows = (HEADS_Q + HEADS_KV) * HEAD

        def upstream():
            for L in layers:
                out = K.moe_fc2_combine_fma(h, h_scale, L["w2"], L["w2_scale"], L["b2"], ids, tw)
                y, _ = add_norm(out, residual, L["norm_w"])
                D.dense_fp8_linear_rope(y, L["qkv"], L["qkv_scale"], L["qkv_bias"], pos, cache, rope_rows, HEAD,
                                        path="fma")

        def carried():
            for L in layers:
                K.moe_fc2_combine_fma(h, h_scale, L["w2"], L["w2_scale"], L["b2"], ids, tw,
                                      next_norm=NextNorm(residual, L["norm_w"], L["bufs"]))
                D.dense_fp8_linear_rope_norm(L["bufs"], m, L["norm_w"], 1e-5, L["qkv"], L["qkv_scale"], L["qkv_bias"],
                                             pos, cache, rope_rows, HEAD, path="fma")

        rec = {"m": m, "layers": args.layers}
        for name, fn in (("upstream_order", upstream), ("carried", carried)):  # median µs of a replay, per boundary
            rec[f"{name}_us"] = _load("l2_probe")._time_graph(fn, args.reps) / args.layers
        records.append(rec)
    return records


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/norm_carry.py needs a CUDA GPU")
        return 2
    moe = _load("moe")
    copy_gbps = moe.measure_copy_bandwidth(torch.device("cuda"))
    head = moe.header(torch.device("cuda"), copy_gbps)
    records = run(args)
    n = (HEADS_Q + 2 * HEADS_KV) * HEAD
    gemv_bytes = E * H * I // 2 + E * H * I // 32 + n * H + 4 * n  # FC2 (all 4 experts) + qkv weights and scales
    print(f"device {head['device']}  copy bandwidth {copy_gbps:.0f} GB/s  commit {head['commit']}")
    print("| M | upstream order µs/boundary | carried µs/boundary | saved | GEMV bytes | % of copy BW (carried) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in records:
        r["gemv_bytes"] = gemv_bytes
        r["carried_pct_copy_bw"] = 100 * gemv_bytes / (r["carried_us"] * 1e-6) / (copy_gbps * 1e9)
        print(f"| {r['m']} | {r['upstream_order_us']:.2f} | {r['carried_us']:.2f} | "
              f"{r['upstream_order_us'] - r['carried_us']:.2f} | {gemv_bytes / 1e6:.1f} MB | "
              f"{r['carried_pct_copy_bw']:.0f}% |")
    return _load("l2_probe").write_results("norm_carry", head, records, args)


if __name__ == "__main__":
    raise SystemExit(main())
