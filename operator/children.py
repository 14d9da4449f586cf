"""Pure functions: an InferenceDeployment spec -> the manifests of its children.

Deployment (the worker pods), Service (their OpenAI endpoint) and PodDisruptionBudget, each owned
by the resource (garbage-collected with it) and labelled for selection and for our event handler.
No I/O here: the handlers apply what these return.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvscale.operator.models import GROUP, KIND, VERSION, InferenceDeploymentSpec

MANAGER = "kvscale-operator"  # our field manager and the managed-by label
AUTOSCALER_MANAGER = "kvscale-autoscaler"  # the autoscaler's, for the Deployment's replicas
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_OWNER = f"{GROUP}/inference-deployment"
WORKER = "kvscale-worker"
PORT = 8000
PRESTOP_SECONDS = 5  # endpoints stop routing to a terminating pod before it drains
MODELS_ROOT = "/models"


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str


def selector_labels(name: str) -> dict[str, str]:
    return {LABEL_NAME: WORKER, LABEL_OWNER: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def labels(name: str) -> dict[str, str]:
    return {**selector_labels(name), LABEL_INSTANCE: name, LABEL_MANAGED_BY: MANAGER}


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(owner: Owner) -> dict[str, Any]:
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": labels(owner.name),
        "ownerReferences": [owner_reference(owner)],
    }


def resolve_model(uri: str) -> tuple[str, dict | None, dict | None]:
    """(path inside the container, volume, volume mount) for a model URI; a PVC is mounted
    read-only at /models/CLAIM, under a volume name of its own (so two URIs on one claim share it)."""
    if not uri.startswith("pvc://"):
        return uri.removeprefix("file://"), None, None
    claim, _, sub = uri.removeprefix("pvc://").partition("/")
    name, mount = f"pvc-{claim}"[:63], f"{MODELS_ROOT}/{claim}"
    volume = {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return f"{mount}/{sub}".rstrip("/"), volume, {"name": name, "mountPath": mount, "readOnly": True}


def worker_args(
    name: str, spec: InferenceDeploymentSpec, model_path: str, draft_path: str | None
) -> list[str]:
    e = spec.engine
    args = [
        "serve",
        "--model", model_path,
        "--served-model-name", spec.model.served_name or name,
        "--port", str(PORT),
        "--block-size", str(e.block_size),
        "--max-num-seqs", str(e.max_num_seqs),
        "--max-num-batched-tokens", str(e.max_num_batched_tokens),
        "--dtype", e.dtype,
        "--drain-timeout", str(spec.server.drain_timeout_seconds),
        "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    if e.kv_cache_memory_fraction is not None:
        args += ["--kv-cache-memory-fraction", str(e.kv_cache_memory_fraction)]
    if spec.speculative is not None:
        s = spec.speculative
        args += ["--speculative-method", s.method, "--num-speculative-tokens", str(s.num_speculative_tokens)]
        if draft_path is not None:
            args += ["--draft-model", draft_path]
    return args + list(e.extra_args)


def _env(spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    # A read-only root filesystem: every cache goes to the /tmp emptyDir; no hub downloads.
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
    ]
    if spec.server.api_key_secret:
        ref = {"name": spec.server.api_key_secret, "key": "api-key"}
        env.append({"name": "KVSCALE_API_KEY", "valueFrom": {"secretKeyRef": ref}})
    for var in spec.env:
        if var.value is not None:
            env.append({"name": var.name, "value": var.value})
        else:
            assert var.value_from is not None
            src = var.value_from
            ref_kind, ref = (
                ("secretKeyRef", src.secret_key_ref)
                if src.secret_key_ref
                else ("configMapKeyRef", src.config_map_key_ref)
            )
            env.append({"name": var.name, "valueFrom": {ref_kind: {"name": ref.name, "key": ref.key}}})
    return env


def pod_template(owner: Owner, spec: InferenceDeploymentSpec, image: str) -> dict[str, Any]:
    volumes: dict[str, dict] = {"tmp": {"name": "tmp", "emptyDir": {}}}
    mounts: dict[str, dict] = {"tmp": {"name": "tmp", "mountPath": "/tmp"}}
    uris = [spec.model.uri]
    if spec.speculative is not None and spec.speculative.draft_model_uri:
        uris.append(spec.speculative.draft_model_uri)
    paths = []
    for uri in uris:
        path, volume, mount = resolve_model(uri)
        paths.append(path)
        if volume is not None and mount is not None:
            volumes[volume["name"]], mounts[mount["name"]] = volume, mount
    model_path, draft_path = paths[0], (paths[1] if len(paths) > 1 else None)
    resources: dict[str, Any] = {
        "requests": {"cpu": spec.resources.cpu, "memory": spec.resources.memory},
        "limits": {"cpu": spec.resources.cpu, "memory": spec.resources.memory},
    }
    if spec.resources.gpus:
        resources["requests"]["nvidia.com/gpu"] = resources["limits"]["nvidia.com/gpu"] = str(
            spec.resources.gpus
        )
        volumes["dshm"] = {"name": "dshm", "emptyDir": {"medium": "Memory"}}  # torch's shared memory
        mounts["dshm"] = {"name": "dshm", "mountPath": "/dev/shm"}
    http = {"path": "/ready", "port": "http"}
    container = {
        "name": "worker",
        "image": image,
        "command": ["kvscale-worker"],
        "args": worker_args(owner.name, spec, model_path, draft_path),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": resources,
        "volumeMounts": list(mounts.values()),
        # Loading a model takes minutes: the startup probe holds liveness off until /ready says so.
        "startupProbe": {
            "httpGet": http,
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": math.ceil(spec.server.startup_timeout_seconds / 5),
        },
        "readinessProbe": {"httpGet": http, "periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        # Give the Service time to stop routing here, then SIGTERM starts the worker's drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": list(volumes.values()),
        # Longer than preStop + drain, so the kubelet never kills a worker that is still draining.
        "terminationGracePeriodSeconds": PRESTOP_SECONDS + spec.server.drain_timeout_seconds + 10,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # workers never talk to the API server
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    return {
        "metadata": {
            "labels": labels(owner.name),
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }


def deployment(owner: Owner, spec: InferenceDeploymentSpec, image: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            # Never below the wanted capacity during a rollout: add one, then remove one.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": spec.server.startup_timeout_seconds + 60,
            "revisionHistoryLimit": 3,
            "template": pod_template(owner, spec, image),
        },
    }
    # With autoscaling the field stays out of our apply, so the autoscaler owns it alone and
    # neither we nor a GitOps tool ever fight over it.
    if spec.desired_replicas is not None:
        body["spec"]["replicas"] = spec.desired_replicas
    return body


def replicas_handover(live: dict[str, Any]) -> dict[str, Any] | None:
    """What the autoscaler's field manager must apply before our apply drops `spec.replicas`.

    Switching a resource from `replicas` to `autoscaling` takes the field out of our apply. If we
    are its only owner, the API server then removes it and the Deployment falls back to its
    default, 1 replica, until the autoscaler scales it again. Applying the live value under the
    autoscaler's manager first makes the field co-owned (the same value never conflicts), so our
    apply only gives up our share and the count stays (Kubernetes' documented hand-over to an
    HPA). None when there is nothing to hand over.
    """
    replicas = (live.get("spec") or {}).get("replicas")
    ours = any(
        entry.get("manager") == MANAGER
        and entry.get("operation") == "Apply"
        and "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {})
        for entry in (live.get("metadata") or {}).get("managedFields") or []
    )
    if replicas is None or not ours:
        return None
    meta = live["metadata"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": {"replicas": replicas},
    }


def service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner.name),
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(owner: Owner) -> dict[str, Any]:
    # Voluntary disruptions (drains, upgrades) take one worker at a time.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner.name)}},
    }


def children(owner: Owner, spec: InferenceDeploymentSpec, image: str) -> list[dict[str, Any]]:
    return [deployment(owner, spec, image), service(owner), pod_disruption_budget(owner)]
