"""The test cluster is a real Kubernetes: schema and CEL validation, controllers, garbage
collection, RBAC. (Pods that run: e2e/test_realnode.py.)"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client
from runtime import PAUSE_IMAGE

TESTDATA = Path(__file__).parent / "testdata"


def sleeper_image(cluster) -> str:
    """An image the cluster has without a registry: locally the pause image the real node
    imported (pods stay Pending without a node, which these tests allow)."""
    return "busybox" if not cluster.local else PAUSE_IMAGE


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
                    containers=[
                        client.V1Container(
                            name="main",
                            image=sleeper_image(cluster),
                            image_pull_policy="IfNotPresent",
                            command=None if cluster.local else ["sleep", "3600"],
                        )
                    ],
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
    sleep = [] if cluster.local else ["--command", "--", "sleep", "3600"]
    cluster.kubectl(
        "run", "victim", f"--image={sleeper_image(cluster)}", "--image-pull-policy=IfNotPresent",
        "--restart=Never", "-n", namespace, *sleep,
    )  # fmt: skip
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
