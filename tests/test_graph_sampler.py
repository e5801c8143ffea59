"""CPU tests of the graph-capturable decode sampler (vllm_sm121.graph.sampler)."""

import inspect
import random
import re
from types import SimpleNamespace

import pytest
import torch

from vllm_sm121.graph import sampler as gs
from vllm_sm121.graph.sampler import (
    SamplingTensors,
    fill_sampling_tensors,
    sample,
    sample_reference,
    uniforms,
)


def _st(temps, ks, ps, seeds, steps=None):
    n = len(temps)
    st = SamplingTensors.allocate(n)
    st.temperature.copy_(torch.tensor(temps, dtype=torch.float32))
    st.top_k.copy_(torch.tensor(ks, dtype=torch.int32))
    st.top_p.copy_(torch.tensor(ps, dtype=torch.float32))
    st.seed.copy_(torch.tensor(seeds, dtype=torch.int64))
    st.step.copy_(torch.tensor(steps or [0] * n, dtype=torch.int64))
    return st


def _run(logits, st, **kw):
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    sample(logits, st, out, **kw)
    return out


def test_greedy_rows_equal_argmax_and_ignore_filters():
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # tie: lowest index wins
    st = _st([0.0] * 6, [1, 5, 0, 300, 2, 0], [1.0, 0.1, 0.5, 1.0, 0.01, 1.0], list(range(6)))
    out = _run(logits, st)
    assert torch.equal(out, logits.argmax(-1))
    assert out[2] == 7


def test_greedy_uses_raw_logits_in_bf16():
    torch.manual_seed(1)
    logits = torch.randn(3, 64).to(torch.bfloat16)
    st = _st([0.0, 1e-6, 0.0], [0, 0, 3], [1.0, 1.0, 0.3], [0, 1, 2])
    assert torch.equal(_run(logits, st), logits.float().argmax(-1))


def test_top_k_1_equals_greedy():
    torch.manual_seed(2)
    logits = torch.randn(8, 500)
    st = _st([0.5, 1.0, 1.5, 2.0] * 2, [1] * 8, [1.0, 0.9, 0.5, 1.0] * 2, list(range(100, 108)))
    for _ in range(3):
        assert torch.equal(_run(logits, st), logits.argmax(-1))


def test_matches_reference_mixed_batch():
    torch.manual_seed(3)
    B, V = 32, 257
    logits = torch.randn(B, V) * 3
    rng = random.Random(0)
    temps = [rng.choice([0.0, 0.3, 1.0, 1.7]) for _ in range(B)]
    ks = [rng.choice([0, -1, 1, 5, 40, V, V + 10]) for _ in range(B)]
    ps = [rng.choice([1.0, 0.95, 0.5, 0.1]) for _ in range(B)]
    seeds = [rng.getrandbits(64) - (1 << 63) for _ in range(B)]
    steps = [rng.randrange(0, 1 << 40) for _ in range(B)]
    st = _st(temps, ks, ps, seeds, steps)
    for it in range(3):
        ref = sample_reference(logits, temps, ks, ps, seeds, [s + it for s in steps])
        assert _run(logits, st).tolist() == ref
    assert st.step.tolist() == [s + 3 for s in steps]


def test_seeded_reproducible_and_batch_composition_independent():
    torch.manual_seed(4)
    V = 1000
    target = torch.randn(V)
    cfg = (0.9, 50, 0.9, 12345, 7)  # temperature, top_k, top_p, seed, step
    a = _st([cfg[0]], [cfg[1]], [cfg[2]], [cfg[3]], [cfg[4]])
    b = _st([cfg[0]], [cfg[1]], [cfg[2]], [cfg[3]], [cfg[4]])
    tok = _run(target[None], a)[0]
    assert _run(target[None], b)[0] == tok  # two calls, same state: same token
    for pos, B in ((0, 5), (3, 5), (9, 10)):
        others = torch.randn(B, V)
        others[pos] = target
        temps = [1.0] * B
        ks = [0] * B
        ps = [0.5] * B
        seeds = list(range(B))
        steps = [0] * B
        temps[pos], ks[pos], ps[pos], seeds[pos], steps[pos] = cfg
        assert _run(others, _st(temps, ks, ps, seeds, steps))[pos] == tok


def test_steps_and_seeds_give_different_draws():
    V = 4096
    u = uniforms(torch.zeros(50, dtype=torch.int64), torch.arange(50), V)
    assert len({tuple(r.tolist()) for r in u}) == 50
    logits = torch.zeros(1, V)  # uniform distribution over 4096 tokens
    st = _st([1.0], [0], [1.0], [42])
    toks = [int(_run(logits, st)[0]) for _ in range(20)]
    assert len(set(toks)) >= 15
    assert st.step.tolist() == [20]
    seeds = [int(_run(logits, _st([1.0], [0], [1.0], [s]))[0]) for s in range(20)]
    assert len(set(seeds)) >= 15


def test_uniforms_are_uniform():
    u = uniforms(torch.arange(200, dtype=torch.int64) * 7919, torch.arange(200, dtype=torch.int64), 1000)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 60  # df=19
    # neighbouring tokens / steps are uncorrelated
    assert abs(float(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1])) < 0.02
    assert abs(float(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1])) < 0.02


def _expected(logits, t, k, p):
    z = logits.double() / t
    if 0 < k < z.numel():
        kth = torch.sort(z, descending=True).values[k - 1]
        z = torch.where(z >= kth, z, torch.tensor(float("-inf"), dtype=z.dtype))
    probs = torch.softmax(z, 0)
    order = torch.argsort(probs, descending=True)
    before = torch.cumsum(probs[order], 0) - probs[order]
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[before < p]] = True
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.8, 6, 0.9)])
def test_distribution_matches_filtered_softmax(t, k, p):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 1.2, -3.0])
    V, N, S = 8, 4000, 5  # 4000 seeds x 5 steps
    expected = _expected(logits, t, k, p)
    st = _st([t] * N, [k] * N, [p] * N, [s * 1000003 + 17 for s in range(N)])
    counts = torch.zeros(V)
    batch = logits.expand(N, V).contiguous()
    for _ in range(S):
        counts += torch.bincount(_run(batch, st), minlength=V).float()
    total = N * S
    zero = expected == 0
    assert float(counts[zero].sum()) == 0.0, (counts, expected)
    exp = expected[~zero].float() * total
    chi2 = float(((counts[~zero] - exp) ** 2 / exp).sum())
    assert chi2 < 35, (chi2, counts / total, expected)  # df <= 7; p ~ 1e-5


def test_top_p_keeps_smallest_set_reaching_p():
    # probs 0.5, 0.3, 0.15, 0.05 (plus -inf noise-free), temperature 1
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs.log()[None].expand(64, 4).contiguous()

    def support(p):
        st = _st([1.0] * 64, [0] * 64, [p] * 64, list(range(64)))
        seen = set()
        for _ in range(8):
            seen |= set(_run(logits, st).tolist())
        return seen

    assert support(0.45) == {1}  # top-1 alone reaches p
    assert support(0.01) == {1}  # top-1 always kept
    assert support(0.55) == {1, 3}  # 0.5 < p -> add next
    assert support(0.79) == {1, 3}
    assert support(0.81) == {0, 1, 3}
    assert support(0.96) == {0, 1, 2, 3}


def test_top_k_keeps_ties_at_kth_value():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]]).expand(256, 5).contiguous()
    st = _st([1.0] * 256, [2] * 256, [1.0] * 256, list(range(256)))
    assert set(_run(logits, st).tolist()) == {0, 2, 3}


def test_top_k_then_top_p_order():
    # softmax: 0.380, 0.344, 0.140, 0.085, 0.051. top-k=3 renormalizes to 0.440, 0.398, 0.162,
    # so top-p 0.8 after top-k keeps {0, 1}; top-p on the full distribution would need {0, 1, 2}.
    logits = torch.tensor([2.0, 1.9, 1.0, 0.5, 0.0])
    batch = logits.expand(256, 5).contiguous()
    st = _st([1.0] * 256, [3] * 256, [0.8] * 256, list(range(256)))
    assert set(_run(batch, st).tolist()) == {0, 1}
    st = _st([1.0] * 256, [0] * 256, [0.8] * 256, list(range(256)))
    assert set(_run(batch, st).tolist()) == {0, 1, 2}


def test_apply_top_k_top_p_false_skips_filters():
    torch.manual_seed(5)
    logits = torch.randn(4, 50)
    st = _st([1.0] * 4, [0] * 4, [1.0] * 4, [1, 2, 3, 4])
    a = _run(logits, st, advance=False)
    b = _run(logits, st, apply_top_k_top_p=False, advance=False)
    assert torch.equal(a, b)
    assert st.step.tolist() == [0] * 4


def test_rows_view_of_larger_buffers():
    torch.manual_seed(6)
    st = SamplingTensors.allocate(16)
    fill_sampling_tensors(st, [SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, seed=s) for s in range(3)], 40)
    out = torch.empty(3, dtype=torch.int64)
    sample(torch.randn(3, 40), st, out)
    assert st.step.tolist() == [1, 1, 1] + [0] * 13


def test_torch_compile_fullgraph_no_graph_breaks():
    torch.manual_seed(7)
    logits = torch.randn(5, 64)
    st = _st([0.0, 1.0, 0.7, 1.2, 0.5], [0, 3, 0, 10, 64], [1.0, 1.0, 0.8, 0.9, 0.5], [1, 2, 3, 4, 5])
    st2 = _st([0.0, 1.0, 0.7, 1.2, 0.5], [0, 3, 0, 10, 64], [1.0, 1.0, 0.8, 0.9, 0.5], [1, 2, 3, 4, 5])
    torch._dynamo.reset()
    compiled = torch.compile(sample, fullgraph=True, backend="aot_eager")
    out = torch.empty(5, dtype=torch.int64)
    for _ in range(2):
        compiled(logits, st, out)
        assert torch.equal(out, _run(logits, st2))
    assert st.step.tolist() == [2] * 5


def test_no_host_sync_calls_in_sampling_path():
    path = [gs._mul32, gs._mix32, gs._row_keys, gs.uniforms, gs._apply_top_k_top_p, gs.sample,
            SamplingTensors.rows]
    for fn in path:
        src = inspect.getsource(fn)
        for bad in (".item(", ".tolist(", "nonzero(", ".cpu(", ".numpy(", "torch.multinomial",
                    "torch.Generator", "synchronize("):
            assert bad not in src, f"{bad} in {fn.__name__}"
        # no Python `if` on tensor values: the only ifs allowed test static arguments
        for cond in re.findall(r"^\s*if (.*):", src, flags=re.M):
            assert cond.strip() in {"apply_top_k_top_p", "advance",
                                    "out_tokens.shape != (batch,) or out_tokens.dtype != torch.int64"}, cond


def test_fill_sampling_tensors_and_validation():
    st = SamplingTensors.allocate(6)
    ps = [
        SimpleNamespace(temperature=0.0, top_k=5, top_p=0.5, seed=None),
        SimpleNamespace(temperature=0.8, top_k=-1, top_p=0.9, seed=2**64 - 1),
        SimpleNamespace(temperature=1.0, top_k=500, top_p=1.0, seed=-1),
        SimpleNamespace(temperature=1.0, top_k=7, top_p=1.0, seed=3, min_p=0.0, logits_processors=[]),
    ]
    fill_sampling_tensors(st, ps, 100, steps=[0, 4, 0, 9], rng=random.Random(1))
    assert st.temperature.tolist()[:4] == pytest.approx([0.0, 0.8, 1.0, 1.0])
    assert st.top_k.tolist() == [100, 100, 100, 7, 100, 100]
    assert st.top_p.tolist()[:4] == pytest.approx([1.0, 0.9, 1.0, 1.0])
    assert st.seed.tolist()[1] == -1 and st.seed.tolist()[3] == 3
    assert st.step.tolist() == [0, 4, 0, 9, 0, 0]
    assert st.temperature.tolist()[4:] == [0.0, 0.0]  # padding rows are greedy

    for field, value in [("min_p", 0.1), ("logits_processors", [object()]), ("presence_penalty", 0.5),
                         ("repetition_penalty", 1.1), ("logit_bias", {1: 2.0}), ("logprobs", 2),
                         ("top_p", 0.0), ("top_k", -2), ("temperature", float("nan")), ("seed", 1.5)]:
        p = SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, seed=None)
        setattr(p, field, value)
        with pytest.raises(ValueError, match=field) as e:
            fill_sampling_tensors(st, [p], 100)
        assert "supported options: temperature, top_k, top_p, seed" in str(e.value)


def test_fill_accepts_vllm_sampling_params():
    from vllm import SamplingParams

    st = SamplingTensors.allocate(2)
    fill_sampling_tensors(st, [SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=7),
                               SamplingParams(temperature=0.0)], 1000)
    assert st.top_k.tolist() == [20, 1000] and st.seed.tolist()[0] == 7
    with pytest.raises(ValueError, match="min_p"):
        fill_sampling_tensors(st, [SamplingParams(min_p=0.2)], 1000)


def test_top_k_off_values_map_to_vocab_size():
    """0, negative and >= V top-k values mean "off" (vLLM stores V): nothing is filtered."""
    torch.manual_seed(8)
    logits = torch.randn(3, 50)
    out = gs._apply_top_k_top_p(logits.clone(), torch.tensor([0, -1, 80], dtype=torch.int32), torch.ones(3))
    assert torch.equal(out, logits)
    out = gs._apply_top_k_top_p(logits.clone(), torch.tensor([1, 1, 1], dtype=torch.int32), torch.ones(3))
    assert torch.equal(torch.isfinite(out).sum(1), torch.ones(3, dtype=torch.long))
