"""LeaderWorkerSet (kubernetes-sigs/lws) for the e2e tests: its upstream CRD, from the Go module
sigs.k8s.io/lws fetched through the Go module proxy (as e2e/controlplane's modules are), never
a hand-written copy.

    python e2e/lws.py        # fetch the module (go mod download), print the CRD's path

The module lands in the Go module cache (GOMODCACHE, ~/go/pkg/mod): read-only, verified against
the checksum database, shared with every later run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

MODULE, VERSION = "sigs.k8s.io/lws", "v0.8.0"
CRD = "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"


def _mod_cache() -> Path:
    if os.environ.get("GOMODCACHE"):
        return Path(os.environ["GOMODCACHE"])
    return Path(os.environ.get("GOPATH") or Path.home() / "go") / "pkg" / "mod"


def module_dir() -> Path:
    """Where the module's source is once fetched (it may not be yet)."""
    return _mod_cache() / f"{MODULE}@{VERSION}"


def lws_crd_path() -> Path:
    return module_dir() / CRD


def fetch(timeout: float = 600) -> Path:
    """The module's folder, downloaded first where needed (`go mod download` outside any module)."""
    if lws_crd_path().is_file():
        return module_dir()
    if shutil.which("go") is None:
        raise RuntimeError("the Go toolchain is needed to fetch sigs.k8s.io/lws (https://go.dev/dl)")
    with tempfile.TemporaryDirectory() as empty:
        out = subprocess.run(
            ["go", "mod", "download", "-json", f"{MODULE}@{VERSION}"],
            cwd=empty,
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "GOFLAGS": "-mod=mod"},
        )
    return Path(json.loads(out.stdout)["Dir"])


if __name__ == "__main__":
    print(fetch() / CRD)
