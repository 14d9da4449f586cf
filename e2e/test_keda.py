"""KEDA for real (e2e/keda.py: its operator and metrics adapter, built from its module, the adapter
behind the API server's aggregation layer), with a real Prometheus scraping the workers (found
through the API by the test: Debian's Prometheus is built without Kubernetes service discovery):
a ScaledObject on an InferenceDeployment's /scale subresource, with a Prometheus trigger on
vllm:num_requests_waiting, scales it up under load and back to its minimum afterwards. Our
autoscaler is off (no spec.autoscaling): every change of the resource's replicas is the HPA
controller's write through /scale, for the HPA KEDA made."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import keda
import pytest
import yaml
from audit import OPERATOR_USER, audit_lines
from host_process import free_port, processes
from kubernetes import client
from realnode import NODE_IP
from service_route import wait_routed
from test_controlplane import wait_for
from test_operator import GROUP, PLURAL, VERSION, apply, example, get_cr, namespace, operator  # noqa: F401
from test_probes import WORKER_PORT

pytestmark = pytest.mark.slow

NAME = "keda"
QUERY = 'sum(vllm:num_requests_waiting{{namespace="{ns}"}}) or vector(0)'


def prometheus_config(targets: Path) -> dict:
    """Scrape the worker pods listed in `targets` (file_sd): Debian's Prometheus is built without
    Kubernetes service discovery, so `discover` plays that part, from the same API."""
    return {
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "scrape_configs": [
            {
                "job_name": "kvscale-workers",
                "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "2s"}],
            }
        ],
    }


def discover(cluster, ns: str, targets: Path, stop: threading.Event) -> None:
    """Until stop: every second, the namespace's running worker pods into Prometheus' file_sd
    targets (written whole, then renamed: Prometheus never reads half a file)."""
    core = client.CoreV1Api(cluster.api)
    while not stop.wait(1.0):
        pods = core.list_namespaced_pod(ns, label_selector="app.kubernetes.io/name=kvscale-worker").items
        groups = [
            {
                "targets": [f"{p.status.pod_ip}:{WORKER_PORT}"],
                "labels": {"namespace": ns, "pod": p.metadata.name},
            }
            for p in pods
            if p.status.phase == "Running" and p.status.pod_ip and p.metadata.deletion_timestamp is None
        ]
        partial = targets.with_suffix(".tmp")
        partial.write_text(json.dumps(groups))
        partial.replace(targets)


def scaled_object(ns: str, prometheus: str) -> dict:
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "InferenceDeployment",
                "name": NAME,
            },
            "pollingInterval": 2,
            "minReplicaCount": 1,
            "maxReplicaCount": 2,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {"stabilizationWindowSeconds": 0},
                        "scaleDown": {
                            "stabilizationWindowSeconds": 10,
                            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 5}],
                        },
                    }
                }
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {"serverAddress": prometheus, "query": QUERY.format(ns=ns), "threshold": "1"},
                }
            ],
        },
    }


def scale_writes(cluster, since_line: int, ns: str) -> list[tuple[str, str]]:
    """(user, verb) of each write to the resource's /scale after `since_line` of the audit log."""
    out = []
    for line in (cluster.state_dir / "audit.log").read_text().splitlines()[since_line:]:
        event = json.loads(line)
        ref = event.get("objectRef") or {}
        where = (ref.get("resource"), ref.get("subresource"), ref.get("namespace"))
        if where == (PLURAL, "scale", ns) and event["verb"] in ("update", "patch"):
            out.append((event["user"]["username"], event["verb"]))
    return out


def ready_replicas(cluster, ns: str) -> int:
    return (get_cr(cluster, NAME, ns).get("status") or {}).get("readyReplicas") or 0


def load(address_of, stop: threading.Event, errors: list[str], n: int = 4) -> list[threading.Thread]:
    """n clients sending long completions back to back through the resource's Service until
    stop is set: with maxNumSeqs 1 all but one wait."""
    body = json.dumps({"model": NAME, "prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True}).encode()

    def client_loop() -> None:
        while not stop.is_set():
            request = urllib.request.Request(
                f"http://{address_of()}/v1/completions", body, {"Content-Type": "application/json"}
            )
            try:
                urllib.request.urlopen(request, timeout=300).read()
            except OSError as e:
                errors.append(repr(e))

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_keda_scales_the_resource_through_scale_on_the_queue(operator, namespace, tmp_path):  # noqa: F811
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("needs the prometheus binary (the Debian package prometheus)")
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(targets)))
    discovering = threading.Event()
    threading.Thread(target=discover, args=(operator, namespace, targets, discovering), daemon=True).start()
    port = free_port()
    prometheus = f"http://127.0.0.1:{port}"
    argv = [
        binary,
        f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    doc = example(NAME, namespace, replicas=1)
    doc["spec"]["engine"] = {**doc["spec"].get("engine", {}), "maxNumSeqs": 1}
    assert "autoscaling" not in doc["spec"]
    with (
        processes({"prometheus": (argv, f"{prometheus}/-/ready")}, {}, tmp_path / "prometheus"),
        keda.running(operator.kubectl, operator.kubeconfig, NODE_IP, tmp_path / "keda") as logs,
    ):
        try:
            apply(operator, doc)
            wait_for(lambda: ready_replicas(operator, namespace) == 1, timeout=180, what="one worker")
            operator.kubectl(
                "apply", "--server-side", "-f", "-", input=json.dumps(scaled_object(namespace, prometheus))
            )

            def hpa_reads_the_metric():
                hpas = (
                    client.AutoscalingV2Api(operator.api)
                    .list_namespaced_horizontal_pod_autoscaler(namespace)
                    .items
                )
                metrics = hpas[0].status.current_metrics if hpas and hpas[0].status else None
                return hpas[0] if metrics and metrics[0].external and metrics[0].external.current else None

            hpa = wait_for(
                hpa_reads_the_metric, timeout=120, interval=1, what=f"KEDA's HPA to read the metric ({logs})"
            )
            assert hpa.spec.scale_target_ref.kind == "InferenceDeployment"
            mark = audit_lines(operator)

            # Load through the Service: the queue builds at the one worker, KEDA's HPA scales to two.
            service = client.CoreV1Api(operator.api).read_namespaced_service(NAME, namespace)
            wait_routed(service.spec.cluster_ip, WORKER_PORT)
            stop, errors = threading.Event(), []
            loaded = time.monotonic()
            threads = load(lambda: f"{service.spec.cluster_ip}:{WORKER_PORT}", stop, errors)
            try:
                wait_for(
                    lambda: ready_replicas(operator, namespace) == 2,
                    timeout=240,
                    interval=1,
                    what=f"KEDA to scale the resource to 2 ready workers ({errors[-3:]})",
                )
            finally:
                stop.set()
            up_s = time.monotonic() - loaded
            stopped = time.monotonic()
            for t in threads:
                t.join(timeout=300)
            # The queue drains: back to the minimum.
            wait_for(
                lambda: (
                    get_cr(operator, NAME, namespace)["spec"]["replicas"] == 1
                    and ready_replicas(operator, namespace) == 1
                ),
                timeout=180,
                interval=1,
                what="KEDA to scale the resource back to 1",
            )
            down_s = time.monotonic() - stopped
            print(
                json.dumps(
                    {"keda_scale_up_to_2_ready_s": round(up_s, 1), "keda_back_to_1_s": round(down_s, 1)}
                )
            )
            writes = scale_writes(operator, mark, namespace)
            assert len(writes) >= 2, writes  # up and down, each through /scale
            # None by our operator (its autoscaler is off for this resource): the HPA controller's.
            assert OPERATOR_USER not in {user for user, _ in writes}, writes
            assert not errors, errors[:3]
        finally:
            discovering.set()
            # KEDA's finalizer: deleted while its operator runs (the namespace would hang otherwise).
            operator.kubectl(
                "delete", "scaledobject", NAME, "-n", namespace, "--ignore-not-found", "--timeout=60s"
            )
