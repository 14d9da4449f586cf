"""LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, kubernetes-sigs/lws): the workers of a
multi-node model. Whether the cluster serves it (discovery), its API calls for the handlers and
the autoscaler, and its status read as the Deployment's fields the status code knows.

Optional like the InferencePool: a resource that needs it where it is not served is refused with
one condition (handlers.LWS_UNAVAILABLE) and nothing is applied for it.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client

from kvscale.operator.kube import custom_api

GROUP, VERSION, PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"


def served(custom: client.CustomObjectsApi, timeout_s: float) -> bool:
    return custom_api.served(custom, GROUP, VERSION, PLURAL, timeout_s)


def ops(api: client.ApiClient):
    return custom_api.ops(api, GROUP, VERSION, PLURAL)


def as_deployment(lws: dict[str, Any] | None) -> dict[str, Any] | None:
    """A LeaderWorkerSet as the Deployment fields status.compute_status reads, counted in
    groups: LWS's status counts groups (replicas, readyReplicas: groups whose every pod is
    ready, updatedReplicas) and has no observedGeneration, so a status the controller wrote is
    taken as current; its Available condition has no Deployment counterpart and is not read."""
    if lws is None:
        return None
    meta, spec, status = lws.get("metadata") or {}, lws.get("spec") or {}, lws.get("status") or {}
    return {
        "metadata": {"generation": meta.get("generation", 0)},
        "spec": {"replicas": spec.get("replicas", 1)},
        "status": {
            "observedGeneration": meta.get("generation", 0),
            "replicas": status.get("replicas", 0),
            "readyReplicas": status.get("readyReplicas", 0),
            "updatedReplicas": status.get("updatedReplicas", 0),
        },
    }


def read_scale(api: client.ApiClient, name: str, namespace: str, timeout_s: float) -> int:
    """The groups wanted: the LeaderWorkerSet's spec.replicas through its scale subresource."""
    scale = client.CustomObjectsApi(api).get_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, PLURAL, name, _request_timeout=timeout_s
    )
    return int((scale.get("spec") or {}).get("replicas", 1))


def write_scale(api: client.ApiClient, name: str, namespace: str, replicas: int, manager: str) -> None:
    client.CustomObjectsApi(api).patch_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, PLURAL, name, {"spec": {"replicas": replicas}}, field_manager=manager
    )
