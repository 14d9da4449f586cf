"""The real `helm` binary, built from its Go module (helm.sh/helm/v4) fetched through the module
proxy, as e2e/lws.py builds the LeaderWorkerSet controller: what the chart's tests
(tests/test_helm_chart.py, e2e/test_helm.py) run.

    python e2e/helm.py build    # e2e/.bin/helm, unless built from this version already
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import go_module

MODULE, VERSION = "helm.sh/helm/v4", "v4.3.2"
HELM_BIN = Path(__file__).resolve().parent / ".bin" / "helm"


def build(timeout: float = 3600) -> Path:
    """e2e/.bin/helm from the module's ./cmd/helm (in a writable copy: the module cache is
    read-only), unless built from this version already."""
    stamp = HELM_BIN.with_suffix(".version")
    if HELM_BIN.is_file() and stamp.is_file() and stamp.read_text() == VERSION:
        return HELM_BIN
    source = go_module.fetch(MODULE, VERSION, "cmd/helm/helm.go")
    HELM_BIN.parent.mkdir(parents=True, exist_ok=True)
    with go_module.writable_copy(source) as tree:
        subprocess.run(
            ["go", "build", "-o", str(HELM_BIN), "./cmd/helm"],
            cwd=tree,
            check=True,
            timeout=timeout,
            env={**os.environ, "CGO_ENABLED": "0"},
        )
    stamp.write_text(VERSION)
    return HELM_BIN


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit(__doc__)
    print(build())
