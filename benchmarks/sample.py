"""Decode sampling benchmark: the whole-model mode's in-graph sampler (``kernels/decode_sample.py``)
vs stock vLLM 0.26's sampling ops on the same logits, same card, same run.

Usage (needs a CUDA GPU; ``--dry-run`` runs a tiny vocabulary on the CPU under the Triton
interpreter, numbers meaningless)::

    python benchmarks/sample.py                       # rows 1, 8, 32 x greedy / temperature / top-k+top-p
    python benchmarks/sample.py --rows 1 --reps 50 --out results/sample.json

Cases (gpt-oss's vocabulary, 201,088; bf16 logits N(0, 4) as the lm_head leaves them):
    greedy        every row temperature 0
    temperature   every row temperature 1.0 (gpt-oss's usual serving setting; $VLLM_SM121_GRAPH_SAMPLE=1)
    topk_topp     temperature 1.0, top-k 50, top-p 0.9 ($VLLM_SM121_GRAPH_SAMPLE=2)

Providers
    sm121     ``decode_sample`` (greedy: the same kernels with zero temperatures; top-k / top-p: the
              threshold passes first: 8 launches for bf16 logits), workspace preallocated, as the graph runs it.
    vllm      stock's ops for the case (``vllm/v1/sample``): greedy = fp32 cast + argmax;
              temperature = fp32 cast, division, softmax, ``random_sample`` (exponential race);
              topk_topp = the same with ``apply_top_k_top_p``, vLLM's own dispatcher (its native
              path with $VLLM_USE_FLASHINFER_SAMPLER=0, as on the test machines): the torch sort
              below 8 rows, vLLM's Triton filter (``apply_top_k_top_p_triton``) from 8 rows on.
              (Runs up to 68b2d8d called ``apply_top_k_top_p_pytorch`` at every row count.)

Timing: each provider's call captured in a CUDA graph (``benchmarks/moe.py``'s ``time_graph``, L2
flushed before each replay), p20/p50/p80 over --reps replays: GPU time only; stock vLLM runs these
ops eagerly, so its host launch cost comes on top. Bytes: the logits read once (P x V x 2); %
of the copy bandwidth of a 1 GiB device-to-device copy measured in the same run.

Output: a table and JSON (--out, default results/sample.json): header (device, capability,
versions, commit, copy bandwidth) + one record per (provider, case, rows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe as M  # noqa: E402  (timing, copy bandwidth, header: benchmarks/moe.py)

VOCAB = 201088
CASES = ("greedy", "temperature", "topk_topp")
PROVIDERS = ("sm121", "vllm")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32", help="rows (requests) per step, comma separated")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, vocabulary 3000, sm121 only")
    ap.add_argument("--out", default="results/sample.json")
    args = ap.parse_args(argv)
    for name, allowed in (("cases", CASES), ("providers", PROVIDERS)):
        bad = set(getattr(args, name).split(",")) - set(allowed)
        if bad:
            ap.error(f"--{name}: unknown {sorted(bad)}; choose from {','.join(allowed)}")
    return args


def _options(case: str, rows: int, device):
    temp = 0.0 if case == "greedy" else 1.0
    t = torch.full((rows,), temp, dtype=torch.float32, device=device)
    k = torch.full((rows,), 50 if case == "topk_topp" else 0, dtype=torch.int32, device=device)
    p = torch.full((rows,), 0.9 if case == "topk_topp" else 1.0, dtype=torch.float32, device=device)
    return t, k, p


def sm121_call(case: str, logits: torch.Tensor):
    from vllm_sm121.kernels import decode_sample as ds

    rows, vocab = logits.shape
    t, k, p = _options(case, rows, logits.device)
    seeds = torch.arange(rows, dtype=torch.int64, device=logits.device) * 7919 + 1
    step = torch.zeros(1, dtype=torch.int64, device=logits.device)
    out = torch.empty(rows, dtype=torch.int32, device=logits.device)
    ws = ds.workspace(rows, vocab, logits.device)
    filt = dict(top_k=k, top_p=p) if case == "topk_topp" else {}
    return lambda: ds.decode_sample(logits, t, seeds, step, out, ws, **filt)


def vllm_call(case: str, logits: torch.Tensor):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p, random_sample

    rows = logits.shape[0]
    t, k, p = _options(case, rows, logits.device)
    kk = torch.where(k > 0, k, torch.full_like(k, logits.shape[1])).to(torch.int64)

    def run():
        x = logits.to(torch.float32)
        if case == "greedy":
            return x.argmax(dim=-1)
        x = x.div_(t.unsqueeze(1))
        if case == "topk_topp":
            x = apply_top_k_top_p(x, kk, p)  # vLLM's choice of kernel for this row count
        return random_sample(x.softmax(dim=-1, dtype=torch.float32), {})

    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, vocab, providers = torch.device("cpu"), 3000, ["sm121"]
    else:
        if not torch.cuda.is_available():
            print("benchmarks/sample.py needs a CUDA GPU (use --dry-run on the CPU)")
            return 2
        device, vocab, providers = torch.device("cuda"), args.vocab, args.providers.split(",")
    copy_gbps = M.measure_copy_bandwidth(device) if device.type == "cuda" else None
    head = {**M.header(device, copy_gbps), "benchmark": "sample", "vocab": vocab, "reps": args.reps}
    print(f"device {head['device']}, commit {head['commit']}, copy bandwidth "
          f"{copy_gbps or 0:.0f} GB/s, vocabulary {vocab}")
    flush = torch.empty(M.FLUSH_BYTES if device.type == "cuda" else 1, dtype=torch.uint8, device=device)
    g = torch.Generator().manual_seed(0)
    records = []
    print(f"{'case':<12} {'rows':>4} {'provider':<7} {'p50 us':>9} {'p20-p80 us':>15} {'%BW':>5}")
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = (torch.randn(rows, vocab, generator=g) * 4).to(torch.bfloat16).to(device)
        nbytes = logits.numel() * logits.element_size()
        for case in args.cases.split(","):
            for prov in providers:
                fn = (sm121_call if prov == "sm121" else vllm_call)(case, logits)
                if device.type == "cuda":
                    times, _ = M.time_graph(fn, args.reps, flush)
                    p20, p50, p80 = (M.pct(times, q) for q in (0.2, 0.5, 0.8))
                    bw = 100 * nbytes / (p50 * 1e-6) / 1e9 / copy_gbps
                else:
                    fn()
                    p20 = p50 = p80 = bw = float("nan")
                rec = dict(provider=prov, case=case, rows=rows, vocab=vocab, bytes=nbytes, p20_us=p20, p50_us=p50,
                           p80_us=p80, pct_copy_bw=bw)
                records.append(rec)
                print(f"{case:<12} {rows:>4} {prov:<7} {p50:>9.1f} {f'{p20:.1f}-{p80:.1f}':>15} {bw:>5.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"header": head, "records": records}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
