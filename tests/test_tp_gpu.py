"""Tensor and expert parallelism on two GPUs: the plugin at TP=2 / EP=2 against itself at TP=1.

gpt-oss-tiny's shapes (64 q / 8 kv heads, 8 experts, intermediate 2880) as a random real-format
checkpoint: at TP=2 each rank has 32 q / 4 kv heads with their sinks, and an intermediate shard of
1440 (padded to 1472 by the plugin's MoE method, as for gpt-oss-120b); at EP=2 each rank has 4
experts. The plugin runs everything it has: SM121 attention, nvfp4 KV cache, the MXFP4 x MXFP8
MoE (fused norm producer included; ``$VLLM_SM121_MOE_EXPERIMENTAL=1`` must be set for the whole
run, as ``scripts/gpu_session.sh tptests`` does).

The checks use the rule of ``test_e2e_gpu`` (mean and p99 of |delta logprob| at most 1.5x a
spread + 1e-3), teacher-forced prompt logprobs:

* attention: SM121 (bf16 KV, vLLM's MoE) at TP=2 vs TRITON_ATTN at TP=1, within the spread
  FLASH_ATTN shows against TRITON_ATTN at TP=1;
* MoE: the plugin's MoE at TP=2 and EP=2 vs the same at TP=1, within the spread TRITON_ATTN and
  FLASH_ATTN show when both run the plugin's MoE at TP=1. Quantized activations turn a tiny input
  difference into whole-step code flips now and then, so a quantized configuration's spread is
  wider than the bf16 one; it is measured in the same configuration, not assumed;
* FULL_AND_PIECEWISE graphs at TP=2 (SM121 + the plugin's MoE): sampled tokens scored by TP=2
  eager teacher forcing, within that MoE spread;
* everything on (nvfp4 KV, FP8 dense) at TP=2 / EP=2 vs TP=1: reported with a sanity bound, next
  to the configuration's own spread measured as prefill chunks 512 vs 256 (no upstream backend
  reads nvfp4 on sm_90);
* nvfp4 at TP=2 / EP=2 judged by a like-for-like spread: the same TP=1 configuration against
  its twin with other prefill tiles ($VLLM_SM121_ATTN_TILE, ``ALT_TILES``: another reduction
  order, as a second backend has), calibrated by the same tile change with bf16 KV;
* issue 10's rule: nvfp4 at TP=2 / EP=2 vs TP=1 in the TP-invariant mode ($VLLM_SM121_TP_INVARIANT:
  the one-rank engine sums the two ranks' fp32 shares in their order) within the upstream backends'
  spread (asserted, with the share of bit-equal logprobs); against TP=1's default order reported
  (summation order only, stop 35);
* where TP=2 leaves TP=1, layer by layer (reported, for the next step of that rule).

Engines per test (each ~35-60 s on an H100 pair): fixtures ``upstream`` 2, ``moe_spread`` 2 and ``tile_knob`` 2;
attention 1, MoE 3, graphs 2, upstream chunks 1, each nvfp4 case 4 (chunk spread) or 4 (tile spread) or 3 (upstream
spread), TP-invariant 4, per-layer divergence 3, EP=2 repeat 3. ``$SM121_TP_MODEL=120b-4layers``
(``tp_model``) runs them on gpt-oss-120b's first 4 layers (128 experts). Select with ``-k`` (gpu_session
``TP_K``) to fit a 10-minute call.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import logprob_gap, run_engine
from test_e2e_gpu import MODELS, PROMPT_LENS, _prompts, _within, _write

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]

PLUGIN = dict(attention_backend="SM121", kv_cache_dtype="nvfp4", additional_config={"sm121": {"moe": "mxfp8"}})
UPSTREAM = dict(additional_config={"sm121": {"moe": "upstream"}})
MOE = dict(additional_config={"sm121": {"moe": "mxfp8"}})


def _run(ckpt, prompts, *, tp=1, ep=False, graphs=False, gen=0, chunk=256, **kw):
    """(prompt logprobs, generated ids, generated logprobs) of one engine; TP workers are spawned."""
    return run_engine(prompts, gen=gen, graphs=graphs, model=ckpt, max_num_batched_tokens=chunk,
                      tensor_parallel_size=tp, enable_expert_parallel=ep, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from vllm_sm121 import moe

    if not moe.READY:
        pytest.skip("the plugin's MoE is gated off: set VLLM_SM121_MOE_EXPERIMENTAL=1 for the run")
    return _write(tmp_path_factory, tp_model(), {**MODELS, **TP_MODELS})


# (not in test_e2e_gpu.MODELS: its tests are parametrized over every entry there)
TP_MODELS = {"120b-4layers": ("gpt-oss-120b", 4)}


def tp_model() -> str:
    """$SM121_TP_MODEL: the random checkpoint's shapes, "tiny" (default: gpt-oss-120b's layer shapes
    with 8 experts) or "120b-4layers" (gpt-oss-120b's first 4 layers, 128 experts: ~9 GB written)."""
    name = os.environ.get("SM121_TP_MODEL", "tiny")
    if name != "tiny" and name not in TP_MODELS:
        raise ValueError(f"$SM121_TP_MODEL={name!r} is not supported; supported: tiny, {', '.join(TP_MODELS)}")
    return name


def _say(what, gap, spread):
    print(f"\n{what}: |delta logprob| mean {gap[0]:.4g} p99 {gap[1]:.4g} "
          f"(upstream backends' spread at TP=1: mean {spread[0]:.4g} p99 {spread[1]:.4g})")


@pytest.fixture(scope="module")
def upstream(ckpt):
    """TRITON_ATTN's prompt logprobs at TP=1 and the spread FLASH_ATTN shows against them."""
    prompts = _prompts(PROMPT_LENS)
    triton = _run(ckpt, prompts, attention_backend="TRITON_ATTN", **UPSTREAM)[0]
    return triton, logprob_gap(_run(ckpt, prompts, attention_backend="FLASH_ATTN", **UPSTREAM)[0], triton)


def test_sm121_attention_at_tp2_within_upstream_spread(ckpt, upstream):
    """SM121 (bf16 KV, vLLM's MoE) at TP=2 -- 32 q / 4 kv heads and their sinks per rank -- against
    TRITON_ATTN at TP=1, by the rule FLASH_ATTN passes against it."""
    triton, spread = upstream
    gap = logprob_gap(_run(ckpt, _prompts(PROMPT_LENS), tp=2, attention_backend="SM121", **UPSTREAM)[0], triton)
    _say("SM121 attention TP=2 vs TRITON_ATTN TP=1", gap, spread)
    assert torch.cat(triton).std().item() > 5 * spread[0], "weights too weak for a meaningful comparison"
    assert _within(gap, spread), (gap, spread)


@pytest.fixture(scope="module")
def moe_spread(ckpt):
    """The spread of two upstream attention backends (TRITON_ATTN, FLASH_ATTN) when both run the
    plugin's MoE at TP=1: MXFP8 activations re-round any upstream difference, so this is the
    run-to-run spread of that configuration (about twice the bf16 one on an H100 pair)."""
    prompts = _prompts(PROMPT_LENS)
    triton = _run(ckpt, prompts, attention_backend="TRITON_ATTN", **MOE)[0]
    return logprob_gap(_run(ckpt, prompts, attention_backend="FLASH_ATTN", **MOE)[0], triton)


def test_moe_at_tp2_and_ep2_within_upstream_spread(ckpt, moe_spread):
    """The plugin's MXFP4 x MXFP8 MoE at TP=2 (intermediate shards padded 1440 -> 1472) and EP=2
    (4 experts per rank, expert_map routing) against itself at TP=1, within ``moe_spread``."""
    prompts = _prompts(PROMPT_LENS)
    tp1 = _run(ckpt, prompts, attention_backend="SM121", **MOE)[0]
    for name, kw in (("TP=2", dict(tp=2)), ("EP=2", dict(tp=2, ep=True))):
        gap = logprob_gap(_run(ckpt, prompts, attention_backend="SM121", **kw, **MOE)[0], tp1)
        _say(f"SM121 + MXFP8 MoE {name} vs TP=1", gap, moe_spread)
        assert _within(gap, moe_spread), (name, gap, moe_spread)


def test_tp2_full_graphs_decode(ckpt, moe_spread):
    """SM121 + the plugin's MoE (bf16 KV) decoding under FULL_AND_PIECEWISE graphs at TP=2 (the
    MoE hook's all-reduce and the attention inside each rank's graphs): the sampled tokens'
    logprobs against TP=2 eager teacher forcing of the same sequences, within ``moe_spread``."""
    prompts = _prompts()
    cfg = dict(attention_backend="SM121", **MOE)
    _, ids, graph_lp = _run(ckpt, prompts, tp=2, graphs="FULL_AND_PIECEWISE", gen=16, **cfg)
    seqs = [p + i for p, i in zip(prompts, ids)]
    scored = _run(ckpt, seqs, tp=2, **cfg)[0]
    forced = [s[len(p) - 1:] for s, p in zip(scored, prompts)]  # logprobs of the generated tokens
    gap = logprob_gap(graph_lp, forced)
    _say("SM121 + MXFP8 MoE, TP=2 FULL_AND_PIECEWISE decode vs TP=2 eager teacher-forced", gap, moe_spread)
    assert all(len(i) == 16 for i in ids)
    assert _within(gap, moe_spread), (gap, moe_spread)


def test_upstream_chunk_size_spread_reported(ckpt, upstream):
    """The same TRITON_ATTN engine with 512- instead of 256-token prefill chunks: the measure the
    nvfp4 test uses for its own spread, next to the FLASH_ATTN-vs-TRITON_ATTN spread."""
    chunked = logprob_gap(_run(ckpt, _prompts(PROMPT_LENS), chunk=512, attention_backend="TRITON_ATTN",
                               **UPSTREAM)[0], upstream[0])
    _say("upstream TRITON_ATTN, prefill chunks 512 vs 256 (TP=1)", chunked, upstream[1])
    assert chunked[0] < 0.25 * torch.cat(upstream[0]).std().item()


NVFP4_CONFIGS = {"nvfp4-kv": PLUGIN,
                 "nvfp4-kv-fp8-dense": dict(PLUGIN, additional_config={"sm121": {"moe": "mxfp8",
                                                                                  "dense_weights": "fp8"}})}


@pytest.mark.parametrize("what", list(NVFP4_CONFIGS))
def test_nvfp4_at_tp2_reported(ckpt, upstream, what):
    """Everything on (nvfp4 KV, MXFP8 MoE, and FP8 dense) at TP=2 / EP=2 vs TP=1: reported with a
    sanity bound. Each rank calibrates nvfp4 scales on its heads (powers of two: the same cache
    values) and scales its o_proj shard by the whole rows' max (a MAX all-reduce at load: TP=1's codes).

    No upstream backend reads nvfp4 on sm_90, so the configuration's own run-to-run spread is
    measured the one way available: the same TP=1 engine with prefill chunks of 512 instead of 256
    tokens (another, equally correct, reduction order; the upstream equivalent is
    ``test_upstream_chunk_size_spread_reported``)."""
    prompts = _prompts(PROMPT_LENS)
    signal = torch.cat(upstream[0]).std().item()
    kw = NVFP4_CONFIGS[what]
    tp1 = _run(ckpt, prompts, **kw)[0]
    own = logprob_gap(_run(ckpt, prompts, chunk=512, **kw)[0], tp1)
    _say(f"{what}, prefill chunks 512 vs 256 (TP=1): this configuration's own spread", own, upstream[1])
    for name, par in (("TP=2", dict(tp=2)), ("EP=2", dict(tp=2, ep=True))):
        gap = logprob_gap(_run(ckpt, prompts, **par, **kw)[0], tp1)
        _say(f"{what} {name} vs TP=1 (reported)", gap, upstream[1])
        assert gap[0] < 0.25 * signal, (what, name, gap)


# Prefill tiles other than the sm_90 defaults: the same arithmetic with another online-softmax
# reduction order, i.e. a second, equally correct SM121 configuration (as a second backend is for bf16).
ALT_TILES = {"VLLM_SM121_ATTN_TILE": "prefill=32,32,4,2;prefill_sw=32,16,4,2"}


def _run_env(env, *args, **kw):
    """_run with ``env`` set for the engine (its spawned processes inherit it), then restored."""
    import os

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return _run(*args, **kw)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def tile_knob(ckpt, upstream):
    """Calibration: SM121 with bf16 KV (vLLM's MoE), default vs ALT_TILES prefill tiles at TP=1,
    next to the FLASH_ATTN-vs-TRITON_ATTN spread: is the tile change a backend-sized perturbation?"""
    prompts = _prompts(PROMPT_LENS)
    base = _run(ckpt, prompts, attention_backend="SM121", **UPSTREAM)[0]
    gap = logprob_gap(_run_env(ALT_TILES, ckpt, prompts, attention_backend="SM121", **UPSTREAM)[0], base)
    _say("SM121 bf16 KV, prefill tiles default vs ALT_TILES (TP=1)", gap, upstream[1])
    return gap


@pytest.mark.parametrize("what", list(NVFP4_CONFIGS))
def test_nvfp4_tp2_within_its_tile_spread(ckpt, upstream, tile_knob, what):
    """Issue 10's nvfp4 acceptance, like for like: the configuration at TP=2 / EP=2 against itself
    at TP=1 must stay within (1.5x + 1e-3) the spread the same TP=1 configuration shows against its
    ALT_TILES twin (the quantized cache amplifies any reduction-order change; the bf16 rule cannot
    be applied to it unchanged). Engines: 4 per case, plus 2 for the module's calibration."""
    prompts = _prompts(PROMPT_LENS)
    kw = NVFP4_CONFIGS[what]
    tp1 = _run(ckpt, prompts, **kw)[0]
    spread = logprob_gap(_run_env(ALT_TILES, ckpt, prompts, **kw)[0], tp1)
    _say(f"{what}, prefill tiles default vs ALT_TILES (TP=1): its spread", spread, upstream[1])
    print(f"  (the tile knob moves bf16 SM121 by mean {tile_knob[0]:.4g} p99 {tile_knob[1]:.4g})")
    for name, par in (("TP=2", dict(tp=2)), ("EP=2", dict(tp=2, ep=True))):
        gap = logprob_gap(_run(ckpt, prompts, **par, **kw)[0], tp1)
        _say(f"{what} {name} vs TP=1, judged by its tile spread {spread[0]:.4g} / {spread[1]:.4g}", gap, upstream[1])
        assert _within(gap, spread), (what, name, gap, spread)


@pytest.mark.parametrize("what", list(NVFP4_CONFIGS))
def test_nvfp4_tp2_vs_default_tp1_reported(ckpt, upstream, what):
    """Issue 10's rule with TP=1 in its default reduction order: nvfp4 KV + the plugin's MoE (and
    FP8 dense) at TP=2 / EP=2 against the same plugin at TP=1, next to the upstream backends' spread.
    Reported, not asserted against the rule: TP=2 sums o_proj's and FC2's two fp32 shares, TP=1 one
    long sum (the only difference, stop 35: 0.110 / 0.442 vs the rule's 0.061 / 0.506), which the
    quantized activations amplify; the rule is asserted against the TP-invariant TP=1
    (``test_tp_invariant_tp1_matches_tp2_and_ep2``). Asserted: a sanity bound (a fault is far off).
    Engines: 3 per case, plus the module's 2 upstream ones."""
    prompts = _prompts(PROMPT_LENS)
    kw = NVFP4_CONFIGS[what]
    tp1 = _run(ckpt, prompts, **kw)[0]
    signal = torch.cat(upstream[0]).std().item()
    for name, par in (("TP=2", dict(tp=2)), ("EP=2", dict(tp=2, ep=True))):
        gap = logprob_gap(_run(ckpt, prompts, **par, **kw)[0], tp1)
        _say(f"{what} {name} vs TP=1 (default order; rule {'met' if _within(gap, upstream[1]) else 'not met'})",
             gap, upstream[1])
        assert gap[0] < 0.25 * signal, (what, name, gap)


DIVERGENCE_PROMPT_ENV = "SM121_DIVERGENCE_PROMPT"


def _divergence_prompt():
    """([prompt], prefill chunk) for the divergence test: one prompt of $SM121_DIVERGENCE_PROMPT
    tokens (default: the dumped forward's) in two chunks, the second the dumped forward's N tokens
    (``probes.dump_tokens()``; e.g. P = 2049, N = 110: the TP=2 tail of stop 37's 2049-token
    prompt); one forward when P = N."""
    from vllm_sm121.envs import env_int
    from vllm_sm121.testing import probes

    n = probes.dump_tokens()
    total = env_int(DIVERGENCE_PROMPT_ENV, n)
    if total != n and total <= 2 * n:
        raise ValueError(f"${DIVERGENCE_PROMPT_ENV}={total}: must equal ${probes.DUMP_TOKENS_ENV} ({n}) or be more than "
                         f"twice it (prefill chunks of P - N tokens: the second, of N, must be the last)")
    prompt = [(7 * i + 3) % 200 + 1 for i in range(total)]
    return [prompt], (256 if total == n else total - n)


def test_tp2_divergence_per_layer_reported(ckpt, monkeypatch):
    """Where TP=2 leaves TP=1 (nvfp4 KV, the plugin's MoE, FP8 dense: every GEMM the plugin's), one
    200-token prompt in one eager forward (or, with $SM121_DIVERGENCE_PROMPT=P and $SM121_DUMP_TOKENS=N,
    the last N-token chunk of a P-token prompt: ``_divergence_prompt``): per layer, the share of elements bit-equal to TP=1 in the
    attention core's inputs and output (each rank's heads against their slice of TP=1's), the MoE
    output and the residual, then the logits, against TP=1 and against TP=1 in the TP-invariant
    mode ($VLLM_SM121_TP_INVARIANT=tp2, which should be bit-equal). Reported for the next step of
    issue 10; asserted: every layer dumped on every rank, the last residual within 25% relative L2
    of TP=1's (a wrong shard, bias or reduce would be far off; 4 random-weight layers of quantized
    activations amplify the reduction-order difference to ~10%, stop 35), and every dumped tensor
    bit-equal to the TP-invariant TP=1's."""
    from vllm_sm121.testing import probes

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    prompts, chunk = _divergence_prompt()
    kw = NVFP4_CONFIGS["nvfp4-kv-fp8-dense"]
    run = dict(setup=probes.install_layer_dumps, probe=probes.layer_dumps)
    tp1 = _run(ckpt, prompts, chunk=chunk, **run, **kw)[1][0]
    layers = sorted({int(k.split(".")[0]) for k in tp1 if k[0].isdigit()})
    assert layers and all(f"{i}.{w}" in tp1 for i in layers for w in ("attn", "block")), sorted(tp1)
    sim = _run_env({"VLLM_SM121_TP_INVARIANT": "tp2"}, ckpt, prompts, chunk=chunk, **run, **kw)[1][0]

    def eq(a, b):
        return (a == b).float().mean().item()

    def rank_slice(t, k):  # rank k's columns of a TP=1 tensor split by heads
        half = t.shape[1] // 2
        return t[:, k * half:(k + 1) * half]

    ranks = _run(ckpt, prompts, tp=2, chunk=chunk, **run, **kw)[1]
    assert len(ranks) == 2 and all(f"{i}.{w}" in r for r in ranks for i in layers for w in ("attn", "block"))
    for label, ref in (("TP=1", tp1), ("TP=1 in the TP-invariant mode (tp2)", sim)):
        print(f"\nTP=2 vs {label}: share of elements bit-equal (q, k, v after the rotation; attention "
              "core; MoE out; residual), max |diff| of the residual; nvfp4 K/V global scales (TP=1 / ranks)")
        for i in layers:
            qkv = " ".join(f"{n} {min(eq(r[f'{i}.qkv'][j], rank_slice(ref[f'{i}.qkv'][j], k)) for k, r in enumerate(ranks)):.4f}"
                           for j, n in enumerate("qkv")) if f"{i}.qkv" in ref else "qkv -"
            a = min(eq(r[f"{i}.attn"][0], rank_slice(ref[f"{i}.attn"][0], k)) for k, r in enumerate(ranks))
            mo, res = ranks[0][f"{i}.block"][0], ranks[0][f"{i}.block"][1]
            g = " / ".join(str(r[f"{i}.g"][0].tolist()) for r in [ref] + list(ranks) if f"{i}.g" in r)
            g += "  calibrated on (tokens, capturing, cache elements) " + " / ".join(
                str(r[f"{i}.calib"][0].tolist()) for r in [ref] + list(ranks) if f"{i}.calib" in r)
            print(f"  layer {i}: {qkv}  attn {a:.4f}  moe {eq(mo, ref[f'{i}.block'][0]):.4f}  residual "
                  f"{eq(res, ref[f'{i}.block'][1]):.4f}  max {((res - ref[f'{i}.block'][1]).abs().max().item()):.3g}"
                  f"  g {g}")
        if "logits" in ref and "logits" in ranks[0]:
            a, b = ranks[0]["logits"][0], ref["logits"][0]
            n = min(a.shape[1], b.shape[1])
            a, b = a[:, :n], b[:, :n]
            lp = (a.log_softmax(-1) - b.log_softmax(-1)).abs()
            print(f"  logits: bit-equal {eq(a, b):.4f}, max |diff| {(a - b).abs().max().item():.3g}, "
                  f"|delta logprob| over the vocabulary mean {lp.mean().item():.4g} max {lp.max().item():.4g}")
    last, ref = ranks[0][f"{layers[-1]}.block"][1], tp1[f"{layers[-1]}.block"][1]
    assert ((last - ref).norm() / ref.norm()).item() < 0.25  # a wrong shard, bias or reduce would be far off
    # against the TP-invariant TP=1 every dumped tensor is bit-equal (stop 35, 2 H200s)
    for i in layers:
        for k, r in enumerate(ranks):
            for j in range(3):
                assert torch.equal(r[f"{i}.qkv"][j], rank_slice(sim[f"{i}.qkv"][j], k)), (i, k, "qkv"[j])
            assert torch.equal(r[f"{i}.attn"][0], rank_slice(sim[f"{i}.attn"][0], k)), (i, k, "attn")
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][f"{i}.block"], sim[f"{i}.block"])), (i, "block")
    assert torch.equal(ranks[0]["logits"][0], sim["logits"][0])


@pytest.mark.parametrize("what", list(NVFP4_CONFIGS))
def test_tp_invariant_tp1_matches_tp2_and_ep2(ckpt, upstream, what):
    """Issue 10's rule against the plugin's TP-invariant mode: the one-rank engine with
    $VLLM_SM121_TP_INVARIANT=tp2 (ep2) computes o_proj and the MoE as TP=2's (EP=2's) two ranks
    do -- their weight shards, their fp32 shares, summed as the fp32 all-reduce sums them -- so a
    correct TP=2 / EP=2 engine gives the same bits; any sharding, padding, bias, sink, KV-scale or
    all-reduce fault would show. Within (1.5x + 1e-3) the upstream backends' spread; the share of
    bit-equal prompt logprobs is reported. Engines: 4 per case, plus the module's 2 upstream ones."""
    prompts = _prompts(PROMPT_LENS)
    kw = NVFP4_CONFIGS[what]
    results = []  # both cases run before anything is asserted (one engine pair per case)
    for mode, name, par in (("tp2", "TP=2", dict(tp=2)), ("ep2", "EP=2", dict(tp=2, ep=True))):
        ref = _run_env({"VLLM_SM121_TP_INVARIANT": mode}, ckpt, prompts, **kw)[0]
        got = _run(ckpt, prompts, **par, **kw)[0]
        gap = logprob_gap(got, ref)
        same = torch.cat([(a == b).float() for a, b in zip(got, ref)]).mean().item()
        _say(f"{what} {name} vs TP=1 with $VLLM_SM121_TP_INVARIANT={mode}", gap, upstream[1])
        print(f"  bit-equal prompt logprobs: {same:.4f}; per prompt (share, first differing position): "
              f"{_per_prompt_equal(got, ref)}")
        results.append((name, gap, same))
    for name, gap, same in results:
        assert _within(gap, upstream[1]), (what, name, gap, upstream[1])
    for name, gap, same in results:
        # 0.970-1.000 at 9da91cd; stop 37 (0fc4867, lm_head shards): 0.973 / 1.000 nvfp4 KV, 0.970 / 0.938 FP8 dense
        assert same >= 0.95, (what, name, same)


def _per_prompt_equal(a, b):
    """Per prompt: (share of bit-equal prompt logprobs, first position that differs or -1)."""
    out = []
    for x, y in zip(a, b):
        eq = (x == y)
        bad = (~eq).nonzero()
        out.append((eq.float().mean().item(), int(bad[0, 0]) if len(bad) else -1))
    return out


def test_ep2_repeat_and_mode_reported(ckpt):
    """EP=2 is deterministic (two engines, the same bits), and where it leaves the ep2 TP-invariant
    TP=1, per prompt (share bit-equal, first differing position). Stop 36 (7ddf330, before the mode
    computed the lm_head as two vocabulary shards, ``vllm_sm121/tp_invariant.py``): run 1 == run 2;
    against the mode the prompts of 15, 16 and 17 tokens and the 2049-token prompt's last chunk
    differed from their first position, every other prompt bit-equal. nvfp4 KV + the plugin's MoE.
    Engines: 3."""
    prompts = _prompts(PROMPT_LENS)
    kw = NVFP4_CONFIGS["nvfp4-kv"]
    a = _run(ckpt, prompts, tp=2, ep=True, **kw)[0]
    b = _run(ckpt, prompts, tp=2, ep=True, **kw)[0]
    ref = _run_env({"VLLM_SM121_TP_INVARIANT": "ep2"}, ckpt, prompts, **kw)[0]
    print("\nprompt lengths:", [len(p) for p in prompts])
    print("EP=2 run 1 vs run 2 (share equal, first diff):", _per_prompt_equal(a, b))
    print("EP=2 run 1 vs ep2 mode:", _per_prompt_equal(a, ref))
    assert all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))  # (prompt 0 has one token: no logprob)
