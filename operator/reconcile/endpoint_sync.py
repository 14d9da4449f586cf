"""The InferenceEndpoints' reconciler: makes each endpoint's shared router true, one call at a time
per endpoint.

`sync` reads the endpoint and its namespace's InferenceDeployments, renders the router for the
members (reconcile/endpoint.py), applies each child that drifted (server-side apply under our
field manager; never over an object someone else owns) and writes the status (the URL, the models
behind it, Ready). It runs on the endpoint's own create, update and resume (handlers.py), and
whenever a member's part in it changes: an InferenceDeployment that joins, leaves, changes its
served name, adapters or scale-from-zero, or goes (`member_changed`, from every InferenceDeployment
event: a resource that names no endpoint costs a dict read; a member's event, one validation of its
spec and a comparison, and no API call unless that part changed). The children are not watched: a child
deleted by hand comes back at the next of those.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import ValidationError

from kvscale.operator.api.endpoint import ENDPOINT_KIND, InferenceEndpointSpec
from kvscale.operator.api.labels import LABEL_ENDPOINT
from kvscale.operator.kube.client import Kube, now
from kvscale.operator.reconcile import admin_policy
from kvscale.operator.reconcile.children import Owner, foreign
from kvscale.operator.reconcile.endpoint import Member, endpoint_children, endpoint_url, members
from kvscale.operator.reconcile.heal import child_drift
from kvscale.operator.settings import Settings

logger = logging.getLogger(__name__)


def member_part(resource: dict[str, Any]) -> tuple[str | None, Member | None]:
    """(the endpoint an InferenceDeployment names, what it brings to it): what `member_changed`
    compares between two events of it."""
    spec = resource.get("spec") or {}
    endpoint = (spec.get("router") or {}).get("endpoint")
    if endpoint is None or resource["metadata"].get("deletionTimestamp"):
        return None, None
    found, _ = members(endpoint, [resource])
    return endpoint, (found[0] if found else None)


class EndpointReconciler:
    def __init__(self, kube: Kube, settings: Settings) -> None:
        self.kube, self.settings = kube, settings
        self.policy = admin_policy.PolicyFile(settings.policy_path)
        # (namespace, InferenceDeployment) -> its last member_part: a status write of a member
        # (most of its events) changes nothing here and syncs nothing.
        self._parts: dict[tuple[str, str], tuple[str | None, Member | None]] = {}
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def member_changed(self, body: dict[str, Any], type: str | None) -> None:
        """An InferenceDeployment event: sync the endpoints whose members it changed (the one it
        names now and the one it named before)."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        part = (None, None) if type == "DELETED" else member_part(body)
        before = self._parts.get(key, (None, None))
        if part == before:
            return
        if part == (None, None):
            self._parts.pop(key, None)
        else:
            self._parts[key] = part
        for endpoint in {before[0], part[0]} - {None}:
            found = self.sync(meta["namespace"], endpoint)
            if not found and endpoint == part[0]:
                # A typo in router.endpoint would leave the model with no router and no word:
                # said once, on the resource, each time it comes to name a missing endpoint.
                message = (
                    f"router.endpoint names the InferenceEndpoint {endpoint!r}, which does not exist "
                    f"in {meta['namespace']}: no router serves this model until it is created"
                )
                self.kube.post_event(body, "EndpointNotFound", message, warning=True)

    def sync(self, namespace: str, name: str) -> bool:
        """Make the endpoint true; False when there is no such endpoint. Raises on an API error
        (the handler retries with a backoff)."""
        with self._lock(namespace, name):
            cr = self.kube.get_endpoint(namespace, name)
            if cr is None or cr["metadata"].get("deletionTimestamp"):
                return False  # the garbage collector takes its children
            self._sync(cr)
            return True

    def _sync(self, cr: dict[str, Any]) -> None:
        meta = cr["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        generation = meta.get("generation", 0)
        try:
            spec = InferenceEndpointSpec.model_validate(cr.get("spec") or {})
        except ValidationError as e:  # stored under an older CRD: said once, not retried
            self._status(cr, [], "InvalidSpec", f"invalid spec: {e}", ready=False)
            return
        try:
            admin = self.policy.load()
        except admin_policy.PolicyError as e:
            self._status(cr, [], "PolicyInvalid", str(e), ready=False)
            return
        violations = admin_policy.check_router(spec.router, admin)
        if violations:
            self._status(cr, [], "PolicyViolation", admin_policy.refusal(violations), ready=False)
            return
        pool, problems = members(name, self.kube.list_resources_in(namespace))
        owner = Owner(name, namespace, meta["uid"])
        rendered = endpoint_children(
            owner,
            spec,
            pool,
            spec.router.image or self.settings.router_image,
            ids=admin.pod_security,
            net=admin.network_policy,
            operator_namespace=self.settings.operator_namespace,
        )
        for child in rendered:
            kind, child_name = child["kind"], child["metadata"]["name"]
            live = self.kube.read(kind, child_name, namespace)
            taken = foreign(live, owner, ENDPOINT_KIND, LABEL_ENDPOINT)
            if taken is not None:  # never a forced apply over someone else's object
                message = (
                    f"the {kind} {namespace}/{child_name} exists and is not this endpoint's "
                    f"({taken}): not taken over; delete or rename it"
                )
                self._status(cr, pool, "ChildConflict", message, ready=False)
                return
            if child_drift(child, live):
                self.kube.apply(child)
        if problems:
            message = "left out: " + "; ".join(problems)
            self._status(cr, pool, "MembersLeftOut", message, ready=False, generation=generation)
        elif not pool:
            self._status(cr, pool, "NoModels", "no InferenceDeployment names this endpoint", ready=False)
        else:
            self._status(cr, pool, "Applied", f"serving {len(pool)} model(s)", ready=True)

    def _status(
        self,
        cr: dict[str, Any],
        pool: list[Member],
        reason: str,
        message: str,
        *,
        ready: bool,
        generation: int | None = None,
    ) -> None:
        """Write the status when it changed (the Ready condition's time moves only on a change of
        its status); a warning event once per new failure reason."""
        meta = cr["metadata"]
        old = cr.get("status") or {}
        previous = next((c for c in old.get("conditions") or [] if c.get("type") == "Ready"), None)
        status = "True" if ready else "False"
        since = (
            previous.get("lastTransitionTime")
            if previous is not None and previous.get("status") == status
            else now()
        )
        condition = {
            "type": "Ready",
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since,
            "observedGeneration": meta.get("generation", 0) if generation is None else generation,
        }
        body = {
            "observedGeneration": meta.get("generation", 0),
            "endpoint": endpoint_url(meta["name"], meta["namespace"]),
            "models": [
                {"name": m.model, "inferenceDeployment": m.deployment, "adapters": list(m.adapters)}
                for m in pool
            ],
            "conditions": [condition],
        }
        if all(old.get(k) == v for k, v in body.items() if k != "conditions") and previous == condition:
            return
        self.kube.apply_endpoint_status(meta["namespace"], meta["name"], body)
        if not ready and (previous is None or previous.get("reason") != reason):
            logger.warning("endpoint %s/%s: %s", meta["namespace"], meta["name"], message)
            self.kube.post_event(cr, reason, message, warning=True, kind=ENDPOINT_KIND)
