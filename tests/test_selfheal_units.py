"""Self-healing and honest status, without a cluster: the pure decisions (drift, permanent
errors, backoff, who owns which status field) and the reconciler's `sync`, through kopf's
handlers, against an in-memory API server that counts every write."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

import kopf
import pytest
from kubernetes.client.rest import ApiException

from kvscale.operator.api.groupversion import GROUP
from kvscale.operator.api.labels import AUTOSCALER_MANAGER, CHILD_SELECTOR, MANAGER
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.api.status import OWNED, status_apply
from kvscale.operator.handlers import Handlers, configure
from kvscale.operator.kube import client as kube_client
from kvscale.operator.kube.client import CHILD_RESOURCES, Kube
from kvscale.operator.kube.errors import permanent
from kvscale.operator.reconcile.children import CHILD_KEYS, Owner, child_key, children, key_of, kind_of
from kvscale.operator.reconcile.heal import (
    RetryQueue,
    apply_failure,
    backoff_s,
    child_drift,
    drifted,
    rejected,
)
from kvscale.operator.reconcile.reconciler import Reconciler
from kvscale.operator.reconcile.status import compute_status, status_changed
from kvscale.operator.settings import Settings

OWNER = Owner("tiny", "ns", "uid-1")
SPEC = {"model": {"uri": "/models/tiny"}, "replicas": 2, "resources": {"cpu": "0.5", "memory": "1Gi"}}


def desired(spec: dict = SPEC) -> dict[str, dict]:
    objs = children(OWNER, InferenceDeploymentSpec.model_validate(spec), "img:1")
    return {o["kind"]: o for o in objs}


def as_served(obj: dict, rv: int = 1) -> dict:
    """What the API server returns for an applied child: defaults filled in, quantities
    canonical, metadata and status of its own."""
    live = copy.deepcopy(obj)
    live["metadata"].update(uid=f"u-{obj['kind']}", resourceVersion=str(rv), creationTimestamp="t")
    live["metadata"]["labels"] = {**live["metadata"]["labels"], "added-by": "someone-else"}
    if obj["kind"] == "Deployment":
        pod = live["spec"]["template"]["spec"]
        pod.update(dnsPolicy="ClusterFirst", restartPolicy="Always", schedulerName="default-scheduler")
        container = pod["containers"][0]
        container.update(imagePullPolicy="IfNotPresent", terminationMessagePath="/dev/termination-log")
        for r in ("requests", "limits"):
            if container["resources"][r].get("cpu") == "0.5":
                container["resources"][r]["cpu"] = "500m"
        container.setdefault("env", []).append({"name": "SET_BY_HAND", "value": "1"})  # another manager's
        container["readinessProbe"]["httpGet"]["scheme"] = "HTTP"
        live["status"] = {"replicas": 0}
    if obj["kind"] == "Service":
        live["spec"].update(clusterIP="10.0.0.9", sessionAffinity="None")
    return live


# --- drift -------------------------------------------------------------------------------


def test_a_child_as_the_api_server_serves_it_has_not_drifted():
    for kind, obj in desired().items():
        assert child_drift(obj, as_served(obj)) == [], kind
        listed = as_served(obj)
        del listed["apiVersion"], listed["kind"]  # a list's items carry neither
        assert child_drift(obj, listed) == [], kind


def test_hand_edits_of_what_we_set_are_drift():
    dep = desired()["Deployment"]
    scaled = as_served(dep)
    scaled["spec"]["replicas"] = 5  # kubectl scale
    assert child_drift(dep, scaled) == [".spec.replicas"]
    imaged = as_served(dep)
    imaged["spec"]["template"]["spec"]["containers"][0]["image"] = "other:2"  # kubectl set image
    assert child_drift(dep, imaged) == [".spec.template.spec.containers[worker].image"]
    unlabelled = as_served(dep)
    del unlabelled["metadata"]["labels"]["app.kubernetes.io/managed-by"]
    assert child_drift(dep, unlabelled) == [".metadata.labels.app.kubernetes.io/managed-by"]
    renamed = as_served(dep)
    renamed["spec"]["template"]["spec"]["containers"][0]["name"] = "hijacked"
    assert child_drift(dep, renamed) == [".spec.template.spec.containers[worker]"]
    assert child_drift(dep, None) == ["(missing)"]


def test_lists_without_names_compare_whole_and_quantities_by_value():
    assert drifted({"args": ["a", "b"]}, {"args": ["b", "a"]}) == [".args"]
    assert drifted({"args": ["a"]}, {"args": ["a", "b"]}) == [".args"]
    assert drifted({"cpu": "1.5"}, {"cpu": "1500m"}) == []
    assert drifted({"memory": "1Gi"}, {"memory": "1G"}) == [".memory"]
    assert drifted({"n": 1}, {"n": True}) == [".n"]  # a bool is not the number 1
    assert drifted({"a": {"b": 1}}, {"a": "x"}) == [".a"]


# --- errors, backoff, retries --------------------------------------------------------------


def test_4xx_is_permanent_except_what_retrying_can_fix():
    assert all(permanent(s) for s in (400, 403, 404, 422))
    assert not any(permanent(s) for s in (None, 408, 409, 429, 500, 502, 503, 504))


def test_backoff_doubles_to_a_ceiling_and_the_queue_honours_it():
    assert [backoff_s(n) for n in (1, 2, 3, 4)] == [2, 4, 8, 16]
    assert backoff_s(100) == 300
    clock = [0.0]
    q = RetryQueue(clock=lambda: clock[0])
    assert q.failed("a") == 2 and q.pop_due() == []
    clock[0] = 2.0
    assert q.pop_due() == ["a"] and q.pop_due() == []
    assert q.failed("a") == 4  # the second failure in a row waits twice as long
    q.succeeded("a")
    clock[0] = 100.0
    assert q.pop_due() == [] and q.failed("a") == 2  # a success starts over


def test_a_refused_generation_stays_refused_until_the_spec_changes():
    refused = {"type": "Degraded", "status": "True", "reason": "ApplyRejected", "observedGeneration": 3}
    failed = {**refused, "reason": "ApplyFailed"}
    assert rejected([refused], 3) == refused and rejected([refused], 4) is None
    assert rejected([failed], 3) is None and apply_failure([failed], 3) == failed
    assert apply_failure([{**refused, "status": "False"}], 3) is None


# --- status ownership ----------------------------------------------------------------------


def reconciler_status(**overrides) -> dict:
    args = {
        "name": "tiny",
        "generation": 2,
        "selector": "s",
        "desired": 2,
        "deployment": None,
        "previous_conditions": [],
        "now": "t",
    }
    return compute_status(**{**args, **overrides})


def test_each_writer_sends_only_its_own_fields():
    status = reconciler_status()
    body = status_apply("tiny", "ns", status, MANAGER)
    assert body["apiVersion"] == f"{GROUP}/v1alpha1" and body["metadata"] == {
        "name": "tiny",
        "namespace": "ns",
    }
    assert set(body["status"]) <= OWNED[MANAGER].fields
    assert {c["type"] for c in body["status"]["conditions"]} == {"Ready", "Progressing", "Degraded"}
    # The reconciler never carries the autoscaler's condition, even when it is in status.
    scaling = {"type": "ScalingActive", "status": "True", "reason": "MetricsAvailable", "message": ""}
    again = reconciler_status(desired=None, previous_conditions=[scaling])
    assert "ScalingActive" not in {c["type"] for c in again["conditions"]}
    with pytest.raises(ValueError, match="kvCacheUsage"):
        status_apply("tiny", "ns", {**status, "kvCacheUsage": 0.5}, MANAGER)
    with pytest.raises(ValueError, match="Ready"):
        status_apply("tiny", "ns", {"conditions": status["conditions"]}, AUTOSCALER_MANAGER)
    mine = status_apply(
        "tiny",
        "ns",
        {"kvCacheUsage": None, "autoscaling": {"readyWorkers": 1, "x": None}, "conditions": [scaling]},
        AUTOSCALER_MANAGER,
    )
    assert mine["status"] == {"autoscaling": {"readyWorkers": 1}, "conditions": [scaling]}  # no nulls


def test_status_is_written_on_change_only():
    status = reconciler_status()
    live = {**status, "kvCacheUsage": 0.3, "conditions": [*status["conditions"], {"type": "ScalingActive"}]}
    assert not status_changed(live, status)  # the other writer's fields are not ours to compare
    later = reconciler_status(previous_conditions=status["conditions"], now="t2")
    assert not status_changed(live, later)  # same conditions: same lastTransitionTime
    ready = reconciler_status(
        deployment={
            "metadata": {"generation": 1},
            "spec": {"replicas": 2},
            "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2},
        },
        previous_conditions=status["conditions"],
    )
    assert status_changed(live, ready)


def test_a_refused_apply_is_not_ready_and_observed_generation_is_only_what_was_applied():
    refused = reconciler_status(apply_error=("ApplyRejected", "422: bad env"), applied=False, last_applied=1)
    cond = {c["type"]: c for c in refused["conditions"]}
    assert cond["Ready"]["status"] == "False" and cond["Ready"]["reason"] == "ApplyRejected"
    assert cond["Degraded"]["reason"] == "ApplyRejected" and cond["Degraded"]["message"] == "422: bad env"
    assert cond["Degraded"]["observedGeneration"] == 2  # the generation the condition is about
    assert refused["observedGeneration"] == 1  # the last generation that was applied
    assert reconciler_status(applied=False)["observedGeneration"] is None
    assert reconciler_status()["observedGeneration"] == 2


# --- the watches ----------------------------------------------------------------------------


def test_every_child_watch_is_filtered_by_the_api_server_and_nothing_adds_a_finalizer():
    settings = kopf.OperatorSettings()
    configure(settings=settings)
    registry = Handlers(Reconciler(Kube(None), Settings()), None).register(kopf.OperatorRegistry())
    watched = [h.selector for h in registry._watching.get_all_handlers() if h.selector.group != GROUP]
    # the children, and the worker pods (their model downloads)
    assert len(watched) == len(CHILD_RESOURCES) + 1 == 8
    for selector in watched:
        plural = selector.any_name
        resource = kopf.Resource(selector.group, selector.version, plural)
        assert settings.watching.label_selectors.collect(resource) == [CHILD_SELECTOR], plural
        assert plural in (
            "deployments",
            "services",
            "poddisruptionbudgets",
            "serviceaccounts",
            "roles",
            "rolebindings",
            "networkpolicies",
            "pods",
        )
    assert not registry._spawning.get_all_handlers()  # no kopf timers or daemons
    assert not any(h.requires_finalizer for h in registry._changing.get_all_handlers())


# --- sync against an in-memory API server ----------------------------------------------------


@dataclass
class FakeAPI:
    """Children and the resource as the API server would hold them; every request recorded."""

    resource: dict[str, Any]
    objects: dict[str, dict] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    refuse: dict[str, int] = field(default_factory=dict)  # key -> status of the apply's error
    rv: int = 10

    @staticmethod
    def key(kind: str, name: str) -> str:
        """The child key (children.child_key): the router's children are named NAME-router."""
        return child_key(
            kind, {"app.kubernetes.io/name": "kvscale-router"} if name.endswith("-router") else {}
        )

    def read(self, kind, name, namespace):
        key = self.key(kind, name)
        self.calls.append(("get", key))
        obj = self.objects.get(key)
        return copy.deepcopy(obj) if obj is not None else None

    def delete(self, kind, name, namespace):
        key = self.key(kind, name)
        self.calls.append(("delete", key))
        self.objects.pop(key, None)

    def apply(self, obj, manager=MANAGER):
        kind = key_of(obj)
        self.calls.append(("patch", kind))
        if kind in self.refuse:
            e = ApiException(
                status=self.refuse[kind],
                reason="Unprocessable Entity" if self.refuse[kind] == 422 else "Service Unavailable",
            )
            e.body = json.dumps({"message": f"{kind} is invalid: duplicate env"})
            raise e
        live = self.objects.get(kind)
        if live is None or child_drift(obj, live):
            self.rv += 1
            merged = as_served(obj, self.rv)
            if live is not None:
                merged["status"] = live.get("status", {})
            self.objects[kind] = merged
        return copy.deepcopy(self.objects[kind])

    def get_resource(self, namespace, name):
        self.calls.append(("get", "InferenceDeployment"))
        return copy.deepcopy(self.resource)

    def apply_status(self, namespace, name, status, manager):
        self.calls.append(("patch", f"status/{manager}"))
        status_apply(name, namespace, status, manager)  # refuses another writer's fields
        current = self.resource.setdefault("status", {})
        mine = {c["type"] for c in status.get("conditions", [])} or OWNED[manager].conditions
        kept = [c for c in current.get("conditions", []) if c["type"] not in mine]
        current.update({k: v for k, v in status.items() if k != "conditions"})
        current["conditions"] = kept + list(status.get("conditions", []))

    def post_event(self, cr, reason, message, *, warning=False):
        self.events.append(("warn" if warning else "info", reason, message))

    def list_resources(self):
        return [copy.deepcopy(self.resource)]

    def list_children(self, kind):
        """As a LIST shows them: items without apiVersion and kind."""
        return [
            {k: v for k, v in o.items() if k not in ("apiVersion", "kind")}
            for key, o in self.objects.items()
            if kind_of(key) == kind
        ]

    def writes(self) -> list[tuple[str, str]]:
        return [c for c in self.calls if c[0] in ("patch", "delete")]


@pytest.fixture
def cluster() -> FakeAPI:
    resource = {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "tiny", "namespace": "ns", "uid": "uid-1", "generation": 1},
        "spec": SPEC,
    }
    fake = FakeAPI(resource)
    # The operator's parts over the fake: what `kvscale-operator run` builds over the real client.
    fake.reconciler = Reconciler(fake, Settings(worker_image="img:1", router_image="router:1"))
    fake.handlers = Handlers(fake.reconciler, None)
    return fake


SERVICE_GONE = {
    "metadata": {"name": "tiny", "namespace": "ns", "labels": {"kvscale.dev/inference-deployment": "tiny"}}
}


def degraded(fake: FakeAPI) -> dict:
    return next(c for c in fake.resource["status"]["conditions"] if c["type"] == "Degraded")


def reconcile(fake: FakeAPI, retry: int = 0) -> None:
    """kopf's create (or update, or resume) handler."""
    fake.handlers.reconcile(meta={"name": "tiny", "namespace": "ns"}, retry=retry)


def deployment_event(fake: FakeAPI, type_: str | None = "MODIFIED") -> None:
    body = fake.objects.get("Deployment") or desired()["Deployment"]
    fake.handlers.deployment_changed(body=copy.deepcopy(body), type=type_)


def test_reconcile_creates_the_children_and_an_unchanged_child_is_never_written(cluster):
    reconcile(cluster)
    made = sorted(
        set(CHILD_KEYS) - {"InferencePool", "LeaderWorkerSet"}
    )  # no such CRDs here, one pod per copy
    assert sorted(cluster.objects) == made  # the workers' and the router's
    assert cluster.resource["status"]["observedGeneration"] == 1
    assert [e[1] for e in cluster.events].count("Created") == len(made)
    cluster.calls.clear()
    for _ in range(3):  # the Deployment's own events, the Service's, the PDB's: nothing to write
        deployment_event(cluster)
        cluster.handlers.service_changed(body=copy.deepcopy(cluster.objects["Service"]), type="MODIFIED")
        cluster.handlers.pdb_changed(body=copy.deepcopy(cluster.objects["PodDisruptionBudget"]), type=None)
    assert cluster.writes() == []
    # A Service or PDB event reads nothing but the resource.
    assert ("get", "Service") not in cluster.calls and ("get", "Deployment") not in cluster.calls


def test_a_deleted_child_is_recreated_and_one_edited_by_hand_is_reverted(cluster):
    reconcile(cluster)
    cluster.calls.clear()
    del cluster.objects["Deployment"]
    deployment_event(cluster, "DELETED")
    assert "Deployment" in cluster.objects and ("patch", "Deployment") in cluster.writes()
    for kind, handler in (
        ("Service", cluster.handlers.service_changed),
        ("PodDisruptionBudget", cluster.handlers.pdb_changed),
    ):
        gone = cluster.objects.pop(kind)
        handler(body=gone, type="DELETED")
        assert kind in cluster.objects, kind
    cluster.objects["Deployment"]["spec"]["replicas"] = 7  # kubectl scale
    deployment_event(cluster)
    assert cluster.objects["Deployment"]["spec"]["replicas"] == 2
    cluster.objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:1"
    deployment_event(cluster)
    assert cluster.objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"] == "img:1"
    reverted = [e for e in cluster.events if e[1] == "Reverted"]
    assert len(reverted) == 2 and ".spec.replicas" in reverted[0][2]


def test_a_stale_event_is_checked_against_the_api_server_before_any_write(cluster):
    reconcile(cluster)
    cluster.calls.clear()
    stale = copy.deepcopy(cluster.objects["Deployment"])
    stale["spec"]["replicas"] = 7  # already put back by the time the event is handled
    cluster.handlers.deployment_changed(body=stale, type="MODIFIED")
    assert ("get", "Deployment") in cluster.calls and cluster.writes() == []


def test_a_refused_apply_is_reported_once_and_not_retried_until_the_spec_changes(cluster):
    cluster.refuse["Deployment"] = 422
    reconcile(cluster)  # no TemporaryError: kopf does not retry it
    degraded = next(c for c in cluster.resource["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ApplyRejected" and "duplicate env" in degraded["message"]
    ready = next(c for c in cluster.resource["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ApplyRejected"
    assert (
        "observedGeneration" not in cluster.resource["status"]
        or cluster.resource["status"]["observedGeneration"] is None
    )
    warnings = [e for e in cluster.events if e[0] == "warn"]
    assert len(warnings) == 1 and "duplicate env" in warnings[0][2]
    cluster.calls.clear()
    for _ in range(5):  # the watchers and the resync leave the refused generation alone
        cluster.handlers.service_changed(body=SERVICE_GONE, type="DELETED")
        cluster.reconciler.sync_or_retry("ns", "tiny")  # what the resync does for each resource
    assert cluster.writes() == [] and len([e for e in cluster.events if e[0] == "warn"]) == 1
    assert cluster.reconciler.retries.pop_due() == []
    # A new generation is tried again.
    del cluster.refuse["Deployment"]
    cluster.resource["metadata"]["generation"] = 2
    reconcile(cluster)
    assert "Deployment" in cluster.objects and cluster.resource["status"]["observedGeneration"] == 2
    degraded = next(c for c in cluster.resource["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"


def test_a_name_no_label_can_hold_is_refused_once_without_children(cluster):
    """Stored under an older CRD (before the name rule), such a name must not reach the children:
    their labels would be refused on every try."""
    name = "n" * 64
    cluster.resource["metadata"]["name"] = name
    cluster.handlers.reconcile(meta={"name": name, "namespace": "ns"}, retry=0)
    assert cluster.objects == {}
    assert degraded(cluster)["reason"] == "InvalidSpec" and "invalid name" in degraded(cluster)["message"]
    cluster.reconciler.sync_or_retry("ns", name)
    assert [c for c in cluster.writes() if c[1] != f"status/{MANAGER}"] == []
    assert len([e for e in cluster.events if e[0] == "warn"]) == 1


def test_a_5xx_is_retried_with_backoff(cluster):
    cluster.refuse["Service"] = 503
    with pytest.raises(kopf.TemporaryError) as raised:
        reconcile(cluster, retry=2)
    assert raised.value.delay == backoff_s(3)
    assert cluster.resource["status"].get("observedGeneration") is None  # not applied in full
    assert degraded(cluster)["reason"] == "ApplyFailed"
    deployment_event(cluster)  # a Deployment event does not clear what the full apply found
    assert degraded(cluster)["reason"] == "ApplyFailed"
    del cluster.refuse["Service"]
    reconcile(cluster, retry=3)  # kopf's retry
    assert cluster.resource["status"]["observedGeneration"] == 1 and degraded(cluster)["status"] == "False"
    # Through a watcher, a transient failure goes to the retry queue, run by the resync task.
    cluster.refuse["Service"] = 503
    del cluster.objects["Service"]
    cluster.handlers.service_changed(body=SERVICE_GONE, type="DELETED")
    assert degraded(cluster)["reason"] == "ApplyFailed" and cluster.reconciler.retries._due
    del cluster.refuse["Service"]
    cluster.reconciler.sync_or_retry("ns", "tiny", apply_all=True)  # the retry
    assert "Service" in cluster.objects and not cluster.reconciler.retries._due
    assert degraded(cluster)["status"] == "False"


def test_a_watcher_leaves_a_new_generation_to_its_reconcile(cluster):
    reconcile(cluster)
    cluster.calls.clear()
    cluster.resource["metadata"]["generation"] = 2
    cluster.resource["spec"] = {**SPEC, "replicas": 3}
    deployment_event(cluster)  # before kopf's update handler ran: no "Reverted" of a spec change
    assert cluster.writes() == [] or cluster.writes() == [("patch", f"status/{MANAGER}")]
    assert cluster.objects["Deployment"]["spec"]["replicas"] == 2
    reconcile(cluster)
    assert cluster.objects["Deployment"]["spec"]["replicas"] == 3
    assert not [e for e in cluster.events if e[1] == "Reverted"]
    assert [e[1] for e in cluster.events].count("Updated") == 1


def test_switching_autoscaling_off_removes_the_autoscalers_fields_through_its_own_manager(cluster):
    cluster.resource["status"] = {
        "kvCacheUsage": 0.4,
        "autoscaling": {"desiredReplicas": 3},
        "conditions": [{"type": "ScalingActive", "status": "True", "reason": "MetricsAvailable"}],
    }
    owned = {"manager": AUTOSCALER_MANAGER, "operation": "Apply", "subresource": "status"}
    cluster.resource["metadata"]["managedFields"] = [owned]
    reconcile(cluster)
    assert ("patch", f"status/{AUTOSCALER_MANAGER}") in cluster.writes()
    # Once the autoscaler's manager owns nothing, the API server drops it from managedFields.
    cluster.resource["metadata"]["managedFields"] = []
    cluster.calls.clear()
    deployment_event(cluster)
    assert ("patch", f"status/{AUTOSCALER_MANAGER}") not in cluster.writes()


def test_a_failed_status_write_is_retried_not_left_stale(cluster, monkeypatch):
    reconcile(cluster)
    cluster.objects["Deployment"]["status"] = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
    write = cluster.apply_status

    def unavailable(*args, **kwargs):
        raise ApiException(status=503, reason="Service Unavailable")

    monkeypatch.setattr(cluster, "apply_status", unavailable)
    deployment_event(cluster)  # the workers turned ready, but the status write fails
    assert cluster.resource["status"]["readyReplicas"] == 0 and cluster.reconciler.retries._due
    monkeypatch.setattr(cluster, "apply_status", write)
    cluster.reconciler.sync_or_retry("ns", "tiny", apply_all=True)  # what the resync task runs when it is due
    assert cluster.resource["status"]["readyReplicas"] == 2 and not cluster.reconciler.retries._due


def test_the_resync_heals_what_no_event_reported_and_writes_nothing_else(cluster, monkeypatch):
    reconcile(cluster)
    cluster.calls.clear()
    cluster.reconciler.resync()
    assert cluster.writes() == []  # all as applied: not one write, not one extra read
    assert [c for c in cluster.calls if c[0] == "get"] == []
    del cluster.objects["PodDisruptionBudget"]  # its DELETED event was missed
    cluster.objects["Service"]["spec"]["ports"][0]["port"] = 9999
    cluster.reconciler.resync()
    assert "PodDisruptionBudget" in cluster.objects
    assert cluster.objects["Service"]["spec"]["ports"][0]["port"] == 8000
    assert ("patch", "Deployment") not in cluster.writes()


def test_events_are_posted_outside_kopfs_handlers_too(monkeypatch):
    """The resync task is no kopf handler, where kopf.info has no queue to post to."""
    posted = []

    class Core:
        def __init__(self, _api):
            pass

        def create_namespaced_event(self, namespace, body, **_):
            posted.append((namespace, body))
            if len(posted) > 1:
                raise ApiException(status=403, reason="Forbidden")  # best effort: logged

    monkeypatch.setattr(kube_client.client, "CoreV1Api", Core)
    cr = {"metadata": {"name": "tiny", "namespace": "ns", "uid": "uid-1"}}
    Kube(None).post_event(cr, "Reverted", "re-applied", warning=False)
    Kube(None).post_event(cr, "DegradedTrue", "ApplyRejected: no", warning=True)
    (ns, first), (_, second) = posted
    assert ns == "ns" and first["involvedObject"]["uid"] == "uid-1" and first["type"] == "Normal"
    assert first["involvedObject"]["kind"] == "InferenceDeployment" and second["type"] == "Warning"


def _leaves(node, trail=()):
    """Every (trail, value) of a leaf: trail items are dict keys or list indices."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*trail, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, (*trail, i))
    else:
        yield trail, node


def _at(node, trail):
    for step in trail:
        node = node[step]
    return node


@pytest.mark.parametrize("kind", ["Deployment", "Service", "PodDisruptionBudget"])
def test_every_field_we_set_is_watched_and_nothing_anyone_adds_is(kind):
    """Exhaustive over the child: changing any one value we set is drift; adding a key to any
    map of ours is not."""
    obj = {k: v for k, v in desired()[kind].items() if k not in ("apiVersion", "kind")}
    for trail, value in _leaves(obj):
        live = as_served(desired()[kind])
        changed = (
            not value if isinstance(value, bool) else (value + 1 if isinstance(value, int) else f"{value}x")
        )
        _at(live, trail[:-1])[trail[-1]] = changed
        assert child_drift(desired()[kind], live), trail
    for trail, _ in _leaves(obj):
        for cut in range(len(trail)):
            parent = _at(as_served(desired()[kind]), trail[:cut])
            if isinstance(parent, dict):
                live = as_served(desired()[kind])
                _at(live, trail[:cut])["addedByOthers"] = "x"
                assert child_drift(desired()[kind], live) == [], trail[:cut]


# --- the operator's metrics move with these code paths ------------------------------------------


def _count(metric, *labels) -> float:
    return metric.labels(*labels)._value.get()


def test_syncs_are_counted_by_result_and_errors_by_kind(cluster):
    from kvscale.operator import metrics

    ok, permanent_, transient = (_count(metrics.RECONCILES, r) for r in metrics.RESULTS)
    rejected_, transient_api = _count(metrics.ERRORS, "api_rejected"), _count(metrics.ERRORS, "api_transient")
    reconcile(cluster)
    assert _count(metrics.RECONCILES, "ok") == ok + 1
    cluster.refuse["Service"] = 503
    del cluster.objects["Service"]
    cluster.handlers.service_changed(body=SERVICE_GONE, type="DELETED")
    assert _count(metrics.RECONCILES, "transient_error") == transient + 1
    assert _count(metrics.ERRORS, "api_transient") == transient_api + 1
    cluster.refuse["Service"] = 422
    cluster.resource["metadata"]["generation"] = 2
    reconcile(cluster)
    assert _count(metrics.RECONCILES, "permanent_error") == permanent_ + 1
    assert _count(metrics.ERRORS, "api_rejected") == rejected_ + 1


def test_a_failed_read_counts_as_a_transient_error_of_its_kind(cluster, monkeypatch):
    from kvscale.operator import metrics

    def hung(*_):
        raise TimeoutError("read timed out")

    monkeypatch.setattr(cluster, "get_resource", hung)
    transient, network = _count(metrics.RECONCILES, "transient_error"), _count(metrics.ERRORS, "network")
    cluster.reconciler.sync_or_retry("ns", "tiny")
    assert _count(metrics.RECONCILES, "transient_error") == transient + 1
    assert _count(metrics.ERRORS, "network") == network + 1


def test_the_healers_reapplies_are_counted_per_kind_and_a_spec_apply_is_not_one(cluster):
    from kvscale.operator import metrics

    before = {k: _count(metrics.CHILD_REAPPLIES, k) for k in ("Deployment", "Service")}
    reconcile(cluster)  # creates: not a heal
    assert {k: _count(metrics.CHILD_REAPPLIES, k) for k in before} == before
    cluster.objects["Deployment"]["spec"]["replicas"] = 7  # kubectl scale
    deployment_event(cluster)
    del cluster.objects["Service"]
    cluster.handlers.service_changed(body=SERVICE_GONE, type="DELETED")
    deployment_event(cluster)  # nothing drifted: nothing re-applied
    assert _count(metrics.CHILD_REAPPLIES, "Deployment") == before["Deployment"] + 1
    assert _count(metrics.CHILD_REAPPLIES, "Service") == before["Service"] + 1


def test_error_kinds():
    from kvscale.operator.kube.errors import error_kind
    from kvscale.operator.kube.leader import NotLeader

    assert error_kind(ApiException(status=422)) == "api_rejected"
    assert error_kind(ApiException(status=409)) == "api_transient"
    assert error_kind(ApiException(status=503)) == "api_transient"
    assert error_kind(NotLeader("no")) == "not_leader"
    assert error_kind(ConnectionRefusedError()) == "network"
    assert error_kind(ValueError("bug")) == "internal"


# --- the router's children -----------------------------------------------------------------


def test_the_routers_children_are_healed_like_the_workers(cluster):
    reconcile(cluster)
    assert cluster.resource["status"]["endpoint"] == "http://tiny-router.ns.svc:8000"
    cluster.calls.clear()
    for key, handler in (
        ("RouterDeployment", cluster.handlers.deployment_changed),
        ("RouterService", cluster.handlers.service_changed),
        ("RouterPodDisruptionBudget", cluster.handlers.pdb_changed),
        ("ServiceAccount", cluster.handlers.service_account_changed),
        ("Role", cluster.handlers.role_changed),
        ("RoleBinding", cluster.handlers.role_binding_changed),
    ):
        handler(body=copy.deepcopy(cluster.objects[key]), type="MODIFIED")  # as applied: no write
        assert cluster.writes() == [], key
        gone = cluster.objects.pop(key)
        handler(body=gone, type="DELETED")
        assert key in cluster.objects and cluster.writes() == [("patch", key)], key
        cluster.calls.clear()
    # An edit by hand of the router's Deployment is reverted; the workers' is not touched.
    container = cluster.objects["RouterDeployment"]["spec"]["template"]["spec"]["containers"][0]
    container["image"] = "evil:1"
    cluster.handlers.deployment_changed(
        body=copy.deepcopy(cluster.objects["RouterDeployment"]), type="MODIFIED"
    )
    assert cluster.writes() == [("patch", "RouterDeployment")]
    assert (
        cluster.objects["RouterDeployment"]["spec"]["template"]["spec"]["containers"][0]["image"]
        == "router:1"
    )
    # A Role widened by hand is put back.
    cluster.objects["Role"]["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    cluster.handlers.role_changed(body=copy.deepcopy(cluster.objects["Role"]), type="MODIFIED")
    assert len(cluster.objects["Role"]["rules"]) == 2


def test_switching_the_router_off_deletes_it_and_the_endpoint_is_the_workers(cluster):
    reconcile(cluster)
    cluster.resource["metadata"]["generation"] = 2
    cluster.resource["spec"] = {**SPEC, "router": {"enabled": False}}
    cluster.calls.clear()
    reconcile(cluster)
    assert sorted(cluster.objects) == ["Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service"]
    assert sorted(c[1] for c in cluster.calls if c[0] == "delete") == sorted(
        [
            "RouterDeployment",
            "RouterService",
            "RouterPodDisruptionBudget",
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "RouterNetworkPolicy",
        ]
    )
    assert cluster.resource["status"]["endpoint"] == "http://tiny.ns.svc:8000"
    cluster.calls.clear()
    reconcile(cluster)  # nothing left to delete
    assert not [c for c in cluster.calls if c[0] == "delete"]


def test_a_router_object_someone_else_owns_is_never_deleted(cluster):
    cluster.resource["spec"] = {**SPEC, "router": {"enabled": False}}
    cluster.objects["RouterService"] = {
        "kind": "Service",
        "metadata": {"name": "tiny-router", "ownerReferences": []},
    }
    reconcile(cluster)
    assert "RouterService" in cluster.objects and not [c for c in cluster.calls if c[0] == "delete"]


def test_an_inference_pool_is_applied_only_where_served_and_healed_by_the_resync(cluster, monkeypatch):
    reconcile(cluster)
    assert "InferencePool" not in cluster.objects  # the CRD is not installed: never asked for
    assert not [c for c in cluster.calls if c[1] == "InferencePool"]
    cluster.reconciler.pools_served = True  # the resync task's discovery saw it come
    cluster.reconciler.resync()
    pool = cluster.objects["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"] == "tiny"
    cluster.calls.clear()
    cluster.reconciler.resync()
    assert cluster.writes() == []  # as applied: nothing written
    del cluster.objects["InferencePool"]  # deleted by hand: the next resync puts it back
    cluster.reconciler.resync()
    assert "InferencePool" in cluster.objects
    cluster.resource["metadata"]["generation"] = 2
    cluster.resource["spec"] = {**SPEC, "inferencePool": {"enabled": False}}
    reconcile(cluster)
    assert "InferencePool" not in cluster.objects and ("delete", "InferencePool") in cluster.calls


def test_a_pool_whose_crd_went_since_the_last_discovery_does_not_fail_the_resource(cluster, monkeypatch):
    cluster.reconciler.pools_served = True
    cluster.refuse["InferencePool"] = 404  # the CRD was deleted a moment ago
    reconcile(cluster)
    assert degraded(cluster)["status"] == "False" and cluster.resource["status"]["observedGeneration"] == 1
    assert "Deployment" in cluster.objects and "RouterDeployment" in cluster.objects


GROUP_SPEC = {**SPEC, "parallelism": {"tensor": 2, "nodes": 2}}


def condition(fake: FakeAPI, type_: str) -> dict:
    return next(c for c in fake.resource["status"]["conditions"] if c["type"] == type_)


def test_a_multi_node_resource_without_the_leader_worker_set_api_gets_nothing_and_one_reason(cluster):
    """No LeaderWorkerSet API: no child is read or written (no Service without its workers),
    Ready and Degraded say LeaderWorkerSetUnavailable, the spec is not marked as applied, and
    nothing is retried (the discovery that sees the CRD arrive re-syncs everything)."""
    cluster.resource["spec"] = GROUP_SPEC
    reconcile(cluster)
    assert cluster.objects == {} and [c for c in cluster.calls if c[1] != "InferenceDeployment"] == [
        ("patch", f"status/{MANAGER}")
    ]
    ready = condition(cluster, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "LeaderWorkerSetUnavailable"
    assert "parallelism.nodes" in ready["message"] and "kubernetes-sigs/lws" in ready["message"]
    assert condition(cluster, "Degraded")["reason"] == "LeaderWorkerSetUnavailable"
    assert cluster.resource["status"].get("observedGeneration") is None
    assert cluster.reconciler.retries.pop_due() == [] and cluster.reconciler.retries._due == {}


def test_the_workers_move_between_a_deployment_and_a_leader_worker_set(cluster, monkeypatch):
    reconcile(cluster)
    assert "Deployment" in cluster.objects and "LeaderWorkerSet" not in cluster.objects
    cluster.reconciler.lws_served = True
    cluster.resource["metadata"]["generation"] = 2
    cluster.resource["spec"] = GROUP_SPEC
    reconcile(cluster)
    assert "Deployment" not in cluster.objects and ("delete", "Deployment") in cluster.calls
    lws = cluster.objects["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert cluster.objects["Service"]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    # The status counts groups (replicas: 2 is two groups of two pods), from the LWS's status.
    lws["status"] = {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}
    reconcile(cluster)
    assert cluster.resource["status"]["ready"] == "1/2"
    assert condition(cluster, "Ready")["reason"] == "PartiallyReady"
    lws["status"]["readyReplicas"] = 2
    reconcile(cluster)
    assert cluster.resource["status"]["ready"] == "2/2"
    assert condition(cluster, "Ready")["reason"] == "AllWorkersReady"
    cluster.resource["metadata"]["generation"] = 3
    cluster.resource["spec"] = SPEC
    reconcile(cluster)
    assert "LeaderWorkerSet" not in cluster.objects and "Deployment" in cluster.objects
