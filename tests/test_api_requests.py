"""The requests the InferencePool's calls (kube/inferencepool.py, through kube/client.py) and the
router's scale-from-zero ask (router/wake.py) send, made by the real kubernetes client
against a stand-in API server (a local HTTP server that records each request and answers with
canned objects: tests only)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from kubernetes import client

from kvscale.operator.kube import inferencepool
from kvscale.operator.kube.client import Kube
from kvscale.router.wake import scale_up_from_zero

DISCOVERY = {
    "kind": "APIResourceList",
    "groupVersion": "inference.networking.k8s.io/v1",
    "resources": [{"name": "inferencepools", "namespaced": True, "kind": "InferencePool", "verbs": ["get"],
                   "singularName": "inferencepool"}],
}  # fmt: skip
POOL = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "items": [],
        "metadata": {"name": "tiny", "namespace": "ns", "resourceVersion": "1"}}  # fmt: skip
SCALE = {"apiVersion": "autoscaling/v1", "kind": "Scale", "spec": {"replicas": 0}, "status": {"replicas": 0},
         "metadata": {"name": "tiny", "namespace": "ns", "resourceVersion": "7"}}  # fmt: skip


@pytest.fixture
def api_server(monkeypatch):
    seen: list[tuple[str, str, str | None, dict | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            seen.append((self.command, self.path, self.headers.get("Content-Type"), body))
            if self.path == "/apis/inference.networking.k8s.io/v1":
                out = DISCOVERY
            elif self.path.endswith("/scale"):
                out = SCALE
            else:
                out = POOL
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_PUT = do_DELETE = _answer

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{server.server_address[1]}"
    api = client.ApiClient(cfg)
    yield api, seen
    server.shutdown()


def test_the_inference_pool_is_discovered_read_applied_listed_and_deleted_as_the_api_expects(api_server):
    api, seen = api_server
    kube = Kube(api)
    assert inferencepool.served(client.CustomObjectsApi(api), 30)
    assert kube.read("InferencePool", "tiny", "ns")["kind"] == "InferencePool"
    pool = {
        "apiVersion": POOL["apiVersion"],
        "kind": "InferencePool",
        "metadata": {"name": "tiny", "namespace": "ns"},
    }
    kube.apply({**pool, "spec": {"targetPorts": [{"number": 8000}]}})
    assert kube.list_children("InferencePool") == []
    kube.delete("InferencePool", "tiny", "ns")
    base = "/apis/inference.networking.k8s.io/v1"
    assert [(m, p, t) for m, p, t, _ in seen] == [
        ("GET", base, None),
        ("GET", f"{base}/namespaces/ns/inferencepools/tiny", None),
        ("PATCH", f"{base}/namespaces/ns/inferencepools/tiny?fieldManager=kvscale-operator&force=true",
         "application/apply-patch+yaml"),
        ("GET", f"{base}/inferencepools?labelSelector="
         "app.kubernetes.io/managed-by%3Dkvscale-operator%2Ckvscale.dev/inference-deployment", None),
        ("DELETE", f"{base}/namespaces/ns/inferencepools/tiny", None),
    ]  # fmt: skip
    assert seen[2][3]["spec"] == {"targetPorts": [{"number": 8000}]}


def test_the_routers_ask_reads_the_scale_and_puts_one_replica_with_its_resource_version(api_server):
    api, seen = api_server
    assert asyncio.run(scale_up_from_zero(client.AppsV1Api(api), "tiny", "ns")()) is True
    (get, put) = seen
    assert get[:2] == ("GET", "/apis/apps/v1/namespaces/ns/deployments/tiny/scale")
    assert put[:2] == ("PUT", "/apis/apps/v1/namespaces/ns/deployments/tiny/scale")
    assert put[3]["spec"] == {"replicas": 1} and put[3]["metadata"]["resourceVersion"] == "7"
