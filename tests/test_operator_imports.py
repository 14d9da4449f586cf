"""What the images install: every package folder is in the wheel, and the operator and router
images, which install only the `operator` extra, import every module of kvscale.operator,
kvscale.router and kvscale.common without the worker's dependencies (the images' smoke checks do
the same at build time; these find it before an image is built: an editable install hides both)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from model_fixtures import REPO


def test_every_operator_router_and_common_module_imports_without_the_worker_only_dependencies():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(extra: str) -> set[str]:
        reqs = meta["optional-dependencies"][extra]
        return {r.split(">")[0].split("<")[0].split("=")[0].strip() for r in reqs}

    # The router's tokenizer imports transformers only when asked (router/tokenizer.py): blocked too.
    worker_only = names("worker") - names("operator")
    modules = sorted(m.replace("-", "_").lower() for m in worker_only)
    assert {"torch", "transformers", "xgrammar"} <= set(modules)
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in modules)  # an import of it fails
    code = (
        f"import sys, importlib, pkgutil; {blocked}; "
        "import kvscale.common, kvscale.operator, kvscale.router; "
        "[importlib.import_module(m.name) for p in (kvscale.common, kvscale.operator, kvscale.router) "
        "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_every_package_folder_is_in_the_wheel():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {folder: name for name, folder in tool["package-dir"].items()}
    folders = sorted(p.parent for root in roots for p in (REPO / root).rglob("__init__.py"))
    names = set()
    for folder in folders:
        rel = folder.relative_to(REPO).parts
        names.add(".".join([roots[rel[0]], *rel[1:]]))
    assert names - set(tool["packages"]) == set(), "add them to [tool.setuptools] packages"
