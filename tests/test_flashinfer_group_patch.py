"""Patch 0003 (FlashInfer plans per hyperparameter group), checked on CPU.

What runs: ``patches/vllm/0003-flashinfer-plan-per-hyperparameter-group.patch`` is
applied with ``git apply`` (as in ``tests/test_compat.py``) to a temporary copy of the
installed ``vllm/v1/attention/backends/flashinfer.py``; site-packages is never
modified. The copy is loaded as a module of its own, and its real
``FlashInferMetadataBuilder.__init__``/``build`` and ``FlashInferImpl.__init__``/
``forward`` run. The unpatched copy is loaded the same way for comparison.

Faked at the plan/run boundary: ``flashinfer``, ``flashinfer.decode``,
``flashinfer.prefill`` and ``flashinfer.utils`` are fakes in ``sys.modules`` while a
copy is imported, so the flashinfer package is neither needed nor used (the test runs,
and is never skipped, without it). The fake wrappers record their constructor and
``plan()`` arguments and every ``run()``; ``plan()`` keeps ``_window_left``,
``_logits_soft_cap`` (``None`` -> 0.0) and ``_sm_scale`` as FlashInfer does, so
``forward()``'s own asserts check that each layer got a wrapper planned for its values.

Faked below it: the platform (a FlashInfer-native GPU: no trtllm-gen, so every step is
planned), a ``SimpleNamespace`` VllmConfig with the fields the builder reads, layers
holding a real ``FlashInferImpl`` of the loaded copy, ``get_layers_from_vllm_config``
returning them, the NHD layout, and the page-index copy kernel (in torch).

Layers: gpt-oss's pattern (window 128 on even layers, full attention on odd ones, scale
1/8, sinks on every layer in the real model) and an Eagle3-style drafter layer in the
same KV-cache group (full attention, no sinks, its own scale).

Not run on a GPU: FlashInfer is not installed on the GPU machines, and on sm_90 upstream
refuses windows and sinks before the code this patch changes (see the patch header).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import shutil
import subprocess
import sys
import types

import pytest
import torch

# vLLM's build() reads CommonAttentionMetadata.seq_lens_cpu, deprecated in 0.26.
pytestmark = pytest.mark.filterwarnings(r"ignore:\s*Prefer using device seq_lens")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCH = (
    ROOT / "patches" / "vllm" / "0003-flashinfer-plan-per-hyperparameter-group.patch"
)
REL = "vllm/v1/attention/backends/flashinfer.py"

NUM_HEADS, HEAD_SIZE, NUM_KV_HEADS, BLOCK_SIZE = 8, 64, 2, 16
TARGET_SCALE = 1 / 8  # gpt-oss: 1/sqrt(64)
DRAFTER_SCALE = 0.1  # the drafter's own scale, so scale differs too
DTYPE = torch.bfloat16


# --------------------------------------------------------------------------------------
# Layers


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    sliding_window: int | None
    scale: float = TARGET_SCALE
    logits_soft_cap: float | None = None
    has_sinks: bool = False

    def key(self) -> tuple:
        """(window_left, logits_soft_cap, sm_scale, has_sinks) as FlashInfer sees it."""
        window_left = -1 if self.sliding_window is None else self.sliding_window - 1
        return (window_left, self.logits_soft_cap, self.scale, self.has_sinks)


def _gpt_oss_group(
    num_target_layers: int = 4, sinks: bool = False, drafter_first: bool = False
):
    """gpt-oss and Eagle3 layers in one KV-cache group (hybrid manager off)."""
    specs = {
        f"model.layers.{i}.self_attn.attn": LayerSpec(
            128 if i % 2 == 0 else None, has_sinks=sinks
        )
        for i in range(num_target_layers)
    }
    drafter = {
        f"model.layers.{num_target_layers}.self_attn.attn": LayerSpec(
            None, scale=DRAFTER_SCALE
        )
    }
    return {**drafter, **specs} if drafter_first else {**specs, **drafter}


# Sinks left out: FlashInfer's native kernels cannot run them (see the sinks tests).
GPT_OSS_AND_DRAFTER = _gpt_oss_group()
# What reaches the assertion on sm_90, where windows and sinks are refused earlier:
# soft-cap and scale.
SOFTCAP_AND_SCALE = {
    "model.layers.0.self_attn.attn": LayerSpec(None, logits_soft_cap=30.0),
    "model.layers.1.self_attn.attn": LayerSpec(None),
    "model.layers.2.self_attn.attn": LayerSpec(None, logits_soft_cap=30.0),
    "model.layers.3.self_attn.attn": LayerSpec(
        None, scale=DRAFTER_SCALE, logits_soft_cap=30.0
    ),
}
HOMOGENEOUS = {f"model.layers.{i}.self_attn.attn": LayerSpec(None) for i in range(4)}
HETEROGENEOUS = {
    "gpt_oss_and_drafter": GPT_OSS_AND_DRAFTER,
    "softcap_and_scale": SOFTCAP_AND_SCALE,
}


def _distinct_keys(specs: dict[str, LayerSpec]) -> list[tuple]:
    return list(dict.fromkeys(s.key() for s in specs.values()))


# --------------------------------------------------------------------------------------
# FlashInfer, faked at the plan/run boundary

LOG: list[tuple] = []  # ("new" | "plan" | "fast_plan" | "run", wrapper, details)


class _FakeWrapper:
    kind = "?"

    def __init__(self, workspace_buffer=None, kv_layout="NHD", **kwargs):
        self.uid = 1 + sum(1 for e in LOG if e[0] == "new")
        self.workspace_buffer = workspace_buffer
        self.kv_layout = kv_layout
        self.init_kwargs = kwargs
        self.is_cuda_graph_enabled = bool(kwargs.get("use_cuda_graph", False))
        self.plans: list[dict] = []
        LOG.append(("new", self, kwargs))

    def plan(self, **kwargs):  # vLLM passes keywords only
        self._record_plan("plan", kwargs)

    def _record_plan(self, how, kwargs):
        self.plans.append(kwargs)
        # What FlashInfer keeps from a plan (read back by FlashInferImpl.forward).
        self._window_left = kwargs["window_left"]
        self._logits_soft_cap = kwargs["logits_soft_cap"] or 0.0
        self._sm_scale = kwargs["sm_scale"]
        self._causal = kwargs.get("causal", False)
        LOG.append((how, self, kwargs))

    def run(self, q, paged_kv_cache, *args, out=None, **kwargs):
        assert out is not None and out.shape[0] == q.shape[0]
        out.fill_(self.uid)  # mark the rows this wrapper computed
        LOG.append(("run", self, q.shape[0]))
        return out


class FakePrefillWrapper(_FakeWrapper):
    kind = "prefill"


class FakeDecodeWrapper(_FakeWrapper):
    kind = "decode"


class FakeRaggedPrefillWrapper(_FakeWrapper):
    kind = "ragged"


class FakeCascadeWrapper(_FakeWrapper):
    kind = "cascade"

    def __init__(self, num_levels, workspace_buffer, kv_layout="NHD"):
        super().__init__(workspace_buffer, kv_layout)


def _fake_fast_decode_plan(wrapper, **kwargs):
    wrapper._record_plan("fast_plan", kwargs)


def _never_called(*args, **kwargs):
    raise AssertionError("trtllm-gen kernel called on a native FlashInfer step")


def _fake_flashinfer_modules() -> dict[str, types.ModuleType]:
    root = types.ModuleType("flashinfer")
    root.__path__ = []  # a package: ``from flashinfer.decode import`` finds the fakes
    root.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    root.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    root.BatchPrefillWithRaggedKVCacheWrapper = FakeRaggedPrefillWrapper
    root.MultiLevelCascadeAttentionWrapper = FakeCascadeWrapper
    decode = types.ModuleType("flashinfer.decode")
    decode.fast_decode_plan = _fake_fast_decode_plan
    decode.trtllm_batch_decode_with_kv_cache = _never_called
    prefill = types.ModuleType("flashinfer.prefill")
    prefill.trtllm_batch_context_with_kv_cache = _never_called
    utils = types.ModuleType("flashinfer.utils")
    utils.FP4Tensor = type("FP4Tensor", (), {})
    root.decode, root.prefill, root.utils = decode, prefill, utils
    return {m.__name__: m for m in (root, decode, prefill, utils)}


# --------------------------------------------------------------------------------------
# Loading the patched and the unpatched copy


def _installed_source() -> pathlib.Path:
    import vllm

    return pathlib.Path(vllm.__file__).resolve().parents[1] / REL


def _load_copy(
    tmp_root: pathlib.Path, apply_patch: bool, module_name: str
) -> types.ModuleType:
    dst = tmp_root / REL
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(_installed_source(), dst)
    if apply_patch:
        proc = subprocess.run(
            ["git", "apply", "-p1", str(PATCH)],
            cwd=tmp_root,
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert "FlashInferPlanKey" in dst.read_text()
    # vLLM's own modules are imported for real first, so only the copy sees the fakes.
    for dependency in (
        "vllm.utils.flashinfer",
        "vllm.v1.attention.backends.utils",
        "vllm.v1.attention.ops.common",
        "vllm.v1.attention.ops.dcp_alltoall",
        "vllm.v1.attention.ops.merge_attn_states",
    ):
        importlib.import_module(dependency)

    with pytest.MonkeyPatch.context() as mp:
        for name, fake in _fake_flashinfer_modules().items():
            mp.setitem(sys.modules, name, fake)
        spec = importlib.util.spec_from_file_location(module_name, dst)
        module = importlib.util.module_from_spec(spec)
        # dataclasses look their module up while it loads
        mp.setitem(sys.modules, module_name, module)
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    return _load_copy(
        tmp_path_factory.mktemp("patched"), True, "_sm121_flashinfer_patched"
    )


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    return _load_copy(
        tmp_path_factory.mktemp("upstream"), False, "_sm121_flashinfer_upstream"
    )


# --------------------------------------------------------------------------------------
# A FlashInfer-native GPU, a VllmConfig, layers


class FakePlatform:
    """A GPU where FlashInfer runs its native kernels (no trtllm-gen), like sm_120."""

    def __init__(self, major: int = 12, minor: int = 0):
        self.major, self.minor = major, minor

    def is_device_capability(self, cap: int) -> bool:
        return self.major * 10 + self.minor == cap

    def is_device_capability_family(self, family: int) -> bool:
        return self.major == family // 10

    def get_device_capability(self):
        return types.SimpleNamespace(major=self.major, minor=self.minor)


class _CopyPageIndices:
    """``_copy_page_indices_kernel[grid](...)`` in torch (no Triton without a GPU)."""

    def __getitem__(self, grid):
        def launch(
            page_indices, block_table, block_table_stride, cu_num_blocks, BLOCK_SIZE
        ):
            for req in range(grid[0]):
                start, end = int(cu_num_blocks[req]), int(cu_num_blocks[req + 1])
                page_indices[start:end] = block_table[req, : end - start]

        return launch


class FakeLayer:
    def __init__(self, impl):
        self.impl = impl
        self._q_scale = torch.ones(1)
        self._q_scale_float = self._k_scale_float = self._v_scale_float = 1.0
        self._o_scale_float = None


@dataclasses.dataclass
class Env:
    mod: types.ModuleType
    layers: dict[str, FakeLayer]
    vllm_config: object
    trtllm_queries: list[dict]  # kwargs of every use_trtllm_attention(...) call

    def builder(self):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
            dtype=DTYPE,
        )
        b = self.mod.FlashInferMetadataBuilder(
            spec, list(self.layers), self.vllm_config, torch.device("cpu")
        )
        # As the model runner does; spares the default ~400 MB allocation.
        b.set_workspace_buffer(torch.zeros(16, dtype=torch.uint8))
        return b


def _vllm_config(cudagraph_full: bool = False):
    from vllm.config import CUDAGraphMode

    ns = types.SimpleNamespace
    return ns(
        cache_config=ns(cache_dtype="auto"),
        model_config=ns(
            max_model_len=1024,
            dtype=DTYPE,
            get_num_attention_heads=lambda pc: NUM_HEADS,
        ),
        attention_config=ns(
            use_trtllm_attention=None,
            disable_flashinfer_q_quantization=False,
            use_non_causal=False,
        ),
        scheduler_config=ns(max_num_batched_tokens=256, max_num_seqs=8),
        speculative_config=None,
        compilation_config=ns(
            cudagraph_mode=CUDAGraphMode.FULL
            if cudagraph_full
            else CUDAGraphMode.PIECEWISE,
            max_cudagraph_capture_size=None,
        ),
        parallel_config=ns(
            decode_context_parallel_size=1,
            dcp_kv_cache_interleave_size=1,
            dcp_comm_backend="ag_rs",
        ),
        use_v2_model_runner=False,
    )


def _make_env(
    mp: pytest.MonkeyPatch,
    mod,
    specs: dict[str, LayerSpec],
    cudagraph_full: bool = False,
) -> Env:
    from vllm.v1.attention.backends import utils as attn_utils

    trtllm_queries: list[dict] = []

    def fake_use_trtllm_attention(*args, **kwargs):
        trtllm_queries.append(kwargs)
        return False  # a native step: prefill is planned

    mp.setattr(mod, "current_platform", FakePlatform())
    mp.setattr(mod, "can_use_trtllm_attention", lambda *a, **k: False)  # native decode
    mp.setattr(mod, "use_trtllm_attention", fake_use_trtllm_attention)
    mp.setattr(mod, "get_kv_cache_layout", lambda: "NHD")
    mp.setattr(mod, "PIN_MEMORY", False)
    mp.setattr(mod, "_copy_page_indices_kernel", _CopyPageIndices())
    LOG.clear()

    layers = {}
    for name, s in specs.items():
        sinks = torch.zeros(NUM_HEADS, dtype=torch.float32) if s.has_sinks else None
        impl = mod.FlashInferImpl(
            NUM_HEADS,
            HEAD_SIZE,
            s.scale,
            NUM_KV_HEADS,
            None,
            s.sliding_window,
            "auto",
            s.logits_soft_cap,
            sinks=sinks,
        )
        layers[name] = FakeLayer(impl)
    vllm_config = _vllm_config(cudagraph_full)

    def fake_get_layers_from_vllm_config(cfg, layer_type, layer_names=None):
        assert cfg is vllm_config
        return {
            n: layers[n] for n in (layer_names if layer_names is not None else layers)
        }

    mp.setattr(
        attn_utils, "get_layers_from_vllm_config", fake_get_layers_from_vllm_config
    )
    return Env(mod, layers, vllm_config, trtllm_queries)


# --------------------------------------------------------------------------------------
# Batches


def _common_metadata(query_lens: list[int], seq_lens: list[int]):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
    )
    num_tokens = int(qsl[-1])
    max_blocks = 8
    block_table = torch.arange(len(query_lens) * max_blocks, dtype=torch.int32).view(
        len(query_lens), max_blocks
    )
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(query_lens),
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
        _seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
    )


# (query lens, seq lens): request 0 decodes 1 token (40 in context), request 1 prefills
MIXED = ([1, 5], [40, 5])
PURE_DECODE = ([1, 1], [40, 17])


def _build(builder, batch=MIXED):
    return builder.build(
        common_prefix_len=0, common_attn_metadata=_common_metadata(*batch)
    )


def _plans(kind: str) -> list[tuple]:
    """(wrapper, how, (window_left, soft_cap, sm_scale)) per plan call of one kind."""
    return [
        (w, how, (kw["window_left"], kw["logits_soft_cap"], kw["sm_scale"]))
        for how, w, kw in LOG
        if how in ("plan", "fast_plan") and w.kind == kind
    ]


def _plain(v):
    return v.tolist() if isinstance(v, torch.Tensor) else v


def _plain_all(details):
    return (
        {k: _plain(v) for k, v in details.items()}
        if isinstance(details, dict)
        else details
    )


def _forward(env: Env, name: str, metadata, num_tokens: int) -> torch.Tensor:
    layer = env.layers[name]
    torch.manual_seed(0)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, dtype=DTYPE)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE)
    shape = env.mod.FlashInferBackend.get_kv_cache_shape(
        8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE
    )
    kv_cache = torch.zeros(shape, dtype=DTYPE)
    output = torch.zeros(num_tokens, NUM_HEADS, HEAD_SIZE, dtype=DTYPE)
    layer.impl.forward(layer, query, key, key.clone(), kv_cache, metadata, output)
    return output


# --------------------------------------------------------------------------------------
# The patched builder: one plan per group, each layer runs its group's wrapper


@pytest.mark.parametrize("group", list(HETEROGENEOUS))
def test_patched_plans_one_wrapper_per_distinct_tuple(patched, monkeypatch, group):
    specs = HETEROGENEOUS[group]
    keys = _distinct_keys(specs)
    assert len(keys) == 3  # a real mix, not a homogeneous group
    env = _make_env(monkeypatch, patched, specs)
    builder = env.builder()
    assert [tuple(k) for k in builder.plan_keys] == keys
    for name, s in specs.items():  # the impl's key is the builder's key for that layer
        assert tuple(env.layers[name].impl.plan_key) == s.key()

    md = _build(builder)
    assert (md.num_decodes, md.num_prefills) == (1, 1)
    for kind, phase in (("prefill", md.prefill), ("decode", md.decode)):
        plans = _plans(kind)
        # One plan per tuple, with that tuple's values.
        assert [key for _, _, key in plans] == [k[:3] for k in keys], kind
        wrappers = [w for w, _, _ in plans]
        assert len(set(map(id, wrappers))) == len(keys), f"{kind}: a wrapper per tuple"
        assert all(w.workspace_buffer is builder._workspace_buffer for w in wrappers), (
            "workspace is shared"
        )
        assert {tuple(k): w for k, w in phase.wrappers.items()} == {
            k: w for k, w in zip(keys, wrappers)
        }
    prefill_plan = _plans("prefill")[0][0].plans[0]
    assert prefill_plan["causal"] is True and prefill_plan["num_qo_heads"] == NUM_HEADS
    assert prefill_plan["qo_indptr"].tolist() == [0, 5]

    for name, s in specs.items():
        LOG[:] = [e for e in LOG if e[0] != "run"]
        out = _forward(env, name, md, num_tokens=6)
        runs = [(e[1], e[2]) for e in LOG if e[0] == "run"]
        pre, dec = md.prefill.wrappers[s.key()], md.decode.wrappers[s.key()]
        assert runs == [(pre, 5), (dec, 1)], name
        planned_for = (s.key()[0], s.logits_soft_cap or 0.0, s.scale)
        for w in (pre, dec):
            assert (w._window_left, w._logits_soft_cap, w._sm_scale) == planned_for, (
                name
            )
        assert torch.all(out[:1] == dec.uid) and torch.all(out[1:] == pre.uid), name


def test_patched_reuses_its_wrappers_across_steps(patched, monkeypatch):
    env = _make_env(monkeypatch, patched, GPT_OSS_AND_DRAFTER)
    builder = env.builder()
    first = _build(builder)
    second = _build(builder)
    assert (
        first.prefill.wrappers == second.prefill.wrappers
        and first.decode.wrappers == second.decode.wrappers
    )
    num_keys = len(builder.plan_keys)
    assert sum(1 for e in LOG if e[0] == "new") == 2 * num_keys  # created once
    # ... and planned at every step.
    assert len(_plans("prefill")) == len(_plans("decode")) == 2 * num_keys


def test_patched_full_cudagraph_decode_has_a_wrapper_per_batch_size_and_tuple(
    patched, monkeypatch
):
    env = _make_env(monkeypatch, patched, GPT_OSS_AND_DRAFTER, cudagraph_full=True)
    builder = env.builder()
    keys = _distinct_keys(GPT_OSS_AND_DRAFTER)
    md1 = _build(builder, PURE_DECODE)
    md2 = _build(builder, PURE_DECODE)
    assert md1.prefill is None and md1.decode.wrappers == md2.decode.wrappers
    assert sorted(builder._decode_wrappers_cudagraph, key=str) == sorted(
        ((2, k) for k in builder.plan_keys), key=str
    )
    for w in md1.decode.wrappers.values():
        assert (
            w.is_cuda_graph_enabled
            and w.init_kwargs["paged_kv_indptr_buffer"].shape[0] == 3
        )
    # First step: plan() per tuple (warm-up); next step: fast_decode_plan per tuple.
    assert [(how, key) for _, how, key in _plans("decode")] == [
        ("plan", k[:3]) for k in keys
    ] + [("fast_plan", k[:3]) for k in keys]
    for name, s in GPT_OSS_AND_DRAFTER.items():
        out = _forward(env, name, md2, num_tokens=2)
        assert torch.all(out == md2.decode.wrappers[s.key()].uid), name


def test_patched_homogeneous_group_plans_exactly_as_upstream(
    patched, upstream, monkeypatch
):
    """One group: the same wrappers, made in the same order, planned the same way."""

    def trace(mod):
        with monkeypatch.context() as mp:
            env = _make_env(mp, mod, HOMOGENEOUS)
            builder = env.builder()
            md = _build(builder)
            for name in HOMOGENEOUS:
                _forward(env, name, md, num_tokens=6)
            shared = builder._workspace_buffer
            return [
                (
                    event,
                    w.kind,
                    w.uid,
                    w.workspace_buffer is shared,
                    _plain_all(details),
                )
                for event, w, details in LOG
            ]

    got, want = trace(patched), trace(upstream)
    assert got == want
    # Exactly one plan per phase, as before.
    assert [e[:2] for e in got if e[0] in ("plan", "new")] == [
        ("new", "prefill"),
        ("plan", "prefill"),
        ("new", "decode"),
        ("plan", "decode"),
    ]
    assert [e[2] for e in got if e[0] == "run"] == [1, 2] * len(HOMOGENEOUS)


# --------------------------------------------------------------------------------------
# Sinks: grouped by, still refused on native steps


@pytest.mark.parametrize(
    "drafter_first", [False, True], ids=["target_first", "drafter_first"]
)
def test_patched_gpt_oss_with_sinks_groups_and_still_needs_trtllm(
    patched, monkeypatch, drafter_first
):
    specs = _gpt_oss_group(sinks=True, drafter_first=drafter_first)
    env = _make_env(monkeypatch, patched, specs)
    # Sinks need trtllm-gen (SM100): the platform has it, but this step is native.
    monkeypatch.setattr(
        patched.FlashInferBackend, "supports_sink", classmethod(lambda cls: True)
    )
    builder = env.builder()
    assert {tuple(k) for k in builder.plan_keys} == {
        (127, None, TARGET_SCALE, True),
        (-1, None, TARGET_SCALE, True),
        (-1, None, DRAFTER_SCALE, False),
    }
    assert builder.has_sinks is True  # any layer, whatever the order
    with pytest.raises(NotImplementedError, match="does not support attention sinks"):
        _build(builder)
    assert env.trtllm_queries and all(
        q["has_sinks"] is True for q in env.trtllm_queries
    )
    assert not [e for e in LOG if e[0] == "plan"]


# --------------------------------------------------------------------------------------
# The unpatched copy refuses the same groups


def test_upstream_refuses_gpt_oss_layers_with_the_drafter(upstream, monkeypatch):
    env = _make_env(monkeypatch, upstream, GPT_OSS_AND_DRAFTER)
    with pytest.raises(ValueError, match="Window left is not the same for all layers"):
        _build(env.builder())


def test_upstream_asserts_all_layers_share_softcap_and_scale(upstream, monkeypatch):
    env = _make_env(monkeypatch, upstream, SOFTCAP_AND_SCALE)
    with pytest.raises(AssertionError, match="all layers share the same values"):
        _build(env.builder())


def test_upstream_sinks_follow_the_first_layer(upstream, monkeypatch):
    """Contrast for the sinks test: upstream passes only the first layer's has_sinks."""
    env = _make_env(
        monkeypatch, upstream, _gpt_oss_group(sinks=True, drafter_first=True)
    )
    with pytest.raises(ValueError, match="Window left is not the same for all layers"):
        _build(env.builder())
    assert env.trtllm_queries and all(
        q["has_sinks"] is False for q in env.trtllm_queries
    )
