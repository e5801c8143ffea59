"""The SM121 backend inside vLLM, without a GPU: name resolution, declarations, validation messages."""

import pytest
import torch

import vllm_sm121


@pytest.fixture(scope="module", autouse=True)
def registered():
    vllm_sm121.register()


def test_name_resolves_everywhere_vllm_looks_it_up():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_sm121.attention.backend import SM121AttentionBackend

    member = AttentionBackendEnum["SM121"]  # what --attention-backend / -ac.backend / -sc use
    assert member is AttentionBackendEnum.CUSTOM
    assert member.get_class() is SM121AttentionBackend
    # Attention.__init__ looks the backend up by its own get_name():
    assert AttentionBackendEnum[SM121AttentionBackend.get_name()] is member


def test_attention_config_accepts_the_flag_value():
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cfg = AttentionConfig(backend="SM121")
    assert cfg.backend is AttentionBackendEnum.CUSTOM


def test_alias_survives_pickling_into_a_fresh_process():
    """Spawned engine/worker processes unpickle the config before plugins load: CUSTOM pickles by value."""
    import pickle

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    blob = pickle.dumps(AttentionBackendEnum["SM121"])
    assert pickle.loads(blob) is AttentionBackendEnum.CUSTOM


def _validate(**over):
    from vllm.platforms.interface import DeviceCapability

    from vllm_sm121.attention.backend import SM121AttentionBackend

    cfg = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
               has_sink=True, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
               device_capability=DeviceCapability(12, 1), attn_type="decoder", has_sliding_window=True)
    cfg.update(over)
    return SM121AttentionBackend.validate_configuration(**cfg)


def test_gpt_oss_configuration_is_valid_on_sm121_and_sm90():
    from vllm.platforms.interface import DeviceCapability

    for cap in (DeviceCapability(12, 1), DeviceCapability(12, 0), DeviceCapability(9, 0)):
        for kv in ("auto", "bfloat16", "fp8", "fp8_e4m3", "nvfp4"):
            for bs in (16, 32, 64):
                assert _validate(device_capability=cap, kv_cache_dtype=kv, block_size=bs) == []


@pytest.mark.parametrize(
    "over,needle",
    [
        (dict(head_size=48), "head_size=48 not supported (supported: [32, 64"),
        (dict(kv_cache_dtype="int8_per_token_head"), "--kv-cache-dtype int8_per_token_head not supported (supported: auto, bfloat16"),
        (dict(kv_cache_dtype="nvfp4", head_size=80), "--kv-cache-dtype nvfp4 needs head_size in [16, 32, 64, 128, 256]"),
        (dict(block_size=8), "block_size=8 not supported (supported: multiples of 16)"),
        (dict(dtype=torch.float32), "dtype=torch.float32 not supported"),
        (dict(device_capability=None), "compute capability"),
    ],
)
def test_invalid_configurations_are_named(over, needle):
    from vllm.platforms.interface import DeviceCapability

    if over.get("device_capability", 1) is None:
        over["device_capability"] = DeviceCapability(8, 0)
    reasons = _validate(**over)
    assert any(needle in r for r in reasons), reasons
    if "device_capability" in over:
        assert any("9.x" in r and "12.x" in r for r in reasons)


def test_kv_cache_shape_and_bad_dtype():
    from vllm_sm121.attention.backend import SM121AttentionBackend

    assert SM121AttentionBackend.get_kv_cache_shape(10, 16, 8, 64) == (10, 2, 8, 16, 64)
    with pytest.raises(ValueError, match="block_size=24"):
        SM121AttentionBackend.get_kv_cache_shape(10, 24, 8, 64)
    with pytest.raises(ValueError, match="nvfp4 needs head_size"):
        SM121AttentionBackend.get_kv_cache_shape(10, 16, 8, 80, "nvfp4")


@pytest.mark.parametrize("block_size,num_kv_heads,head_size", [(16, 8, 64), (32, 8, 64), (16, 2, 128), (64, 4, 64)])
@pytest.mark.parametrize("sliding", [None, 128])
def test_nvfp4_cache_shape_is_exactly_vllms_page(block_size, num_kv_heads, head_size, sliding):
    """vLLM views the raw page bytes as uint8 of our shape: the element count must equal its page size."""
    import math

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, SlidingWindowSpec

    from vllm_sm121.attention.backend import SM121AttentionBackend

    kw = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.uint8,
              kv_quant_mode=KVQuantMode.NVFP4)
    spec = SlidingWindowSpec(sliding_window=sliding, **kw) if sliding else FullAttentionSpec(**kw)
    shape = SM121AttentionBackend.get_kv_cache_shape(7, block_size, num_kv_heads, head_size, "nvfp4")
    assert shape[:2] == (7, 2)
    assert math.prod(shape[1:]) == spec.page_size_bytes
    bf16 = SM121AttentionBackend.get_kv_cache_shape(7, block_size, num_kv_heads, head_size)
    assert math.prod(shape) * 32 == math.prod(bf16) * 2 * 9  # 9/32 of the bf16 bytes


def test_impl_keeps_per_layer_hyperparameters():
    from vllm_sm121.attention.impl import SM121AttentionImpl

    full = SM121AttentionImpl(64, 64, 0.125, 8, None, None, "auto", None, "decoder", None)
    swa = SM121AttentionImpl(64, 64, 1 / 11.3, 8, None, 128, "fp8", 30.0, "decoder", None,
                             sinks=torch.zeros(64))
    assert (full.sliding_window, full.logits_soft_cap, full.sinks) == (None, None, None)
    assert (swa.sliding_window, swa.logits_soft_cap, swa.scale) == (128, 30.0, pytest.approx(1 / 11.3))
    with pytest.raises(ValueError, match="ALiBi"):
        SM121AttentionImpl(64, 64, 0.125, 8, [1.0] * 64, None, "auto", None, "decoder", None)
    with pytest.raises(ValueError, match="sinks has 3 entries"):
        SM121AttentionImpl(64, 64, 0.125, 8, None, None, "auto", None, "decoder", None, sinks=torch.zeros(3))


def test_sm121_options_are_validated_when_layers_are_built(monkeypatch):
    """--additional-config '{"sm121": ...}' with an unknown key or a value not implemented in this
    release fails when vLLM builds the model's SM121 layers (its config current), naming the option."""
    import types

    import vllm.config

    from vllm_sm121.attention.impl import SM121AttentionImpl

    def build(additional):
        monkeypatch.setattr(vllm.config, "get_current_vllm_config",
                            lambda: types.SimpleNamespace(additional_config=additional))
        return SM121AttentionImpl(64, 64, 0.125, 8, None, None, "auto", None, "decoder", None)

    build({"sm121": {"moe": "upstream"}})
    build({"other_plugin": {"x": 1}})
    with pytest.raises(ValueError, match="unknown option"):
        build({"sm121": {"mo": "upstream"}})
    with pytest.raises(ValueError, match="'dense_weights': 'mxfp4' is not implemented"):
        build({"sm121": {"dense_weights": "mxfp4"}})
