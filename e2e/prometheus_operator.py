"""The prometheus-operator's PodMonitor CRD for the e2e tests, generated from the types of its Go
module (github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring, fetched through the
module proxy; the repository's own CRD files are not in any module it serves) by the real
controller-gen (sigs.k8s.io/controller-tools), as upstream generates them: what the chart's
PodMonitors are validated against by the API server (e2e/test_helm.py).

    python e2e/prometheus_operator.py   # build controller-gen, generate, print the CRD's path
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import go_module

MODULE, VERSION = "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring", "v0.95.2"
TOOLS, TOOLS_VERSION = "sigs.k8s.io/controller-tools", "v0.23.0"
BIN = Path(__file__).resolve().parent / ".bin"
CONTROLLER_GEN = BIN / "controller-gen"
CRDS = BIN / f"monitoring-crds-{VERSION}"
PODMONITOR = CRDS / "monitoring.coreos.com_podmonitors.yaml"


def controller_gen(timeout: float = 1800) -> Path:
    stamp = CONTROLLER_GEN.with_suffix(".version")
    if CONTROLLER_GEN.is_file() and stamp.is_file() and stamp.read_text() == TOOLS_VERSION:
        return CONTROLLER_GEN
    source = go_module.fetch(TOOLS, TOOLS_VERSION, "cmd/controller-gen/main.go")
    BIN.mkdir(parents=True, exist_ok=True)
    with go_module.writable_copy(source) as tree:
        subprocess.run(
            ["go", "build", "-o", str(CONTROLLER_GEN), "./cmd/controller-gen"],
            cwd=tree,
            check=True,
            timeout=timeout,
            env={**os.environ, "CGO_ENABLED": "0"},
        )
    stamp.write_text(TOOLS_VERSION)
    return CONTROLLER_GEN


def podmonitor_crd(timeout: float = 600) -> Path:
    """The PodMonitor CRD generated from the module's v1 types (once; kept in e2e/.bin)."""
    if PODMONITOR.is_file():
        return PODMONITOR
    gen = controller_gen()
    source = go_module.fetch(MODULE, VERSION, "v1/podmonitor_types.go")
    with go_module.writable_copy(source) as tree:
        subprocess.run(
            [str(gen), "crd", "paths=./v1", f"output:crd:dir={CRDS}"],
            cwd=tree,
            check=True,
            timeout=timeout,
            env={**os.environ, "GOFLAGS": "-mod=mod"},
        )
    return PODMONITOR


if __name__ == "__main__":
    print(podmonitor_crd())
