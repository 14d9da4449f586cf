"""Optional APIs served by CRDs other projects install (the InferencePool, the LeaderWorkerSet):
whether the cluster serves one (discovery), and its calls shaped as the typed clients' methods.

The handlers ask discovery from the resync task only (never in a sync) and apply such a child
only while its API is served; none is watched through kopf, whose watch would fail wherever the
CRD is absent: the resync heals them (docs/operator.md).
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException


def served(custom: client.CustomObjectsApi, group: str, version: str, plural: str, timeout_s: float) -> bool:
    """Whether the API server serves `plural` in group/version (the group version's discovery
    document: a non-resource URL every authenticated user may read)."""
    try:
        response = custom.get_api_resources(
            group, version, _preload_content=False, _request_timeout=timeout_s
        )
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    body = json.loads(response.data or b"{}")
    return any(r.get("name") == plural for r in body.get("resources") or [])


def ops(api: client.ApiClient, group: str, version: str, plural: str):
    """(read, server-side apply, list in all namespaces, list in one, delete), shaped as the typed
    clients' methods are (name, namespace, ...), for Kube.ops."""
    custom = client.CustomObjectsApi(api)

    def read(name: str, namespace: str, **kw: Any):
        return custom.get_namespaced_custom_object(group, version, namespace, plural, name, **kw)

    def apply(name: str, namespace: str, body: dict, **kw: Any):
        return custom.patch_namespaced_custom_object(group, version, namespace, plural, name, body, **kw)

    def list_all(**kw: Any):
        return custom.list_cluster_custom_object(group, version, plural, **kw)

    def list_in(namespace: str, **kw: Any):
        return custom.list_namespaced_custom_object(group, version, namespace, plural, **kw)

    def delete(name: str, namespace: str, **kw: Any):
        return custom.delete_namespaced_custom_object(group, version, namespace, plural, name, **kw)

    return read, apply, list_all, list_in, delete
