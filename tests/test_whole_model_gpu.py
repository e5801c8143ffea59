"""Whole-model graph mode, stages A and B, on a GPU (vllm_sm121/graph/): gpt-oss-tiny as a random
real-format checkpoint, SM121 attention, FULL_AND_PIECEWISE graphs (capture sizes <= 8).

One engine with the mode on serves greedy batches of 1, 2, 4 and 8 prompts (capture sizes, so the
in-graph lm_head runs at the same M as stock's) three ways: as shipped (stock's lm_head and
sampler skipped; steady steps skip stock's input preparation too, stage B), with verification on
(``sm121_graph_verify``: every step that takes the graph's tokens also runs stock's lm_head and
sampler on the same hidden states, and every stage-B step compares the inputs it wrote on the
device with the ones stock computes from the host state), then 8 requests of different lengths
(rows leave the batch one by one), and with logprobs=1 (falls back to stock). Prefix caching is on
(vLLM's default; the batches repeat their prompts, so later ones start from cached blocks, and a
running request's blocks count as common prefix blocks, which stage B must not mistake for cascade
attention). Asserted:

1. verification covered every decode step of the verified batches and no row's graph token
   differs from stock's on the same logits (the exact check of the tail);
2. the shipped and verified batches took the graph's tokens (the test cannot pass by falling
   back), and a seeded temperature-0.8 batch and the logprob batches fell back, reasons counted.

Whole generated sequences are not compared for equality: vLLM with this model is not repeatable
run to run on random weights (H100, commit c773752: two engines with the mode off, the same
requests: 14 of 15 sequences identical, one differing from its first token; within one engine
the same batch twice through stock's sampler can differ too). The agreements are printed: graph
vs stock within the engine, and mode on vs a second engine with the mode off (with
$SM121_WM_CONTROL=1 a third engine, mode off again, gives the off-vs-off baseline).
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
SIZES = (1, 2, 4, 8)
GEN = 24
CHURN = (5, 8, 11, 14, 17, 20, 23, 24)  # max_tokens of 8 requests started together


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from vllm_sm121.testing.checkpoint import write_random_gpt_oss_checkpoint

    return write_random_gpt_oss_checkpoint(str(ROOT / "models" / "gpt-oss-tiny"),
                                           str(tmp_path_factory.mktemp("tiny")), seed=0)


def _prompts(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 8000, (m,), generator=g).tolist() for m in LENS[:n]]


def _gen(llm, params, n):
    res = llm.generate([{"prompt_token_ids": p} for p in _prompts(n)], params, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res], res


SEEDED = dict(max_tokens=GEN, temperature=0.8, top_k=50, top_p=0.9, ignore_eos=True, detokenize=False)


def _gen_seeded(llm):
    from vllm import SamplingParams

    params = [SamplingParams(seed=100 + i, **SEEDED) for i in range(4)]
    res = llm.generate([{"prompt_token_ids": p} for p in _prompts(4)], params, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res]


def _serve(checkpoint, whole_model: bool, tp: int = 1) -> dict:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    os.environ["VLLM_SM121_GRAPH_FAST_SAMPLED"] = "1"  # sampled / logprob batches on stage B's inputs too
    # new pages through the input kernel at TP=1; stock's block-table upload at TP=2 (both paths run)
    os.environ["VLLM_SM121_GRAPH_PATCH_PAGES"] = "1" if tp == 1 else "0"
    from vllm import LLM, SamplingParams

    kw = dict(model=checkpoint, skip_tokenizer_init=True, max_model_len=4096, max_num_batched_tokens=512,
              gpu_memory_utilization=0.3, enable_prefix_caching=True, seed=0, attention_backend="SM121",
              tensor_parallel_size=tp,
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE", "max_cudagraph_capture_size": 8,
                                  # each engine compiles cold (additional_config is in vLLM's compile hash),
                                  # and Inductor picks reduction / combo-kernel configs by timing them: without
                                  # this, two engines may round RMSNorm differently whatever the mode does
                                  "inductor_compile_config": {"deterministic": True, "combo_kernels": False,
                                                              "benchmark_combo_kernel": False}})
    if whole_model:
        kw["additional_config"] = {"sm121": {"cudagraph": "whole_model"}}
    llm = LLM(**kw)
    greedy = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, detokenize=False)
    lp = SamplingParams(max_tokens=GEN, temperature=0.0, logprobs=1, ignore_eos=True, detokenize=False)

    out = {}
    try:
        for n in SIZES:
            out[f"greedy{n}"] = _gen(llm, greedy, n)[0]
        if whole_model:
            llm.collective_rpc("sm121_graph_verify", args=(True,))
            for n in SIZES:
                out[f"verified{n}"] = _gen(llm, greedy, n)[0]
            # churn: rows leave the batch one by one (stage B's steady chain breaks and restarts)
            churn = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, detokenize=False) for m in CHURN]
            res = llm.generate([{"prompt_token_ids": p} for p in _prompts(len(CHURN))], churn, use_tqdm=False)
            out["churn"] = [list(r.outputs[0].token_ids) for r in res]
        for n in SIZES:  # verification stays on: stage B's inputs of sampled batches are checked too
            out[f"logprobs{n}"], res = _gen(llm, lp, n)
            out[f"logprob_values{n}"] = [[d[t].logprob for d, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)]
                                         for r in res]
        mixed = [greedy] * 3 + [SamplingParams(max_tokens=GEN, temperature=0.8, seed=7, ignore_eos=True,
                                               detokenize=False)]
        res = llm.generate([{"prompt_token_ids": p} for p in _prompts(4)], mixed, use_tqdm=False)
        out["mixed"] = [list(r.outputs[0].token_ids) for r in res]
        # seeded sampling (temperature, top-k, top-p), the same batch twice in this engine
        for rep in (1, 2):
            out[f"seeded{rep}"] = _gen_seeded(llm)
        if whole_model:
            # one engine, one compiled model: greedy and logprob batches with the mode on, then with it
            # switched off at run time (sm121_graph_enable), each from a cold prefix cache, twice in
            # turn (on, off, on, off): on vs off is judged by this engine's own run-to-run spread
            for tag, enabled in (("one_on", True), ("one_off", False), ("one_on2", True), ("one_off2", False)):
                llm.collective_rpc("sm121_graph_enable", args=(enabled,))
                assert llm.reset_prefix_cache()
                toks, vals = [], []
                for n in SIZES:
                    t, res = _gen(llm, lp, n)
                    toks.append(t)
                    vals.append([[d[x].logprob for d, x in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)]
                                 for r in res])
                out[tag] = {"greedy": [_gen(llm, greedy, n)[0] for n in SIZES], "logprobs": toks, "values": vals,
                            "seeded": _gen_seeded(llm)}
            llm.collective_rpc("sm121_graph_enable", args=(True,))
            out["stats_ranks"] = llm.collective_rpc("sm121_graph_stats")  # one dict per worker (TP rank)
            out["stats"] = out["stats_ranks"][0]
            out["verify"], out["verify_ranks"] = out["stats"]["verify"], [r["verify"] for r in out["stats_ranks"]]
            llm.collective_rpc("sm121_graph_verify", args=(False,))
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def runs(checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = {"on": _serve(checkpoint, True), "off": _serve(checkpoint, False)}
    if os.environ.get("SM121_WM_CONTROL") == "1":
        r["off2"] = _serve(checkpoint, False)
    return r


def _same(a, b) -> str:
    pairs = [(x, y) for n in SIZES for x, y in zip(a[n], b[n])]
    first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None) for x, y in pairs]
    return f"{sum(x == y for x, y in pairs)}/{len(pairs)} sequences identical; first differing position {first}"


def _assert_verified(on):
    """The tail's exact check: verification covered every decode step of the verified batches, no
    row's graph token differs from stock's on the same logits, and the shipped and verified
    batches took the graph's tokens (the test cannot pass by falling back)."""
    stats, v = on["stats"], on["verify"]
    # (GEN - 1) decode steps per greedy batch
    assert v["steps"] >= len(SIZES) * (GEN - 2) and v["rows"] >= sum(SIZES) * (GEN - 2), v
    assert v["mismatched_rows"] == 0, v
    assert stats["taken"] >= 2 * len(SIZES) * (GEN - 2), stats  # shipped + verified batches
    assert stats["tail_runs"] > 0, stats  # captured into the graphs
    assert all(len(t) == GEN for n in SIZES for t in on[f"greedy{n}"])
    # stage B: most decode steps of a steady batch skip stock's input preparation (the first decode
    # step after a prefill and the steps around a finish run stock's); verification recomputed
    # stock's inputs from the host state on every such step
    steady = stats["steady"]
    assert steady["off"] is None and steady["fast"] >= 2 * len(SIZES) * (GEN - 6), steady
    # the logprob and sampled batches: steady steps on device inputs, stock's sampler
    assert steady["fast_sampled"] >= len(SIZES) * (GEN - 6), steady
    assert v["input_steps"] >= 2 * len(SIZES) * (GEN - 6) and v["input_mismatches"] == 0, v
    assert [len(t) for t in on["churn"]] == list(CHURN)


def test_graph_tokens_equal_stock_tokens_on_the_same_logits(runs):
    on = runs["on"]
    stats, v = on["stats"], on["verify"]
    seqs = {k: {n: runs[r][f"{k}{n}"] for n in SIZES} for r, k in (("on", "greedy"), ("on", "verified"))}
    stock = {r: {n: runs[r][f"logprobs{n}"] for n in SIZES} for r in runs}
    print(f"\nwhole-model stats (stage A + B): {stats}\nverification: {v}")
    print(f"graph tokens vs stock sampling, same engine: {_same(seqs['greedy'], stock['on'])}")
    print(f"verified vs shipped graph tokens, same engine: {_same(seqs['verified'], seqs['greedy'])}")
    print(f"mode on vs mode off (two engines, stock sampling on both sides): {_same(stock['on'], stock['off'])}")
    # teacher forcing through the decode path: where mode on and off sampled the same tokens so far,
    # each step's logprob had the same context on both sides (reported; issue 7 asks for equality)
    # (index 0 is the token drawn from the prefill's logits, which the mode never touches)
    prefill, deltas = [], []
    for n in SIZES:
        for a, b, la, lb in zip(runs["on"][f"logprobs{n}"], runs["off"][f"logprobs{n}"],
                                runs["on"][f"logprob_values{n}"], runs["off"][f"logprob_values{n}"]):
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            d = [abs(x - y) for x, y in zip(la[:same], lb[:same])]  # the same token on the same context
            prefill += d[:1]
            deltas += d[1:]
    print(f"prefill logprobs, mode on vs off: {len(prefill)} sequences, {sum(d == 0 for d in prefill)} exactly "
          f"equal, max |delta| {max(prefill, default=0):.3g}")
    print(f"decode logprobs, mode on vs off on the same context: {len(deltas)} steps, "
          f"{sum(d == 0 for d in deltas)} exactly equal, max |delta| {max(deltas, default=0):.3g}")
    # Reported only: equal prefills do not make two engines' decodes equal. One engine repeating the
    # same batches is not exact either (H200, 07143ae: on vs on max |delta| 0.0153 on the same
    # context), and two engines' decode graphs are compiled apart (0 to 0.406 seen). The criterion is
    # judged in one engine, against its own spread: test_mode_on_and_off_in_one_engine_agree_within_its_spread.
    assert deltas, "no decode logprob on a shared context"
    seeded = lambda a, b: f"{sum(x == y for x, y in zip(a, b))}/{len(a)} sequences identical"  # noqa: E731
    print(f"seeded sampling (temperature 0.8, top-k 50, top-p 0.9): mode on, run 1 vs run 2: "
          f"{seeded(runs['on']['seeded1'], runs['on']['seeded2'])}; mode off, run 1 vs 2: "
          f"{seeded(runs['off']['seeded1'], runs['off']['seeded2'])}; mode on vs off: "
          f"{seeded(runs['on']['seeded1'], runs['off']['seeded1'])}")
    if "off2" in runs:
        print(f"control, mode off vs mode off (two engines): {_same(stock['off'], stock['off2'])}")
    _assert_verified(on)


def _passes_gap(a, b) -> dict:
    """Two passes of the one-engine comparison: greedy sequences identical, and the teacher-forced
    logprobs of the logprob batches up to each sequence's first differing token (the same token on
    the same context): how many, how many exactly equal, max |delta|."""
    greedy = [(x, y) for ga, gb in zip(a["greedy"], b["greedy"]) for x, y in zip(ga, gb)]
    deltas = []
    for ta, tb, va, vb in zip(a["logprobs"], b["logprobs"], a["values"], b["values"]):
        for xa, xb, la, lb in zip(ta, tb, va, vb):
            same = next((i for i, (p, q) in enumerate(zip(xa, xb)) if p != q), len(xa))
            deltas += [abs(p - q) for p, q in zip(la[:same], lb[:same])]
    return {"greedy_identical": sum(x == y for x, y in greedy), "greedy": len(greedy), "positions": len(deltas),
            "equal": sum(x == 0 for x in deltas), "max_delta": max(deltas, default=0.0),
            "mean_delta": sum(deltas) / max(len(deltas), 1)}


def test_mode_on_and_off_in_one_engine_agree_within_its_spread(runs):
    """Issue 7's numerics criterion, in one engine (two engines compile the model apart): the mode
    switched off at run time, each pass from a cold prefix cache, passes in turn on, off, on, off.
    The engine's run-to-run spread is on vs on and off vs off; on vs off must be within it: exactly
    equal where the engine repeats itself exactly, else of the same size (max and mean |delta| on
    the same context at most twice the spread's: if on and off behave alike the four passes are
    exchangeable, so "no larger than the spread" would fail about half the time by chance alone;
    a mode that changed the numbers shows gaps of another order, e.g. 2.29 seen when contexts differ)."""
    r = runs["on"]
    spread = [_passes_gap(r["one_on"], r["one_on2"]), _passes_gap(r["one_off"], r["one_off2"])]
    cross = [_passes_gap(r["one_on"], r["one_off"]), _passes_gap(r["one_on2"], r["one_off2"])]
    for name, gaps in (("spread (on vs on, off vs off)", spread), ("mode on vs switched off", cross)):
        print(f"\none engine, {name}: " + "; ".join(
            f"greedy {g['greedy_identical']}/{g['greedy']} sequences identical, logprobs on the same context "
            f"{g['equal']}/{g['positions']} exactly equal, max |delta| {g['max_delta']:.3g}, mean "
            f"{g['mean_delta']:.2g}" for g in gaps))
    seeded = [(a, b, sum(x == y for x, y in zip(r[a]["seeded"], r[b]["seeded"]))) for a, b in
              (("one_on", "one_on2"), ("one_off", "one_off2"), ("one_on", "one_off"), ("one_on2", "one_off2"))]
    print("one engine, seeded sampling (temperature 0.8, top-k 50, top-p 0.9), sequences identical: "
          + ", ".join(f"{a} vs {b} {n}/{len(r[a]['seeded'])}" for a, b, n in seeded))
    assert all(g["positions"] >= sum(SIZES) for g in spread + cross)
    limit = max(g["max_delta"] for g in spread)
    if limit == 0 and all(g["greedy_identical"] == g["greedy"] for g in spread):
        assert all(g["max_delta"] == 0 and g["greedy_identical"] == g["greedy"] for g in cross), cross
    else:
        mean_limit = max(g["mean_delta"] for g in spread)
        assert all(g["max_delta"] <= 2 * limit and g["mean_delta"] <= 2 * mean_limit for g in cross), (cross, spread)


def test_sampling_and_logprob_batches_fall_back(runs):
    on = runs["on"]
    fb = on["stats"]["fallbacks"]
    reasons = " ".join(fb)
    assert "temperature > 0" in reasons and "logprobs" in reasons, on["stats"]
    assert fb["logprobs requested"] >= len(SIZES) * (GEN - 2), fb
    assert all(len(t) == GEN for t in on["mixed"])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_graph_tokens_equal_stock_tokens_on_the_same_logits(checkpoint):
    """Issue 10: the mode at TP=2. Each rank's graph ends in the vocab-parallel lm_head, vLLM's
    own logits all-gather (captured like the model's all-reduces) and the argmax; verification
    runs stock's lm_head + sampler on the same hidden states on every rank, and every rank's
    counters are asserted (each rank feeds its own tokens into its next step). Same checks as at
    TP=1, fallbacks included."""
    on = _serve(checkpoint, True, tp=2)
    print(f"\nTP=2 whole-model stats (stage A + B): {on['stats_ranks']}\nverification: {on['verify_ranks']}")
    assert len(on["stats_ranks"]) == 2 == len(on["verify_ranks"])
    for stats, verify in zip(on["stats_ranks"], on["verify_ranks"]):  # every rank samples for itself
        _assert_verified({**on, "stats": stats, "verify": verify})
    assert len({r["taken"] for r in on["stats_ranks"]}) == 1, on["stats_ranks"]  # ranks in step
    reasons = " ".join(on["stats"]["fallbacks"])
    assert "temperature > 0" in reasons and "logprobs" in reasons, on["stats"]


@pytest.mark.parametrize("level", ["1", "2"])
def test_in_graph_temperature_sampling(checkpoint, monkeypatch, level):
    """$VLLM_SM121_GRAPH_SAMPLE=1: the graph samples unseeded temperature-only requests too
    (kernels/decode_sample.py); =2: with top-k 50 / top-p 0.9 as well (the threshold kernel). With verification on: a mixed batch (2 greedy, 2 temperature-1.0
    rows) and an all-temperature batch take the graph's tokens (counted as taken, no "a request
    samples" fallback), greedy rows equal stock's tokens on the same logits, temperature rows are
    counted apart; 4 requests with one prompt at temperature 1.0 give distinct sequences; a
    seeded request still falls back to stock's sampler."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("VLLM_SM121_GRAPH_SAMPLE", level)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM, SamplingParams

    llm = LLM(model=checkpoint, skip_tokenizer_init=True, max_model_len=4096, max_num_batched_tokens=512,
              gpu_memory_utilization=0.3, seed=0, attention_backend="SM121",
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE", "max_cudagraph_capture_size": 8},
              additional_config={"sm121": {"cudagraph": "whole_model"}})
    try:
        llm.collective_rpc("sm121_graph_verify", args=(True,))
        greedy = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, detokenize=False)
        filt = dict(top_k=50, top_p=0.9) if level == "2" else {}
        hot = SamplingParams(max_tokens=GEN, temperature=1.0, ignore_eos=True, detokenize=False, **filt)
        prompts = [{"prompt_token_ids": p} for p in _prompts(4)]
        mixed = llm.generate(prompts, [greedy, hot, greedy, hot], use_tqdm=False)
        same = [{"prompt_token_ids": _prompts(1)[0]}] * 4
        hot_out = llm.generate(same, hot, use_tqdm=False)
        seeded = llm.generate(prompts[:1], SamplingParams(max_tokens=GEN, temperature=1.0, seed=5, ignore_eos=True,
                                                          detokenize=False), use_tqdm=False)
        stats = llm.collective_rpc("sm121_graph_stats")[0]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\nin-graph sampling (level {level}) stats: {stats}")
    seqs = [list(r.outputs[0].token_ids) for r in hot_out]
    print(f"temperature 1.0, one prompt, 4 requests: {len({tuple(s) for s in seqs})} distinct sequences")
    v, fb = stats["verify"], stats["fallbacks"]
    assert all(len(r.outputs[0].token_ids) == GEN for r in [*mixed, *hot_out, *seeded])
    assert not any("a request samples" in k for k in fb), fb
    assert any("seeded" in k for k in fb), fb
    assert stats["taken"] >= 2 * (GEN - 6), stats
    assert v["mismatched_rows"] == 0 and v["sampled_rows"] >= 6 * (GEN - 6) and v["rows"] >= 2 * (GEN - 6), v
    # every sampled token is one vLLM's own top-k / top-p filter keeps (boundary ties aside)
    assert v["sampled_outside_filter"] <= 0.02 * v["sampled_rows"], v
    assert len({tuple(s) for s in seqs}) >= 2, seqs
