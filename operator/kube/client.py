"""The operator's Kubernetes client: the calls the reconciler and the autoscaler make, per kind of
child, on one ApiClient (fenced by leader.fence_api_client in `kvscale-operator run`), every call
with a timeout so that a hung API server never holds a sync, and its lock, forever.

Reads and lists of children come back as the API server's JSON (dicts, as kopf's events carry
them), not the typed client's models: what a watch showed and what a read shows compare as they
are (heal.child_drift).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any, NamedTuple

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kvscale.operator import metrics
from kvscale.operator.api.endpoint import ENDPOINT_KIND, ENDPOINT_PLURAL
from kvscale.operator.api.groupversion import GROUP, KIND, PLURAL, VERSION
from kvscale.operator.api.labels import CHILD_SELECTOR, MANAGER
from kvscale.operator.api.status import status_apply
from kvscale.operator.kube import inferencepool, leaderworkerset
from kvscale.operator.kube.errors import NETWORK_ERRORS, api_message

logger = logging.getLogger(__name__)

APPLY = "application/apply-patch+yaml"
API_TIMEOUT_S = 30  # on every call: a hung API server never holds a sync (and its lock) forever
# The API resource of each kind of child (what kopf watches, with a server-side selector).
CHILD_RESOURCES = {
    "Deployment": ("apps", "v1", "deployments"),
    "Service": ("v1", "services"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io", "v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
}
POD_RESOURCE = ("v1", "pods")  # the workers carry the same labels
LISTED_KINDS = tuple(CHILD_RESOURCES)  # and the optional APIs' kinds, while served
# The children of optional APIs (other projects' CRDs), by whether each is served now.
OPTIONAL_KINDS = ("InferencePool", "LeaderWorkerSet")


class Ops(NamedTuple):
    """One kind's calls, shaped as the typed clients' methods (name, namespace, ...)."""

    read: Any
    apply: Any
    list_all: Any
    list_in: Any
    delete: Any


def load_api_client() -> client.ApiClient:
    """In-cluster credentials, else KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json(response) -> dict[str, Any]:
    return json.loads(response.data)


class Kube:
    """The Kubernetes API as the reconciler and the autoscaler use it. `namespaces`: the watched
    namespaces (Settings.watch_namespaces); lists go to these only, or across all when empty."""

    def __init__(self, api: client.ApiClient, namespaces: tuple[str, ...] = ()) -> None:
        self.api = api
        self.namespaces = namespaces

    def ops(self, kind: str) -> Ops:
        if kind == "InferencePool":
            return Ops(*inferencepool.ops(self.api))
        if kind == "LeaderWorkerSet":
            return Ops(*leaderworkerset.ops(self.api))
        if kind == "Deployment":
            apps = client.AppsV1Api(self.api)
            return Ops(
                apps.read_namespaced_deployment,
                apps.patch_namespaced_deployment,
                apps.list_deployment_for_all_namespaces,
                apps.list_namespaced_deployment,
                apps.delete_namespaced_deployment,
            )
        if kind == "Service":
            core = client.CoreV1Api(self.api)
            return Ops(
                core.read_namespaced_service,
                core.patch_namespaced_service,
                core.list_service_for_all_namespaces,
                core.list_namespaced_service,
                core.delete_namespaced_service,
            )
        if kind == "PodDisruptionBudget":
            policy = client.PolicyV1Api(self.api)
            return Ops(
                policy.read_namespaced_pod_disruption_budget,
                policy.patch_namespaced_pod_disruption_budget,
                policy.list_pod_disruption_budget_for_all_namespaces,
                policy.list_namespaced_pod_disruption_budget,
                policy.delete_namespaced_pod_disruption_budget,
            )
        if kind == "ServiceAccount":
            core = client.CoreV1Api(self.api)
            return Ops(
                core.read_namespaced_service_account,
                core.patch_namespaced_service_account,
                core.list_service_account_for_all_namespaces,
                core.list_namespaced_service_account,
                core.delete_namespaced_service_account,
            )
        if kind == "Role":
            rbac = client.RbacAuthorizationV1Api(self.api)
            return Ops(
                rbac.read_namespaced_role,
                rbac.patch_namespaced_role,
                rbac.list_role_for_all_namespaces,
                rbac.list_namespaced_role,
                rbac.delete_namespaced_role,
            )
        if kind == "RoleBinding":
            rbac = client.RbacAuthorizationV1Api(self.api)
            return Ops(
                rbac.read_namespaced_role_binding,
                rbac.patch_namespaced_role_binding,
                rbac.list_role_binding_for_all_namespaces,
                rbac.list_namespaced_role_binding,
                rbac.delete_namespaced_role_binding,
            )
        if kind == "NetworkPolicy":
            networking = client.NetworkingV1Api(self.api)
            return Ops(
                networking.read_namespaced_network_policy,
                networking.patch_namespaced_network_policy,
                networking.list_network_policy_for_all_namespaces,
                networking.list_namespaced_network_policy,
                networking.delete_namespaced_network_policy,
            )
        raise KeyError(kind)

    # -- children ---------------------------------------------------------------------------
    def read(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            response = self.ops(kind).read(
                name, namespace, _preload_content=False, _request_timeout=API_TIMEOUT_S
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return _json(response)

    def delete(self, kind: str, name: str, namespace: str) -> None:
        """Delete a child we no longer render (the router, switched off); gone already is fine."""
        try:
            self.ops(kind).delete(name, namespace, _request_timeout=API_TIMEOUT_S)
        except ApiException as e:
            if e.status != 404:
                raise

    def apply(self, obj: dict[str, Any], manager: str = MANAGER) -> dict[str, Any]:
        """Server-side apply of `obj` under `manager`, forced (our own fields)."""
        meta = obj["metadata"]
        response = self.ops(obj["kind"]).apply(
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

    def list_children(self, kind: str) -> list[dict[str, Any]]:
        """Our children of `kind` in the watched namespaces (a list's items carry no apiVersion or
        kind)."""
        ops = self.ops(kind)
        query = {
            "label_selector": CHILD_SELECTOR,
            "_preload_content": False,
            "_request_timeout": API_TIMEOUT_S,
        }
        if not self.namespaces:
            return _json(ops.list_all(**query))["items"]
        return [
            item for namespace in self.namespaces for item in _json(ops.list_in(namespace, **query))["items"]
        ]

    def served(self, kind: str) -> bool:
        """Whether the optional API of `kind` (OPTIONAL_KINDS) is served: asked of discovery."""
        custom = client.CustomObjectsApi(self.api)
        module = inferencepool if kind == "InferencePool" else leaderworkerset
        return module.served(custom, API_TIMEOUT_S)

    # -- the InferenceDeployments -----------------------------------------------------------
    def get_resource(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_ours(PLURAL, namespace, name)

    def _get_ours(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One of our resources (kvscale.dev), None when it is gone."""
        try:
            return client.CustomObjectsApi(self.api).get_namespaced_custom_object(
                GROUP, VERSION, namespace, plural, name, _request_timeout=API_TIMEOUT_S
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list_resources(self) -> list[dict[str, Any]]:
        """Every resource in the watched namespaces (all of them: one cluster-wide LIST)."""
        custom = client.CustomObjectsApi(self.api)
        if not self.namespaces:
            return custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, _request_timeout=API_TIMEOUT_S)[
                "items"
            ]
        return [
            item
            for namespace in self.namespaces
            for item in custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, _request_timeout=API_TIMEOUT_S
            )["items"]
        ]

    def list_resources_in(self, namespace: str) -> list[dict[str, Any]]:
        """The InferenceDeployments of one namespace (an endpoint's members are its neighbours)."""
        return client.CustomObjectsApi(self.api).list_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, _request_timeout=API_TIMEOUT_S
        )["items"]

    # -- the InferenceEndpoints -------------------------------------------------------------
    def get_endpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_ours(ENDPOINT_PLURAL, namespace, name)

    def apply_endpoint_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Server-side apply of the endpoint's status (the operator is its only writer)."""
        metrics.STATUS_WRITES.labels(MANAGER).inc()
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": ENDPOINT_KIND,
            "metadata": {"name": name, "namespace": namespace},
            "status": status,
        }
        client.CustomObjectsApi(self.api).patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            ENDPOINT_PLURAL,
            name,
            body,
            field_manager=MANAGER,
            force=True,
            _content_type=APPLY,
            _request_timeout=API_TIMEOUT_S,
        )

    def apply_status(self, namespace: str, name: str, status: dict[str, Any], manager: str) -> None:
        """Server-side apply of `manager`'s own status fields (api/status.status_apply checks which)."""
        metrics.STATUS_WRITES.labels(manager).inc()
        client.CustomObjectsApi(self.api).patch_namespaced_custom_object_status(
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

    def post_event(
        self, cr: dict[str, Any], reason: str, message: str, *, warning: bool = False, kind: str = KIND
    ) -> None:
        """A core/v1 Event on the resource. Our own poster rather than kopf.info: kopf's works only
        inside its handlers, and the resync task is not one. Best effort: a lost event is logged."""
        meta = cr["metadata"]
        stamp = now()
        event = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": kind,
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
            client.CoreV1Api(self.api).create_namespaced_event(
                meta["namespace"], event, _request_timeout=API_TIMEOUT_S
            )
        except (ApiException, *NETWORK_ERRORS) as e:
            logger.warning("could not post the event %s on %s: %s", reason, meta["name"], api_message(e))
