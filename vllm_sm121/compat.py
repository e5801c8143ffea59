"""The only module that touches vLLM private surfaces.

Each touch is an explicit step with a register entry (symbol, why, how, upstream patch, removal
plan) and a matching diff under ``patches/vllm/``; ``tests/test_compat.py`` checks that each
named patch exists and applies to the installed vLLM 0.26.0 source.
"""

from __future__ import annotations

import dataclasses

BACKEND_NAME = "SM121"
BACKEND_CLASS_PATH = "vllm_sm121.attention.backend.SM121AttentionBackend"


@dataclasses.dataclass(frozen=True)
class Shim:
    symbol: str
    why: str
    how: str
    patch: str  # file under patches/vllm/
    removal: str


SHIMS: list[Shim] = [
    Shim(
        symbol="vllm.v1.attention.backends.registry.AttentionBackendEnum (name lookup)",
        why="`--attention-backend SM121` is resolved with AttentionBackendEnum[name.upper()]; a new "
            "enum member would not survive the spawn of engine/worker processes (they unpickle the "
            "config before plugins load).",
        how="register_backend(CUSTOM, path) (public) + the alias SM121 -> CUSTOM in the enum's "
            "_member_map_ (private), in every process through the general plugin.",
        patch="0001-attention-backend-registry-named-custom-backends.patch",
        removal="once upstream accepts registered names (the patch), register under 'SM121' directly",
    ),
    Shim(
        symbol="vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer._create_draft_vllm_config",
        why="The drafter never inherits --attention-backend (it autoselects); on SM12x nothing else "
            "runs gpt-oss's drafter next to an SM121 target, and the heterogeneous-layer story "
            "(target with window+sinks, drafter without) is exactly what SM121 exists for.",
        how="Wrap the method: when the speculative config names no attention_backend and the "
            "target runs SM121, the draft config gets SM121 too. An explicit "
            "speculative-config attention_backend always wins.",
        patch="0002-spec-decode-drafter-inherits-opted-in-attention-backend.patch",
        removal="once upstream lets a backend opt in to being inherited by drafters (the patch)",
    ),
    Shim(
        symbol="vllm.model_executor.models.gpt_oss.GptOssModel.block_cls (process-global class attribute)",
        why="vLLM runs the MoE as the opaque op moe_forward, so a MoE method cannot fuse the quantization "
            "of its input with the post-attention residual add + RMSNorm; gpt-oss's experts would get bf16 "
            "and quantize it again. Only the model can hand the norm's MXFP8 output to the experts.",
        how="Set GptOssModel.block_cls (the documented override point) to vllm_sm121.moe.hook.Sm121GptOssBlock "
            "right after gpt_oss.py is imported, only while vllm_sm121.moe.READY (from moe.register()). "
            "The block falls back to upstream's forward for layers whose experts are not on "
            "Sm121Mxfp4MoEMethod or are parallel/LoRA/sequence-parallel.",
        patch="0004-gpt-oss-fused-norm-mxfp8-moe-hook.patch",
        removal="once upstream lets a MoE quant method consume the post-attention norm (the patch), move "
                "hooked_mlp_forward into Sm121Mxfp4MoEMethod.fused_norm_moe_forward and drop the block class",
    ),
    Shim(
        symbol="vllm.model_executor.models.gpt_oss.GptOssForCausalLM.__init__ (wrapped)",
        why="gpt-oss builds its lm_head with no quant config, so nothing public can give it a quant method, "
            "and the stock gpt-oss MXFP4 config hands qkv_proj / o_proj to UnquantizedLinearMethod; "
            '"dense_weights": "fp8" needs all three on vllm_sm121.dense.method\'s FP8 methods before loading.',
        how="Wrap GptOssForCausalLM.__init__ right after gpt_oss.py is imported (every process): after the "
            "upstream constructor, vllm_sm121.dense.hook.apply_dense_weights swaps the quant_method of "
            "qkv_proj / o_proj (UnquantizedLinearMethod) and lm_head (UnquantizedEmbeddingMethod) for ours when "
            "the config's sm121.dense_weights is fp8 (else it does nothing). Weights are created by upstream "
            "code either way; vLLM's process_weights_after_loading converts them.",
        patch="0005-gpt-oss-lm-head-quant-config.patch",
        removal="once upstream builds gpt-oss's lm_head with the model's quant config (the patch), choose the "
                "three methods in the plugin's gpt-oss quant config (get_quant_method -> "
                "dense.method.dense_quant_method_for) and drop the wrapper",
    ),
    Shim(
        symbol="vllm.v1.worker.gpu_model_runner.GPUModelRunner (module attribute, rebound during init_device)",
        why="Worker.init_device builds GPUModelRunner through a function-local import; there is no runner-class "
            "hook, and the whole-model graph mode needs a runner subclass (vllm_sm121.graph.runner).",
        how="vllm_sm121.graph.worker.WholeModelWorker.init_device binds the module attribute to "
            "WholeModelRunner for the duration of super().init_device() (under a lock), then restores it.",
        patch="0006-worker-model-runner-cls.patch",
        removal="once upstream has Worker.model_runner_cls (the patch), set it on WholeModelWorker",
    ),
    Shim(
        symbol="vllm.platforms.cuda.CudaPlatformBase.check_and_update_config (wrapped)",
        why="General plugins get no call once the engine's VllmConfig is final, and the whole-model graph "
            "option (--additional-config sm121.cudagraph = whole_model) must pick the worker class after "
            "the platform resolved worker_cls 'auto'.",
        how="Wrap the classmethod right after vllm/platforms/cuda.py is imported: after the original, "
            "vllm_sm121.graph.tail.install_worker sets parallel_config.worker_cls to WholeModelWorker when "
            "the option is on (ValueError naming the option for configurations it cannot run or a custom "
            "--worker-cls); otherwise nothing changes.",
        patch="0007-plugin-config-hook.patch",
        removal="once upstream runs plugin config hooks on the final VllmConfig (the patch), register "
                "install_worker there",
    ),
]


def register_attention_backend() -> None:
    """Make ``SM121`` a valid attention-backend name resolving to our backend (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS_PATH)
    # Shim 0001: alias the name. CUSTOM pickles by value, so spawned processes see CUSTOM too.
    members = AttentionBackendEnum._member_map_
    if members.get(BACKEND_NAME) not in (None, AttentionBackendEnum.CUSTOM):
        raise RuntimeError(f"attention backend name {BACKEND_NAME} is already taken by {members[BACKEND_NAME]}")
    members[BACKEND_NAME] = AttentionBackendEnum.CUSTOM


def _target_runs_sm121(vllm_config) -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return vllm_config.attention_config.backend is AttentionBackendEnum.CUSTOM and (
        AttentionBackendEnum.CUSTOM.get_path() == BACKEND_CLASS_PATH
    )


class _PostImportHook:
    """Run ``fn(module)`` right after ``name`` is imported (or now, if it already is).

    Keeps ``register()`` cheap: patching a module must not import it (and half of vLLM with it)
    in processes that never use it, such as the API server.
    """

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        import importlib.util
        import sys

        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module, fn = spec.loader.exec_module, self.fn

        def exec_and_patch(module):
            exec_module(module)
            fn(module)

        spec.loader.exec_module = exec_and_patch
        sys.meta_path.remove(self)
        return spec


def on_import(name: str, fn) -> None:
    import sys

    if name in sys.modules:
        fn(sys.modules[name])
    elif not any(isinstance(h, _PostImportHook) and h.name == name and h.fn is fn for h in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook(name, fn))


def _patch_create_draft_vllm_config(module) -> None:
    import dataclasses as dc

    proposer = module.SpecDecodeBaseProposer
    original = proposer._create_draft_vllm_config
    if getattr(original, "_sm121_shim", False):
        return

    def _create_draft_vllm_config(self):
        draft = original(self)
        if self.speculative_config.attention_backend is None and _target_runs_sm121(self.vllm_config):
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            draft = dc.replace(draft, attention_config=dc.replace(
                draft.attention_config, backend=AttentionBackendEnum.CUSTOM))
        return draft

    _create_draft_vllm_config._sm121_shim = True
    proposer._create_draft_vllm_config = _create_draft_vllm_config


def register_drafter_inherits_sm121() -> None:
    """Shim 0002: an Eagle3/draft model without its own attention_backend follows an SM121 target."""
    on_import("vllm.v1.spec_decode.llm_base_proposer", _patch_create_draft_vllm_config)


def _install_gpt_oss_block(module) -> None:
    from vllm.logger import init_logger

    from vllm_sm121.moe.hook import Sm121GptOssBlock

    model = module.GptOssModel
    if model.block_cls is Sm121GptOssBlock:
        return
    if model.block_cls is not module.TransformerBlock:
        init_logger("vllm.sm121").warning(
            "gpt-oss: GptOssModel.block_cls is already %s; the fused norm->MXFP8 MoE hook is not installed",
            model.block_cls.__qualname__)
        return
    model.block_cls = Sm121GptOssBlock


def register_gpt_oss_fused_moe_block() -> None:
    """Shim 0004: gpt-oss blocks whose experts run Sm121Mxfp4MoEMethod feed them the norm's MXFP8."""
    on_import("vllm.model_executor.models.gpt_oss", _install_gpt_oss_block)


def _install_gpt_oss_dense_hook(module) -> None:
    import functools

    cls = module.GptOssForCausalLM
    original = cls.__init__
    if getattr(original, "_sm121_shim", False):
        return

    @functools.wraps(original)
    def __init__(self, vllm_config, prefix: str = ""):  # upstream's signature (vLLM inspects it)
        original(self, vllm_config=vllm_config, prefix=prefix)
        from vllm_sm121.dense.hook import apply_dense_weights
        from vllm_sm121.tp_invariant import apply_tp_invariant_lm_head

        apply_dense_weights(self, vllm_config)
        apply_tp_invariant_lm_head(self, vllm_config)  # (after the FP8 swap: it wraps the final method)

    __init__._sm121_shim = True
    cls.__init__ = __init__


def register_gpt_oss_dense_weights() -> None:
    """Shim 0005: gpt-oss's qkv_proj / o_proj / lm_head get FP8 methods when "dense_weights" is "fp8"."""
    on_import("vllm.model_executor.models.gpt_oss", _install_gpt_oss_dense_hook)


def _patch_cuda_platform_config(module) -> None:
    import functools

    base = module.CudaPlatformBase
    original = base.__dict__["check_and_update_config"].__func__
    if getattr(original, "_sm121_shim", False):
        return

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        from vllm_sm121.config import record_traced_choices
        from vllm_sm121.graph.tail import install_worker

        install_worker(vllm_config)
        record_traced_choices(vllm_config)  # before vLLM hashes the config (compile cache, plans)

    check_and_update_config._sm121_shim = True
    base.check_and_update_config = classmethod(check_and_update_config)


def register_whole_model_graph() -> None:
    """Shims 0006 + 0007: --additional-config sm121.cudagraph = whole_model installs WholeModelWorker."""
    on_import("vllm.platforms.cuda", _patch_cuda_platform_config)
