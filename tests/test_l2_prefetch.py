"""L2 prefetch of the next GEMV's weights (``kernels/l2_prefetch.py``, ``vllm_sm121/l2_plan.py``).

CPU: the option's parsing and errors, the launch arguments (off on the interpreter), the per-block
registry (which kernel prefetches which weight; weak references; no module re-registered), the
traced choice, and the MoE launchers taking a plan. GPU: attention and the MoE FMA path give
bit-identical outputs with every prefetch placement (a prefetch is only a hint), and a bad
prefetch tensor is refused by name.
"""

import gc
import weakref

import pytest
import torch
from helpers import load_benchmark, make_paged_batch

from vllm_sm121 import l2_plan
from vllm_sm121.kernels import l2_prefetch
from vllm_sm121.kernels.moe import L2Plan, moe_block


def test_parse_targets_and_errors():
    assert l2_plan.parse("o") == {"o"}
    assert l2_plan.parse(" o, qkv_late ,w2") == {"o", "qkv_late", "w2"}
    assert l2_plan.parse("none") == frozenset()
    with pytest.raises(ValueError, match=r"VLLM_SM121_L2_PREFETCH.*unknown target.*'lm_head'.*supported"):
        l2_plan.parse("o,lm_head")
    for a in ("qkv", "w2"):
        with pytest.raises(ValueError, match=f"{a} and {a}_late are two placements"):
            l2_plan.parse(f"{a},{a}_late")
    # blank: the family's default (none on a machine without CUDA)
    if not torch.cuda.is_available():
        assert l2_plan.targets_from("") == frozenset()
    assert l2_plan.targets_from("o,qkv") == {"o", "qkv"}


def test_launch_args_are_off_without_a_tensor_and_on_the_interpreter():
    x = torch.zeros(4)
    for t in (None, torch.zeros(0), torch.zeros(8, 8)):
        ptr, nbytes, kw = l2_prefetch.launch_args(t, x)
        assert kw == dict(PF=False) and nbytes == 0 and ptr is x


def test_launch_args_on_a_gpu_family(monkeypatch):
    """As a GPU launch sees them (the family faked): the tensor's bytes as uint8, their count, the
    hint spacing; a non-contiguous tensor or one on another device is refused by name."""
    import types

    from vllm_sm121 import platform as P

    monkeypatch.setattr(l2_prefetch, "_platform", types.SimpleNamespace(family_of=lambda t: P.SM90,
                                                                       INTERPRETER=P.INTERPRETER))
    x = torch.zeros(4)
    for t in (torch.zeros(6, 8, dtype=torch.bfloat16), torch.zeros(6, 8, dtype=torch.float8_e4m3fn)):
        ptr, nbytes, kw = l2_prefetch.launch_args(t, x)
        assert ptr.dtype == torch.uint8 and ptr.data_ptr() == t.data_ptr() and nbytes == 48 * t.element_size()
        assert kw == dict(PF=True, PF_LANES=l2_prefetch.LANES, PF_LINE=l2_prefetch.LINE)
    with pytest.raises(ValueError, match="L2 prefetch: the tensor must be contiguous on cpu, got non-contiguous"):
        l2_prefetch.launch_args(torch.zeros(6, 8).t(), x)
    with pytest.raises(ValueError, match="must be contiguous on cpu, got torch.float32 on meta"):
        l2_prefetch.launch_args(torch.zeros(6, 8, device="meta"), x)
    # FC1's per-expert prefetch needs FC2 weights of the same experts
    from test_moe_block import Case

    from vllm_sm121.kernels.moe import moe_fc1_swiglu_fma

    args, s = _moe_inputs(Case(1, 64, 64, 4, 2), "cpu", 3)
    q, logits, w13, s13, b13, w2, s2, _b2, topk = args
    ids = torch.zeros(1, topk, dtype=torch.int32)
    with pytest.raises(ValueError, match="l2_w2: FC2 weights of the same 4 experts expected"):
        moe_fc1_swiglu_fma(q, s, w13, s13, b13, ids, l2_w2=(w2[:3].contiguous(), s2[:3].contiguous()))


def _fake_block() -> torch.nn.Module:
    b = torch.nn.Module()
    b.attn = torch.nn.Module()
    b.attn.qkv_proj = torch.nn.Linear(4, 8)
    b.attn.o_proj = torch.nn.Linear(8, 4)
    b.attn.attn = torch.nn.Module()
    return b


def test_plan_wires_each_kernel_to_the_next_gemv():
    blocks = [_fake_block() for _ in range(3)]
    modules = [len(list(b.modules())) for b in blocks]
    keys = [l2_plan.install(b, f"model.layers.{i}", frozenset({"o", "qkv_late", "w2"})) for i, b in enumerate(blocks)]
    ns = keys[0].split(":")[0]
    assert keys == [f"{ns}:model.layers.{i}" for i in range(3)]
    assert [len(list(b.modules())) for b in blocks] == modules  # nothing registered as a submodule twice
    for b in blocks:  # attention -> its own o_proj
        assert l2_plan.attention_prefetch(b.attn.attn) is b.attn.o_proj.weight
    for i in range(2):  # FC2 of layer i -> qkv of layer i + 1, placed late; FC1 -> its FC2 rows, early
        assert l2_plan.moe_plan(keys[i]) == L2Plan(next_weight=blocks[i + 1].attn.qkv_proj.weight, next_late=True,
                                                    w2=True, w2_late=False)
    assert l2_plan.moe_plan(keys[2]).next_weight is None  # the last layer has no next qkv
    assert l2_plan.moe_plan("") is None and l2_plan.moe_plan("0:nowhere.0") is None
    # a second model in the process (layer 0 again) gets its own keys: the first keeps its plan
    other = [_fake_block() for _ in range(2)]
    k2 = [l2_plan.install(b, f"model.layers.{i}", frozenset({"o", "qkv"})) for i, b in enumerate(other)]
    assert k2[0] != keys[0] and k2[0].endswith(":model.layers.0")
    assert l2_plan.moe_plan(keys[0]).next_weight is blocks[1].attn.qkv_proj.weight
    assert l2_plan.moe_plan(k2[0]).next_weight is other[1].attn.qkv_proj.weight
    # only "o": the MoE prefetches nothing; without "o" the attention prefetches nothing
    assert l2_plan.install(_fake_block(), "model.layers.0", frozenset({"o"})) == ""
    again = _fake_block()
    assert l2_plan.install(again, "model.layers.0", frozenset({"o"})) == ""
    assert l2_plan.attention_prefetch(again.attn.attn) is again.attn.o_proj.weight
    assert l2_plan.install(again, "model.layers.0", frozenset({"w2_late"})).endswith(":model.layers.0")
    assert l2_plan.attention_prefetch(again.attn.attn) is None
    # weak references: once a block is gone nothing holds its weight and nobody prefetches it
    weight = weakref.ref(blocks[1].attn.qkv_proj.weight)
    blocks[1] = None
    gc.collect()
    assert weight() is None
    assert l2_plan.moe_plan(keys[0]).next_weight is None


def test_plan_skips_an_attention_without_the_projections():
    b = torch.nn.Module()
    b.attn = torch.nn.Linear(2, 2)  # another attention class
    assert l2_plan.install(b, "other.layers.0", frozenset({"o", "qkv"})) == ""
    with pytest.raises(ValueError, match="does not end in a layer index"):
        l2_plan.next_prefix("model.norm")
    assert l2_plan.next_prefix("model.layers.9") == "model.layers.10"


def test_traced_choice_records_the_resolved_targets(monkeypatch):
    from vllm_sm121 import config as C

    monkeypatch.delenv(C.L2_PREFETCH_ENV, raising=False)
    if not torch.cuda.is_available():  # blank: the family default, recorded as what it is
        assert C.traced_env_choices()["l2_prefetch"] == "none"
    monkeypatch.setenv(C.L2_PREFETCH_ENV, " qkv_late, o")
    assert C.traced_env_choices()["l2_prefetch"] == "o,qkv_late"
    assert l2_plan.targets_from("none") == frozenset()
    assert C.L2_PREFETCH_ENV == l2_plan.PREFETCH_ENV


def _moe_inputs(c, device, seed):
    from test_moe_block import build_layer

    from vllm_sm121.kernels.norm_mxfp8 import mxfp8_quantize_torch

    _method, layer = build_layer(c, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q, s = mxfp8_quantize_torch(torch.randn(c.m, c.hidden, generator=g))
    logits = torch.randn(c.m, c.experts, generator=g).bfloat16()
    args = (q.to(device), logits.to(device), layer.w13_weight, layer.w13_weight_scale, layer.w13_bias,
            layer.w2_weight, layer.w2_weight_scale, layer.w2_bias, c.topk)
    return args, s.to(device)


PLANS = [("qkv", L2Plan(next_weight=True)), ("qkv_late", L2Plan(next_weight=True, next_late=True)),
         ("w2", L2Plan(w2=True)), ("w2_late", L2Plan(w2=True, w2_late=True)),
         ("all", L2Plan(next_weight=True, next_late=True, w2=True, w2_late=True))]


def _with_weight(plan: L2Plan, w: torch.Tensor) -> L2Plan:
    import dataclasses

    return dataclasses.replace(plan, next_weight=w if plan.next_weight is not None else None)


@pytest.mark.interpreter
def test_moe_block_takes_a_plan_on_the_interpreter(device):
    """The launchers accept every plan (compiled out on the interpreter: the same numbers)."""
    from test_moe_block import Case

    c = Case(1, 64, 64, 4, 2)
    args, s = _moe_inputs(c, device, 3)
    base = moe_block(*args, x_scale=s)
    w = torch.zeros(5000, dtype=torch.uint8, device=device)
    for _name, plan in PLANS:
        assert torch.equal(moe_block(*args, x_scale=s, l2=_with_weight(plan, w)), base)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_moe_prefetch_keeps_the_output_bit_identical(m):
    """gpt-oss-120b expert shapes, the FMA path: every placement of both prefetches (the next
    layer's 14.7 MB qkv weight by FC2, the experts' FC2 rows by FC1) gives the same bytes."""
    from test_moe_block import Case

    c = Case(m, 2880, 2880, 128, 4)
    args, s = _moe_inputs(c, "cuda", 7)
    base = moe_block(*args, x_scale=s)
    w = torch.randint(0, 256, (5120, 2880), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    for name, plan in PLANS:
        out = moe_block(*args, x_scale=s, l2=_with_weight(plan, w))
        assert torch.equal(out, base), name
    with pytest.raises(ValueError, match="L2 prefetch: the tensor must be contiguous"):
        moe_block(*args, x_scale=s, l2=L2Plan(next_weight=w.t()))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_attention_prefetch_keeps_the_output_bit_identical(kv_dtype):
    """gpt-oss-120b's decode launch (64 q / 8 kv heads, a graph's 64 splits, fused merge) with the
    11.8 MB o_proj weight prefetched: the same bytes as without, eager and replayed in a graph."""
    from vllm_sm121.kernels.paged_attention import SplitWorkspace, paged_attention

    b = make_paged_batch([1, 1], [700, 33], num_q_heads=64, num_kv_heads=8, head_size=64, block_size=16,
                         kv_dtype=kv_dtype, device="cuda", seed=5)
    sinks = torch.randn(64, device="cuda")
    ws = SplitWorkspace.allocate(b.q.shape[0], 64, 64, 64, "cuda")
    w = torch.randint(0, 256, (2880, 4096), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    outs = {}
    for pf in (None, w):
        out = torch.zeros_like(b.q)

        def run(out=out, pf=pf):
            paged_attention(b.q, b.key_cache, b.value_cache, b.block_table, b.query_start_loc, b.seq_lens,
                            max_query_len=1, max_seq_len=1024, scale=0.125, sinks=sinks, k_scale=b.k_scale,
                            v_scale=b.v_scale, out=out, num_splits=64, workspace=ws, prefetch=pf)

        run()
        eager = out.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        outs[pf is None] = eager
    assert torch.equal(outs[True], outs[False])


def test_l2_probe_benchmark_arguments_and_no_gpu_exit(capsys):
    """``benchmarks/l2_probe.py``: its defaults (gpt-oss-120b's qkv and o, hints every 32 and 128
    bytes) and, without a GPU, exit 2 with the reason."""
    probe = load_benchmark("l2_probe")
    args = probe.parse_args([])
    assert args.shapes.split(",") == list(probe.SHAPES) and [int(v) for v in args.lines.split(",")] == [32, 128]
    assert probe.SHAPES == {"qkv": (5120, 2880), "o": (2880, 4096)}
    if not torch.cuda.is_available():
        assert probe.main(["--out", "/dev/null"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out
