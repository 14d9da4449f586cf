"""The Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1): whether
the cluster serves it (discovery), and its API calls for the handlers.

The resource is optional: most clusters do not install its CRD. The resync task asks discovery
every DISCOVERY_S (never a sync: a sync must not pay a request to learn what rarely changes) and
the handlers apply a pool per InferenceDeployment only while it is served. Not watched through
kopf: its watch would fail wherever the CRD is absent; the resync heals a pool (docs/operator.md).
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


def served(custom: client.CustomObjectsApi, timeout_s: float) -> bool:
    """Whether the API server serves inferencepools in inference.networking.k8s.io/v1 (the group
    version's discovery document: a non-resource URL every authenticated user may read)."""
    try:
        response = custom.get_api_resources(
            GROUP, VERSION, _preload_content=False, _request_timeout=timeout_s
        )
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    body = json.loads(response.data or b"{}")
    return any(r.get("name") == PLURAL for r in body.get("resources") or [])


def ops(api: client.ApiClient):
    """(read, server-side apply, list in all namespaces, list in one, delete), shaped as the typed
    clients' methods are (name, namespace, ...), for handlers._ops."""
    custom = client.CustomObjectsApi(api)

    def read(name: str, namespace: str, **kw: Any):
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, **kw)

    def apply(name: str, namespace: str, body: dict, **kw: Any):
        return custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body, **kw)

    def list_all(**kw: Any):
        return custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, **kw)

    def list_in(namespace: str, **kw: Any):
        return custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, **kw)

    def delete(name: str, namespace: str, **kw: Any):
        return custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, **kw)

    return read, apply, list_all, list_in, delete
