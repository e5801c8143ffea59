"""Every VLLM_SM121_* variable the package reads is declared in ``vllm_sm121/envs.py``
(``DECLARED``, design.md: one place) with the module that reads it, and nothing declared is stale."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_variable_is_declared_in_envs():
    from vllm_sm121.envs import DECLARED

    used: dict[str, set[str]] = {}
    for folder in ("vllm_sm121", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "envs.py" and folder == "vllm_sm121":
                continue  # the declarations themselves (VLLM_SM121_FAULT, read there, is checked below)
            for name in re.findall(r"VLLM_SM121_[A-Z0-9_]*[A-Z0-9]", path.read_text()):
                used.setdefault(name, set()).add(path.relative_to(ROOT).as_posix())
    used.setdefault("VLLM_SM121_FAULT", set()).add("vllm_sm121/envs.py")  # read by envs.__getattr__
    missing = sorted(set(used) - set(DECLARED))
    stale = sorted(set(DECLARED) - set(used))
    assert not missing, f"read but not declared in vllm_sm121/envs.py: {missing}"
    assert not stale, f"declared but read nowhere: {stale}"
    for name, (where, what) in DECLARED.items():
        assert name.startswith("VLLM_SM121_") and what, name
        assert where in used[name], f"{name}: declared as read in {where}, found in {sorted(used[name])}"
