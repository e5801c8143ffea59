"""Start `vllm serve` with the SM121 backend, send token-id completions, quote the evidence.

Prints (and checks) the log lines that show SM121 on every attention layer, the backend vLLM
says it selected, and -- with --cudagraph-metrics -- vLLM's own CUDA-graph dispatch table.

    python scripts/serve_check.py --model models/gpt-oss-tiny [--] [extra vllm serve args]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--log", default="serve.log")
    ap.add_argument("--expect-layers", type=int, required=True, help="attention layers that must log SM121")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--stagger", type=float, default=0.0,
                    help="seconds between request starts (> 0: later prefills join running decodes, "
                         "so the engine sees mixed prefill+decode batches)")
    ap.add_argument("extra", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    extra = [a for a in args.extra if a != "--"]
    cmd = ["vllm", "serve", args.model, "--load-format", "dummy", "--skip-tokenizer-init", "--attention-backend",
           "SM121", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(args.port),
           "--cudagraph-metrics", *extra]
    print("$", " ".join(cmd), flush=True)
    log = open(args.log, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ok = False
    try:
        t0 = time.time()
        while time.time() - t0 < 400:
            if proc.poll() is not None:
                break
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2)
                ok = True
                break
            except Exception:
                time.sleep(2)
        print(f"server up: {ok} after {time.time() - t0:.0f} s", flush=True)
        if ok:
            prompts = [[11 + i, 12, 13, 14 + i] * (1 + 40 * (i % 3)) for i in range(args.requests)]
            body = lambda p: dict(model=args.model, prompt=p, max_tokens=32, ignore_eos=True, temperature=0)  # noqa: E731
            def send(ip):
                time.sleep(ip[0] * args.stagger)
                return post(args.port, body(ip[1]))

            if args.stagger > 0:
                post(args.port, body([1, 2, 3]))  # warm the server up, so staggered arrivals stay staggered
            with concurrent.futures.ThreadPoolExecutor(args.requests) as ex:
                outs = list(ex.map(send, enumerate(prompts)))
            n = [o["usage"]["completion_tokens"] for o in outs]
            print(f"/v1/completions: {len(outs)} answers, completion tokens {n}", flush=True)
            ok = all(x == 32 for x in n)
            time.sleep(11)  # let the stat logger's interval pass, then one more request to flush it
            post(args.port, body([5, 6, 7]))
            time.sleep(2)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = open(args.log).read()
    layer_lines = [l for l in text.splitlines() if "SM121 attention layer" in l]
    chosen = [l for l in text.splitlines() if re.search(r"Using .*(backend|CUSTOM)|vllm-sm121 .* loaded", l)]
    table = [l for l in text.splitlines() if re.search(r"CUDAGraph|Runtime Mode|\|\s*\d+\s*\|", l)]
    print("\n--- plugin / backend selection lines")
    print("\n".join(dict.fromkeys(chosen)))
    print(f"\n--- SM121 layer lines ({len(layer_lines)}; expected >= {args.expect_layers})")
    print("\n".join(layer_lines))
    print("\n--- CUDA-graph dispatch (vLLM --cudagraph-metrics)")
    print("\n".join(table[-24:]))
    errors = [l for l in text.splitlines() if "Traceback" in l or " ERROR " in l]
    if errors:
        print("\n--- errors\n" + "\n".join(errors[:20]))
    return 0 if ok and len(layer_lines) >= args.expect_layers else 1


if __name__ == "__main__":
    sys.exit(main())
