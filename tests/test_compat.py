"""Every shim in vllm_sm121.compat names a patch under patches/vllm/ that applies to vLLM 0.26.0."""

import pathlib
import re
import shutil
import subprocess

import pytest

from vllm_sm121 import compat

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches" / "vllm"


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
    touched = sorted(set(re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), re.M)))
    assert touched, f"{patch} touches no file"
    for rel in touched:
        dst = tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_site_packages() / rel, dst)
    proc = subprocess.run(["git", "apply", "--check", "-p1", str(patch)], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_patch_is_listed_in_readme_and_named_by_a_shim():
    readme = (PATCHES.parent / "README.md").read_text()
    named = {s.patch for s in compat.SHIMS}
    for p in PATCHES.glob("*.patch"):
        assert p.name in readme, f"{p.name} missing from patches/README.md"
        assert p.name in named, f"{p.name} is named by no shim in vllm_sm121/compat.py"
