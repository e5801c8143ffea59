"""Every upstream spelling of "use the SM121 attention backend" resolves to it (CPU, vLLM 0.26.0).

Each spelling goes through vLLM's own CLI parser (``EngineArgs.add_cli_args`` on a
``FlexibleArgumentParser``) and then through the vLLM step that turns the string into an
``AttentionBackendEnum`` member. The member must be ``CUSTOM`` and its class must be
``SM121AttentionBackend`` (``get_name() == "SM121"``).

The one fake (``cli_parser`` fixture): building the parser computes the default of every
``VllmConfig`` field, ``DeviceConfig()`` included, whose ``__post_init__`` raises "Failed to infer
device type" when ``current_platform.device_type`` is empty, which it is on this GPU-less machine
(``UnspecifiedPlatform``, vllm/config/device.py:49-59). The fixture gives the platform object
``device_type = "cpu"`` for the parser's construction only, and only when it is empty.

``EngineArgs.create_engine_config`` itself needs a model (``ModelConfig`` reads its HF config)
and a real platform, so the ``--attention-backend`` test calls the step it runs on the parsed
value, ``AttentionConfig.validate_backend_before`` (vllm/engine/arg_utils.py:2249-2259), and
checks that this step is still the one ``create_engine_config`` uses.
"""

from __future__ import annotations

import inspect
import json

import pytest

import vllm_sm121


@pytest.fixture(scope="module", autouse=True)
def registered():
    vllm_sm121.register()


@pytest.fixture(scope="module")
def cli_parser():
    """vLLM's full engine CLI parser, built with the minimal platform fake (see module docstring)."""
    from vllm.engine import arg_utils
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with pytest.MonkeyPatch.context() as mp:
        if not current_platform.device_type:
            mp.setattr(current_platform, "device_type", "cpu")
        parser = arg_utils.EngineArgs.add_cli_args(FlexibleArgumentParser())
    # add_cli_args memoises the config defaults (``_compute_kwargs`` is an lru_cache); drop the
    # ones computed under the fake so later users recompute them against the real platform.
    arg_utils._compute_kwargs.cache_clear()
    return parser


def _engine_args(parser, argv):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs.from_cli_args(parser.parse_args(argv))


def _attention_config(engine_args):
    """The attention config ``EngineArgs.create_engine_config`` builds (arg_utils.py:2249-2259)."""
    import copy

    from vllm.config.attention import AttentionConfig

    cfg = copy.deepcopy(engine_args.attention_config)
    if engine_args.attention_backend is not None:
        assert cfg.backend is None, "vLLM rejects --attention-backend together with -ac.backend"
        cfg.backend = AttentionConfig.validate_backend_before(engine_args.attention_backend)
    return cfg


def _assert_sm121(member):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_sm121.attention.backend import SM121AttentionBackend

    assert member is AttentionBackendEnum.CUSTOM, member
    cls = member.get_class()
    assert cls is SM121AttentionBackend, cls
    assert cls.get_name() == "SM121"


def test_create_engine_config_converts_attention_backend_with_validate_backend_before():
    """Guard: the conversion the next test replays is the one create_engine_config performs."""
    from vllm.engine.arg_utils import EngineArgs

    src = inspect.getsource(EngineArgs.create_engine_config)
    assert "AttentionConfig.validate_backend_before(" in src
    assert "self.attention_backend" in src


def test_attention_backend_flag(cli_parser):
    ea = _engine_args(cli_parser, ["--attention-backend", "SM121"])
    assert ea.attention_backend == "SM121"  # argparse keeps the string; create_engine_config converts it
    assert ea.attention_config.backend is None
    _assert_sm121(_attention_config(ea).backend)


def test_ac_dot_backend_flag(cli_parser):
    ea = _engine_args(cli_parser, ["-ac.backend", "SM121"])
    assert ea.attention_backend is None
    _assert_sm121(ea.attention_config.backend)  # converted by AttentionConfig's field validator
    _assert_sm121(_attention_config(ea).backend)


def test_attention_config_json_flag(cli_parser):
    ea = _engine_args(cli_parser, ["--attention-config", json.dumps({"backend": "SM121"})])
    _assert_sm121(ea.attention_config.backend)
    _assert_sm121(_attention_config(ea).backend)


@pytest.mark.parametrize(
    "argv",
    [
        ["-ac.backend_per_kind", json.dumps({"full_attention": "SM121", "sliding_window": "SM121"})],
        ["--attention-config", json.dumps({"backend_per_kind": {"full_attention": "SM121", "sliding_window": "SM121"}})],
    ],
    ids=["ac.backend_per_kind", "attention-config-json"],
)
def test_backend_per_kind(cli_parser, argv):
    """gpt-oss's two KV-group kinds, as the selector derives them (vllm/v1/attention/selector.py:160-168)."""
    from vllm.v1.attention.selector import get_attn_spec_kind

    cfg = _attention_config(_engine_args(cli_parser, argv))
    assert cfg.backend is None
    assert set(cfg.backend_per_kind) == {"full_attention", "sliding_window"}
    for has_sliding_window in (False, True):  # gpt-oss full layers, gpt-oss windowed layers
        kind = get_attn_spec_kind(use_mla=False, has_sliding_window=has_sliding_window, attn_type="decoder")
        _assert_sm121(cfg.backend_per_kind.get(kind.value, cfg.backend))


def test_speculative_config_attention_backend_validator():
    """The field validator that converts ``speculative_config.attention_backend`` (speculative.py:1207-1214)."""
    from vllm.config.speculative import SpeculativeConfig

    _assert_sm121(SpeculativeConfig._parse_attention_backend("SM121"))


def test_speculative_config_flag(cli_parser):
    """``-sc`` end to end: JSON -> EngineArgs.create_speculative_config -> SpeculativeConfig(**dict).

    ``method="ngram"`` is the one method that builds without a model; the attention_backend field
    is validated by the same pydantic validator whatever the method (eagle3 included).
    """
    from vllm.config import ParallelConfig

    sc = {"method": "ngram", "num_speculative_tokens": 2, "attention_backend": "SM121"}
    ea = _engine_args(cli_parser, ["-sc", json.dumps(sc)])
    assert ea.speculative_config["attention_backend"] == "SM121"
    spec = ea.create_speculative_config(target_model_config=None, target_parallel_config=ParallelConfig())
    _assert_sm121(spec.attention_backend)


LOWERCASE_ROUTES = {
    "attention-backend": ["--attention-backend", "sm121"],
    "ac.backend": ["-ac.backend", "sm121"],
    "attention-config-json": ["--attention-config", json.dumps({"backend": "sm121"})],
    "ac.backend_per_kind": ["-ac.backend_per_kind", json.dumps({"sliding_window": "sm121"})],
    "speculative-config": ["-sc", json.dumps({"method": "ngram", "num_speculative_tokens": 2,
                                              "attention_backend": "sm121"})],
}


@pytest.mark.parametrize("route", list(LOWERCASE_ROUTES))
def test_lowercase_spelling(cli_parser, route):
    from vllm.config import ParallelConfig

    ea = _engine_args(cli_parser, LOWERCASE_ROUTES[route])
    if route == "speculative-config":
        member = ea.create_speculative_config(None, ParallelConfig()).attention_backend
    elif route == "ac.backend_per_kind":
        member = _attention_config(ea).backend_per_kind["sliding_window"]
    else:
        member = _attention_config(ea).backend
    _assert_sm121(member)


def test_unregistered_name_is_rejected_by_the_same_steps(cli_parser, capsys):
    """Control: the steps above do reject a name nobody registered, so they are not vacuous."""
    from vllm.config.speculative import SpeculativeConfig

    unknown = "Unknown attention backend: 'SM122'"  # AttentionBackendEnum's metaclass __getitem__
    ea = _engine_args(cli_parser, ["--attention-backend", "SM122"])
    with pytest.raises(ValueError, match=unknown):
        _attention_config(ea)
    with pytest.raises(SystemExit):  # argparse reports the same ValueError and exits 2
        _engine_args(cli_parser, ["-ac.backend", "SM122"])
    assert unknown in capsys.readouterr().err
    with pytest.raises(ValueError, match=unknown):
        SpeculativeConfig._parse_attention_backend("SM122")
