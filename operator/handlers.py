"""The kopf watches: every handler the operator runs, registered on the registry it is given and
bound to the reconciler and the autoscaler it is given. Each is a few lines: kopf's arguments in,
a call to reconcile/reconciler.py or autoscaler/scaler.py, kopf's retry out.

- create, update (of the spec) and resume of an InferenceDeployment apply every child
  (`reconcile`); a refusal of the spec is reported (status, one event) and not retried: kopf
  retries only the TemporaryError of a transient failure or of a refusal the cluster decides
  (quota, admission, RBAC), after a doubling backoff;
- events of the children we own (server-side label selectors: only ours are streamed) and of the
  worker pods go to the reconciler, the resource's events to the autoscaler (`track`);
- create, update (of the spec) and resume of an InferenceEndpoint apply its shared router, and
  every InferenceDeployment event tells the endpoint reconciler, which syncs an endpoint only when
  that resource's part in it changed (reconcile/endpoint_sync.py);
- startup and cleanup start and stop the resync task and the pod cache, which run while kopf
  runs: on the leader only.

No kopf timer or daemon: kopf puts a finalizer on every resource that has one. kopf keeps its
bookkeeping in status.kopf, never in metadata, so GitOps tools that own the resource see no drift.
Handler ids are given explicitly: kopf persists a change handler's progress under its id.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
from kubernetes.client.rest import ApiException

from kvscale.operator.adapters.sync import AdapterSync
from kvscale.operator.api.endpoint import ENDPOINT_PLURAL
from kvscale.operator.api.groupversion import GROUP, PLURAL, VERSION
from kvscale.operator.api.labels import CHILD_SELECTOR
from kvscale.operator.autoscaler.scaler import Scaler
from kvscale.operator.kube.client import CHILD_RESOURCES, POD_RESOURCE
from kvscale.operator.kube.errors import NETWORK_ERRORS, api_message
from kvscale.operator.reconcile.endpoint_sync import EndpointReconciler
from kvscale.operator.reconcile.heal import backoff_s
from kvscale.operator.reconcile.reconciler import Reconciler


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


class Handlers:
    """kopf's side of the reconciler and the autoscaler: one method per handler."""

    def __init__(
        self,
        reconciler: Reconciler,
        scaler: Scaler,
        adapters: AdapterSync | None = None,
        endpoints: EndpointReconciler | None = None,
    ) -> None:
        self.reconciler = reconciler
        self.scaler = scaler
        self.adapters = adapters
        self.endpoints = endpoints
        self._resync: asyncio.Task | None = None

    def register(self, registry: kopf.OperatorRegistry) -> kopf.OperatorRegistry:
        """Every handler on `registry` (ids: the methods' names); returns it."""
        on = kopf.on
        on.startup(registry=registry, id="configure")(configure)
        for when in (on.resume, on.create):
            when(GROUP, VERSION, PLURAL, registry=registry, id="reconcile")(self.reconcile)
        on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry, id="reconcile")(self.reconcile)
        for kind, handler in self.child_handlers().items():
            on.event(*CHILD_RESOURCES[kind], registry=registry, id=handler.__name__)(handler)
        on.event(*POD_RESOURCE, registry=registry, id="pod_changed")(self.pod_changed)
        on.event(GROUP, VERSION, PLURAL, registry=registry, id="track")(self.track)
        if self.endpoints is not None:
            for when in (on.resume, on.create):
                when(GROUP, VERSION, ENDPOINT_PLURAL, registry=registry, id="endpoint")(self.endpoint)
            on.update(GROUP, VERSION, ENDPOINT_PLURAL, field="spec", registry=registry, id="endpoint")(
                self.endpoint
            )
            on.event(GROUP, VERSION, PLURAL, registry=registry, id="member_changed")(self.member_changed)
        for handler in (self.start_resync, self.start_pod_cache):
            on.startup(registry=registry, id=handler.__name__)(handler)
        for handler in (self.stop_resync, self.stop_pod_cache):
            on.cleanup(registry=registry, id=handler.__name__)(handler)
        return registry

    def child_handlers(self) -> dict[str, Any]:
        """The watch of each kind of child we own."""
        return {
            "Deployment": self.deployment_changed,
            "Service": self.service_changed,
            "PodDisruptionBudget": self.pdb_changed,
            "ServiceAccount": self.service_account_changed,
            "Role": self.role_changed,
            "RoleBinding": self.role_binding_changed,
            "NetworkPolicy": self.network_policy_changed,
        }

    def reconcile(self, meta: kopf.Meta, retry: int, **_: Any) -> None:
        """Create, resume, or a spec change: apply every child."""
        namespace, name = meta["namespace"], meta["name"]
        try:
            error = self.reconciler.sync(namespace, name, apply_all=True)
        except (ApiException, *NETWORK_ERRORS) as e:
            raise kopf.TemporaryError(f"syncing failed: {api_message(e)}", delay=backoff_s(retry + 1)) from e
        if error is not None:
            raise kopf.TemporaryError(error[1], delay=backoff_s(retry + 1))
        self.reconciler.retries.succeeded((namespace, name))

    def endpoint(self, meta: kopf.Meta, retry: int, **_: Any) -> None:
        """An InferenceEndpoint's create, resume, or spec change: apply its shared router."""
        assert self.endpoints is not None
        try:
            self.endpoints.sync(meta["namespace"], meta["name"])
        except (ApiException, *NETWORK_ERRORS) as e:
            raise kopf.TemporaryError(f"syncing failed: {api_message(e)}", delay=backoff_s(retry + 1)) from e

    def member_changed(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        """An InferenceDeployment event: the endpoints it joins or leaves are synced (a failure is
        logged; the next event of a member or of the endpoint tries again)."""
        assert self.endpoints is not None
        try:
            self.endpoints.member_changed(dict(body), type)
        except (ApiException, *NETWORK_ERRORS) as e:
            logging.getLogger(__name__).warning("syncing an endpoint failed: %s", api_message(e))

    def deployment_changed(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        """The workers changed (a pod became ready, a rollout advanced, someone edited or deleted
        the Deployment), or the router's Deployment did."""
        self.reconciler.child_changed("Deployment", dict(body), type)

    def service_changed(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        self.reconciler.child_changed("Service", dict(body), type)

    def pdb_changed(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        self.reconciler.child_changed("PodDisruptionBudget", dict(body), type)

    def service_account_changed(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        self.reconciler.child_changed("ServiceAccount", dict(body), type)

    def role_changed(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        self.reconciler.child_changed("Role", dict(body), type)

    def role_binding_changed(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        self.reconciler.child_changed("RoleBinding", dict(body), type)

    def network_policy_changed(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        self.reconciler.child_changed("NetworkPolicy", dict(body), type)

    def pod_changed(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        self.reconciler.pod_changed(dict(body), type)

    async def track(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        """Start, update or stop the resource's autoscaler task and its adapter sync."""
        await self.scaler.track(dict(body), type)
        if self.adapters is not None:
            await self.adapters.track(dict(body), type)

    async def start_resync(self, **_: Any) -> None:
        """The resync and the retries run in kopf's loop, so only while kopf runs: on the leader."""
        self._resync = asyncio.create_task(self.reconciler.resync_forever(), name="resync")

    async def stop_resync(self, **_: Any) -> None:
        if self._resync is not None:
            self._resync.cancel()

    def start_pod_cache(self, **_: Any) -> None:
        """The pod cache is fed while kopf runs: on the leader only (main._lead)."""
        self.scaler.start()

    def stop_pod_cache(self, **_: Any) -> None:
        self.scaler.stop()
