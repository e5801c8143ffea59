"""Paged attention kernel vs the torch reference, on dequantized inputs (tolerance = kernel error).

CPU (Triton interpreter, marked ``interpreter``): a reduced sweep on tiny shapes.
GPU (marked ``gpu``): the full sweep — decode, prefill, mixed, spec-verify (q_len 2-8); lengths
crossing block boundaries and the window edge; head sizes 64/128; GQA 1/8; window none/128;
soft-cap none/30; scale 1/8 and 1/11.3; sinks none/random; KV bf16/fp8; split-KV on and off.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools

import pytest
import torch

from helpers import FP8, assert_close, make_paged_batch
from vllm_sm121.kernels import SplitWorkspace, paged_attention, paged_attention_torch
from vllm_sm121.platform import AttnTile


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # decode | prefill | mixed | verify
    seq_lens: tuple[int, ...]
    head_size: int = 64
    gqa: int = 8  # q heads per kv head
    num_kv_heads: int = 2
    block_size: int = 16
    window: int | None = None
    softcap: float | None = None
    scale: float = 0.125
    sinks: bool = False
    kv_dtype: torch.dtype = torch.bfloat16
    num_splits: int | None = None  # None: the launcher's heuristic
    verify_len: int = 4

    def q_lens(self) -> list[int]:
        if self.kind == "decode":
            return [1] * len(self.seq_lens)
        if self.kind == "prefill":
            return list(self.seq_lens)
        if self.kind == "verify":
            return [min(self.verify_len, s) for s in self.seq_lens]
        # mixed: decodes first (vLLM reorders them so), then a chunk with context, then a prefill
        n = len(self.seq_lens)
        return [1 if i < n - 2 else (min(s, 9) if i == n - 2 else s) for i, s in enumerate(self.seq_lens)]

    def __str__(self):
        kv = "fp8" if self.kv_dtype == FP8 else "bf16"
        return (f"{self.kind}-L{'/'.join(map(str, self.seq_lens))}-d{self.head_size}-g{self.gqa}-bs{self.block_size}"
                f"-w{self.window}-cap{self.softcap}-s{self.scale:.3g}-sink{int(self.sinks)}-{kv}-split{self.num_splits}")


def run_case(case: Case, device: str, seed: int = 0):
    b = make_paged_batch(
        case.q_lens(), list(case.seq_lens), num_q_heads=case.gqa * case.num_kv_heads,
        num_kv_heads=case.num_kv_heads, head_size=case.head_size, block_size=case.block_size,
        kv_dtype=case.kv_dtype, sliding_window=case.window, pad_tokens=3, device=device, seed=seed,
    )
    sinks = None
    if case.sinks:
        g = torch.Generator().manual_seed(seed + 1)
        sinks = (torch.randn(case.gqa * case.num_kv_heads, generator=g) * 2).to(device)
    kw = dict(scale=case.scale, sliding_window=case.window, softcap=case.softcap, sinks=sinks,
              k_scale=b.k_scale, v_scale=b.v_scale)
    sentinel = torch.full_like(b.q, 7.0)
    out = paged_attention(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens,
                          max_query_len=b.max_query_len, max_seq_len=b.max_seq_len, out=sentinel.clone(),
                          num_splits=case.num_splits, **kw)
    ref = paged_attention_torch(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens, **kw)
    n = int(b.query_start_loc[-1])
    assert_close(out[:n], ref[:n], what=str(case))
    # Graph-padding rows past the last real token are never written.
    assert torch.equal(out[n:], sentinel[n:]), f"{case}: padding rows were written"


# --------------------------------------------------------------------------------------- CPU sweep
CPU_CASES = [
    Case("decode", (1, 17, 33), gqa=4),
    Case("decode", (15, 16, 17), gqa=1, num_kv_heads=3, sinks=True),
    Case("prefill", (5, 16, 21), gqa=2),
    Case("mixed", (20, 31, 12, 18), gqa=4, window=8, sinks=True),
    Case("verify", (9, 16, 40), gqa=8, num_kv_heads=1, verify_len=3, softcap=30.0, scale=1 / 11.3),
    Case("decode", (40, 47), gqa=4, window=16, kv_dtype=FP8, sinks=True),
    Case("prefill", (33,), gqa=1, window=16, kv_dtype=FP8, softcap=30.0),
    Case("decode", (48, 70), gqa=4, num_splits=4, sinks=True),
    Case("verify", (30, 64), gqa=4, num_splits=2, window=16, kv_dtype=FP8, verify_len=2),
    Case("mixed", (33, 17, 40), head_size=128, gqa=2, block_size=32, num_splits=2),
    Case("decode", (20,), head_size=80, gqa=2, block_size=16),  # non-power-of-two head size
]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_paged_attention_cpu(case, device):
    run_case(case, device)  # the reduced sweep; on a GPU machine it runs there too


# --------------------------------------------------------------------------------------- GPU sweep
def _gpu_cases() -> list[Case]:
    lens = {
        "decode": [(127, 128, 129, 15, 16, 17, 1, 1000)],
        "prefill": [(127, 128, 129), (17, 300)],
        "mixed": [(127, 129, 1000, 16, 300, 128)],
        "verify": [(127, 128, 129, 17, 700)],
    }
    cases = []
    flags = itertools.cycle(itertools.product([None, 30.0], [0.125, 1 / 11.3], [False, True]))
    for kind, head, gqa, window, kv in itertools.product(
        lens, (64, 128), (1, 8), (None, 128), (torch.bfloat16, FP8)
    ):
        for seq_lens in lens[kind]:
            softcap, scale, sinks = next(flags)
            cases.append(Case(kind, seq_lens, head_size=head, gqa=gqa, window=window, kv_dtype=kv,
                              softcap=softcap, scale=scale, sinks=sinks, verify_len=2 + len(cases) % 7))
    # Every soft-cap x scale x sinks combination on the gpt-oss layer shape, both window kinds.
    for softcap, scale, sinks, window in itertools.product([None, 30.0], [0.125, 1 / 11.3], [False, True], [None, 128]):
        cases.append(Case("mixed", (129, 17, 1000, 300), gqa=8, num_kv_heads=8, window=window,
                          softcap=softcap, scale=scale, sinks=sinks))
    # Block sizes +-1 around the boundary and the page size itself; split-KV forced.
    for bs in (16, 32, 64):
        cases.append(Case("decode", (bs - 1, bs, bs + 1, 3 * bs), block_size=bs, window=128, sinks=True))
    for splits in (2, 8, 32):
        cases.append(Case("decode", (4000, 129, 1), num_kv_heads=8, num_splits=splits, sinks=True, window=None))
        cases.append(Case("verify", (4000, 300), num_kv_heads=8, num_splits=splits, sinks=True, window=128,
                          verify_len=8, kv_dtype=FP8))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=str)
def test_paged_attention_gpu(case):
    run_case(case, "cuda")


class _NotLaunched:
    """Stands in for a kernel whose launch is a test failure."""

    def __getitem__(self, grid):
        raise AssertionError("the split merge was launched")


@pytest.mark.interpreter
@pytest.mark.parametrize("q_lens,seq_lens,splits,window,kv_dtype,sinks", [
    ((1, 1, 1), (1, 200, 40), 8, None, torch.bfloat16, True),  # short contexts: most splits see no KV
    ((1, 1), (300, 7), 4, 16, FP8, True),  # window: the live splits cover only the window's tiles
    ((3, 2), (90, 64), 2, None, torch.bfloat16, False),  # spec-verify rows
    ((0, 1), (5, 70), 4, None, torch.bfloat16, True),  # an empty (padded) request
    ((1, 1), (1100, 90), 64, None, torch.bfloat16, True),  # gpt-oss-120b's graph split count: all live / few
])
def test_fused_split_merge_equals_the_merge_launch(device, q_lens, seq_lens, splits, window, kv_dtype, sinks,
                                                   monkeypatch):
    """By default the split program of each query tile that finishes last merges the partials (no
    ``_combine_splits_kernel`` launch): the same output as the merge launch (fp32 sums in another
    order, so to rounding), the reference's within the kernel's tolerance, padding rows untouched,
    and every arrival counter back at 0 for the next launch (a replayed graph)."""
    PA = importlib.import_module("vllm_sm121.kernels.paged_attention")  # the module (the package exports the function)

    b = make_paged_batch(list(q_lens), list(seq_lens), num_q_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                         kv_dtype=kv_dtype, sliding_window=window, pad_tokens=2, device=device, seed=3)
    sink = torch.randn(8, generator=torch.Generator().manual_seed(4)).to(device) if sinks else None
    kw = dict(scale=0.125, sliding_window=window, sinks=sink, k_scale=b.k_scale, v_scale=b.v_scale)
    ws = SplitWorkspace.allocate(b.q.shape[0], 8, splits, 64, device)
    sentinel = torch.full_like(b.q, 7.0)

    def run():
        return paged_attention(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens,
                               max_query_len=b.max_query_len, max_seq_len=b.max_seq_len, out=sentinel.clone(),
                               num_splits=splits, workspace=ws, **kw)

    monkeypatch.setenv(PA.ATTN_FUSED_COMBINE_ENV, "0")
    launched = run()
    monkeypatch.delenv(PA.ATTN_FUSED_COMBINE_ENV)
    with monkeypatch.context() as mp:
        mp.setattr(PA, "_combine_splits_kernel", _NotLaunched())
        fused = run()
        assert int(ws.cnt.abs().sum()) == 0
        fused_again = run()  # the counters were reset: a second launch merges again
    n = int(b.query_start_loc[-1])
    torch.testing.assert_close(fused[:n].float(), launched[:n].float(), rtol=1e-2, atol=2e-3)
    assert torch.equal(fused, fused_again)
    assert torch.equal(fused[n:], sentinel[n:]), "padding rows were written"
    ref = paged_attention_torch(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens, **kw)
    assert_close(fused[:n], ref[:n], what="fused merge")
    # A workspace without counters takes the merge launch; wrong counters are refused by name.
    no_cnt = SplitWorkspace(acc=ws.acc, ml=ws.ml)
    out = paged_attention(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens,
                          max_query_len=b.max_query_len, max_seq_len=b.max_seq_len, num_splits=splits,
                          workspace=no_cnt, **kw)
    torch.testing.assert_close(out[:n].float(), launched[:n].float(), rtol=0, atol=0)
    bad = SplitWorkspace(acc=ws.acc, ml=ws.ml, cnt=ws.cnt.float())
    with pytest.raises(ValueError, match="workspace.cnt must be int32"):
        paged_attention(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens,
                        max_query_len=b.max_query_len, max_seq_len=b.max_seq_len, num_splits=splits,
                        workspace=bad, **kw)


@pytest.mark.interpreter
@pytest.mark.parametrize("seq_lens,window,kv_dtype,sinks", [
    ((1, 20, 32, 33), None, torch.bfloat16, True),  # one KV tile (the interpreter's 32 tokens) or two
    ((310, 45), 16, FP8, True),  # a sliding window inside one tile, and one across two
    ((32, 64), None, torch.bfloat16, False),
])
def test_single_live_split_finishes_its_rows(device, seq_lens, window, kv_dtype, sinks, monkeypatch):
    """Under the fused merge, a query tile whose KV fits one split (a short context under a graph
    captured with many splits) is finished by that split: no partials are stored for it (its
    workspace rows keep the NaN put there), and its output has exactly the bits the merge launch
    gives, as the tiles that still merge several splits do to rounding."""
    PA = importlib.import_module("vllm_sm121.kernels.paged_attention")

    n = len(seq_lens)
    b = make_paged_batch([1] * n, list(seq_lens), num_q_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                         kv_dtype=kv_dtype, sliding_window=window, device=device, seed=9)
    sink = torch.randn(8, generator=torch.Generator().manual_seed(10)).to(device) if sinks else None
    kw = dict(scale=0.125, sliding_window=window, sinks=sink, k_scale=b.k_scale, v_scale=b.v_scale)
    splits, tile_n = 8, 32
    ws = SplitWorkspace.allocate(n, 8, splits, 64, device)

    def run():
        return paged_attention(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens,
                               max_query_len=1, max_seq_len=b.max_seq_len, num_splits=splits, workspace=ws,
                               tile=AttnTile(16, tile_n, 4, 1), **kw)

    visible = [min(s, window) if window else s for s in seq_lens]
    first = [max(s - window, 0) if window else 0 for s in seq_lens]
    tiles = [-(-(f + v) // tile_n) - f // tile_n for f, v in zip(first, visible)]
    single = [t == 1 for t in tiles]
    assert any(single) and not all(single)
    monkeypatch.setenv(PA.ATTN_FUSED_COMBINE_ENV, "0")
    launched = run()
    monkeypatch.delenv(PA.ATTN_FUSED_COMBINE_ENV)
    ws.acc.fill_(float("nan"))
    ws.ml.fill_(float("nan"))
    fused = run()
    assert int(ws.cnt.abs().sum()) == 0
    for t, one in enumerate(single):
        if one:
            assert torch.isnan(ws.acc[t]).all() and torch.isnan(ws.ml[t]).all(), f"token {t}: partials stored"
            assert torch.equal(fused[t], launched[t]), f"token {t}: not the merge's bits"
        else:
            assert not torch.isnan(ws.ml[t]).all(), f"token {t}: {tiles[t]} tiles but no partials"
            torch.testing.assert_close(fused[t].float(), launched[t].float(), rtol=1e-2, atol=2e-3)
    ref = paged_attention_torch(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens, **kw)
    assert_close(fused, ref, what="single live split")
    # $VLLM_SM121_ATTN_ONE_SPLIT_FINISH=0 (A/B runs): every tile merges again, to the same bits.
    monkeypatch.setenv(PA.ATTN_ONE_SPLIT_FINISH_ENV, "0")
    ws.ml.fill_(float("nan"))
    merged = run()
    assert not torch.isnan(ws.ml[single.index(True)]).all(), "the switch did not bring the merge back"
    assert torch.equal(merged, fused) and int(ws.cnt.abs().sum()) == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("min_tokens", [48, 100])
@pytest.mark.parametrize("q_lens,seq_lens,splits,window", [
    ((1, 1, 1), (1, 200, 40), 8, None),
    ((1, 1), (300, 7), 4, 16),
    ((1, 1), (1100, 90), 64, None),  # the graph's 64 splits: 1100 tokens on few live splits
])
def test_min_split_tokens_keep_the_output(device, q_lens, seq_lens, splits, window, min_tokens, monkeypatch):
    """$VLLM_SM121_ATTN_MIN_SPLIT_TOKENS puts short contexts on fewer live splits: the fused merge and
    the merge launch both give the reference's output (and the counters end at 0)."""
    PA = importlib.import_module("vllm_sm121.kernels.paged_attention")

    b = make_paged_batch(list(q_lens), list(seq_lens), num_q_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                         kv_dtype=torch.bfloat16, sliding_window=window, device=device, seed=5)
    sink = torch.randn(8, generator=torch.Generator().manual_seed(6)).to(device)
    kw = dict(scale=0.125, sliding_window=window, sinks=sink, k_scale=b.k_scale, v_scale=b.v_scale)
    ws = SplitWorkspace.allocate(b.q.shape[0], 8, splits, 64, device)
    monkeypatch.setenv(PA.ATTN_MIN_SPLIT_TOKENS_ENV, str(min_tokens))
    ref = paged_attention_torch(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens, **kw)
    n = int(b.query_start_loc[-1])
    for fused in ("1", "0"):
        monkeypatch.setenv(PA.ATTN_FUSED_COMBINE_ENV, fused)
        out = paged_attention(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens,
                              max_query_len=b.max_query_len, max_seq_len=b.max_seq_len, num_splits=splits,
                              workspace=ws, **kw)
        assert_close(out[:n], ref[:n], what=f"min split tokens {min_tokens}, fused merge {fused}")
    assert int(ws.cnt.abs().sum()) == 0
    monkeypatch.setenv(PA.ATTN_MIN_SPLIT_TOKENS_ENV, "-1")
    with pytest.raises(ValueError, match=PA.ATTN_MIN_SPLIT_TOKENS_ENV):
        PA.min_split_tiles(16)


def test_fused_split_merge_switch(monkeypatch):
    """$VLLM_SM121_ATTN_FUSED_COMBINE: on unless 0; anything but an integer is refused by name."""
    PA = importlib.import_module("vllm_sm121.kernels.paged_attention")  # the module (the package exports the function)

    monkeypatch.delenv(PA.ATTN_FUSED_COMBINE_ENV, raising=False)
    assert PA.attn_fused_combine()
    monkeypatch.setenv(PA.ATTN_FUSED_COMBINE_ENV, "0")
    assert not PA.attn_fused_combine()
    monkeypatch.setenv(PA.ATTN_FUSED_COMBINE_ENV, "yes")
    with pytest.raises(ValueError, match="VLLM_SM121_ATTN_FUSED_COMBINE"):
        PA.attn_fused_combine()


@pytest.mark.gpu
def test_long_context_split_matches_unsplit():
    """32k-token decode at batch 1: the split-KV path (auto) matches the single-pass kernel."""
    case = Case("decode", (32768,), num_kv_heads=8, sinks=True)
    b = make_paged_batch(case.q_lens(), list(case.seq_lens), num_q_heads=64, num_kv_heads=8, head_size=64,
                         block_size=16, device="cuda")
    sinks = torch.randn(64, device="cuda")
    args = (b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens)
    kw = dict(max_query_len=1, max_seq_len=32768, scale=0.125, sinks=sinks)
    ws = SplitWorkspace.allocate(1, 64, 32, 64, "cuda")
    split = paged_attention(*args, num_splits=32, workspace=ws, **kw)
    single = paged_attention(*args, num_splits=1, **kw)
    ref = paged_attention_torch(*args, scale=0.125, sinks=sinks)
    assert_close(split, ref, what="split")
    assert_close(single, ref, what="single")


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_metadata():
    """Captured once, replayed with other lengths written into the same buffers: still correct."""
    torch.manual_seed(0)
    # Every page real (no null blocks): the replay below moves the lengths, and with them the window.
    b = make_paged_batch([1, 1, 1, 1], [1000, 40, 129, 7], num_q_heads=64, num_kv_heads=8, head_size=64,
                         block_size=16, device="cuda")
    sinks = torch.randn(64, device="cuda")
    out = torch.empty_like(b.q)
    ws = SplitWorkspace.allocate(b.q.shape[0], 64, 8, 64, "cuda")
    seq_lens = b.seq_lens.clone()

    def step():
        paged_attention(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, seq_lens,
                        max_query_len=1, max_seq_len=1024, scale=0.125, sliding_window=128, sinks=sinks,
                        out=out, num_splits=8, workspace=ws)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([1000, 40, 129, 7], [513, 1, 128, 1000]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_torch(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, seq_lens,
                                    scale=0.125, sliding_window=128, sinks=sinks)
        assert_close(out[:4], ref[:4], what=f"graph replay {lens}")


# --------------------------------------------------------------------------------------- bad input
def _good_args(**over):
    b = make_paged_batch([1, 2], [5, 9], num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    args = dict(q=b.q, key_cache=b.key_cache, value_cache=b.value_cache, block_table=b.block_table,
                query_start_loc=b.query_start_loc, seq_lens=b.seq_lens)
    kw = dict(max_query_len=2, max_seq_len=9, scale=0.125)
    for k, v in over.items():
        (args if k in args else kw)[k] = v(args) if callable(v) else v
    return args, kw


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(q=lambda a: a["q"].float()), r"q.dtype=float32 is not supported; supported: bfloat16, float16"),
        (dict(q=lambda a: a["q"][..., :48].contiguous(), key_cache=lambda a: a["key_cache"][..., :48].contiguous(),
              value_cache=lambda a: a["value_cache"][..., :48].contiguous()), r"head_size=48 is not supported"),
        (dict(key_cache=lambda a: a["key_cache"][:, :, :8].contiguous(),
              value_cache=lambda a: a["value_cache"][:, :, :8].contiguous()), r"block_size=8 is not supported"),
        (dict(key_cache=lambda a: a["key_cache"].half(), value_cache=lambda a: a["value_cache"].half()),
         r"key_cache.dtype=torch.float16 must equal q.dtype"),
        (dict(q=lambda a: a["q"][:, :3].contiguous()), r"num_q_heads=3 must be a multiple of num_kv_heads=2"),
        (dict(seq_lens=lambda a: a["seq_lens"][:1]), r"need num_seqs \+ 1 = 2"),
        (dict(block_table=lambda a: a["block_table"].long()), r"block_table.dtype=int64 is not supported"),
        (dict(sinks=torch.zeros(3)), r"sinks must have shape \[num_q_heads=4\]"),
        (dict(sliding_window=0), r"sliding_window=0 must be a positive int"),
        (dict(num_splits=3), r"num_splits=3 is not supported"),
        (dict(q=lambda a: a["q"][:, :, :64:2]), r"head_size=32|must be contiguous"),
    ],
)
def test_paged_attention_bad_input(over, match):
    args, kw = _good_args(**over)
    with pytest.raises(ValueError, match=match):
        paged_attention(**args, **kw)


def test_fp8_cache_needs_scales():
    args, kw = _good_args(key_cache=lambda a: a["key_cache"].nan_to_num().to(FP8),
                          value_cache=lambda a: a["value_cache"].nan_to_num().to(FP8))
    with pytest.raises(ValueError, match="k_scale and v_scale are required"):
        paged_attention(**args, **kw)


@pytest.mark.interpreter
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_unchecked_launch_matches_checked(kv_dtype, device):
    b = make_paged_batch([1, 3], [20, 9], num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16, kv_dtype=kv_dtype,
                         device=device)
    args = (b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens)
    kw = dict(max_query_len=3, max_seq_len=20, scale=0.125, sinks=torch.randn(4, device=device), k_scale=b.k_scale,
              v_scale=b.v_scale)
    assert torch.equal(paged_attention(*args, **kw), paged_attention(*args, check=False, **kw))


@pytest.mark.interpreter
@pytest.mark.parametrize("q_lens,seq_lens", [((1, 0, 1, 1), (5, 0, 17, 33)), ((1,) * 20, tuple(range(3, 23)))],
                         ids=["padded-request", "20-sequences"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_sequence_lookup_with_empty_requests_and_wide_batches(q_lens, seq_lens, num_splits, device):
    """Decode batches find each program's sequence by loading the per-sequence lists whole
    (``_locate``, SEQ_CHUNK 16 and 32 here): a request with no query tokens (vLLM's graph padding)
    owns no program, and batches wider than 16 sequences take the next list size."""
    b = make_paged_batch(list(q_lens), list(seq_lens), num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                         device=device)
    kw = dict(max_query_len=1, max_seq_len=max(seq_lens), scale=0.125)
    out = paged_attention(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens,
                          num_splits=num_splits, **kw)
    ref = paged_attention_torch(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens, **kw)
    n = int(b.query_start_loc[-1])
    assert_close(out[:n], ref[:n], what=f"{q_lens} splits {num_splits}")
