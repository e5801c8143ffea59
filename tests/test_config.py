"""The ``--additional-config '{"sm121": {...}}'`` table: defaults, validation, error messages."""

import pytest

from vllm_sm121 import config


def test_defaults_when_absent():
    for cfg in (None, {}, {"other_plugin": {"x": 1}}):
        assert config.parse(cfg) == config.Sm121Config()


def test_implemented_values_accepted():
    for name, opt in config.OPTIONS.items():
        for value in opt.implemented:
            assert getattr(config.parse({"sm121": {name: value}}), name) == value


def test_unknown_option_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['mo'\].*moe, dense_weights, cudagraph"):
        config.parse({"sm121": {"mo": "mxfp8"}})


def test_bad_value_names_option_and_values():
    with pytest.raises(ValueError, match=r"'int4' is not a valid value for 'dense_weights'; supported: "):
        config.parse({"sm121": {"dense_weights": "int4"}})


def test_not_implemented_value_is_an_error_not_a_fallback():
    for name, opt in config.OPTIONS.items():
        for value in set(opt.values) - set(config.implemented(name)):
            with pytest.raises(ValueError, match=f"'{name}'.*not implemented"):
                config.parse({"sm121": {name: value}})


def test_section_must_be_an_object():
    with pytest.raises(ValueError, match="must be a JSON object"):
        config.parse({"sm121": "mxfp8"})


def test_traced_choices_recorded_once_for_the_compile_cache(monkeypatch):
    """VLLM_SM121_ROUTER_IN_NORM changes the traced graph; vLLM's compile-cache key hashes
    additional_config, not VLLM_SM121_*: the choice is copied there once, first record winning."""
    import types

    from vllm_sm121 import config as C

    monkeypatch.delenv(C.ROUTER_IN_NORM_ENV, raising=False)
    monkeypatch.delenv(C.ROPE_IN_QKV_ENV, raising=False)
    monkeypatch.delenv(C.KV_IN_QKV_ENV, raising=False)
    monkeypatch.delenv(C.NORM_IN_QKV_ENV, raising=False)
    monkeypatch.delenv(C.L2_PREFETCH_ENV, raising=False)
    monkeypatch.delenv(C.TP_FP32_REDUCE_ENV, raising=False)
    monkeypatch.delenv(C.TP_INVARIANT_ENV, raising=False)
    cfg = types.SimpleNamespace(additional_config={"sm121": {"moe": "upstream"}})
    assert C.record_traced_choices(cfg) == {"router_in_norm": True, "rope_in_qkv": True, "kv_in_qkv": False,
                                            "norm_in_qkv": True, "l2_prefetch": "none",
                                            "tp_fp32_reduce": True, "tp_invariant": ""}
    monkeypatch.setenv(C.ROUTER_IN_NORM_ENV, "0")
    monkeypatch.setenv(C.ROPE_IN_QKV_ENV, "0")
    monkeypatch.setenv(C.KV_IN_QKV_ENV, "1")
    monkeypatch.setenv(C.NORM_IN_QKV_ENV, "0")
    monkeypatch.setenv(C.L2_PREFETCH_ENV, "o")
    monkeypatch.setenv(C.TP_FP32_REDUCE_ENV, "0")
    monkeypatch.setenv(C.TP_INVARIANT_ENV, "EP2")
    assert C.record_traced_choices(cfg) == {"router_in_norm": True, "rope_in_qkv": True, "kv_in_qkv": False,
                                            "norm_in_qkv": True, "l2_prefetch": "none",
                                            "tp_fp32_reduce": True, "tp_invariant": ""}  # recorded: unchanged
    assert C.parse(cfg.additional_config).moe == "upstream"  # the sm121 section still parses
    fresh = types.SimpleNamespace(additional_config=None)
    assert C.record_traced_choices(fresh) == {"router_in_norm": False, "rope_in_qkv": False, "kv_in_qkv": True,
                                              "norm_in_qkv": False, "l2_prefetch": "o",
                                              "tp_fp32_reduce": False, "tp_invariant": "ep2"}
    assert fresh.additional_config == {C.TRACED_KEY: {"router_in_norm": False, "rope_in_qkv": False,
                                                      "kv_in_qkv": True, "norm_in_qkv": False, "l2_prefetch": "o",
                                              "tp_fp32_reduce": False, "tp_invariant": "ep2"}}

    class Hashed:
        def compute_hash(self):
            return "x"

    assert C.record_traced_choices(types.SimpleNamespace(additional_config=Hashed())) is None
    monkeypatch.setenv(C.ROUTER_IN_NORM_ENV, "yes")
    with pytest.raises(ValueError, match="VLLM_SM121_ROUTER_IN_NORM"):
        C.traced_env_choices()
    monkeypatch.setenv(C.ROUTER_IN_NORM_ENV, "1")
    monkeypatch.setenv(C.TP_INVARIANT_ENV, "tp4")
    with pytest.raises(ValueError, match="VLLM_SM121_TP_INVARIANT='tp4' is not supported; supported: tp2, ep2"):
        C.traced_env_choices()


def test_cuda_platform_check_records_the_traced_choices(monkeypatch):
    """The CUDA platform's config check (wrapped by compat) records them before anything hashes."""
    import types

    from vllm_sm121 import compat

    recorded = []

    class FakeBase:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            recorded.append("original")

    mod = types.SimpleNamespace(CudaPlatformBase=FakeBase)
    monkeypatch.setattr("vllm_sm121.graph.tail.install_worker", lambda cfg: recorded.append("worker"))
    compat._patch_cuda_platform_config(mod)
    cfg = types.SimpleNamespace(additional_config={})
    FakeBase.check_and_update_config(cfg)
    assert recorded == ["original", "worker"] and "sm121_traced" in cfg.additional_config
