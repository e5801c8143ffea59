"""gpt-oss MoE block benchmark: ours (``sm121``: MXFP4 x MXFP8 kernels) vs vLLM 0.26's MXFP4 MoE
backends on the same card, same run.

Usage (needs a CUDA GPU with vLLM 0.26.0; without one it says so and exits 2)::

    python benchmarks/moe.py                          # gpt-oss-120b layer, M = 1..4096, all providers
    python benchmarks/moe.py --m 1,8,512 --providers sm121,triton --reps 20
    python benchmarks/moe.py --experts 32             # gpt-oss-20b layer
    python benchmarks/moe.py --m 1,2,4 --providers sm121_fma,sm121_decode,triton \
        --fma-tiles "64,256,32,256,8,1;64,128,16,128,4,1"  # + FMA decode tile sweep
    python benchmarks/moe.py --m 8,64,512,4096 --providers sm121_grouped,triton \
        --grouped-tiles "16,128,128,4,3;32,128,128,4,3"     # + grouped (prefill) tile sweep
    python benchmarks/moe.py --dry-run                # CPU, Triton interpreter: tiny shapes; ours run
                                                      # (sm121 through vLLM's layer), upstream: config only

Shapes
    gpt-oss-120b expert layer: hidden 2880, intermediate 2880, 128 experts, top-4, biases, gpt-oss
    SwiGLU; weights in the checkpoint's MXFP4 layout with random valid e2m1 codes and e8m0 scales
    2**-9..2**-6 (dummy loading would leave zeros); x and router logits N(0, 1) bf16, so routing
    is near uniform (M tokens touch ~min(E, 4M) experts).

Providers (each one vLLM ``FusedMoE`` layer built and called through vLLM's own layer API, as the
engine does for gpt-oss: a ``VllmConfig`` whose ``ModelConfig`` is a gpt-oss checkpoint
(models/gpt-oss-20b/config.json, quantization_config mxfp4, with this run's hidden/intermediate/
experts/top-k, written to a temp dir), ``LoadConfig(load_format="dummy")`` and
``KernelConfig(moe_backend=...)`` (= ``--moe-backend``); under ``set_current_vllm_config`` the
layer is ``FusedMoE(...)`` with gpt_oss.py MLPBlock's arguments and ``vllm_config.quant_config``,
the checkpoint tensors go in through the parameters' ``weight_loader`` (as gpt_oss.py's MXFP4
loader), then vLLM's ``process_weights_after_loading`` (-> ``quant_method.process_weights_after_loading``),
and ``layer(x, router_logits)`` runs under ``set_forward_context``, i.e. MoERunner ->
``vllm::moe_forward`` -> the method; every provider gets the same random MXFP4 codes/scales/biases)
    sm121           our ``Sm121Mxfp4MoEMethod`` (``sm121_mxfp4`` config resolved to "mxfp8");
                    sm121_fma / sm121_decode / sm121_grouped: its three paths forced (kernel
                    launcher ``moe_block(path=...)`` only; fma: CUDA-core GEMVs, above 4 tokens
                    windowed (4 of an expert's tokens per program; one routing launch);
                    decode: tl.dot_scaled GEMVs; grouped: GEMMs over expert-sorted pairs).
                    sm121_fmaq: the fma path handed MXFP8 activations, as the fused norm hands
                    them in the model (quantized once outside the timing; routing only, or
                    inside FC1 with VLLM_SM121_MOE_FUSED_ROUTE=1).
    triton          ``GptOssMxfp4MoEMethod`` with ``--moe-backend triton``: vLLM's default on sm_90
                    (vendored triton_kernels ``matmul_ogs``, bf16 x mxfp4).
    marlin          ``GptOssMxfp4MoEMethod`` with ``--moe-backend marlin`` (W4A16; GB10's default).
                    ``VLLM_MARLIN_INPUT_DTYPE=fp8`` (W4A8) is SM89/SM12x-only and raises on sm_90.
    A provider that cannot be built on the card gets a row with its error.

Timing
    One CUDA graph per (provider, M) holding one layer call; each replay after a 256 MiB write
    that evicts L2; CUDA events; p20/p50/p80 over --reps. Bytes moved: the distinct experts the
    routing touches (their MXFP4 blocks, scales and biases, both GEMMs) + activations in/out;
    % of copy bandwidth: bytes / p50 over a device-to-device 1 GiB copy measured in this run.

FMA tile sweep (--fma-tiles "t1;t2;...", each t = fc1_rows,fc1_kb,fc2_rows,fc2_kb,warps,stages
[,fc2_warps,fc2_stages[,fc2_split[,fc1_split]]] as in $VLLM_SM121_MOE_FMA_TILES; stages 2 = register
prefetch of the next K step; fc2_split / fc1_split = FC2 / FC1 split-K): for every tile and every M <= 4, the
whole block (path fma) and FC1 / FC2+combine alone, each its own CUDA graph timed as above, with
GB/s and % of copy bandwidth (FC1: the routed experts' w13 + scales + bias; FC2: w2's); the
fastest tile per M is printed last. A tile that fails to compile is a row with its error.

Grouped tile sweep (--grouped-tiles "t1;t2;...", each t = bm,bn,bk,warps,stages as in
$VLLM_SM121_MOE_GROUPED_TILE: tokens per tile, weight rows per program, K step, warps, pipeline
stages): for every tile and every M, the whole block (path grouped, the tile forced through the
environment variable) and FC1 / FC2+sum alone (MXFP8 input from the routing launch, the tile's
moe_align map built outside the graph), timed and reported as the FMA sweep (FC1 bytes: the routed
experts' w13 + scales + bias; FC2: w2's); records "sm121_grouped_tile"; the fastest tile per M last.

Correctness (--refcheck, default on): each provider's output vs the dequantized fp32 reference
``moe_block_torch`` (MXFP8 activations) and vs the bf16-activation reference (rel L2).

Output: a table and JSON (--out, default results/moe.json): header (device, capability,
versions, commit from VLLM_SM121_COMMIT or git, copy bandwidth) + one record per (provider, M).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import _version, git_info  # noqa: E402  (benchmarks/e2e.py: versions and commit, as the e2e JSON)

REPO_ROOT = Path(__file__).resolve().parents[1]
PROVIDERS = ("sm121", "sm121_fma", "sm121_decode", "sm121_grouped", "triton", "marlin", "sm121_fmaq")
DEFAULT_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
FLUSH_BYTES = 256 << 20
COPY_BYTES = 1 << 30
NO_CUDA_MESSAGE = "benchmarks/moe.py needs a CUDA GPU (use --dry-run on the CPU)"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default=None, help="token counts, comma separated (default 1..4096)")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--inter", type=int, default=2880)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-refcheck", dest="refcheck", action="store_false")
    ap.add_argument("--fma-tiles", default="",
                    help="FMA decode tile sweep: 'fc1_rows,fc1_kb,fc2_rows,fc2_kb,warps,stages"
                         "[,fc2_warps,fc2_stages[,fc2_split[,fc1_split]]];...'")
    ap.add_argument("--align", action="store_true",
                    help="also time moe_align (one Triton launch) against moe_align_torch at each M "
                         "(the grouped path's tile map, BLOCK_M of the tile table)")
    ap.add_argument("--norm-router", action="store_true",
                    help="also time the MoE's input producer: norm kernel + router GEMM vs the router inside "
                         "the norm kernel, at each M")
    ap.add_argument("--grouped-tiles", default="",
                    help="grouped (prefill) tile sweep: 'bm,bn,bk,warps,stages;...'")
    ap.add_argument("--grouped-f2", choices=("auto", "on"), default="auto",
                    help="the grouped GEMMs' second scale multiply: auto (default) registers the weights' scales "
                         "as the plugin's MoE method does at load (F2 dropped: these scales are <= 128); on keeps "
                         "it (A/B)")
    ap.add_argument("--in-graph", type=int, default=0, metavar="N",
                    help="time N (L2 flush, call) pairs in one graph minus N flushes (no host launch latency "
                         "in the numbers); 0 (default): one call per graph replay, host launch latency included")
    ap.add_argument("--out", default=str(REPO_ROOT / "results" / "moe.json"))
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU + Triton interpreter, tiny shapes: ours run, upstream providers config only")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.hidden, args.inter, args.experts = 64, 64, 8
        args.m = args.m or "1,3,17"
        args.reps = 1
    args.m = [int(x) for x in (args.m.split(",") if args.m else DEFAULT_M)]
    args.providers = [p for p in args.providers.split(",") if p]
    args.fma_tiles = [t.strip() for t in args.fma_tiles.replace(" ", ";").split(";") if t.strip()]
    args.grouped_tiles = [t.strip() for t in args.grouped_tiles.replace(" ", ";").split(";") if t.strip()]
    bad = sorted(set(args.providers) - set(PROVIDERS))
    if bad:
        ap.error(f"unknown providers {bad}; supported: {', '.join(PROVIDERS)}")
    return args


# ---- data ---------------------------------------------------------------------------------------

def make_weights(args, device, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    e, h, i = args.experts, args.hidden, args.inter

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(device)

    def scales(*shape):
        return torch.randint(118, 122, shape, generator=g, dtype=torch.uint8).to(device)

    def bias(*shape):
        return (torch.randn(shape, generator=g) * 0.1).bfloat16().to(device)

    return {"w13_weight": codes(e, 2 * i, h // 2), "w13_weight_scale": scales(e, 2 * i, h // 32), "w13_bias": bias(e, 2 * i),
                "w2_weight": codes(e, h, i // 2), "w2_weight_scale": scales(e, h, i // 32), "w2_bias": bias(e, h)}


def fc1_expert_bytes(args) -> int:
    h, i = args.hidden, args.inter
    return 2 * i * (h // 2 + h // 32) + 2 * i * 2


def fc2_expert_bytes(args) -> int:
    h, i = args.hidden, args.inter
    return h * (i // 2 + i // 32) + h * 2


def expert_bytes(args) -> int:
    return fc1_expert_bytes(args) + fc2_expert_bytes(args)


def bytes_moved(args, topk_ids: torch.Tensor) -> int:
    m = topk_ids.shape[0]
    return int(topk_ids.unique().numel()) * expert_bytes(args) + m * args.hidden * 2 * 2 + m * args.experts * 2


# ---- providers (each returns fn() -> bf16 [M, H]) -------------------------------------------------

UPSTREAM_MOE_BACKENDS = {"triton": "triton", "marlin": "marlin"}  # provider -> --moe-backend (KernelConfig.moe_backend)
HF_CONFIG = REPO_ROOT / "models" / "gpt-oss-20b" / "config.json"  # shipped; 120b differs only in experts/layers
_CONFIG_DIRS: dict[str, tempfile.TemporaryDirectory] = {}
_DIST_READY = False


def gpt_oss_hf_config(args) -> dict:
    """The checkpoint's config.json (quantization_config: mxfp4) with the benchmark's layer shape."""
    cfg = json.loads(HF_CONFIG.read_text())
    cfg.update(hidden_size=args.hidden, intermediate_size=args.inter, num_local_experts=args.experts,
               num_experts_per_tok=args.topk, experts_per_token=args.topk)
    return cfg


def model_dir(args) -> str:
    """A directory holding ``gpt_oss_hf_config(args)`` as config.json (kept for the process)."""
    text = json.dumps(gpt_oss_hf_config(args), indent=1, sort_keys=True)
    if text not in _CONFIG_DIRS:
        tmp = tempfile.TemporaryDirectory(prefix="moe-bench-gpt-oss-")
        (Path(tmp.name) / "config.json").write_text(text)
        _CONFIG_DIRS[text] = tmp
    return _CONFIG_DIRS[text].name


def build_model_config(args):
    """vLLM's ModelConfig for the gpt-oss checkpoint shape (what ``vllm serve`` builds; CPU-safe)."""
    from vllm.config import ModelConfig

    return ModelConfig(model=model_dir(args), skip_tokenizer_init=True, dtype="bfloat16", seed=0)


def build_vllm_config(provider: str, args, model_config=None, device: str = "cuda"):
    """The VllmConfig ``provider``'s layer is built and run under.

    ``sm121``: our config (``sm121_mxfp4`` resolved to "mxfp8", as resolve_moe gives gpt-oss with
    --attention-backend SM121). Upstream providers: the quant config vLLM derives from the
    checkpoint (``gpt_oss_mxfp4``) with ``--moe-backend <provider>``.
    """
    from vllm.config import DeviceConfig, KernelConfig, LoadConfig, VllmConfig

    model_config = model_config or build_model_config(args)
    quant_config = None
    if provider.startswith("sm121"):
        from vllm_sm121.moe.method import Sm121GptOssMxfp4Config

        quant_config = Sm121GptOssMxfp4Config.from_config(model_config.hf_config.quantization_config)
        quant_config._moe = "mxfp8"
    return VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="dummy"),
                      device_config=DeviceConfig(device=device), quant_config=quant_config,
                      kernel_config=KernelConfig(moe_backend=UPSTREAM_MOE_BACKENDS.get(provider, "auto")))


def layer_kwargs(vllm_config, prefix: str) -> dict:
    """``FusedMoE`` arguments exactly as gpt_oss.py's MLPBlock passes them (TP 1, no SP)."""
    hf = vllm_config.model_config.hf_config
    return {"num_experts": hf.num_local_experts, "top_k": hf.num_experts_per_tok, "hidden_size": hf.hidden_size,
            "intermediate_size": hf.intermediate_size, "renormalize": True, "quant_config": vllm_config.quant_config,
            "prefix": prefix, "apply_router_weight_on_input": False, "has_bias": True, "activation": "swigluoai",
            "is_sequence_parallel": False}


def _init_vllm_dist(device: str = "cuda"):
    global _DIST_READY
    if _DIST_READY:
        return
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}",
                                 backend="nccl" if device == "cuda" else "gloo")
    initialize_model_parallel(1, 1)
    if device == "cuda":  # what GPUModelRunner does: Marlin's MoE takes its scratch from vLLM's workspace manager
        from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

        if not is_workspace_manager_initialized():
            init_workspace_manager(torch.device(device))
    _DIST_READY = True


def load_weights(experts, weights: dict) -> None:
    """Checkpoint tensors into the layer's parameters through their weight_loader, as gpt_oss.py's
    MXFP4 loader does (combined experts; backends that pad keep the checkpoint top-left)."""
    for name, w in weights.items():
        param = getattr(experts, name)
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            raise RuntimeError(f"{name} has no weight_loader")
        loader(param, w.to(param.device), weight_name=f"{experts.layer_name}.{name}", shard_id=None, expert_id=None)


def make_vllm_layer(provider: str, args, weights: dict, device: str = "cuda"):
    """A vLLM FusedMoE layer with ``provider``'s method; returns (fn(x, logits), info)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import FusedMoE
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    vc = build_vllm_config(provider, args, device=device)
    prefix = f"model.layers.{PROVIDERS.index(provider)}.mlp.experts"
    # Everything vLLM-side (model-parallel groups, layer construction, weight processing, the
    # forward) runs under this config, as in the engine: vLLM 0.26 reads it in all of them
    # (e.g. the MXFP4 oracle reads vllm_config.model_config.quantization_config).
    with set_current_vllm_config(vc):
        _init_vllm_dist(device)
        with set_default_torch_dtype(vc.model_config.dtype), torch.device(device):
            layer = FusedMoE(**layer_kwargs(vc, prefix))
        experts = layer.routed_experts
        with torch.no_grad():
            load_weights(experts, weights)
        process_weights_after_loading(layer, vc.model_config, torch.device(device))
    method = experts.quant_method
    if provider in UPSTREAM_MOE_BACKENDS:
        from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import map_mxfp4_backend
        from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod

        wanted = map_mxfp4_backend(UPSTREAM_MOE_BACKENDS[provider])
        if not isinstance(method, GptOssMxfp4MoEMethod) or method.mxfp4_backend not in wanted:
            raise RuntimeError(f"got {type(method).__name__}/{getattr(method, 'mxfp4_backend', None)}, "
                               f"expected GptOssMxfp4MoEMethod/{[b.name for b in wanted]}")
    backend = getattr(method, "mxfp4_backend", None)
    info = f"{type(method).__name__}/{backend.name if backend is not None else 'sm121'}"
    if getattr(method, "experts_cls", None) is not None:
        info += f"/{method.experts_cls.__name__}"

    def fn(x, logits):
        with set_current_vllm_config(vc), set_forward_context(None, vc):
            return layer(x, logits)[:, : args.hidden]

    return fn, info


def make_kernel_path(path: str, args, weights: dict):
    from vllm_sm121.kernels.moe import moe_block, mxfp8_quantize

    w = weights
    prequant = path == "fmaq"
    path = "fma" if prequant else path
    cache: dict = {}

    def fn(x, logits):
        x_scale = None
        if prequant:  # MXFP8 input as the fused norm gives it: quantized once, outside the timed graph
            if cache.get("x") is not x:
                cache.update(x=x, q=mxfp8_quantize(x))
            x, x_scale = cache["q"]
        return moe_block(x, logits, w["w13_weight"], w["w13_weight_scale"], w["w13_bias"], w["w2_weight"],
                         w["w2_weight_scale"], w["w2_bias"], args.topk, x_scale=x_scale, path=path)

    return fn, f"kernels.moe.moe_block(path={path}{', MXFP8 input' if prequant else ''})"


def make_provider(provider: str, args, weights: dict, device):
    """(fn, info), or a status string for a provider that is not run here."""
    if provider.startswith("sm121_"):
        return make_kernel_path(provider.split("_", 1)[1], args, weights)
    if device.type != "cuda" and provider in UPSTREAM_MOE_BACKENDS:
        # Their kernels need CUDA; check what can be checked here: the config they are built under.
        vc = build_vllm_config(provider, args, device=device.type)
        return (f"skipped: needs CUDA (config ok: quantization {vc.model_config.quantization}, "
                f"--moe-backend {vc.kernel_config.moe_backend}, {vc.model_config.hf_config.num_local_experts} experts)")
    return make_vllm_layer(provider, args, weights, device=device.type)


# ---- timing -------------------------------------------------------------------------------------

# --in-graph N: time N (L2 flush, call) pairs captured in one graph, minus a graph of N flushes,
# per call: no host launch latency between the events (a one-launch graph's replay waits ~5-8 us
# for the host to submit it, which a layer inside the model's graph never does). 0: one call per replay.
IN_GRAPH = 0


def _replay_us(graph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def time_graph(fn, reps: int, flush: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    out = fn()  # warm up (compiles / autotunes)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    if IN_GRAPH:
        pairs, flushes = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(pairs):
            for _ in range(IN_GRAPH):
                flush.zero_()
                fn()
        with torch.cuda.graph(flushes):
            for _ in range(IN_GRAPH):
                flush.zero_()
        _replay_us(pairs), _replay_us(flushes)
        times = [(_replay_us(pairs) - _replay_us(flushes)) / IN_GRAPH for _ in range(reps)]
        graph.replay()  # ``out`` (the reference checks') is the one-call graph's output
        torch.cuda.synchronize()
        return times, out
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times, out


def measure_copy_bandwidth(device, reps: int = 10) -> float:
    """GB/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3)
    return 2 * COPY_BYTES / statistics.median(ts) / 1e9


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def header(device, copy_gbps) -> dict:
    commit = git_info()["commit"]
    versions = {pkg: _version(pkg) for pkg in ("vllm", "torch", "triton", "vllm-sm121")}
    cuda = device.type == "cuda"
    return {"benchmark": "moe", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)",
                "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
                "versions": versions, "commit": commit, "copy_gbps": copy_gbps,
                # the plugin's switches this run had (packed products, register cap, fusions, tiles, ...)
                "sm121_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_SM121_")},
                # what the FMA GEMVs multiply with here (packed fp16 is the GPU default since stop 25)
                "fma_products": "packed fp16" if _fma_f16x2(device) else "exact fp32",
                # the grouped GEMMs' weight decoder (stop 41): "halves" replaces every tile's bk by 128
                "grouped_decoder": "halves" if _grouped_halves(device) else "checkpoint order"}


def _fma_f16x2(device) -> bool:
    from vllm_sm121.kernels.moe import fma_f16x2

    return fma_f16x2(torch.empty(0, device=device))


def _grouped_halves(device) -> bool:
    from vllm_sm121.kernels.moe import grouped_halves

    return grouped_halves(torch.empty(0, device=device))


def fma_tile_sweep(args, weights: dict, device, flush, copy_gbps) -> list[dict]:
    """Time the FMA decode path per tile (--fma-tiles) at each M of one launch (<= FMA_LAUNCH_MAX_TOKENS;
    windowed above 4 tokens): block, FC1, FC2 + combine."""
    from vllm_sm121.kernels import moe as K

    w = weights

    def parts(spec, x, logits, xq, xs, topk_ids, topk_w):
        tiles = K.FmaTiles.parse(spec)
        h, hs = K.moe_fc1_swiglu_fma(xq, xs, w["w13_weight"], w["w13_weight_scale"], w["w13_bias"], topk_ids)
        return (("block", lambda: K.moe_block(x, logits, w["w13_weight"], w["w13_weight_scale"], w["w13_bias"],
                                              w["w2_weight"], w["w2_weight_scale"], w["w2_bias"], args.topk,
                                              path="fma")),
                ("fc1", lambda: K.moe_fc1_swiglu_fma(xq, xs, w["w13_weight"], w["w13_weight_scale"], w["w13_bias"],
                                                     topk_ids, tiles)),
                ("fc2", lambda: K.moe_fc2_combine_fma(h, hs, w["w2_weight"], w["w2_weight_scale"], w["w2_bias"],
                                                      topk_ids, topk_w, tiles)))

    return _tile_sweep(args, w, device, flush, copy_gbps, parts, name="FMA", provider="sm121_fma_tile",
                       env=K.FMA_TILES_ENV, specs=args.fma_tiles,
                       ms=[m for m in args.m if 0 < m <= K.FMA_LAUNCH_MAX_TOKENS],
                       title="FMA decode tile sweep (fc1_rows,fc1_kb,fc2_rows,fc2_kb,warps,stages"
                             "[,fc2_warps,fc2_stages[,fc2_split[,fc1_split]]])")


def _tile_sweep(args, w: dict, device, flush, copy_gbps, parts, *, name, provider, env, specs, ms, title) -> list[dict]:
    """Shared loop of the tile sweeps: per M, route random tokens once; per tile spec, set ``env``
    to it (restored afterwards) and time ``parts(spec, x, logits, xq, xs, topk_ids, topk_w)``
    ((name, fn) pairs: block, fc1, fc2). A tile that fails to build or run is recorded as such."""
    from vllm_sm121.kernels import moe as K

    records = []
    print(f"\n{title}; M = {ms}")
    print(TILE_TABLE_HEADER)
    best: dict[int, tuple[float, str]] = {}
    saved = os.environ.get(env)
    try:
        for m in ms:
            g = torch.Generator().manual_seed(m)
            x = torch.randn(m, args.hidden, generator=g).bfloat16().to(device)
            logits = torch.randn(m, args.experts, generator=g).bfloat16().to(device)
            topk_w, topk_ids, xq, xs = K.moe_route(logits, args.topk, x)
            n_exp = int(topk_ids.unique().numel())
            b_fc1, b_fc2 = n_exp * fc1_expert_bytes(args), n_exp * fc2_expert_bytes(args)
            b_all = bytes_moved(args, moe_route_torch_ids(logits, args.topk))
            ref = None
            if args.refcheck:
                ref = K.moe_block_torch(x, logits, w["w13_weight"], w["w13_weight_scale"], w["w13_bias"],
                                        w["w2_weight"], w["w2_weight_scale"], w["w2_bias"], args.topk)
            for spec in specs:
                rec = {"provider": provider, "tile": spec, "m": m, "bytes": b_all, "fc1_bytes": b_fc1,
                       "fc2_bytes": b_fc2}
                try:
                    os.environ[env] = spec
                    res = _time_parts(parts(spec, x, logits, xq, xs, topk_ids, topk_w), args, device, flush)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result
                    rec["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                    records.append(rec)
                    print(f"{spec:<26}{m:>5}  {rec['status']}")
                    continue
                _tile_record(rec, res, spec, m, ref, copy_gbps, best)
                records.append(rec)
    finally:
        if saved is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = saved
    for m, (us, spec) in sorted(best.items()):
        print(f"fastest {name} tile at M={m}: {spec} ({us:.1f} us)")
    return records


def _time_parts(parts, args, device, flush) -> dict:
    """{name: (p50 us, output)} for each (name, fn): CUDA-graph replays on the GPU, one call on the CPU."""
    res = {}
    for name, fn in parts:
        if device.type == "cuda":
            times, out = time_graph(fn, args.reps, flush)
        else:
            t0 = time.perf_counter()
            out = fn()
            times = [(time.perf_counter() - t0) * 1e6]
        res[name] = (pct(times, 0.5), out)
    return res


def _tile_record(rec: dict, res: dict, spec: str, m: int, ref, copy_gbps, best: dict) -> None:
    """Fill a tile-sweep record from _time_parts' block / fc1 / fc2 timings, print its row, track the best."""
    rec.update(status="ok", us_p50=res["block"][0], fc1_us_p50=res["fc1"][0], fc2_us_p50=res["fc2"][0])
    pcts = []
    for key, nbytes in (("block", rec["bytes"]), ("fc1", rec["fc1_bytes"]), ("fc2", rec["fc2_bytes"])):
        gbps = nbytes / res[key][0] / 1e3
        rec[f"{key}_gbps"] = gbps
        pcts.append(100 * gbps / copy_gbps if copy_gbps else float("nan"))
        if copy_gbps:
            rec[f"{key}_pct_copy_bw"] = pcts[-1]
    if ref is not None:
        rec["rel_l2_vs_ref"] = ((res["block"][1].float() - ref).norm() / ref.norm()).item()
    print(f"{spec:<26}{m:>5}{res['block'][0]:>10.1f}{pcts[0]:>7.1f}{res['fc1'][0]:>10.1f}{pcts[1]:>7.1f}"
          f"{res['fc2'][0]:>10.1f}{pcts[2]:>7.1f}{rec.get('rel_l2_vs_ref', float('nan')):>11.2e}")
    if m not in best or res["block"][0] < best[m][0]:
        best[m] = (res["block"][0], spec)


TILE_TABLE_HEADER = (f"{'tile':<26}{'M':>5}{'block us':>10}{'%copy':>7}{'fc1 us':>10}{'%copy':>7}{'fc2 us':>10}{'%copy':>7}"
                     f"{'relL2 ref':>11}")


def grouped_tile_sweep(args, weights: dict, device, flush, copy_gbps) -> list[dict]:
    """Time the grouped (prefill) path per tile (--grouped-tiles) at each M: block, FC1, FC2 + sum."""
    from vllm_sm121.kernels import moe as K

    w = weights

    def parts(spec, x, logits, xq, xs, topk_ids, topk_w):
        tiles = K.GroupedTiles.parse(spec)
        align = K.moe_align(topk_ids, args.experts, tiles.block_m)
        f2_13, f2_2 = K.weight_scales_f2(w["w13_weight_scale"]), K.weight_scales_f2(w["w2_weight_scale"])
        h, hs = K.moe_fc1_swiglu_grouped(xq, xs, w["w13_weight"], w["w13_weight_scale"], w["w13_bias"], topk_ids,
                                         align, tiles, w_f2=f2_13)
        return (("block", lambda: K.moe_block(x, logits, w["w13_weight"], w["w13_weight_scale"], w["w13_bias"],
                                              w["w2_weight"], w["w2_weight_scale"], w["w2_bias"], args.topk,
                                              path="grouped")),
                ("fc1", lambda: K.moe_fc1_swiglu_grouped(xq, xs, w["w13_weight"], w["w13_weight_scale"],
                                                         w["w13_bias"], topk_ids, align, tiles, w_f2=f2_13)),
                ("fc2", lambda: K.moe_fc2_grouped(h, hs, w["w2_weight"], w["w2_weight_scale"], w["w2_bias"], topk_ids,
                                                  topk_w, align, tiles, w_f2=f2_2)))

    return _tile_sweep(args, w, device, flush, copy_gbps, parts, name="grouped", provider="sm121_grouped_tile",
                       env=K.GROUPED_TILE_ENV, specs=args.grouped_tiles, ms=[m for m in args.m if m > 0],
                       title="Grouped (prefill) tile sweep (bm,bn,bk,warps,stages)")


def align_timing(args, device, flush) -> list[dict]:
    """moe_align (Triton) vs moe_align_torch (the torch-op reference it replaces), p50 µs per M,
    CUDA-graph replays; both outputs compared for equality."""
    from vllm_sm121.kernels import moe as K

    records = []
    print(f"\nmoe_align: one Triton launch vs the torch ops; E = {args.experts}, top-{args.topk}")
    print(f"{'M':>6}{'pairs':>8}{'BLOCK_M':>8}{'triton us':>11}{'torch us':>10}  equal")
    for m in [m for m in args.m if m > 0]:
        g = torch.Generator().manual_seed(m)
        ids = K.moe_route(torch.randn(m, args.experts, generator=g).bfloat16().to(device), args.topk)[1]
        bm = K.grouped_tiles(ids, m, args.topk, args.experts).block_m
        row = {"m": m, "pairs": ids.numel(), "block_m": bm}
        outs = {}
        for name, fn in (("moe_align", K.moe_align), ("moe_align_torch", K.moe_align_torch)):
            if device.type == "cuda":
                times, out = time_graph(lambda: fn(ids, args.experts, bm), args.reps, flush)  # noqa: B023
                us = pct(times, 0.5)
            else:
                out, us = fn(ids, args.experts, bm), float("nan")
            outs[name] = out
            records.append({"provider": name, **row, "us_p50": us})
        equal = all(torch.equal(a, b) for a, b in zip(outs["moe_align"], outs["moe_align_torch"]))
        for r in records[-2:]:
            r["equal"] = equal
        print(f"{m:>6}{ids.numel():>8}{bm:>8}{records[-2]['us_p50']:>11.1f}{records[-1]['us_p50']:>10.1f}  {equal}")
    return records


def norm_router_timing(args, device, flush, copy_gbps) -> list[dict]:
    """The MoE's input producer per M: the norm kernel then the router as a bf16 linear (cuBLAS), vs
    the router inside the norm kernel (``fused_add_rmsnorm_mxfp8_router``); p50 µs (graph replays,
    L2 flushed), bytes read (x, residual, router weight), outputs compared. (Until the commit after
    b64c866 the separate side also copied the residual inside the timed graph.)"""
    from vllm_sm121.kernels import norm_mxfp8 as N

    h, e = args.hidden, args.experts
    g = torch.Generator().manual_seed(7)
    w = (1 + 0.02 * torch.randn(h, generator=g)).bfloat16().to(device)
    rw = (torch.randn(e, h, generator=g) * h ** -0.5).bfloat16().to(device)
    rb = (0.1 * torch.randn(e, generator=g)).bfloat16().to(device)

    def separate(x, res, r):  # upstream's order: the norm kernel (residual into r, no copy), then the GEMM
        y, q, s = N.fused_add_rmsnorm_mxfp8(x, res, w, residual_out=r)
        return r, q, s, torch.nn.functional.linear(y, rw, rb)

    def fused(x, res, r):
        return N.fused_add_rmsnorm_mxfp8_router(x, res, w, rw, rb)

    records = []
    tiles = N.router_tiles(h, e)
    print(f"\nnorm -> MXFP8 + router (H = {h}, E = {e}): separate launches vs the router inside the norm "
          f"(fused up to {N.ROUTER_FUSED_MAX_TOKENS} tokens; block_e, warps, MXFP8 blocks per program: {tiles})")
    print(f"{'M':>6}{'separate us':>13}{'fused us':>10}{'MB read':>9}{'% copy':>8}  logits max |d|")
    for m in [m for m in args.m if m > 0]:
        x = torch.randn(m, h, generator=g).bfloat16().to(device)
        res = torch.randn(m, h, generator=g).bfloat16().to(device)
        r = torch.empty_like(res)
        nbytes = 2 * m * h * 2 + e * h * 2
        outs, us = {}, {}
        for name, fn in (("norm+linear", separate), ("norm_router", fused)):
            if device.type == "cuda":
                times, out = time_graph(lambda: fn(x, res, r), args.reps, flush)  # noqa: B023
                us[name] = pct(times, 0.5)
            else:
                out, us[name] = fn(x, res, r), float("nan")
            outs[name] = out
        a, b = outs["norm+linear"], outs["norm_router"]
        dlog = (a[3].float() - b[3].float()).abs().max().item()
        same = torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
        pc = 100 * nbytes / (us["norm_router"] * 1e-6) / 1e9 / copy_gbps if copy_gbps else float("nan")
        for name in us:
            records.append({"provider": name, "m": m, "us_p50": us[name], "bytes": nbytes, "router_tiles": tiles,
                            "logits_max_abs_diff": dlog, "residual_and_scales_equal": same})
        print(f"{m:>6}{us['norm+linear']:>13.1f}{us['norm_router']:>10.1f}{nbytes / 1e6:>9.2f}{pc:>8.1f}  "
              f"{dlog:.2e}{'' if same else '  (residual/scales differ!)'}")
    return records


def moe_route_torch_ids(logits, topk):
    from vllm_sm121.kernels.moe import moe_route_torch

    return moe_route_torch(logits, topk)[1]


def pick_device(dry_run: bool, no_cuda_message: str):
    """CPU + the Triton interpreter for a dry run, else CUDA; None (message printed) without a GPU."""
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(no_cuda_message, file=sys.stderr)
        return None
    return torch.device("cuda")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.dry_run, NO_CUDA_MESSAGE)
    if device is None:
        return 2
    from vllm_sm121.kernels.moe import moe_block_torch, moe_route_torch

    weights = make_weights(args, device)
    if args.grouped_f2 == "auto":  # as Sm121Mxfp4MoEMethod.process_weights_after_loading
        from vllm_sm121.kernels.moe import register_weight_scales

        register_weight_scales(weights["w13_weight_scale"], weights["w2_weight_scale"])
    copy_gbps = measure_copy_bandwidth(device) if device.type == "cuda" else None
    head = header(device, copy_gbps)
    from vllm_sm121.kernels.moe import weight_scales_f2

    head["grouped_f2"] = [weight_scales_f2(weights[k]) for k in ("w13_weight_scale", "w2_weight_scale")]
    global IN_GRAPH
    IN_GRAPH = args.in_graph
    head["timing"] = (f"in-graph: {IN_GRAPH} (L2 flush, call) pairs in one graph minus {IN_GRAPH} flushes, per call"
                      if IN_GRAPH else "one call per graph replay after an L2 flush (host launch latency included)")
    print(f"device {head['device']}  copy bandwidth {copy_gbps or float('nan'):.0f} GB/s  commit {head['commit']}  "
          f"shape H={args.hidden} I={args.inter} E={args.experts} top{args.topk}  timing: {head['timing']}  "
          f"grouped decoder: {head['grouped_decoder']} (F2 multiply FC1 / FC2: {head['grouped_f2']})")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    providers = {}
    for p in args.providers:
        try:
            providers[p] = make_provider(p, args, weights, device)
        except Exception as e:  # noqa: BLE001 - a provider that cannot run on this card is a result
            providers[p] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    records = []
    print(f"{'provider':<14}{'M':>6}{'p50 us':>11}{'p20':>11}{'p80':>11}{'MB moved':>10}{'GB/s':>8}{'% copy':>8}"
          f"{'relL2 ref':>11}{'relL2 bf16':>11}  info")
    for m in args.m:
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, args.hidden, generator=g).bfloat16().to(device)
        logits = torch.randn(m, args.experts, generator=g).bfloat16().to(device)
        nbytes = bytes_moved(args, moe_route_torch(logits, args.topk)[1])
        ref = ref_bf16 = None
        if args.refcheck:
            wargs = [weights[k] for k in ("w13_weight", "w13_weight_scale", "w13_bias", "w2_weight",
                                          "w2_weight_scale", "w2_bias")]
            ref = moe_block_torch(x, logits, *wargs, args.topk)
            ref_bf16 = moe_block_torch(x, logits, *wargs, args.topk, activations="bf16")
        for p, prov in providers.items():
            rec = {"provider": p, "m": m, "bytes": nbytes, "hidden": args.hidden, "inter": args.inter, "experts": args.experts,
                       "topk": args.topk}
            if prov is None or isinstance(prov, str):
                rec["status"] = prov or "skipped: needs CUDA"
                records.append(rec)
                print(f"{p:<14}{m:>6}  {rec['status']}")
                continue
            fn, info = prov
            try:
                if device.type == "cuda":
                    times, out = time_graph(lambda: fn(x, logits), args.reps, flush)  # noqa: B023
                else:
                    t0 = time.perf_counter()
                    out = fn(x, logits)
                    times = [(time.perf_counter() - t0) * 1e6]
            except Exception as e:  # noqa: BLE001
                rec["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                records.append(rec)
                print(f"{p:<14}{m:>6}  {rec['status']}")
                continue
            p50 = pct(times, 0.5)
            rec.update(status="ok", info=info, us_p20=pct(times, 0.2), us_p50=p50, us_p80=pct(times, 0.8),
                       gbps=nbytes / p50 / 1e3)
            if copy_gbps:
                rec["pct_copy_bw"] = 100 * rec["gbps"] / copy_gbps
            if ref is not None:
                o = out.float()
                rec["rel_l2_vs_ref"] = ((o - ref).norm() / ref.norm()).item()
                rec["rel_l2_vs_bf16_act"] = ((o - ref_bf16).norm() / ref_bf16.norm()).item()
            records.append(rec)
            print(f"{p:<14}{m:>6}{p50:>11.1f}{rec['us_p20']:>11.1f}{rec['us_p80']:>11.1f}{nbytes / 1e6:>10.1f}"
                  f"{rec['gbps']:>8.0f}{rec.get('pct_copy_bw', float('nan')):>8.1f}"
                  f"{rec.get('rel_l2_vs_ref', float('nan')):>11.2e}{rec.get('rel_l2_vs_bf16_act', float('nan')):>11.2e}"
                  f"  {info}")
    if args.fma_tiles:
        records += fma_tile_sweep(args, weights, device, flush, copy_gbps)
    if args.grouped_tiles:
        records += grouped_tile_sweep(args, weights, device, flush, copy_gbps)
    if args.align:
        records += align_timing(args, device, flush)
    if args.norm_router:
        records += norm_router_timing(args, device, flush, copy_gbps)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"header": head, "records": records}, indent=1))
    print(f"wrote {out_path}")
    bad = [r for r in records
           if r["provider"].startswith("sm121") and not r.get("status", "").startswith(("ok", "skipped"))]
    if _DIST_READY:
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
