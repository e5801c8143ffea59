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
