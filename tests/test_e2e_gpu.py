"""End-to-end on a GPU: gpt-oss-tiny (random real-format checkpoint) through vLLM with SM121.

Teacher-forced prompt logprobs of SM121 are compared with vLLM's own TRITON_ATTN; the allowed
gap is the spread two correct upstream backends (TRITON_ATTN vs FLASH_ATTN/FA3) show on the
same prompts. Prompts are longer than the 128-token window and are chunked (max 256 batched
tokens), so sliding-window, sinks, chunked prefill and decode paths all run; SM121 also runs
under FULL CUDA graphs, and its own greedy continuation is scored by TRITON_ATTN (decode path).
"""

from __future__ import annotations

import gc
import os
import pathlib

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT_LENS = (300, 140, 37)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 8000, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from vllm_sm121.testing.checkpoint import write_random_gpt_oss_checkpoint

    return write_random_gpt_oss_checkpoint(str(ROOT / "models" / "gpt-oss-tiny"),
                                           str(tmp_path_factory.mktemp("gpt-oss-tiny-random")), seed=0)


def _run(checkpoint, backend, prompts, *, graphs=False, gen=0):
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # As `vllm serve` does: engine and workers are spawned, and load the plugin by entry point.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    from vllm import LLM, SamplingParams

    kw = dict(compilation_config={"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 8}) if graphs \
        else dict(enforce_eager=True)
    llm = LLM(model=checkpoint, skip_tokenizer_init=True, attention_backend=backend, max_model_len=1024,
              max_num_batched_tokens=256, gpu_memory_utilization=0.3, enable_prefix_caching=False, seed=0, **kw)
    try:
        sp = SamplingParams(max_tokens=max(gen, 1), prompt_logprobs=0, logprobs=0, temperature=0.0,
                            ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        prompt_lp = [torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])])
                     for o, p in zip(outs, prompts)]
        gen_ids = [list(o.outputs[0].token_ids) for o in outs]
        gen_lp = [torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, ids)])
                  for o, ids in zip(outs, gen_ids)]
        return prompt_lp, gen_ids, gen_lp
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _diffs(a, b) -> tuple[float, float]:
    d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
    return d.mean().item(), d.max().item()


@pytest.fixture(scope="module")
def runs(checkpoint):
    """SM121 and TRITON_ATTN each decode 24 tokens under FULL CUDA graphs; the SM121 sequences are
    then scored (teacher-forced, eager) by every backend, the TRITON_ATTN ones by TRITON_ATTN."""
    prompts = _prompts()
    _, gen_ids, graph_gen_lp = _run(checkpoint, "SM121", prompts, graphs=True, gen=24)
    _, t_gen_ids, t_graph_gen_lp = _run(checkpoint, "TRITON_ATTN", prompts, graphs=True, gen=24)
    full = [p + g for p, g in zip(prompts, gen_ids)]
    scored = {b: _run(checkpoint, b, full)[0] for b in ("TRITON_ATTN", "FLASH_ATTN", "SM121")}
    t_scored = _run(checkpoint, "TRITON_ATTN", [p + g for p, g in zip(prompts, t_gen_ids)])[0]
    return dict(prompts=prompts, graph_gen_lp=graph_gen_lp, scored=scored,
                t_graph_gen_lp=t_graph_gen_lp, t_scored=t_scored)


def _check(what, gap, spread):
    print(f"\n{what}: |logprob| gap mean {gap[0]:.4g} max {gap[1]:.4g}; "
          f"upstream spread mean {spread[0]:.4g} max {spread[1]:.4g}")
    assert gap[0] <= 1.5 * spread[0] + 1e-3, (gap, spread)
    assert gap[1] <= 1.5 * spread[1] + 1e-3, (gap, spread)


def test_prefill_chunked_teacher_forced_within_upstream_spread(runs):
    sc = runs["scored"]
    spread = _diffs(sc["FLASH_ATTN"], sc["TRITON_ATTN"])
    signal = torch.cat(sc["TRITON_ATTN"]).std().item()
    assert signal > 5 * spread[0], "weights too weak for a meaningful comparison"
    _check("SM121 eager chunked prefill vs TRITON_ATTN (spread: FLASH_ATTN vs TRITON_ATTN)",
           _diffs(sc["SM121"], sc["TRITON_ATTN"]), spread)


def test_full_graph_decode_within_upstream_spread(runs):
    """Logprobs sampled while decoding under FULL graphs vs teacher forcing of the same tokens.

    Upstream's own spread here is the larger of FLASH_ATTN-vs-TRITON_ATTN teacher forcing and
    TRITON_ATTN's graph decode vs its own teacher forcing (decode and prefill round differently).
    """
    tail = lambda lps, prompts: [lp[len(p) - 1:] for lp, p in zip(lps, prompts)]  # noqa: E731
    sc, prompts = runs["scored"], runs["prompts"]
    fa_vs_triton = _diffs(tail(sc["FLASH_ATTN"], prompts), tail(sc["TRITON_ATTN"], prompts))
    triton_self = _diffs(runs["t_graph_gen_lp"], tail(runs["t_scored"], prompts))
    spread = (max(fa_vs_triton[0], triton_self[0]), max(fa_vs_triton[1], triton_self[1]))
    _check("SM121 FULL-graph decode vs TRITON_ATTN teacher-forced",
           _diffs(runs["graph_gen_lp"], tail(sc["TRITON_ATTN"], prompts)), spread)
