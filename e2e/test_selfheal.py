"""The operator heals its children on the real node: a deleted Deployment, Service or PDB is
recreated within seconds, `kubectl scale` and `kubectl set image` on the Deployment are
reverted, and an unchanged resource makes the operator write nothing at all, while its watches
do run (the API server's audit log shows both, and that every watch of a child carries a label
selector: only our children are streamed)."""

from __future__ import annotations

from collections import Counter

import pytest
from audit import CHILDREN, WRITES, audit_lines, operator_requests, resource_of
from images import WORKER_IMAGE
from kubernetes import client
from test_controlplane import wait_for
from test_operator import (  # noqa: F401 (fixtures)
    apply,
    children_versions,
    example,
    namespace,
    operator,
    respelled,
    wait_applied,
    wait_ready,
)

HEAL_S = 15  # "within seconds": one watch event and one apply


def rolled_out(apps, name: str, ns: str) -> bool:
    """The Deployment's controller has seen its last change and every replica is updated and ready."""
    d = apps.read_namespaced_deployment(name, ns)
    s = d.status
    return (
        s is not None
        and (s.observed_generation or 0) >= d.metadata.generation
        and (s.updated_replicas or 0) == (s.ready_replicas or 0) == (s.replicas or 0) == d.spec.replicas
    )


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
    # ours (an annotation someone else adds), make the operator write no child: a sync that finds
    # no drift sends nothing.
    wait_for(
        lambda: (
            not any(p.metadata.deletion_timestamp for p in core.list_namespaced_pod(namespace).items)
            and rolled_out(apps, "heal", namespace)
        ),
        timeout=120,
        what="the reverted rollout to be over",
    )
    since = audit_lines(operator)
    apply(operator, doc)
    for kind in ("deployment", "service", "pdb"):
        operator.kubectl("annotate", kind, "heal", "-n", namespace, "e2e.kvscale.dev/touched=1")
    before = children_versions(operator, "heal", namespace)
    wait_for(
        lambda: (
            sum(
                1
                for e in operator_requests(operator, since, namespace)
                if resource_of(e) == "inferencedeployments" and e["verb"] == "get"
            )
            >= 3  # each child's watch event ran a sync, which reads the resource first
        ),
        timeout=HEAL_S,
        interval=0.2,
        what="the child watchers to handle the annotations",
    )
    # The positive signal that those syncs are over: a new generation that renders the same
    # children, which the operator applies in full. Syncs of one resource run one at a time (the
    # reconciler's lock) and write observedGeneration last, so once it moves, the watchers'
    # syncs and this one have sent all they were going to: one apply of each child, this one's.
    apply(operator, respelled(doc))
    wait_applied(operator, "heal", namespace)
    # Must-show 1 is about the children. The status is not asserted here: during a reverted
    # rollout it flips Ready (PartiallyReady / AllWorkersReady) a few more times after the pods
    # settle, each flip an event and a status write (open: see the closing note).
    sent = Counter(
        (e["objectRef"]["resource"], e["objectRef"].get("name"), e["verb"])
        for e in operator_requests(operator, since, namespace)
        if e["verb"] in WRITES and e["objectRef"]["resource"] in CHILDREN
    )
    extra = {k: n for k, n in sent.items() if k[2] != "patch" or n > 1}  # beyond the one full apply
    if extra:  # what was written, and why, for the failure report
        print(operator.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp").stdout)
        print(operator.kubectl("get", "infd", "heal", "-n", namespace, "-o", "jsonpath={.status}").stdout)
    assert extra == {}, sorted(sent.items())
    assert {(r, "heal", "patch") for r in CHILDREN} <= set(sent), sorted(sent)  # the full apply was seen
    # ... and the full apply of the new generation sent every child, changing none of them.
    assert children_versions(operator, "heal", namespace) == before

    # Every list and watch of a child is filtered by the API server, not in the operator.
    unfiltered = [
        e["requestURI"]
        for e in operator_requests(operator, 0)
        if e["objectRef"]["resource"] in CHILDREN
        and e["verb"] in ("list", "watch")
        and "labelSelector=" not in e["requestURI"]
    ]
    assert unfiltered == [], unfiltered
