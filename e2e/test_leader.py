"""Leader fencing on the real node (docs/operator.md, "Leader election and fencing"): the operator
runs as two pods from its image under the ServiceAccount of manifests/, with short lease timings.
Freezing the leader's process (SIGSTOP) past the lease lets the standby take over and reconcile;
the old leader, resumed (SIGCONT), makes no write at all. Who wrote what is read from the API
server's audit log: both pods share one ServiceAccount, so each request is told apart by the pod
its bound token names (`authentication.kubernetes.io/pod-name`), else by the pod's IP."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import time
import uuid

import pytest
from kubernetes import client
from test_controlplane import wait_for
from test_operator import (  # noqa: F401 (operator: the fixture)
    GROUP,
    OPERATOR,
    OPERATOR_NS,
    OPERATOR_USER,
    PLURAL,
    VERSION,
    apply,
    example,
    operator,
)

# The operator's timings for this test (kvscale-operator run reads them from its env): a leader
# that cannot renew stops after 4 s, a standby takes over 6 s after it last saw a renewal (short,
# with room for a loaded node: a spurious loss before the freeze would fail the test).
LEASE_S, DEADLINE_S, RETRY_S = 6, 4, 1
LEASE_ENV = {
    "KVSCALE_LEASE_DURATION": str(LEASE_S),
    "KVSCALE_RENEW_DEADLINE": str(DEADLINE_S),
    "KVSCALE_RETRY_PERIOD": str(RETRY_S),
}
WRITES = {"create", "update", "patch", "delete", "deletecollection"}
POD_NAME = "authentication.kubernetes.io/pod-name"
# A frozen process sends nothing: a request the API server received later than this after the
# freeze was sent after the process resumed (this covers one already on the wire at SIGSTOP).
IN_FLIGHT_S = 2.0
SELECTOR = "app.kubernetes.io/name=kvscale-operator"


def operator_pods(cluster) -> list[client.V1Pod]:
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(OPERATOR_NS, label_selector=SELECTOR).items
    return [p for p in pods if p.status.phase == "Running" and p.metadata.deletion_timestamp is None]


def holder(cluster) -> str | None:
    try:
        lease = client.CoordinationV1Api(cluster.api).read_namespaced_lease(OPERATOR, OPERATOR_NS)
    except client.ApiException:
        return None
    return lease.spec.holder_identity


def rolled_out(cluster) -> None:
    """The operator's Deployment rolled out; two pods run, one of them holds the lease."""
    cluster.kubectl("rollout", "status", f"deployment/{OPERATOR}", "-n", OPERATOR_NS, "--timeout=180s")

    def settled():
        names = {p.metadata.name for p in operator_pods(cluster)}
        return len(names) == 2 and holder(cluster) in names

    wait_for(settled, timeout=90, interval=0.5, what="two operator pods, one of them leading")


@pytest.fixture
def short_lease(operator):  # noqa: F811 (the fixture imported above)
    if not operator.local:
        pytest.skip("freezes the operator's process on the local node and reads the audit log")
    env = [f"{k}={v}" for k, v in LEASE_ENV.items()]
    operator.kubectl("set", "env", f"deployment/{OPERATOR}", "-n", OPERATOR_NS, *env)
    rolled_out(operator)
    yield operator
    unset = [f"{k}-" for k in LEASE_ENV]
    operator.kubectl("set", "env", f"deployment/{OPERATOR}", "-n", OPERATOR_NS, *unset)
    rolled_out(operator)


@pytest.fixture
def fence_namespace(short_lease):
    name = f"fence-{uuid.uuid4().hex[:6]}"
    short_lease.kubectl("create", "namespace", name)
    yield name
    short_lease.kubectl("delete", "namespace", name, "--wait=false", check=False)


def audit_events(cluster) -> list[dict]:
    lines = (cluster.state_dir / "audit.log").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("user", {}).get("username") == OPERATOR_USER]


def by_pod(event: dict, pod: client.V1Pod) -> bool:
    names = event["user"].get("extra", {}).get(POD_NAME)
    if names is not None:
        return pod.metadata.name in names
    return pod.status.pod_ip in event.get("sourceIPs", [])


def resource(event: dict) -> str | None:
    return event.get("objectRef", {}).get("resource")


def received(event: dict) -> float:
    return dt.datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()


def describe(event: dict) -> str:
    return f"{event['requestReceivedTimestamp']} {event['verb']} {event['requestURI']}"


def reconciled(cluster, name: str, namespace: str) -> bool:
    """The operator applied the children and reported status for the current generation."""
    try:
        client.AppsV1Api(cluster.api).read_namespaced_deployment(name, namespace)
        cr = client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )
    except client.ApiException:
        return False
    return (cr.get("status") or {}).get("observedGeneration") == cr["metadata"]["generation"]


def restarts(cluster, pod: client.V1Pod) -> int:
    live = client.CoreV1Api(cluster.api).read_namespaced_pod(pod.metadata.name, OPERATOR_NS)
    return live.status.container_statuses[0].restart_count


def test_a_frozen_leader_is_replaced_and_writes_nothing_when_it_resumes(short_lease, fence_namespace):
    """SIGSTOP the leader past the lease: the standby takes the lease and reconciles (a resource
    created meanwhile gets its children and status). SIGCONT: the old process finds its renew
    deadline long past, refuses every write and exits 1; the audit log shows it wrote nothing
    after the freeze, while the new leader wrote."""
    cluster, ns = short_lease, fence_namespace
    # No workers (replicas 0): the test is about the operator's writes, not about pods.
    apply(cluster, example("before", ns, replicas=0))
    wait_for(lambda: reconciled(cluster, "before", ns), timeout=60, what="the leader to reconcile")
    pods = {p.metadata.name: p for p in operator_pods(cluster)}
    leader_name = holder(cluster)
    leader = pods.pop(leader_name)
    (standby,) = pods.values()
    pid = cluster.node.container_pid(leader.status.container_statuses[0].container_id)
    restarts_before = restarts(cluster, leader)

    os.kill(pid, signal.SIGSTOP)
    frozen_at = time.time()
    try:
        apply(cluster, example("during", ns, replicas=0))
        wait_for(
            lambda: holder(cluster) == standby.metadata.name,
            timeout=30,
            interval=0.2,
            what="the standby to take the lease from the frozen leader",
        )
        took_over = time.time()
        # It waited out the lease by its own clock, from the last renewal it saw (at most one
        # retry period before the freeze).
        assert took_over - frozen_at >= LEASE_S - RETRY_S - 0.5, took_over - frozen_at
        wait_for(lambda: reconciled(cluster, "during", ns), timeout=30, what="the new leader to reconcile")
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pytest.fail("the frozen leader was killed before it could resume (liveness probe?)")
    resumed_at = time.time()

    # Work the old leader would do if it still acted: a spec change (its kopf watch delivers it)
    # besides the status, Deployment and event changes it missed while frozen.
    changed = example("before", ns, replicas=0)
    changed["spec"]["engine"]["maxNumSeqs"] = 8
    apply(cluster, changed)
    wait_for(lambda: reconciled(cluster, "before", ns), timeout=30, what="the new leader to apply a change")
    # It stops and exits 1 (the lease is lost); its pod restarts it as a standby.
    wait_for(
        lambda: restarts(cluster, leader) > restarts_before,
        timeout=90,
        interval=0.5,
        what="the old leader to stop and restart as a standby",
    )
    previous = cluster.kubectl("logs", "--previous", leader_name, "-n", OPERATOR_NS).stdout
    assert "lost the lease" in previous, previous[-3000:]
    assert holder(cluster) == standby.metadata.name
    # The old pod is heard from again (its restarted process reads the lease as a standby), so
    # the audit log covers the time after the resume.
    wait_for(
        lambda: any(by_pod(e, leader) and received(e) >= resumed_at for e in audit_events(cluster)),
        timeout=60,
        interval=1,
        what="a request of the old leader's pod after it resumed",
    )

    events = audit_events(cluster)
    old = [e for e in events if by_pod(e, leader)]
    new = [e for e in events if by_pod(e, standby)]
    # The identities are told apart, and the old leader did write while it led (its renewals).
    assert not any(by_pod(e, standby) for e in old)
    assert any(e["verb"] == "update" and resource(e) == "leases" and received(e) < frozen_at for e in old), (
        "no lease renewal of the old leader in the audit log: the pods' identities are not told apart"
    )
    # The standby took over and reconciled: it wrote after the takeover.
    assert any(e["verb"] in WRITES and received(e) >= took_over - 1 for e in new)
    # The old pod wrote nothing after the freeze: no lease, no status, no child, no event.
    late = [describe(e) for e in old if e["verb"] in WRITES and received(e) >= frozen_at + IN_FLIGHT_S]
    assert not late, f"the old leader wrote after it was frozen (resumed at {resumed_at}): {late}"
