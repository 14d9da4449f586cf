"""KEDA for the e2e tests: its operator and its metrics adapter (the external metrics API server),
built from the Go module github.com/kedacore/keda/v2 fetched through the module proxy (v2.21.0: the
newest that builds with Go 1.26; v2.21.1 needs 1.27.4), its CRDs the module's own.

    python e2e/keda.py build    # e2e/.bin/keda-operator and e2e/.bin/keda-adapter

Both run as processes beside the control plane (`running`), with the admin kubeconfig, as KEDA
runs them in-cluster but without leader election or its own certificate rotation: one CA and one
certificate made here serve the adapter's API, the operator's gRPC metrics service and the
mutual TLS between them. The adapter is registered with the API server's aggregation layer the
way KEDA's manifests register it (APIService v1beta1.external.metrics.k8s.io -> Service
keda/keda-metrics-apiserver), the Service's endpoints being the node address the adapter listens
on (the control plane routes to endpoints: e2e/controlplane, --enable-aggregator-routing). The
HPA that KEDA makes then reads the metric through the API server, as in any cluster.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import certs
import go_module
from host_process import free_port, processes

MODULE, VERSION = "github.com/kedacore/keda/v2", "v2.21.0"
PROGRAMS = {"keda-operator": "./cmd/operator", "keda-adapter": "./cmd/adapter"}
BIN = Path(__file__).resolve().parent / ".bin"
NAMESPACE = "keda"
ADAPTER_SERVICE = "keda-metrics-apiserver"
APISERVICE = "v1beta1.external.metrics.k8s.io"


def build(timeout: float = 3600) -> dict[str, Path]:
    """Both binaries, unless built from this version already (in a writable copy of the module:
    the module cache is read-only)."""
    exes = {name: BIN / name for name in PROGRAMS}
    stamps = {name: exe.with_suffix(".version") for name, exe in exes.items()}
    if all(
        exe.is_file() and stamps[n].is_file() and stamps[n].read_text() == VERSION for n, exe in exes.items()
    ):
        return exes
    source = go_module.fetch(MODULE, VERSION, "cmd/operator/main.go")
    BIN.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"}
    with go_module.writable_copy(source) as tree:
        for name, package in PROGRAMS.items():
            subprocess.run(
                ["go", "build", "-o", str(exes[name]), package],
                cwd=tree,
                check=True,
                timeout=timeout,
                env=env,
            )
            stamps[name].write_text(VERSION)
    return exes


def crds() -> list[Path]:
    return sorted(
        (go_module.fetch(MODULE, VERSION, "cmd/operator/main.go") / "config" / "crd" / "bases").glob("*.yaml")
    )


def registration(node_ip: str, port: int, ca: bytes) -> list[dict]:
    """The Service, its endpoints (the adapter on the node's address) and the APIService."""
    labels = {"app.kubernetes.io/part-of": "kvscale-e2e-keda"}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE, "labels": labels},
            "spec": {"ports": [{"name": "https", "port": 443, "targetPort": port, "protocol": "TCP"}]},
        },
        # Both forms of the endpoints: which one the aggregator's resolver reads depends on the
        # Kubernetes version (Endpoints, long deprecated, then EndpointSlices).
        {
            "apiVersion": "v1",
            "kind": "Endpoints",
            "metadata": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE, "labels": labels},
            "subsets": [
                {
                    "addresses": [{"ip": node_ip}],
                    "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
                }
            ],
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": ADAPTER_SERVICE,
                "namespace": NAMESPACE,
                "labels": {**labels, "kubernetes.io/service-name": ADAPTER_SERVICE},
            },
            "addressType": "IPv6" if ":" in node_ip else "IPv4",
            "endpoints": [{"addresses": [node_ip], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        },
        {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": APISERVICE, "labels": labels},
            "spec": {
                "service": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE, "port": 443},
                "group": "external.metrics.k8s.io",
                "version": "v1beta1",
                "caBundle": base64.b64encode(ca).decode(),
                "groupPriorityMinimum": 100,
                "versionPriority": 100,
            },
        },
    ]


@contextlib.contextmanager
def running(
    kubectl, kubeconfig: Path, node_ip: str, workdir: Path, timeout: float = 120
) -> Iterator[dict[str, Path]]:
    """KEDA's CRDs applied, its operator and adapter running and the adapter registered, until
    the block ends (the APIService first: an unavailable one fails API discovery for everyone).
    Yields each program's log."""
    exes = build()
    for crd in crds():
        kubectl("apply", "--server-side", "-f", str(crd))
    cert_dir = workdir / "certs"
    host = f"[{node_ip}]" if ":" in node_ip else node_ip
    ca = certs.serving_cert(
        cert_dir,
        [
            "IP:127.0.0.1",
            f"IP:{node_ip}",
            f"DNS:{ADAPTER_SERVICE}.{NAMESPACE}.svc",
            f"DNS:keda-operator.{NAMESPACE}.svc",
        ],
        name="keda-e2e",
    )
    grpc, operator_health, adapter_port = free_port(), free_port(), free_port(node_ip)
    k = str(kubeconfig)
    programs = {
        "keda-operator": (
            [
                str(exes["keda-operator"]),
                "--leader-elect=false",
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                f"--health-probe-bind-address=127.0.0.1:{operator_health}",
                f"--metrics-service-bind-address=127.0.0.1:{grpc}",
                f"--cert-dir={cert_dir}",
                "--enable-cert-rotation=false",
                "--enable-webhook-patching=false",
                "--enable-apiservice-patching=false",
                f"--ca-dir={cert_dir}",
                "--zap-log-level=info",
            ],
            f"http://127.0.0.1:{operator_health}/readyz",
        ),
        "keda-adapter": (
            [
                str(exes["keda-adapter"]),
                f"--secure-port={adapter_port}",
                f"--bind-address={node_ip}",
                f"--port={free_port()}",
                f"--metrics-service-address=127.0.0.1:{grpc}",
                f"--client-ca-file={cert_dir / 'ca.crt'}",
                f"--tls-cert-file={cert_dir / 'tls.crt'}",
                f"--tls-private-key-file={cert_dir / 'tls.key'}",
                f"--cert-dir={cert_dir}",
                f"--lister-kubeconfig={k}",
                f"--authentication-kubeconfig={k}",
                f"--authorization-kubeconfig={k}",
            ],
            f"https://{host}:{adapter_port}/readyz",
        ),
    }
    env = {
        **os.environ,
        "KUBECONFIG": k,
        "POD_NAMESPACE": NAMESPACE,
        "POD_NAME": "keda-e2e",
        "KEDA_CLUSTER_OBJECT_NAMESPACE": NAMESPACE,
        "WATCH_NAMESPACE": "",
    }
    objects = registration(node_ip, adapter_port, ca)
    with processes(programs, env, workdir, timeout) as logs:
        try:
            for obj in objects:
                kubectl("apply", "--server-side", "-f", "-", input=json.dumps(obj))
            kubectl("wait", "--for=condition=Available", f"apiservice/{APISERVICE}", "--timeout=60s")
            yield logs
        finally:
            kubectl("delete", "apiservice", APISERVICE, "--ignore-not-found", check=False)
            kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false", check=False)


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit(__doc__)
    print(build())
