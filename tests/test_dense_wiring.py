"""``"dense_weights": "fp8"`` wired into vLLM's gpt-oss (``vllm_sm121.dense.hook``, compat shim 0005).

CPU: vLLM's real ``GptOssForCausalLM`` is built through vLLM's own ``initialize_model`` from a
``VllmConfig`` of models/gpt-oss-tiny shrunk to hidden 64 (real ``QKVParallelLinear`` /
``RowParallelLinear`` / ``ParallelLMHead`` / ``LogitsProcessor``, the stock MXFP4 quant config,
a one-rank gloo group); only the attention kernel and the MoE are stand-ins, through the
documented ``attention_cls`` / ``mlp_cls`` overrides (vLLM's ``Attention`` needs a GPU platform).
Checked: which layers get which method for each option value, the refusals, vLLM's
``process_weights_after_loading`` converting them, and qkv_proj / o_proj / ``compute_logits``
against the dequantized references (Triton interpreter on the CPU, the kernel on a GPU).

GPU (``gpu`` marker): ``LLM`` on a random real-format gpt-oss-tiny checkpoint with SM121
attention, teacher-forced prompt logprobs with ``dense_weights`` fp8 vs bf16 (eager and with
CUDA graphs), mean / p99 |delta logprob| printed.
"""

from __future__ import annotations

import gc
import inspect
import itertools
import os
import pathlib
import sys
import types

import pytest
import torch
from helpers import assert_close, logprob_gap, one_rank_groups

from vllm_sm121 import compat
from vllm_sm121.dense import hook

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"], vocab_size=200)
FP8 = {"sm121": {"dense_weights": "fp8"}}
_seeds = itertools.count()


@pytest.fixture(scope="module")
def env():
    """gpt-oss with stand-in attention kernel / MoE, the shim installed, one-rank groups; undone after."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.models import gpt_oss

    class Attention(gpt_oss.OAIAttention):
        def _build_attention(self, **kwargs):  # the documented override: no attention kernel
            return torch.nn.Identity()

    class MLP(torch.nn.Module):
        """Takes MLPBlock's arguments; keeps the bf16 router (which must stay bf16), no experts."""

        def __init__(self, vllm_config, layer_idx, prefix=""):
            super().__init__()
            cfg = vllm_config.model_config.hf_config
            self.router = ReplicatedLinear(cfg.hidden_size, cfg.num_local_experts, bias=True, quant_config=None,
                                           prefix=f"{prefix}.router")

        def forward(self, x):
            return x

    class Block(gpt_oss.TransformerBlock):
        attention_cls = Attention
        mlp_cls = MLP

    def vllm_config(additional=None, **overrides):
        mc = ModelConfig(model=str(ROOT / "models" / "gpt-oss-tiny"), skip_tokenizer_init=True,
                         hf_overrides={**TINY, **overrides}, dtype=torch.bfloat16)
        return VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                          additional_config=additional or {})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpt_oss.GptOssModel, "block_cls", Block)
        mp.setattr(gpt_oss.GptOssForCausalLM, "__init__", gpt_oss.GptOssForCausalLM.__init__)  # restored after
        compat.register_gpt_oss_dense_weights()  # gpt_oss.py is imported: wraps at once
        with one_rank_groups(vllm_config()):
            yield types.SimpleNamespace(vllm_config=vllm_config, gpt_oss=gpt_oss)


def build(env, additional=None, **overrides):
    """vLLM's initialize_model (model class from the registry, its config current)."""
    from vllm.model_executor.model_loader.utils import initialize_model

    cfg = env.vllm_config(additional, **overrides)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as vLLM's loader (whose context manager does not restore on errors)
    try:
        return initialize_model(cfg), cfg
    finally:
        torch.set_default_dtype(old)


def methods(model) -> dict[str, str]:
    return {n: type(m.quant_method).__name__ for n, m in model.named_modules() if hasattr(m, "quant_method")}


def test_shim_wraps_gpt_oss_once_with_upstreams_signature(env):
    init = env.gpt_oss.GptOssForCausalLM.__init__
    assert getattr(init, "_sm121_shim", False)
    compat._install_gpt_oss_dense_hook(env.gpt_oss)  # idempotent
    assert env.gpt_oss.GptOssForCausalLM.__init__ is init
    params = inspect.signature(init).parameters  # initialize_model checks for these two
    assert "vllm_config" in params and "prefix" in params
    # Only gpt-oss: an Eagle3 drafter (another class) is not wrapped.
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    assert not getattr(Eagle3LlamaForCausalLM.__init__, "_sm121_shim", False)


def test_shim_is_listed_with_its_patch():
    assert any(s.patch.startswith("0005-") and "GptOssForCausalLM.__init__" in s.symbol for s in compat.SHIMS)


@pytest.mark.parametrize("additional", [None, {"sm121": {"dense_weights": "bf16"}}, {"sm121": {"moe": "upstream"}}],
                         ids=["absent", "bf16", "other-option"])
def test_without_fp8_every_layer_keeps_upstreams_method(env, additional):
    model, _ = build(env, additional)
    got = methods(model)
    assert got["lm_head"] == "UnquantizedEmbeddingMethod"
    assert {got[f"model.layers.{i}.attn.{p}"] for i in range(2) for p in ("qkv_proj", "o_proj")} == {
        "UnquantizedLinearMethod"}


def test_fp8_swaps_qkv_o_and_head_only(env, caplog):
    with caplog.at_level("INFO", logger="vllm.sm121"):
        model, cfg = build(env, FP8)
    got = methods(model)
    for i in range(2):
        assert got[f"model.layers.{i}.attn.qkv_proj"] == got[f"model.layers.{i}.attn.o_proj"] == \
            "Sm121DenseFp8LinearMethod"
        assert got[f"model.layers.{i}.mlp.router"] == "UnquantizedLinearMethod"
    assert got["lm_head"] == "Sm121DenseFp8LMHeadMethod"
    assert got["model.embedding"] == "UnquantizedEmbeddingMethod"
    assert model.lm_head.weight.dtype == torch.bfloat16  # loading is upstream's until converted
    # applying again (a second construction hook, a reload) swaps nothing and still reports
    again = hook.apply_dense_weights(model, cfg)
    assert len(again.layers) == 5 and methods(model) == got
    # one INFO line with the count and the bytes saved (5 layers of [N, 64] bf16 -> e4m3 + fp32 scale)
    lines = [r.getMessage() for r in caplog.records if "dense_weights fp8" in r.getMessage()]
    assert len(lines) == 1 and "5 layers" in lines[0] and "saves" in lines[0], lines
    rows = 2 * (128 + 64) + 256  # qkv (2+2*1 heads x 32) and o per layer, head padded to 256
    assert again.bf16_bytes == 2 * 64 * rows and again.fp8_bytes == 64 * rows + 4 * rows


@pytest.mark.interpreter
def test_load_convert_and_run_through_vllm(env, device):
    """vLLM's process_weights_after_loading converts the three layers; their forward and
    compute_logits match the dequantized references and stay at e4m3's error from bf16."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from vllm_sm121.kernels.dense import dense_fp8_linear_torch

    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter on the CPU")
    model, cfg = build(env, FP8)
    g = torch.Generator().manual_seed(next(_seeds))
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    names = ("model.layers.0.attn.qkv_proj", "model.layers.1.attn.o_proj", "lm_head")
    bf16 = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))
    for n in names:
        layer = model.get_submodule(n)
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (layer.weight.shape[0],)
        assert not [pn for pn, p in layer.named_parameters() if p.dtype == torch.bfloat16 and p.dim() == 2]
    model.to(device)
    inputs = {n: torch.randn(5, 64, generator=g).bfloat16().to(device) for n in names}
    with set_current_vllm_config(cfg), torch.no_grad():
        outs = {n: model.get_submodule(n)(inputs[n])[0] for n in names[:2]}
        outs["lm_head"] = model.compute_logits(inputs["lm_head"])  # LogitsProcessor -> the head's apply
    assert outs["lm_head"].shape == (5, TINY["vocab_size"])  # padded rows dropped by LogitsProcessor
    for n, out in outs.items():
        layer, x = model.get_submodule(n), inputs[n]
        bias = getattr(layer, "bias", None)
        ref = dense_fp8_linear_torch(x, layer.weight, layer.weight_scale, bias)[:, :out.shape[1]]
        assert out.dtype == torch.bfloat16
        assert_close(out, ref, atol=2e-2, rtol=2e-2, what=n)
        full = x.float() @ bf16[n].to(device).float().T[:, :out.shape[1]]
        if bias is not None:
            full = full + bias.float()
        rel = ((out.float() - full).norm() / full.norm()).item()
        assert rel < 0.05, (n, rel)


@pytest.mark.parametrize("override, match", [
    (dict(tie_word_embeddings=True), "tied word embeddings"),
    (dict(head_dtype="float32"), "head_dtype"),
])
def test_refused_at_construction(env, override, match):
    with pytest.raises(ValueError, match=rf"dense_weights.*fp8.*{match}.*supported: "):
        build(env, FP8, **override)
    build(env, None, **override)  # bf16: upstream's model, untouched


def _ns(cfg, **kw):
    base = dict(model_config=cfg.model_config, additional_config=FP8, lora_config=None, speculative_config=None,
                parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    return types.SimpleNamespace(**{**base, **kw})


def test_unsupported_configurations(env):
    cfg = env.vllm_config(FP8)
    assert hook.unsupported_reason(cfg) is None
    par = lambda tp, pp: types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp)  # noqa: E731
    draft = lambda method="eagle3", **hf: types.SimpleNamespace(method=method, draft_model_config=(  # noqa: E731
        types.SimpleNamespace(hf_config=types.SimpleNamespace(**hf))))
    assert hook.unsupported_reason(_ns(cfg, parallel_config=par(2, 1))) is None  # each rank converts its shard
    assert "pipeline_parallel_size=2" in hook.unsupported_reason(_ns(cfg, parallel_config=par(1, 2)))
    assert "LoRA" in hook.unsupported_reason(_ns(cfg, lora_config=object()))
    # Eagle3 drafters: gpt-oss's have a 32000-token head (fine); one with the target's vocabulary
    # would reach vLLM's torch.equal(target head, draft head) with e4m3 vs bf16.
    assert hook.unsupported_reason(_ns(cfg, speculative_config=draft(vocab_size=200, draft_vocab_size=32))) is None
    assert "torch.equal" in hook.unsupported_reason(_ns(cfg, speculative_config=draft(vocab_size=200,
                                                                                        draft_vocab_size=200)))
    assert "torch.equal" in hook.unsupported_reason(_ns(cfg, speculative_config=draft(vocab_size=200)))
    # a separate draft model (e.g. gpt-oss-20b for 120b) never shares the head
    assert hook.unsupported_reason(_ns(cfg, speculative_config=draft("draft_model", vocab_size=200))) is None
    assert hook.unsupported_reason(_ns(cfg, speculative_config=types.SimpleNamespace(draft_model_config=None))) is None


def test_already_quantized_layer_is_refused(env):
    from vllm.model_executor.layers.linear import LinearMethodBase

    class OtherMethod(LinearMethodBase):
        def create_weights(self, *a, **k):
            pass

        def apply(self, layer, x, bias=None):
            return x

    model, _ = build(env, None)
    model.model.layers[1].attn.o_proj.quant_method = OtherMethod()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.attn\.o_proj has quant method OtherMethod"):
        hook.apply_dense_weights(model, env.vllm_config(FP8))
    assert methods(model)["lm_head"] == "UnquantizedEmbeddingMethod"  # nothing swapped half-way


def test_option_values():
    from vllm_sm121 import config

    assert config.parse(FP8).dense_weights == "fp8"
    with pytest.raises(ValueError, match=r"'dense_weights': 'mxfp4' is not implemented.*supported now: bf16, fp8"):
        config.parse({"sm121": {"dense_weights": "mxfp4"}})


def test_two_post_import_hooks_on_one_module(tmp_path, monkeypatch):
    """gpt_oss.py carries two shims (0004 block, 0005 dense): both must run on its import."""
    (tmp_path / "sm121_probe_two.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    first, second = (lambda m: seen.append("a")), (lambda m: seen.append("b"))
    compat.on_import("sm121_probe_two", first)
    compat.on_import("sm121_probe_two", second)
    compat.on_import("sm121_probe_two", second)  # the same hook twice: once
    import sm121_probe_two  # noqa: F401

    assert sorted(seen) == ["a", "b"]
    sys.modules.pop("sm121_probe_two", None)


# ---- GPU: vLLM end to end ----------------------------------------------------------------------

PROMPT_LENS = (1, 17, 129, 300, 700)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 8000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _prompt_logprobs(ckpt, dense: str, prompts, graphs: bool):
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # as `vllm serve`: workers load the plugin by entry point
    from vllm import LLM, SamplingParams

    kw = dict(compilation_config={"max_cudagraph_capture_size": 8}) if graphs else dict(enforce_eager=True)
    llm = LLM(model=ckpt, skip_tokenizer_init=True, attention_backend="SM121", max_model_len=2048,
              max_num_batched_tokens=256, gpu_memory_utilization=0.3, enable_prefix_caching=False, seed=0,
              additional_config={"sm121": {"dense_weights": dense}}, **kw)
    try:
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [torch.tensor([d[t].logprob for d, t in zip((o.prompt_logprobs or [None])[1:], p[1:])])
                for o, p in zip(outs, prompts)]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


_diffs = logprob_gap


def _fake_quant_copy(ckpt: str, dst: pathlib.Path) -> str:
    """The checkpoint with q/k/v/o_proj and lm_head replaced by their FP8 per-channel values
    (codes x scale, rounded to bf16): a bf16 model computing what the FP8 layers compute."""
    import shutil

    from safetensors.torch import load_file, save_file

    from vllm_sm121.kernels.dense import fp8_per_channel_dequantize, fp8_per_channel_quantize

    shutil.copytree(ckpt, dst)
    path = dst / "model.safetensors"
    tensors = load_file(path)
    for name, t in tensors.items():
        if name == "lm_head.weight" or name.endswith(tuple(f"{p}_proj.weight" for p in "qkvo")):
            tensors[name] = fp8_per_channel_dequantize(*fp8_per_channel_quantize(t)).bfloat16()
    save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


@pytest.mark.gpu
def test_fp8_dense_prompt_logprobs_vs_bf16(tmp_path_factory, capfd):
    """Random real-format gpt-oss-tiny (bf16 qkv / o / lm_head ~ N(0, 0.02)), SM121 attention,
    teacher-forced prompt logprobs, eager and CUDA graphs; the workers must log the conversion.

    Three references: bf16 (stock); ``fake_quant``, a bf16 run of the same checkpoint with those
    five weights replaced by their FP8 values (codes x scale, rounded to bf16), i.e. what FP8
    weights cost with stock kernels; FP8 must deviate from bf16 no more than that, and be much
    closer to ``fake_quant`` than to bf16 (what is left: kernel and accumulation order, the bf16
    rounding of the fake-quant weights, amplified by MoE routing flips in a random model; on an
    H100 it was 1.2-1.6x the FLASH_ATTN-vs-TRITON_ATTN spread test_e2e_gpu.py measures on this model)."""
    from vllm_sm121.testing.checkpoint import write_random_gpt_oss_checkpoint

    ckpt = write_random_gpt_oss_checkpoint(str(ROOT / "models" / "gpt-oss-tiny"), str(tmp_path_factory.mktemp("t")),
                                           seed=0)
    fq_ckpt = _fake_quant_copy(ckpt, tmp_path_factory.mktemp("fq") / "ckpt")
    prompts = _prompts()
    bf16 = _prompt_logprobs(ckpt, "bf16", prompts, graphs=False)
    fake_quant = _prompt_logprobs(fq_ckpt, "bf16", prompts, graphs=False)
    signal = torch.cat(bf16).std().item()
    cost = _diffs(fake_quant, bf16)
    capfd.readouterr()
    for graphs in (False, True):
        fp8 = _prompt_logprobs(ckpt, "fp8", prompts, graphs=graphs)
        log = capfd.readouterr()
        gap, ref_gap = _diffs(fp8, bf16), _diffs(fp8, fake_quant)
        with capfd.disabled():  # (the next readouterr would swallow it)
            print(f"\n[tiny] dense_weights fp8 (SM121, graphs={graphs}), |delta logprob| mean / p99: vs bf16 "
                  f"{gap[0]:.4g} / {gap[1]:.4g}; vs bf16 with the FP8 weight values "
                  f"{ref_gap[0]:.4g} / {ref_gap[1]:.4g}; "
                  f"FP8 weight values in bf16 vs bf16 {cost[0]:.4g} / {cost[1]:.4g}; logprob std {signal:.3g}; "
                  f"{sum(len(x) for x in bf16)} tokens")
        assert "dense_weights fp8: 9 layers" in log.out + log.err, "the workers did not convert the layers"
        assert 0 < gap[0] <= 1.25 * cost[0] + 0.01, (gap, cost)
        assert ref_gap[0] < 0.5 * gap[0] and ref_gap[1] < gap[1], (ref_gap, gap)


def _shard_spy(method):
    """Record the weight / scale shapes the wrapped method's apply receives."""
    seen = []
    inner_apply = method.inner.apply

    def apply(layer, x, bias=None):
        seen.append((tuple(layer.weight.shape), tuple(getattr(layer, "weight_scale", torch.empty(0)).shape)))
        return inner_apply(layer, x, bias)

    method.inner.apply = apply
    return seen


@pytest.mark.parametrize("dense", ["bf16", pytest.param("fp8", marks=pytest.mark.interpreter)])
def test_tp_invariant_lm_head_computes_two_vocab_shards(env, monkeypatch, device, dense):
    """$VLLM_SM121_TP_INVARIANT: the lm_head's method (upstream's bf16 one or the FP8 one) runs as
    TP=2's two vocab-parallel ranks -- each on its half of the padded rows (and of the FP8 scales),
    the halves concatenated as vLLM's all-gather concatenates them -- and the logits equal that."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from vllm_sm121.kernels.dense import dense_fp8_linear_torch
    from vllm_sm121.tp_invariant import VocabShardsLMHeadMethod

    if dense == "fp8" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter on the CPU")
    off, _ = build(env, FP8 if dense == "fp8" else None)
    assert not isinstance(off.lm_head.quant_method, VocabShardsLMHeadMethod)  # mode off: untouched
    monkeypatch.setenv("VLLM_SM121_TP_INVARIANT", "tp2")
    model, cfg = build(env, FP8 if dense == "fp8" else None)
    method = model.lm_head.quant_method
    assert isinstance(method, VocabShardsLMHeadMethod)
    assert type(method.inner).__name__ == ("Sm121DenseFp8LMHeadMethod" if dense == "fp8" else "UnquantizedEmbeddingMethod")
    g = torch.Generator().manual_seed(next(_seeds))
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))  # through the wrapper
    head = model.lm_head
    rows = head.num_embeddings_padded
    assert rows == 256 and head.weight.shape[0] == rows  # vocab 200 padded to 64s: 128 rows per rank
    assert head.weight.dtype == (torch.float8_e4m3fn if dense == "fp8" else torch.bfloat16)
    seen = _shard_spy(method)
    model.to(device)
    x = torch.randn(5, 64, generator=g).bfloat16().to(device)
    with set_current_vllm_config(cfg), torch.no_grad():
        logits = model.compute_logits(x)
    scale_shape = (128,) if dense == "fp8" else (0,)
    assert seen == [((128, 64), scale_shape)] * 2
    w = head.weight
    if dense == "fp8":
        halves = [dense_fp8_linear_torch(x, w[r * 128:(r + 1) * 128], head.weight_scale[r * 128:(r + 1) * 128], None)
                  for r in range(2)]
        assert_close(logits, torch.cat(halves, -1)[:, :200], atol=2e-2, rtol=2e-2, what="lm_head shards")
    else:
        halves = [torch.nn.functional.linear(x, w[r * 128:(r + 1) * 128]) for r in range(2)]
        assert torch.equal(logits, torch.cat(halves, -1)[:, :200])  # the same GEMMs as the two ranks'
        assert_close(logits, torch.nn.functional.linear(x, w)[:, :200], atol=2e-2, rtol=2e-2, what="vs one GEMM")


def test_tp_invariant_lm_head_refusals(env, monkeypatch):
    from vllm_sm121.tp_invariant import VocabShardsLMHeadMethod, apply_tp_invariant_lm_head, lm_head_unsupported_reason

    monkeypatch.setenv("VLLM_SM121_TP_INVARIANT", "ep2")
    with pytest.raises(ValueError, match=r"VLLM_SM121_TP_INVARIANT=ep2: the lm_head runs in head_dtype.*unset it"):
        build(env, None, head_dtype="float32")
    model, cfg = build(env, None)
    wrapped = model.lm_head.quant_method
    assert apply_tp_invariant_lm_head(model, cfg) and model.lm_head.quant_method is wrapped  # idempotent
    assert isinstance(wrapped, VocabShardsLMHeadMethod)
    model.lm_head.tp_size = 2
    assert "tensor_parallel_size=2" in lm_head_unsupported_reason(model)
    model.lm_head.tp_size, model.lm_head.num_embeddings_padded = 1, 320
    assert "added (LoRA) vocabulary rows" in lm_head_unsupported_reason(model)
    model.lm_head.num_embeddings_padded = model.lm_head.org_vocab_size_padded = 255
    assert "does not split over 2 ranks" in lm_head_unsupported_reason(model)
    model.lm_head.cpu_linear = object()  # vLLM's CPU platform's pre-packed GEMM
    with pytest.raises(ValueError, match="needs a CUDA device"):
        wrapped.apply(model.lm_head, torch.zeros(1, 64, dtype=torch.bfloat16))
    assert "no vocab-parallel lm_head" in lm_head_unsupported_reason(torch.nn.Linear(2, 2))
    monkeypatch.setenv("VLLM_SM121_TP_INVARIANT", "")
    again, cfg = build(env, None)
    assert not apply_tp_invariant_lm_head(again, cfg)
