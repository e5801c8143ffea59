"""Stage A of the whole-model CUDA graph mode (issue 7): lm_head + greedy sampling inside the
FULL decode graph (design: ``docs/design-whole-model-graph.md`` section 4, Stage A).

Import-light (torch only; vLLM is imported inside functions), so the eligibility and
configuration checks are CPU-testable.

:class:`DecodeTail` stands between vLLM's FULL ``CUDAGraphWrapper`` and the model. When the
forward context says the call is a FULL uniform-decode batch of 1 token per request (the batches
vLLM replays a FULL graph for) of at most ``max_rows`` rows, it runs, after the model,

    logits = model.compute_logits(hidden[:P]);  tokens[:P] = int32(argmax(fp32(logits)))

so capture puts the lm_head, the fp32 cast and the argmax into that graph and every replay
leaves the greedy token of each row in the persistent ``tokens`` buffer. The runner
(``vllm_sm121.graph.runner``) then skips the eager lm_head / sampler of stock vLLM for a batch
whose every request is greedy with no option that changes logits (``ineligible_reason``); any
other batch falls back, per batch, to stock vLLM's path (the graph's extra lm_head is then
wasted work, not a wrong result), and the reason is logged once.

Exactness: the ops are stock's greedy path (``vllm/v1/sample/sampler.py``: fp32 cast, argmax,
lowest index on ties) on the same logits, computed for the P padded rows of the graph instead
of the n real rows (n = P whenever the batch size is a capture size; otherwise the lm_head GEMM
runs at another M, whose rounding may differ).
"""

from __future__ import annotations

from typing import Any

import torch

SECTION_OPTION = '--additional-config \'{"sm121": {"cudagraph": "whole_model"}}\''
# Rows (requests) a tail covers: logits are [P, vocab] fp32 temporaries inside the graph
# (gpt-oss: 0.8 MB per row), so large decode batches keep stock's path.
MAX_ROWS = 32
# "1": the graph also samples unseeded temperature-only requests (kernels/decode_sample.py; opt-in);
# "2": and those with top-k / top-p (the radix threshold passes; opt-in)
SAMPLE_ENV = "VLLM_SM121_GRAPH_SAMPLE"
STOCK_WORKER = "vllm.v1.worker.gpu_worker.Worker"
WORKER = "vllm_sm121.graph.worker.WholeModelWorker"


def sample_level(value: str | None) -> int:
    """$VLLM_SM121_GRAPH_SAMPLE as a level: 0 greedy only, 1 + temperature, 2 + top-k / top-p."""
    v = (value or "0").strip()
    if v not in ("0", "1", "2"):
        raise ValueError(f"${SAMPLE_ENV}={value!r}: expected 0 (greedy only in the graph), 1 (+ temperature) "
                         "or 2 (+ top-k / top-p)")
    return int(v)


def _full_mode():
    from vllm.config import CUDAGraphMode

    return CUDAGraphMode.FULL


def current_context():
    """vLLM's forward context, or None outside one (a runnable called with no context set)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context() if is_forward_context_available() else None


def covers(ctx: Any, max_rows: int) -> bool:
    """Whether a forward under context ``ctx`` is a FULL uniform decode of 1 token per request
    and <= max_rows rows (the batches whose graph carries the tail)."""
    bd = getattr(ctx, "batch_descriptor", None)
    return (
        bd is not None
        and getattr(ctx, "cudagraph_runtime_mode", None) == _full_mode()
        and bool(bd.uniform)
        and bd.num_reqs is not None
        and bd.num_reqs == bd.num_tokens
        and 0 < bd.num_tokens <= max_rows
        and not getattr(bd, "has_lora", False)
    )


def ineligible_reason(metadata: Any, params: list[Any], *, custom_logits_processors: bool = False,
                      nans_in_logits: bool = False, thinking_budget: bool = False,
                      graph_samples: int = 0) -> str | None:
    """Why a batch cannot take the graph's tokens (None: it can). ``metadata``: vLLM's
    ``SamplingMetadata`` of the persistent batch; ``params``: the requests' ``SamplingParams``.
    Anything that changes the logits or needs them after the step falls back. ``graph_samples``
    (``sample_level``): 1, the graph samples temperature rows too, so unseeded temperature-only
    requests are taken; 2, with top-k / top-p as well. Seeded requests (stock's generator keeps
    their tokens reproducible and equal to the mode off) and min-p always fall back."""
    if not params:
        return "empty batch"
    if custom_logits_processors:
        return "custom logits processors are configured (--logits-processors or a vllm.logits_processors plugin)"
    if thinking_budget:
        return "a thinking_token_budget is active (the sampler forces think-end tokens)"
    if nans_in_logits:
        return "VLLM_COMPUTE_NANS_IN_LOGITS needs the logits"
    if not metadata.all_greedy:
        if not graph_samples:
            return ("a request samples (temperature > 0; the graph's sampler is greedy-only unless "
                    f"${SAMPLE_ENV}=1)")
        if metadata.generators:
            return "a seeded request (stock's per-request generator draws its tokens)"
        if (metadata.top_k is not None or metadata.top_p is not None) and graph_samples < 2:
            return f"top-k / top-p requested (the graph samples temperature only unless ${SAMPLE_ENV}=2)"
        if any(getattr(p, "min_p", 0.0) for p in params):
            return "min_p requested (the graph samples temperature only)"
    if metadata.max_num_logprobs is not None or getattr(metadata, "logprob_token_ids", None):
        return "logprobs requested"
    if not metadata.no_penalties:
        return "penalties requested"
    if metadata.allowed_token_ids_mask is not None:
        return "allowed_token_ids requested"
    if metadata.bad_words_token_ids:
        return "bad_words requested"
    for p in params:
        if getattr(p, "min_tokens", 0):
            return "min_tokens requested"
        if getattr(p, "logit_bias", None):
            return "logit_bias requested"
        if getattr(p, "structured_outputs", None) is not None:
            return "structured output requested"
    return None


class DecodeTail:
    """The FULL wrapper's runnable: the model, plus the greedy tail on covered batches.

    Attribute access falls through to the model (as ``CUDAGraphWrapper`` does to its runnable),
    except ``compute_logits``, which returns a placeholder when the runner has claimed the
    graph's tokens for this step (``take``), and the model's lm_head otherwise."""

    def __init__(self, model: Any, max_rows: int, device: torch.device | str, get_context=None,
                 samples: int = 0):
        self.__dict__.update(model=model, max_rows=max_rows, claimed=False, ran=0,
                             tokens=torch.zeros(max_rows, dtype=torch.int32, device=device),
                             _stub=torch.empty((max_rows, 0), dtype=torch.float32, device=device),
                             _get_context=get_context, samples=samples, _ws=None)
        if samples:  # in-graph temperature sampling (kernels/decode_sample.py); rows' options set by the runner
            self.__dict__.update(temperature=torch.zeros(max_rows, dtype=torch.float32, device=device),
                                 seeds=torch.zeros(max_rows, dtype=torch.int64, device=device),
                                 step=torch.zeros(1, dtype=torch.int64, device=device))
        if samples >= 2:  # top-k (0 = off) and top-p (1.0 = off) per row
            self.__dict__.update(top_k=torch.zeros(max_rows, dtype=torch.int32, device=device),
                                 top_p=torch.ones(max_rows, dtype=torch.float32, device=device))

    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("model")
        if model is None:  # half-built (copy / unpickling): no fall-through yet
            raise AttributeError(name)
        return getattr(model, name)

    def _context(self):
        return self._get_context() if self._get_context is not None else current_context()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*args, **kwargs)
        if isinstance(out, torch.Tensor) and covers(self._context(), self.max_rows):
            from vllm.v1.sample.sampler import Sampler

            logits = self.model.compute_logits(out)
            if self.samples:  # greedy rows: the same argmax; temperature rows: the exponential race
                from vllm_sm121.kernels import decode_sample as ds

                if self._ws is None or self._ws[0].shape[1] != ds.num_blocks(logits.shape[1]):
                    self.__dict__["_ws"] = ds.workspace(self.max_rows, logits.shape[1], logits.device)
                filt = dict(top_k=self.top_k, top_p=self.top_p) if self.samples >= 2 else {}
                ds.decode_sample(logits, self.temperature, self.seeds, self.step, self.tokens, self._ws, **filt)
            else:  # stock's greedy path: fp32 logits, Sampler.greedy_sample (argmax, lowest index on ties)
                self.tokens[: logits.shape[0]].copy_(Sampler.greedy_sample(logits.to(torch.float32)))
            self.__dict__["ran"] += 1  # Python-side count: captures and eager runs, not replays
        return out

    def claim(self) -> None:
        """The runner takes this step's graph tokens: the next ``compute_logits`` is skipped."""
        self.__dict__["claimed"] = True

    def compute_logits(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.claimed:
            self.__dict__["claimed"] = False
            return self._stub[: hidden_states.shape[0]]
        return self.model.compute_logits(hidden_states, *args, **kwargs)

    def sampled(self, n: int) -> torch.Tensor:
        """[n, 1] int32 greedy tokens of the last replay (stock's dtype and shape), a fresh tensor:
        the buffer itself is overwritten by the next replay while stock's copy of this step's
        tokens to the host may still be queued on its side stream."""
        return self.tokens[:n, None].clone()


def _logits_on_every_rank() -> bool:
    """Under TP, vLLM's LogitsProcessor all-gathers the vocab shards (every rank gets the whole
    logits, and the tail's argmax runs on each rank inside its graph, with vLLM's own collective
    captured like the model's all-reduces) where the platform says so, which CUDA does;
    otherwise only rank 0 receives logits."""
    from vllm.platforms import current_platform

    return bool(current_platform.use_all_gather())


def unsupported_reason(vllm_config: Any) -> str | None:
    """Why the engine configured in ``vllm_config`` cannot run the mode (None: it can)."""
    from vllm.config import CUDAGraphMode

    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is None or not (mode.separate_routine() and mode.decode_mode() == CUDAGraphMode.FULL):
        return (f"it needs FULL decode graphs: cudagraph_mode FULL_AND_PIECEWISE (vLLM's default) or "
                f"FULL_DECODE_ONLY, got {mode} (FULL replays decode batches as mixed graphs, which carry no "
                "tail; --enforce-eager turns graphs off)")
    if getattr(vllm_config, "use_v2_model_runner", False):
        return "it extends vLLM's V1 model runner, and this model would run the V2 one: set VLLM_USE_V2_MODEL_RUNNER=0"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding (Eagle3) under the mode is stage D, not built yet"
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1 or pc.data_parallel_size != 1:
        return (f"pipeline and data parallelism are not supported (pipeline {pc.pipeline_parallel_size}, data "
                f"{pc.data_parallel_size}); tensor and expert parallelism are")
    if pc.tensor_parallel_size != 1 and not _logits_on_every_rank():
        return (f"tensor parallelism ({pc.tensor_parallel_size}) needs the logits all-gathered to every rank, "
                "and this platform gathers them to rank 0 only (Platform.use_all_gather() is False)")
    if getattr(pc, "use_ubatching", False):
        return "micro-batching (DBO) is not supported"
    return None


def install_worker(vllm_config: Any) -> bool:
    """After vLLM's platform resolved ``worker_cls``: point it at the mode's worker when the
    ``sm121`` section asks for ``cudagraph: whole_model``. Returns whether it did; raises
    ValueError naming the option for a configuration the mode cannot run or a custom worker."""
    from vllm_sm121 import config as sm121_config

    cfg = sm121_config.parse(getattr(vllm_config, "additional_config", None))
    if cfg.cudagraph != "whole_model":
        return False
    why = unsupported_reason(vllm_config)
    if why:
        raise ValueError(f"{SECTION_OPTION}: {why}")
    pc = vllm_config.parallel_config
    if pc.worker_cls not in (STOCK_WORKER, "auto", WORKER):
        raise ValueError(f"{SECTION_OPTION} installs its own worker ({WORKER}); --worker-cls "
                         f"{pc.worker_cls!r} is set: drop one of the two")
    pc.worker_cls = WORKER
    return True
