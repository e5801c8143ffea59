"""Every Python package in the tree ships in the wheel (pyproject's explicit packages list)."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_is_listed_with_its_directory():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg.get("package-dir", {})

    def path_of(pkg: str) -> pathlib.Path:
        for prefix in sorted(dirs, key=len, reverse=True):
            if pkg == prefix or pkg.startswith(prefix + "."):
                rest = pkg[len(prefix):].lstrip(".")
                return ROOT / dirs[prefix] / rest.replace(".", "/")
        return ROOT / pkg.replace(".", "/")

    for pkg in listed:
        assert (path_of(pkg) / "__init__.py").exists(), f"{pkg} is listed but {path_of(pkg)} has no __init__.py"
    found = set()
    for init in (ROOT / "vllm_sm121").rglob("__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    for init in (ROOT / "kernels").rglob("__init__.py"):
        found.add(".".join(("vllm_sm121",) + init.parent.relative_to(ROOT).parts))
    found = {p for p in found if "__pycache__" not in p}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
