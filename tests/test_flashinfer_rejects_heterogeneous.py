"""Upstream FlashInfer cannot plan gpt-oss plus an Eagle3 drafter layer in one group; SM121 can.

vLLM 0.26.0's ``FlashInferMetadataBuilder.__init__`` scans its group's layers with
``get_per_layer_parameters(vllm_config, layer_names, FlashInferImpl)`` and reduces them with
``infer_global_hyperparameters`` (vllm/v1/attention/backends/flashinfer.py:791-808; both in
vllm/v1/attention/backends/utils.py:136-222). Unless every prefill and decode of the batch goes
through TRT-LLM (SM100 family only; vllm/utils/flashinfer.py:374-394, so never on sm_121),
``build`` then refuses the group (flashinfer.py:1186-1205):

* 1187-1192: ``NotImplementedError`` when the first layer has sinks (gpt-oss layers do);
* 1194-1198: ``ValueError("Window left is not the same for all layers. ...")`` when
  ``has_same_window_lefts`` is False;
* 1200-1205: ``assert has_same_all_params, "... all layers share the same values ..."``.

The tests feed vLLM's own two functions layers whose ``impl`` is a real ``FlashInferImpl`` object,
with the attributes set as ``FlashInferImpl.__init__`` stores them (flashinfer.py:1547-1585:
``scale`` as float, ``sliding_window`` as ``(w - 1, 0)`` or ``(-1, -1)``, ``logits_soft_cap``,
``sinks``). Fakes: the impls are made with ``FlashInferImpl.__new__`` (``__init__`` needs a current
VllmConfig and a platform), the layers are plain objects holding ``impl``, and
``get_layers_from_vllm_config`` in the utils module is replaced by a function returning them.

Layers: gpt-oss-20b (24 layers, 64 query heads of size 64, scale 1/8, sinks on every layer,
window 128 on even layers) and one Eagle3 drafter layer (full attention, no sinks, scale 1/8).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest
import torch

# Imported for real: it imports on this CPU-only machine (flashinfer 0.6.14 is installed).
flashinfer_backend = pytest.importorskip(
    "vllm.v1.attention.backends.flashinfer",
    reason="vLLM's FlashInfer backend module needs the flashinfer package; without it there is no upstream "
    "FlashInferImpl to compare with",
)
from vllm.v1.attention.backends import utils as attn_utils  # noqa: E402

FlashInferImpl = flashinfer_backend.FlashInferImpl

NUM_HEADS, HEAD_SIZE, NUM_KV_HEADS = 64, 64, 8
SCALE = 1 / 8  # 1 / sqrt(64), target and drafter alike
NUM_TARGET_LAYERS = 24
DRAFTER = f"model.layers.{NUM_TARGET_LAYERS}.self_attn.attn"  # Eagle3 numbers its layer after the target's


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    sliding_window: int | None
    has_sinks: bool
    scale: float = SCALE
    logits_soft_cap: float | None = None


def _layer_specs() -> dict[str, LayerSpec]:
    specs = {
        f"model.layers.{i}.self_attn.attn": LayerSpec(sliding_window=128 if i % 2 == 0 else None, has_sinks=True)
        for i in range(NUM_TARGET_LAYERS)
    }
    specs[DRAFTER] = LayerSpec(sliding_window=None, has_sinks=False)
    return specs


SPECS = _layer_specs()
GROUPS = {
    # Hybrid KV-cache manager off (unify_hybrid_kv_cache_specs): every layer in one group.
    "all_layers_and_drafter": list(SPECS),
    # Hybrid KV-cache manager on: the drafter joins gpt-oss's full-attention group.
    "full_attention_layers_and_drafter": [n for n, s in SPECS.items() if s.sliding_window is None],
}
CONTROL_GROUPS = {  # gpt-oss alone, per KV-cache group: FlashInfer's reduction accepts these
    "target_windowed_layers": [n for n, s in SPECS.items() if s.sliding_window is not None],
    "target_full_layers": [n for n, s in SPECS.items() if s.sliding_window is None and n != DRAFTER],
}


def _sinks(spec: LayerSpec) -> torch.Tensor | None:
    return torch.zeros(NUM_HEADS, dtype=torch.float32) if spec.has_sinks else None


def _flashinfer_impl(spec: LayerSpec) -> FlashInferImpl:
    impl = FlashInferImpl.__new__(FlashInferImpl)
    impl.num_heads, impl.head_size, impl.num_kv_heads = NUM_HEADS, HEAD_SIZE, NUM_KV_HEADS
    impl.scale = float(spec.scale)
    impl.sliding_window = (-1, -1) if spec.sliding_window is None else (spec.sliding_window - 1, 0)
    impl.logits_soft_cap = spec.logits_soft_cap
    impl.sinks = _sinks(spec)
    return impl


class _Layer:
    def __init__(self, impl):
        self.impl = impl


def _flashinfer_global_params(monkeypatch, names: list[str]):
    layers = {n: _Layer(_flashinfer_impl(SPECS[n])) for n in names}
    vllm_config = object()

    def fake_get_layers_from_vllm_config(cfg, layer_type, layer_names=None):
        assert cfg is vllm_config and list(layer_names) == names
        return {n: layers[n] for n in layer_names}

    monkeypatch.setattr(attn_utils, "get_layers_from_vllm_config", fake_get_layers_from_vllm_config)
    per_layer = attn_utils.get_per_layer_parameters(vllm_config, names, FlashInferImpl)
    assert list(per_layer) == names
    for n in names:  # what FlashInfer sees of each layer
        spec = SPECS[n]
        assert per_layer[n].window_left == (-1 if spec.sliding_window is None else spec.sliding_window - 1)
        assert per_layer[n].has_sinks is spec.has_sinks
        assert per_layer[n].sm_scale == pytest.approx(spec.scale)
    return attn_utils.infer_global_hyperparameters(per_layer)


def test_flashinfer_builder_uses_the_global_reduction():
    """Guard: the builder still reduces its group to one parameter set and refuses mismatches."""
    init_src = inspect.getsource(flashinfer_backend.FlashInferMetadataBuilder.__init__)
    assert "get_per_layer_parameters(" in init_src and "infer_global_hyperparameters(" in init_src
    build_src = inspect.getsource(flashinfer_backend.FlashInferMetadataBuilder.build)
    assert "Window left is not the same for all layers" in build_src
    assert "global_hyperparameters.has_same_all_params" in build_src


@pytest.mark.parametrize("group", list(GROUPS))
def test_flashinfer_cannot_plan_gpt_oss_with_eagle3_drafter(monkeypatch, group):
    names = GROUPS[group]
    assert DRAFTER in names
    g = _flashinfer_global_params(monkeypatch, names)
    if group == "all_layers_and_drafter":
        assert g.has_same_window_lefts is False  # -> ValueError("Window left is not the same ...")
    else:
        assert g.has_same_window_lefts is True  # one window here; the drafter's lack of sinks still differs
    assert g.has_same_all_params is False  # -> assert "... all layers share the same values ..."
    assert g.has_sinks is True  # first layer is gpt-oss -> NotImplementedError (sinks) even before those two


@pytest.mark.parametrize("group", list(CONTROL_GROUPS))
def test_flashinfer_reduction_accepts_gpt_oss_groups_without_the_drafter(monkeypatch, group):
    """Control: the same reduction says True for uniform groups, so the False above is the drafter's doing."""
    g = _flashinfer_global_params(monkeypatch, CONTROL_GROUPS[group])
    assert g.has_same_window_lefts is True
    assert g.has_same_all_params is True


def test_sm121_keeps_each_layers_parameters():
    from vllm_sm121.attention.impl import SM121AttentionImpl

    impls = {}
    for name, spec in SPECS.items():
        sinks = _sinks(spec)
        impl = SM121AttentionImpl(NUM_HEADS, HEAD_SIZE, spec.scale, NUM_KV_HEADS, None, spec.sliding_window,
                                  "auto", spec.logits_soft_cap, "decoder", None, sinks=sinks)
        assert impl.sliding_window == spec.sliding_window, name
        assert impl.logits_soft_cap == spec.logits_soft_cap, name
        assert impl.scale == pytest.approx(spec.scale), name
        assert impl.sinks is sinks, name
        impls[name] = impl
    # The group really is heterogeneous, and each impl still holds its own values.
    kept = {(i.sliding_window, i.sinks is not None, i.scale, i.logits_soft_cap) for i in impls.values()}
    assert kept == {(128, True, SCALE, None), (None, True, SCALE, None), (None, False, SCALE, None)}
    assert impls[DRAFTER].sinks is None and impls[DRAFTER].sliding_window is None
    assert impls["model.layers.0.self_attn.attn"].sliding_window == 128
    assert impls["model.layers.1.self_attn.attn"].sliding_window is None


GLOBAL_STATE = {"global_hyperparameters", "window_left", "sm_scale", "logits_soft_cap", "has_sinks", "sliding_window",
                "scale", "sinks"}


def _self_attributes_assigned(cls) -> set[str]:
    """Names of ``self.<name>`` assigned anywhere in the class body (its __init__ needs CUDA, so no instance)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            for sub in ast.walk(t) if t is not None else ():
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def test_sm121_builder_has_no_global_hyperparameters():
    from vllm_sm121.attention.metadata import SM121AttentionMetadataBuilder

    assert not [a for a in GLOBAL_STATE if hasattr(SM121AttentionMetadataBuilder, a)]
    assert not _self_attributes_assigned(SM121AttentionMetadataBuilder) & GLOBAL_STATE
    src = inspect.getsource(SM121AttentionMetadataBuilder)
    assert "get_per_layer_parameters" not in src and "infer_global_hyperparameters" not in src
    # Control: the same scan finds FlashInfer's global plan state.
    found = _self_attributes_assigned(flashinfer_backend.FlashInferMetadataBuilder)
    assert {"global_hyperparameters", "window_left", "sm_scale", "logits_soft_cap", "has_sinks"} <= found
