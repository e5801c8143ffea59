"""Serving under load: `vllm serve` with the SM121 backend on loopback, 200 concurrent requests.

    python scripts/serve_load.py --model models/gpt-oss-tiny [--out results/serve_load.json] [--] [extra vllm serve args]
    python scripts/serve_load.py --dry-run            # no GPU: the plan (request lengths), JSON, exit 0

What it does (as scripts/serve_check.py: token-id prompts, --skip-tokenizer-init, loopback):
  1. Weights: ``--weights random`` (default) writes a random real-format MXFP4 checkpoint of the
     --model config (vllm_sm121.testing.checkpoint.write_random_gpt_oss_checkpoint, --seed,
     --num-layers) and serves it, so logprobs have signal; ``--weights dummy`` serves
     ``--load-format dummy`` (then the logprobs compared are those of dummy weights, ~uniform).
  2. Starts ``vllm serve <weights> --skip-tokenizer-init --attention-backend SM121
     --max-model-len 4096 --host 127.0.0.1 ...extra`` and waits for /health.
  3. Load: --requests (200) /v1/completions requests, --concurrency (64) in flight at most,
     prompts of random token ids with lengths 1..--max-prompt (2048) and max_tokens
     1..--max-tokens (256), seeded (--seed); greedy, ignore_eos. A request fails on an HTTP or
     connection error, a response without usage, or completion_tokens != max_tokens. The whole
     load phase is bounded by --time-limit seconds (unfinished requests count as failures).
     --sample (8) of the requests (spread over the lengths) also ask for "prompt_logprobs": 0:
     the teacher-forced logprob of every prompt token, computed in a batch under load.
  4. Alone: the same sampled requests are sent again one at a time to the idle server;
     |delta logprob| per prompt token between the two. Batch invariance is not guaranteed
     (different batch shapes, chunked prefill splits), so a sample mismatches when its mean
     |delta| > --tol (0.05); the max and p99 are reported too.
  5. Stops the server (SIGINT to its process group, then SIGKILL), quotes its SM121 layer lines.

Prints requests sent, failures, mismatches, p50/p99 latency, throughput; writes JSON (--out:
header with device, versions, commit (VLLM_SM121_COMMIT or git), the exact serve command, the
plan, per-request records). Exit 0 when the server came up, failures == 0 and mismatches == 0;
1 otherwise; 2 without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib.metadata
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVED_NAME = "gpt-oss-load"


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------


def resolve_model(text: str) -> Path:
    p = Path(text).expanduser()
    cands = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p, REPO_ROOT / "models" / p]
    for c in cands:
        if (c / "config.json").is_file():
            return c.resolve()
    raise ValueError(f"--model: {text!r} is not a directory holding a config.json (e.g. models/gpt-oss-tiny, "
                     "models/gpt-oss-20b)")


def make_plan(n: int, max_prompt: int, max_tokens: int, vocab: int, seed: int, sample: int) -> list[dict]:
    """Seeded requests: prompt length 1..max_prompt, max_tokens 1..max_tokens, token ids in
    [10, vocab - 10); ``sample`` of them (spread over the prompt lengths) ask for prompt logprobs."""
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        plen = rng.randint(1, max_prompt)
        plan.append({"id": i, "prompt_len": plen, "max_tokens": rng.randint(1, max_tokens),
                     "prompt": [rng.randrange(10, vocab - 10) for _ in range(plen)], "sample": False})
    # sampled: prompts of >= 2 tokens (the first token has no logprob), spread over the lengths
    order = sorted((r for r in plan if r["prompt_len"] >= 2), key=lambda r: r["prompt_len"])
    if sample and order:
        picks = {order[round(j * (len(order) - 1) / max(sample - 1, 1))]["id"] for j in range(min(sample, len(order)))}
        for r in plan:
            r["sample"] = r["id"] in picks
    return plan


def body_for(req: dict, model: str) -> dict:
    b = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0.0,
         "ignore_eos": True}
    if req["sample"]:
        b["prompt_logprobs"] = 0
    return b


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------


def post(port: int, body: dict, timeout: float) -> tuple[dict | None, str | None, float]:
    """(response, error, seconds)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read()), None, time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode(errors="replace")
        return None, f"HTTP {e.code}: {detail}", time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}", time.perf_counter() - t0


def check_response(req: dict, resp: dict | None, err: str | None) -> str | None:
    if err:
        return err
    try:
        got = resp["usage"]["completion_tokens"]
    except (KeyError, TypeError):
        return f"no usage in the response: {str(resp)[:200]}"
    if got != req["max_tokens"]:
        return f"completion_tokens {got} != max_tokens {req['max_tokens']} (ignore_eos)"
    if req["sample"] and not prompt_logprobs_of(req, resp):
        return "asked for prompt_logprobs, got none"
    return None


def prompt_logprobs_of(req: dict, resp: dict | None) -> list[float] | None:
    """Teacher-forced logprob of prompt tokens 1..n-1 (JSON keys are token ids as strings)."""
    try:
        pl = resp["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        return None
    if not pl or len(pl) != len(req["prompt"]):
        return None
    out = []
    for d, tok in zip(pl[1:], req["prompt"][1:]):
        entry = (d or {}).get(str(tok)) or (d or {}).get(tok)
        if entry is None:
            return None
        out.append(float(entry["logprob"] if isinstance(entry, dict) else entry))
    return out


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    i = min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))
    return s[i]


# ---------------------------------------------------------------------------------------------
# server
# ---------------------------------------------------------------------------------------------


def start_server(cmd: list[str], log_path: Path, port: int, timeout: float) -> tuple[subprocess.Popen, bool, float]:
    logf = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    proc._logf = logf  # type: ignore[attr-defined]
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            return proc, False, time.time() - t0
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, True, time.time() - t0
        except Exception:  # noqa: BLE001
            time.sleep(2)
    return proc, False, time.time() - t0


def stop_server(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    proc._logf.close()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# header
# ---------------------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    if os.environ.get("VLLM_SM121_COMMIT"):
        return os.environ["VLLM_SM121_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def device_info() -> dict:
    try:
        import torch

        if not torch.cuda.is_available():
            return {"device": None, "error": "no CUDA GPU: torch.cuda.is_available() is False"}
        p = torch.cuda.get_device_properties(0)
        return {"device": p.name, "capability": f"{p.major}.{p.minor}", "torch_cuda": torch.version.cuda}
    except Exception as e:  # noqa: BLE001
        return {"device": None, "error": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="scripts/serve_load.py", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Method: the docstring at the top of scripts/serve_load.py.")
    ap.add_argument("--model", default="models/gpt-oss-tiny", help="gpt-oss config dir (default models/gpt-oss-tiny)")
    ap.add_argument("--weights", default="random", choices=("random", "dummy"),
                    help="random: a random real-format checkpoint of the config (default); dummy: --load-format dummy")
    ap.add_argument("--num-layers", type=int, default=None, help="--weights random: keep this many layers")
    ap.add_argument("--requests", type=int, default=200, help="requests sent under load (default 200)")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight at most (default 64)")
    ap.add_argument("--max-prompt", type=int, default=2048, help="prompt lengths 1..N (default 2048)")
    ap.add_argument("--max-tokens", type=int, default=256, help="max_tokens 1..N (default 256)")
    ap.add_argument("--sample", type=int, default=8, help="requests whose prompt logprobs are compared (default 8)")
    ap.add_argument("--tol", type=float, default=0.05,
                    help="a sample mismatches when its mean |delta logprob| exceeds this (default 0.05)")
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds for the load phase (default 600)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health (default 600)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="vllm serve --max-model-len (default 4096)")
    ap.add_argument("--port", type=int, default=8125)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="JSON output (default results/serve_load.json; --dry-run: results/serve_load_dryrun.json)")
    ap.add_argument("--log", default=None, help="server log (default <out>.server.log)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: print the plan, write JSON, exit 0")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more vllm serve arguments")
    args = ap.parse_args(argv)
    args.extra = [a for a in args.extra if a != "--"]
    for opt, v, lo in (("--requests", args.requests, 1), ("--concurrency", args.concurrency, 1),
                       ("--max-prompt", args.max_prompt, 1), ("--max-tokens", args.max_tokens, 1),
                       ("--sample", args.sample, 0), ("--port", args.port, 1), ("--max-model-len", args.max_model_len, 2)):
        if v < lo:
            ap.error(f"{opt} must be >= {lo}, got {v}")
    if args.sample > args.requests:
        ap.error(f"--sample {args.sample} > --requests {args.requests}")
    if args.tol <= 0 or args.time_limit <= 0 or args.startup_timeout <= 0:
        ap.error("--tol, --time-limit and --startup-timeout must be > 0")
    if args.num_layers is not None and (args.num_layers < 1 or args.weights != "random"):
        ap.error("--num-layers must be >= 1 and needs --weights random")
    if args.max_prompt + args.max_tokens > args.max_model_len:
        ap.error(f"--max-prompt {args.max_prompt} + --max-tokens {args.max_tokens} > --max-model-len "
                 f"{args.max_model_len}")
    try:
        args.model_dir = resolve_model(args.model)
        args.hf = json.loads((args.model_dir / "config.json").read_text())
    except ValueError as e:
        ap.error(str(e))
    if args.hf.get("model_type") != "gpt_oss" or not isinstance(args.hf.get("vocab_size"), int):
        ap.error(f"--model: {args.model_dir / 'config.json'} is not a gpt-oss config with a vocab_size")
    pos = int(args.hf.get("max_position_embeddings") or 0)
    if pos and args.max_model_len > pos:
        ap.error(f"--max-model-len {args.max_model_len} > the model's max_position_embeddings {pos}")
    if args.out is None:
        args.out = "results/serve_load_dryrun.json" if args.dry_run else "results/serve_load.json"
    return args


def serve_cmd(args, weights_dir: str) -> list[str]:
    cmd = ["vllm", "serve", weights_dir, "--served-model-name", SERVED_NAME, "--skip-tokenizer-init",
           "--attention-backend", "SM121", "--max-model-len", str(args.max_model_len),
           "--host", "127.0.0.1", "--port", str(args.port), "--seed", str(args.seed)]
    if args.weights == "dummy":
        cmd += ["--load-format", "dummy"]
    return cmd + args.extra


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out = out if out.is_absolute() else Path.cwd() / out
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = Path(args.log) if args.log else out.with_suffix(".server.log")
    plan = make_plan(args.requests, args.max_prompt, args.max_tokens, args.hf["vocab_size"], args.seed, args.sample)
    plens = [r["prompt_len"] for r in plan]
    gens = [r["max_tokens"] for r in plan]
    sampled = [r for r in plan if r["sample"]]
    print(f"model {args.model_dir} ({args.weights} weights), {args.requests} requests, concurrency "
          f"{args.concurrency}, time limit {args.time_limit:.0f}s, seed {args.seed}")
    print(f"prompt lengths 1..{args.max_prompt}: min {min(plens)} median {statistics.median(plens):.0f} "
          f"max {max(plens)}, total {sum(plens):,} tokens; max_tokens 1..{args.max_tokens}: min {min(gens)} "
          f"median {statistics.median(gens):.0f} max {max(gens)}, total {sum(gens):,}")
    print("requests (id:prompt_len/max_tokens): " + " ".join(f"{r['id']}:{r['prompt_len']}/{r['max_tokens']}" for r in plan))
    print(f"prompt-logprob sample ({len(sampled)}, tolerance mean |delta| <= {args.tol}): "
          + ", ".join(f"#{r['id']} ({r['prompt_len']} tokens)" for r in sampled))
    weights_note = ("random real-format checkpoint (vllm_sm121.testing.checkpoint, seed "
                    f"{args.seed}{', ' + str(args.num_layers) + ' layers' if args.num_layers else ''})"
                    if args.weights == "random" else "dummy weights (--load-format dummy): the logprobs "
                    "compared are of dummy weights")
    header: dict[str, Any] = {
        "script": "serve_load",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "dry_run": args.dry_run,
        "python": sys.version.split()[0],
        "torch": _version("torch"), "triton": _version("triton"), "vllm": _version("vllm"),
        "vllm_sm121": _version("vllm-sm121"), "git_commit": git_commit(),
        "model": str(args.model_dir), "weights": weights_note,
        "requests": args.requests, "concurrency": args.concurrency, "time_limit_s": args.time_limit,
        "max_prompt": args.max_prompt, "max_tokens": args.max_tokens, "seed": args.seed,
        "sample": args.sample, "tol_mean_abs_delta": args.tol,
    }
    result: dict[str, Any] = {
        "header": header,
        "plan": [{k: v for k, v in r.items() if k != "prompt"} for r in plan],
        "serve_cmd": serve_cmd(args, "<weights>"),
    }
    if args.dry_run:
        header["device"] = "none (dry run)"
        out.write_text(json.dumps(result, indent=1))
        print(f"$ {' '.join(result['serve_cmd'])}\nwrote {out}\ndry run: no server started")
        return 0

    dev = device_info()
    header.update(dev)
    if not dev.get("device"):
        print(f"scripts/serve_load.py needs a CUDA GPU with vLLM 0.26.0 ({dev.get('error')}); "
              "--dry-run prints the plan.", file=sys.stderr)
        return 2
    if shutil.which("vllm") is None:
        print("scripts/serve_load.py: no `vllm` executable on PATH", file=sys.stderr)
        return 2

    tmp = tempfile.mkdtemp(prefix="serve_load_")
    try:
        if args.weights == "random":
            from vllm_sm121.testing.checkpoint import write_random_gpt_oss_checkpoint

            t = time.time()
            weights_dir = write_random_gpt_oss_checkpoint(str(args.model_dir), os.path.join(tmp, "ckpt"),
                                                          seed=args.seed, num_layers=args.num_layers)
            print(f"random checkpoint written in {time.time() - t:.0f}s: {weights_dir}", flush=True)
        else:
            weights_dir = str(args.model_dir)
        cmd = serve_cmd(args, weights_dir)
        result["serve_cmd"] = cmd
        print("$", " ".join(cmd), flush=True)
        proc, up, t_up = start_server(cmd, log_path, args.port, args.startup_timeout)
        result["server_up"], result["startup_s"] = up, t_up
        print(f"server up: {up} after {t_up:.0f}s (log {log_path})", flush=True)
        records: list[dict] = []
        alone: list[dict] = []
        try:
            if up:
                records, wall = load_phase(args, plan)
                result["load_wall_s"] = wall
                alone = alone_phase(args, plan)
        finally:
            stop_server(proc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    result["sm121_layer_lines"] = [ln for ln in text.splitlines() if "SM121 attention layer" in ln][:64]
    result["server_errors"] = [ln for ln in text.splitlines() if "Traceback" in ln or " ERROR " in ln][:20]
    summarize(args, result, plan, records, alone)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")
    s = result.get("summary") or {}
    return 0 if up and s.get("failures") == 0 and s.get("mismatches") == 0 else 1


def load_phase(args, plan: list[dict]) -> tuple[list[dict], float]:
    recs: dict[int, dict] = {}
    t0 = time.perf_counter()
    deadline = t0 + args.time_limit

    def one(req: dict) -> dict:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return {"id": req["id"], "error": "not sent: --time-limit reached", "latency_s": None}
        resp, err, dt = post(args.port, body_for(req, SERVED_NAME), timeout=remaining)
        rec = {"id": req["id"], "error": check_response(req, resp, err), "latency_s": dt,
               "t_done_s": time.perf_counter() - t0}
        if req["sample"]:
            rec["prompt_logprobs"] = prompt_logprobs_of(req, resp)
        return rec

    ex = concurrent.futures.ThreadPoolExecutor(args.concurrency)
    futs = {ex.submit(one, r): r for r in plan}
    try:
        for f in concurrent.futures.as_completed(futs, timeout=args.time_limit + 5):
            rec = f.result()
            recs[rec["id"]] = rec
            n = len(recs)
            if n % 25 == 0 or n == len(plan):
                print(f"  {n}/{len(plan)} done, {sum(1 for r in recs.values() if r['error'])} failed, "
                      f"{time.perf_counter() - t0:.0f}s", flush=True)
    except concurrent.futures.TimeoutError:
        print(f"  --time-limit {args.time_limit:.0f}s reached", flush=True)
    wall = time.perf_counter() - t0
    ex.shutdown(wait=False, cancel_futures=True)
    for r in plan:
        recs.setdefault(r["id"], {"id": r["id"], "error": f"not completed within --time-limit {args.time_limit:.0f}s",
                                  "latency_s": None})
    return [recs[r["id"]] for r in plan], wall


def alone_phase(args, plan: list[dict]) -> list[dict]:
    out = []
    for req in (r for r in plan if r["sample"]):
        resp, err, dt = post(args.port, body_for(req, SERVED_NAME), timeout=max(60.0, args.time_limit))
        out.append({"id": req["id"], "error": check_response(req, resp, err), "latency_s": dt,
                    "prompt_logprobs": prompt_logprobs_of(req, resp)})
    return out


def summarize(args, result: dict, plan: list[dict], records: list[dict], alone: list[dict]) -> None:
    by_id = {r["id"]: r for r in plan}
    fails = [r for r in records if r["error"]]
    lat = [r["latency_s"] for r in records if not r["error"] and r["latency_s"] is not None]
    wall = result.get("load_wall_s") or float("nan")
    gen_tok = sum(by_id[r["id"]]["max_tokens"] for r in records if not r["error"])
    prompt_tok = sum(by_id[r["id"]]["prompt_len"] for r in records if not r["error"])
    comps, mism, all_d = [], 0, []
    loaded = {r["id"]: r for r in records}
    for a in alone:
        lp_load = (loaded.get(a["id"]) or {}).get("prompt_logprobs")
        lp_alone = a.get("prompt_logprobs")
        c: dict[str, Any] = {"id": a["id"], "prompt_len": by_id[a["id"]]["prompt_len"], "alone_error": a["error"]}
        if lp_load is None or lp_alone is None or len(lp_load) != len(lp_alone):
            c["status"] = "missing logprobs (loaded or alone request failed)"
            mism += 1
        else:
            d = [abs(x - y) for x, y in zip(lp_load, lp_alone)]
            all_d += d
            c.update(mean_abs_delta=statistics.fmean(d) if d else 0.0, max_abs_delta=max(d, default=0.0),
                     logprob_mean=statistics.fmean(lp_alone) if lp_alone else None)
            c["status"] = "mismatch" if c["mean_abs_delta"] > args.tol else "ok"
            mism += c["status"] == "mismatch"
        comps.append(c)
    s = {
        "requests_sent": len(records),
        "completed_ok": len(records) - len(fails),
        "failures": len(fails),
        "failure_examples": [f"#{r['id']}: {r['error']}" for r in fails[:10]],
        "sampled": len(alone),
        "mismatches": mism if result.get("server_up") else None,
        "mean_abs_delta": statistics.fmean(all_d) if all_d else None,
        "p99_abs_delta": percentile(all_d, 99),
        "max_abs_delta": max(all_d) if all_d else None,
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "load_wall_s": result.get("load_wall_s"),
        "throughput_req_s": (len(records) - len(fails)) / wall if wall == wall and wall > 0 else None,
        "throughput_gen_tok_s": gen_tok / wall if wall == wall and wall > 0 else None,
        "throughput_prompt_tok_s": prompt_tok / wall if wall == wall and wall > 0 else None,
    }
    if not result.get("server_up"):
        s["failures"] = len(plan)
        s["failure_examples"] = ["server did not come up: see the log"] + result.get("server_errors", [])[:5]
    result["records"] = records
    result["comparisons"] = comps
    result["summary"] = s

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    print("\n--- serving under load")
    print(f"requests sent {s['requests_sent']}, failures {s['failures']}, mismatches {s['mismatches']} "
          f"(of {s['sampled']} sampled; mean |delta| > {args.tol})")
    for line in s["failure_examples"]:
        print(f"  failure {line}")
    print(f"latency p50 {f(s['latency_p50_s'], '.2f')} s, p99 {f(s['latency_p99_s'], '.2f')} s; load phase "
          f"{f(s['load_wall_s'], '.1f')} s; throughput {f(s['throughput_req_s'], '.2f')} req/s, "
          f"{f(s['throughput_gen_tok_s'], ',.0f')} generated tok/s, {f(s['throughput_prompt_tok_s'], ',.0f')} "
          "prompt tok/s")
    print(f"prompt logprobs under load vs alone: mean |delta| {f(s['mean_abs_delta'], '.4g')}, p99 "
          f"{f(s['p99_abs_delta'], '.4g')}, max {f(s['max_abs_delta'], '.4g')} ({result['header']['weights']})")
    for c in comps:
        print(f"  #{c['id']} ({c['prompt_len']} tokens): {c['status']}"
              + (f", mean {c['mean_abs_delta']:.4g} max {c['max_abs_delta']:.4g}" if "mean_abs_delta" in c else ""))
    print(f"SM121 layer lines in the server log: {len(result.get('sm121_layer_lines', []))}")
    for line in result.get("server_errors", [])[:10]:
        print(f"  server: {line[:300]}")


if __name__ == "__main__":
    sys.exit(main())
