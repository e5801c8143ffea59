"""Eagle3 speculative decoding on gpt-oss: what a step COSTS, for k = 1..7 draft tokens.

Dummy weights make acceptance meaningless, so this measures cost only: the time of a target
verify step of 1+k tokens relative to a plain 1-token decode step, the time of the drafter's
step (k draft tokens), and the break-even acceptance length that follows for each k.

Usage (needs a CUDA GPU with vLLM 0.26.0; without one it says so and exits 2)::

    python benchmarks/eagle_cost.py                                   # 20b + its Eagle3 head, SM121
    python benchmarks/eagle_cost.py --backend SM121,TRITON_ATTN       # plugin and upstream, same run
    python benchmarks/eagle_cost.py --model ../shared/models/gpt-oss-120b --drafter models/eagle3-gpt-oss-120b
    python benchmarks/eagle_cost.py --ks 1,3,7 --gen 64 --iters 2    # shorter
    python benchmarks/eagle_cost.py --dry-run                         # no GPU: plan + config checks

    On the GPU machine: ``bash scripts/gpu_session.sh <part-dir> eaglecost``.
    Set ``VLLM_SM121_COMMIT`` where the tree has no .git.

Runs (one fresh Python process each, as benchmarks/e2e.py: engines do not give all GPU memory
back): for every ``--backend``, one plain run (no speculative_config, k = 0) and one run per k
with ``speculative_config={"method": "eagle3", "model": <drafter>, "num_speculative_tokens": k}``.
Weights are vLLM's ``load_format="dummy"`` for target and drafter; token-id prompts, no
tokenizer; greedy, ignore_eos, prefix caching off; batch ``--batch`` (default 1).
``--drafter-backend`` (default ``auto``: not set, vLLM's / the plugin's rule -- with SM121 the
drafter follows SM121) puts ``attention_backend`` into the speculative config.
Compilation: ``max_cudagraph_capture_size = --capture-size`` (default 16; vLLM rounds capture
sizes to multiples of 1+k under FULL decode graphs, so a B=1 verify of 1+k tokens replays its own
graph); ``--capture-size 0`` keeps vLLM's default.

Measurement (per run: --warmup untimed generates, then --iters repetitions of
t(max_tokens=1) and t(max_tokens=--gen) on the same prompts):
    step wall time   (t(gen) - t(1)) / (steps(gen) - steps(1)); steps = target forward passes
                     counted in the worker (each engine step is one target forward: a 1-token
                     decode in the plain run, a verify of 1+k tokens per sequence in a spec run,
                     whatever the drafts' acceptance). Prefill and request overhead cancel out.
    GPU times        CUDA events in the worker (installed through ``LLM.collective_rpc`` with
                     VLLM_ALLOW_INSECURE_SERIALIZATION=1) around the model runner's
                     ``_model_forward`` (the target: 1 token / 1+k tokens per sequence) and around
                     ``drafter.propose`` (the whole drafter step: its forward over the verified
                     tokens + k-1 single-token passes + argmax); the prefill pass is dropped.
                     Medians over all decode steps of all iterations.
    Derived          r_k = spec step wall / plain step wall (same backend, same card, same run);
                     break-even mean acceptance length tau_k = r_k tokens emitted per spec step
                     (accepted drafts + the bonus token), i.e. r_k - 1 accepted drafts per step;
                     when r_k > k + 1 that k cannot beat plain decode at any acceptance.
                     verify ratio = GPU verify(1+k) / GPU forward(1 token, plain run);
                     draft ratio = GPU drafter step / GPU forward(1 token, plain run).
    vLLM's spec-decode counters (drafts, draft tokens, accepted) are read with
    ``LLM.get_metrics()`` and stored: the acceptance of dummy weights is recorded, not meaningful.

Output: a table (backend, k, plain ms/step, spec ms/step, ratio, break-even tokens/step, GPU
verify and draft ms and their ratios) and JSON (--out; header with device, versions, git commit
(VLLM_SM121_COMMIT or git rev-parse), per run the exact LLM kwargs and raw samples).
Each run's full log goes to <out>.logs/.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import _short_error, _version, _write_json, deep_merge, engine_env, git_info, start_engine, wait_or_kill  # noqa: E402  (benchmarks/e2e.py)

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO_ROOT / "models"
DEFAULT_MODEL = "gpt-oss-20b"
# target shape -> the drafter config shipped for it
DRAFTERS = {
    "gpt-oss-120b": MODELS_DIR / "eagle3-gpt-oss-120b",
    "gpt-oss-20b": MODELS_DIR / "eagle3-gpt-oss-20b",
    "gpt-oss-tiny": REPO_ROOT / "tests" / "eagle3-gpt-oss-tiny",
}
BACKENDS = ("SM121", "TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION")
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
DEFAULT_KS = (1, 2, 3, 4, 5, 6, 7)
MAX_K = 15
CHILD_FLAG = "--_child"
LOG_PREFIX = "[eagle_cost]"


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------------------------------------
# models and drafter configs (pure JSON: runs without vLLM)
# ---------------------------------------------------------------------------------------------


def resolve_dir(text: str, option: str, shipped: tuple[str, ...]) -> Path:
    p = Path(text).expanduser()
    cands = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p, MODELS_DIR / p]
    for c in cands:
        if (c / "config.json").is_file():
            return c.resolve()
    raise ValueError(f"{option}: {text!r} is not a directory holding a config.json; use one of "
                     f"{', '.join(shipped)} (under {MODELS_DIR}) or a config directory path")


def target_key(cfg: dict) -> str | None:
    """gpt-oss-120b / -20b / -tiny by shape (picks the default drafter)."""
    if cfg.get("model_type") != "gpt_oss":
        return None
    layers, experts = cfg.get("num_hidden_layers"), cfg.get("num_local_experts")
    if cfg.get("hidden_size") == 2880 and layers == 36 and experts == 128:
        return "gpt-oss-120b"
    if cfg.get("hidden_size") == 2880 and layers == 24 and experts == 32:
        return "gpt-oss-20b"
    if layers is not None and layers <= 8:
        return "gpt-oss-tiny"
    return None


def check_target_config(cfg: dict, where: str) -> None:
    if cfg.get("model_type") != "gpt_oss":
        raise ValueError(f"--model: {where} is not a gpt-oss config (model_type "
                         f"{cfg.get('model_type')!r}, expected 'gpt_oss')")
    for k in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if not isinstance(cfg.get(k), int):
            raise ValueError(f"--model: {where} has no integer {k!r}")


def check_drafter_config(d: dict, target: dict, where: str) -> list[str]:
    """Raise ValueError (naming --drafter) if the Eagle3 head cannot serve this target; return
    notes. The public Eagle3-head format: LlamaForCausalLMEagle3, one Llama layer (full attention,
    no sinks), the target's hidden size and vocabulary, a draft vocabulary <= the target's."""
    bad = []
    archs = d.get("architectures") or []
    if not any(a in EAGLE3_ARCHS for a in archs):
        bad.append(f"architectures {archs} names no Eagle3 head ({' or '.join(EAGLE3_ARCHS)})")
    if d.get("model_type") != "llama":
        bad.append(f"model_type {d.get('model_type')!r}, expected 'llama'")
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "vocab_size")
    missing = [k for k in need if d.get(k) is None]
    if missing:
        bad.append(f"missing field(s) {', '.join(missing)}")
    th = target.get("hidden_size")
    dth = d.get("target_hidden_size", d.get("hidden_size"))
    if dth is not None and dth != th:
        bad.append(f"target_hidden_size {dth} != the target's hidden_size {th}")
    if d.get("vocab_size") is not None and d.get("vocab_size") != target.get("vocab_size"):
        bad.append(f"vocab_size {d.get('vocab_size')} != the target's vocab_size "
                   f"{target.get('vocab_size')}")
    dv = d.get("draft_vocab_size", d.get("vocab_size"))
    if isinstance(dv, int) and isinstance(d.get("vocab_size"), int) and not 0 < dv <= d["vocab_size"]:
        bad.append(f"draft_vocab_size {dv} not in 1..{d['vocab_size']}")
    types = d.get("layer_types") or []
    if any(t != "full_attention" for t in types) or d.get("sliding_window"):
        bad.append("an Eagle3 head here has full attention only (no layer_types other than "
                   "full_attention, no sliding_window)")
    nh, hd = d.get("num_attention_heads"), d.get("head_dim")
    if isinstance(nh, int) and isinstance(d.get("num_key_value_heads"), int) and nh % d["num_key_value_heads"]:
        bad.append(f"num_attention_heads {nh} is not a multiple of num_key_value_heads "
                   f"{d['num_key_value_heads']}")
    if bad:
        raise ValueError(f"--drafter: {where}: " + "; ".join(bad))
    notes = []
    ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = target["num_hidden_layers"]
    if ids is not None and any(not 0 <= i < layers for i in ids):
        raise ValueError(f"--drafter: {where}: eagle_aux_hidden_state_layer_ids {ids} outside the "
                         f"target's {layers} layers")
    if ids is None:
        notes.append(f"no eagle_aux_hidden_state_layer_ids: vLLM's default (2, {layers // 2}, "
                     f"{layers - 3})")
    if hd is None and isinstance(nh, int):
        notes.append(f"no head_dim: hidden_size / heads = {d['hidden_size'] // nh}")
    return notes


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------


def base_llm_kwargs(args, target_dir: Path, hf: dict) -> dict:
    need = args.prompt_len + args.gen + MAX_K + 64
    positions = int(hf.get("max_position_embeddings") or 0)
    max_len = max(1024, -(-need // 1024) * 1024)
    kw: dict[str, Any] = {
        "model": str(target_dir),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "seed": args.seed,
        "enable_prefix_caching": False,
        "max_model_len": min(max_len, positions) if positions else max_len,
        "disable_log_stats": False,  # LLM.get_metrics(): vLLM's spec-decode counters
    }
    if args.capture_size:
        kw["compilation_config"] = {"max_cudagraph_capture_size": args.capture_size}
    return kw


def build_runs(args) -> list[dict]:
    runs = []
    base = base_llm_kwargs(args, args.target_dir, args.target_hf)
    for be in args.backend_list:
        for k in [0, *args.k_list]:
            kw = dict(base, attention_backend=be)
            if k:
                sc: dict[str, Any] = {"method": "eagle3", "model": str(args.drafter_dir),
                                      "num_speculative_tokens": k}
                if args.drafter_backend != "auto":
                    sc["attention_backend"] = args.drafter_backend
                kw["speculative_config"] = sc
            kw = deep_merge(kw, args.llm_kwargs_obj)
            runs.append({"name": f"{be}/k{k}" if k else f"{be}/plain", "backend": be, "k": k,
                         "llm_kwargs": kw})
    return runs


# ---------------------------------------------------------------------------------------------
# the child process: one engine
# ---------------------------------------------------------------------------------------------


def _install_timers(worker):
    """Runs in the vLLM worker (via LLM.collective_rpc): CUDA events around the target forward
    and the drafter step. Self-contained: cloudpickle ships it by value."""
    import torch

    w = getattr(worker, "worker", None) or worker
    mr = getattr(w, "model_runner", None)
    if mr is None or not hasattr(mr, "_model_forward"):
        return {"error": f"no V1 model runner with _model_forward on {type(w).__name__}"}
    state = {"fwd": [], "draft": []}
    mr._eagle_cost_state = state
    orig_fwd = mr._model_forward

    def timed_forward(*a, **kw):
        ids = kw.get("input_ids", a[0] if a else None)
        if ids is not None:
            n = int(ids.shape[0])
        else:
            pos = kw.get("positions")
            n = int(pos.shape[-1]) if pos is not None else -1
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = orig_fwd(*a, **kw)
        e.record()
        state["fwd"].append((n, s, e))
        return out

    mr._model_forward = timed_forward
    drafter = getattr(mr, "drafter", None)
    if drafter is not None and hasattr(drafter, "propose"):
        orig_propose = drafter.propose

        def timed_propose(*a, **kw):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = orig_propose(*a, **kw)
            e.record()
            state["draft"].append((s, e))
            return out

        drafter.propose = timed_propose
    return {"runner": type(mr).__name__, "drafter": type(drafter).__name__ if drafter else None}


def _collect_timers(worker):
    """Runs in the worker: elapsed ms of the recorded events since the last call, then reset."""
    import torch

    w = getattr(worker, "worker", None) or worker
    st = getattr(getattr(w, "model_runner", None), "_eagle_cost_state", None)
    if st is None:
        return None
    torch.cuda.synchronize()
    out = {"fwd": [(n, s.elapsed_time(e)) for n, s, e in st["fwd"]],
           "draft": [s.elapsed_time(e) for s, e in st["draft"]]}
    st["fwd"].clear()
    st["draft"].clear()
    return out


def _spec_counters(llm) -> dict:
    """vLLM's spec-decode counters (LLM.get_metrics), summed over label sets."""
    out: dict[str, float] = {}
    try:
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode") and hasattr(m, "value"):
                out[m.name] = out.get(m.name, 0.0) + float(m.value)
    except Exception as e:  # noqa: BLE001
        out["error"] = _short_error(e)  # type: ignore[assignment]
    return out


def _counter_delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a.get(k, 0.0) for k in b if isinstance(b[k], float)}


def child_main(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(callable)
    res: dict[str, Any] = {"name": spec["name"], "error": None}
    _write_json(result_path, res)

    def log(msg: str) -> None:
        print(f"{LOG_PREFIX} {spec['name']}: {msg}", flush=True)

    llm = start_engine(spec["llm_kwargs"], res, result_path, log)
    if llm is None:
        return 3
    import torch
    from vllm import SamplingParams

    try:
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        res["device"], res["capability"] = p.name, f"{p.major}.{p.minor}"
        vc = llm.llm_engine.vllm_config
        res["engine"] = {
            "attention_backend": str(vc.attention_config.backend),
            "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
            "cudagraph_capture_sizes": list(vc.compilation_config.cudagraph_capture_sizes or []),
            "async_scheduling": vc.scheduler_config.async_scheduling,
            "speculative": (None if vc.speculative_config is None else {
                "method": vc.speculative_config.method,
                "k": vc.speculative_config.num_speculative_tokens,
                "draft_arch": list(vc.speculative_config.draft_model_config.hf_config.architectures or []),
                "attention_backend": str(getattr(vc.speculative_config, "attention_backend", None)),
            }),
        }
    except Exception as e:  # noqa: BLE001
        res["engine"] = {"error": _short_error(e)}
    try:
        res["timers"] = llm.collective_rpc(_install_timers)[0]
    except Exception as e:  # noqa: BLE001
        res["timers"] = {"error": _short_error(e)}
    log(f"engine up in {res['startup_s']:.1f}s; {json.dumps(res['engine'], default=str)}; "
        f"timers {res['timers']}")
    timed = "error" not in res["timers"]

    rng = random.Random(f"{spec['seed']}:eagle_cost")
    prompts = [{"prompt_token_ids": [rng.randrange(10, spec["vocab"] - 10) for _ in range(spec["prompt_len"])]}
               for _ in range(spec["batch"])]

    def generate(n: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        got = [len(o.outputs[0].token_ids) for o in outs]
        if any(g != n for g in got):
            raise RuntimeError(f"expected {len(prompts)} x {n} tokens, got {got}")
        return dt

    def collect() -> dict | None:
        return llm.collective_rpc(_collect_timers)[0] if timed else None

    n = spec["gen"]
    try:
        for i in range(spec["warmup"]):
            log(f"warm-up {i + 1}/{spec['warmup']}")
            generate(1)
            generate(n)
        collect()
        iters = []
        for i in range(spec["iters"]):
            c0 = _spec_counters(llm)
            t1 = generate(1)
            g1 = collect()
            c1 = _spec_counters(llm)
            tn = generate(n)
            gn = collect()
            c2 = _spec_counters(llm)
            rec: dict[str, Any] = {"t_1_s": t1, "t_n_s": tn, "spec_1": _counter_delta(c0, c1),
                                   "spec_n": _counter_delta(c1, c2)}
            if timed:
                rec["steps"] = len(gn["fwd"]) - len(g1["fwd"])
                # decode / verify passes: all target forwards but the prefill (the first)
                rec["fwd_ms"] = gn["fwd"][1:]
                rec["draft_ms"] = gn["draft"][1:]
                rec["prefill_fwd"] = gn["fwd"][:1]
            else:  # fall back on vLLM's counters (spec runs) or one step per token (plain)
                drafts = rec["spec_n"].get("vllm:spec_decode_num_drafts_total",
                                           rec["spec_n"].get("vllm:spec_decode_num_drafts"))
                rec["steps"] = int(drafts / spec["batch"]) if drafts else n - 1
            rec["step_ms"] = (tn - t1) / rec["steps"] * 1e3 if rec["steps"] > 0 else None
            iters.append(rec)
            log(f"iter {i + 1}/{spec['iters']}: {rec['steps']} steps, "
                f"{rec['step_ms'] or float('nan'):.3f} ms/step wall")
        res["iters"] = iters
    except Exception as e:  # noqa: BLE001
        res["error"] = f"measurement failed: {_short_error(e)}"
        log(res["error"])
    steps = [r["step_ms"] for r in res.get("iters", []) if r.get("step_ms")]
    res["step_ms"] = _median(steps)
    res["step_ms_min"], res["step_ms_max"] = (min(steps), max(steps)) if steps else (None, None)
    fwd = [ms for r in res.get("iters", []) for _, ms in r.get("fwd_ms", [])]
    ntok = collections.Counter(t for r in res.get("iters", []) for t, _ in r.get("fwd_ms", []))
    res["fwd_gpu_ms"] = _median(fwd)
    res["fwd_tokens"] = dict(ntok)  # padded token counts of the decode / verify passes
    res["draft_gpu_ms"] = _median([ms for r in res.get("iters", []) for ms in r.get("draft_ms", [])])
    tot: dict[str, float] = collections.Counter()
    for r in res.get("iters", []):
        tot.update(r.get("spec_n", {}))
    res["spec_counters"] = dict(tot)
    _write_json(result_path, res)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001
        log(f"engine shutdown: {_short_error(e)}")
    return 0 if not res["error"] else 4


# ---------------------------------------------------------------------------------------------
# the parent
# ---------------------------------------------------------------------------------------------

ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b: ")
BACKEND_LINE = re.compile(r"Using .*(backend|Backend)|SM121 attention layer|vllm-sm121 .* loaded")


def run_child(spec: dict, log_path: Path, timeout_s: float, verbose: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="eagle_cost_") as td:
        sp, rp = Path(td) / "spec.json", Path(td) / "result.json"
        sp.write_text(json.dumps(spec, default=str))
        cmd = [sys.executable, str(Path(__file__).resolve()), CHILD_FLAG, str(sp), str(rp)]
        errors: list[str] = []
        backend_lines: list[str] = []
        tail: collections.deque[str] = collections.deque(maxlen=40)
        with log_path.open("w") as logf:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace",
                                    # unbuffered; workers spawned (the child touched CUDA first), as e2e.py
                                    env=dict(os.environ, PYTHONUNBUFFERED="1", **engine_env({}, {}, os.environ)),
                                    start_new_session=True)

            def pump() -> None:
                assert proc.stdout is not None
                for line in proc.stdout:
                    logf.write(line)
                    line = line.rstrip("\n")
                    tail.append(line)
                    if line.startswith(LOG_PREFIX) or verbose:
                        print(line, flush=True)
                    elif ERROR_LINE.search(line) and len(errors) < 20:
                        errors.append(line.strip())
                    if BACKEND_LINE.search(line) and len(backend_lines) < 12 and line not in backend_lines:
                        backend_lines.append(line)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            rc, timed_out = wait_or_kill(proc, timeout_s)
            reader.join(timeout=10)
        try:
            res = json.loads(rp.read_text())
        except (OSError, ValueError):
            res = {"error": f"child exited rc={rc} without a result"}
    res["returncode"], res["log"], res["backend_log_lines"] = rc, str(log_path), backend_lines
    if timed_out:
        res["error"] = (res.get("error") or "") + f" timed out after {timeout_s:.0f}s (killed)"
    if res.get("error") or rc:
        res["error_log_lines"], res["log_tail"] = errors, list(tail)[-25:]
        res["error"] = res.get("error") or f"child exited rc={rc}"
    return res


def derive(runs: list[dict]) -> list[dict]:
    """One row per backend and k: ratios against the plain run of the same backend."""
    rows = []
    plain = {r["backend"]: r for r in runs if r["k"] == 0}
    for r in runs:
        res = r.get("result") or {}
        p = (plain.get(r["backend"]) or {}).get("result") or {}
        row: dict[str, Any] = {"backend": r["backend"], "k": r["k"], "error": res.get("error"),
                               "plain_ms": p.get("step_ms"), "step_ms": res.get("step_ms"),
                               "step_ms_min": res.get("step_ms_min"), "step_ms_max": res.get("step_ms_max"),
                               "fwd_gpu_ms": res.get("fwd_gpu_ms"), "fwd_tokens": res.get("fwd_tokens"),
                               "draft_gpu_ms": res.get("draft_gpu_ms"),
                               "plain_fwd_gpu_ms": p.get("fwd_gpu_ms")}
        row["ratio"] = row["break_even_tokens_per_step"] = None
        if row["step_ms"] and row["plain_ms"]:
            row["ratio"] = row["step_ms"] / row["plain_ms"]
            if r["k"]:
                row["break_even_tokens_per_step"] = row["ratio"]
                row["break_even_accepted_drafts"] = row["ratio"] - 1.0
                row["can_win"] = row["ratio"] < r["k"] + 1
        pf = row["plain_fwd_gpu_ms"]
        row["verify_ratio"] = row["fwd_gpu_ms"] / pf if (pf and row["fwd_gpu_ms"]) else None
        row["draft_ratio"] = row["draft_gpu_ms"] / pf if (pf and row["draft_gpu_ms"]) else None
        c = res.get("spec_counters") or {}
        drafted = c.get("vllm:spec_decode_num_draft_tokens_total", c.get("vllm:spec_decode_num_draft_tokens"))
        acc = c.get("vllm:spec_decode_num_accepted_tokens_total", c.get("vllm:spec_decode_num_accepted_tokens"))
        row["dummy_acceptance"] = acc / drafted if drafted else None
        rows.append(row)
    return rows


def _f(x, fmt=".3f", none="-"):
    return none if x is None else format(x, fmt)


def print_table(rows: list[dict]) -> None:
    print("\nEagle3 step cost (dummy weights: acceptance is not meaningful, cost is)")
    hdr = (f"{'backend':<12} {'k':>2} | {'plain ms':>9} | {'spec step ms':>12} | {'ratio':>6} | "
           f"{'break-even tok/step':>19} | {'verify GPU ms (tok)':>19} | {'verify/1tok':>11} | "
           f"{'draft GPU ms':>12} | {'draft/1tok':>10}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        toks = ",".join(str(t) for t in sorted(r.get("fwd_tokens") or {}, key=int)) or "-"
        be = "-" if not r["k"] else _f(r["break_even_tokens_per_step"], ".2f")
        if r["k"] and r.get("can_win") is False:
            be += " (>k+1)"
        print(f"{r['backend']:<12} {r['k']:>2} | {_f(r['plain_ms']):>9} | {_f(r['step_ms']):>12} | "
              f"{_f(r['ratio'], '.2f'):>6} | {be:>19} | {_f(r['fwd_gpu_ms']) + ' (' + toks + ')':>19} | "
              f"{_f(r['verify_ratio'], '.2f'):>11} | {_f(r['draft_gpu_ms']):>12} | {_f(r['draft_ratio'], '.2f'):>10}"
              + (f"  ERROR {r['error'][:120]}" if r.get("error") else ""))
    print("ratio = spec step / plain step (wall, same backend); break-even = mean tokens a spec step "
          "must emit (accepted drafts + bonus) to match plain decode; verify/draft ratios are GPU "
          "event times over the plain 1-token forward.")


# ---------------------------------------------------------------------------------------------
# dry run: vLLM's own parsing of the target + drafter configs (no GPU needed)
# ---------------------------------------------------------------------------------------------


def vllm_check(args, runs: list[dict]) -> dict:
    import dataclasses
    import inspect

    out: dict[str, Any] = {"problems": [], "notes": []}
    try:
        from vllm import LLM
        from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
        from vllm.engine.arg_utils import EngineArgs

        import vllm_sm121

        vllm_sm121.register()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except Exception as e:  # noqa: BLE001
        out["problems"].append(f"vLLM not importable: {_short_error(e)}")
        return out
    allowed = {f.name for f in dataclasses.fields(EngineArgs)}
    allowed |= set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"}
    for r in runs:
        for k in r["llm_kwargs"]:
            if k not in allowed:
                out["problems"].append(f"{r['name']}: LLM(...) has no argument {k!r}")
        for be in (r["llm_kwargs"].get("attention_backend"),
                   (r["llm_kwargs"].get("speculative_config") or {}).get("attention_backend")):
            if be is not None and be not in AttentionBackendEnum._member_map_:
                out["problems"].append(f"{r['name']}: attention_backend {be!r} is not a vLLM backend name")
    try:
        target = ModelConfig(model=str(args.target_dir), skip_tokenizer_init=True, dtype="bfloat16",
                             max_model_len=runs[0]["llm_kwargs"]["max_model_len"])
        sc = SpeculativeConfig(method="eagle3", model=str(args.drafter_dir),
                               num_speculative_tokens=max(args.k_list), target_model_config=target,
                               target_parallel_config=ParallelConfig())
        d = sc.draft_model_config
        hf = d.hf_config
        inner = getattr(hf, "model", None) or hf
        out["drafter"] = {
            "architectures": list(getattr(hf, "architectures", None) or []),
            "vocab_size": d.get_vocab_size(),
            "draft_vocab_size": getattr(inner, "draft_vocab_size", None),
            "hidden_size": d.get_hidden_size(),
            "num_layers": getattr(inner, "num_hidden_layers", None),
            "heads": [getattr(inner, "num_attention_heads", None), getattr(inner, "num_key_value_heads", None),
                      getattr(inner, "head_dim", None)],
            "rope_parameters": getattr(inner, "rope_parameters", None),
            "target_vocab_size": target.get_vocab_size(),
        }
        if d.get_vocab_size() != target.get_vocab_size():
            out["problems"].append(f"--drafter: vLLM reads vocab {d.get_vocab_size()} for the drafter, "
                                   f"{target.get_vocab_size()} for the target")
    except Exception as e:  # noqa: BLE001
        out["problems"].append(f"--drafter: vLLM's SpeculativeConfig refuses {args.drafter_dir}: "
                               f"{_short_error(e)}")
    return out


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks/eagle_cost.py",
                                 description="Eagle3 on gpt-oss: verify / draft step cost vs plain decode "
                                             "(dummy weights), k = 1..7.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Method: the docstring at the top of benchmarks/eagle_cost.py.")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="gpt-oss config dir or shipped name (gpt-oss-20b, gpt-oss-tiny); default gpt-oss-20b")
    ap.add_argument("--drafter", default=None,
                    help="Eagle3 head config dir (default: the shipped one for the target's shape: "
                         "models/eagle3-gpt-oss-{20b,120b}, tests/eagle3-gpt-oss-tiny)")
    ap.add_argument("--backend", default="SM121",
                    help=f"target attention backend(s), comma list from {','.join(BACKENDS)} (default SM121)")
    ap.add_argument("--drafter-backend", default="auto",
                    help="attention_backend in the speculative config: auto (not set) or a backend name")
    ap.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)),
                    help=f"num_speculative_tokens values, comma list of 1..{MAX_K} (default 1..7)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--gen", type=int, default=128, help="max_tokens of the long run (default 128)")
    ap.add_argument("--iters", type=int, default=3, help="timed repetitions (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
    ap.add_argument("--capture-size", type=int, default=16,
                    help="max_cudagraph_capture_size (default 16; 0 = vLLM's default)")
    ap.add_argument("--llm-kwargs", default="{}", help="JSON merged into every run's LLM kwargs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="JSON output (default results/eagle_cost.json; --dry-run: results/eagle_cost_dryrun.json)")
    ap.add_argument("--timeout-per-run", type=float, default=900.0, help="seconds (default 900)")
    ap.add_argument("--verbose", action="store_true", help="echo every vLLM log line")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: print the plan, check the drafter config (JSON and vLLM's parser), write JSON")
    ap.add_argument("--no-vllm-check", action="store_true", help="dry run: skip vLLM's config parsing (~1 min)")
    args = ap.parse_args(argv)

    args.backend_list = list(dict.fromkeys(_csv(args.backend)))
    bad = [b for b in args.backend_list if b not in BACKENDS]
    if bad or not args.backend_list:
        ap.error(f"--backend: unknown {', '.join(map(repr, bad)) or '(empty)'}; valid: {', '.join(BACKENDS)}")
    if args.drafter_backend != "auto" and args.drafter_backend not in BACKENDS:
        ap.error(f"--drafter-backend: {args.drafter_backend!r}; valid: auto, {', '.join(BACKENDS)}")
    try:
        ks = [int(x) for x in _csv(args.ks)]
    except ValueError:
        ap.error(f"--ks: {args.ks!r} is not a comma list of integers (e.g. 1,2,3)")
    if not ks or any(not 1 <= k <= MAX_K for k in ks):
        ap.error(f"--ks: {args.ks!r}: each k must be in 1..{MAX_K}")
    args.k_list = sorted(set(ks))
    for opt, v, lo in (("--batch", args.batch, 1), ("--prompt-len", args.prompt_len, 1),
                       ("--gen", args.gen, 8), ("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                       ("--capture-size", args.capture_size, 0)):
        if v < lo:
            ap.error(f"{opt} must be >= {lo}, got {v}")
    need = args.batch * (1 + max(args.k_list))
    if args.capture_size and args.capture_size < need:
        ap.error(f"--capture-size {args.capture_size}: a verify step of --batch {args.batch} x (1 + "
                 f"{max(args.k_list)}) tokens needs >= {need} (or 0 for vLLM's default)")
    try:
        args.llm_kwargs_obj = json.loads(args.llm_kwargs)
    except ValueError as e:
        ap.error(f"--llm-kwargs: not JSON ({e})")
    if not isinstance(args.llm_kwargs_obj, dict):
        ap.error("--llm-kwargs: must be a JSON object of LLM(...) keyword arguments")
    try:
        args.target_dir = resolve_dir(args.model, "--model", ("gpt-oss-20b", "gpt-oss-tiny"))
        args.target_hf = json.loads((args.target_dir / "config.json").read_text())
        check_target_config(args.target_hf, str(args.target_dir / "config.json"))
        key = target_key(args.target_hf)
        if args.drafter is None:
            if key not in DRAFTERS:
                raise ValueError(f"--drafter: no shipped Eagle3 head for {args.target_dir} (shape not "
                                 "gpt-oss-120b/20b/tiny); pass --drafter <config dir>")
            args.drafter_dir = DRAFTERS[key]
        else:
            args.drafter_dir = resolve_dir(args.drafter, "--drafter", ("eagle3-gpt-oss-20b", "eagle3-gpt-oss-120b"))
        try:
            args.drafter_hf = json.loads((args.drafter_dir / "config.json").read_text())
        except ValueError as e:
            raise ValueError(f"--drafter: {args.drafter_dir / 'config.json'} is not JSON ({e})") from e
        args.drafter_notes = check_drafter_config(args.drafter_hf, args.target_hf,
                                                  str(args.drafter_dir / "config.json"))
    except ValueError as e:
        ap.error(str(e))
    vocab = args.target_hf["vocab_size"]
    if args.prompt_len + args.gen + MAX_K > int(args.target_hf.get("max_position_embeddings") or 1 << 30):
        ap.error("--prompt-len + --gen exceed the model's max_position_embeddings")
    if vocab < 32:
        ap.error(f"--model: vocab_size {vocab} too small")
    if args.out is None:
        args.out = "results/eagle_cost_dryrun.json" if args.dry_run else "results/eagle_cost.json"
    return args


def make_header(args, device: dict | None) -> dict:
    return {
        "benchmark": "eagle_cost",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "argv": sys.argv[1:],
        "dry_run": bool(args.dry_run),
        "device": (device or {}).get("device") or ("none (dry run)" if args.dry_run else None),
        "capability": (device or {}).get("capability"),
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "triton": _version("triton"),
        "vllm": _version("vllm"),
        "vllm_sm121": _version("vllm-sm121"),
        "git": git_info(),
        "git_commit": git_info()["commit"],
        "model": str(args.target_dir),
        "drafter": str(args.drafter_dir),
        "drafter_config": args.drafter_hf,
        "drafter_notes": args.drafter_notes,
        "batch": args.batch, "prompt_len": args.prompt_len, "gen": args.gen,
        "iters": args.iters, "warmup": args.warmup, "seed": args.seed, "ks": args.k_list,
        "backends": args.backend_list, "drafter_backend": args.drafter_backend,
        "method": {
            "step_ms": "(t(max_tokens=gen) - t(max_tokens=1)) / (target forwards(gen) - forwards(1)), wall, "
                       "median of iters",
            "ratio": "spec step_ms / plain step_ms, same backend",
            "break_even_tokens_per_step": "= ratio: mean tokens (accepted drafts + bonus) a spec step must "
                                          "emit to match plain decode",
            "verify_ratio": "GPU time of the target forward of 1+k tokens/seq (CUDA events around "
                            "_model_forward) / that of the 1-token forward in the plain run",
            "draft_ratio": "GPU time of drafter.propose (k drafts) / the plain 1-token forward",
        },
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == CHILD_FLAG:
        return child_main(argv[1], argv[2])
    args = parse_args(argv)
    runs = build_runs(args)
    out = Path(args.out)
    out = out if out.is_absolute() else Path.cwd() / out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"target  {args.target_dir}\ndrafter {args.drafter_dir} "
          f"({args.drafter_hf.get('num_hidden_layers')} layer, hidden {args.drafter_hf.get('hidden_size')}, "
          f"vocab {args.drafter_hf.get('vocab_size')}, draft vocab {args.drafter_hf.get('draft_vocab_size')})")
    for n in args.drafter_notes:
        print(f"  note: {n}")
    print(f"batch {args.batch}, prompt {args.prompt_len} tokens, gen {args.gen}, warm-up {args.warmup}, "
          f"iters {args.iters}; {len(runs)} runs (one process each):")
    for r in runs:
        print(f"  {r['name']:<18} LLM(**{json.dumps(r['llm_kwargs'])})")

    if args.dry_run:
        result = {"header": make_header(args, None), "runs": runs}
        rc = 0
        if not args.no_vllm_check:
            chk = vllm_check(args, runs)
            result["vllm_check"] = chk
            print(f"\nvLLM check: {'ok' if not chk['problems'] else str(len(chk['problems'])) + ' problem(s)'}")
            if chk.get("drafter"):
                print(f"  vLLM parses the drafter as {json.dumps(chk['drafter'], default=str)}")
            for p in chk["problems"]:
                print(f"  {p}")
            rc = 1 if chk["problems"] else 0
        out.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {out}\ndry run: nothing measured")
        return rc

    t_start = time.time()
    result = {"header": make_header(args, None), "runs": runs}
    log_dir = out.with_suffix(".logs")
    log_dir.mkdir(exist_ok=True)
    for i, r in enumerate(runs):
        print(f"\n{LOG_PREFIX} [{i + 1}/{len(runs)}] {r['name']} (elapsed {time.time() - t_start:.0f}s)", flush=True)
        spec = {"name": r["name"], "llm_kwargs": r["llm_kwargs"], "batch": args.batch,
                "prompt_len": args.prompt_len, "gen": args.gen, "iters": args.iters,
                "warmup": args.warmup, "seed": args.seed, "vocab": args.target_hf["vocab_size"]}
        res = run_child(spec, log_dir / f"{r['name'].replace('/', '.')}.log", args.timeout_per_run, args.verbose)
        r["result"] = res
        if i == 0 and res.get("error") and "no CUDA GPU" in str(res.get("error")):
            print("benchmarks/eagle_cost.py needs a CUDA GPU with vLLM 0.26.0 to measure anything "
                  f"({res['error']}). Use --dry-run for the plan and the config checks.", file=sys.stderr)
            return 2
        if res.get("device") and not result["header"]["device"]:
            result["header"].update(device=res["device"], capability=res["capability"])
        if res.get("error"):
            print(f"{LOG_PREFIX} {r['name']}: {res['error']}", flush=True)
            for line in res.get("error_log_lines") or []:
                print(f"    {line[:300]}")
        result["rows"] = derive(runs)
        out.write_text(json.dumps(result, indent=1, default=str))  # partial results survive
    result["header"]["elapsed_s"] = time.time() - t_start
    result["rows"] = derive(runs)
    print_table(result["rows"])
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out}; logs in {log_dir}")
    return 0 if any(r["step_ms"] for r in result["rows"] if r["k"]) else 1


if __name__ == "__main__":
    sys.exit(main())
