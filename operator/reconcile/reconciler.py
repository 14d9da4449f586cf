"""The reconciler: makes each InferenceDeployment true, one call at a time per resource.

One method, `sync`, applies the children that need it (server-side apply under our field manager)
and writes the status fields the reconciler owns when they changed (server-side apply of the
status subresource; the autoscaler owns its own fields, api/status.py). Everything calls it:

- the create, update (of the spec) and resume handlers apply every child (handlers.py): a spec
  change can drop fields, which only an apply removes (an unchanged apply is a no-op on the API
  server);
- the watches on the Deployments, Services, PDBs, ServiceAccounts, Roles, RoleBindings and
  NetworkPolicies we own (`child_changed`) re-apply a child that was deleted or changed by hand
  (heal.child_drift), and the workers' Deployment's refresh the status; a child that has not
  drifted is not sent at all. The router's Deployment and Service share kinds with the workers':
  children are keyed (children.child_key), not by kind alone;
- the resync task in the leader (`resync_forever`) does the same for every resource every
  Settings.resync_s, catching what a missed event left behind, and retries transient failures
  with a doubling backoff;
- the watch on the worker pods (`pod_changed`) keeps where each pod's hf:// model download
  stands (status.pod_download) and refreshes the status when that changes: a download that
  starts, ends or fails (a crash loop of the init container is one change).

An API error the spec causes (a 422 against a schema, a 400) is permanent for that generation
(status and one event, no retry until the spec changes); a 5xx or a timeout is retried, and so
are refusals that the cluster decides (a ResourceQuota, an admission webhook or policy, RBAC:
heal.api_refusal), with a doubling backoff up to 5 min, reported once under their own reason,
so a fixed quota recovers without a spec edit.

All I/O goes through `self.kube` (kube/client.py); all state is the object's own (no module
globals): the retry queue, the per-resource locks, what the pod watch saw, what discovery said.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Collection
from typing import Any

from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from kvscale.operator import metrics
from kvscale.operator.api.labels import AUTOSCALER_MANAGER, LABEL_OWNER, MANAGER
from kvscale.operator.api.lora import adapter_name_clash
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.api.validation import name_problem
from kvscale.operator.kube import leaderworkerset
from kvscale.operator.kube.client import LISTED_KINDS, OPTIONAL_KINDS, Kube, now
from kvscale.operator.kube.errors import NETWORK_ERRORS, api_message, error_kind
from kvscale.operator.reconcile import admin_policy
from kvscale.operator.reconcile.children import (
    CHILD_KEYS,
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
from kvscale.operator.reconcile.heal import (
    APPLY_FAILURES,
    RETRIED_REASONS,
    RetryQueue,
    api_error_refusal,
    apply_failure,
    child_drift,
    rejected,
)
from kvscale.operator.reconcile.status import (
    PodDownload,
    compute_status,
    download_condition,
    pod_download,
    status_changed,
)
from kvscale.operator.settings import Settings

logger = logging.getLogger(__name__)

CHILD_KINDS = CHILD_KEYS  # what a sync may apply: every child, by key
# Children that are deleted when no longer rendered (the router switched off, a pool turned off,
# the workers moved between a Deployment and a LeaderWorkerSet).
REMOVABLE_KEYS = (*ROUTER_KEYS, *NETWORK_KEYS, "InferencePool", "Deployment", "LeaderWorkerSet")
OPTIONAL_KEYS = OPTIONAL_KINDS  # their keys are their kinds
LWS_UNAVAILABLE = "LeaderWorkerSetUnavailable"
LWS_UNAVAILABLE_MESSAGE = (
    "parallelism.nodes above 1 runs each copy of the model as a LeaderWorkerSet group, and this "
    "cluster does not serve leaderworkersets.leaderworkerset.x-k8s.io/v1: install LeaderWorkerSet "
    "(https://github.com/kubernetes-sigs/lws), or set parallelism.nodes to 1"
)
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # the LWS controller's label on its pods
LWS_STATUS_LAG_S = 3.0


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def has_autoscaler_status(cr: dict[str, Any]) -> bool:
    """Whether the autoscaler's field manager still owns status fields (an empty apply by it
    removes them; once it owns none, it leaves managedFields, so this is asked once)."""
    return any(
        f.get("manager") == AUTOSCALER_MANAGER
        and f.get("operation") == "Apply"
        and f.get("subresource") == "status"
        for f in cr["metadata"].get("managedFields") or []
    )


class WorkerPods:
    """What the pod watch saw, by (namespace, resource) and pod name: each pod's model download
    (pods without one are not kept) and whether each pod of a LeaderWorkerSet group is ready (a
    group's readiness is in its LeaderWorkerSet's status, which is not watched). Thread-safe."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._downloads: dict[tuple[str, str], dict[str, PodDownload]] = {}
        self._ready: dict[tuple[str, str], dict[str, bool]] = {}

    def downloads_of(self, namespace: str, name: str) -> list[PodDownload]:
        with self._guard:
            return list(self._downloads.get((namespace, name), {}).values())

    def note_download(self, namespace: str, owner: str, pod: str, download: PodDownload | None) -> bool:
        """Record a pod's download (None: none, or the pod is gone); whether that changed anything."""
        return self._note(self._downloads, (namespace, owner), pod, download)

    def note_ready(self, namespace: str, owner: str, pod: str, ready: bool | None) -> bool:
        """Record whether a group's pod is ready (None: gone); whether that changed."""
        return self._note(self._ready, (namespace, owner), pod, ready)

    def _note(self, table: dict, key: tuple[str, str], pod: str, value: Any) -> bool:
        with self._guard:
            pods = table.setdefault(key, {})
            before = pods.pop(pod, None)
            if value is not None:
                pods[pod] = value
            if not pods:
                del table[key]
        return before != value


class Reconciler:
    """The InferenceDeployments' reconciliation, over `kube`, as `settings` say."""

    def __init__(self, kube: Kube, settings: Settings) -> None:
        self.kube = kube
        self.settings = settings
        self.retries = RetryQueue()
        self.policy = admin_policy.PolicyFile(settings.policy_path)
        self.pods = WorkerPods()
        # Whether the API server serves InferencePools and LeaderWorkerSets: asked by the resync
        # task every Settings.discovery_s, read by every sync (never asked by one).
        self.pools_served = False
        self.lws_served = False
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    # -- one resource ------------------------------------------------------------------------
    def sync(
        self,
        namespace: str,
        name: str,
        *,
        apply_all: bool = False,
        kinds: Collection[str] = CHILD_KINDS,
        seen: dict[str, dict[str, Any] | None] | None = None,
        resource: dict[str, Any] | None = None,
    ) -> tuple[str, str] | None:
        """Make the resource true: apply its children of `kinds` (child keys) that need it (all of
        them with `apply_all`, else those that drifted), then write the reconciler's status if it
        changed.

        `seen`: children by key as a watch or a list just showed them (None: absent), read
        otherwise; `resource`: the resource as a list showed it, read otherwise. Returns the
        transient error (reason, message) to retry, else None. Raises on a failed read or status
        write.
        """
        try:
            error = self._sync(
                namespace, name, apply_all=apply_all, kinds=kinds, seen=seen, resource=resource
            )
        except Exception as e:
            metrics.reconciled("transient_error")
            metrics.errored(error_kind(e))
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
        self,
        namespace: str,
        name: str,
        *,
        apply_all: bool,
        kinds: Collection[str],
        seen: dict[str, dict[str, Any] | None] | None,
        resource: dict[str, Any] | None,
    ) -> tuple[str, str] | None:
        """sync() without the counting: returns the error of this generation, permanent or not."""
        with self._lock(namespace, name):
            cr = resource if resource is not None else self.kube.get_resource(namespace, name)
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
            clash = adapter_name_clash(spec, name) if spec is not None else None
            if clash is not None:  # the default served name is the resource's: no CEL rule sees both
                spec, error = None, ("InvalidSpec", clash)
            admin, refusal = self._admin_policy(spec) if spec is not None else (None, None)
            if refusal is not None:  # re-checked by every sync: a policy change is seen by the resync
                error = refusal
            elif spec is not None:
                refused = None if apply_all else rejected(previous, generation)
                if refused is not None:  # permanent until the spec changes: no write, no new event
                    error = (refused["reason"], refused.get("message", ""))
                elif not full and not apply_all and status.get("observedGeneration") != generation:
                    pass  # a new generation: its reconcile (or retry) applies it, a watcher does not race it
                elif workload_key(spec) == "LeaderWorkerSet" and not self.lws_served:
                    # Nothing half-rendered: no Service without its workers. Not permanent: the
                    # discovery that sees the CRD arrive re-syncs every resource.
                    error = (LWS_UNAVAILABLE, LWS_UNAVAILABLE_MESSAGE)
                else:
                    # A generation not yet applied in full (a failed or interrupted apply) is
                    # applied in full: only an apply removes the fields an older spec set.
                    apply_all = apply_all or (full and status.get("observedGeneration") != generation)
                    error, wrote = self._apply_children(cr, spec, kinds, seen, apply_all, admin)
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
            deployment = self._workload_status(workers, name, namespace, seen)
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
                download=download_condition(self.pods.downloads_of(namespace, name)),
                endpoint=endpoint_url(Owner(name, namespace, ""), spec) if spec is not None else None,
            )
            if status_changed(status, new):
                self._announce_transitions(cr, previous, new["conditions"])
                self.kube.apply_status(namespace, name, new, MANAGER)
            if spec is not None and spec.autoscaling is None and has_autoscaler_status(cr):
                # The autoscaler stopped: its fields go (only an apply by their manager removes
                # them; asked on every sync, so a last write of a stopping autoscaler goes too).
                self.kube.apply_status(namespace, name, {}, AUTOSCALER_MANAGER)
            return error

    def _admin_policy(
        self, spec: InferenceDeploymentSpec
    ) -> tuple[admin_policy.AdminPolicy | None, tuple[str, str] | None]:
        """The admin policy in force, and (reason, message) when it refuses the spec or cannot be
        read (nothing is applied then); no refusal when it allows the spec."""
        try:
            admin = self.policy.load()
        except admin_policy.PolicyError as e:
            return None, ("PolicyInvalid", str(e))
        violations = admin_policy.check(spec, admin)
        return admin, (("PolicyViolation", admin_policy.refusal(violations)) if violations else None)

    def _workload_status(
        self, key: str, name: str, namespace: str, seen: dict[str, dict[str, Any] | None]
    ) -> dict[str, Any] | None:
        """The workers' Deployment, or their LeaderWorkerSet read as one (counted in groups)."""
        if key == "Deployment":
            return (
                seen["Deployment"] if "Deployment" in seen else self.kube.read("Deployment", name, namespace)
            )
        if not self.lws_served:
            return None
        live = seen[key] if key in seen else self.kube.read(key, name, namespace)
        return leaderworkerset.as_deployment(live)

    def _apply_children(
        self,
        cr: dict[str, Any],
        spec: InferenceDeploymentSpec,
        kinds: Collection[str],
        seen: dict[str, dict[str, Any] | None],
        apply_all: bool,
        admin: admin_policy.AdminPolicy | None = None,
    ) -> tuple[tuple[str, str] | None, bool]:
        """(the error that stopped it, whether any child was written); `seen` gets what is live."""
        name, namespace = cr["metadata"]["name"], cr["metadata"]["namespace"]
        generation = cr["metadata"].get("generation", 0)
        wrote = False
        owner = Owner(name, namespace, cr["metadata"]["uid"])
        rendered = all_children(
            owner,
            spec,
            spec.image or self.settings.worker_image,
            spec.router.image or self.settings.router_image,
            pools=self.pools_served,
            policy=admin,
            operator_namespace=self.settings.operator_namespace,
        )
        keys = {key_of(c) for c in rendered}
        for key in REMOVABLE_KEYS:  # the router (or the pool) switched off: what is left of it goes
            if key in OPTIONAL_KEYS and not self._served(key):
                continue  # no such resource here
            if key in kinds and key not in keys:
                try:
                    wrote = self._remove(key, owner, seen) or wrote
                except (ApiException, *NETWORK_ERRORS) as e:
                    logger.warning("deleting %s of %s/%s failed: %s", key, namespace, name, api_message(e))
                    return (
                        "ApplyFailed",
                        f"deleting the {kind_of(key)} {child_name(key, name)} failed: {api_message(e)}",
                    ), wrote
        for child in rendered:
            key, kind, child_name_ = key_of(child), child["kind"], child["metadata"]["name"]
            if key not in kinds:
                continue
            try:
                before = seen[key] if key in seen else self.kube.read(kind, child_name_, namespace)
                drift = child_drift(child, before)
                if drift and key in seen:  # an event or a list may be behind: ask before writing
                    before = seen[key] = self.kube.read(kind, child_name_, namespace)
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
                        self.kube.apply(handover, manager=AUTOSCALER_MANAGER)
                after = seen[key] = self.kube.apply(child)
            except (ApiException, *NETWORK_ERRORS) as e:
                status = e.status if isinstance(e, ApiException) else None
                if kind in OPTIONAL_KEYS and status == 404:
                    continue  # its CRD went since the last discovery: the next one notices
                reason, _ = api_error_refusal(e)  # QuotaExceeded, AdmissionDenied ...: retried
                metrics.errored(error_kind(e))
                logger.warning("applying %s %s/%s failed: %s", kind, namespace, name, api_message(e))
                return (reason, f"applying the {kind} failed: {api_message(e)}"), wrote
            changed = (
                before is None
                or before["metadata"]["resourceVersion"] != after["metadata"]["resourceVersion"]
            )
            wrote = wrote or changed
            if before is None:
                self.kube.post_event(
                    cr, "Created", f"created {kind} {child_name_} for generation {generation}"
                )
            elif changed and apply_all:
                self.kube.post_event(
                    cr, "Updated", f"updated {kind} {child_name_} to generation {generation}"
                )
            elif changed:
                where = ", ".join(drift[:3]) + (", ..." if len(drift) > 3 else "")
                self.kube.post_event(
                    cr, "Reverted", f"re-applied {kind} {child_name_}: {where} had been changed"
                )
        return None, wrote

    def _served(self, key: str) -> bool:
        """Whether the API of an optional child (OPTIONAL_KEYS) is served, as discovery last said."""
        return self.pools_served if key == "InferencePool" else self.lws_served

    def _remove(self, key: str, owner: Owner, seen: dict[str, dict[str, Any] | None]) -> bool:
        """Delete the child `key` no longer rendered if it is there and ours; whether a delete was
        sent."""
        kind, name = kind_of(key), child_name(key, owner.name)
        before = seen[key] if key in seen else self.kube.read(kind, name, owner.namespace)
        if before is None or before["metadata"].get("deletionTimestamp"):
            return False
        refs = before["metadata"].get("ownerReferences") or []
        if not any(r.get("uid") == owner.uid for r in refs):
            return False  # not ours: never delete what someone else made under that name
        self.kube.delete(kind, name, owner.namespace)
        seen[key] = None
        return True

    def _announce_transitions(self, body: Any, previous: list[dict], current: list[dict]) -> None:
        """An event on the resource whenever Ready changes, or Degraded or its reason, with why."""
        before = {c["type"]: (c.get("status"), c.get("reason")) for c in previous}
        for c in current:
            was = before.get(c["type"], (None, None))
            moved = was[0] != c["status"] or (c["type"] == "Degraded" and was[1] != c["reason"])
            if c["type"] == "Ready" and c["reason"] in APPLY_FAILURES:
                continue  # Degraded tells it, once
            if c["type"] in ("Ready", "Degraded") and moved:
                warning = (c["type"] == "Degraded") == (c["status"] == "True")
                self.kube.post_event(
                    body, f"{c['type']}{c['status']}", f"{c['reason']}: {c['message']}", warning=warning
                )

    def sync_or_retry(self, namespace: str, name: str, **kwargs: Any) -> None:
        """sync() for the watchers and the resync: a transient failure comes back later, backed off."""
        try:
            error = self.sync(namespace, name, **kwargs)
        except (ApiException, *NETWORK_ERRORS) as e:
            error = ("SyncFailed", api_message(e))
        if error is not None:
            delay = self.retries.failed((namespace, name))
            logger.warning("syncing %s/%s failed (%s); retrying in %.0f s", namespace, name, error[1], delay)
        elif set(kwargs.get("kinds", CHILD_KINDS)) >= set(CHILD_KINDS):
            self.retries.succeeded((namespace, name))

    # -- what the watches saw ----------------------------------------------------------------
    def child_changed(self, kind: str, body: dict[str, Any], type: str | None) -> None:
        """A child of `kind` changed, or was deleted (type DELETED: gone, or no longer ours to see,
        someone removed our labels: read it again): heal it if it drifted; the workers' refresh
        the owner's status."""
        labels = body["metadata"].get("labels") or {}
        owner = labels.get(LABEL_OWNER)
        if not owner:
            return
        key = child_key(kind, labels)
        seen = {} if type == "DELETED" else {key: body}
        self.sync_or_retry(body["metadata"]["namespace"], owner, kinds=(key,), seen=seen)

    def pod_changed(self, body: dict[str, Any], type: str | None) -> None:
        """A worker pod changed: when its model download started, ended or failed, refresh the
        owner's status (most pod events change nothing here and cost nothing)."""
        meta = body["metadata"]
        owner = (meta.get("labels") or {}).get(LABEL_OWNER)
        if not owner:
            return
        download = None if type == "DELETED" else pod_download(body)
        grouped = LWS_NAME_LABEL in (meta.get("labels") or {})
        workers = "LeaderWorkerSet" if grouped else "Deployment"
        ready = type != "DELETED" and pod_ready(body)
        # A group's readiness is in its LeaderWorkerSet's status, which is not watched: a pod that
        # turns ready (or not) refreshes it now and once more shortly, after the LWS controller
        # counted it.
        moved = grouped and self.pods.note_ready(
            meta["namespace"], owner, meta["name"], None if type == "DELETED" else ready
        )
        if self.pods.note_download(meta["namespace"], owner, meta["name"], download) or moved:
            self.sync_or_retry(meta["namespace"], owner, kinds=(workers,))
        if moved:
            self.retries.after((meta["namespace"], owner), LWS_STATUS_LAG_S)

    # -- every resource ----------------------------------------------------------------------
    def resync(self) -> None:
        """Every resource and its children as the API server has them now (one LIST per kind),
        through the same sync the watchers use: writes only what drifted or what a missed event
        left."""
        resources = self.kube.list_resources()
        listed = (*LISTED_KINDS, *(key for key in OPTIONAL_KEYS if self._served(key)))
        live = {
            kind: {
                (o["metadata"]["namespace"], o["metadata"]["name"]): o for o in self.kube.list_children(kind)
            }
            for kind in listed
        }
        for key in OPTIONAL_KEYS:
            live.setdefault(key, {})
        for cr in resources:
            ns, name = cr["metadata"]["namespace"], cr["metadata"]["name"]
            seen = {key: live[kind_of(key)].get((ns, child_name(key, name))) for key in CHILD_KINDS}
            self.sync_or_retry(ns, name, resource=cr, seen=seen)

    def refresh_discovery(self) -> bool:
        """Ask discovery whether InferencePools and LeaderWorkerSets are served; whether either
        changed."""
        pools_now = self.kube.served("InferencePool")
        lws_now = self.kube.served("LeaderWorkerSet")
        changed = (pools_now, lws_now) != (self.pools_served, self.lws_served)
        if pools_now != self.pools_served:
            logger.info(
                "InferencePools are %s", "served: applying one per resource" if pools_now else "not served"
            )
        if lws_now != self.lws_served:
            logger.info(
                "LeaderWorkerSets are %s",
                "served: multi-node resources get theirs" if lws_now else "not served",
            )
        self.pools_served, self.lws_served = pools_now, lws_now
        return changed

    async def resync_forever(self) -> None:
        """The safety net, in the leader's loop: discovery, the due retries, the periodic resync."""
        next_full = time.monotonic() + self.settings.resync_s
        next_discovery = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            try:  # nothing may end this task: it is the safety net
                if time.monotonic() >= next_discovery:
                    next_discovery = time.monotonic() + self.settings.discovery_s
                    if await asyncio.to_thread(self.refresh_discovery):
                        next_full = time.monotonic()  # the CRD came (or went): every pool now
                for namespace, name in self.retries.pop_due():
                    await asyncio.to_thread(self.sync_or_retry, namespace, name, apply_all=True)
                if time.monotonic() >= next_full:
                    next_full = time.monotonic() + self.settings.resync_s
                    await asyncio.to_thread(self.resync)
            except (ApiException, *NETWORK_ERRORS) as e:
                metrics.errored(error_kind(e))
                logger.warning("resync failed: %s", api_message(e))
            except Exception as e:
                metrics.errored(error_kind(e))
                logger.exception("resync failed")
