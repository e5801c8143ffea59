"""``sm121_mxfp4``: registration, which checkpoints/configs it claims, which method each layer gets."""

import types

import pytest
import torch

import vllm_sm121
from vllm_sm121 import moe
from vllm_sm121.moe import quant_config as qc

GPT_OSS = types.SimpleNamespace(model_type="gpt_oss")


@pytest.fixture(autouse=True)
def moe_ready(monkeypatch):
    """The MoE path is gated off (vllm_sm121.moe.READY) until it passes on a GPU; these tests
    exercise its wiring as it will be switched on, and register its config themselves."""
    monkeypatch.setattr(moe, "READY", True)  # config.implemented("moe") reads it at parse time
    moe.register()
LLAMA = types.SimpleNamespace(model_type="llama")


def vllm_config(backend="SM121", sm121=None, hf_config=GPT_OSS, quant_method="mxfp4"):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_sm121.register()
    hf = types.SimpleNamespace(**vars(hf_config), quantization_config={"quant_method": quant_method})
    return types.SimpleNamespace(
        attention_config=types.SimpleNamespace(backend=AttentionBackendEnum[backend] if backend else None),
        additional_config={"sm121": sm121} if sm121 is not None else {},
        model_config=types.SimpleNamespace(hf_config=hf),
    )


def probe(monkeypatch, cfg, quant_method="mxfp4", hf_config=GPT_OSS, user_quant=None):
    monkeypatch.setattr(qc, "_current_vllm_config", lambda: cfg)
    return qc.Sm121Mxfp4Config.override_quantization_method({"quant_method": quant_method}, user_quant,
                                                            hf_config=hf_config)


@pytest.mark.parametrize("quant_method", ["mxfp4", "gpt_oss_mxfp4"])
def test_sm121_backend_claims_gpt_oss_mxfp4(monkeypatch, quant_method):
    assert probe(monkeypatch, vllm_config(), quant_method) == "sm121_mxfp4"
    assert probe(monkeypatch, vllm_config(), quant_method, user_quant="mxfp4") == "sm121_mxfp4"


def test_moe_upstream_declines(monkeypatch):
    assert probe(monkeypatch, vllm_config(sm121={"moe": "upstream"})) is None


@pytest.mark.parametrize("backend", [None, "TRITON_ATTN", "FLASH_ATTN"])
def test_other_attention_backends_keep_upstream_by_default(monkeypatch, backend):
    assert probe(monkeypatch, vllm_config(backend=backend)) is None


def test_non_gpt_oss_checkpoints_are_never_claimed(monkeypatch):
    cfg = vllm_config()
    assert probe(monkeypatch, cfg, hf_config=LLAMA) is None
    assert probe(monkeypatch, cfg, hf_config=None) is None
    assert probe(monkeypatch, cfg, quant_method="fp8") is None
    assert probe(monkeypatch, None, hf_config=LLAMA) is None
    assert probe(monkeypatch, cfg, user_quant="fp8") is None  # the user asked for another method


def test_provisional_claim_without_a_current_config(monkeypatch):
    """vLLM's engine path: probed from ModelConfig.__post_init__, before any VllmConfig exists."""
    assert probe(monkeypatch, None) == "sm121_mxfp4"


def test_resolve_moe_table():
    assert moe.resolve_moe(vllm_config()) == "mxfp8"
    assert moe.resolve_moe(vllm_config(sm121={"moe": "upstream"})) == "upstream"
    assert moe.resolve_moe(vllm_config(backend="TRITON_ATTN")) == "upstream"
    assert moe.resolve_moe(vllm_config(quant_method="gpt_oss_mxfp4")) == "mxfp8"
    assert moe.resolve_moe(vllm_config(hf_config=LLAMA)) == "upstream"
    with pytest.raises(ValueError, match="moe"):
        moe.resolve_moe(vllm_config(sm121={"moe": "mxfp6"}))


def test_explicit_mxfp8_without_sm121_backend():
    from vllm_sm121 import config

    cfg = vllm_config(backend="TRITON_ATTN", sm121={"moe": "mxfp8"})
    if "mxfp8" in config.implemented("moe"):
        assert moe.resolve_moe(cfg) == "mxfp8"
        assert moe.resolve_moe(vllm_config(backend=None, sm121={"moe": "mxfp8"}, hf_config=LLAMA)) == "upstream"
    else:
        with pytest.raises(ValueError, match="not implemented"):
            moe.resolve_moe(cfg)


def test_registered_under_its_name_and_builds_the_gpt_oss_config():
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        get_quantization_config,
    )
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config

    moe.register()
    moe.register()  # idempotent
    assert QUANTIZATION_METHODS.count("sm121_mxfp4") == 1
    cls = get_quantization_config("sm121_mxfp4")
    assert cls is qc.Sm121Mxfp4Config
    inst = cls.from_config({"quant_method": "mxfp4"})
    assert isinstance(inst, GptOssMxfp4Config)
    assert inst.get_name() == "gpt_oss_mxfp4"  # RoutedExperts.weight_loader keys on this name
    assert torch.bfloat16 in inst.get_supported_act_dtypes()


def _routed_experts_stub(c):
    from test_moe_block import make_moe_config
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    layer = RoutedExperts.__new__(RoutedExperts)  # isinstance() is all get_quant_method looks at
    torch.nn.Module.__init__(layer)
    layer.moe_config = make_moe_config(c)
    layer.renormalize, layer.scoring_func, layer.use_grouped_topk = True, "softmax", False
    layer.custom_routing_function = layer.e_score_correction_bias = None
    layer.apply_router_weight_on_input = False
    return layer


@pytest.mark.parametrize("sm121,ours", [(None, True), ({"moe": "upstream"}, False)])
def test_get_quant_method_resolves_with_the_current_config(monkeypatch, sm121, ours):
    import vllm.config
    from test_moe_block import Case
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config

    from vllm_sm121.moe.method import Sm121GptOssMxfp4Config, Sm121Mxfp4MoEMethod

    cfg = vllm_config(sm121=sm121)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: cfg)
    upstream = object()
    monkeypatch.setattr(GptOssMxfp4Config, "get_quant_method", lambda self, layer, prefix: upstream)
    inst = Sm121GptOssMxfp4Config.from_config({})
    method = inst.get_quant_method(_routed_experts_stub(Case(1, 64, 64, 4, 2)), "model.layers.0.mlp.experts")
    assert isinstance(method, Sm121Mxfp4MoEMethod) if ours else method is upstream
    assert inst.get_quant_method(torch.nn.Linear(2, 2), "model.layers.0.attn.qkv") is upstream


def test_unsupported_layer_falls_back_by_default(monkeypatch):
    import vllm.config
    from test_moe_block import Case
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config

    from vllm_sm121.moe.method import Sm121GptOssMxfp4Config

    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: vllm_config())
    upstream = object()
    monkeypatch.setattr(GptOssMxfp4Config, "get_quant_method", lambda self, layer, prefix: upstream)
    layer = _routed_experts_stub(Case(1, 96, 64, 4, 2))  # hidden 96: not a multiple of 64
    assert Sm121GptOssMxfp4Config.from_config({}).get_quant_method(layer, "experts") is upstream


def test_vllm_model_config_probe_picks_it_for_gpt_oss(monkeypatch):
    """vLLM's own probe (ModelConfig._verify_quantization) on a real gpt-oss config.json: claimed
    provisionally without a current config, declined when a current config says "upstream"."""
    from vllm.config import ModelConfig

    vllm_sm121.register()
    moe.register()
    monkeypatch.setattr(qc, "_current_vllm_config", lambda: None)
    assert ModelConfig(model="models/gpt-oss-tiny", skip_tokenizer_init=True).quantization == "sm121_mxfp4"
    monkeypatch.setattr(qc, "_current_vllm_config", lambda: vllm_config(sm121={"moe": "upstream"}))
    assert ModelConfig(model="models/gpt-oss-tiny", skip_tokenizer_init=True).quantization == "gpt_oss_mxfp4"


def test_gated_off_until_ready(monkeypatch):
    """While READY is False: nothing is claimed, the option value is refused, stock MoE runs."""
    from vllm_sm121 import config

    monkeypatch.setattr(moe, "READY", False)
    assert moe.resolve_moe(vllm_config()) == "upstream"
    assert "mxfp8" not in config.OPTIONS["moe"].implemented and config.implemented("moe") == ("upstream",)
    with pytest.raises(ValueError, match="not implemented"):
        config.parse({"sm121": {"moe": "mxfp8"}})
    monkeypatch.setattr(moe, "READY", True)  # the gate is read at parse time
    assert config.parse({"sm121": {"moe": "mxfp8"}}).moe == "mxfp8"


def test_experimental_env_opts_in_every_process():
    """$VLLM_SM121_MOE_EXPERIMENTAL=1 (read at import, inherited by vLLM's engine processes) turns
    the gated MoE on, option value included; unset or any other value keeps it off."""
    import os
    import subprocess
    import sys

    code = ("from vllm_sm121 import config, moe; "
            "print(moe.READY, 'mxfp8' in config.implemented('moe'))")
    for value, want in (("1", "True True"), ("0", "False False"), (None, "False False")):
        env = {k: v for k, v in os.environ.items() if k != moe.EXPERIMENTAL_ENV}
        if value is not None:
            env[moe.EXPERIMENTAL_ENV] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == want.split(), (value, out.stdout, out.stderr[-2000:])
