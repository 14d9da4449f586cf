"""Pure functions: an InferenceEndpoint and the InferenceDeployments that name it -> its members and
the manifests of its shared router.

The router is the same kvscale-router an InferenceDeployment gets, run with one `--pool` per
member (router/pool.py): `MODEL=SERVICE[,scale=DEPLOYMENT][,adapters=A|B]`, the model each member
serves (its servedName), its workers' Service, its Deployment where it scales from zero (the
router wakes that pool alone), and its adapters (so a request for one routes to its pool while the
pool is at zero). Everything the endpoint makes is named as the endpoint (its Service is the URL
clients use) and labelled with LABEL_ENDPOINT, never LABEL_OWNER: the InferenceDeployments'
watches and resync never see it. No I/O here: reconcile/endpoint_sync.py applies what these return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvscale.operator.api.endpoint import ENDPOINT_KIND, InferenceEndpointSpec
from kvscale.operator.api.labels import LABEL_COMPONENT, LABEL_MANAGED_BY, MANAGER
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.reconcile.admin_policy import NetworkPolicySettings, PodSecurity
from kvscale.operator.reconcile.children import (
    KV_EVENTS_PORT,
    KV_REPLAY_PORT,
    PORT,
    Owner,
    endpoint_selector_labels,
    http_from,
    operator_peer,
    owner_reference,
    pool_keys_file,
    router_pods_deployment,
    scales_from_zero,
)

# The router's budget: one pool per member, each a few lines of its args and its own queue, scrape
# and event subscriptions. Past it, later members are left out and said so in the status, so no
# tenant with `edit` can grow one shared router's Deployment (and its work) without bound.
MAX_MEMBERS = 64
# What `--pool` splits on (and spaces): the router refuses a model name with one of them.
POOL_SEPARATORS = frozenset("=,|")


@dataclass(frozen=True)
class Member:
    """An InferenceDeployment behind the endpoint: one router pool."""

    deployment: str  # its name: its workers' Service and Deployment are named so
    model: str  # the name requests use (model.servedName, else the resource's name)
    adapters: tuple[str, ...] = ()
    scales_from_zero: bool = False
    startup_timeout_s: int = 0
    api_key_secret: str | None = None  # server.apiKeySecret: its workers' key, checked at the router

    def pool_arg(self) -> str:
        """The router's `--pool` value for this member."""
        out = f"{self.model}={self.deployment}"
        if self.scales_from_zero:
            out += f",scale={self.deployment}"
        if self.adapters:
            out += ",adapters=" + "|".join(self.adapters)
        if self.api_key_secret:
            out += f",keys={pool_keys_file(self.deployment)}"
        return out


def _joined(resource: dict[str, Any]) -> tuple[str, str]:
    meta = resource["metadata"]
    return meta.get("creationTimestamp") or "", meta["name"]


def members(endpoint: str, resources: list[dict[str, Any]]) -> tuple[list[Member], list[str]]:
    """The InferenceDeployments of `resources` (one namespace's) that name `endpoint`, in the order
    they were created, and why any that name it are left out: a model or adapter name an earlier
    member serves (a request's `model` must pick one pool), a served name `--pool` cannot carry,
    past MAX_MEMBERS, or a spec the models refuse (its own status says why). One being deleted is
    gone already, for the router."""
    out: list[Member] = []
    problems: list[str] = []
    taken: dict[str, str] = {}  # a model or adapter name -> the member that serves it
    for r in sorted(resources, key=_joined):
        meta = r["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        router = ((r.get("spec") or {}).get("router")) or {}
        if router.get("endpoint") != endpoint:
            continue
        name = meta["name"]
        try:
            spec = InferenceDeploymentSpec.model_validate(r.get("spec") or {})
        except ValidationError:
            problems.append(f"{name}: its spec is invalid (see its status)")
            continue
        if not spec.router.enabled:
            continue
        model = spec.model.served_name or name
        if POOL_SEPARATORS & set(model) or any(c.isspace() for c in model):
            problems.append(f"{name}: its served name {model!r} has a space or one of '=', ',' or '|'")
            continue
        names = [model, *(a.name for a in spec.adapters)]
        clash = next((n for n in names if n in taken), None)
        if clash is not None:
            problems.append(f"{name}: model {clash!r} is already served here by {taken[clash]}")
            continue
        if len(out) >= MAX_MEMBERS:
            problems.append(f"{name}: the endpoint serves at most {MAX_MEMBERS} InferenceDeployments")
            continue
        taken.update(dict.fromkeys(names, name))
        out.append(
            Member(
                name,
                model,
                tuple(a.name for a in spec.adapters),
                scales_from_zero(spec),
                spec.server.startup_timeout_seconds,
                spec.server.api_key_secret,
            )
        )
    return out, problems


def endpoint_url(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc:{PORT}"


def _metadata(owner: Owner) -> dict[str, Any]:
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": {
            **endpoint_selector_labels(owner.name),
            LABEL_MANAGED_BY: MANAGER,
            LABEL_COMPONENT: "router",
        },
        "ownerReferences": [owner_reference(owner, ENDPOINT_KIND)],
    }


def router_args(spec: InferenceEndpointSpec, pool: list[Member]) -> list[str]:
    args = ["--port-name", "http", "--port", str(PORT)]
    for m in pool:
        args += ["--pool", m.pool_arg()]
    if spec.router.prefix_index == "precise":
        args += ["--kv-events-port", str(KV_EVENTS_PORT), "--kv-events-replay-port", str(KV_REPLAY_PORT)]
        args += ["--tokenizer", "workers"]
    waking = [m.startup_timeout_s for m in pool if m.scales_from_zero]
    if waking:  # a request may wait for its pool's first worker to start
        args += ["--queue-timeout", str(max(60, *waking))]
    return args


def role_rules(pool: list[Member]) -> list[dict[str, Any]]:
    """The members' EndpointSlices (list, watch), and the scale subresource of those that scale
    from zero, by name (none: no such rule, since an empty resourceNames means every one)."""
    rules: list[dict[str, Any]] = [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    waking = sorted(m.deployment for m in pool if m.scales_from_zero)
    if waking:
        rules.append(
            {
                "apiGroups": ["apps"],
                "resources": ["deployments/scale"],
                "resourceNames": waking,
                "verbs": ["get", "update"],
            }
        )
    return rules


def endpoint_children(
    owner: Owner,
    spec: InferenceEndpointSpec,
    pool: list[Member],
    image: str,
    *,
    ids: PodSecurity | None = None,
    net: NetworkPolicySettings | None = None,
    operator_namespace: str = "kvscale-system",
) -> list[dict[str, Any]]:
    """The shared router: ServiceAccount, Role, RoleBinding, Deployment (no pods while no member
    has joined: a router with no pool has nothing to serve), Service, PodDisruptionBudget and,
    unless the admin policy turns them off, the router pods' NetworkPolicy. The members' workers
    admit these pods in their own NetworkPolicies (children.network_policies)."""
    rbac = "rbac.authorization.k8s.io"
    selector = endpoint_selector_labels(owner.name)
    deployment = router_pods_deployment(
        _metadata(owner),
        selector,
        spec.router,
        router_args(spec, pool),
        image,
        pool_key_secrets=[(m.deployment, m.api_key_secret) for m in pool if m.api_key_secret],
        ids=ids,
    )
    if not pool:
        deployment["spec"]["replicas"] = 0
    out = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner)},
        {"apiVersion": f"{rbac}/v1", "kind": "Role", "metadata": _metadata(owner), "rules": role_rules(pool)},
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(owner),
            "roleRef": {"apiGroup": rbac, "kind": "Role", "name": owner.name},
            "subjects": [{"kind": "ServiceAccount", "name": owner.name, "namespace": owner.namespace}],
        },
        deployment,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(owner),
            "spec": {
                "type": "ClusterIP",
                "selector": selector,
                "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
            },
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _metadata(owner),
            "spec": {
                "maxUnavailable": 1,
                "selector": {"matchLabels": selector},
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        },
    ]
    net = net or NetworkPolicySettings()
    if net.enabled:
        clients = net.clients_from if net.clients_from is not None else [{"podSelector": {}}]
        scrapers = [operator_peer(operator_namespace), *net.metrics_from]
        out.append(
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": _metadata(owner),
                "spec": {
                    "podSelector": {"matchLabels": selector},
                    "policyTypes": ["Ingress"],
                    "ingress": [http_from(clients), http_from(scrapers)],
                },
            }
        )
    return out
