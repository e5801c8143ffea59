"""Shared test helpers: random paged batches, one tolerance rule."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import socket

import torch

FP8 = torch.float8_e4m3fn


def assert_close(out: torch.Tensor, ref: torch.Tensor, *, atol: float = 1.5e-2, rtol: float = 1e-2, what: str = ""):
    """The one tolerance rule for attention outputs (bf16/fp16 result vs fp32 reference).

    The kernel rounds P to 16 bits before P@V and writes a 16-bit result; both cost well under
    1e-2 for O(1) outputs, while a wrong mask, window, sink or scale moves outputs by >= 5e-2.
    """
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out.float()).all(), f"{what}: non-finite output"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@dataclasses.dataclass
class PagedBatch:
    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    k_scale: float | None
    v_scale: float | None


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype=torch.bfloat16,
    kv_dtype=torch.bfloat16,
    sliding_window: int | None = None,
    pad_tokens: int = 0,
    device="cpu",
    seed: int = 0,
) -> PagedBatch:
    """A ragged batch with a shuffled page table.

    Block 0 is vLLM's null block and is filled with NaN: pages wholly before a sliding window
    point at it, as vLLM's sliding-window manager does, so any unmasked read shows up as NaN.
    """
    assert len(q_lens) == len(seq_lens) and all(0 <= q <= s for q, s in zip(q_lens, seq_lens))
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(pages_per_seq) + 3
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    max_pages = max(max(pages_per_seq), 1) + 2
    # Unused table entries point at random real pages: the kernel must never read them.
    block_table = torch.randint(1, num_blocks, (len(seq_lens), max_pages), generator=g, dtype=torch.int32)
    cache_shape = (num_blocks, num_kv_heads, block_size, head_size)
    k_full = torch.randn(cache_shape, generator=g)
    v_full = torch.randn(cache_shape, generator=g)
    k_scale = v_scale = None
    if kv_dtype == FP8:
        k_scale, v_scale = 0.0625, 0.03125  # exercise the scales: stored values are x / scale
        key_cache = (k_full / k_scale).clamp(-448, 448).to(FP8)
        value_cache = (v_full / v_scale).clamp(-448, 448).to(FP8)
        key_cache[0].view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
        value_cache[0].view(torch.uint8).fill_(0x7F)
    else:
        key_cache, value_cache = k_full.to(kv_dtype), v_full.to(kv_dtype)
        key_cache[0] = float("nan")
        value_cache[0] = float("nan")
    it = iter(perm)
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        first_needed = 0
        if sliding_window is not None:
            first_needed = max(0, (sl - ql) - sliding_window + 1)
        for p in range(pages_per_seq[i]):
            page = next(it)
            if (p + 1) * block_size <= first_needed:
                page = 0  # freed by the sliding-window manager
            block_table[i, p] = page
    total = sum(q_lens)
    q = torch.randn(total + pad_tokens, num_q_heads, head_size, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return PagedBatch(
        q=q.to(device),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_table=block_table.to(device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        k_scale=k_scale,
        v_scale=v_scale,
    )


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(f"_bench_{name}",
                                                  Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def graph_replayed(fn, times: int = 3):
    """``fn()``'s outputs as captured in a CUDA graph, after ``times`` replays (synchronized)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(times):
        graph.replay()
    torch.cuda.synchronize()
    return out


def logprob_gap(a, b) -> tuple[float, float]:
    """Mean and p99 of |delta logprob| over all scored tokens of two runs (lists of 1-D tensors)."""
    d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
    return d.mean().item(), torch.quantile(d, 0.99).item()


@contextlib.contextmanager
def one_rank_groups(vllm_config):
    """vLLM's distributed groups for one CPU rank (gloo on a free loopback port), torn down after;
    a no-op where an earlier test already set them up."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    owns = not ps.model_parallel_is_initialized()
    if owns:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with set_current_vllm_config(vllm_config):
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method=f"tcp://127.0.0.1:{port}")
            ps.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        if owns:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


def greedy_agreement(pass0, pass1, tie: float | None = 0.05):
    """Compare two greedy passes over the same prompts position by position, up to each
    sequence's first differing token (after it the contexts differ and nothing is comparable).

    Returns (|delta logprob| of the chosen token over the common positions, list of divergences).
    At a divergence (pass 0 picks a, pass 1 picks b) each pass's token must be in the other's
    top-k, and the two margins m0 = lp0(a) - lp0(b), m1 = lp1(b) - lp1(a) must be what a logprob
    noise of ``tie`` can produce: m0 + m1 = (lp0(a) - lp1(a)) + (lp1(b) - lp0(b)) <= 2 * tie;
    else it is a real divergence (returned as (seq, pos, margin0, margin1)). ``tie=None``: the
    noise of these two passes, the larger of 0.05 and the largest |delta| where they agree.
    """
    deltas, agree, flips = [], [], []
    for s, (steps0, steps1) in enumerate(zip(pass0, pass1)):
        for pos, ((t0, d0), (t1, d1)) in enumerate(zip(steps0, steps1)):
            if t0 == t1:
                deltas.append(abs(d0[t0].logprob - d1[t1].logprob))
                agree.append(deltas[-1])
                continue
            m0 = d0[t0].logprob - d0[t1].logprob if t1 in d0 else float("inf")
            m1 = d1[t1].logprob - d1[t0].logprob if t0 in d1 else float("inf")
            deltas.append(abs(d0[t0].logprob - d1[t1].logprob))  # both are their pass's best
            flips.append((s, pos, m0, m1))
            break
    if tie is None:
        tie = max([0.05, *agree])
    return torch.tensor(deltas), [f for f in flips if f[2] + f[3] > 2 * tie]


def generate_and_score(llm, prompts, gen: int = 0):
    """Greedy ``llm.generate`` of ``max(gen, 1)`` tokens with teacher-forced prompt logprobs:
    (prompt logprobs of tokens 1.. per prompt, generated ids, their logprobs), as 1-D tensors."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max(gen, 1), prompt_logprobs=0, logprobs=0, temperature=0.0,
                        ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    prompt_lp = [torch.tensor([d[t].logprob for d, t in zip((o.prompt_logprobs or [None])[1:], p[1:])])
                 for o, p in zip(outs, prompts)]
    ids = [list(o.outputs[0].token_ids) for o in outs]
    gen_lp = [torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, i)]) for o, i in zip(outs, ids)]
    return prompt_lp, ids, gen_lp


def run_engine(prompts, *, gen: int = 0, graphs=False, probe=None, setup=None, **llm_kwargs):
    """One vLLM engine as the end-to-end GPU tests start it (random checkpoint, no tokenizer,
    4k context, 30% of the card, no prefix cache, seed 0; eager, or ``graphs`` = a cudagraph_mode
    name with capture sizes <= 8), scored by ``generate_and_score``, then torn down. With
    ``probe`` (a function of the worker, run by ``LLM.collective_rpc`` after the requests):
    returns (scores, the probe's per-worker results). ``setup``: a function of the worker run the same
    way before the requests (e.g. installing hooks the probe reads)."""
    import gc
    import os

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # As `vllm serve` does: engine and workers are spawned, and load the plugin by entry point.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    from vllm import LLM

    mode = dict(compilation_config={"cudagraph_mode": graphs, "max_cudagraph_capture_size": 8}) if graphs \
        else dict(enforce_eager=True)
    base = dict(skip_tokenizer_init=True, max_model_len=4096, max_num_batched_tokens=256, gpu_memory_utilization=0.3,
                enable_prefix_caching=False, seed=0)
    llm = LLM(**{**base, **mode, **llm_kwargs})
    try:
        if setup is not None:
            llm.collective_rpc(setup)
        scores = generate_and_score(llm, prompts, gen)
        return (scores, llm.collective_rpc(probe)) if probe is not None else scores
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def rotation_in_epilogue_diff(monkeypatch, path: str, x, q, s, b, pos, cache, rope_rows: int, head: int) -> torch.Tensor:
    """``dense_fp8_linear_rope(..., path=path)`` (which must rotate in its epilogue: ``rope_neox_`` is
    forbidden while it runs) against the same GEMM unrotated, then ``rope_neox_``: v rows bit-equal, the
    rotation visible, every rotated value within one bf16 step. Returns |fused - reference| (fp32)."""
    from vllm_sm121.kernels import dense as D

    def not_called(*args, **kwargs):
        raise AssertionError("the rotation ran after the projection instead of in its epilogue")

    with monkeypatch.context() as mp:
        mp.setattr(D, "rope_neox_", not_called)
        fused = D.dense_fp8_linear_rope(x, q, s, b, pos, cache, rope_rows, head, path=path)
    plain = D.dense_fp8_linear(x, q, s, b, path=path)
    ref = D.rope_neox_(plain.clone(), pos, cache, rope_rows, head)
    assert torch.equal(fused[:, rope_rows:], plain[:, rope_rows:])
    assert not torch.equal(ref[:, :rope_rows], plain[:, :rope_rows])
    diff = (fused.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs().clamp(min=2.0 ** -126) * 2.0 ** -7).all()), float(diff.max())
    return diff
