"""The Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1): whether
the cluster serves it (discovery), and its API calls for the handlers.

The resource is optional: most clusters do not install its CRD. The resync task asks discovery
every DISCOVERY_S (never a sync: a sync must not pay a request to learn what rarely changes) and
the handlers apply a pool per InferenceDeployment only while it is served. Not watched through
kopf: its watch would fail wherever the CRD is absent; the resync heals a pool (docs/operator.md).
"""

from __future__ import annotations

from kubernetes import client

from kvscale.operator.kube import custom_api

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


def served(custom: client.CustomObjectsApi, timeout_s: float) -> bool:
    return custom_api.served(custom, GROUP, VERSION, PLURAL, timeout_s)


def ops(api: client.ApiClient):
    return custom_api.ops(api, GROUP, VERSION, PLURAL)
