"""The test cluster is a real Kubernetes: schema and CEL validation, controllers, garbage
collection, RBAC, and pods that run (on the node stand-in when the cluster is local)."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from kubernetes import client

TESTDATA = Path(__file__).parent / "testdata"


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.25, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def namespace(cluster):
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_crd_schema_and_cel_are_enforced(cluster, namespace):
    cluster.kubectl("apply", "--server-side", "-f", str(TESTDATA / "widget-crd.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/widgets.test.kvscale.dev", "--timeout=60s")

    def widget(name: str, spec: dict) -> str:
        return json.dumps(
            {"apiVersion": "test.kvscale.dev/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}
        )

    ok = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=widget("ok", {"size": 3, "min": 1, "max": 2})
    )
    assert "created" in ok.stdout
    too_big = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=widget("big", {"size": 11}), check=False
    )
    assert (
        too_big.returncode != 0
        and "spec.size" in too_big.stderr
        and "less than or equal to 10" in too_big.stderr
    )
    missing = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget("none", {}), check=False)
    assert missing.returncode != 0 and "spec.size: Required value" in missing.stderr
    cel = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=widget("cel", {"size": 1, "min": 5, "max": 2}), check=False
    )
    assert cel.returncode != 0 and "min must not exceed max" in cel.stderr
    names = cluster.kubectl("get", "widgets", "-n", namespace, "-o", "name").stdout.split()
    assert names == ["widget.test.kvscale.dev/ok"]


def test_deployment_creates_replicaset_and_pods_and_deletion_collects_them(cluster, namespace):
    apps, core = client.AppsV1Api(cluster.api), client.CoreV1Api(cluster.api)
    labels = {"app": "sleeper"}
    deployment = client.V1Deployment(
        metadata=client.V1ObjectMeta(name="sleeper"),
        spec=client.V1DeploymentSpec(
            replicas=2,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(
                    termination_grace_period_seconds=2,
                    containers=[client.V1Container(name="main", image="busybox", command=["sleep", "3600"])],
                ),
            ),
        ),
    )
    apps.create_namespaced_deployment(namespace, deployment)
    rs = wait_for(lambda: apps.list_namespaced_replica_set(namespace).items, what="the ReplicaSet")
    assert rs[0].metadata.owner_references[0].kind == "Deployment"
    pods = wait_for(
        lambda: (
            (p := core.list_namespaced_pod(namespace, label_selector="app=sleeper").items)
            and len(p) == 2
            and p
        ),
        what="two pods",
    )
    assert all(p.metadata.owner_references[0].kind == "ReplicaSet" for p in pods)

    apps.delete_namespaced_deployment("sleeper", namespace)  # background propagation, the default
    wait_for(
        lambda: not apps.list_namespaced_replica_set(namespace).items, what="the ReplicaSet to be collected"
    )
    wait_for(
        lambda: not core.list_namespaced_pod(namespace, label_selector="app=sleeper").items,
        what="the pods to be collected",
    )


def test_rbac_refuses_a_verb_the_role_lacks(cluster, namespace, tmp_path):
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    cluster.kubectl(
        "create", "role", "pod-reader", "--verb=get,list,watch", "--resource=pods", "-n", namespace
    )
    cluster.kubectl(
        "create",
        "rolebinding",
        "reader",
        "--role=pod-reader",
        f"--serviceaccount={namespace}:reader",
        "-n",
        namespace,
    )
    cluster.kubectl(
        "run",
        "victim",
        "--image=busybox",
        "--restart=Never",
        "-n",
        namespace,
        "--command",
        "--",
        "sleep",
        "3600",
    )
    token = cluster.kubectl("create", "token", "reader", "-n", namespace).stdout.strip()
    # A kubeconfig with only the token: the admin client certificate would authenticate first.
    admin = cluster.kubectl("config", "view", "--raw", "--minify", "-o", "json")
    cluster_entry = json.loads(admin.stdout)["clusters"][0]
    as_reader = tmp_path / "reader.kubeconfig"
    as_reader.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster_entry],
                "users": [{"name": "reader", "user": {"token": token}}],
                "contexts": [{"name": "r", "context": {"cluster": cluster_entry["name"], "user": "reader"}}],
                "current-context": "r",
            }
        )
    )
    from cluster import kubectl

    listed = kubectl(as_reader, "get", "pods", "-n", namespace, "-o", "name")
    assert "pod/victim" in listed.stdout
    refused = kubectl(as_reader, "delete", "pod", "victim", "-n", namespace, check=False)
    assert (
        refused.returncode != 0
        and "Forbidden" in refused.stderr
        and 'cannot delete resource "pods"' in refused.stderr
    )
    assert (
        kubectl(as_reader, "auth", "can-i", "delete", "pods", "-n", namespace, check=False).stdout.strip()
        == "no"
    )
    other = kubectl(as_reader, "get", "pods", "-n", "default", check=False)
    assert other.returncode != 0 and "Forbidden" in other.stderr
    assert cluster.kubectl("get", "pod", "victim", "-n", namespace).returncode == 0  # still there


def test_node_stand_in_runs_the_pod_command_on_loopback_and_reports_ready(cluster, namespace):
    if not cluster.local:
        pytest.skip("the node stand-in only runs on the local control plane")
    core = client.CoreV1Api(cluster.api)
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="web"),
        spec=client.V1PodSpec(
            termination_grace_period_seconds=5,
            containers=[
                client.V1Container(
                    name="web",
                    image="python",
                    command=[Path(sys.executable).name, "-m", "http.server", "--bind", "$(POD_IP)", "8080"],
                    env=[
                        client.V1EnvVar(
                            name="POD_IP",
                            value_from=client.V1EnvVarSource(
                                field_ref=client.V1ObjectFieldSelector(field_path="status.podIP")
                            ),
                        )
                    ],
                    ports=[client.V1ContainerPort(container_port=8080, name="http")],
                    readiness_probe=client.V1Probe(
                        http_get=client.V1HTTPGetAction(path="/", port="http"), period_seconds=1
                    ),
                )
            ],
        ),
    )
    core.create_namespaced_pod(namespace, pod)

    def ready():
        p = core.read_namespaced_pod("web", namespace)
        conditions = {c.type: c.status for c in p.status.conditions or []}
        return p if conditions.get("Ready") == "True" else None

    running = wait_for(ready, timeout=60, what="the pod to turn Ready")
    ip = running.status.pod_ip
    assert running.spec.node_name == "kvscale-node-0" and running.status.phase == "Running"
    assert ip.startswith("127.0.0.") and ip != "127.0.0.1"
    with urllib.request.urlopen(f"http://{ip}:8080/", timeout=5) as r:
        assert r.status == 200  # the real process answers on the pod's own address

    core.delete_namespaced_pod("web", namespace)
    wait_for(lambda: not core.list_namespaced_pod(namespace).items, what="the pod to be gone")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{ip}:8080/", timeout=2)
