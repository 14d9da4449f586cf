"""One endpoint for many models, on the real node (issue 31): an InferenceEndpoint and two
InferenceDeployments that name it in spec.router.endpoint.

- The operator renders one shared router (the endpoint's Deployment and Service, named as the
  endpoint) with a pool per model, and no router of their own for the members; the endpoint's
  status lists both models and the members' status gives the endpoint's URL.
- Through the endpoint's Service (its ClusterIP, kube-proxy on this node): `model` picks the
  pool; an unknown model gets OpenAI's 404 before any queue; /v1/models lists both, the one at
  zero included.
- "beta" (autoscaling.minReplicas 0) goes to zero while "alpha" serves; with client load on
  alpha, one request for beta makes exactly one scale-up of beta's Deployment, written by the
  endpoint's ServiceAccount, and is answered 200, while alpha's requests keep being served
  (0 failed) and alpha is never scaled.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from audit import audit_lines
from kubernetes import client
from service_route import wait_routed
from test_controlplane import wait_for
from test_operator import (  # noqa: F401 (fixtures)
    GROUP,
    VERSION,
    apply,
    example,
    get_cr,
    namespace,
    operator,
    wait_ready,
)
from test_router import ClientLoad, complete, scale_writes, worker_pods

ENDPOINTS = "inferenceendpoints"


def endpoint_cr(cluster, name: str, ns: str) -> dict:
    return client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(
        GROUP, VERSION, ns, ENDPOINTS, name
    )


def get_json(ip: str, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{ip}:8000{path}", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_two_models_behind_one_endpoint_one_scaled_from_zero_while_the_other_serves(
    operator,  # noqa: F811
    namespace,  # noqa: F811
):
    if not operator.local:
        pytest.skip("reads the local API server's audit log")
    ns, shared = namespace, "shared"
    apps = client.AppsV1Api(operator.api)
    # One router replica: the node's two CPUs also run both models' workers.
    apply(
        operator,
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceEndpoint",
            "metadata": {"name": shared, "namespace": ns},
            "spec": {"router": {"replicas": 1}},
        },
    )
    alpha = example("alpha", ns, router={"endpoint": shared}, replicas=1)
    beta = example("beta", ns, router={"endpoint": shared})
    del beta["spec"]["replicas"]
    beta["spec"]["autoscaling"] = {
        "minReplicas": 0,
        "maxReplicas": 1,
        "scaleToZeroAfterSeconds": 15,
        "scaleDownStabilizationSeconds": 10,
    }
    apply(operator, alpha)
    apply(operator, beta)

    # The operator's picture: one shared router with both pools, no router of the members' own.
    def both_joined():
        status = endpoint_cr(operator, shared, ns).get("status") or {}
        ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})
        names = [m["name"] for m in status.get("models", [])]
        return status if ready.get("status") == "True" and sorted(names) == ["alpha", "beta"] else None

    status = wait_for(both_joined, timeout=120, interval=0.5, what="the endpoint to list both models")
    assert status["endpoint"] == f"http://{shared}.{ns}.svc:8000"
    args = apps.read_namespaced_deployment(shared, ns).spec.template.spec.containers[0].args
    assert "alpha=alpha" in args and "beta=beta,scale=beta" in args, args
    wait_ready(operator, "alpha", ns, replicas=1)
    for member in ("alpha", "beta"):
        assert get_cr(operator, member, ns)["status"]["endpoint"] == f"http://{shared}.{ns}.svc:8000"
        with pytest.raises(client.ApiException) as gone:
            apps.read_namespaced_deployment(f"{member}-router", ns)
        assert gone.value.status == 404

    def beta_at_zero():
        return apps.read_namespaced_deployment("beta", ns).spec.replicas == 0 and not [
            p
            for p in worker_pods(operator, ns)
            if p.metadata.labels.get("kvscale.dev/inference-deployment") == "beta"
        ]

    wait_for(beta_at_zero, timeout=420, interval=1, what="the idle beta to reach zero")

    def router_ready():
        dep = apps.read_namespaced_deployment(shared, ns)
        return (dep.status.ready_replicas or 0) >= 1

    wait_for(router_ready, timeout=180, interval=0.5, what="the shared router to be ready")
    ip = client.CoreV1Api(operator.api).read_namespaced_service(shared, ns).spec.cluster_ip
    wait_routed(ip, 8000)

    # `model` picks the pool; an unknown one is refused in OpenAI's shape, before any queue.
    code, body = complete(ip, "alpha")
    assert code == 200, body
    code, body = complete(ip, "gamma")
    error = json.loads(body)["error"]
    assert (code, error["code"], error["param"]) == (404, "model_not_found", "model"), body
    code, models = get_json(ip, "/v1/models")
    assert code == 200 and {"alpha", "beta"} <= {m["id"] for m in models["data"]}, models
    assert apps.read_namespaced_deployment("beta", ns).spec.replicas == 0  # listing woke nothing

    # beta wakes while alpha serves: one scale-up, by the endpoint's ServiceAccount.
    mark = audit_lines(operator)
    load = ClientLoad(ip, "alpha", "requests for alpha through the endpoint")
    before = len(load.results)
    code, body = complete(ip, "beta", timeout=300)  # waits for beta's first worker
    served_meanwhile = len(load.results) - before
    load.stop()
    assert code == 200, body
    assert not load.errors, load.errors[:5]
    assert served_meanwhile >= 3 and set(load.results) == {200}, served_meanwhile
    endpoint_sa = f"system:serviceaccount:{ns}:{shared}"
    assert scale_writes(operator, mark, ns, "beta") == [endpoint_sa]
    assert scale_writes(operator, mark, ns, "alpha") == []
    assert apps.read_namespaced_deployment("beta", ns).spec.replicas == 1
