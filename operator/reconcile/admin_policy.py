"""The admin policy: what an InferenceDeployment may ask of the cluster through the operator.

The operator applies children with its own rights, not the user's: without a policy, anyone who
may edit an InferenceDeployment could have the operator run any image, pre-empt other tenants'
pods (priorityClassName, a toleration of every taint), pick a RuntimeClass, mount any Secret of
the namespace or send one as a Bearer token to any URL. The platform team writes a policy (a
YAML file, normally a ConfigMap in the operator's namespace mounted at Settings.policy_path;
docs/operator.md, "Admin policy", says why a file and not a cluster-scoped resource); `check`
is the pure decision, `PolicyFile.load` reads the file. No file: `AdminPolicy()`, whose defaults
are the safe ones documented on each field.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError

from kvscale.operator.api.model import is_hf
from kvscale.operator.api.routing import RouterSettings
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.api.validation import CamelModel

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
# Variables of the download container the spec sets through its own fields, where this policy
# checks them: an `env` entry of that name would replace the operator's value unchecked.
GUARDED_ENV = {
    "HF_ENDPOINT": "model.hfEndpoint",
    "HF_TOKEN": "model.hfTokenSecret",
    "HUGGING_FACE_HUB_TOKEN": "model.hfTokenSecret",
}


class TolerationRule(CamelModel):
    """A toleration the workers may carry: `key` must match, the other fields too where set."""

    key: str = Field(min_length=1, max_length=317, description="Taint key.")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Unset: either.")
    value: str | None = Field(default=None, description="Unset: any value.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Unset: any effect (and a toleration of every effect)."
    )


class PodSecurity(CamelModel):
    """Fixed IDs of the worker and router pods. Unset (the default): `runAsNonRoot` alone, the
    image's numeric USER runs (OpenShift's restricted-v2 assigns the namespace's UID)."""

    run_as_user: int | None = Field(default=None, ge=1, description="The pods' runAsUser.")
    run_as_group: int | None = Field(default=None, ge=0, description="The pods' runAsGroup.")
    fs_group: int | None = Field(
        default=None,
        ge=0,
        description="The worker pods' fsGroup: needed where a model.cacheClaim or compileCache "
        "volume is not writable by the image's user.",
    )


class NetworkPolicySettings(CamelModel):
    """The NetworkPolicies the operator applies per InferenceDeployment."""

    enabled: bool = Field(default=True, description="Apply them.")
    clients_from: list[dict[str, Any]] | None = Field(
        default=None,
        description="NetworkPolicyPeers allowed to send requests to the router (to the workers "
        "when router.enabled is false). Unset: pods of the resource's own namespace.",
    )
    metrics_from: list[dict[str, Any]] = Field(
        default_factory=list,
        description="More NetworkPolicyPeers allowed on the metrics port (e.g. Prometheus' "
        "namespace); the operator's own pods always are.",
    )


class AdminPolicy(CamelModel):
    """What InferenceDeployments may ask for. Each unset field has the default its description
    gives: refusing what lets one tenant take from another, allowing the rest."""

    images: list[str] | None = Field(
        default=None,
        description="Glob patterns (fnmatch) of spec.image and spec.router.image. Unset: any "
        "image; the operator's configured images are always allowed.",
    )
    priority_class_names: list[str] = Field(
        default_factory=list, description="Glob patterns of spec.priorityClassName. Default: none."
    )
    runtime_class_names: list[str] = Field(
        default_factory=list, description="Glob patterns of spec.runtimeClassName. Default: none."
    )
    tolerations: list[TolerationRule] | None = Field(
        default=None,
        description="Allowed spec.tolerations. Unset: any with a key. A toleration without a key "
        "(every taint) is always refused.",
    )
    node_selectors: dict[str, list[str]] | None = Field(
        default=None,
        description="Allowed spec.nodeSelector keys and their values ([]: any value); when set, "
        "affinity.nodeAffinity is refused (it could select any node). Unset: any.",
    )
    hf_endpoints: list[str] | None = Field(
        default=None,
        description="Allowed model.hfEndpoint URLs (scheme, host and port equal, path a prefix); "
        f"with this set an hf:// model without hfEndpoint uses {DEFAULT_HF_ENDPOINT}, which must "
        "be listed too. Unset: any.",
    )
    insecure_hf_endpoints: list[str] = Field(
        default_factory=list,
        description="Glob patterns of plain-http model.hfEndpoint URLs that may receive "
        "hfTokenSecret (an in-cluster mirror the admin vouches for). Default: none: a token "
        "goes to https endpoints only.",
    )
    secrets: list[str] | None = Field(
        default=None,
        description="Glob patterns of every Secret a spec names (model.hfTokenSecret, "
        "server.apiKeySecret, imagePullSecrets, env). Unset: those the spec names for a purpose "
        "(the first three) are allowed, and env may read only those.",
    )
    claims: list[str] | None = Field(
        default=None,
        description="Glob patterns of the PersistentVolumeClaims a spec mounts (pvc:// model and "
        "draft URIs, model.cacheClaim, compileCache.claim). Unset: any claim of the resource's "
        "namespace.",
    )
    max_gpus_per_pod: int | None = Field(default=None, ge=0, description="Most resources.gpus.")
    max_replicas: int | None = Field(
        default=None,
        ge=0,
        description="Most workers (replicas, autoscaling.maxReplicas) and router pods.",
    )
    max_gpus: int | None = Field(
        default=None,
        ge=0,
        description="Most GPUs one resource may hold: gpus x pods per group x most replicas.",
    )
    pod_security: PodSecurity = Field(default_factory=PodSecurity, description="Pod IDs.")
    network_policy: NetworkPolicySettings = Field(
        default_factory=NetworkPolicySettings, description="Per-resource NetworkPolicies."
    )


@dataclass(frozen=True)
class Violation:
    field: str  # the spec's path, as kubectl shows it: spec.tolerations[0]
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _glob(value: str, patterns: list[str]) -> bool:
    return any(fnmatchcase(value, p) for p in patterns)


def _endpoint_allowed(url: str, allowed: list[str]) -> bool:
    got = urlsplit(url)
    for entry in allowed:
        want = urlsplit(entry)
        path = want.path.rstrip("/")
        if (got.scheme, got.netloc.lower()) == (want.scheme, want.netloc.lower()) and (
            got.path.rstrip("/") == path or got.path.startswith(path + "/")
        ):
            return True
    return False


def _toleration_allowed(t: Any, rules: list[TolerationRule]) -> bool:
    return any(
        r.key == t.key
        and r.operator in (None, t.operator)
        and r.value in (None, t.value or "")
        and (r.effect is None or r.effect == t.effect)
        for r in rules
    )


def _secret_refs(spec: InferenceDeploymentSpec) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(field, Secret name) of the Secrets named for a purpose, and of those env reads."""
    purpose = []
    if spec.model.hf_token_secret is not None:
        purpose.append(("spec.model.hfTokenSecret.name", spec.model.hf_token_secret.name))
    if spec.server.api_key_secret:
        purpose.append(("spec.server.apiKeySecret", spec.server.api_key_secret))
    purpose += [(f"spec.imagePullSecrets[{r.name}]", r.name) for r in spec.image_pull_secrets]
    env = [
        (f"spec.env[{v.name}].valueFrom.secretKeyRef.name", v.value_from.secret_key_ref.name)
        for v in spec.env
        if v.value_from is not None and v.value_from.secret_key_ref is not None
    ]
    return purpose, env


def check_router(router: RouterSettings, policy: AdminPolicy) -> list[Violation]:
    """An InferenceEndpoint's shared router against `policy`: its image and its replicas."""
    out: list[Violation] = []
    if policy.images is not None and router.image is not None and not _glob(router.image, policy.images):
        message = f"image {router.image!r} is not one the admin policy allows"
        out.append(Violation("spec.router.image", message))
    if policy.max_replicas is not None and router.replicas > policy.max_replicas:
        out.append(Violation("spec.router.replicas", f"at most {policy.max_replicas} (admin policy)"))
    return out


def check(spec: InferenceDeploymentSpec, policy: AdminPolicy) -> list[Violation]:
    """Every field of `spec` outside `policy`, in the spec's order (empty: allowed)."""
    out: list[Violation] = []
    if policy.images is not None:
        for field, image in (("spec.image", spec.image), ("spec.router.image", spec.router.image)):
            if image is not None and not _glob(image, policy.images):
                out.append(Violation(field, f"image {image!r} is not one the admin policy allows"))

    # Scheduling: each of these takes capacity or nodes from other tenants.
    if spec.priority_class_name and not _glob(spec.priority_class_name, policy.priority_class_names):
        out.append(
            Violation(
                "spec.priorityClassName",
                f"PriorityClass {spec.priority_class_name!r} is not allowed by the admin policy "
                "(a higher priority pre-empts other tenants' pods)",
            )
        )
    if spec.runtime_class_name and not _glob(spec.runtime_class_name, policy.runtime_class_names):
        out.append(
            Violation(
                "spec.runtimeClassName",
                f"RuntimeClass {spec.runtime_class_name!r} is not allowed by the admin policy",
            )
        )
    for i, t in enumerate(spec.tolerations):
        if t.key is None:
            out.append(
                Violation(
                    f"spec.tolerations[{i}]",
                    "a toleration without a key tolerates every taint (nodes reserved for others "
                    "included): name the taint's key",
                )
            )
        elif policy.tolerations is not None and not _toleration_allowed(t, policy.tolerations):
            out.append(
                Violation(
                    f"spec.tolerations[{i}]", f"a toleration of {t.key!r} is not allowed by the admin policy"
                )
            )
    if policy.node_selectors is not None:
        for key, value in spec.node_selector.items():
            values = policy.node_selectors.get(key)
            if values is None or (values and value not in values):
                out.append(
                    Violation(
                        f"spec.nodeSelector[{key}]",
                        f"{key}={value} is not a node selector the admin policy allows",
                    )
                )
        if spec.affinity is not None and spec.affinity.node_affinity:
            out.append(
                Violation(
                    "spec.affinity.nodeAffinity",
                    "the admin policy restricts node selectors: use spec.nodeSelector",
                )
            )

    # Where a Hub token goes.
    m = spec.model
    hf = is_hf(m.uri) or (spec.speculative is not None and is_hf(spec.speculative.draft_model_uri))
    endpoint = m.hf_endpoint or (DEFAULT_HF_ENDPOINT if hf else None)
    token = m.hf_token_secret is not None
    if (
        token
        and endpoint
        and urlsplit(endpoint).scheme != "https"
        and not _glob(endpoint, policy.insecure_hf_endpoints)
    ):
        out.append(
            Violation(
                "spec.model.hfEndpoint",
                "must be https: the download sends hfTokenSecret to it as a Bearer token (the "
                "admin policy's insecureHfEndpoints can allow an http mirror)",
            )
        )
    if policy.hf_endpoints is not None and endpoint and not _endpoint_allowed(endpoint, policy.hf_endpoints):
        field = "spec.model.hfEndpoint" if m.hf_endpoint else "spec.model.uri"
        out.append(Violation(field, f"the Hub endpoint {endpoint} is not one the admin policy allows"))
    for v in spec.env:
        if v.name in GUARDED_ENV:
            out.append(
                Violation(
                    f"spec.env[{v.name}]",
                    f"set {GUARDED_ENV[v.name]} instead: the admin policy checks it there",
                )
            )

    # Secrets: only those the spec names for a purpose, or those the policy allows.
    purpose, env = _secret_refs(spec)
    if policy.secrets is not None:
        for field, name in purpose + env:
            if not _glob(name, policy.secrets):
                out.append(Violation(field, f"Secret {name!r} is not one the admin policy allows"))
    else:
        # hfTokenSecret and apiKeySecret; not a pull Secret (the kubelet's, not the container's).
        named = {name for field, name in purpose if not field.startswith("spec.imagePullSecrets")}
        for field, name in env:
            if name not in named:
                out.append(
                    Violation(
                        field,
                        f"env may read only the Secrets the spec names for a purpose "
                        f"(model.hfTokenSecret, server.apiKeySecret), not {name!r}; the admin "
                        "policy's `secrets` can allow more",
                    )
                )

    if policy.claims is not None:
        uris = [("spec.model.uri", m.uri)]
        if spec.speculative is not None and spec.speculative.draft_model_uri:
            uris.append(("spec.speculative.draftModelUri", spec.speculative.draft_model_uri))
        used = [(f, u.removeprefix("pvc://").partition("/")[0]) for f, u in uris if u.startswith("pvc://")]
        if m.cache_claim:
            used.append(("spec.model.cacheClaim", m.cache_claim))
        if spec.compile_cache is not None:
            used.append(("spec.compileCache.claim", spec.compile_cache.claim))
        for field, claim in used:
            if not _glob(claim, policy.claims):
                out.append(
                    Violation(field, f"PersistentVolumeClaim {claim!r} is not one the admin policy allows")
                )

    # Limits.
    r = spec.resources
    if policy.max_gpus_per_pod is not None and r.gpus > policy.max_gpus_per_pod:
        out.append(
            Violation("spec.resources.gpus", f"at most {policy.max_gpus_per_pod} per pod (admin policy)")
        )
    most = spec.autoscaling.max_replicas if spec.autoscaling is not None else spec.replicas
    most_field = "spec.autoscaling.maxReplicas" if spec.autoscaling is not None else "spec.replicas"
    if policy.max_replicas is not None:
        if most > policy.max_replicas:
            out.append(Violation(most_field, f"at most {policy.max_replicas} (admin policy)"))
        if spec.router.enabled and spec.router.replicas > policy.max_replicas:
            out.append(Violation("spec.router.replicas", f"at most {policy.max_replicas} (admin policy)"))
    total = r.gpus * spec.nodes * most
    if policy.max_gpus is not None and total > policy.max_gpus:
        out.append(
            Violation(
                most_field,
                f"{total} GPUs ({r.gpus} per pod x {spec.nodes} pods per group x {most}) is above "
                f"the admin policy's {policy.max_gpus} per resource",
            )
        )
    return out


def refusal(violations: list[Violation]) -> str:
    """The condition message naming every refused field."""
    return "refused by the admin policy: " + "; ".join(map(str, violations))


class PolicyError(Exception):
    """The policy file exists but cannot be read as a policy: nothing is applied (fail closed)."""


def parse(text: str, source: str | Path = "") -> AdminPolicy:
    """The policy in `text` (read from `source`, for the message)."""
    try:
        data = yaml.safe_load(text) or {}
        return AdminPolicy.model_validate(data)
    except (yaml.YAMLError, ValidationError) as e:
        where = f" {source}" if source else ""
        raise PolicyError(f"the admin policy{where} is invalid: {e}".splitlines()[0][:500]) from e


class PolicyFile:
    """The policy in force, from one file: re-read when it changes (the kubelet updates a mounted
    ConfigMap in place), `AdminPolicy()` without one. Thread-safe (syncs run on several threads)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._guard = threading.Lock()
        self._cached: tuple[tuple[int, int] | None, AdminPolicy | PolicyError] | None = None

    def load(self) -> AdminPolicy:
        """Raises PolicyError for an invalid file."""
        try:
            st = self.path.stat()
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        with self._guard:
            cached = self._cached
            if cached is None or cached[0] != stamp:
                try:
                    value = AdminPolicy() if stamp is None else parse(self.path.read_text(), self.path)
                except PolicyError as e:
                    value = e
                cached = self._cached = (stamp, value)
        if isinstance(cached[1], PolicyError):
            raise cached[1]
        return cached[1]
