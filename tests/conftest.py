"""Test set-up: CPU runs use Triton's interpreter; GPU tests are marked ``gpu`` and skip without CUDA.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is created, so it is decided
here, before the kernel modules are imported by the tests.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_patches_once() -> bool:
    """Speed up Triton's interpreter (CI time): it re-patches ``triton.language`` (an
    ``inspect.getmembers`` walk of three modules) on every call of a ``@triton.jit`` helper inside a
    kernel, although the launch has already patched the same modules and restores them when it ends.
    Here a helper call whose language modules the enclosing launch has patched reuses that patch;
    anything else goes through Triton's own ``_patch_lang``. What runs is unchanged (the same
    interpreted builtins); ~40% of an FMA MoE kernel's interpreter time was this walk. Returns
    False (and changes nothing) where the interpreter lacks the hooks this relies on (Triton 3.6's)."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    orig, scope_cls = getattr(interp, "_patch_lang", None), getattr(interp, "_LangPatchScope", None)
    if orig is None or scope_cls is None or getattr(orig, "_sm121_once", False):
        return False
    patched: list[set] = []  # per enclosing launch: ids of the language modules it patched

    seen: dict[int, set] = {}  # id of a function's globals -> its language modules

    def langs(fn) -> set:
        key = id(fn.__globals__)
        if key not in seen:
            seen[key] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        return seen[key]

    def patch_lang(fn):
        want = langs(fn)
        if patched and want <= patched[-1]:
            return scope_cls()  # nothing new to patch, nothing to restore
        scope = orig(fn)
        if patched:  # a helper seeing another module: patched as Triton does (its scope is dropped there too)
            patched[-1] |= want
            return scope
        patched.append(want)
        restore = scope.restore

        def restore_and_pop():
            patched.pop()
            restore()

        scope.restore = restore_and_pop
        return scope

    patch_lang._sm121_once = True
    interp._patch_lang = patch_lang
    return True


if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("VLLM_SM121_TEST_PLAIN_INTERPRETER") != "1":
    _interpreter_patches_once()


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cuda" if HAS_CUDA else "cpu",
        help="device for kernel tests: cpu (Triton interpreter) or cuda",
    )


@pytest.fixture
def device(request) -> str:
    return request.config.getoption("--device")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _forget_registered_moe_scales():
    """Expert weight scales registered as F2-free (``kernels.moe.register_weight_scales``, e.g. by a MoE
    method test's load step) are keyed by address: forgotten after each test, so that a later test's
    tensor at a reused address keeps the F2 multiply."""
    yield
    import sys

    moe = sys.modules.get("vllm_sm121.kernels.moe")
    if moe is not None:
        moe._F2_FREE_SCALES.clear()


@pytest.fixture
def exact_moe_products(monkeypatch):
    """Pin the MoE FMA GEMVs to the exact fp32 products ($VLLM_SM121_MOE_FMA_F16X2=0) for tests that
    hold them to the exact rules (FC1 within one e4m3 step of the reference): on a GPU the packed
    fp16 products are the default; a test of those sets the variable itself."""
    monkeypatch.setenv("VLLM_SM121_MOE_FMA_F16X2", "0")
