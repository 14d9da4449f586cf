"""kopf handlers and the resync: the only place the operator does I/O.

One function, `sync`, makes a resource true, one call at a time per resource: it applies the
children that need it (server-side apply under our field manager) and writes the status fields
the reconciler owns when they changed (server-side apply of the status subresource; the
autoscaler owns its own fields, status.py). Everything calls it:

- kopf's create, update (of the spec) and resume handlers apply every child: a spec change can
  drop fields, which only an apply removes (an unchanged apply is a no-op on the API server);
- watches on the Deployments, Services, PDBs, ServiceAccounts, Roles and RoleBindings we own
  (server-side label selectors: only ours are streamed) re-apply a child that was deleted or
  changed by hand (heal.child_drift), and the workers' Deployment's refresh the status; a child
  that has not drifted is not sent at all. The router's Deployment and Service share kinds with
  the workers': children are keyed (children.child_key), not by kind alone;
- the resync task in the leader does the same for every resource every RESYNC_S, catching what
  a missed event left behind, and retries transient failures with a doubling backoff;
- a watch on the worker pods (the same server-side selector) keeps where each pod's hf://
  model download stands (status.pod_download) and refreshes the status when that changes: a
  download that starts, ends or fails (a crash loop of the init container is one change).

No kopf timer or daemon: kopf puts a finalizer on every resource that has one. An API error the
spec causes (a 422 against a schema, a 400) is permanent for that generation (status and one
event, no retry until the spec changes); a 5xx or a timeout is retried, and so are refusals that
the cluster decides (a ResourceQuota, an admission webhook or policy, RBAC: heal.api_refusal),
with a doubling backoff up to 5 min, reported once under their own reason, so a fixed quota
recovers without a spec edit. kopf keeps its bookkeeping in status.kopf, never in
metadata, so GitOps tools that own the resource see no drift.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import threading
import time
from collections.abc import Collection
from functools import cache
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from pydantic import ValidationError
from urllib3.exceptions import HTTPError

from kvscale.operator import inferencepool, leaderworkerset, metrics, policy
from kvscale.operator.children import (
    AUTOSCALER_MANAGER,
    CHILD_KEYS,
    LABEL_MANAGED_BY,
    LABEL_OWNER,
    MANAGER,
    NETWORK_KEYS,
    ROUTER_KEYS,
    Owner,
    all_children,
    child_key,
    child_name,
    endpoint_url,
    foreign,
    key_of,
    kind_of,
    replicas_handover,
    selector_string,
    workload_key,
)
from kvscale.operator.heal import (
    APPLY_FAILURES,
    RETRIED_REASONS,
    RetryQueue,
    api_error_refusal,
    apply_failure,
    backoff_s,
    child_drift,
    rejected,
)
from kvscale.operator.models import GROUP, KIND, PLURAL, VERSION, InferenceDeploymentSpec, name_problem
from kvscale.operator.status import (
    PodDownload,
    compute_status,
    download_condition,
    pod_download,
    status_apply,
    status_changed,
)

logger = logging.getLogger(__name__)

DEFAULT_WORKER_IMAGE = "ghcr.io/kvscale/kvscale-worker:0.1.0"
DEFAULT_ROUTER_IMAGE = "ghcr.io/kvscale/kvscale-router:0.1.0"
APPLY = "application/apply-patch+yaml"
API_TIMEOUT_S = 30  # on every call: a hung API server never holds a sync (and its lock) forever
RESYNC_S = float(os.environ.get("KVSCALE_RESYNC_SECONDS", "300"))
CHILD_KINDS = CHILD_KEYS  # what a sync may apply: every child, by key
# What kopf watches for each kind of child, with a server-side selector: only ours are streamed.
CHILD_RESOURCES = {
    "Deployment": ("apps", "v1", "deployments"),
    "Service": ("v1", "services"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io", "v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
}
LISTED_KINDS = tuple(CHILD_RESOURCES)  # and InferencePool, while its CRD is served
# Children that are deleted when no longer rendered (the router switched off, a pool turned off,
# the workers moved between a Deployment and a LeaderWorkerSet).
REMOVABLE_KEYS = (*ROUTER_KEYS, *NETWORK_KEYS, "InferencePool", "Deployment", "LeaderWorkerSet")
# The children of optional APIs (other projects' CRDs), by whether each is served now.
OPTIONAL_KEYS = ("InferencePool", "LeaderWorkerSet")
LWS_UNAVAILABLE = "LeaderWorkerSetUnavailable"
LWS_UNAVAILABLE_MESSAGE = (
    "parallelism.nodes above 1 runs each copy of the model as a LeaderWorkerSet group, and this "
    "cluster does not serve leaderworkersets.leaderworkerset.x-k8s.io/v1: install LeaderWorkerSet "
    "(https://github.com/kubernetes-sigs/lws), or set parallelism.nodes to 1"
)
DISCOVERY_S = float(os.environ.get("KVSCALE_DISCOVERY_SECONDS", "30"))
# Whether the API server serves InferencePools: asked by the resync task every DISCOVERY_S, read by
# every sync (never asked by one).
pools_served = False
lws_served = False  # and LeaderWorkerSets, the same way
CHILD_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGER},{LABEL_OWNER}"
POD_RESOURCE = ("v1", "pods")  # the workers carry the same labels
# No answer, a timeout, a refused or reset connection: retried like a 5xx.
NETWORK_ERRORS = (HTTPError, OSError)

retries = RetryQueue()
# The namespaced install's namespaces (kvscale-operator run --watch-namespace): the resync lists
# in these only, as its Roles allow nothing cluster-wide. Empty: every namespace.
watch_namespaces: tuple[str, ...] = ()
_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()
# (namespace, resource) -> pod name -> its model download, from the pod watch (pods without one
# are not kept).
_downloads: dict[tuple[str, str], dict[str, PodDownload]] = {}
_downloads_guard = threading.Lock()
# (namespace, resource) -> pod name -> ready, for LeaderWorkerSet groups' pods (pod_changed).
_ready: dict[tuple[str, str], dict[str, bool]] = {}
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # the LWS controller's label on its pods
LWS_STATUS_LAG_S = 3.0


def operator_namespace() -> str:
    """Where the operator's pods run: the NetworkPolicies let them scrape the workers."""
    return os.environ.get("POD_NAMESPACE", "kvscale-system")


def worker_image() -> str:
    return os.environ.get("KVSCALE_WORKER_IMAGE", DEFAULT_WORKER_IMAGE)


def router_image() -> str:
    return os.environ.get("KVSCALE_ROUTER_IMAGE", DEFAULT_ROUTER_IMAGE)


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@cache
def api() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()  # KUBECONFIG, or ~/.kube/config
    return client.ApiClient()


def _json(response) -> dict[str, Any]:
    return json.loads(response.data)


# Per kind: (read, server-side apply, list in all namespaces, list in one, delete) on the typed
# client.
def _ops(kind: str):
    apps, core, policy = client.AppsV1Api(api()), client.CoreV1Api(api()), client.PolicyV1Api(api())
    rbac = client.RbacAuthorizationV1Api(api())
    networking = client.NetworkingV1Api(api())
    if kind == "InferencePool":
        return inferencepool.ops(api())
    if kind == "LeaderWorkerSet":
        return leaderworkerset.ops(api())
    return {
        "Deployment": (
            apps.read_namespaced_deployment,
            apps.patch_namespaced_deployment,
            apps.list_deployment_for_all_namespaces,
            apps.list_namespaced_deployment,
            apps.delete_namespaced_deployment,
        ),
        "Service": (
            core.read_namespaced_service,
            core.patch_namespaced_service,
            core.list_service_for_all_namespaces,
            core.list_namespaced_service,
            core.delete_namespaced_service,
        ),
        "PodDisruptionBudget": (
            policy.read_namespaced_pod_disruption_budget,
            policy.patch_namespaced_pod_disruption_budget,
            policy.list_pod_disruption_budget_for_all_namespaces,
            policy.list_namespaced_pod_disruption_budget,
            policy.delete_namespaced_pod_disruption_budget,
        ),
        "ServiceAccount": (
            core.read_namespaced_service_account,
            core.patch_namespaced_service_account,
            core.list_service_account_for_all_namespaces,
            core.list_namespaced_service_account,
            core.delete_namespaced_service_account,
        ),
        "Role": (
            rbac.read_namespaced_role,
            rbac.patch_namespaced_role,
            rbac.list_role_for_all_namespaces,
            rbac.list_namespaced_role,
            rbac.delete_namespaced_role,
        ),
        "RoleBinding": (
            rbac.read_namespaced_role_binding,
            rbac.patch_namespaced_role_binding,
            rbac.list_role_binding_for_all_namespaces,
            rbac.list_namespaced_role_binding,
            rbac.delete_namespaced_role_binding,
        ),
        "NetworkPolicy": (
            networking.read_namespaced_network_policy,
            networking.patch_namespaced_network_policy,
            networking.list_network_policy_for_all_namespaces,
            networking.list_namespaced_network_policy,
            networking.delete_namespaced_network_policy,
        ),
    }[kind]


def read(kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    try:
        return _json(_ops(kind)[0](name, namespace, _preload_content=False, _request_timeout=API_TIMEOUT_S))
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def delete(kind: str, name: str, namespace: str) -> None:
    """Delete a child we no longer render (the router, switched off); gone already is fine."""
    try:
        _ops(kind)[4](name, namespace, _request_timeout=API_TIMEOUT_S)
    except ApiException as e:
        if e.status != 404:
            raise


def server_side_apply(obj: dict[str, Any], manager: str = MANAGER) -> dict[str, Any]:
    meta = obj["metadata"]
    patch = _ops(obj["kind"])[1]
    response = patch(
        meta["name"],
        meta["namespace"],
        obj,
        field_manager=manager,
        force=True,
        _content_type=APPLY,
        _preload_content=False,
        _request_timeout=API_TIMEOUT_S,
    )
    return _json(response)


def get_resource(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return client.CustomObjectsApi(api()).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, _request_timeout=API_TIMEOUT_S
        )
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def apply_status(namespace: str, name: str, status: dict[str, Any], manager: str) -> None:
    """Server-side apply of `manager`'s own status fields (status.status_apply checks which)."""
    metrics.STATUS_WRITES.labels(manager).inc()
    client.CustomObjectsApi(api()).patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        name,
        status_apply(name, namespace, status, manager),
        field_manager=manager,
        force=True,
        _content_type=APPLY,
        _request_timeout=API_TIMEOUT_S,
    )


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Bookkeeping in status only: metadata stays exactly what the user (or Argo CD, Flux) applied.
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(field="status.kopf.diffbase")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    # Server-side: the API server streams our children only, not every Deployment of the
    # cluster. (A handler's `labels=` filter is applied in the operator, after the streaming.)
    for resource in (*CHILD_RESOURCES.values(), POD_RESOURCE):
        settings.watching.label_selectors[resource] = CHILD_SELECTOR


def post_event(cr: dict[str, Any], reason: str, message: str, *, warning: bool = False) -> None:
    """A core/v1 Event on the resource. Our own poster rather than kopf.info: kopf's works only
    inside its handlers, and the resync task is not one. Best effort: a lost event is logged."""
    meta = cr["metadata"]
    stamp = now()
    event = {
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": MANAGER},
        "reportingComponent": MANAGER,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    try:
        client.CoreV1Api(api()).create_namespaced_event(
            meta["namespace"], event, _request_timeout=API_TIMEOUT_S
        )
    except (ApiException, *NETWORK_ERRORS) as e:
        logger.warning("could not post the event %s on %s: %s", reason, meta["name"], _api_message(e))


def _lock(namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def _api_message(e: Exception) -> str:
    if isinstance(e, ApiException):
        try:
            detail = json.loads(e.body or "{}").get("message", "")
        except (ValueError, AttributeError):
            detail = ""
        return f"{e.status} {e.reason}" + (f": {detail}" if detail else "")
    return f"{type(e).__name__}: {e}"


def sync(
    namespace: str,
    name: str,
    *,
    apply_all: bool = False,
    kinds: Collection[str] = CHILD_KINDS,
    seen: dict[str, dict[str, Any] | None] | None = None,
    resource: dict[str, Any] | None = None,
) -> tuple[str, str] | None:
    """Make the resource true: apply its children of `kinds` (child keys) that need it (all of them
    with `apply_all`, else those that drifted), then write the reconciler's status if it changed.

    `seen`: children by key as a watch or a list just showed them (None: absent), read otherwise;
    `resource`: the resource as a list showed it, read otherwise. Returns the transient error
    (reason, message) to retry, else None. Raises on a failed read or status write.
    """
    try:
        error = _sync(namespace, name, apply_all=apply_all, kinds=kinds, seen=seen, resource=resource)
    except Exception as e:
        metrics.reconciled("transient_error")
        metrics.errored(metrics.error_kind(e))
        raise
    if error is None:
        metrics.reconciled("ok")
    elif error[0] in RETRIED_REASONS:  # transient, or fixed by someone else: backed off
        metrics.reconciled("transient_error")
        return error
    else:
        metrics.reconciled("permanent_error")
    return None


def _sync(
    namespace: str,
    name: str,
    *,
    apply_all: bool,
    kinds: Collection[str],
    seen: dict[str, dict[str, Any] | None] | None,
    resource: dict[str, Any] | None,
) -> tuple[str, str] | None:
    """sync() without the counting: returns the error of this generation, permanent or not."""
    with _lock(namespace, name):
        cr = resource if resource is not None else get_resource(namespace, name)
        if cr is None or cr["metadata"].get("deletionTimestamp"):
            return None  # gone, or going with its children
        generation = cr["metadata"].get("generation", 0)
        status = cr.get("status") or {}
        previous = list(status.get("conditions") or [])
        full = set(kinds) >= set(CHILD_KINDS)
        seen = dict(seen or {})
        error: tuple[str, str] | None = None
        wrote = applied = False
        spec = None
        try:
            spec = InferenceDeploymentSpec.model_validate(cr["spec"])
        except ValidationError as e:  # the schema admits it, the models do not (e.g. an older CRD)
            first = e.errors()[0]
            metrics.errored("invalid_spec")
            error = ("InvalidSpec", f"invalid spec: {first['msg']} at {'.'.join(map(str, first['loc']))}")
        bad_name = name_problem(name)  # the same: the CRD's rule on metadata.name is newer
        if bad_name is not None:
            spec, error = None, ("InvalidSpec", f"invalid name: {bad_name}")
        admin, refusal = _admin_policy(spec) if spec is not None else (None, None)
        if refusal is not None:  # re-checked by every sync: a policy change is seen by the resync
            error = refusal
        elif spec is not None:
            refused = None if apply_all else rejected(previous, generation)
            if refused is not None:  # permanent until the spec changes: no write, no new event
                error = (refused["reason"], refused.get("message", ""))
            elif not full and not apply_all and status.get("observedGeneration") != generation:
                pass  # a new generation: its reconcile (or retry) applies it, a watcher does not race it
            elif workload_key(spec) == "LeaderWorkerSet" and not lws_served:
                # Nothing half-rendered: no Service without its workers. Not permanent: the
                # discovery that sees the CRD arrive re-syncs every resource.
                error = (LWS_UNAVAILABLE, LWS_UNAVAILABLE_MESSAGE)
            else:
                # A generation not yet applied in full (a failed or interrupted apply) is applied
                # in full: only an apply removes the fields an older spec set.
                apply_all = apply_all or (full and status.get("observedGeneration") != generation)
                error, wrote = _apply_children(cr, spec, kinds, seen, apply_all, admin)
                applied = full and error is None
        shown = error
        if error is None and not full:
            # A partial sync (one child's event) cannot clear what the last full one found.
            failure = apply_failure(previous, generation)
            if failure is not None:
                shown = (failure["reason"], failure.get("message", ""))
        workers = workload_key(spec) if spec is not None else "Deployment"
        if not {"Deployment", "LeaderWorkerSet"} & set(kinds) and not wrote and shown is None:
            return None  # a Service or PDB event changes nothing the status says
        deployment = _workload_status(workers, name, namespace, seen)
        new = compute_status(
            name=name,
            generation=generation,
            selector=selector_string(name),
            desired=spec.desired_replicas if spec is not None else None,
            deployment=deployment,
            previous_conditions=previous,
            now=now(),
            apply_error=shown,
            applied=applied,
            last_applied=status.get("observedGeneration"),
            download=download_condition(downloads_of(namespace, name)),
            endpoint=endpoint_url(Owner(name, namespace, ""), spec) if spec is not None else None,
        )
        if status_changed(status, new):
            _announce_transitions(cr, previous, new["conditions"])
            apply_status(namespace, name, new, MANAGER)
        if spec is not None and spec.autoscaling is None and _has_autoscaler_status(cr):
            # The autoscaler stopped: its fields go (only an apply by their manager removes them;
            # asked on every sync, so a last write of a stopping autoscaler goes too).
            apply_status(namespace, name, {}, AUTOSCALER_MANAGER)
        return error


def _admin_policy(
    spec: InferenceDeploymentSpec,
) -> tuple[policy.AdminPolicy | None, tuple[str, str] | None]:
    """The admin policy in force, and (reason, message) when it refuses the spec or cannot be
    read (nothing is applied then); no refusal when it allows the spec."""
    try:
        admin = policy.load()
    except policy.PolicyError as e:
        return None, ("PolicyInvalid", str(e))
    violations = policy.check(spec, admin)
    return admin, (("PolicyViolation", policy.refusal(violations)) if violations else None)


def _workload_status(
    key: str, name: str, namespace: str, seen: dict[str, dict[str, Any] | None]
) -> dict[str, Any] | None:
    """The workers' Deployment, or their LeaderWorkerSet read as one (counted in groups)."""
    if key == "Deployment":
        return seen["Deployment"] if "Deployment" in seen else read("Deployment", name, namespace)
    if not lws_served:
        return None
    live = seen[key] if key in seen else read(key, name, namespace)
    return leaderworkerset.as_deployment(live)


def _has_autoscaler_status(cr: dict[str, Any]) -> bool:
    """Whether the autoscaler's field manager still owns status fields (an empty apply by it
    removes them; once it owns none, it leaves managedFields, so this is asked once)."""
    return any(
        f.get("manager") == AUTOSCALER_MANAGER
        and f.get("operation") == "Apply"
        and f.get("subresource") == "status"
        for f in cr["metadata"].get("managedFields") or []
    )


def _apply_children(
    cr: dict[str, Any],
    spec: InferenceDeploymentSpec,
    kinds: Collection[str],
    seen: dict[str, dict[str, Any] | None],
    apply_all: bool,
    admin: policy.AdminPolicy | None = None,
) -> tuple[tuple[str, str] | None, bool]:
    """(the error that stopped it, whether any child was written); `seen` gets what is live."""
    name, namespace = cr["metadata"]["name"], cr["metadata"]["namespace"]
    generation = cr["metadata"].get("generation", 0)
    wrote = False
    owner = Owner(name, namespace, cr["metadata"]["uid"])
    rendered = all_children(
        owner,
        spec,
        spec.image or worker_image(),
        spec.router.image or router_image(),
        pools=pools_served,
        policy=admin,
        operator_namespace=operator_namespace(),
    )
    keys = {key_of(c) for c in rendered}
    for key in REMOVABLE_KEYS:  # the router (or the pool) switched off: what is left of it goes
        if key in OPTIONAL_KEYS and not _served(key):
            continue  # no such resource here
        if key in kinds and key not in keys:
            try:
                wrote = _remove(key, owner, seen) or wrote
            except (ApiException, *NETWORK_ERRORS) as e:
                logger.warning("deleting %s of %s/%s failed: %s", key, namespace, name, _api_message(e))
                return (
                    "ApplyFailed",
                    f"deleting the {kind_of(key)} {child_name(key, name)} failed: {_api_message(e)}",
                ), wrote
    for child in rendered:
        key, kind, child_name_ = key_of(child), child["kind"], child["metadata"]["name"]
        if key not in kinds:
            continue
        try:
            before = seen[key] if key in seen else read(kind, child_name_, namespace)
            drift = child_drift(child, before)
            if drift and key in seen:  # an event or a list may be behind: ask before writing
                before = seen[key] = read(kind, child_name_, namespace)
                drift = child_drift(child, before)
            if before is not None and before["metadata"].get("deletionTimestamp"):
                continue  # its DELETED event brings us back, to create it anew
            if not drift and not apply_all:
                seen[key] = before
                continue
            taken = foreign(before, owner)
            if taken is not None:  # never a forced apply over someone else's object
                message = (
                    f"the {kind} {namespace}/{child_name_} exists and is not this resource's "
                    f"({taken}): not taken over; delete or rename it"
                )
                logger.warning("%s/%s: %s", namespace, name, message)
                return ("ChildConflict", message), wrote
            if drift and not apply_all:  # healing: it was deleted or changed by hand
                metrics.CHILD_REAPPLIES.labels(kind).inc()
            if (
                key in ("Deployment", "LeaderWorkerSet")
                and before is not None
                and "replicas" not in child["spec"]
            ):
                handover = replicas_handover(before, child["apiVersion"], kind)
                if handover is not None:  # switching to autoscaling: keep today's count
                    server_side_apply(handover, manager=AUTOSCALER_MANAGER)
            after = seen[key] = server_side_apply(child)
        except (ApiException, *NETWORK_ERRORS) as e:
            status = e.status if isinstance(e, ApiException) else None
            if kind in OPTIONAL_KEYS and status == 404:
                continue  # its CRD went since the last discovery: the next one notices
            reason, _ = api_error_refusal(e)  # QuotaExceeded, AdmissionDenied ...: retried
            metrics.errored(metrics.error_kind(e))
            logger.warning("applying %s %s/%s failed: %s", kind, namespace, name, _api_message(e))
            return (reason, f"applying the {kind} failed: {_api_message(e)}"), wrote
        changed = (
            before is None or before["metadata"]["resourceVersion"] != after["metadata"]["resourceVersion"]
        )
        wrote = wrote or changed
        if before is None:
            post_event(cr, "Created", f"created {kind} {child_name_} for generation {generation}")
        elif changed and apply_all:
            post_event(cr, "Updated", f"updated {kind} {child_name_} to generation {generation}")
        elif changed:
            where = ", ".join(drift[:3]) + (", ..." if len(drift) > 3 else "")
            post_event(cr, "Reverted", f"re-applied {kind} {child_name_}: {where} had been changed")
    return None, wrote


def _served(key: str) -> bool:
    """Whether the API of an optional child (OPTIONAL_KEYS) is served, as discovery last said."""
    return pools_served if key == "InferencePool" else lws_served


def _remove(key: str, owner: Owner, seen: dict[str, dict[str, Any] | None]) -> bool:
    """Delete the child `key` no longer rendered if it is there and ours; whether a delete was sent."""
    kind, name = kind_of(key), child_name(key, owner.name)
    before = seen[key] if key in seen else read(kind, name, owner.namespace)
    if before is None or before["metadata"].get("deletionTimestamp"):
        return False
    refs = before["metadata"].get("ownerReferences") or []
    if not any(r.get("uid") == owner.uid for r in refs):
        return False  # not ours: never delete what someone else made under that name
    delete(kind, name, owner.namespace)
    seen[key] = None
    return True


def _announce_transitions(body: Any, previous: list[dict], current: list[dict]) -> None:
    """An event on the resource whenever Ready changes, or Degraded or its reason, with why."""
    before = {c["type"]: (c.get("status"), c.get("reason")) for c in previous}
    for c in current:
        was = before.get(c["type"], (None, None))
        moved = was[0] != c["status"] or (c["type"] == "Degraded" and was[1] != c["reason"])
        if c["type"] == "Ready" and c["reason"] in APPLY_FAILURES:
            continue  # Degraded tells it, once
        if c["type"] in ("Ready", "Degraded") and moved:
            warning = (c["type"] == "Degraded") == (c["status"] == "True")
            post_event(body, f"{c['type']}{c['status']}", f"{c['reason']}: {c['message']}", warning=warning)


def sync_or_retry(namespace: str, name: str, **kwargs: Any) -> None:
    """sync() for the watchers and the resync: a transient failure comes back later, backed off."""
    try:
        error = sync(namespace, name, **kwargs)
    except (ApiException, *NETWORK_ERRORS) as e:
        error = ("SyncFailed", _api_message(e))
    if error is not None:
        delay = retries.failed((namespace, name))
        logger.warning("syncing %s/%s failed (%s); retrying in %.0f s", namespace, name, error[1], delay)
    elif set(kwargs.get("kinds", CHILD_KINDS)) >= set(CHILD_KINDS):
        retries.succeeded((namespace, name))


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(meta: kopf.Meta, retry: int, **_: Any) -> None:
    """Apply every child. A refusal of the spec is reported (status, one event) and not retried:
    kopf retries only the TemporaryError of a transient failure or of a refusal the cluster
    decides (quota, admission, RBAC), after a doubling backoff."""
    namespace, name = meta["namespace"], meta["name"]
    try:
        error = sync(namespace, name, apply_all=True)
    except (ApiException, *NETWORK_ERRORS) as e:
        raise kopf.TemporaryError(f"syncing failed: {_api_message(e)}", delay=backoff_s(retry + 1)) from e
    if error is not None:
        raise kopf.TemporaryError(error[1], delay=backoff_s(retry + 1))
    retries.succeeded((namespace, name))


def _child_changed(kind: str, body: kopf.Body, type: str | None) -> None:
    labels = body["metadata"].get("labels") or {}
    owner = labels.get(LABEL_OWNER)
    if not owner:
        return
    key = child_key(kind, labels)
    # DELETED: gone, or no longer ours to see (someone removed our labels): read it again.
    seen = {} if type == "DELETED" else {key: dict(body)}
    sync_or_retry(body["metadata"]["namespace"], owner, kinds=(key,), seen=seen)


@kopf.on.event(*CHILD_RESOURCES["Deployment"])
def deployment_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    """The workers changed (a pod became ready, a rollout advanced, someone edited or deleted
    the Deployment): heal it if it drifted, refresh the owner's status."""
    _child_changed("Deployment", body, type)


@kopf.on.event(*CHILD_RESOURCES["Service"])
def service_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    _child_changed("Service", body, type)


@kopf.on.event(*CHILD_RESOURCES["PodDisruptionBudget"])
def pdb_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    _child_changed("PodDisruptionBudget", body, type)


def downloads_of(namespace: str, name: str) -> list[PodDownload]:
    with _downloads_guard:
        return list(_downloads.get((namespace, name), {}).values())


def note_download(namespace: str, owner: str, pod: str, download: PodDownload | None) -> bool:
    """Record a pod's download (None: none, or the pod is gone); whether that changed anything."""
    with _downloads_guard:
        pods = _downloads.setdefault((namespace, owner), {})
        before = pods.pop(pod, None)
        if download is not None:
            pods[pod] = download
        if not pods:
            del _downloads[(namespace, owner)]
    return before != download


def note_ready(namespace: str, owner: str, pod: str, ready: bool | None) -> bool:
    """Record whether a group's pod is ready (None: gone); whether that changed."""
    with _downloads_guard:
        pods = _ready.setdefault((namespace, owner), {})
        before = pods.pop(pod, None)
        if ready is not None:
            pods[pod] = ready
        if not pods:
            del _ready[(namespace, owner)]
    return before != ready


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


@kopf.on.event(*POD_RESOURCE)
def pod_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    """A worker pod changed: when its model download started, ended or failed, refresh the
    owner's status (most pod events change nothing here and cost nothing)."""
    meta = body["metadata"]
    owner = (meta.get("labels") or {}).get(LABEL_OWNER)
    if not owner:
        return
    download = None if type == "DELETED" else pod_download(dict(body))
    grouped = LWS_NAME_LABEL in (meta.get("labels") or {})
    workers = "LeaderWorkerSet" if grouped else "Deployment"
    ready = type != "DELETED" and pod_ready(dict(body))
    # A group's readiness is in its LeaderWorkerSet's status, which is not watched: a pod that
    # turns ready (or not) refreshes it now and once more shortly, after the LWS controller
    # counted it.
    moved = grouped and note_ready(
        meta["namespace"], owner, meta["name"], None if type == "DELETED" else ready
    )
    if note_download(meta["namespace"], owner, meta["name"], download) or moved:
        sync_or_retry(meta["namespace"], owner, kinds=(workers,))
    if moved:
        retries.after((meta["namespace"], owner), LWS_STATUS_LAG_S)


@kopf.on.event(*CHILD_RESOURCES["ServiceAccount"])
def service_account_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    _child_changed("ServiceAccount", body, type)


@kopf.on.event(*CHILD_RESOURCES["Role"])
def role_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    _child_changed("Role", body, type)


@kopf.on.event(*CHILD_RESOURCES["RoleBinding"])
def role_binding_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    _child_changed("RoleBinding", body, type)


@kopf.on.event(*CHILD_RESOURCES["NetworkPolicy"])
def network_policy_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    _child_changed("NetworkPolicy", body, type)


def list_resources() -> list[dict[str, Any]]:
    """Every resource in the watched namespaces (all of them: one cluster-wide LIST)."""
    custom = client.CustomObjectsApi(api())
    if not watch_namespaces:
        return custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, _request_timeout=API_TIMEOUT_S)[
            "items"
        ]
    return [
        item
        for namespace in watch_namespaces
        for item in custom.list_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, _request_timeout=API_TIMEOUT_S
        )["items"]
    ]


def list_children(kind: str) -> list[dict[str, Any]]:
    """Our children of `kind` in the watched namespaces (a list's items carry no apiVersion or
    kind)."""
    ops = _ops(kind)
    query = {"label_selector": CHILD_SELECTOR, "_preload_content": False, "_request_timeout": API_TIMEOUT_S}
    if not watch_namespaces:
        return _json(ops[2](**query))["items"]
    return [item for namespace in watch_namespaces for item in _json(ops[3](namespace, **query))["items"]]


def resync() -> None:
    """Every resource and its children as the API server has them now (one LIST per kind),
    through the same sync the watchers use: writes only what drifted or what a missed event left."""
    resources = list_resources()
    listed = (*LISTED_KINDS, *(key for key in OPTIONAL_KEYS if _served(key)))
    live = {
        kind: {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in list_children(kind)}
        for kind in listed
    }
    for key in OPTIONAL_KEYS:
        live.setdefault(key, {})
    for cr in resources:
        ns, name = cr["metadata"]["namespace"], cr["metadata"]["name"]
        seen = {key: live[kind_of(key)].get((ns, child_name(key, name))) for key in CHILD_KINDS}
        sync_or_retry(ns, name, resource=cr, seen=seen)


def refresh_discovery() -> bool:
    """Ask discovery whether InferencePools and LeaderWorkerSets are served; whether either
    changed."""
    global pools_served, lws_served
    custom = client.CustomObjectsApi(api())
    pools_now = inferencepool.served(custom, API_TIMEOUT_S)
    lws_now = leaderworkerset.served(custom, API_TIMEOUT_S)
    changed = (pools_now, lws_now) != (pools_served, lws_served)
    if pools_now != pools_served:
        logger.info(
            "InferencePools are %s", "served: applying one per resource" if pools_now else "not served"
        )
    if lws_now != lws_served:
        logger.info(
            "LeaderWorkerSets are %s",
            "served: multi-node resources get theirs" if lws_now else "not served",
        )
    pools_served, lws_served = pools_now, lws_now
    return changed


async def _resync_forever() -> None:
    next_full = time.monotonic() + RESYNC_S
    next_discovery = time.monotonic()
    while True:
        await asyncio.sleep(1.0)
        try:  # nothing may end this task: it is the safety net
            if time.monotonic() >= next_discovery:
                next_discovery = time.monotonic() + DISCOVERY_S
                if await asyncio.to_thread(refresh_discovery):
                    next_full = time.monotonic()  # the CRD came (or went): every pool now
            for namespace, name in retries.pop_due():
                await asyncio.to_thread(sync_or_retry, namespace, name, apply_all=True)
            if time.monotonic() >= next_full:
                next_full = time.monotonic() + RESYNC_S
                await asyncio.to_thread(resync)
        except (ApiException, *NETWORK_ERRORS) as e:
            metrics.errored(metrics.error_kind(e))
            logger.warning("resync failed: %s", _api_message(e))
        except Exception as e:
            metrics.errored(metrics.error_kind(e))
            logger.exception("resync failed")


_resync_task: asyncio.Task | None = None


@kopf.on.startup()
async def start_resync(**_: Any) -> None:
    """The resync and the retries run in kopf's loop, so only while kopf runs: on the leader."""
    global _resync_task
    _resync_task = asyncio.create_task(_resync_forever(), name="resync")


@kopf.on.cleanup()
async def stop_resync(**_: Any) -> None:
    if _resync_task is not None:
        _resync_task.cancel()
