"""The gpt-oss model-level hook (``vllm_sm121.moe.hook``): norm -> MXFP8 -> experts, in vLLM's real block.

CPU (Triton interpreter). A real ``Sm121GptOssBlock`` is built from a ``VllmConfig`` of
models/gpt-oss-tiny shrunk to hidden 64 (vLLM's ``MLPBlock``, ``FusedMoE`` runner, ``RMSNorm``s
and our quantization config; a single-rank gloo group), with only the attention replaced by a
stand-in through the documented ``attention_cls`` override (vLLM's ``Attention`` needs a GPU
platform). The shim's patch applying to vLLM 0.26.0 is checked by ``tests/test_compat.py``
(parametrized over every ``compat.SHIMS`` entry).
"""

import dataclasses
import itertools
import os
import types

import pytest
import torch
from helpers import one_rank_groups
from test_moe_block import assert_block_close, fill_random_mxfp4_, rel_l2

from vllm_sm121 import compat, moe
from vllm_sm121.kernels.moe import moe_block_torch
from vllm_sm121.kernels.norm_mxfp8 import fused_add_rmsnorm_mxfp8_torch
from vllm_sm121.moe import hook  # registers the sm121:: ops

# The blocks are built on CPU and run the kernels on CPU tensors: that needs Triton's interpreter
# (CI, or TRITON_INTERPRET=1); a GPU machine runs the kernels' own GPU tests instead.
pytestmark = [pytest.mark.interpreter,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")]

TINY = dict(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=1, layer_types=["sliding_attention"],
            vocab_size=128)
_prefixes = itertools.count()


class _StandInAttention(torch.nn.Module):
    """Takes OAIAttention's constructor arguments; doubles its input."""

    def __init__(self, config, prefix="", quant_config=None, cache_config=None):
        super().__init__()

    def forward(self, hidden_states, positions):
        return hidden_states * 2


@pytest.fixture(scope="module")
def env():
    """READY on (as tests of the gated MoE do), the shim installed, one-rank groups; undone after."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.model_executor.models import gpt_oss

    from vllm_sm121 import config

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "READY", True)
        mp.setitem(config.OPTIONS, "moe", dataclasses.replace(config.OPTIONS["moe"], implemented=("mxfp8", "upstream")))
        mp.setattr(gpt_oss.GptOssModel, "block_cls", gpt_oss.GptOssModel.block_cls)  # restored after
        moe.register()  # installs hook.Sm121GptOssBlock (gpt_oss.py is already imported: at once)

        def vllm_config(moe_option: str):
            mc = ModelConfig(model="models/gpt-oss-tiny", skip_tokenizer_init=True, hf_overrides=TINY,
                             dtype=torch.bfloat16)
            return VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                              additional_config={"sm121": {"moe": moe_option}})

        cfgs = {name: vllm_config(name) for name in ("mxfp8", "upstream")}
        with one_rank_groups(cfgs["mxfp8"]):
            yield types.SimpleNamespace(cfgs=cfgs, gpt_oss=gpt_oss)


def build_block(env, moe_option: str, seed: int = 0):
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_sm121.moe.hook import Sm121GptOssBlock

    assert env.gpt_oss.GptOssModel.block_cls is Sm121GptOssBlock  # the shim's doing

    class Block(env.gpt_oss.GptOssModel.block_cls):
        attention_cls = _StandInAttention

    cfg = env.cfgs[moe_option]
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):
        block = Block(cfg, quant_config=cfg.quant_config, prefix=f"model.layers.{next(_prefixes)}")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for norm in (block.input_layernorm, block.post_attention_layernorm):
            norm.weight.copy_(1 + 0.1 * torch.randn(norm.weight.shape, generator=g))
        block.mlp.router.weight.copy_(0.3 * torch.randn(block.mlp.router.weight.shape, generator=g))
        block.mlp.router.bias.copy_(0.1 * torch.randn(block.mlp.router.bias.shape, generator=g))
    experts = block.mlp.experts.routed_experts
    if moe_option == "mxfp8":
        fill_random_mxfp4_(experts, seed)
        experts.quant_method.process_weights_after_loading(experts)
    return block


def _inputs(m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, TINY["hidden_size"], generator=g).bfloat16()
    residual = torch.randn(m, TINY["hidden_size"], generator=g).bfloat16()
    return x, torch.arange(m), residual


@pytest.mark.parametrize("m", [1, 3, 17])  # FMA path up to FMA_MAX_TOKENS = 4, grouped above
def test_fused_block_matches_reference_and_upstream_forward(env, m):
    from vllm.forward_context import set_forward_context

    from vllm_sm121.moe.method import Sm121Mxfp4MoEMethod

    block = build_block(env, "mxfp8", seed=m)
    experts = block.mlp.experts.routed_experts
    assert isinstance(experts.quant_method, Sm121Mxfp4MoEMethod) and block.sm121_fused_moe
    assert block.sm121_router_in_norm  # the default where the router qualifies
    x, pos, res0 = _inputs(m, seed=10 + m)
    with torch.no_grad():
        out, res = block(x, pos, res0.clone())
        block.sm121_router_in_norm = False  # the router as upstream's GEMM after the norm kernel
        out_sep, res_sep = block(x, pos, res0.clone())
        block.sm121_router_in_norm = True
        assert torch.equal(res_sep, res)
        # same MXFP8 inputs; the logits' fp32 sums differ in order only (same top-k here)
        assert rel_l2(out, out_sep) < 1e-2, rel_l2(out, out_sep)

        # Reference: upstream's input norm and the stand-in attention, then torch add+RMSNorm ->
        # MXFP8, the block's router on the bf16 output, and the MoE reference on those MXFP8 values.
        h, r1 = block.input_layernorm(x, res0.clone())
        r_ref = r1.clone()
        y, q, s = fused_add_rmsnorm_mxfp8_torch(2 * h, r_ref, block.post_attention_layernorm.weight)
        logits = block.mlp.router(y)
        ref = moe_block_torch(q, logits, experts.w13_weight, experts.w13_weight_scale, experts.w13_bias,
                              experts.w2_weight, experts.w2_weight_scale, experts.w2_bias, 2, x_scale=s)
        assert torch.equal(res, r_ref)  # the new residual, rounded once as upstream's fused add
        assert_block_close(out, ref, f"hooked block M={m}")
        assert ref.abs().max() > 0.3  # the GEMMs saw real values

        # Upstream's forward of the same block (vLLM's norm, MLPBlock, moe_forward op, our method
        # quantizing bf16 inside FC1). It rounds the norm output to bf16 before MXFP8, the fused
        # norm quantizes the fp32 value: a few e4m3 values differ by one step (double rounding),
        # well under the MXFP8-vs-bf16 format error (test_moe_block: up to 8e-2).
        block.sm121_fused_moe = False
        with set_forward_context(None, env.cfgs["mxfp8"]):
            out_up, res_up = block(x, pos, res0.clone())
    assert torch.equal(res_up, res)
    print(f"\nM={m}: hooked vs MXFP8 reference {rel_l2(out, ref):.2e}; vs upstream forward {rel_l2(out, out_up):.2e}")
    assert rel_l2(out, out_up) < 2e-2, rel_l2(out, out_up)


def test_other_moe_method_keeps_upstream_forward(env, monkeypatch):
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod

    block = build_block(env, "upstream")
    assert isinstance(block.mlp.experts.routed_experts.quant_method, GptOssMxfp4MoEMethod)
    assert block.sm121_fused_moe is False
    assert hook.fused_moe_unsupported_reason(block, env.cfgs["upstream"]) == "experts not on Sm121Mxfp4MoEMethod"
    sentinel = object()
    monkeypatch.setattr(env.gpt_oss.TransformerBlock, "forward", lambda self, h, p, r: sentinel)
    monkeypatch.setattr(hook, "hooked_mlp_forward", lambda *a: pytest.fail("fused path taken"))
    assert block(*_inputs(2, seed=0)) is sentinel


def test_parallel_lora_and_sequence_parallel_fall_back(env):
    fused_moe_unsupported_reason = hook.fused_moe_unsupported_reason
    block = build_block(env, "mxfp8")
    cfg = env.cfgs["mxfp8"]
    assert fused_moe_unsupported_reason(block, cfg) is None
    moe_cfg = block.mlp.experts.routed_experts.moe_config
    par = moe_cfg.moe_parallel_config
    for field in ("tp_size", "ep_size"):  # one TP group: the hook all-reduces the experts' output itself
        moe_cfg.moe_parallel_config = dataclasses.replace(par, **{field: 2, "use_ep": field == "ep_size"})
        assert fused_moe_unsupported_reason(block, cfg) is None, field
    for field in ("dp_size", "pcp_size"):
        moe_cfg.moe_parallel_config = dataclasses.replace(par, **{field: 2})
        assert "data/context-parallel MoE" in fused_moe_unsupported_reason(block, cfg), field
    moe_cfg.moe_parallel_config = par
    block.mlp.is_sequence_parallel = True
    assert fused_moe_unsupported_reason(block, cfg) == "sequence-parallel MoE"
    block.mlp.is_sequence_parallel = False
    with_lora = types.SimpleNamespace(lora_config=object(), model_config=cfg.model_config)
    assert fused_moe_unsupported_reason(block, with_lora) == "LoRA"
    fp16 = types.SimpleNamespace(lora_config=None, model_config=types.SimpleNamespace(dtype=torch.float16))
    assert fused_moe_unsupported_reason(block, fp16) == "activations not bf16"


def test_custom_ops_fake_impls_and_tracing(env):
    from torch._subclasses.fake_tensor import FakeTensorMode

    t, h, e, i = 5, 64, 4, 64
    with FakeTensorMode():
        x, res, w = torch.empty(t, h, dtype=torch.bfloat16), torch.empty(t, h, dtype=torch.bfloat16), torch.empty(h)
        y, q, s = torch.ops.sm121.add_rmsnorm_mxfp8(x, res, w.bfloat16(), 1e-5)
        assert (y.shape, y.dtype, q.shape, q.dtype, s.shape, s.dtype) == (
            (t, h), torch.bfloat16, (t, h), torch.float8_e4m3fn, (t, h // 32), torch.uint8)
        u8 = torch.uint8
        out = torch.ops.sm121.gpt_oss_moe_mxfp8(
            q, s, torch.empty(t, e, dtype=torch.bfloat16), torch.empty(e, 2 * i, h // 2, dtype=u8),
            torch.empty(e, 2 * i, h // 32, dtype=u8), torch.empty(e, 2 * i, dtype=torch.bfloat16),
            torch.empty(e, h, i // 2, dtype=u8), torch.empty(e, h, i // 32, dtype=u8),
            torch.empty(e, h, dtype=torch.bfloat16), 2)
        assert (out.shape, out.dtype) == ((t, h), torch.bfloat16)

    # The block's MoE half compiles into one Dynamo graph holding both ops (what vLLM's
    # torch.compile sees; no graph break), and the compiled function gives the eager numbers.
    block = build_block(env, "mxfp8")
    x, _, res0 = _inputs(3, seed=1)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for router_in_norm, norm_op in ((False, "sm121.add_rmsnorm_mxfp8"), (True, "sm121.add_rmsnorm_mxfp8_router")):
        def mlp_half(hs, residual):
            return hook.hooked_mlp_forward(hs, residual, block.post_attention_layernorm, block.mlp, router_in_norm)

        torch._dynamo.reset()
        graphs.clear()
        with torch.no_grad():
            res_c, res_e = res0.clone(), res0.clone()
            out_c, r_c = torch.compile(mlp_half, backend=capture, fullgraph=True)(x, res_c)
            out_e, r_e = mlp_half(x, res_e)
        assert len(graphs) == 1
        targets = {str(n.target).rsplit(".default", 1)[0] for n in graphs[0].graph.nodes if n.op == "call_function"}
        assert {norm_op, "sm121.gpt_oss_moe_mxfp8"} <= targets, targets
        assert ("sm121.add_rmsnorm_mxfp8" in targets) != router_in_norm, targets
        assert torch.equal(out_c, out_e) and torch.equal(r_c, r_e)


def test_opcheck_norm_op():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=g).bfloat16()
    res = torch.randn(3, 64, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
    torch.library.opcheck(torch.ops.sm121.add_rmsnorm_mxfp8.default, (x, res, w, 1e-5),
                          test_utils=("test_schema", "test_faketensor"))
    rw = (0.1 * torch.randn(8, 64, generator=g)).bfloat16()
    rb = (0.1 * torch.randn(8, generator=g)).bfloat16()
    for t in (3, 9):  # the fused kernel and the fallback (norm kernel + linear)
        torch.library.opcheck(torch.ops.sm121.add_rmsnorm_mxfp8_router.default,
                              (torch.randn(t, 64, generator=g).bfloat16(), torch.randn(t, 64, generator=g).bfloat16(),
                               w, 1e-5, rw, rb), test_utils=("test_schema", "test_faketensor"))


def test_opcheck_moe_op():
    from test_moe_block import Case, build_layer

    from vllm_sm121.kernels.norm_mxfp8 import mxfp8_quantize_torch

    c = Case(3, 64, 64, 4, 2)
    _method, layer = build_layer(c, "cpu", seed=4)
    g = torch.Generator().manual_seed(5)
    q, s = mxfp8_quantize_torch(torch.randn(c.m, c.hidden, generator=g))
    logits = torch.randn(c.m, c.experts, generator=g).bfloat16()
    args = (q, s, logits, layer.w13_weight.data, layer.w13_weight_scale.data, layer.w13_bias.data,
            layer.w2_weight.data, layer.w2_weight_scale.data, layer.w2_bias.data, c.topk)
    # test_faketensor only: SchemaCheckMode compares inputs with an op that has no CPU e4m3 kernel.
    torch.library.opcheck(torch.ops.sm121.gpt_oss_moe_mxfp8.default, args, test_utils=("test_faketensor",))


def test_shim_installs_once_and_respects_another_block_cls(env, monkeypatch):
    from vllm_sm121.moe.hook import Sm121GptOssBlock

    gpt_oss = env.gpt_oss
    monkeypatch.setattr(gpt_oss.GptOssModel, "block_cls", gpt_oss.TransformerBlock)
    compat._install_gpt_oss_block(gpt_oss)
    compat._install_gpt_oss_block(gpt_oss)
    assert gpt_oss.GptOssModel.block_cls is Sm121GptOssBlock

    class Theirs(gpt_oss.TransformerBlock):
        pass

    monkeypatch.setattr(gpt_oss.GptOssModel, "block_cls", Theirs)
    compat._install_gpt_oss_block(gpt_oss)
    assert gpt_oss.GptOssModel.block_cls is Theirs
    assert any(s.patch == "0004-gpt-oss-fused-norm-mxfp8-moe-hook.patch" for s in compat.SHIMS)


def test_hook_is_installed_only_through_moe_register(monkeypatch):
    """While READY is False the general plugin never calls moe.register(), hence never the shim."""
    import vllm_sm121

    calls = []
    monkeypatch.setattr(compat, "register_gpt_oss_fused_moe_block", lambda: calls.append(1))
    monkeypatch.setattr(moe, "READY", False)
    vllm_sm121._features()
    assert calls == []
    monkeypatch.setattr(moe, "READY", True)
    vllm_sm121._features()
    assert calls == [1]


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16-reduce", "fp32-reduce"])
@pytest.mark.parametrize("field", ["tp_size", "ep_size"])
def test_fused_path_all_reduces_under_tensor_and_expert_parallelism(env, monkeypatch, field, fp32):
    """Under TP/EP each rank's experts return a share of the sum: the hook all-reduces it (here a
    stand-in that scales by 3, on one rank) exactly once, after the experts; with the fp32 reduce
    (the default under TP / EP) the share is the unrounded fp32 sum and the result is rounded once."""
    import vllm.distributed

    block = build_block(env, "mxfp8", seed=5)
    x, pos, res0 = _inputs(2, seed=7)
    with torch.no_grad():
        single, _ = block(x, pos, res0.clone())
    experts = block.mlp.experts.routed_experts
    par = experts.moe_config.moe_parallel_config
    calls = []
    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_reduce", lambda t: calls.append(t) or t * 3)
    experts.moe_config.moe_parallel_config = dataclasses.replace(par, **{field: 2})  # use_ep off: no expert_map
    block.sm121_fp32_reduce_moe = fp32  # (decided at construction, where this block had one rank)
    try:
        with torch.no_grad():
            out, _ = block(x, pos, res0.clone())
    finally:
        experts.moe_config.moe_parallel_config = par
    assert len(calls) == 1
    if fp32:
        assert calls[0].dtype == torch.float32 and torch.equal(calls[0].bfloat16(), single)
        assert out.dtype == torch.bfloat16 and torch.equal(out, (calls[0] * 3).bfloat16())
    else:
        assert torch.equal(calls[0], single) and torch.equal(out, single * 3)


def test_fp32_reduce_switch_and_o_proj_reasons(env, monkeypatch):
    """One rank: nothing to reduce (the block keeps upstream's o_proj); the reasons name what blocks it."""
    from vllm_sm121 import config as C

    monkeypatch.delenv(C.TP_FP32_REDUCE_ENV, raising=False)
    block = build_block(env, "mxfp8")
    assert not block.sm121_fp32_reduce_moe and not block.sm121_fp32_reduce_o
    assert hook.o_proj_fp32_reduce_unsupported_reason(block.attn) == "attention is not upstream's OAIAttention"
    assert C.traced_env_choices()["tp_fp32_reduce"] is True
    monkeypatch.setenv(C.TP_FP32_REDUCE_ENV, "0")
    assert C.traced_env_choices()["tp_fp32_reduce"] is False


@pytest.mark.parametrize("dense", ["bf16", "fp8"])
def test_o_proj_fp32_reduce_rounds_once_after_the_sum(monkeypatch, dense):
    """Two row-parallel ranks simulated on one: each rank's fp32 partial (bias on rank 0), summed by
    the all-reduce stand-in and rounded once, reproduces the unsharded bf16 projection; summing
    bf16-rounded partials (upstream's bf16 all-reduce) does not, in many elements."""
    import vllm.distributed
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from vllm_sm121.dense.method import Sm121DenseFp8LinearMethod
    from vllm_sm121.kernels import dense as D

    g = torch.Generator().manual_seed(3)
    n, k = 48, 128
    x = torch.randn(5, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.2).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    if dense == "fp8":
        q, scale = D.fp8_per_channel_quantize(w)
        full = D.dense_fp8_linear(x, q, scale, b)
    else:
        full = (x.float() @ w.float().t() + b.float()).bfloat16()
    parts = []

    def rank(r):
        sl = slice(r * k // 2, (r + 1) * k // 2)
        o = types.SimpleNamespace(tp_rank=r, bias=b)
        if dense == "fp8":
            o.quant_method, o.weight, o.weight_scale = Sm121DenseFp8LinearMethod(), q[:, sl].contiguous(), scale
        else:
            o.quant_method, o.weight = UnquantizedLinearMethod(), w[:, sl].contiguous()
        return o, x[:, sl].contiguous()

    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_reduce", lambda t: parts.append(t) or t)
    halves = [hook.o_proj_fp32_reduce(*rank(r)) for r in (0, 1)]
    assert all(p.dtype == torch.float32 for p in parts) and all(h.dtype == torch.bfloat16 for h in halves)
    same32 = ((parts[0] + parts[1]).bfloat16() == full).float().mean().item()
    same16 = ((halves[0] + halves[1]) == full).float().mean().item()
    assert same32 >= 0.97 and same32 > same16 + 0.1, (same32, same16)


def test_router_in_norm_switch_and_reasons(env, monkeypatch):
    block = build_block(env, "mxfp8")
    assert block.sm121_router_in_norm and hook.router_in_norm_unsupported_reason(block.mlp) is None
    cfg = env.cfgs["mxfp8"]
    assert cfg.additional_config[hook.TRACED_KEY]["router_in_norm"] is True
    hash_on = cfg.compute_hash()
    monkeypatch.setenv(hook.ROUTER_IN_NORM_ENV, "0")
    assert build_block(env, "mxfp8").sm121_router_in_norm  # the config's record wins over a later env
    cfg.additional_config.pop(hook.TRACED_KEY)  # a config checked with the variable set
    assert not build_block(env, "mxfp8").sm121_router_in_norm
    # the choice reaches vLLM's compile-cache key (additional_config is hashed; VLLM_SM121_* are not)
    assert cfg.additional_config[hook.TRACED_KEY]["router_in_norm"] is False and cfg.compute_hash() != hash_on
    monkeypatch.delenv(hook.ROUTER_IN_NORM_ENV)
    cfg.additional_config.pop(hook.TRACED_KEY)
    mlp = types.SimpleNamespace(router=torch.nn.Linear(64, 4))
    assert hook.router_in_norm_unsupported_reason(mlp) == "router is not upstream's ReplicatedLinear"
    router = block.mlp.router
    assert hook.router_in_norm_unsupported_reason(block.mlp, router.weight.shape[1] + 32) == (
        "router weight not bf16 [E, hidden] with a contiguous last dimension")
    monkeypatch.setattr(router, "bias", torch.nn.Parameter(router.bias.data.float(), requires_grad=False))
    assert hook.router_in_norm_unsupported_reason(block.mlp) == "router bias not a contiguous bf16 [E]"
    monkeypatch.setattr(router, "skip_bias_add", True)
    assert hook.router_in_norm_unsupported_reason(block.mlp) == "router returns its bias separately"
    monkeypatch.setattr(router, "quant_method", object())
    assert hook.router_in_norm_unsupported_reason(block.mlp) == "quantized router"


def _gpt_oss_rope(cfg, head: int = 64):
    """gpt-oss's rotary embedding as OAIAttention builds it (YaRN, NeoX, fp32 cache)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(cfg):
        return _get_rope(get_rope, head)


def _get_rope(get_rope, head):
    return get_rope(head, max_position=131072, dtype=torch.float32, is_neox_style=True,
                    rope_parameters={"rope_theta": 150000.0, "rope_type": "yarn", "factor": 32.0,
                                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False})


@pytest.mark.parametrize("m", [1, 3, 6])  # FMA GEMV (rotation in its epilogue) up to 4 tokens, then GEMV + torch
def test_rope_in_qkv_feeds_attention_what_upstream_rotation_gives(env, m):
    """``hooked_attn_forward`` against upstream's own rotation: the attention receives q, k, v of the
    same shapes and order, with q and k within one bf16 step of the FP8 qkv projection rotated by
    vLLM's ``RotaryEmbedding.forward_native`` (eager, bf16 per operation; ours rounds once), and v
    untouched; the output is o_proj of what the attention returned."""
    from vllm_sm121.kernels import dense as D

    head, hq, hkv, hidden = 64, 2, 1, 96
    g = torch.Generator().manual_seed(m)
    n = (hq + 2 * hkv) * head
    q8, s8 = D.fp8_per_channel_quantize((torch.randn(n, hidden, generator=g) * 0.3).bfloat16())
    qkv_proj = types.SimpleNamespace(weight=q8, weight_scale=s8, bias=torch.randn(n, generator=g).bfloat16())
    seen = {}

    def attention(q, k, v):
        seen.update(q=q.clone(), k=k.clone(), v=v.clone())
        return q * 2

    def o_proj(a):
        return a + 1, None

    rope = _gpt_oss_rope(env.cfgs["mxfp8"], head)
    attn = types.SimpleNamespace(qkv_proj=qkv_proj, rotary_emb=rope, attn=attention, o_proj=o_proj,
                                 q_size=hq * head, kv_size=hkv * head, head_dim=head)
    x = torch.randn(m, hidden, generator=g).bfloat16()
    pos = torch.randint(0, 8192, (m,), generator=g)
    out = hook.hooked_attn_forward(attn, x, pos)
    qkv = D.dense_fp8_linear(x, q8, s8, qkv_proj.bias, path="fma" if m <= 4 else "auto")
    q_up, k_up = rope.forward_native(pos, qkv[:, :hq * head].clone(), qkv[:, hq * head:(hq + hkv) * head].clone())
    for name, want in (("q", q_up), ("k", k_up)):
        got = seen[name].float()
        assert got.shape == want.shape, name
        # eager bf16 rounds x1 * cos, x2 * sin and their difference: errors scale with the terms, not
        # the (possibly cancelled) result: bound by bf16 steps of the token's largest projection
        scale = qkv.float().abs().amax(dim=1, keepdim=True)
        err = float(((got - want.float()).abs() / scale).max())
        assert err <= 2.0 ** -6, (name, err)  # two bf16 steps of the row's largest value
    assert torch.equal(seen["v"], qkv[:, (hq + hkv) * head:])
    assert torch.equal(out, seen["q"] * 2 + 1)


def test_rope_in_qkv_switch_and_reasons(env, monkeypatch):
    """On by default ($VLLM_SM121_ROPE_IN_QKV, a traced choice; 0 turns it off); refused with a reason
    without FP8 dense weights or on another attention class (the stand-in here), and then the block
    keeps upstream's."""
    from vllm_sm121 import config as C

    monkeypatch.delenv(C.ROPE_IN_QKV_ENV, raising=False)
    assert C.traced_env_choices()["rope_in_qkv"] is True
    block = build_block(env, "mxfp8")
    assert block.sm121_rope_in_qkv is False
    cfg = env.cfgs["mxfp8"]
    assert "dense_weights" in hook.rope_in_qkv_unsupported_reason(block.attn, cfg)
    fp8 = types.SimpleNamespace(additional_config={"sm121": {"dense_weights": "fp8"}})
    assert "OAIAttention" in hook.rope_in_qkv_unsupported_reason(block.attn, fp8)
    monkeypatch.setenv(C.ROPE_IN_QKV_ENV, "0")
    assert C.traced_env_choices()["rope_in_qkv"] is False


def test_kv_in_qkv_switch_and_reasons(env, monkeypatch):
    """Opt-in ($VLLM_SM121_KV_IN_QKV=1, a traced choice): only where the rotation runs in the qkv GEMV,
    with an nvfp4 cache on SM121 attention; refused with the reason otherwise."""
    from vllm_sm121 import config as C
    from vllm_sm121.attention.impl import SM121AttentionImpl

    monkeypatch.delenv(C.KV_IN_QKV_ENV, raising=False)
    assert C.traced_env_choices()["kv_in_qkv"] is False
    monkeypatch.setenv(C.KV_IN_QKV_ENV, "1")
    assert C.traced_env_choices()["kv_in_qkv"] is True
    block = build_block(env, "mxfp8")
    assert block.sm121_kv_in_qkv is False  # the stand-in attention: no rotation in the GEMV, so no write
    nvfp4 = types.SimpleNamespace(cache_config=types.SimpleNamespace(cache_dtype="nvfp4"))
    impl = SM121AttentionImpl(4, 64, 0.125, 2, kv_cache_dtype="nvfp4")
    backend = types.SimpleNamespace(forward_includes_kv_cache_update=False)
    ok_layer = types.SimpleNamespace(impl=impl, kv_sharing_target_layer_name=None, calculate_kv_scales=False,
                                     attn_backend=backend)
    attn = types.SimpleNamespace(attn=ok_layer)
    assert hook.kv_in_qkv_unsupported_reason(attn, nvfp4) is None
    bf16 = types.SimpleNamespace(cache_config=types.SimpleNamespace(cache_dtype="auto"))
    assert "nvfp4" in hook.kv_in_qkv_unsupported_reason(attn, bf16)
    other = types.SimpleNamespace(attn=types.SimpleNamespace(**{**ok_layer.__dict__, "impl": object()}))
    assert "SM121" in hook.kv_in_qkv_unsupported_reason(other, nvfp4)
    shared = types.SimpleNamespace(attn=types.SimpleNamespace(**{**ok_layer.__dict__, "kv_sharing_target_layer_name": "x"}))
    assert "shares" in hook.kv_in_qkv_unsupported_reason(shared, nvfp4)


def _qkv_op_weights(g: torch.Generator):
    """(FP8 codes [256, 64], scales, bf16 bias, fp32 cos/sin cache [512, 64]) for the qkv ops' opchecks;
    importing the dense method registers the ops."""
    from vllm_sm121.dense import method
    from vllm_sm121.kernels import dense as D

    assert method is not None
    q8, s8 = D.fp8_per_channel_quantize((torch.randn(256, 64, generator=g) * 0.3).bfloat16())
    return q8, s8, torch.randn(256, generator=g).bfloat16(), torch.rand(512, 64, generator=g)


def test_opcheck_qkv_rope_op():
    """``sm121::dense_fp8_linear_rope``: schema and fake implementation, on the fused (few tokens) and
    the unfused path."""
    g = torch.Generator().manual_seed(6)
    q8, s8, bias, cache = _qkv_op_weights(g)
    for t in (2, 7):
        x = torch.randn(t, 64, generator=g).bfloat16()
        pos = torch.randint(0, 512, (t,), generator=g)
        torch.library.opcheck(torch.ops.sm121.dense_fp8_linear_rope.default, (x, q8, s8, bias, pos, cache, 192, 64),
                              test_utils=("test_faketensor",))


class _Fp8Attention(torch.nn.Module):
    """OAIAttention's attributes for the tiny block: an FP8 qkv_proj on the plugin's method, gpt-oss's
    rotation, the given attention (a callable or an attention layer) and an o_proj stand-in."""

    def __init__(self, env, seed: int, attn):
        from vllm_sm121.dense.method import Sm121DenseFp8LinearMethod
        from vllm_sm121.kernels import dense as D

        super().__init__()
        head, hq, hkv = TINY["head_dim"], TINY["num_attention_heads"], TINY["num_key_value_heads"]
        n, hidden = (hq + 2 * hkv) * head, TINY["hidden_size"]
        g = torch.Generator().manual_seed(seed)
        q8, s8 = D.fp8_per_channel_quantize((torch.randn(n, hidden, generator=g) * 0.3).bfloat16())
        self.qkv_proj = torch.nn.Module()
        self.qkv_proj.quant_method = Sm121DenseFp8LinearMethod()
        for name, t in (("weight", q8), ("weight_scale", s8), ("bias", torch.randn(n, generator=g).bfloat16())):
            self.qkv_proj.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        self.rotary_emb = _gpt_oss_rope(env.cfgs["mxfp8"], head)
        self.q_size, self.kv_size, self.head_dim = hq * head, hkv * head, head
        self.attn = attn

    def o_proj(self, a):
        return a[:, :TINY["hidden_size"]] + 1, None


def _compiled_once(block, x, pos, res0):
    """``block.forward`` through Dynamo with fullgraph=True: (the one graph's op names in order, its outputs)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out, res = torch.compile(block.forward, backend=capture, fullgraph=True)(x, pos, res0.clone())
    assert len(graphs) == 1
    return [str(nd.target).rsplit(".default", 1)[0] for nd in graphs[0].graph.nodes if nd.op == "call_function"], out, res


def test_block_with_rope_in_qkv_traces_into_one_graph(env):
    """With the rotation in the qkv GEMV switched on, the block's forward still compiles into one
    Dynamo graph (no break: the FP8-method check is a constant), which holds the fused op, and gives
    the eager numbers. The attention is a stand-in module with OAIAttention's attributes."""
    block = build_block(env, "mxfp8")
    block.attn = _Fp8Attention(env, 3, lambda q, k, v: q * 2 + torch.cat((k, v), dim=-1).sum(-1, keepdim=True))
    block.sm121_rope_in_qkv = True
    x, _, res0 = _inputs(3, seed=2)
    pos = torch.tensor([5, 900, 77])
    with torch.no_grad():
        targets, out_c, r_c = _compiled_once(block, x, pos, res0)
        out_e, r_e = block.forward(x, pos, res0.clone())
    assert "sm121.dense_fp8_linear_rope" in targets, targets
    assert torch.equal(out_c, out_e) and torch.equal(r_c, r_e)


class _QkvCall(torch.nn.Module):
    """A qkv_proj called as upstream calls it (returns (out, None)), on the stand-in's FP8 weights."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, h):
        from vllm_sm121.dense.method import dense_fp8_linear

        return dense_fp8_linear(h, self.w.weight, self.w.weight_scale, self.w.bias), None


@pytest.mark.parametrize("rope", [True, False], ids=["fp8-qkv", "upstream-attention"])
def test_block_with_fp32_reduces_traces_into_one_graph(env, monkeypatch, rope):
    """Under TP (simulated: the MoE's parallel config says 2 ranks, the all-reduce is the identity)
    with the fp32 reduces on, the block compiles into one Dynamo graph holding the fp32 o_proj and
    the fp32 MoE op, and gives the eager numbers, which round o_proj and the experts once."""
    import vllm.distributed
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    block = build_block(env, "mxfp8", seed=9)
    block.attn = _Fp8Attention(env, 3, lambda q, k, v: q * 2 + torch.cat((k, v), dim=-1).sum(-1, keepdim=True))
    if not rope:  # upstream's OAIAttention.forward order, with the qkv as a plain module call
        block.attn.qkv_proj = _QkvCall(block.attn.qkv_proj)
    g = torch.Generator().manual_seed(4)
    o = torch.nn.Module()
    o.tp_rank, o.quant_method = 0, UnquantizedLinearMethod()
    o.register_parameter("weight", torch.nn.Parameter((torch.randn(64, 64, generator=g) * 0.1).bfloat16(),
                                                      requires_grad=False))
    o.register_parameter("bias", torch.nn.Parameter(torch.randn(64, generator=g).bfloat16(), requires_grad=False))
    object.__setattr__(block.attn, "o_proj", o)  # (an instance attribute: the stand-in's o_proj is a method)
    block.sm121_rope_in_qkv = rope
    block.sm121_fp32_reduce_o = block.sm121_fp32_reduce_moe = True
    reduced = []
    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_reduce", lambda t: reduced.append(t.dtype) or t)
    experts = block.mlp.experts.routed_experts
    par = experts.moe_config.moe_parallel_config
    experts.moe_config.moe_parallel_config = dataclasses.replace(par, tp_size=2)
    x, _, res0 = _inputs(3, seed=2)
    pos = torch.tensor([5, 900, 77])
    try:
        with torch.no_grad():
            targets, out_c, r_c = _compiled_once(block, x, pos, res0)
            reduced.clear()
            out_e, r_e = block.forward(x, pos, res0.clone())
    finally:
        experts.moe_config.moe_parallel_config = par
    assert "sm121.linear_f32" in targets and "sm121.gpt_oss_moe_mxfp8" in targets, targets
    assert reduced == [torch.float32, torch.float32]  # o_proj's and the experts' shares
    assert out_e.dtype == torch.bfloat16 and torch.equal(out_c, out_e) and torch.equal(r_c, r_e)


@pytest.mark.parametrize("rope", [True, False], ids=["fp8-qkv", "upstream-attention"])
def test_block_in_the_tp_invariant_mode_traces_into_one_graph(env, monkeypatch, rope):
    """The TP-invariant mode on one rank (o_proj's two K halves, the MoE's two rank shards, summed
    in fp32): the block compiles into one Dynamo graph holding two fp32 o_proj shares and two MoE
    shares, no all-reduce, and gives the eager numbers."""
    import vllm.distributed
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    block = build_block(env, "mxfp8", seed=9)
    block.attn = _Fp8Attention(env, 3, lambda q, k, v: q * 2 + torch.cat((k, v), dim=-1).sum(-1, keepdim=True))
    if not rope:
        block.attn.qkv_proj = _QkvCall(block.attn.qkv_proj)
    g = torch.Generator().manual_seed(4)
    o = torch.nn.Module()
    o.tp_rank, o.quant_method, o.sm121_sim_parts = 0, UnquantizedLinearMethod(), 2
    o.register_parameter("weight", torch.nn.Parameter((torch.randn(64, 64, generator=g) * 0.1).bfloat16(),
                                                      requires_grad=False))
    o.register_parameter("bias", torch.nn.Parameter(torch.randn(64, generator=g).bfloat16(), requires_grad=False))
    object.__setattr__(block.attn, "o_proj", o)
    block.sm121_rope_in_qkv = rope
    block.sm121_fp32_reduce_o = block.sm121_fp32_reduce_moe = True
    experts = block.mlp.experts.routed_experts
    experts.sm121_sim_mode = "tp2"
    experts.quant_method._build_simulated_ranks(experts)
    assert experts.sm121_sim_parts == 2
    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_reduce",
                        lambda t: pytest.fail("the simulated ranks never all-reduce"))
    x, _, res0 = _inputs(3, seed=2)
    pos = torch.tensor([5, 900, 77])
    with torch.no_grad():
        targets, out_c, r_c = _compiled_once(block, x, pos, res0)
        out_e, r_e = block.forward(x, pos, res0.clone())
    assert targets.count("sm121.linear_f32") == 2 and targets.count("sm121.gpt_oss_moe_mxfp8") == 2, targets
    assert out_e.dtype == torch.bfloat16 and torch.equal(out_c, out_e) and torch.equal(r_c, r_e)


@pytest.mark.interpreter
def test_block_with_kv_in_qkv_traces_into_one_graph_and_fills_the_cache(env, monkeypatch):
    """With the KV write in the qkv GEMV switched on, the block's forward compiles into one Dynamo
    graph holding ``sm121::dense_fp8_linear_rope_kv`` then vLLM's ``unified_attention_with_output``
    (no ``unified_kv_cache_update``), and gives the eager numbers; the attention layer's nvfp4 cache
    gets the k / v heads (the attention's forward here: a stand-in SM121 impl that doubles q)."""
    from vllm.model_executor.layers.attention import attention as A

    from vllm_sm121.attention.impl import SM121AttentionImpl

    head, hq, hkv = TINY["head_dim"], TINY["num_attention_heads"], TINY["num_key_value_heads"]

    class Impl(SM121AttentionImpl):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kw):
            output.copy_(query * 2)
            return output

    impl = Impl(hq, head, 0.125, hkv, kv_cache_dtype="nvfp4")
    cache = torch.zeros(4, 2, hkv * 16 * (head // 2 + head // 16), dtype=torch.uint8)
    impl._kv(cache)
    impl._calibrating = False
    slots = torch.tensor([3, 17, 40])
    layer = types.SimpleNamespace(impl=impl, layer_name="model.layers.0.self_attn.attn", num_heads=hq,
                                  num_kv_heads=hkv, head_size=head, head_size_v=head)
    monkeypatch.setattr(A, "get_attention_context", lambda name: (None, layer, cache, slots))
    block = build_block(env, "mxfp8")
    block.attn = _Fp8Attention(env, 4, layer)
    block.sm121_rope_in_qkv = block.sm121_kv_in_qkv = True
    x, _, res0 = _inputs(3, seed=5)
    pos = torch.tensor([5, 900, 77])
    with torch.no_grad():
        out_e, r_e = block.forward(x, pos, res0.clone())
        written = cache.clone()
        cache.zero_()
        targets, out_c, r_c = _compiled_once(block, x, pos, res0)
    assert "sm121.dense_fp8_linear_rope_kv" in targets and "vllm.unified_attention_with_output" in targets, targets
    assert targets.index("sm121.dense_fp8_linear_rope_kv") < targets.index("vllm.unified_attention_with_output")
    assert "vllm.unified_kv_cache_update" not in targets
    assert torch.equal(out_c, out_e) and torch.equal(r_c, r_e)
    assert written.count_nonzero() > 0 and torch.equal(cache, written)


def _linked_pair(env, seed: int):
    """Two consecutive tiny blocks (layers n, n + 1 of one config) with FP8 qkv + rotation, linked by
    ``carry.link`` as the constructor links them under $VLLM_SM121_NORM_IN_QKV=1."""
    from vllm_sm121.moe import carry

    pair = []
    for j in range(2):
        block = build_block(env, "mxfp8", seed=seed + j)
        block.attn = _Fp8Attention(env, seed + j, lambda q, k, v: q * 2 + torch.cat((k, v), dim=-1).sum(-1, keepdim=True))
        block.sm121_rope_in_qkv = True
        assert hook.norm_in_qkv_unsupported_reason(block) is None
        pair.append(block)
    a, b = pair
    assert carry.link(a, env.cfgs["mxfp8"], "model.layers.900") == ""  # no layer 899
    key = carry.link(b, env.cfgs["mxfp8"], "model.layers.901")
    b.sm121_norm_in_key = key
    assert key == "model.layers.901.input_layernorm" and a.sm121_norm_out_key == key and b.sm121_norm_out_key == ""
    return a, b


@pytest.mark.parametrize("m,max_t", [(1, None), (3, None), (3, "4"), (6, "4")])
def test_input_norm_carried_from_fc2_into_the_next_qkv(env, m, max_t, monkeypatch):
    """Two linked blocks: block n's FC2 carries block n+1's input add + RMSNorm into its qkv op for
    batches of up to $VLLM_SM121_NORM_IN_QKV_MAX_T tokens (default 1; the op's own norm above). Block
    n's outputs are unchanged; what FC2 carried is upstream's new residual bit for bit, and block
    n+1's outputs are within bf16 rounding-placement of the unlinked pair's (upstream's input norm,
    then the same GEMV)."""
    from vllm_sm121.kernels.next_norm import CARRY_TOKENS_ENV
    from vllm_sm121.moe import carry

    if max_t is None:
        monkeypatch.delenv(CARRY_TOKENS_ENV, raising=False)
    else:
        monkeypatch.setenv(CARRY_TOKENS_ENV, max_t)
    carried = m <= int(max_t or 1)
    a, b = _linked_pair(env, 40 + m)
    x, _, res0 = _inputs(m, seed=30 + m)
    pos = torch.arange(m) * 37
    key = b.sm121_norm_in_key
    with torch.no_grad():
        xa, ra = a(x, pos, res0.clone())
        out, r = b(xa, pos, ra)
        s_carried = carry.buffers(key, TINY["hidden_size"], x.device).s[:m].clone()
        a.sm121_norm_out_key = b.sm121_norm_in_key = ""  # unlinked: upstream's boundary
        xa2, ra2 = a(x, pos, res0.clone())
        out2, r2 = b(xa2, pos, ra2)
        a.sm121_norm_out_key = b.sm121_norm_in_key = key
    assert torch.equal(xa, xa2) and torch.equal(ra, ra2)
    if carried:  # what FC2 carried: block n+1's new residual as upstream's add rounds it
        assert torch.equal(s_carried, (xa.float() + ra.float()).bfloat16())
    else:  # nothing written (the buffers start at zero)
        assert not s_carried.any()
    # r and out both follow block n+1's attention, whose qkv input moved by bf16 rounding placement
    print(f"\nM={m}: carried={carried} vs upstream boundary {rel_l2(out, out2):.2e}, residual {rel_l2(r, r2):.2e}")
    assert rel_l2(out, out2) < 2e-2 and rel_l2(r, r2) < 2e-2, (rel_l2(out, out2), rel_l2(r, r2))


def test_linked_pair_traces_into_one_graph(env):
    """The linked pair compiles into one Dynamo graph (the link is constant attributes) holding the
    MoE op and ``sm121::dense_fp8_linear_rope_norm``, with the eager numbers."""
    a, b = _linked_pair(env, 70)

    def pair(x, pos, res):
        x, res = a(x, pos, res)
        return b(x, pos, res)

    x, _, res0 = _inputs(2, seed=71)
    pos = torch.tensor([3, 250])
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out_c, r_c = torch.compile(pair, backend=capture, fullgraph=True)(x, pos, res0.clone())
        out_e, r_e = pair(x, pos, res0.clone())
    targets = [str(nd.target) for nd in graphs[0].graph.nodes if nd.op == "call_function"]
    assert any("dense_fp8_linear_rope_norm" in t for t in targets), targets
    assert torch.equal(out_c, out_e) and torch.equal(r_c, r_e)


def test_norm_in_qkv_switch_and_reasons(env, monkeypatch):
    """On by default ($VLLM_SM121_NORM_IN_QKV, a traced choice; 0 turns it off); not applied without
    the rotation in the qkv GEMV (the stand-in attention here), and refused with the reason under
    tensor or expert parallelism, where the all-reduce separates FC2 from the add. The token limit
    is checked."""
    from vllm_sm121 import config as C
    from vllm_sm121.kernels import next_norm

    monkeypatch.delenv(C.NORM_IN_QKV_ENV, raising=False)
    assert C.traced_env_choices()["norm_in_qkv"] is True
    monkeypatch.setenv(C.NORM_IN_QKV_ENV, "0")
    assert C.traced_env_choices()["norm_in_qkv"] is False
    block = build_block(env, "mxfp8")
    assert block.sm121_norm_in_key == "" and block.sm121_norm_out_key == ""  # no rotation in the GEMV here
    par = block.mlp.experts.routed_experts.moe_config.moe_parallel_config
    monkeypatch.setattr(par, "tp_size", 2)
    assert "all-reduce" in hook.norm_in_qkv_unsupported_reason(block)
    monkeypatch.delenv(next_norm.CARRY_TOKENS_ENV, raising=False)
    assert next_norm.carry_tokens() == 1
    monkeypatch.setenv(next_norm.CARRY_TOKENS_ENV, "5")
    with pytest.raises(ValueError, match="VLLM_SM121_NORM_IN_QKV_MAX_T=5"):
        next_norm.carry_tokens()


def test_opcheck_qkv_norm_op():
    """``sm121::dense_fp8_linear_rope_norm``: schema and fake implementation on the unlinked path
    (the op's own norm; the carried path reads registered buffers)."""
    g = torch.Generator().manual_seed(8)
    q8, s8, bias, cache = _qkv_op_weights(g)
    for t in (2, 7):
        x = torch.randn(t, 64, generator=g).bfloat16()
        res = torch.randn(t, 64, generator=g).bfloat16()
        pos = torch.randint(0, 512, (t,), generator=g)
        w = (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
        torch.library.opcheck(torch.ops.sm121.dense_fp8_linear_rope_norm.default,
                              (x, res, w, 1e-5, q8, s8, bias, pos, cache, 192, 64, ""), test_utils=("test_faketensor",))
