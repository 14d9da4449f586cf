"""The operator's own /metrics, /healthz and /readyz on the real node (operator/health.py), read
from the operator pods' IPs (the node's bridge is reachable from this host, as for the workers
in test_probes.py): the leader counts the reconcile of a new resource and says it leads, the
standby says it stands by, and both are live and ready."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_controlplane import wait_for
from test_leader import holder, operator_pods, reconciled
from test_operator import apply, example, namespace, operator  # noqa: F401 (fixtures)

HEALTH_PORT = 8080  # manifests/base/deployment.yaml: kvscale-operator run --health-port


def get(ip: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{ip}:{HEALTH_PORT}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sample(ip: str, name: str, **labels: str) -> float:
    """One sample of the pod's /metrics (0 when absent: a counter not yet moved)."""
    status, text = get(ip, "/metrics")
    assert status == 200, text[:300]
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_the_leader_counts_reconciles_and_leads_and_the_standby_is_live_and_ready(operator, namespace):  # noqa: F811
    if not operator.local:
        pytest.skip("reads the operator pods' IPs, reachable from the local node's host only")
    wait_for(lambda: len(operator_pods(operator)) == 2, timeout=90, what="both operator pods running")
    leader_name = holder(operator)
    pods = {p.metadata.name: p for p in operator_pods(operator)}
    leader = pods.pop(leader_name).status.pod_ip
    (standby,) = (p.status.pod_ip for p in pods.values())
    ok_before = sample(leader, "kvscale_operator_reconciles_total", result="ok")

    apply(operator, example("counted", namespace, replicas=0))  # no workers: the reconcile is the point
    wait_for(lambda: reconciled(operator, "counted", namespace), timeout=60, what="the reconcile")
    wait_for(
        lambda: sample(leader, "kvscale_operator_reconciles_total", result="ok") > ok_before,
        timeout=30,
        what="the leader's reconcile counter to move",
    )
    assert sample(leader, "kvscale_operator_leader") == 1
    assert sample(standby, "kvscale_operator_leader") == 0
    assert sample(standby, "kvscale_operator_reconciles_total", result="ok") == 0  # a standby does nothing
    assert sample(leader, "kvscale_operator_status_writes_total", manager="kvscale-operator") >= 1
    assert get(leader, "/readyz") == (200, "leading")
    assert get(standby, "/readyz") == (200, "standby")
    assert get(leader, "/healthz") == (200, "ok") and get(standby, "/healthz") == (200, "ok")
