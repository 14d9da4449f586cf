"""Go modules fetched through the module proxy, outside any module, and built from a writable copy:
how the harness gets the programs it runs beside the control plane that are not in its own
module set (the LeaderWorkerSet controller, CoreDNS)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _mod_cache() -> Path:
    if os.environ.get("GOMODCACHE"):
        return Path(os.environ["GOMODCACHE"])
    return Path(os.environ.get("GOPATH") or Path.home() / "go") / "pkg" / "mod"


def module_dir(module: str, version: str) -> Path:
    """Where the module's source is once fetched (it may not be yet)."""
    return _mod_cache() / f"{module}@{version}"


def fetch(module: str, version: str, marker: str, timeout: float = 600) -> Path:
    """The module's folder, downloaded first (`go mod download`) unless `marker`, a file inside it,
    is there already."""
    if (module_dir(module, version) / marker).is_file():
        return module_dir(module, version)
    if shutil.which("go") is None:
        raise RuntimeError(f"the Go toolchain is needed to fetch {module} (https://go.dev/dl)")
    with tempfile.TemporaryDirectory() as empty:
        out = subprocess.run(
            ["go", "mod", "download", "-json", f"{module}@{version}"],
            cwd=empty,
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "GOFLAGS": "-mod=mod"},
        )
    return Path(json.loads(out.stdout)["Dir"])


@contextlib.contextmanager
def writable_copy(source: Path) -> Iterator[Path]:
    """A temporary writable copy of a module's source: the module cache is read-only."""
    with tempfile.TemporaryDirectory() as work:
        tree = Path(work) / source.name.split("@")[0]
        shutil.copytree(source, tree)
        subprocess.run(["chmod", "-R", "u+w", str(tree)], check=True)
        yield tree
