"""The operator on an IPv6-first dual-stack node (issue 27: IPv6 and dual-stack addresses
everywhere). Opt-in: KVSCALE_E2E_IPV6_FIRST=1 makes the session's real node IPv6-first
dual-stack (e2e/realnode.py); on the default IPv4 node this module skips. Measured run:
docs/operator.md#ipv6-and-dual-stack.

    KVSCALE_E2E_IPV6_FIRST=1 flock /tmp/kvscale-e2e.lock .venv/bin/pytest -q e2e/test_ipv6_node.py

On that node the operator's own pod reaches the API server through the IPv6 `kubernetes`
Service; a worker pod gets an IPv6 `status.podIP` (and an IPv4 second address) and turns Ready
on the kubelet's IPv6 probes; the autoscaler reads its /metrics at `http://[ip]:8000`
(ScalingActive=True, MetricsAvailable: at least one worker read, and none unreadable); the
workers' Service is IPv6 and its EndpointSlices carry IPv6 addresses, which the router turns into
bracketed URLs and reaches: a completion through the router's IPv6 ClusterIP returns 200.
"""

from __future__ import annotations

import ipaddress
import json
import urllib.request

import pytest
from kubernetes import client
from realnode import POD_CIDR, POD_CIDR6, SERVICE_CIDR6
from test_controlplane import wait_for
from test_operator import apply, condition, example, get_cr, namespace, operator  # noqa: F401
from test_router import router_ip, wait_router, worker_pods


@pytest.fixture
def ipv6_node(operator):  # noqa: F811
    if not (operator.local and operator.node is not None and operator.node.stack.ipv6):
        pytest.skip("needs the IPv6-first node: KVSCALE_E2E_IPV6_FIRST=1")
    return operator


def test_a_worker_on_ipv6_is_ready_scraped_and_routed_to(ipv6_node, namespace):  # noqa: F811
    cluster, ns, name = ipv6_node, namespace, "v6"
    doc = example(name, ns)
    del doc["spec"]["replicas"]
    doc["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 1}
    apply(cluster, doc)
    ip = wait_router(cluster, name, ns)
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(SERVICE_CIDR6), ip

    def ready_worker():
        pods = [p for p in worker_pods(cluster, ns) if p.metadata.deletion_timestamp is None]
        ready = [
            p
            for p in pods
            if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        ]
        return ready[0] if ready else None

    worker = wait_for(ready_worker, timeout=180, interval=0.5, what="a Ready worker")
    ips = [ipaddress.ip_address(a.ip) for a in worker.status.pod_ips]
    assert ipaddress.ip_address(worker.status.pod_ip) in ipaddress.ip_network(POD_CIDR6)
    assert [a.version for a in ips] == [6, 4] and ips[1] in ipaddress.ip_network(POD_CIDR), ips

    # The autoscaler read it: at least one worker's metrics (an IPv6 pod: a bracketed URL) and
    # none unreadable. Before issue 27 the URL had no brackets: every worker unreadable, NoMetrics.
    def scraped():
        cr = get_cr(cluster, name, ns)
        auto = (cr.get("status") or {}).get("autoscaling") or {}
        active = condition(cr, "ScalingActive")
        ok = active.get("reason") == "MetricsAvailable" and auto.get("unreadableWorkers") == 0
        return (active, auto) if ok and auto.get("readyWorkers") == 1 else None

    wait_for(scraped, timeout=60, interval=0.5, what="the autoscaler to read the IPv6 worker's metrics")

    # The workers' Service and its slices are IPv6; the router reaches the worker through them.
    core, discovery = client.CoreV1Api(cluster.api), client.DiscoveryV1Api(cluster.api)
    service = core.read_namespaced_service(name, ns).spec
    assert service.ip_families == ["IPv6"], service.ip_families
    slices = discovery.list_namespaced_endpoint_slice(ns, label_selector=f"kubernetes.io/service-name={name}")
    assert {s.address_type for s in slices.items} == {"IPv6"}
    body = {"model": name, "prompt": "def fibonacci(n):", "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        f"http://[{router_ip(cluster, name, ns)}]:8000/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.status == 200
        assert json.loads(r.read())["choices"][0]["text"]
