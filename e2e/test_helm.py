"""The Helm chart (manifests/charts/kvscale/) with the real helm (e2e/helm.py) on the real control
plane and node: it replaces the kustomize install, its operator serves a resource, `helm upgrade`
of a value rolls the operator (and no worker), `helm rollback` rolls it back, `helm uninstall`
removes everything it made and leaves the CRD and the workloads; the kustomize install is then
restored for the tests after. Its PodMonitors are admitted by the API server against the
prometheus-operator's PodMonitor CRD, generated from that project's Go module
(e2e/prometheus_operator.py)."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import helm as helm_build
import prometheus_operator
import pytest
import yaml
from kubernetes import client
from test_controlplane import wait_for
from test_operator import (  # noqa: F401 (fixtures)
    OPERATOR,
    OPERATOR_NS,
    REPO,
    apply,
    example,
    namespace,
    operator,
    operator_pods,
    wait_for_new_leader,
    wait_ready,
)
from test_probes import worker_pod

pytestmark = pytest.mark.slow

CHART = REPO / "manifests" / "charts" / "kvscale"
RELEASE = "kvscale"
WORKER_PORT = 8000


class Helm:
    def __init__(self, cluster) -> None:
        self.exe = str(helm_build.build())
        self.kubeconfig = str(cluster.kubeconfig)

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [self.exe, "--kubeconfig", self.kubeconfig, "--namespace", OPERATOR_NS, *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}: rc {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out


def rendered(helm: Helm) -> list[dict]:
    """The objects the chart makes where PodMonitors are served (as here, once their CRD is in)."""
    text = helm(
        "template", RELEASE, str(CHART), "--api-versions", "monitoring.coreos.com/v1/PodMonitor"
    ).stdout
    return [d for d in yaml.safe_load_all(text) if d]


def exists(cluster, obj: dict) -> bool:
    ns = obj["metadata"].get("namespace")
    where = ["-n", ns] if ns else []
    kind = (
        f"{obj['kind'].lower()}.{obj['apiVersion'].split('/')[0]}"
        if "/" in obj["apiVersion"]
        else obj["kind"]
    )
    out = cluster.kubectl("get", kind, obj["metadata"]["name"], *where, "--ignore-not-found", "-o", "name")
    return bool(out.stdout.strip())


def operator_env(cluster) -> dict[str, str]:
    deployment = client.AppsV1Api(cluster.api).read_namespaced_deployment(OPERATOR, OPERATOR_NS)
    return {e.name: e.value for e in deployment.spec.template.spec.containers[0].env if e.value is not None}


def stop_operator(cluster) -> None:
    """The operator's Deployment scaled to zero, until its pods are gone."""
    cluster.kubectl("scale", f"deployment/{OPERATOR}", "-n", OPERATOR_NS, "--replicas=0")
    wait_for(lambda: not operator_pods(cluster), timeout=90, what="the operator's pods to stop")


def complete(address: str, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": "def f(x):", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://{address}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def test_helm_installs_upgrades_rolls_back_and_uninstalls_the_operator(operator, namespace):  # noqa: F811
    helm = Helm(operator)
    crd = prometheus_operator.podmonitor_crd()
    operator.kubectl("apply", "--server-side", "-f", str(crd))
    operator.kubectl(
        "wait", "--for=condition=Established", "crd/podmonitors.monitoring.coreos.com", "--timeout=60s"
    )
    objects = rendered(helm)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "ClusterRole", "PodMonitor"} <= kinds, kinds
    before = operator_pods(operator)
    charted: set[str] = set()  # every operator pod the chart ran: none may still lead at the end
    try:
        # The kustomize install's objects go (not its namespace, which Helm never owns), then the
        # chart installs the same objects from nothing.
        # The operator's pods first, its rights once they are gone: a pod still stopping would be
        # refused its last Lease release, and e2e/test_operator.py's audit check allows no 403.
        stop_operator(operator)
        for obj in objects:
            if obj["kind"] != "PodMonitor":
                operator.kubectl(
                    "delete", "--ignore-not-found", "--wait=false", "-f", "-", input=json.dumps(obj)
                )
        helm("install", RELEASE, str(CHART), "--wait", "--timeout", "4m")
        assert all(exists(operator, o) for o in objects), [o["metadata"]["name"] for o in objects]
        installed = operator_pods(operator)
        charted |= installed
        leader = wait_for_new_leader(operator, before)
        assert leader in installed

        # The chart's operator serves a resource.
        apply(operator, example("charted", namespace, replicas=1))
        wait_ready(operator, "charted", namespace, replicas=1)
        worker = worker_pod(operator, namespace, "charted")
        address = f"{worker.status.pod_ip}:{WORKER_PORT}"
        assert complete(address, "charted")["choices"][0]["text"]

        # A value changes: the operator rolls, the workers do not.
        helm(
            "upgrade",
            RELEASE,
            str(CHART),
            "--reuse-values",
            "--set",
            "logLevel=DEBUG",
            "--wait",
            "--timeout",
            "4m",
        )
        assert operator_env(operator)["KVSCALE_LOG_LEVEL"] == "DEBUG"
        wait_for_new_leader(operator, installed)
        upgraded = operator_pods(operator)
        charted |= upgraded
        assert not upgraded & installed
        # The new leader has taken the resource over: it still reports it, and the same worker serves.
        wait_ready(operator, "charted", namespace, replicas=1)
        assert worker_pod(operator, namespace, "charted").metadata.uid == worker.metadata.uid
        assert complete(address, "charted")["choices"][0]["text"]

        helm("rollback", RELEASE, "1", "--wait", "--timeout", "4m")
        assert operator_env(operator)["KVSCALE_LOG_LEVEL"] == "INFO"
        wait_for_new_leader(operator, upgraded)
        charted |= operator_pods(operator)
        history = json.loads(helm("history", RELEASE, "-o", "json").stdout)
        assert [(h["revision"], h["status"]) for h in history] == [
            (1, "superseded"),
            (2, "superseded"),
            (3, "deployed"),
        ], history

        # `helm uninstall` deletes the Deployment and the RBAC in one pass, while the pods take
        # seconds to stop: scaled to zero first, as above (docs/operator.md, "Helm").
        stop_operator(operator)
        helm("uninstall", RELEASE, "--wait", "--timeout", "3m")
        left = [f"{o['kind']}/{o['metadata']['name']}" for o in objects if exists(operator, o)]
        assert not left, left
        # The CRD (Helm never deletes crds/) and the workloads stay: only the operator went.
        operator.kubectl("get", "crd", "inferencedeployments.kvscale.dev")
        assert worker_pod(operator, namespace, "charted").metadata.uid == worker.metadata.uid
    finally:
        if helm("status", RELEASE, check=False).returncode == 0:
            stop_operator(operator)
            helm("uninstall", RELEASE, "--wait", "--timeout", "3m", check=False)
        operator.kubectl("delete", "crd", "podmonitors.monitoring.coreos.com", "--ignore-not-found")
        during = operator_pods(operator) | charted
        operator.kubectl("apply", "--server-side", "-k", str(REPO / "manifests"))
        wait_for_new_leader(operator, during)
