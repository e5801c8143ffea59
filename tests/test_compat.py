"""Every shim in vllm_sm121.compat names a patch under patches/vllm/ that applies to vLLM 0.26.0.

Patches that retire no shim (upstream-only fixes) say ``none`` in the shim column of
patches/README.md; they must apply too.
"""

import pathlib
import re
import shutil
import subprocess

import pytest

from vllm_sm121 import compat

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches" / "vllm"
README = PATCHES.parent / "README.md"


def _upstream_only_patches() -> list[str]:
    """Patches whose README row names no shim (its third column starts with ``none``)."""
    rows = re.findall(r"^\| `([^`]+\.patch)` \|[^|]*\| none\b", README.read_text(), re.MULTILINE)
    return sorted(rows)


def _site_packages() -> pathlib.Path:
    import vllm

    return pathlib.Path(vllm.__file__).resolve().parents[1]


def test_vllm_is_the_pinned_version():
    import vllm

    assert vllm.__version__ == "0.26.0"


@pytest.mark.parametrize("shim", compat.SHIMS, ids=lambda s: s.patch)
def test_shim_patch_exists_and_applies(shim, tmp_path):
    patch = PATCHES / shim.patch
    assert patch.is_file(), f"{shim.symbol}: missing {patch}"
    _assert_applies(patch, tmp_path)


@pytest.mark.parametrize("name", _upstream_only_patches())
def test_upstream_only_patch_applies(name, tmp_path):
    assert name not in {s.patch for s in compat.SHIMS}, f"{name} is named by a shim"
    _assert_applies(PATCHES / name, tmp_path)


def _assert_applies(patch: pathlib.Path, tmp_path: pathlib.Path) -> None:
    touched = sorted(set(re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), re.MULTILINE)))
    assert touched, f"{patch} touches no file"
    for rel in touched:
        dst = tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_site_packages() / rel, dst)
    proc = subprocess.run(["git", "apply", "--check", "-p1", str(patch)], cwd=tmp_path, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr


def test_every_patch_is_listed_in_readme_and_named_by_a_shim():
    readme = README.read_text()
    named = {s.patch for s in compat.SHIMS} | set(_upstream_only_patches())
    for p in PATCHES.glob("*.patch"):
        assert p.name in readme, f"{p.name} missing from patches/README.md"
        assert p.name in named, (
            f"{p.name} is named by no shim in vllm_sm121/compat.py "
            "(nor marked `none` in patches/README.md)"
        )


def test_drafter_follows_sm121_target():
    """Shim 0002 on a stand-in proposer: inherit SM121 only when the draft config names no backend."""
    import dataclasses
    import types

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import vllm_sm121

    vllm_sm121.register()

    @dataclasses.dataclass
    class Attn:
        backend: object = None

    @dataclasses.dataclass
    class Cfg:
        attention_config: Attn

    class Proposer:
        def __init__(self, target_backend, draft_backend):
            self.vllm_config = Cfg(Attn(target_backend))
            self.speculative_config = types.SimpleNamespace(attention_backend=draft_backend)

        def _create_draft_vllm_config(self):  # upstream: never inherit
            return Cfg(Attn(self.speculative_config.attention_backend))

    fake_module = types.SimpleNamespace(SpecDecodeBaseProposer=Proposer)
    compat._patch_create_draft_vllm_config(fake_module)
    sm121 = AttentionBackendEnum["SM121"]
    assert Proposer(sm121, None)._create_draft_vllm_config().attention_config.backend is sm121
    triton = AttentionBackendEnum.TRITON_ATTN
    assert Proposer(sm121, triton)._create_draft_vllm_config().attention_config.backend is triton
    assert Proposer(triton, None)._create_draft_vllm_config().attention_config.backend is None
    assert Proposer(None, None)._create_draft_vllm_config().attention_config.backend is None


def test_post_import_hook_patches_on_first_import(tmp_path, monkeypatch):
    import sys

    (tmp_path / "sm121_probe_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    compat.on_import("sm121_probe_mod", lambda m: seen.append(m.VALUE))
    assert seen == [] and "sm121_probe_mod" not in sys.modules
    import sm121_probe_mod  # noqa: F401

    assert seen == [1]
    compat.on_import("sm121_probe_mod", lambda m: seen.append(2))  # already imported: runs now
    assert seen == [1, 2]
