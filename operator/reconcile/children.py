"""Pure functions: an InferenceDeployment spec -> the manifests of its children.

Deployment (the worker pods; a LeaderWorkerSet of pod groups for a multi-node model), Service
(their OpenAI endpoint) and PodDisruptionBudget, and with
`spec.router.enabled` (the default) the router: its Deployment and Service (NAME-router) and its
ServiceAccount, Role and RoleBinding. Each is owned by the resource (garbage-collected with it)
and labelled for selection and for our watches (api/labels.py). No I/O here: the reconciler
applies what these return.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from urllib.parse import quote

from kubernetes.utils import parse_quantity

from kvscale.operator.api.groupversion import GROUP, KIND, VERSION
from kvscale.operator.api.labels import (
    LABEL_COMPONENT,
    LABEL_ENDPOINT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_OWNER,
    MANAGER,
    ROUTER,
    WORKER,
)
from kvscale.operator.api.model import is_hf
from kvscale.operator.api.pod import RESERVED_LABELS, RESERVED_PREFIX
from kvscale.operator.api.routing import RouterSettings
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.api.validation import DNS_LABEL, QUANTITY, search
from kvscale.operator.reconcile.admin_policy import AdminPolicy, NetworkPolicySettings, PodSecurity

PORT = 8000
PRESTOP_SECONDS = 5  # endpoints stop routing to a terminating pod before it drains
STARTUP_PROBE_PERIOD_S = 1
MODELS_ROOT = "/models"
HF_VOLUME = "hf-models"  # the hf:// downloads: an emptyDir, or model.cacheClaim
HF_ROOT = f"{MODELS_ROOT}/hf"
DOWNLOAD_SUFFIX = "model-download"  # the init containers: model-download, draft-model-download
# spec.compileCache: mounted here; the worker's compiled forward in compiled/ (KVSCALE_COMPILE_CACHE),
# Triton's kernels in triton/ (TRITON_CACHE_DIR) unless it is read-only.
COMPILE_CACHE_VOLUME = "compile-cache"
COMPILE_CACHE_ROOT = "/var/cache/kvscale"
MASTER_PORT = 29500  # torch.distributed's rendezvous on the group's leader (rank 0)
LWS_API = "leaderworkerset.x-k8s.io/v1"
# The LeaderWorkerSet controller's pod label: 0 on each group's leader (its node-rank 0).
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
SCRAPE_ANNOTATIONS = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": str(PORT),
    "prometheus.io/path": "/metrics",
}
# The operator's pods (manifests/base/deployment.yaml): they scrape the workers' and routers' metrics.
OPERATOR = "kvscale-operator"
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace
# Every container: no privilege, a read-only root filesystem (caches go to /tmp).
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str


# A child is known by its key: its kind, or for the router's Deployment and Service (whose kinds
# the workers' children share) the kind with a Router prefix.
WORKER_KEYS = ("Deployment", "LeaderWorkerSet", "Service", "PodDisruptionBudget", "InferencePool")
ROUTER_KEYS = (
    "RouterDeployment",
    "RouterService",
    "RouterPodDisruptionBudget",
    "ServiceAccount",
    "Role",
    "RoleBinding",
)
NETWORK_KEYS = ("NetworkPolicy", "RouterNetworkPolicy")  # with the policy's networkPolicy.enabled
CHILD_KEYS = WORKER_KEYS + ROUTER_KEYS + NETWORK_KEYS


def kind_of(key: str) -> str:
    return key.removeprefix("Router")


def child_key(kind: str, obj_labels: dict[str, str] | None) -> str:
    router = (obj_labels or {}).get(LABEL_NAME) == ROUTER and kind in (
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
    )
    return f"Router{kind}" if router else kind


def key_of(obj: dict[str, Any]) -> str:
    return child_key(obj["kind"], obj["metadata"].get("labels"))


def router_name(name: str) -> str:
    """NAME-router, a DNS label (at most 63) for any resource name: a long one is cut and keeps
    a digest, so two resources never share a router."""
    full = f"{name}-router"
    if len(full) <= 63:
        return full
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:45].rstrip('-')}-{digest}-router"


def child_name(key: str, name: str) -> str:
    return name if key in (*WORKER_KEYS, "NetworkPolicy") else router_name(name)


def selector_labels(name: str) -> dict[str, str]:
    return {LABEL_NAME: WORKER, LABEL_OWNER: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def serving_selector(name: str, spec: InferenceDeploymentSpec) -> dict[str, str]:
    """The pods that answer the OpenAI API: every worker, or of a multi-node group its leader
    only (the other ranks serve /health and /ready alone)."""
    if spec.nodes > 1:
        return {**selector_labels(name), LWS_WORKER_INDEX: "0"}
    return selector_labels(name)


def labels(name: str) -> dict[str, str]:
    return {**selector_labels(name), LABEL_INSTANCE: name, LABEL_MANAGED_BY: MANAGER}


def owner_reference(owner: Owner, kind: str = KIND) -> dict[str, Any]:
    """The controller reference to `owner`, an InferenceDeployment (or an InferenceEndpoint)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": kind,
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


def claim_volume_name(claim: str) -> str:
    """A pod volume name (a DNS label, at most 63) for a claim name (a DNS subdomain, up to 253,
    dots allowed): `pvc-CLAIM` where that is one, else a readable prefix and a digest, so two
    claims never share a volume."""
    name = f"pvc-{claim}"
    if len(name) <= 63 and search(DNS_LABEL, name):
        return name
    digest = hashlib.sha256(claim.encode()).hexdigest()[:10]
    readable = re.sub(r"[^a-z0-9-]", "-", claim)[:45].strip("-")
    return f"pvc-{readable}-{digest}" if readable else f"pvc-{digest}"


def resolve_model(uri: str) -> tuple[str, dict | None, dict | None]:
    """(path inside the container, volume, volume mount) for a model URI; a PVC is mounted
    read-only at /models/CLAIM, under a volume name of its own (so two URIs on one claim share it)."""
    if not uri.startswith("pvc://"):
        return uri.removeprefix("file://"), None, None
    claim, _, sub = uri.removeprefix("pvc://").partition("/")
    name, mount = claim_volume_name(claim), f"{MODELS_ROOT}/{claim}"
    volume = {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return f"{mount}/{sub}".rstrip("/"), volume, {"name": name, "mountPath": mount, "readOnly": True}


def hf_model_path(uri: str) -> str:
    """Where the init container puts hf://ORG/NAME[@REVISION] and the worker loads it from: one
    folder per repository and revision, so a shared cache holds several side by side."""
    repo, _, revision = uri.removeprefix("hf://").partition("@")
    return f"{HF_ROOT}/{repo}/{quote(revision or 'main', safe='')}"


def hf_volume(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    m = spec.model
    if m.cache_claim:
        read_only = {"readOnly": True} if m.cache_read_only else {}
        return {"name": HF_VOLUME, "persistentVolumeClaim": {"claimName": m.cache_claim, **read_only}}
    return {"name": HF_VOLUME, "emptyDir": {"sizeLimit": m.cache_size}}


def compile_cache(spec: InferenceDeploymentSpec) -> tuple[dict, dict, list[dict]] | None:
    """(volume, mount, variables) of spec.compileCache, or None."""
    c = spec.compile_cache
    if c is None:
        return None
    read_only = {"readOnly": True} if c.read_only else {}
    volume = {"name": COMPILE_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": c.claim, **read_only}}
    mount = {"name": COMPILE_CACHE_VOLUME, "mountPath": COMPILE_CACHE_ROOT, **read_only}
    env = [{"name": "KVSCALE_COMPILE_CACHE", "value": f"{COMPILE_CACHE_ROOT}/compiled"}]
    if not c.read_only:  # Triton writes its kernels where it caches them
        env.append({"name": "TRITON_CACHE_DIR", "value": f"{COMPILE_CACHE_ROOT}/triton"})
    return volume, mount, env


def _download_env(spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    """The init container's variables: huggingface_hub's own (HF_TOKEN, HF_ENDPOINT), its caches
    in /tmp (the root filesystem is read-only), no telemetry, no progress bars (the downloader
    logs progress lines itself); then the user's (proxies, CA bundles), which win. The worker
    image is offline by default (HF_HUB_OFFLINE=1 in the Dockerfile): the download turns it off."""
    m = spec.model
    ours: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "HF_HUB_OFFLINE", "value": "0"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"},
    ]
    if m.hf_token_secret is not None:
        ref = {"name": m.hf_token_secret.name, "key": m.hf_token_secret.key}
        ours.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    if m.hf_endpoint:
        ours.append({"name": "HF_ENDPOINT", "value": m.hf_endpoint})
    return _merged_env(ours, spec)


def download_container(
    name: str, uri: str, spec: InferenceDeploymentSpec, image: str, resources: dict, security: dict
) -> dict[str, Any]:
    """An init container fetching `uri` (hf://) into the shared volume before the worker starts
    (with model.cacheReadOnly: checking, read-only and offline, that it is there). A failure's
    reason (the downloader writes one line) lands in the pod's status as the container's
    termination message, where the operator reads it into a condition."""
    check = ["--check"] if spec.model.cache_read_only else []
    read_only = {"readOnly": True} if spec.model.cache_read_only else {}
    return {
        "name": name,
        "image": image,
        "command": ["kvscale-worker"],
        "args": ["--log-format", "text", "download", uri, "--dest", hf_model_path(uri), *check],
        "env": _download_env(spec),
        "resources": resources,
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": HF_VOLUME, "mountPath": HF_ROOT, **read_only},
        ],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": security,
    }


# The workers' KV events for the routers' precise index (docs/router.md): every pod on the same
# two ports, dual-stack (the router connects to each pod's address).
KV_EVENTS_PORT, KV_REPLAY_PORT = 5557, 5558
KV_LOAD_TOPIC = "kvscale.load"  # the worker's load on the same stream, for the prefill guard
KV_EVENTS_CONFIG = json.dumps(
    {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}",
        "load_topic": KV_LOAD_TOPIC,
    },
    separators=(",", ":"),
)


def precise_index(spec: InferenceDeploymentSpec) -> bool:
    return spec.router.enabled and spec.router.prefix_index == "precise"


def worker_args(
    name: str,
    spec: InferenceDeploymentSpec,
    model_path: str,
    draft_path: str | None,
    adapters: dict[str, str] | None = None,
    *,
    leader: bool = True,
) -> list[str]:
    """The worker's command line; `leader`: a pod that serves the API (a multi-node group's
    other ranks publish no KV events: only the leader's engine has a block pool)."""
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
    args += parallel_args(spec)
    if precise_index(spec) and leader:
        args += ["--kv-events-config", KV_EVENTS_CONFIG]
    if spec.speculative is not None:
        s = spec.speculative
        args += ["--speculative-method", s.method, "--num-speculative-tokens", str(s.num_speculative_tokens)]
        if draft_path is not None:
            args += ["--draft-model", draft_path]
    return args + lora_args(spec, adapters or {}) + list(e.extra_args)


def adapter_paths(spec: InferenceDeploymentSpec) -> dict[str, str]:
    """name -> the folder the worker reads each adapter from (as pod_template mounts them)."""
    return {a.name: hf_model_path(a.uri) if is_hf(a.uri) else resolve_model(a.uri)[0] for a in spec.adapters}


def adapter_download_name(uri: str) -> str:
    """The init container fetching an hf:// adapter: named by its URI's digest, so the names stay
    put whatever the order of spec.adapters (and a URI two adapters share is fetched once)."""
    return f"adapter-{hashlib.sha256(uri.encode()).hexdigest()[:10]}-download"


def lora_args(spec: InferenceDeploymentSpec, adapters: dict[str, str]) -> list[str]:
    """The worker's LoRA flags; `adapters`: name -> path in the container. Without dynamic loading
    the adapters are `--lora-modules` (a change rolls the pods out); with it the pods load none at
    start and the operator loads each one through the endpoints (operator/adapters/), from under
    the roots named here, which depend on where the adapters live, not on which ones there are."""
    if not adapters and not spec.lora.dynamic_loading:
        return []
    lora = spec.lora
    args = ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_lora_rank)]
    if lora.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    if not lora.dynamic_loading:
        return [*args, "--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    return [*args, "--enable-lora-runtime-updating", "--lora-allowed-roots", *adapter_roots(spec)]


def adapter_roots(spec: InferenceDeploymentSpec) -> list[str]:
    """Where dynamically loaded adapters may be read from: the hf-models volume, each claim's mount,
    each image path's folder (the worker checks every file of an adapter resolves inside one)."""
    roots = set()
    for a in spec.adapters:
        if is_hf(a.uri):
            roots.add(HF_ROOT)
        elif a.uri.startswith("pvc://"):
            roots.add(f"{MODELS_ROOT}/{a.uri.removeprefix('pvc://').partition('/')[0]}")
        else:
            roots.add(posixpath.dirname(a.uri.removeprefix("file://").rstrip("/")) or "/")
    return sorted(roots) or [HF_ROOT]


def parallel_args(spec: InferenceDeploymentSpec) -> list[str]:
    """The worker's tensor-parallel flags. A multi-node group's pods join their leader through
    the variables the LeaderWorkerSet controller sets in each container (the kubelet expands
    $(NAME) in args): the pod's index in the group is its node-rank, the leader the master."""
    args: list[str] = []
    if spec.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.nodes > 1:
        args += [
            "--nnodes", str(spec.nodes),
            "--node-rank", "$(LWS_WORKER_INDEX)",
            "--master-addr", "$(LWS_LEADER_ADDRESS)",
            "--master-port", str(MASTER_PORT),
        ]  # fmt: skip
    return args


def times(quantity: str, n: int) -> str:
    """`quantity` (a Kubernetes quantity) times n, in its own unit: 1Gi x 4 = 4Gi."""
    match = re.search(QUANTITY, quantity)
    if n == 1 or match is None:
        return quantity
    suffix = match.group(3) or ""
    number = quantity[: len(quantity) - len(suffix)] if suffix else quantity
    return f"{format((Decimal(number) * n).normalize(), 'f')}{suffix}"


def _env(spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    """The worker's variables: ours, then the user's (_merged_env)."""
    # A read-only root filesystem: every cache goes to the /tmp emptyDir; no hub downloads (an
    # hf:// model is fetched by the init container before the worker starts).
    ours: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
    ]
    cache = compile_cache(spec)
    if cache is not None:
        ours = [v for v in ours if v["name"] not in {e["name"] for e in cache[2]}] + cache[2]
    if spec.server.api_key_secret:
        ref = {"name": spec.server.api_key_secret, "key": "api-key"}
        ours.append({"name": "KVSCALE_API_KEY", "valueFrom": {"secretKeyRef": ref}})
    return _merged_env(ours, spec)


def _merged_env(ours: list[dict[str, Any]], spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    """The operator's variables, then the user's; a user variable of the same name replaces ours
    (one entry per name: the Deployment's env is keyed by name and server-side apply refuses
    duplicates). The user's come last, so they may refer to ours as $(NAME)."""
    users: list[dict[str, Any]] = []
    for var in spec.env:
        if var.value is not None:
            users.append({"name": var.name, "value": var.value})
        else:
            assert var.value_from is not None
            src = var.value_from
            ref_kind, ref = (
                ("secretKeyRef", src.secret_key_ref)
                if src.secret_key_ref
                else ("configMapKeyRef", src.config_map_key_ref)
            )
            users.append({"name": var.name, "valueFrom": {ref_kind: {"name": ref.name, "key": ref.key}}})
    taken = {v["name"] for v in users}
    return [v for v in ours if v["name"] not in taken] + list({v["name"]: v for v in users}.values())


def _scheduling(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The pod spec's placement fields, from the spec (only those set)."""
    out: dict[str, Any] = {}
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    if spec.affinity is not None:
        affinity = spec.affinity.model_dump(by_alias=True, exclude_none=True)
        if affinity:
            out["affinity"] = affinity
    if spec.topology_spread_constraints:
        constraints = []
        for c in spec.topology_spread_constraints:
            body = c.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
            body.update(
                maxSkew=c.max_skew, topologyKey=c.topology_key, whenUnsatisfiable=c.when_unsatisfiable
            )
            # Counting this resource's workers is what spreading them means; say so by default.
            body.setdefault("labelSelector", {"matchLabels": selector_labels(owner.name)})
            constraints.append(body)
        out["topologySpreadConstraints"] = constraints
    if spec.priority_class_name:
        out["priorityClassName"] = spec.priority_class_name
    if spec.runtime_class_name:
        out["runtimeClassName"] = spec.runtime_class_name
    if spec.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": r.name} for r in spec.image_pull_secrets]
    return out


def pod_labels(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, str]:
    """The user's pod labels and ours; ours win (the CRD refuses user labels that would take
    them, this keeps the selector whole for a resource stored under an older CRD)."""
    users = {
        k: v
        for k, v in spec.pod_metadata.labels.items()
        if k not in RESERVED_LABELS and not k.startswith(RESERVED_PREFIX)
    }
    return {**users, **labels(owner.name)}


def pod_security_context(ids: PodSecurity, *, files: bool = True) -> dict[str, Any]:
    """Non-root, with the image's numeric USER unless the admin policy fixes IDs (OpenShift's
    restricted-v2 refuses a runAsUser outside the namespace's range and assigns one itself)."""
    out: dict[str, Any] = {"runAsNonRoot": True}
    if ids.run_as_user is not None:
        out["runAsUser"] = ids.run_as_user
    if ids.run_as_group is not None:
        out["runAsGroup"] = ids.run_as_group
    if files and ids.fs_group is not None:
        out["fsGroup"] = ids.fs_group
    out["seccompProfile"] = {"type": "RuntimeDefault"}
    return out


def pod_template(
    owner: Owner,
    spec: InferenceDeploymentSpec,
    image: str,
    *,
    leader: bool = True,
    ids: PodSecurity | None = None,
) -> dict[str, Any]:
    """The worker pod; `leader`: one that serves the API (a pod of rank 0), else a multi-node
    group's other pod (no /metrics to scrape)."""
    r = spec.resources
    # Sized: an emptyDir without a limit may fill the node's disk (or, memory-backed, its memory).
    volumes: dict[str, dict] = {"tmp": {"name": "tmp", "emptyDir": {"sizeLimit": r.ephemeral_storage}}}
    mounts: dict[str, dict] = {"tmp": {"name": "tmp", "mountPath": "/tmp"}}
    uris = [spec.model.uri]
    if spec.speculative is not None and spec.speculative.draft_model_uri:
        uris.append(spec.speculative.draft_model_uri)

    def source(uri: str) -> str:
        """The path `uri` is read from in the worker container; its volume and mount added."""
        if is_hf(uri):  # downloaded by an init container into the hf-models volume
            volumes[HF_VOLUME] = hf_volume(spec)
            mounts[HF_VOLUME] = {"name": HF_VOLUME, "mountPath": HF_ROOT, "readOnly": True}
            return hf_model_path(uri)
        path, volume, mount = resolve_model(uri)
        if volume is not None and mount is not None:
            volumes[volume["name"]], mounts[mount["name"]] = volume, mount
        return path

    paths = [source(uri) for uri in uris]
    adapters = {a.name: source(a.uri) for a in spec.adapters}
    model_path, draft_path = paths[0], (paths[1] if len(paths) > 1 else None)
    cache = compile_cache(spec)
    if cache is not None:
        volumes[COMPILE_CACHE_VOLUME], mounts[COMPILE_CACHE_VOLUME] = cache[0], cache[1]
    # requests = limits for CPU and memory (Guaranteed QoS); ephemeral storage is requested so
    # the scheduler reserves it, and bounded by the /tmp size limit rather than a limit here.
    resources: dict[str, Any] = {
        "requests": {"cpu": r.cpu, "memory": r.memory, "ephemeral-storage": r.ephemeral_storage},
        "limits": {"cpu": r.cpu, "memory": r.memory},
    }
    if r.gpus:
        resources["requests"]["nvidia.com/gpu"] = resources["limits"]["nvidia.com/gpu"] = str(r.gpus)
    if r.gpus or spec.ranks_per_pod > 1:
        # torch's and NCCL's shared memory and the ranks' step inputs: sharedMemory per rank
        # (the container runtime's default /dev/shm is 64 MiB).
        volumes["dshm"] = {
            "name": "dshm",
            "emptyDir": {"medium": "Memory", "sizeLimit": times(r.shared_memory, spec.ranks_per_pod)},
        }
        mounts["dshm"] = {"name": "dshm", "mountPath": "/dev/shm"}
    ports = [{"name": "http", "containerPort": PORT, "protocol": "TCP"}]
    if precise_index(spec) and leader:
        ports.append({"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"})
        ports.append({"name": "kv-replay", "containerPort": KV_REPLAY_PORT, "protocol": "TCP"})
    if spec.nodes > 1:
        ports.append({"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"})
    http = {"path": "/ready", "port": "http"}
    container = {
        "name": "worker",
        "image": image,
        "command": ["kvscale-worker"],
        "args": worker_args(owner.name, spec, model_path, draft_path, adapters, leader=leader),
        "ports": ports,
        "env": _env(spec),
        "resources": resources,
        "volumeMounts": list(mounts.values()),
        # Loading a model takes minutes: the startup probe holds liveness off until /ready says so.
        # Every second: a worker that serves a few seconds after it starts (issue 29) is not held
        # back by the probe's period (at 5 s, Ready came up to 5 s after /ready answered).
        "startupProbe": {
            "httpGet": http,
            "periodSeconds": STARTUP_PROBE_PERIOD_S,
            "timeoutSeconds": 1,
            "failureThreshold": math.ceil(spec.server.startup_timeout_seconds / STARTUP_PROBE_PERIOD_S),
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
        "securityContext": CONTAINER_SECURITY,
    }
    # The download takes the worker's CPU and memory (requests = limits: the pod stays Guaranteed),
    # no GPU. The draft model's comes second: a failure of the main one is reported first.
    download_resources = {
        "requests": {"cpu": r.cpu, "memory": r.memory},
        "limits": {"cpu": r.cpu, "memory": r.memory},
    }
    downloads = [(f"{p}{DOWNLOAD_SUFFIX}", uri) for p, uri in zip(("", "draft-"), uris, strict=False)]
    downloads += [(adapter_download_name(uri), uri) for uri in dict.fromkeys(a.uri for a in spec.adapters)]
    init = [
        download_container(name, uri, spec, image, download_resources, container["securityContext"])
        for name, uri in downloads
        if is_hf(uri)
    ]
    pod_spec: dict[str, Any] = {
        **({"initContainers": init} if init else {}),
        "containers": [container],
        "volumes": list(volumes.values()),
        # Longer than preStop + drain, so the kubelet never kills a worker that is still draining.
        "terminationGracePeriodSeconds": PRESTOP_SECONDS + spec.server.drain_timeout_seconds + 10,
        "securityContext": pod_security_context(ids or PodSecurity()),
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # workers never talk to the API server
    }
    pod_spec.update(_scheduling(owner, spec))
    annotations = {
        **(SCRAPE_ANNOTATIONS if leader else {}),
        **spec.pod_metadata.annotations,  # the user's win: e.g. scrape "false"
    }
    return {
        "metadata": {"labels": pod_labels(owner, spec), "annotations": annotations},
        "spec": pod_spec,
    }


def deployment(
    owner: Owner, spec: InferenceDeploymentSpec, image: str, ids: PodSecurity | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            # By default never below the wanted capacity during a rollout: add one, then remove
            # one. On a full GPU pool maxSurge 0 / maxUnavailable 1 replaces in place instead.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec.rollout.max_surge,
                    "maxUnavailable": spec.rollout.max_unavailable,
                },
            },
            "progressDeadlineSeconds": spec.server.startup_timeout_seconds + 60,
            "revisionHistoryLimit": 3,
            "template": pod_template(owner, spec, image, ids=ids),
        },
    }
    # With autoscaling the field stays out of our apply, so the autoscaler owns it alone and
    # neither we nor a GitOps tool ever fight over it.
    if spec.desired_replicas is not None:
        body["spec"]["replicas"] = spec.desired_replicas
    return body


def leader_worker_set(
    owner: Owner, spec: InferenceDeploymentSpec, image: str, ids: PodSecurity | None = None
) -> dict[str, Any]:
    """The workers of a multi-node model (parallelism.nodes > 1): a LeaderWorkerSet whose
    replicas are groups of `nodes` pods, one copy of the model each. A rank lost takes its
    group down (RecreateGroupOnPodRestart): the other ranks cannot go on without it."""
    body: dict[str, Any] = {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": _metadata(owner),
        "spec": {
            "startupPolicy": "LeaderCreated",
            # At least 1 unavailable group: LWS (v0.8) copies maxUnavailable into its leaders'
            # StatefulSet, which the API server refuses with 0 ("cannot be 0"), even beside a
            # surge its own webhook accepts (measured in e2e/test_parallelism.py).
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {
                    "maxSurge": spec.rollout.max_surge,
                    "maxUnavailable": max(1, spec.rollout.max_unavailable),
                },
            },
            # One headless Service per group, named after its leader (NAME-G), and so the
            # leader's address NAME-G.NAME-G.NS. Under the default (Shared) the controller's one
            # headless Service would be named NAME, the name of our Service: it creates none
            # when that exists, so the group's subdomain is our ClusterIP Service, which lists
            # only ready leaders, and a leader is ready only once its followers joined it, which
            # they cannot do without resolving it (LWS v0.8.0's CreateHeadlessServiceIfNotExists).
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
            "leaderWorkerTemplate": {
                "size": spec.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": pod_template(owner, spec, image, ids=ids),
                "workerTemplate": pod_template(owner, spec, image, leader=False, ids=ids),
            },
        },
    }
    if spec.desired_replicas is not None:  # as the Deployment's: the autoscaler's otherwise
        body["spec"]["replicas"] = spec.desired_replicas
    return body


def workload_key(spec: InferenceDeploymentSpec) -> str:
    """The child that runs the workers: a Deployment, or a LeaderWorkerSet of groups."""
    return "LeaderWorkerSet" if spec.nodes > 1 else "Deployment"


def workload(
    owner: Owner, spec: InferenceDeploymentSpec, image: str, ids: PodSecurity | None = None
) -> dict[str, Any]:
    if workload_key(spec) == "LeaderWorkerSet":
        return leader_worker_set(owner, spec, image, ids)
    return deployment(owner, spec, image, ids)


def replicas_handover(
    live: dict[str, Any], api_version: str = "apps/v1", kind: str = "Deployment"
) -> dict[str, Any] | None:
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
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": {"replicas": replicas},
    }


def service(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner),
        "spec": {
            "type": "ClusterIP",
            "selector": serving_selector(owner.name, spec),
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(owner: Owner) -> dict[str, Any]:
    # Voluntary disruptions (drains, upgrades) take one worker at a time. A worker that is not
    # Ready (still loading, or crash-looping) may always be evicted: otherwise one broken worker
    # blocks every node drain.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def router_selector_labels(name: str) -> dict[str, str]:
    """The router pods' labels: not the owner label, which the workers' tools select on
    (`kvscale.dev/inference-deployment=NAME` means the workers)."""
    return {LABEL_NAME: ROUTER, LABEL_INSTANCE: name}


def endpoint_selector_labels(endpoint: str) -> dict[str, str]:
    """An InferenceEndpoint's router pods: no instance label, so that no InferenceDeployment's
    router selector (name + instance) ever takes them in, whatever the names."""
    return {LABEL_NAME: ROUTER, LABEL_ENDPOINT: endpoint}


def router_selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in router_selector_labels(name).items())


def _router_metadata(owner: Owner) -> dict[str, Any]:
    meta = _metadata(owner)
    meta["name"] = router_name(owner.name)
    meta["labels"] = {
        **router_selector_labels(owner.name),
        LABEL_OWNER: owner.name,  # the children's watches select on it
        LABEL_MANAGED_BY: MANAGER,
        LABEL_COMPONENT: "router",
    }
    return meta


def scales_from_zero(spec: InferenceDeploymentSpec) -> bool:
    return spec.autoscaling is not None and spec.autoscaling.min_replicas == 0


ROUTER_KEYS_DIR = "/etc/kvscale/router-api-keys"


def router_args(owner: Owner, spec: InferenceDeploymentSpec) -> list[str]:
    args = ["--service", owner.name, "--port-name", "http", "--port", str(PORT)]
    if spec.server.api_key_secret:
        # The workers' key, checked at the router too (before a stranger takes a queue place),
        # and the router's own to the workers (its tokenizer fetch; a client's request goes on
        # with it too, already checked), which check it again.
        key_file = f"{ROUTER_KEYS_DIR}/api-key"
        args += ["--api-key-file", key_file, "--upstream-api-key-file", key_file]
    if precise_index(spec):
        args += ["--kv-events-port", str(KV_EVENTS_PORT), "--kv-events-replay-port", str(KV_REPLAY_PORT)]
        args += ["--tokenizer", "workers"]
    if scales_from_zero(spec):
        # The workers' Deployment, through /scale; and a request may wait a first worker's startup.
        args += ["--scale-deployment", owner.name]
        args += ["--queue-timeout", str(max(60, spec.server.startup_timeout_seconds))]
    return args


def pool_keys_file(member: str) -> str:
    """Where an endpoint's router reads a keyed member's workers' key (its `--pool ...,keys=`)."""
    return f"{ROUTER_KEYS_DIR}/{member}/api-key"


ROUTER_CPU_REQUEST = "100m"
ROUTER_TMP = "128Mi"


def _router_cpu_request(limit: str) -> str:
    return limit if parse_quantity(limit) < parse_quantity(ROUTER_CPU_REQUEST) else ROUTER_CPU_REQUEST


def router_deployment(
    owner: Owner, spec: InferenceDeploymentSpec, image: str, ids: PodSecurity | None = None
) -> dict[str, Any]:
    return router_pods_deployment(
        _router_metadata(owner),
        router_selector_labels(owner.name),
        spec.router,
        router_args(owner, spec),
        image,
        api_key_secret=spec.server.api_key_secret,
        ids=ids,
    )


def router_pods_deployment(
    meta: dict[str, Any],
    selector: dict[str, str],
    r: RouterSettings,
    args: list[str],
    image: str,
    *,
    api_key_secret: str | None = None,
    pool_key_secrets: Sequence[tuple[str, str]] = (),
    ids: PodSecurity | None = None,
) -> dict[str, Any]:
    """The router's Deployment: an InferenceDeployment's own (router_deployment) or an
    InferenceEndpoint's (reconcile/endpoint.py); its ServiceAccount has the Deployment's name.
    `pool_key_secrets`: (member, Secret) of an endpoint's members whose workers want a key, each
    mounted at pool_keys_file(member)."""
    http = {"path": "/ready", "port": "http"}
    precise = r.prefix_index == "precise"
    container = {
        "name": "router",
        "image": image,
        "command": ["kvscale-router"],
        "args": args,
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        # A small CPU request (routers of many resources share small nodes), bursting to the limit.
        "resources": {
            "requests": {"cpu": _router_cpu_request(r.cpu), "memory": r.memory},
            "limits": {"cpu": r.cpu, "memory": r.memory},
        },
        "readinessProbe": {"httpGet": http, "periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
        "securityContext": CONTAINER_SECURITY,
    }
    volumes, mounts = [], []
    if api_key_secret:
        secret = {"secretName": api_key_secret, "items": [{"key": "api-key", "path": "api-key"}]}
        volumes.append({"name": "api-keys", "secret": secret})
        mounts.append({"name": "api-keys", "mountPath": ROUTER_KEYS_DIR, "readOnly": True})
    for i, (member, secret_name) in enumerate(pool_key_secrets):
        secret = {"secretName": secret_name, "items": [{"key": "api-key", "path": "api-key"}]}
        volumes.append({"name": f"pool-keys-{i}", "secret": secret})
        mount_dir = pool_keys_file(member).rsplit("/", 1)[0]
        mounts.append({"name": f"pool-keys-{i}", "mountPath": mount_dir, "readOnly": True})
    if precise:
        # The tokenizer fetched from a worker is written out and loaded from /tmp (the root
        # filesystem is read-only): its files are at most 64 MiB (the worker's cap).
        volumes.append({"name": "tmp", "emptyDir": {"sizeLimit": ROUTER_TMP}})
        mounts.append({"name": "tmp", "mountPath": "/tmp"})
        # transformers reads only the fetched files: no hub, and any cache it wants under /tmp.
        container["env"] = [{"name": "HF_HOME", "value": "/tmp/hf"}, {"name": "HF_HUB_OFFLINE", "value": "1"}]
    if mounts:
        container["volumeMounts"] = mounts
    labels_ = {**selector, LABEL_MANAGED_BY: MANAGER, LABEL_COMPONENT: "router"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": dict(selector)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": labels_,
                    "annotations": dict(SCRAPE_ANNOTATIONS),
                },
                "spec": {
                    "serviceAccountName": meta["name"],
                    # The router watches EndpointSlices and writes /scale: it needs its token.
                    "automountServiceAccountToken": True,
                    "containers": [container],
                    **({"volumes": volumes} if volumes else {}),
                    # Replicas on different nodes where there are several (soft: a one-node
                    # cluster still runs them all), so one node's loss leaves a router.
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": dict(selector)},
                        }
                    ],
                    # Longer than preStop + the router's own drain (--shutdown-timeout, 30 s).
                    "terminationGracePeriodSeconds": PRESTOP_SECONDS + 30 + 10,
                    "securityContext": pod_security_context(ids or PodSecurity(), files=False),
                    "enableServiceLinks": False,
                },
            },
        },
    }


def router_service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _router_metadata(owner),
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector_labels(owner.name),
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def router_pod_disruption_budget(owner: Owner) -> dict[str, Any]:
    """Drains and upgrades take one router at a time: with two replicas (the default) one keeps
    serving; with one, eviction is never blocked. A router that is not Ready may go at once."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _router_metadata(owner),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": router_selector_labels(owner.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def router_role_rules(owner: Owner) -> list[dict[str, Any]]:
    """What the router sends: a list and watch of the workers' EndpointSlices (endpoints.py), and
    a read and an update of the workers' Deployment's scale subresource, that one Deployment only
    (scale from zero)."""
    return [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        },
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": [owner.name],
            "verbs": ["get", "update"],
        },
    ]


def router_rbac(owner: Owner) -> list[dict[str, Any]]:
    name = router_name(owner.name)
    rbac = "rbac.authorization.k8s.io"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _router_metadata(owner)},
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "Role",
            "metadata": _router_metadata(owner),
            "rules": router_role_rules(owner),
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "RoleBinding",
            "metadata": _router_metadata(owner),
            "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]


def router_children(
    owner: Owner, spec: InferenceDeploymentSpec, image: str, ids: PodSecurity | None = None
) -> list[dict[str, Any]]:
    """The router's children; none with the router off or shared (an InferenceEndpoint's: the
    handlers delete what is left)."""
    if not spec.router.enabled or spec.router.endpoint is not None:
        return []
    return [
        *router_rbac(owner),
        router_deployment(owner, spec, image, ids),
        router_service(owner),
        router_pod_disruption_budget(owner),
    ]


def endpoint_url(owner: Owner, spec: InferenceDeploymentSpec) -> str:
    """Where clients send requests: the router's Service, the shared InferenceEndpoint's (named
    as the endpoint), or without a router the workers'."""
    if spec.router.enabled and spec.router.endpoint is not None:
        return f"http://{spec.router.endpoint}.{owner.namespace}.svc:{PORT}"
    host = router_name(owner.name) if spec.router.enabled else owner.name
    return f"http://{host}.{owner.namespace}.svc:{PORT}"


def children(
    owner: Owner, spec: InferenceDeploymentSpec, image: str, ids: PodSecurity | None = None
) -> list[dict[str, Any]]:
    """The workers' children (Deployment or LeaderWorkerSet, Service, PDB). The PDB counts pods:
    one at a time also means one group at a time."""
    return [workload(owner, spec, image, ids), service(owner, spec), pod_disruption_budget(owner)]


INFERENCE_POOL_API = "inference.networking.k8s.io/v1"


def inference_pool(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The workers as a Gateway API Inference Extension pool: the same pods and port as the
    workers' Service, for GIE gateways with their own endpoint picker (the workers export the
    model-server protocol's metrics). NAME, as the workers' Service."""
    body: dict[str, Any] = {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": _metadata(owner),
        "spec": {
            "selector": {"matchLabels": serving_selector(owner.name, spec)},
            "targetPorts": [{"number": PORT}],
        },
    }
    picker = spec.inference_pool.endpoint_picker
    if picker is not None:
        body["spec"]["endpointPickerRef"] = {
            "group": "",
            "kind": "Service",
            "name": picker.name,
            "port": {"number": picker.port},
            "failureMode": picker.failure_mode,
        }
    return body


def all_children(
    owner: Owner,
    spec: InferenceDeploymentSpec,
    image: str,
    router_image: str,
    pools: bool = False,
    *,
    policy: AdminPolicy | None = None,
    operator_namespace: str = "kvscale-system",
) -> list[dict[str, Any]]:
    """Every child; the InferencePool with `pools` (its CRD is served) unless the spec turns it
    off; the NetworkPolicies unless the admin policy does."""
    policy = policy or AdminPolicy()
    ids = policy.pod_security
    pool = [inference_pool(owner, spec)] if pools and spec.inference_pool.enabled else []
    return (
        children(owner, spec, image, ids)
        + pool
        + router_children(owner, spec, router_image, ids)
        + network_policies(owner, spec, policy.network_policy, operator_namespace, pooled=bool(pool))
    )


# --- NetworkPolicies ---------------------------------------------------------------------------


def operator_peer(operator_namespace: str) -> dict[str, Any]:
    """The operator's pods (its autoscaler scrapes the workers' and routers' /metrics)."""
    return {
        "namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: operator_namespace}},
        "podSelector": {"matchLabels": {LABEL_NAME: OPERATOR}},
    }


def http_from(peers: list[dict[str, Any]]) -> dict[str, Any]:
    """An ingress rule: `peers` on the workers' and routers' one port (the OpenAI API and
    /metrics). Fresh lists each time: no object is shared between two children."""
    return {"from": copy.deepcopy(peers), "ports": [{"protocol": "TCP", "port": PORT}]}


def network_policies(
    owner: Owner,
    spec: InferenceDeploymentSpec,
    net: NetworkPolicySettings,
    operator_namespace: str,
    *,
    pooled: bool = False,
) -> list[dict[str, Any]]:
    """Ingress NetworkPolicies for the workers (NAME) and the router (NAME-router); egress is
    left open (model downloads, the API server). The kubelet's probes are node traffic, which
    NetworkPolicies do not block. `pooled`: an InferencePool is applied, whose gateway sends to
    the workers directly. None when the admin policy turns them off."""
    if not net.enabled:
        return []
    # A peer without a namespaceSelector: pods of the NetworkPolicy's own namespace.
    clients = net.clients_from if net.clients_from is not None else [{"podSelector": {}}]
    scrapers = [operator_peer(operator_namespace), *net.metrics_from]
    api = "networking.k8s.io/v1"
    worker_rules: list[dict[str, Any]] = []
    if spec.router.enabled:
        shared = spec.router.endpoint
        selector = router_selector_labels(owner.name) if shared is None else endpoint_selector_labels(shared)
        routers = http_from([{"podSelector": {"matchLabels": selector}}])
        if precise_index(spec):  # the routers subscribe to the workers' KV events
            routers["ports"] += [{"protocol": "TCP", "port": p} for p in (KV_EVENTS_PORT, KV_REPLAY_PORT)]
        worker_rules.append(routers)
    if not spec.router.enabled or pooled:  # clients (or a gateway) reach the workers directly
        worker_rules.append(http_from(clients))
    worker_rules.append(http_from(scrapers))
    if spec.nodes > 1:
        # A group's ranks: torch.distributed's rendezvous and NCCL's own (random) ports.
        worker_rules.append({"from": [{"podSelector": {"matchLabels": selector_labels(owner.name)}}]})
    out = [
        {
            "apiVersion": api,
            "kind": "NetworkPolicy",
            "metadata": _metadata(owner),
            "spec": {
                "podSelector": {"matchLabels": selector_labels(owner.name)},
                "policyTypes": ["Ingress"],
                "ingress": worker_rules,
            },
        }
    ]
    if spec.router.enabled and spec.router.endpoint is None:
        out.append(
            {
                "apiVersion": api,
                "kind": "NetworkPolicy",
                "metadata": _router_metadata(owner),
                "spec": {
                    "podSelector": {"matchLabels": router_selector_labels(owner.name)},
                    "policyTypes": ["Ingress"],
                    "ingress": [http_from(clients), http_from(scrapers)],
                },
            }
        )
    return out


# --- ownership ---------------------------------------------------------------------------------


def foreign(
    live: dict[str, Any] | None, owner: Owner, kind: str = KIND, owner_label: str = LABEL_OWNER
) -> str | None:
    """Why the live object of a child's name is not ours to apply over (None: it is ours, or
    there is none). Ours: an owner reference to this resource; or to a resource of this name
    that is gone (deleted and re-created before the garbage collector came); or, with no
    controller at all, our managed-by and owner labels (orphaned by `kubectl delete
    --cascade=orphan`). Anything else someone else made: a forced apply would take it over."""
    if live is None:
        return None
    meta = live.get("metadata") or {}
    refs = meta.get("ownerReferences") or []
    if any(r.get("uid") == owner.uid for r in refs):
        return None
    controller = next((r for r in refs if r.get("controller")), None)
    if controller is not None:
        if (
            controller.get("kind") == kind
            and str(controller.get("apiVersion", "")).startswith(f"{GROUP}/")
            and controller.get("name") == owner.name
        ):
            return None
        return f"controlled by {controller.get('kind')} {controller.get('name')}"
    labels_ = meta.get("labels") or {}
    if labels_.get(LABEL_MANAGED_BY) == MANAGER and labels_.get(owner_label) == owner.name:
        return None
    by = labels_.get(LABEL_MANAGED_BY)
    return f"managed by {by}" if by else "not created by the operator"
