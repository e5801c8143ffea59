"""What one gpt-oss decode step costs the host and which kernels it runs (torch.profiler).

    python benchmarks/profile_step.py                               # tiny, SM121, vLLM's graphs
    python benchmarks/profile_step.py --backend default             # upstream's selection
    python benchmarks/profile_step.py --eager --moe-experimental    # per-layer kernel list, plugin MoE
    python benchmarks/profile_step.py --model models/gpt-oss-20b --out results/profile.json

Method
    The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) on dummy weights, so
    torch.profiler (CPU + CUDA activities) sees the model runner's host calls and the kernels.
    One 16-token prompt (``--batch B``: B distinct ones, decoded together), greedy, ignore_eos
    (``--random-router``: routers refilled and the token-independent biases zeroed as in
    ``benchmarks/e2e.py``, so batched decode routes like real weights); after a warm-up, two
    generations are profiled:
    max_tokens = 2 and 2 + --steps. Per decode step = (count(long) - count(short)) / --steps,
    so prefill, request setup and teardown cancel out.

    Host side: every CUDA runtime / driver API call the profiler records (names starting "cu"),
    grouped as graph launches, kernel launches (runtime and driver: Triton launches through
    cuLaunchKernel), copies, memsets and other (events, synchronisation, ...).
    Device side: kernels per step by name and, divided by the model's layer count, per layer.
    Under CUDA graphs the kernels inside a replay are listed where the profiler records graph
    nodes (CUDA 12+); --eager gives the plain per-layer list.

    "standalone quantization kernels": kernels whose name matches QUANT_RE and not FUSED_RE
    (the plugin's producers that quantize as part of other work: norm, SwiGLU, FC1/FC2, KV
    write). The plugin's MoE routing kernel (``_moe_route_kernel``) doubles as the bf16 -> MXFP8
    quantizer where no MXFP8 producer feeds the experts: read its per-layer count in the kernel
    list (1 = routing only, 2 = routing + a standalone quantization). The "kernels" list holds
    every device activity the profiler records, device copies and memsets included.

Host-time scopes (``--scopes``; issue 7's stage 0, docs/design-whole-model-graph.md): where the
host's time per decode step goes. Before profiling, two more generations (the same short / long
pair) run WITHOUT the profiler while the methods in SCOPES are wrapped with wall-clock timers;
per step = (time(long) - time(short)) / --steps for each, inclusive of the scopes nested inside
it (e.g. execute_model contains _prepare_inputs and _model_forward). Host time, not GPU time:
kernels run asynchronously, except where a scope waits for the GPU (``AsyncGPUModelRunnerOutput
.get_output`` synchronizes on the output copy), which the table says.

Output: a table, and JSON (--out) with the header (device, versions, commit), the LLM kwargs
and the per-step counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

QUANT_RE = re.compile(r"quant|downcast|to_mxfp|mxfp8|fp8_cast|cast_to_fp8", re.I)
FUSED_RE = re.compile(r"norm|swiglu|fc1|fc2|kv_write|write_kv|kv_cache", re.I)
API_GROUPS = (  # (group, predicate on the API name), first match wins
    ("graph launches", lambda n: "GraphLaunch" in n),
    ("kernel launches", lambda n: "LaunchKernel" in n or "LaunchCooperativeKernel" in n),
    ("copies", lambda n: "Memcpy" in n),
    ("memsets", lambda n: "Memset" in n),
)
BACKENDS = ("SM121", "TRITON_ATTN", "FLASH_ATTN", "default")
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"


def _scope(label: str, target: str) -> tuple[str, str, str, str]:
    """(label, module, class, method) from "module:Class.method"."""
    module, qualname = target.split(":")
    cls_name, method = qualname.split(".")
    return label, module, cls_name, method


# (label, "module:Class.method"): the host-side pieces of one vLLM 0.26 decode step, engine loop
# to front end (docs/design-whole-model-graph.md section 1). EngineCore binds step_fn at
# construction, so the iteration is timed where the in-process client calls it (step_fn +
# post_step). "waits for the GPU" marks a synchronization.
SCOPES = tuple(_scope(label, target) for label, target in (
    ("engine iteration (InprocClient.get_output)", "vllm.v1.engine.core_client:InprocClient.get_output"),
    ("  scheduler.schedule", f"{_SCHED}.schedule"),
    ("  runner.execute_model", f"{_RUNNER}.execute_model"),
    ("    _update_states", f"{_RUNNER}._update_states"),
    ("    _prepare_inputs", f"{_RUNNER}._prepare_inputs"),
    ("    _build_attention_metadata", f"{_RUNNER}._build_attention_metadata"),
    ("    _model_forward (graph replay)", f"{_RUNNER}._model_forward"),
    ("  runner.sample_tokens", f"{_RUNNER}.sample_tokens"),
    ("    _sample", f"{_RUNNER}._sample"),
    ("    _bookkeeping_sync", f"{_RUNNER}._bookkeeping_sync"),
    # the whole-model mode's runner (a subclass): steady steps never enter the stock rows above,
    # other steps nest them
    ("  whole-model runner.execute_model", "vllm_sm121.graph.runner:WholeModelRunner.execute_model"),
    ("  whole-model runner.sample_tokens", "vllm_sm121.graph.runner:WholeModelRunner.sample_tokens"),
    ("  output.get_output (waits for the GPU)", "vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput.get_output"),
    ("  steady output.get_output (waits for the GPU)", "vllm_sm121.graph.runner:_TokensOutput.get_output"),
    ("  scheduler.update_from_output", f"{_SCHED}.update_from_output"),
    ("front end: output_processor.process_outputs", "vllm.v1.engine.output_processor:OutputProcessor.process_outputs"),
))


class ScopeTimers:
    """Wall-clock time and calls of class methods, by wrapping them on their classes (every
    instance, subclasses that do not override them included) until ``restore``."""

    def __init__(self, scopes, clock=None):
        import importlib
        import time

        self.clock = clock or time.perf_counter
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        self._saved = []
        for label, module, cls_name, method in scopes:
            cls = getattr(importlib.import_module(module), cls_name)
            orig = cls.__dict__.get(method)
            if orig is None:
                raise AttributeError(f"{module}.{cls_name}.{method} does not exist in this vLLM (scope {label!r})")
            self._saved.append((cls, method, orig))
            setattr(cls, method, self._wrap(label, orig))

    def _wrap(self, label, fn):
        import functools

        @functools.wraps(fn)
        def timed(*a, **k):
            t0 = self.clock()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[label] += self.clock() - t0
                self.calls[label] += 1
        return timed

    def snapshot(self) -> tuple[collections.Counter, collections.Counter]:
        return collections.Counter(self.seconds), collections.Counter(self.calls)

    def restore(self) -> None:
        for cls, method, orig in reversed(self._saved):
            setattr(cls, method, orig)
        self._saved.clear()


def scope_table(short, long, steps: int, labels) -> list[dict]:
    """Per decode step: ms and calls of each scope, from two (seconds, calls) snapshots."""
    (s_sec, s_calls), (l_sec, l_calls) = short, long
    return [{"scope": lab, "ms_per_step": (l_sec[lab] - s_sec[lab]) / steps * 1e3,
             "calls_per_step": (l_calls[lab] - s_calls[lab]) / steps} for lab in labels]


def api_group(name: str) -> str:
    """The group of a CUDA API call name ("other" when none matches)."""
    for group, match in API_GROUPS:
        if match(name):
            return group
    return "other"


def per_step(short: collections.Counter, long: collections.Counter, steps: int) -> dict[str, float]:
    """Calls per decode step from two profiles (max_tokens 2 and 2 + steps), names with > 0."""
    out = {}
    for name in set(short) | set(long):
        v = (long.get(name, 0) - short.get(name, 0)) / steps
        if v > 0:
            out[name] = v
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def standalone_quant(kernels: dict[str, float]) -> dict[str, float]:
    """Kernels that look like activation quantization and are not one of the fused producers."""
    return {k: v for k, v in kernels.items() if QUANT_RE.search(k) and not FUSED_RE.search(k)}


def summarize(api: dict[str, float], kernels: dict[str, float], layers: int,
              kernel_us: dict[str, float] | None = None) -> dict:
    """Per decode step: API calls by group, kernels by count, and (``kernel_us``: device µs per kernel
    name and step) their device time, largest first, with the sum."""
    groups: dict[str, float] = collections.Counter()
    for name, v in api.items():
        groups[api_group(name)] += v
    core = sum(v for g, v in groups.items() if g != "other")
    return {
        "api_per_step": api,
        "api_groups_per_step": dict(groups),
        "launches_copies_memsets_per_step": core,
        "kernels_per_step": kernels,
        "kernels_per_layer": {k: v / layers for k, v in kernels.items()},
        "standalone_quant_kernels": standalone_quant(kernels),
        **({"kernel_us_per_step": dict(sorted(kernel_us.items(), key=lambda kv: -kv[1])),
            "kernel_us_per_step_total": sum(kernel_us.values())} if kernel_us is not None else {}),
    }


def build_kwargs(args, hf: dict) -> dict:
    kw = dict(model=str(args.model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=1024, enable_prefix_caching=False, gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.eager)
    if not args.eager:
        kw["compilation_config"] = {"max_cudagraph_capture_size": args.capture_size}
    if args.backend != "default":
        kw["attention_backend"] = args.backend
    if args.kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    sm121 = {}
    if args.dense_fp8:
        sm121["dense_weights"] = "fp8"
    if args.whole_model:
        sm121["cudagraph"] = "whole_model"
    if sm121:
        kw["additional_config"] = {"sm121": sm121}
    return kw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO_ROOT / "models" / "gpt-oss-tiny"))
    ap.add_argument("--backend", default="SM121", choices=BACKENDS)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (plain per-layer kernel list)")
    ap.add_argument("--capture-size", type=int, default=8, help="max_cudagraph_capture_size (default 8)")
    ap.add_argument("--moe-experimental", action="store_true",
                    help="the plugin's MoE ($VLLM_SM121_MOE_EXPERIMENTAL=1; gated off by default)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "nvfp4"),
                    help="vLLM's --kv-cache-dtype (nvfp4 needs --backend SM121)")
    ap.add_argument("--dense-fp8", action="store_true", help='additional_config sm121.dense_weights = "fp8"')
    ap.add_argument("--whole-model", action="store_true",
                    help='additional_config sm121.cudagraph = "whole_model" (issue 7, stage A: lm_head + greedy '
                    "sampling inside the FULL decode graph; needs graphs, i.e. not --eager)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps between the two profiles (default 32)")
    ap.add_argument("--batch", type=int, default=1,
                    help="prompts decoded together (default 1; at most --capture-size unless --eager)")
    ap.add_argument("--random-router", action="store_true",
                    help="refill the MoE routers and zero the token-independent biases after start-up "
                    "(benchmarks/e2e.py --random-router): batched decode then routes like real weights")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--top", type=int, default=40, help="kernels printed (default 40)")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--dry-run", action="store_true", help="print the LLM kwargs and exit (no GPU needed)")
    ap.add_argument("--scopes", action="store_true",
                    help="also time the host-side pieces of a decode step (SCOPES), without the profiler")
    args = ap.parse_args(argv)
    for name in ("steps", "capture_size", "top", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.eager and args.batch > args.capture_size:
        ap.error(f"--batch {args.batch} is above --capture-size {args.capture_size}: its decode steps would "
                 "not replay a graph; raise --capture-size or use --eager")
    if args.kv_cache_dtype == "nvfp4" and args.backend != "SM121":
        ap.error(f"--kv-cache-dtype nvfp4 needs --backend SM121 (got {args.backend}): no other backend on "
                 "sm_90 / sm_12x reads an nvfp4 cache")
    if args.moe_experimental and args.backend != "SM121":
        ap.error("--moe-experimental needs --backend SM121 (the plugin's MoE is on by default only with the "
                 "SM121 attention backend)")
    args.model = Path(args.model).resolve()
    cfg_path = args.model / "config.json"
    if not cfg_path.is_file():
        ap.error(f"--model {args.model}: no config.json there")
    hf = json.loads(cfg_path.read_text())
    layers = int(hf["num_hidden_layers"])
    kw = build_kwargs(args, hf)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if args.random_router:  # LLM.apply_model ships a function to the model's worker
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if args.moe_experimental:
        env["VLLM_SM121_MOE_EXPERIMENTAL"] = "1"
    print(f"LLM(**{json.dumps(kw)})  env {env}", flush=True)
    if args.dry_run:
        return 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to profile (use --dry-run to check the arguments)", file=sys.stderr)
        return 2
    os.environ.update(env)  # before vLLM and the plugin are imported (the MoE gate is read at import)
    from e2e import git_info, _version
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**kw)
    if args.random_router:
        import functools

        from e2e import randomize_routers

        print(f"routers refilled in {llm.apply_model(functools.partial(randomize_routers, seed=0))} layers",
              flush=True)
    prompts = [TokensPrompt(prompt_token_ids=list(range(100 + 16 * i, 116 + 16 * i))) for i in range(args.batch)]

    def generate(n: int) -> None:
        llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), use_tqdm=False)

    generate(8)
    generate(2 + args.steps)
    scopes = None
    if args.scopes:
        timers = ScopeTimers(SCOPES)
        try:
            snaps = []
            for n in (2, 2 + args.steps):
                before = timers.snapshot()
                t0 = timers.clock()
                generate(n)
                wall = timers.clock() - t0
                after = timers.snapshot()
                snaps.append(((after[0] - before[0]) + collections.Counter({"generate (wall)": wall}),
                              after[1] - before[1] + collections.Counter({"generate (wall)": 1})))
        finally:
            timers.restore()
        scopes = scope_table(snaps[0], snaps[1], args.steps, ["generate (wall)"] + [s[0] for s in SCOPES])
    counts = []
    for n in (2, 2 + args.steps):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate(n)
            torch.cuda.synchronize()
        api, kern, kern_us = collections.Counter(), collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kern[e.name] += 1
                kern_us[e.name] += e.time_range.elapsed_us()
            elif e.name.startswith("cu"):
                api[e.name] += 1
        counts.append((api, kern, kern_us))
    res = summarize(per_step(counts[0][0], counts[1][0], args.steps),
                    per_step(counts[0][1], counts[1][1], args.steps), layers,
                    per_step(counts[0][2], counts[1][2], args.steps))

    print(f"\ndevice {torch.cuda.get_device_name()}  layers {layers}  steps {args.steps}  batch {args.batch}  "
          f"random-router {args.random_router}  backend {args.backend}  "
          f"eager {args.eager}  moe-experimental {args.moe_experimental}  dense-fp8 {args.dense_fp8}  "
          f"whole-model {args.whole_model}")
    print("\nCUDA API calls per decode step")
    for g, v in sorted(res["api_groups_per_step"].items(), key=lambda kv: -kv[1]):
        print(f"  {g:<16} {v:8.2f}")
    print(f"  {'launches+copies+memsets':<24} {res['launches_copies_memsets_per_step']:.2f}")
    for name, v in res["api_per_step"].items():
        print(f"    {name:<40} {v:8.2f}")
    print(f"\nkernels per decode step (per layer = / {layers})")
    for name, v in list(res["kernels_per_step"].items())[: args.top]:
        print(f"  {v:8.2f}  {v / layers:6.2f}  {name[:110]}")
    if "kernel_us_per_step" in res:
        total = res["kernel_us_per_step_total"]
        print(f"\ndevice time per decode step: {total:.1f} us in kernels, copies and memsets (sum; overlap not removed)")
        for name, us in list(res["kernel_us_per_step"].items())[: args.top]:
            n = res["kernels_per_step"].get(name, 0)
            print(f"  {us:9.1f} us  {100 * us / total:5.1f}%  {us / n if n else 0:7.2f} us/call  {name[:96]}")
    print(f"\nstandalone quantization kernels: {res['standalone_quant_kernels'] or 'none'}")
    if scopes is not None:
        print("\nhost time per decode step (inclusive; unprofiled runs)")
        for row in scopes:
            print(f"  {row['scope']:<46} {row['ms_per_step']:8.3f} ms  {row['calls_per_step']:6.2f} calls")
        res["host_scopes_per_step"] = scopes
    out = {"header": {"device": torch.cuda.get_device_name(), "commit": git_info(),
                      "versions": {k: _version(k) for k in ("vllm", "torch", "triton", "vllm-sm121")}},
           "llm_kwargs": kw, "env": env, "layers": layers, "steps": args.steps, "batch": args.batch,
           "random_router": args.random_router, **res}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
