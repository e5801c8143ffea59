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


def _maxdiff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_sm121_matches_upstream_within_upstream_spread(checkpoint):
    prompts = _prompts()
    triton_lp, _, _ = _run(checkpoint, "TRITON_ATTN", prompts)
    fa_lp, _, _ = _run(checkpoint, "FLASH_ATTN", prompts)
    ours_lp, _, _ = _run(checkpoint, "SM121", prompts)
    spread = _maxdiff(triton_lp, fa_lp)
    gap = _maxdiff(ours_lp, triton_lp)
    signal = torch.cat(triton_lp).std().item()
    print(f"\nmax |logprob| gap SM121-vs-TRITON {gap:.4g}; upstream spread TRITON-vs-FA3 {spread:.4g}; "
          f"logprob std across tokens {signal:.4g}")
    assert signal > 20 * max(spread, 1e-3), "random weights too weak to make the comparison meaningful"
    assert gap <= max(2 * spread, 1e-3) + 1e-3


def test_sm121_full_graph_decode_matches_upstream_teacher_forced(checkpoint):
    """SM121 decodes 24 tokens under FULL CUDA graphs; TRITON_ATTN scores the same sequences."""
    prompts = _prompts()
    ours_prompt_lp, gen_ids, ours_gen_lp = _run(checkpoint, "SM121", prompts, graphs=True, gen=24)
    full = [p + g for p, g in zip(prompts, gen_ids)]
    ref_lp, _, _ = _run(checkpoint, "TRITON_ATTN", full)
    ref_gen = [lp[len(p) - 1:] for lp, p in zip(ref_lp, prompts)]
    gap = _maxdiff(ours_gen_lp, ref_gen)
    print(f"\nSM121 graph decode vs TRITON teacher-forced: max |logprob| gap {gap:.4g}")
    assert gap < 0.05
    assert _maxdiff(ours_prompt_lp, [lp[: len(p) - 1] for lp, p in zip(ref_lp, prompts)]) < 0.05
