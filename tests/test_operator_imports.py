"""The operator and router images install only the `operator` extra: every module under
kvscale.operator must import without the worker's dependencies (the image's smoke check does the
same at build time; this finds it before an image is built)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from model_fixtures import REPO


def test_every_operator_module_imports_without_the_worker_only_dependencies():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    worker_only = {
        r.split(">")[0].split("<")[0].split("=")[0].strip() for r in meta["optional-dependencies"]["worker"]
    }
    modules = sorted(m.replace("-", "_").lower() for m in worker_only)
    assert {"torch", "transformers", "xgrammar", "partial_json_parser"} <= set(modules)
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in modules)  # an import of it fails
    code = (
        f"import sys, importlib, pkgutil; {blocked}; import kvscale.operator as op; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(op.__path__, 'kvscale.operator.')]"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
