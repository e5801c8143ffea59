"""kernels/decode_sample.py (issue 7, in-graph sampling): greedy rows equal stock's argmax exactly;
temperature rows pick the reference's best score (the same counter-based noise as
graph/sampler.py), the step counter advances, the noise follows the Gumbel law. On the GPU if
present, else under the Triton interpreter (small vocabularies)."""

from __future__ import annotations

import pytest
import torch

from vllm_sm121.kernels import decode_sample as ds

pytestmark = pytest.mark.interpreter


def _case(device, p, v, temps, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(p, v, generator=g) * 3).to(dtype)
    temperature = torch.tensor(temps, dtype=torch.float32)
    seeds = torch.randint(-(2**62), 2**62, (p,), generator=g, dtype=torch.int64)
    return logits.to(device), temperature.to(device), seeds.to(device)


@pytest.mark.parametrize("v", [5000, 4096 * 2 + 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_match_the_reference(device, v, dtype):
    temps = [0.0, 1.0, 0.7, 0.0, 2.0, 1e-6]
    logits, temperature, seeds = _case(device, len(temps), v, temps, dtype=dtype)
    step = torch.tensor([41], dtype=torch.int64, device=device)
    out = torch.full((8,), -1, dtype=torch.int32, device=device)
    ws = ds.workspace(8, v, device)
    for s in (41, 42, 43):
        ds.decode_sample(logits, temperature, seeds, step, out, ws)
        got = out[: len(temps)].cpu().long()
        scores = ds.decode_sample_scores_torch(logits.cpu(), temperature.cpu(), seeds.cpu(), s)
        best = scores.max(dim=-1).values
        picked = scores.gather(1, got[:, None])[:, 0]
        greedy = temperature.cpu() < ds.SAMPLING_EPS
        # greedy rows: exactly stock's argmax of the fp32 logits
        assert torch.equal(got[greedy], logits.cpu().float().argmax(dim=-1)[greedy])
        # temperature rows: the reference's best score (log may round differently: ties within 1e-5)
        assert torch.all(best - picked <= 1e-5 * best.abs().clamp(min=1)), (s, got, scores.argmax(-1))
        assert int(step.item()) == s + 1
    assert torch.all(out[len(temps):].cpu() == -1)  # rows beyond P untouched


def test_ties_take_the_lowest_index_across_blocks(device):
    v = ds.BLOCK * 3
    logits = torch.zeros(2, v, device=device)
    logits[:, 5] = 1.0
    logits[:, ds.BLOCK + 7] = 1.0  # the same maximum in a later block
    logits[1, 5] = 0.5
    temperature = torch.zeros(2, device=device)
    out = torch.empty(2, dtype=torch.int64, device=device)
    ds.decode_sample(logits, temperature, torch.zeros(2, dtype=torch.int64, device=device),
                     torch.zeros(1, dtype=torch.int64, device=device), out)
    assert out.cpu().tolist() == [5, ds.BLOCK + 7]


def test_noise_follows_the_gumbel_law(device):
    """Temperature rows over uniform logits: every token equally likely (chi-square over 16
    tokens, 2,000 draws with fresh steps: p > 1e-4 when correct), and different seeds give
    different draws at the same step."""
    v, draws = 16, 2000
    logits = torch.zeros(1, v, device=device)
    temperature = torch.ones(1, device=device)
    seeds = torch.tensor([123456789], dtype=torch.int64, device=device)
    step = torch.zeros(1, dtype=torch.int64, device=device)
    out = torch.empty(1, dtype=torch.int64, device=device)
    ws = ds.workspace(1, v, device)
    counts = torch.zeros(v)
    for _ in range(draws):
        ds.decode_sample(logits, temperature, seeds, step, out, ws)
        counts[int(out.item())] += 1
    expected = draws / v
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 50.0, counts  # 15 degrees of freedom: P(chi2 > 50) ~ 1e-5
    two, out2 = torch.zeros(2, 4096, device=device), torch.empty(2, dtype=torch.int64, device=device)
    many = set()
    for s in range(8):
        seeds2 = torch.tensor([s, s + 1000], dtype=torch.int64, device=device)
        ds.decode_sample(two, torch.ones(2, device=device), seeds2, torch.zeros(1, dtype=torch.int64, device=device), out2)
        many.add(tuple(out2.cpu().tolist()))
    assert len(many) == 8 and all(a != b for a, b in many)  # 4096 tokens: a collision is ~1e-3 likely per pair


# (temperature, top_k, top_p): off rows, top-k alone, top-p alone, both, greedy with options (ignored)
FILTER_ROWS = [(1.0, 0, 1.0), (0.8, 5, 1.0), (1.0, 0, 0.9), (0.5, 40, 0.7), (0.0, 5, 0.5), (2.0, 1, 1.0),
               (1.0, 0, 0.05), (1.0, 3000, 0.999)]


def _filter_case(device, v=3000, seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(len(FILTER_ROWS), v, generator=g) * 4).to(device)
    temperature = torch.tensor([r[0] for r in FILTER_ROWS], dtype=torch.float32, device=device)
    top_k = torch.tensor([r[1] for r in FILTER_ROWS], dtype=torch.int32, device=device)
    top_p = torch.tensor([r[2] for r in FILTER_ROWS], dtype=torch.float32, device=device)
    return logits, temperature, top_k, top_p


def test_thresholds_keep_what_vllms_filter_keeps(device):
    """The threshold kernel's kept set equals vLLM's apply_top_k_top_p on the scaled logits (greedy
    rows keep everything: their options are ignored, as stock's greedy path does)."""
    logits, temperature, top_k, top_p = _filter_case(device)
    ws = ds.workspace(len(FILTER_ROWS), logits.shape[1], device)
    got = ds.kept(logits, temperature, top_k, top_p, ws).cpu()
    want = ds.kept_torch(logits.cpu(), temperature.cpu(), top_k.cpu(), top_p.cpu())
    greedy = temperature.cpu() < ds.SAMPLING_EPS
    assert torch.equal(got[~greedy], want[~greedy]), [(i, int(got[i].sum()), int(want[i].sum()))
                                                     for i in range(len(FILTER_ROWS))]
    assert got[greedy].all()
    counts = got.sum(-1).tolist()
    assert counts[0] == logits.shape[1] and counts[1] == 5 and counts[5] == 1 and 1 <= counts[6] < 50


def _kept_like_vllm(got, want, logits, temperature, exact: bool):
    """``got`` keeps what vLLM's filter keeps; with 16-bit logits also, at the top-p cut, the rest
    of a group of equal values (vLLM's sort keeps part of it), nothing else. Greedy rows: all."""
    greedy = temperature < ds.SAMPLING_EPS
    assert got[greedy].all()
    for r in torch.nonzero(~greedy).flatten().tolist():
        if exact:
            assert torch.equal(got[r], want[r]), (r, int(got[r].sum()), int(want[r].sum()))
        else:
            assert torch.all(got[r] | ~want[r]), f"row {r}: the kernel dropped a value vLLM keeps"
            extra = got[r] & ~want[r]
            if extra.any():
                assert torch.all(logits[r][extra] == logits[r][want[r]].min()), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_thresholds_across_chunks_and_dtypes(device, dtype):
    """Several chunks per row (every pass reduces the chunks' partials), 16-bit keys for bf16 /
    fp16 logits and 32-bit for fp32: vLLM's kept sets; -inf entries (masked tokens) and a top-k
    tie group spread over the chunks included; the same thresholds for a row alone and in the
    batch, and on a second run over a reused workspace (no state leaks between calls)."""
    v = ds.BLOCK + 1234
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(len(FILTER_ROWS), v, generator=g) * 4).to(dtype).float()
    logits[2, ::7] = float("-inf")
    logits[1, torch.randperm(v, generator=g)[:9]] = 30.0  # nine tie for the largest, top-k 5 keeps all nine
    logits = logits.to(dtype).to(device)
    temperature = torch.tensor([r[0] for r in FILTER_ROWS], dtype=torch.float32, device=device)
    top_k = torch.tensor([r[1] for r in FILTER_ROWS], dtype=torch.int32, device=device)
    top_p = torch.tensor([r[2] for r in FILTER_ROWS], dtype=torch.float32, device=device)
    ws = ds.workspace(len(FILTER_ROWS), v, device)
    got = ds.kept(logits, temperature, top_k, top_p, ws).cpu()
    want = ds.kept_torch(logits.cpu(), temperature.cpu(), top_k.cpu(), top_p.cpu())
    _kept_like_vllm(got, want, logits.cpu().float(), temperature.cpu(), exact=dtype == torch.float32)
    assert int(got[1].sum()) == 9
    thr = ws[2][: len(FILTER_ROWS)].clone()
    # a reused workspace after other options, then each row alone: the same thresholds
    ds.kept(logits.flip(0), temperature.flip(0), top_k.flip(0), top_p.flip(0), ws)
    assert torch.equal(ds.kept(logits, temperature, top_k, top_p, ws).cpu(), got)
    one = ds.workspace(1, v, device)
    for r in (3, 6):
        ds.kept(logits[r:r + 1], temperature[r:r + 1], top_k[r:r + 1], top_p[r:r + 1], one)
        assert one[2][0] == thr[r], r


def test_temperature_merging_distinct_logits_ties_them(device):
    """A huge temperature divides distinct tiny logits to the same scaled value (0): the filter
    works on the scaled logits, so they tie there (vLLM's rule: top-k keeps both)."""
    logits = torch.tensor([[5.0, 3.0, 1e-30, 2e-30, -1.0, -2.0, -3.0, -4.0]], device=device)
    t = torch.tensor([1e20], device=device)
    for k in (3, 4):
        top_k = torch.tensor([k], dtype=torch.int32, device=device)
        got = ds.kept(logits, t, top_k, torch.ones(1, device=device), ds.workspace(1, 8, device)).cpu()
        want = ds.kept_torch(logits.cpu(), t.cpu(), top_k.cpu(), torch.ones(1))
        assert torch.equal(got, want) and got[0].tolist() == [True] * 4 + [False] * 4, (k, got)


def test_ties_at_the_top_k_value_are_kept_like_vllm(device):
    logits = torch.zeros(1, 100, device=device)
    logits[0, 10:20] = 2.0  # ten tokens tie for the largest value; top-k 3 keeps all ten (vLLM's rule)
    one = torch.ones(1, device=device)
    ws = ds.workspace(1, 100, device)
    got = ds.kept(logits, one, torch.tensor([3], dtype=torch.int32, device=device), one, ws).cpu()
    assert got[0].sum() == 10 and got[0, 10:20].all()
    want = ds.kept_torch(logits.cpu(), one.cpu(), torch.tensor([3], dtype=torch.int32), one.cpu())
    assert torch.equal(got, want)


@pytest.mark.parametrize("p", [1e-9, 5e-8, 1e-3])
def test_a_tiny_top_p_keeps_the_largest(device, p):
    """vLLM always keeps the largest value; with p below ~1e-7, (1 - p) * mass rounds to the mass."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(1, 5000, generator=g) * 2).to(device)
    one = torch.ones(1, device=device)
    ws = ds.workspace(1, 5000, device)
    got = ds.kept(logits, one, torch.zeros(1, dtype=torch.int32, device=device),
                  torch.tensor([p], dtype=torch.float32, device=device), ws).cpu()
    assert got[0].sum() == 1 and got[0, logits[0].cpu().argmax()]
    out = torch.empty(1, dtype=torch.int64, device=device)
    ds.decode_sample(logits, one, torch.ones(1, dtype=torch.int64, device=device),
                     torch.zeros(1, dtype=torch.int64, device=device), out, ws,
                     top_k=torch.zeros(1, dtype=torch.int32, device=device),
                     top_p=torch.tensor([p], dtype=torch.float32, device=device))
    assert out.item() == logits[0].cpu().argmax().item()


def test_bf16_ties_at_the_top_p_cut_are_kept_whole(device):
    """bf16 logits tie often: the kernel keeps every value vLLM keeps, plus, at the top-p cut,
    the rest of a group of equal values (vLLM's sort keeps part of it); the extra mass is small."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 6000, generator=g) * 2).to(torch.bfloat16).to(device)
    one = torch.ones(2, device=device)
    top_k = torch.zeros(2, dtype=torch.int32, device=device)
    top_p = torch.tensor([0.9, 0.5], dtype=torch.float32, device=device)
    got = ds.kept(logits, one, top_k, top_p, ds.workspace(2, 6000, device)).cpu()
    want = ds.kept_torch(logits.cpu(), one.cpu(), top_k.cpu(), top_p.cpu())
    assert torch.all(got | ~want), "the kernel dropped a value vLLM keeps"
    probs = logits.cpu().float().softmax(-1)
    extra = (probs * (got & ~want)).sum(-1)
    assert torch.all(extra < 0.01), extra
    # the extra entries all tie with the smallest value vLLM keeps
    for r in range(2):
        if (got[r] & ~want[r]).any():
            floor = logits[r].cpu()[want[r]].min()
            assert torch.all(logits[r].cpu()[got[r] & ~want[r]] == floor)


def test_tokens_with_top_k_top_p_match_the_reference(device):
    logits, temperature, top_k, top_p = _filter_case(device)
    p = len(FILTER_ROWS)
    seeds = torch.arange(p, dtype=torch.int64, device=device) * 7919 + 3
    step = torch.tensor([5], dtype=torch.int64, device=device)
    out = torch.empty(p, dtype=torch.int64, device=device)
    ws = ds.workspace(p, logits.shape[1], device)
    for s in (5, 6):
        ds.decode_sample(logits, temperature, seeds, step, out, ws, top_k=top_k, top_p=top_p)
        scores = ds.decode_sample_scores_torch(logits.cpu(), temperature.cpu(), seeds.cpu(), s, top_k.cpu(), top_p.cpu())
        got = out.cpu()
        picked = scores.gather(1, got[:, None])[:, 0]
        assert torch.isfinite(picked).all(), got  # never a token the filter dropped
        best = scores.max(-1).values
        assert torch.all(best - picked <= 1e-5 * best.abs().clamp(min=1)), (s, got, scores.argmax(-1))
    assert out[5].item() == logits[5].cpu().argmax().item()  # top-k 1: the largest


def test_bad_inputs_are_named():
    logits = torch.zeros(2, 100)
    t, s, st = torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    out = torch.empty(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="temperature"):
        ds.decode_sample(logits, torch.zeros(2, dtype=torch.float64), s, st, out)
    with pytest.raises(ValueError, match="seeds"):
        ds.decode_sample(logits, t, torch.zeros(1, dtype=torch.int64), st, out)
    with pytest.raises(ValueError, match="step"):
        ds.decode_sample(logits, t, s, torch.zeros(2, dtype=torch.int64), out)
    with pytest.raises(ValueError, match="workspace"):
        ds.decode_sample(logits, t, s, st, out, ds.workspace(2, 5000, "cpu"))
    with pytest.raises(ValueError, match="logits"):
        ds.decode_sample(logits.t(), t, s, st, out)
    with pytest.raises(ValueError, match="come together"):
        ds.decode_sample(logits, t, s, st, out, top_k=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="top_p"):
        ds.decode_sample(logits, t, s, st, out, top_k=torch.zeros(2, dtype=torch.int32), top_p=torch.ones(2, dtype=torch.float64))



@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU dry run; on a GPU host the samplebench step times the real thing")
def test_benchmark_dry_run(tmp_path):
    """benchmarks/sample.py --dry-run: the sm121 provider on a tiny vocabulary under the
    interpreter, JSON written (the GPU run times it against stock's ops)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "sample.json"
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "sample.py"), "--dry-run", "--rows", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    recs = json.loads(out.read_text())["records"]
    assert {x["case"] for x in recs} == {"greedy", "temperature", "topk_topp"}
