"""Whole-model graph mode, stage A, on a GPU (vllm_sm121/graph/): gpt-oss-tiny as a random
real-format checkpoint, SM121 attention, FULL_AND_PIECEWISE graphs (capture sizes <= 8), one
engine with the mode on and one with it off, each serving the same request sets in order:

1. greedy batches of 1, 2, 4 and 8 prompts (capture sizes, so the in-graph lm_head runs at the
   same M as stock's eager one): generated tokens identical to the mode off, and the runner
   reports that decode steps took the graph's tokens (the test cannot pass by falling back);
2. a batch with one seeded temperature-0.8 request: the whole batch falls back to stock
   sampling (tokens identical to the mode off, seeded ones included) and the fallback reason
   is counted;
3. greedy with logprobs=1: falls back; tokens and logprobs identical to the mode off.
"""

from __future__ import annotations

import gc
import os
import pathlib

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
LENS = (37, 140, 300, 17, 64, 129, 255, 2)
GEN = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from vllm_sm121.testing.checkpoint import write_random_gpt_oss_checkpoint

    return write_random_gpt_oss_checkpoint(str(ROOT / "models" / "gpt-oss-tiny"),
                                           str(tmp_path_factory.mktemp("tiny")), seed=0)


def _prompts(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 8000, (m,), generator=g).tolist() for m in LENS[:n]]


def _serve(checkpoint, whole_model: bool) -> dict:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    from vllm import LLM, SamplingParams

    kw = dict(model=checkpoint, skip_tokenizer_init=True, max_model_len=4096, max_num_batched_tokens=512,
              gpu_memory_utilization=0.3, enable_prefix_caching=False, seed=0, attention_backend="SM121",
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE", "max_cudagraph_capture_size": 8})
    if whole_model:
        kw["additional_config"] = {"sm121": {"cudagraph": "whole_model"}}
    llm = LLM(**kw)
    greedy = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, detokenize=False)
    out = {}
    try:
        for n in (1, 2, 4, 8):
            res = llm.generate([{"prompt_token_ids": p} for p in _prompts(n)], greedy, use_tqdm=False)
            out[f"greedy{n}"] = [list(r.outputs[0].token_ids) for r in res]
        mixed = [greedy] * 3 + [SamplingParams(max_tokens=GEN, temperature=0.8, seed=7, ignore_eos=True,
                                               detokenize=False)]
        res = llm.generate([{"prompt_token_ids": p} for p in _prompts(4)], mixed, use_tqdm=False)
        out["mixed"] = [list(r.outputs[0].token_ids) for r in res]
        lp = SamplingParams(max_tokens=GEN, temperature=0.0, logprobs=1, ignore_eos=True, detokenize=False)
        res = llm.generate([{"prompt_token_ids": p} for p in _prompts(2)], lp, use_tqdm=False)
        out["logprobs"] = [list(r.outputs[0].token_ids) for r in res]
        out["logprob_values"] = [[d[t].logprob for d, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)]
                                 for r in res]
        if whole_model:
            out["stats"] = llm.collective_rpc("sm121_graph_stats")[0]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def runs(checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return {"on": _serve(checkpoint, True), "off": _serve(checkpoint, False)}


def test_greedy_tokens_equal_mode_off_and_the_graph_tokens_are_used(runs):
    on, off = runs["on"], runs["off"]
    stats = on["stats"]
    print(f"\nwhole-model stage A stats: {stats}")
    for n in (1, 2, 4, 8):
        assert on[f"greedy{n}"] == off[f"greedy{n}"], n
    # (GEN - 1) decode steps per greedy batch; the first token of each request comes from prefill
    assert stats["taken"] >= 4 * (GEN - 2), stats
    assert stats["tail_runs"] > 0, stats  # captured into the graphs


def test_sampling_and_logprob_batches_fall_back_with_identical_results(runs):
    on, off = runs["on"], runs["off"]
    assert on["mixed"] == off["mixed"]
    assert on["logprobs"] == off["logprobs"]
    assert on["logprob_values"] == off["logprob_values"]
    reasons = " ".join(on["stats"]["fallbacks"])
    assert "temperature > 0" in reasons and "logprobs" in reasons, on["stats"]
