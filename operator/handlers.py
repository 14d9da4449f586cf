"""kopf handlers: the only place the operator does I/O.

An InferenceDeployment's spec is applied to its children with server-side apply under our own
field manager (created, updated or left alone by the API server: an unchanged apply writes
nothing), and its status follows the worker Deployment. kopf keeps its bookkeeping in
status.kopf, never in metadata, so GitOps tools that own the resource see no drift.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from functools import cache
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from kvscale.operator.children import (
    AUTOSCALER_MANAGER,
    LABEL_MANAGED_BY,
    LABEL_OWNER,
    MANAGER,
    Owner,
    children,
    replicas_handover,
    selector_string,
)
from kvscale.operator.models import GROUP, PLURAL, VERSION, InferenceDeploymentSpec
from kvscale.operator.status import compute_status

DEFAULT_WORKER_IMAGE = "ghcr.io/kvscale/kvscale-worker:0.1.0"
APPLY = "application/apply-patch+yaml"


def worker_image() -> str:
    return os.environ.get("KVSCALE_WORKER_IMAGE", DEFAULT_WORKER_IMAGE)


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


# Per kind: (read, server-side apply) on the typed client, returning plain JSON dicts.
def _ops(kind: str):
    apps, core, policy = client.AppsV1Api(api()), client.CoreV1Api(api()), client.PolicyV1Api(api())
    return {
        "Deployment": (apps.read_namespaced_deployment, apps.patch_namespaced_deployment),
        "Service": (core.read_namespaced_service, core.patch_namespaced_service),
        "PodDisruptionBudget": (
            policy.read_namespaced_pod_disruption_budget,
            policy.patch_namespaced_pod_disruption_budget,
        ),
    }[kind]


def read(kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    try:
        return _json(_ops(kind)[0](name, namespace, _preload_content=False))
    except ApiException as e:
        if e.status == 404:
            return None
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
    )
    return _json(response)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Bookkeeping in status only: metadata stays exactly what the user (or Argo CD, Flux) applied.
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(field="status.kopf.diffbase")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(body: kopf.Body, meta: kopf.Meta, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation", 0)
    previous = list((body.get("status") or {}).get("conditions") or [])
    try:
        spec = InferenceDeploymentSpec.model_validate(dict(body["spec"]))
    except ValidationError as e:  # the schema admits it, the models do not (e.g. an older CRD)
        message = f"invalid spec: {e.errors()[0]['msg']} at {'.'.join(map(str, e.errors()[0]['loc']))}"
        kopf.warn(body, reason="InvalidSpec", message=message)
        patch.status["conditions"] = [
            {
                "type": "Degraded",
                "status": "True",
                "reason": "InvalidSpec",
                "message": message,
                "lastTransitionTime": now(),
            }
        ]
        return
    owner = Owner(name, namespace, meta["uid"])
    error = None
    for child in children(owner, spec, spec.image or worker_image()):
        kind = child["kind"]
        before = read(kind, name, namespace)
        try:
            if kind == "Deployment" and before is not None and "replicas" not in child["spec"]:
                handover = replicas_handover(before)
                if handover is not None:  # switching to autoscaling: keep today's count
                    server_side_apply(handover, manager=AUTOSCALER_MANAGER)
            after = server_side_apply(child)
        except ApiException as e:
            error = f"applying the {kind} failed: {e.status} {e.reason}"
            kopf.exception(body, reason="ApplyFailed", message=error)
            break
        if before is None:
            kopf.info(body, reason="Created", message=f"created {kind} {name} for generation {generation}")
        elif before["metadata"]["resourceVersion"] != after["metadata"]["resourceVersion"]:
            kopf.info(body, reason="Updated", message=f"updated {kind} {name} to generation {generation}")
    status = compute_status(
        name=name,
        generation=generation,
        selector=selector_string(name),
        desired=spec.desired_replicas,
        deployment=read("Deployment", name, namespace),
        previous_conditions=previous,
        now=now(),
        apply_error=error,
    )
    _announce_transitions(body, previous, status["conditions"])
    patch.status.update(status)
    if spec.autoscaling is None:  # the autoscaler's signals would be stale: no longer reported
        patch.status["autoscaling"] = None
        patch.status["kvCacheUsage"] = None
    if error:
        raise kopf.TemporaryError(error, delay=15)


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: MANAGER, LABEL_OWNER: kopf.PRESENT})
def deployment_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    """The workers changed (a pod became ready, a rollout advanced): refresh the owner's status."""
    name, namespace = body["metadata"]["labels"][LABEL_OWNER], body["metadata"]["namespace"]
    custom = client.CustomObjectsApi(api())
    try:
        owner = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as e:
        if e.status == 404:
            return  # being deleted with its children
        raise
    try:
        spec = InferenceDeploymentSpec.model_validate(owner["spec"])
    except ValidationError:
        return  # reconcile reports that
    previous_status = owner.get("status") or {}
    previous = list(previous_status.get("conditions") or [])
    status = compute_status(
        name=name,
        generation=owner["metadata"].get("generation", 0),
        selector=selector_string(name),
        desired=spec.desired_replicas,
        deployment=None if type == "DELETED" else dict(body),
        previous_conditions=previous,
        now=now(),
    )
    # Keep an apply failure reported by reconcile until reconcile itself clears it.
    degraded = next((c for c in previous if c["type"] == "Degraded"), None)
    if degraded and degraded.get("reason") == "ApplyFailed":
        status["conditions"] = [degraded if c["type"] == "Degraded" else c for c in status["conditions"]]
    if all(previous_status.get(k) == v for k, v in status.items()):
        return  # nothing new: no write
    _announce_transitions(owner, previous, status["conditions"])
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": status})


def _announce_transitions(body: Any, previous: list[dict], current: list[dict]) -> None:
    """An event on the resource whenever Ready or Degraded changes, with why."""
    before = {c["type"]: c.get("status") for c in previous}
    for c in current:
        if c["type"] in ("Ready", "Degraded") and before.get(c["type"]) != c["status"]:
            post = kopf.warn if (c["type"] == "Degraded") == (c["status"] == "True") else kopf.info
            post(body, reason=f"{c['type']}{c['status']}", message=f"{c['reason']}: {c['message']}")
