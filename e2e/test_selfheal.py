"""The operator heals its children on the real node: a deleted Deployment, Service or PDB is
recreated within seconds, `kubectl scale` and `kubectl set image` on the Deployment are
reverted, and an unchanged resource makes the operator write nothing at all, while its watches
do run (the API server's audit log shows both, and that every watch of a child carries a label
selector: only our children are streamed)."""

from __future__ import annotations

import json
import time

import pytest
from images import WORKER_IMAGE
from kubernetes import client
from test_controlplane import wait_for
from test_operator import (  # noqa: F401 (fixtures)
    OPERATOR_USER,
    apply,
    example,
    namespace,
    operator,
    wait_ready,
)

CHILDREN = {"deployments", "services", "poddisruptionbudgets"}
WRITES = {"create", "update", "patch", "delete", "deletecollection"}
HEAL_S = 15  # "within seconds": one watch event and one apply


def audit_lines(cluster) -> int:
    return len((cluster.state_dir / "audit.log").read_text().splitlines())


def operator_requests(cluster, since_line: int, ns: str | None = None) -> list[dict]:
    """The operator's requests in the audit log after line `since_line` (in namespace `ns`)."""
    out = []
    for line in (cluster.state_dir / "audit.log").read_text().splitlines()[since_line:]:
        event = json.loads(line)
        ref = event.get("objectRef")
        if event["user"].get("username") != OPERATOR_USER or ref is None:
            continue
        if ns is not None and ref.get("namespace") != ns:
            continue
        out.append(event)
    return out


def settled(cluster, ns: str, quiet_s: float, timeout: float = 120) -> int:
    """The audit log's line count once the operator has made no write in `ns` for `quiet_s`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mark = audit_lines(cluster)
        time.sleep(quiet_s)
        if not any(e["verb"] in WRITES for e in operator_requests(cluster, mark, ns)):
            return audit_lines(cluster)
    raise AssertionError(f"the operator kept writing in {ns} for {timeout}s")


def resource_of(event: dict) -> str:
    ref = event["objectRef"]
    return ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")


def test_deleted_and_edited_children_heal_and_an_unchanged_resource_writes_nothing(operator, namespace):  # noqa: F811
    if not operator.local:
        pytest.skip("mounts the fixture model from this machine")
    doc = example("heal", namespace, replicas=1)
    apply(operator, doc)
    wait_ready(operator, "heal", namespace, replicas=1)
    apps, core, policy = (
        client.AppsV1Api(operator.api),
        client.CoreV1Api(operator.api),
        client.PolicyV1Api(operator.api),
    )
    readers = {
        "Deployment": (apps.read_namespaced_deployment, apps.delete_namespaced_deployment),
        "Service": (core.read_namespaced_service, core.delete_namespaced_service),
        "PodDisruptionBudget": (
            policy.read_namespaced_pod_disruption_budget,
            policy.delete_namespaced_pod_disruption_budget,
        ),
    }

    # Deleted children come back (new objects: new uids), each within seconds.
    for kind, (read, delete) in readers.items():
        old_uid = read("heal", namespace).metadata.uid

        def recreated(read=read, old_uid=old_uid):
            try:
                obj = read("heal", namespace)
            except client.ApiException as e:
                if e.status == 404:
                    return None
                raise
            return obj if obj.metadata.uid != old_uid else None

        delete("heal", namespace)
        obj = wait_for(recreated, timeout=HEAL_S, interval=0.2, what=f"the {kind} to be recreated")
        (ref,) = obj.metadata.owner_references
        assert ref.name == "heal" and ref.controller, kind
    # ... and status follows the new Deployment (not "creating the worker Deployment" for ever).
    cr = wait_ready(operator, "heal", namespace, replicas=1)
    assert cr["status"]["observedGeneration"] == cr["metadata"]["generation"]

    # Hand edits of what the operator sets are reverted: kubectl scale, kubectl set image.
    generation = apps.read_namespaced_deployment("heal", namespace).metadata.generation
    operator.kubectl("scale", "deployment/heal", "-n", namespace, "--replicas=3")
    wait_for(
        lambda: (
            (d := apps.read_namespaced_deployment("heal", namespace)).spec.replicas == 1
            and d.metadata.generation >= generation + 2  # scaled, then put back
        ),
        timeout=HEAL_S,
        interval=0.2,
        what="kubectl scale to be reverted",
    )
    generation = apps.read_namespaced_deployment("heal", namespace).metadata.generation
    operator.kubectl("set", "image", "deployment/heal", "-n", namespace, "worker=example.invalid/nope:1")
    wait_for(
        lambda: (
            (d := apps.read_namespaced_deployment("heal", namespace)).spec.template.spec.containers[0].image
            == WORKER_IMAGE
            and d.metadata.generation >= generation + 2
        ),
        timeout=HEAL_S,
        interval=0.2,
        what="kubectl set image to be reverted",
    )
    wait_ready(operator, "heal", namespace, replicas=1)
    events = operator.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=heal"
    ).stdout
    assert "Reverted" in events and ".spec.replicas" in events, events

    # Unchanged: re-applying the same resource, and events on every child that change nothing of
    # ours (an annotation someone else adds), make the operator write no child.
    wait_for(
        lambda: not any(p.metadata.deletion_timestamp for p in core.list_namespaced_pod(namespace).items),
        timeout=120,
        what="the reverted rollout's pods to be gone",
    )
    # The revert's rollout settles in the status (replica counts, Ready) a little after its pods
    # go: start counting once the operator has written nothing in this namespace for 5 s.
    since = settled(operator, namespace, quiet_s=5.0)
    apply(operator, doc)
    for kind in ("deployment", "service", "pdb"):
        operator.kubectl("annotate", kind, "heal", "-n", namespace, "e2e.kvscale.dev/touched=1")
    wait_for(
        lambda: (
            sum(
                1
                for e in operator_requests(operator, since, namespace)
                if resource_of(e) == "inferencedeployments" and e["verb"] == "get"
            )
            >= 3  # each child's watch event ran a sync, which reads the resource
        ),
        timeout=HEAL_S,
        interval=0.5,
        what="the child watchers to handle the annotations",
    )
    time.sleep(3)  # a sync that has read the resource has had time to write, if it were to
    # Must-show 1 is about the children. The status is not asserted here: during a reverted
    # rollout it flips Ready (PartiallyReady / AllWorkersReady) a few more times after the pods
    # settle, each flip an event and a status write (open: see the closing note).
    writes = [
        (resource_of(e), e["verb"], e["requestURI"])
        for e in operator_requests(operator, since, namespace)
        if e["verb"] in WRITES and e["objectRef"]["resource"] in CHILDREN
    ]
    if writes:  # what was written, and why, for the failure report
        print(*writes, sep="\n")
        print(operator.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp").stdout)
        print(operator.kubectl("get", "infd", "heal", "-n", namespace, "-o", "jsonpath={.status}").stdout)
    assert writes == [], writes

    # Every list and watch of a child is filtered by the API server, not in the operator.
    unfiltered = [
        e["requestURI"]
        for e in operator_requests(operator, 0)
        if e["objectRef"]["resource"] in CHILDREN
        and e["verb"] in ("list", "watch")
        and "labelSelector=" not in e["requestURI"]
    ]
    assert unfiltered == [], unfiltered
