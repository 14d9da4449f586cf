"""The real node: pods from our images run by the kubelet through containerd on the CNI bridge,
non-root with a read-only root filesystem, probed by the kubelet, reached through a Service's
ClusterIP that kube-proxy rewrites; pods reach the API server through the `kubernetes` Service."""

from __future__ import annotations

import ipaddress
import json
import urllib.request
import uuid

import pytest
from kubernetes import client
from realnode import NODE_NAME, POD_CIDR, SERVICE_CIDR
from test_controlplane import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def real_node(cluster):
    cluster.require_node()
    if not cluster.local:
        pytest.skip("checks the local real node")
    return cluster


@pytest.fixture
def node_namespace(real_node):
    name = f"n-{uuid.uuid4().hex[:6]}"
    real_node.kubectl("create", "namespace", name)
    yield name
    real_node.kubectl("delete", "namespace", name, "--wait=false", check=False)


# A tiny HTTP server from the operator image's python: serves on 8080, answers its own identity
# and whether it can reach the API server through the `kubernetes` Service (in-cluster config).
SERVER = """
import http.server, json, os, ssl, urllib.request
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"uid": os.getuid(), "host": os.uname().nodename}
        try:
            open("/probe", "w")
        except OSError as e:
            body["rootfs"] = e.strerror
        if self.path == "/api":
            sa = "/var/run/secrets/kubernetes.io/serviceaccount"
            ctx = ssl.create_default_context(cafile=sa + "/ca.crt")
            env = os.environ
            url = "https://%s:%s/version" % (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"])
            auth = {"Authorization": "Bearer " + open(sa + "/token").read()}
            req = urllib.request.Request(url, headers=auth)
            body["api"] = json.load(urllib.request.urlopen(req, context=ctx, timeout=10))["gitVersion"]
        data = json.dumps(body).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(data)
http.server.ThreadingHTTPServer(("", 8080), H).serve_forever()
"""


def test_pods_run_our_image_locked_down_behind_a_cluster_ip(real_node, node_namespace):
    ns, image = node_namespace, real_node.images.images["operator"]
    container = {
        "name": "web",
        "image": image,
        "imagePullPolicy": "Never",
        "command": ["python", "-c", SERVER],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        "securityContext": {
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": ns},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000},
                    "containers": [container],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": ns},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    for doc in (deployment, service):
        real_node.kubectl("apply", "-f", "-", input=json.dumps(doc))
    real_node.kubectl("rollout", "status", "deployment/web", "-n", ns, "--timeout=120s")

    core = client.CoreV1Api(real_node.api)
    pods = core.list_namespaced_pod(ns, label_selector="app=web").items
    assert len(pods) == 2
    for pod in pods:
        assert pod.spec.node_name == NODE_NAME
        assert ipaddress.ip_address(pod.status.pod_ip) in ipaddress.ip_network(POD_CIDR)
    cluster_ip = core.read_namespaced_service("web", ns).spec.cluster_ip
    assert ipaddress.ip_address(cluster_ip) in ipaddress.ip_network(SERVICE_CIDR)

    def get(path: str) -> dict:
        with urllib.request.urlopen(f"http://{cluster_ip}{path}", timeout=15) as r:
            return json.loads(r.read())

    def both_answer() -> bool:
        # Until kube-proxy has the endpoints (moments after the rollout), its rules refuse.
        try:
            return {get("/")["host"] for _ in range(20)} == {p.metadata.name for p in pods}
        except OSError:
            return False

    wait_for(both_answer, timeout=30, what="both pods answering behind the ClusterIP")
    answer = get("/api")
    assert answer["uid"] == 1000 and answer["rootfs"] == "Read-only file system"
    assert answer["api"] == "v1.37.2"

    logs = real_node.kubectl("logs", pods[0].metadata.name, "-n", ns).stdout
    assert "GET /api" in logs or "GET /" in logs
    exec_ = real_node.kubectl("exec", pods[0].metadata.name, "-n", ns, "--", "id", "-u")
    assert exec_.stdout.strip() == "1000"
