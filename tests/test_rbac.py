"""RBAC and the install modes, on the manifests themselves: the operator's roles grant every API
call its code makes (found in the source, so a new call without a grant fails here) and what
the OwnerReferencesPermissionEnforcement admission plugin asks for; the namespaced install has
the same rights as Roles, in exactly the namespaces the operator is told to watch; the
aggregated user roles aggregate. e2e/test_operator.py checks the cluster-wide grants against
the API server's audit log."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import kopf
import pytest
import yaml

from kvscale.operator import main
from kvscale.operator.api.endpoint import InferenceEndpointSpec
from kvscale.operator.api.groupversion import GROUP, PLURAL
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.kube import access
from kvscale.operator.kube import client as kube_client
from kvscale.operator.kube.client import LISTED_KINDS, Kube
from kvscale.operator.reconcile.children import Owner, all_children, router_role_rules
from kvscale.operator.reconcile.endpoint import Member, endpoint_children
from kvscale.operator.settings import Settings

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
SA = {"kind": "ServiceAccount", "name": "kvscale-operator", "namespace": "kvscale-system"}
RBAC = "rbac.authorization.k8s.io"
APPLIED = ("deployments", "services", "poddisruptionbudgets", "serviceaccounts", "roles", "rolebindings")
APPLIED += ("inferencepools", "leaderworkersets", "networkpolicies")
CLUSTER_SCOPED = {("apiextensions.k8s.io", "customresourcedefinitions")}

# Every Kubernetes client method the operator's code calls: (API group, resource, verb, scope).
# "cluster": a request across namespaces (only a ClusterRole allows it); "namespaced": in the
# resource's namespace; "lease": in the operator's own namespace; "marks": in the namespaces an
# admin grants it in (kvscale-operator-pod-marks, bound per namespace: never cluster-wide).
API_CALLS = {
    "get_namespaced_custom_object": (GROUP, PLURAL, "get", "namespaced"),
    "list_cluster_custom_object": (GROUP, PLURAL, "list", "cluster"),
    "list_namespaced_custom_object": (GROUP, PLURAL, "list", "namespaced"),
    "patch_namespaced_custom_object_status": (GROUP, f"{PLURAL}/status", "patch", "namespaced"),
    "read_namespaced_deployment": ("apps", "deployments", "get", "namespaced"),
    "read_namespaced_replica_set": ("apps", "replicasets", "get", "namespaced"),
    "read_namespaced_stateful_set": ("apps", "statefulsets", "get", "namespaced"),
    "patch_namespaced_deployment": ("apps", "deployments", "patch", "namespaced"),
    "list_deployment_for_all_namespaces": ("apps", "deployments", "list", "cluster"),
    "list_namespaced_deployment": ("apps", "deployments", "list", "namespaced"),
    "patch_namespaced_deployment_scale": ("apps", "deployments/scale", "patch", "namespaced"),
    "replace_namespaced_deployment_scale": ("apps", "deployments/scale", "update", "namespaced"),
    "read_namespaced_service": ("", "services", "get", "namespaced"),
    "patch_namespaced_service": ("", "services", "patch", "namespaced"),
    "list_service_for_all_namespaces": ("", "services", "list", "cluster"),
    "list_namespaced_service": ("", "services", "list", "namespaced"),
    "read_namespaced_pod_disruption_budget": ("policy", "poddisruptionbudgets", "get", "namespaced"),
    "patch_namespaced_pod_disruption_budget": ("policy", "poddisruptionbudgets", "patch", "namespaced"),
    "list_pod_disruption_budget_for_all_namespaces": ("policy", "poddisruptionbudgets", "list", "cluster"),
    "list_namespaced_pod_disruption_budget": ("policy", "poddisruptionbudgets", "list", "namespaced"),
    "delete_namespaced_deployment": ("apps", "deployments", "delete", "namespaced"),
    "delete_namespaced_service": ("", "services", "delete", "namespaced"),
    "delete_namespaced_pod_disruption_budget": ("policy", "poddisruptionbudgets", "delete", "namespaced"),
    "read_namespaced_service_account": ("", "serviceaccounts", "get", "namespaced"),
    "patch_namespaced_service_account": ("", "serviceaccounts", "patch", "namespaced"),
    "list_service_account_for_all_namespaces": ("", "serviceaccounts", "list", "cluster"),
    "list_namespaced_service_account": ("", "serviceaccounts", "list", "namespaced"),
    "delete_namespaced_service_account": ("", "serviceaccounts", "delete", "namespaced"),
    "read_namespaced_role": (RBAC, "roles", "get", "namespaced"),
    "patch_namespaced_role": (RBAC, "roles", "patch", "namespaced"),
    "list_role_for_all_namespaces": (RBAC, "roles", "list", "cluster"),
    "list_namespaced_role": (RBAC, "roles", "list", "namespaced"),
    "delete_namespaced_role": (RBAC, "roles", "delete", "namespaced"),
    "read_namespaced_role_binding": (RBAC, "rolebindings", "get", "namespaced"),
    "patch_namespaced_role_binding": (RBAC, "rolebindings", "patch", "namespaced"),
    "list_role_binding_for_all_namespaces": (RBAC, "rolebindings", "list", "cluster"),
    "list_namespaced_role_binding": (RBAC, "rolebindings", "list", "namespaced"),
    "delete_namespaced_role_binding": (RBAC, "rolebindings", "delete", "namespaced"),
    "list_namespaced_pod": ("", "pods", "list", "namespaced"),
    "list_pod_for_all_namespaces": ("", "pods", "list", "cluster"),
    "patch_namespaced_pod": ("", "pods", "patch", "marks"),
    "read_namespaced_network_policy": ("networking.k8s.io", "networkpolicies", "get", "namespaced"),
    "patch_namespaced_network_policy": ("networking.k8s.io", "networkpolicies", "patch", "namespaced"),
    "list_network_policy_for_all_namespaces": ("networking.k8s.io", "networkpolicies", "list", "cluster"),
    "list_namespaced_network_policy": ("networking.k8s.io", "networkpolicies", "list", "namespaced"),
    "delete_namespaced_network_policy": ("networking.k8s.io", "networkpolicies", "delete", "namespaced"),
    "create_namespaced_event": ("", "events", "create", "namespaced"),
    "read_namespaced_lease": ("coordination.k8s.io", "leases", "get", "lease"),
    "create_namespaced_lease": ("coordination.k8s.io", "leases", "create", "lease"),
    "replace_namespaced_lease": ("coordination.k8s.io", "leases", "update", "lease"),
}
# The custom-objects calls of operator/kube/custom_api.py are on the optional APIs' objects: the
# Inference Extension's pools and LeaderWorkerSets (each call on both); leaderworkerset.py
# reads and writes the LeaderWorkerSets' scale subresource.
POOLS = ("inference.networking.k8s.io", "inferencepools")
LWS = ("leaderworkerset.x-k8s.io", "leaderworkersets")
FILE_CALLS = {
    ("custom_api.py", call): [(*api, verb, scope) for api in (POOLS, LWS)]
    for call, verb, scope in (
        ("get_namespaced_custom_object", "get", "namespaced"),
        ("patch_namespaced_custom_object", "patch", "namespaced"),
        ("list_cluster_custom_object", "list", "cluster"),
        ("list_namespaced_custom_object", "list", "namespaced"),
        ("delete_namespaced_custom_object", "delete", "namespaced"),
    )
}
# kube/client.py reads and writes the status of both of our kinds: the InferenceDeployments and
# the InferenceEndpoints (Kube.get_endpoint, Kube.apply_endpoint_status).
ENDPOINTS = "inferenceendpoints"
FILE_CALLS[("client.py", "get_namespaced_custom_object")] = [
    (GROUP, PLURAL, "get", "namespaced"),
    (GROUP, ENDPOINTS, "get", "namespaced"),
]
FILE_CALLS[("client.py", "patch_namespaced_custom_object_status")] = [
    (GROUP, f"{PLURAL}/status", "patch", "namespaced"),
    (GROUP, f"{ENDPOINTS}/status", "patch", "namespaced"),
]
FILE_CALLS[("leaderworkerset.py", "get_namespaced_custom_object_scale")] = [
    (LWS[0], "leaderworkersets/scale", "get", "namespaced")
]
FILE_CALLS[("leaderworkerset.py", "patch_namespaced_custom_object_scale")] = [
    (LWS[0], "leaderworkersets/scale", "patch", "namespaced")
]
CLIENT_CALL = re.compile(
    r"\.((?:read|patch|list|create|replace|get|delete|update|watch)_"
    r"(?:namespaced_\w+|cluster_\w+|\w+_for_all_namespaces))\b"
)


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def grants(role: dict) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def bound_roles(objects: list[dict]) -> dict[tuple[str, str | None], dict]:
    """The roles bound to the operator's ServiceAccount, by (name, namespace: None for a
    ClusterRole), each as its rules' grants and where they apply."""
    roles = {
        (o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")): o
        for o in objects
        if o["kind"] in ("Role", "ClusterRole")
    }
    bound = {}
    for b in objects:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subjects = [{k: s.get(k) for k in SA} for s in b["subjects"]]
        if SA not in subjects:
            continue
        ns = b["metadata"].get("namespace")  # a RoleBinding grants in its namespace only
        role_ns = ns if b["roleRef"]["kind"] == "Role" else None
        role = roles[(b["roleRef"]["kind"], b["roleRef"]["name"], role_ns)]
        bound[(role["metadata"]["name"], ns)] = role
    return bound


# The operator's own watches (kube/pods.py) and the router's (endpoints.py):
# kubernetes.watch.Watch().stream over a list call.
WATCH_CALL = re.compile(r"\.stream\(\s*[\w.()]+\.(list_\w+)")


def client_calls(folder: str) -> dict[str, list[str]]:
    """Client method -> the source files under `folder` (every subpackage) that call it; a list
    call streamed as a watch also as "NAME:watch"."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        text = path.read_text()
        for name in CLIENT_CALL.findall(text):
            found.setdefault(name, []).append(path.name)
        for name in WATCH_CALL.findall(text):
            found.setdefault(f"{name}:watch", []).append(path.name)
    return found


def operator_calls() -> dict[str, list[str]]:
    return client_calls("operator")


def kopf_requests(clusterwide: bool) -> set[tuple[str, str, str]]:
    """What kopf itself sends for the handlers registered: a list and a watch of each resource
    it serves, its status bookkeeping (status.kopf, a patch of the status subresource), Events;
    cluster-wide, also its CRD observer (off in the namespaced install, main._namespaced_settings)."""
    registry, _, _ = main.build(Settings(), None)  # what `kvscale-operator run` registers
    served = {
        (h.selector.group or "", h.selector.plural or h.selector.any_name)
        for reg in (registry._watching, registry._changing, registry._spawning, registry._indexing)
        for h in reg.get_all_handlers()
    }
    assert not registry._spawning.get_all_handlers(), "a daemon or timer: kopf adds finalizers for it"
    sent = {(g, r, v) for g, r in served for v in ("list", "watch")}
    sent |= {(GROUP, f"{plural}/status", "patch") for plural in (PLURAL, ENDPOINTS)}
    sent.add(("", "events", "create"))
    if clusterwide:
        sent |= {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}
    return sent


def admission_checks() -> set[tuple[str, str, str]]:
    """What OwnerReferencesPermissionEnforcement asks the authorizer for our children's writes
    (kubernetes plugin/pkg/admission/gc): `update` on the owner's `finalizers` subresource for
    an ownerReference with blockOwnerDeletion, and `delete` on the child itself for a write that
    changes an existing child's ownerReferences (adopting an orphan)."""
    spec = InferenceDeploymentSpec.model_validate({"model": {"uri": "/models/tiny"}})
    group = InferenceDeploymentSpec.model_validate(
        {"model": {"uri": "/models/tiny"}, "parallelism": {"tensor": 2, "nodes": 2}}
    )
    plurals = {"Deployment": ("apps", "deployments"), "Service": ("", "services")}
    plurals["PodDisruptionBudget"] = ("policy", "poddisruptionbudgets")
    plurals["ServiceAccount"] = ("", "serviceaccounts")
    plurals.update(Role=(RBAC, "roles"), RoleBinding=(RBAC, "rolebindings"), InferencePool=POOLS)
    plurals["LeaderWorkerSet"] = LWS
    plurals["NetworkPolicy"] = ("networking.k8s.io", "networkpolicies")
    checks = set()
    rendered = [
        child
        for s in (spec, group)
        for child in all_children(Owner("tiny", "ns", "uid-1"), s, "worker:1", "router:1", pools=True)
    ]
    owners = {"InferenceDeployment": PLURAL, "InferenceEndpoint": ENDPOINTS}
    shared = endpoint_children(
        Owner("e", "ns", "uid-2"), InferenceEndpointSpec(), [Member("a", "a", (), True)], "r"
    )
    for child in [*rendered, *shared]:
        checks.add((*plurals[child["kind"]], "delete"))
        for ref in child["metadata"]["ownerReferences"]:
            if ref.get("blockOwnerDeletion"):
                assert ref["apiVersion"].split("/")[0] == GROUP and ref["kind"] in owners
                checks.add((GROUP, f"{owners[ref['kind']]}/finalizers", "update"))
    return checks


def needed(clusterwide: bool) -> dict[str, set[tuple[str, str, str]]]:
    """By scope ('cluster', 'namespaced', 'lease'), what the operator needs granted."""
    out: dict[str, set[tuple[str, str, str]]] = {
        "cluster": set(),
        "namespaced": set(),
        "lease": set(),
        "marks": set(),
    }
    for name, files in operator_calls().items():
        call, _, watched = name.partition(":")
        for f in files:
            for group, resource, verb, scope in FILE_CALLS.get((f, call)) or [API_CALLS[call]]:
                verb = watched or verb
                if scope == "cluster" and not clusterwide:
                    continue  # Kube.list_resources / list_children list per namespace instead
                out[scope].add((group, resource, verb))
                if verb == "patch" and resource in APPLIED:
                    out[scope].add((group, resource, "create"))  # a server-side apply that creates
    for g in kopf_requests(clusterwide):
        out["cluster" if clusterwide else "namespaced"].add(g)
    out["namespaced"] |= admission_checks() | router_grants()
    return out


def router_grants() -> set[tuple[str, str, str]]:
    """What the router's Role grants: RBAC's escalation check lets the operator create that Role
    (and bind it) only if it holds every one of those permissions itself (we grant them rather
    than `escalate` and `bind`, which would let it grant anything)."""
    return {
        (group, resource, verb)
        for rule in router_role_rules(Owner("tiny", "ns", "uid-1"))
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_every_client_call_of_the_operator_is_known_here():
    calls = operator_calls()
    unknown = {
        name: files
        for name, files in calls.items()
        if any(
            name.partition(":")[0] not in API_CALLS and (f, name.partition(":")[0]) not in FILE_CALLS
            for f in files
        )
    }
    assert not unknown, f"add these API calls to API_CALLS (and grant them in manifests/): {unknown}"
    assert "patch_namespaced_custom_object_status" in calls and "replace_namespaced_lease" in calls
    assert {"list_pod_for_all_namespaces:watch", "list_namespaced_pod:watch"} <= set(calls)  # pods.py


# Every Kubernetes client call of the router (router/): what its Role (children.router_role_rules)
# must grant in the resource's namespace.
ROUTER_CALLS = {
    "list_namespaced_endpoint_slice": ("discovery.k8s.io", "endpointslices", "list"),
    "list_namespaced_endpoint_slice:watch": ("discovery.k8s.io", "endpointslices", "watch"),
    "read_namespaced_deployment_scale": ("apps", "deployments/scale", "get"),
    "replace_namespaced_deployment_scale": ("apps", "deployments/scale", "update"),
}


def test_every_client_call_of_the_router_is_granted_by_its_role():
    calls = client_calls("router")
    assert set(calls) == set(ROUTER_CALLS), f"map the router's new calls in ROUTER_CALLS: {set(calls)}"
    assert set(ROUTER_CALLS.values()) <= router_grants()


def test_the_cluster_role_grants_what_blockOwnerDeletion_needs_under_the_admission_plugin():
    role = next(d for d in docs(MANIFESTS / "rbac.yaml") if d["kind"] == "ClusterRole")
    assert (GROUP, f"{PLURAL}/finalizers", "update") in grants(role)
    assert admission_checks() <= grants(role)


def test_the_cluster_wide_install_grants_everything_the_operator_sends():
    roles = bound_roles(docs(MANIFESTS / "rbac.yaml") + docs(MANIFESTS / "base" / "leader.yaml"))
    cluster = grants(roles[("kvscale-operator", None)])
    leader = grants(roles[("kvscale-operator-leader", "kvscale-system")])
    need = needed(clusterwide=True)
    assert need["cluster"] | need["namespaced"] <= cluster, (need["cluster"] | need["namespaced"]) - cluster
    assert need["lease"] <= leader
    # Nothing beyond it (the audit log in e2e checks what is sent; this checks what is known).
    assert cluster <= need["cluster"] | need["namespaced"], cluster - need["cluster"] - need["namespaced"]


def test_no_cluster_wide_pod_patch_the_marks_role_is_bound_per_namespace_only():
    objects = docs(MANIFESTS / "rbac.yaml")
    cluster = grants(bound_roles(objects)[("kvscale-operator", None)])
    assert ("", "pods", "patch") not in cluster
    assert not {g for g in cluster if g[1] == "pods" and g[2] not in ("list", "watch")}
    marks = next(
        o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("pod-marks")
    )
    assert grants(marks) == needed(clusterwide=True)["marks"] == {("", "pods", "patch")}
    assert not [
        b
        for b in objects
        if b["kind"] == "ClusterRoleBinding" and b["roleRef"]["name"] == marks["metadata"]["name"]
    ]


class FakeAuthorization:
    answers: ClassVar[list[bool]] = []
    asked: ClassVar[list[dict]] = []

    def __init__(self, _api=None) -> None:
        pass

    def create_self_subject_access_review(self, body, **_):
        FakeAuthorization.asked.append(body)
        return SimpleNamespace(status=SimpleNamespace(allowed=FakeAuthorization.answers.pop(0)))


def test_the_autoscaler_asks_before_marking_pods_and_caches_the_answer(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(access.client, "AuthorizationV1Api", FakeAuthorization)
    reviews = access.AccessReviews()
    FakeAuthorization.answers, FakeAuthorization.asked = [False, True], []
    assert reviews.allowed(None, "tenant-a", clock=lambda: now[0]) is False
    assert reviews.allowed(None, "tenant-a", clock=lambda: now[0]) is False  # cached
    assert FakeAuthorization.asked[0]["spec"]["resourceAttributes"] == {
        "namespace": "tenant-a",
        "verb": "patch",
        "resource": "pods",
    }
    now[0] = access.TTL_S  # a RoleBinding added since: seen after the TTL
    assert reviews.allowed(None, "tenant-a", clock=lambda: now[0]) is True
    assert len(FakeAuthorization.asked) == 2


def namespaced_overlay() -> tuple[list[dict], tuple[str, ...]]:
    """manifests/namespaced/: its objects (the base's, plus rbac.yaml) and the namespaces its
    Deployment patch tells the operator to watch."""
    overlay = yaml.safe_load((MANIFESTS / "namespaced" / "kustomization.yaml").read_text())
    objects = [
        o for f in overlay["resources"] if f.endswith(".yaml") for o in docs(MANIFESTS / "namespaced" / f)
    ]
    env = [
        op["value"]
        for p in overlay["patches"]
        if p.get("target", {}).get("kind") == "Deployment"
        for op in yaml.safe_load(p["patch"])
        if op["path"].endswith("/env/-")
    ]
    (watch,) = [e["value"] for e in env if e["name"] == "KVSCALE_WATCH_NAMESPACES"]
    return objects, main.watch_namespaces(None, watch)


def test_the_namespaced_install_has_the_cluster_roles_rules_as_roles_in_every_watched_namespace():
    objects, watched = namespaced_overlay()
    assert watched
    assert not [o for o in objects if o["kind"].startswith("Cluster")]
    roles = bound_roles(objects + docs(MANIFESTS / "base" / "leader.yaml"))
    need = needed(clusterwide=False)
    cluster_role = next(d for d in docs(MANIFESTS / "rbac.yaml") if d["kind"] == "ClusterRole")
    same = {g for g in grants(cluster_role) if (g[0], g[1]) not in CLUSTER_SCOPED}
    for namespace in watched:
        role = grants(roles[("kvscale-operator", namespace)])
        assert need["namespaced"] | need["marks"] <= role, need["namespaced"] | need["marks"] - role
        # The two modes grant the same per namespace, and the Role the pod marks too.
        assert role == same | need["marks"], role ^ (same | need["marks"])
    assert {ns for _, ns in roles} == {*watched, "kvscale-system"}
    assert need["cluster"] == set()
    assert need["lease"] <= grants(roles[("kvscale-operator-leader", "kvscale-system")])


def kubectl() -> str:
    """The kubectl that e2e/cluster.py builds (what CI has), else one on PATH."""
    built = REPO / "e2e" / ".bin" / "kubectl"
    found = str(built) if built.is_file() else shutil.which("kubectl")
    if found is None:
        pytest.skip("renders the kustomizations with kubectl: python3 e2e/cluster.py build makes one")
    return found


def test_both_kustomizations_render_and_differ_only_in_the_operators_rights():
    exe = kubectl()

    def render(path: Path) -> dict:
        out = subprocess.run([exe, "kustomize", str(path)], check=True, capture_output=True, text=True)
        return {
            (o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")): o for o in docs_of(out.stdout)
        }

    def docs_of(text: str) -> list[dict]:
        return [d for d in yaml.safe_load_all(text) if d]

    cluster, namespaced = render(MANIFESTS), render(MANIFESTS / "namespaced")
    assert not [k for k in namespaced if k[0].startswith("Cluster")]
    assert {k for k in cluster if k[0].startswith("Cluster")} == {
        ("ClusterRole", "kvscale-operator", None),
        ("ClusterRole", "kvscale-operator-pod-marks", None),
        ("ClusterRoleBinding", "kvscale-operator", None),
        ("ClusterRole", "kvscale-inferencedeployments-edit", None),
        ("ClusterRole", "kvscale-inferencedeployments-view", None),
    }
    deployment = ("Deployment", "kvscale-operator", "kvscale-system")
    env = {
        e["name"]: e.get("value")
        for e in namespaced[deployment]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    watched = main.watch_namespaces(None, env["KVSCALE_WATCH_NAMESPACES"])
    assert {k[2] for k in namespaced if k[0] == "Role"} == {*watched, "kvscale-system"}
    assert "KVSCALE_WATCH_NAMESPACES" not in json.dumps(cluster[deployment])
    shared = {k for k in cluster if not k[0].startswith("Cluster")}
    assert shared <= set(namespaced)
    for key in shared - {deployment}:
        assert cluster[key] == namespaced[key], key


def test_users_with_edit_manage_and_with_view_read_inferencedeployments():
    roles = {d["metadata"]["name"]: d for d in docs(MANIFESTS / "user-roles.yaml")}
    edit, view = roles["kvscale-inferencedeployments-edit"], roles["kvscale-inferencedeployments-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    # view aggregates into edit (and edit into admin); the edit role reads on its own too.
    editor = grants(edit)
    assert {(g, r, v) for g, r, v in grants(view)} <= editor
    for verb in ("get", "list", "watch", "create", "update", "patch", "delete"):
        assert (GROUP, PLURAL, verb) in editor
    assert {(GROUP, f"{PLURAL}/scale", v) for v in ("get", "update", "patch")} <= editor  # kubectl scale
    assert {v for g, r, v in grants(view)} == {"get", "list", "watch"}
    # Status and finalizers are the operator's: no user role writes them.
    assert not {
        g
        for g in editor
        if g[1] in (f"{PLURAL}/status", f"{PLURAL}/finalizers") and g[2] not in ("get", "list", "watch")
    }
    assert "kvscale-operator" not in json.dumps([r["rules"] for r in roles.values()])


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        (None, None, ()),
        (None, "", ()),
        (None, "team-a, team-b,,team-a", ("team-a", "team-b")),
        (["team-a", "team-b,team-c"], "ignored", ("team-a", "team-b", "team-c")),
    ],
)
def test_watch_namespaces_from_flags_or_env(flags, env, expected):
    assert main.watch_namespaces(flags, env) == expected


@pytest.mark.parametrize("bad", ["Team", "team_a", "team-*", "-a", "a" * 64])
def test_watch_namespaces_refuses_what_cannot_be_a_namespace(bad):
    with pytest.raises(ValueError, match="not a namespace name"):
        main.watch_namespaces([bad], None)


def test_kopf_scope_and_settings_of_the_namespaced_mode():
    assert main.kopf_scope(()) == {"clusterwide": True}
    assert main.kopf_scope(("a", "b")) == {"namespaces": ["a", "b"]}
    settings = kopf.OperatorSettings()
    assert not settings.scanning.disabled
    main._namespaced_settings(settings)
    assert settings.scanning.disabled  # no cluster-wide LIST/WATCH of Namespaces or CRDs


def test_run_parses_the_watch_namespaces_from_the_flag_and_the_env(monkeypatch):
    seen = {}
    monkeypatch.setattr(main, "cmd_run", lambda args: seen.setdefault("ns", args.watch_namespaces) and 0)
    monkeypatch.setenv("KVSCALE_WATCH_NAMESPACES", "from-env")
    main.main(["run", "--health-port", "0"])
    assert seen.pop("ns") == ("from-env",)
    main.main(["run", "--watch-namespace", "a", "--watch-namespace", "b"])
    assert seen.pop("ns") == ("a", "b")
    with pytest.raises(SystemExit):
        main.main(["run", "--watch-namespace", "Not_A_Namespace"])


class Recorder:
    """Stands in for the typed and the custom-objects clients: records each call, answers an
    empty list (or, for the typed clients, a response whose .data is one)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            self.calls.append((name, args))
            body = {"items": [{"metadata": {"name": name}}]}
            return body if "custom_object" in name else SimpleNamespace(data=json.dumps(body))

        return call


@pytest.mark.parametrize("namespaces", [(), ("team-a", "team-b")])
def test_the_resync_lists_only_in_the_watched_namespaces(monkeypatch, namespaces):
    recorder = Recorder()
    monkeypatch.setattr(kube_client.client, "CustomObjectsApi", lambda _: recorder)
    for typed in ("AppsV1Api", "CoreV1Api", "PolicyV1Api", "RbacAuthorizationV1Api", "NetworkingV1Api"):
        monkeypatch.setattr(kube_client.client, typed, lambda _: recorder)
    kube = Kube(None, namespaces)  # as `kvscale-operator run --watch-namespace ...` builds it
    resources = kube.list_resources()
    for kind in LISTED_KINDS:
        kube.list_children(kind)
    names = [name for name, _ in recorder.calls]
    if not namespaces:
        assert names == [
            "list_cluster_custom_object",
            "list_deployment_for_all_namespaces",
            "list_service_for_all_namespaces",
            "list_pod_disruption_budget_for_all_namespaces",
            "list_service_account_for_all_namespaces",
            "list_role_for_all_namespaces",
            "list_role_binding_for_all_namespaces",
            "list_network_policy_for_all_namespaces",
        ]
        return
    assert all(API_CALLS[n][3] == "namespaced" for n in names), names
    # The namespace: the third argument of a custom-objects call, the first of a typed one.
    listed = [(name, args[2] if "custom_object" in name else args[0]) for name, args in recorder.calls]
    assert [ns for _, ns in listed if _ == "list_namespaced_custom_object"] == ["team-a", "team-b"]
    assert len(resources) == 2  # both namespaces' items
    for method in (
        "list_namespaced_deployment",
        "list_namespaced_service",
        "list_namespaced_pod_disruption_budget",
        "list_namespaced_service_account",
        "list_namespaced_role",
        "list_namespaced_role_binding",
        "list_namespaced_network_policy",
    ):
        assert [ns for n, ns in listed if n == method] == ["team-a", "team-b"]
