"""The InferenceEndpoint (operator/reconcile/endpoint.py, endpoint_sync.py): which
InferenceDeployments are its pools, the shared router it renders, the members' own children, and
the reconciler over a fake API (the real API server: e2e/test_endpoint.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from kvscale.operator.api.endpoint import InferenceEndpointSpec
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.reconcile.admin_policy import AdminPolicy, NetworkPolicySettings
from kvscale.operator.reconcile.children import (
    KV_EVENTS_PORT,
    Owner,
    all_children,
    endpoint_url,
    key_of,
    router_selector_labels,
)
from kvscale.operator.reconcile.endpoint import MAX_MEMBERS, Member, endpoint_children, members
from kvscale.operator.reconcile.endpoint_sync import EndpointReconciler
from kvscale.operator.settings import Settings

OWNER = Owner("shared", "ns", "uid-e")


def resource(name: str, created: str = "2026-12-06T10:00:00Z", **spec: Any) -> dict[str, Any]:
    router = spec.pop("router", {"endpoint": "shared"})
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "creationTimestamp": created},
        "spec": {"model": {"uri": "pvc://models/tiny"}, "router": router, **spec},
    }


def args_of(children: list[dict]) -> list[str]:
    (dep,) = [c for c in children if c["kind"] == "Deployment"]
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


# -- who is in ----------------------------------------------------------------------------------


def test_members_in_join_order_with_their_model_adapters_and_wake():
    found, problems = members(
        "shared",
        [
            resource("b", "2026-12-06T10:00:02Z", model={"uri": "pvc://m/b", "servedName": "coder"}),
            resource("a", "2026-12-06T10:00:01Z", autoscaling={"minReplicas": 0, "maxReplicas": 2}),
            resource("other", router={"endpoint": "elsewhere"}),
            resource("own", router={}),
            resource("c", adapters=[{"name": "sql", "uri": "pvc://m/sql"}]),
        ],
    )
    assert problems == []
    assert [(m.deployment, m.model) for m in found] == [("c", "c"), ("a", "a"), ("b", "coder")]
    assert found[0].adapters == ("sql",)
    assert found[1].scales_from_zero and not found[0].scales_from_zero
    assert [m.pool_arg() for m in found] == ["c=c,adapters=sql", "a=a,scale=a", "coder=b"]


def test_a_name_already_served_leaves_the_later_member_out_and_says_why():
    found, problems = members(
        "shared",
        [
            resource("first", "2026-12-06T10:00:00Z", model={"uri": "pvc://m/x", "servedName": "llm"}),
            resource("second", "2026-12-06T10:00:05Z", model={"uri": "pvc://m/y", "servedName": "llm"}),
            # An adapter named as another member's model is the same clash.
            resource("third", "2026-12-06T10:00:09Z", adapters=[{"name": "llm", "uri": "pvc://m/a"}]),
            resource("odd", "2026-12-06T10:00:10Z", model={"uri": "pvc://m/z", "servedName": "a=b"}),
        ],
    )
    assert [m.deployment for m in found] == ["first"]
    assert problems == [
        "second: model 'llm' is already served here by first",
        "third: model 'llm' is already served here by first",
        "odd: its served name 'a=b' has a space or one of '=', ',' or '|'",
    ]


def test_the_member_budget_and_invalid_or_deleted_members():
    many = [
        resource(f"m{i:03d}", f"2026-12-06T10:{i // 60:02d}:{i % 60:02d}Z") for i in range(MAX_MEMBERS + 2)
    ]
    broken = resource("broken", "2026-12-06T11:00:00Z", replicas=-3)
    gone = resource("gone", "2026-12-06T11:00:01Z")
    gone["metadata"]["deletionTimestamp"] = "2026-12-06T12:00:00Z"
    found, problems = members("shared", [*many, broken, gone])
    assert len(found) == MAX_MEMBERS
    assert problems[:2] == [
        f"m{MAX_MEMBERS:03d}: the endpoint serves at most {MAX_MEMBERS} InferenceDeployments",
        f"m{MAX_MEMBERS + 1:03d}: the endpoint serves at most {MAX_MEMBERS} InferenceDeployments",
    ]
    assert problems[2] == "broken: its spec is invalid (see its status)"
    assert "gone" not in " ".join(problems) and all(m.deployment != "gone" for m in found)


# -- the shared router --------------------------------------------------------------------------


def test_the_router_gets_one_pool_per_member_and_may_wake_only_those_at_zero():
    pool = [Member("a", "a", (), True, 300), Member("b", "coder", ("sql", "docs"))]
    children = endpoint_children(OWNER, InferenceEndpointSpec(), pool, "router:1")
    args = args_of(children)
    assert args[args.index("--pool") + 1] == "a=a,scale=a"
    assert "coder=b,adapters=sql|docs" in args
    assert args[args.index("--queue-timeout") + 1] == "300"  # a pool's first worker may take that long
    assert "--kv-events-port" in args and args[args.index("--tokenizer") + 1] == "workers"
    (role,) = [c for c in children if c["kind"] == "Role"]
    scale = [r for r in role["rules"] if r["resources"] == ["deployments/scale"]]
    assert scale == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["a"],
            "verbs": ["get", "update"],
        }
    ]
    # Every child is the endpoint's, named as it, and garbage-collected with it.
    for c in children:
        assert c["metadata"]["name"] == "shared"
        (ref,) = c["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("InferenceEndpoint", "uid-e", True)
        assert "kvscale.dev/inference-deployment" not in c["metadata"]["labels"]


def test_no_member_no_scale_grant_and_no_router_pods():
    children = endpoint_children(OWNER, InferenceEndpointSpec(), [], "router:1")
    (dep,) = [c for c in children if c["kind"] == "Deployment"]
    assert dep["spec"]["replicas"] == 0
    (role,) = [c for c in children if c["kind"] == "Role"]
    # An empty resourceNames would grant every Deployment's scale: no rule at all instead.
    assert all("deployments/scale" not in r["resources"] for r in role["rules"])
    waking = endpoint_children(OWNER, InferenceEndpointSpec(), [Member("a", "a")], "router:1")
    assert all(
        "deployments/scale" not in r["resources"]
        for r in next(c for c in waking if c["kind"] == "Role")["rules"]
    )


def test_the_endpoints_pods_and_an_inference_deployments_router_never_select_each_other():
    """An InferenceDeployment and an InferenceEndpoint of the same name: their router Services
    must not select each other's pods."""
    (dep,) = [
        c
        for c in endpoint_children(Owner("x", "ns", "u"), InferenceEndpointSpec(), [Member("a", "a")], "r")
        if c["kind"] == "Deployment"
    ]
    endpoint_pods = dep["spec"]["template"]["metadata"]["labels"]
    own_selector = router_selector_labels("x")
    assert not own_selector.items() <= endpoint_pods.items()
    own = all_children(
        Owner("x", "ns", "u2"),
        InferenceDeploymentSpec.model_validate(resource("x")["spec"] | {"router": {}}),
        "w",
        "r",
    )
    (own_dep,) = [c for c in own if key_of(c) == "RouterDeployment"]
    assert (
        not dep["spec"]["selector"]["matchLabels"].items()
        <= own_dep["spec"]["template"]["metadata"]["labels"].items()
    )


def test_the_router_pods_policy_follows_the_admin_policy():
    on = endpoint_children(
        OWNER, InferenceEndpointSpec(), [Member("a", "a")], "r", net=NetworkPolicySettings()
    )
    off = endpoint_children(
        OWNER, InferenceEndpointSpec(), [Member("a", "a")], "r", net=NetworkPolicySettings(enabled=False)
    )
    assert [c["kind"] for c in on if c["kind"] == "NetworkPolicy"] == ["NetworkPolicy"]
    assert all(c["kind"] != "NetworkPolicy" for c in off)


# -- a member's own children --------------------------------------------------------------------


def test_a_member_has_no_router_of_its_own_and_admits_the_endpoints_routers():
    spec = InferenceDeploymentSpec.model_validate(resource("a")["spec"])
    owner = Owner("a", "ns", "uid-a")
    children = all_children(owner, spec, "w", "r", policy=AdminPolicy())
    keys = {key_of(c) for c in children}
    assert not keys & {"RouterDeployment", "RouterService", "ServiceAccount", "Role", "RouterNetworkPolicy"}
    (policy,) = [c for c in children if key_of(c) == "NetworkPolicy"]
    routers = policy["spec"]["ingress"][0]
    assert routers["from"] == [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "kvscale-router",
                    "kvscale.dev/inference-endpoint": "shared",
                }
            }
        }
    ]
    assert {"protocol": "TCP", "port": KV_EVENTS_PORT} in routers["ports"]
    assert endpoint_url(owner, spec) == "http://shared.ns.svc:8000"
    # Its workers still publish KV events for the shared router's precise index.
    (dep,) = [c for c in children if key_of(c) == "Deployment"]
    assert "--kv-events-config" in dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_an_endpoint_needs_the_router_on_and_a_service_name():
    with pytest.raises(ValidationError, match=r"router\.endpoint needs router\.enabled"):
        InferenceDeploymentSpec.model_validate(
            resource("a", router={"endpoint": "shared", "enabled": False})["spec"]
        )
    with pytest.raises(ValidationError, match="name of an InferenceEndpoint"):
        InferenceDeploymentSpec.model_validate(resource("a", router={"endpoint": "a.b"})["spec"])


# -- the reconciler over a fake API -------------------------------------------------------------


class FakeAPI:
    """The API server as the endpoint reconciler sees it: objects by (kind, name), every write."""

    def __init__(self, resources: list[dict]) -> None:
        self.endpoint = {
            "apiVersion": "kvscale.dev/v1alpha1",
            "kind": "InferenceEndpoint",
            "metadata": {"name": "shared", "namespace": "ns", "uid": "uid-e", "generation": 1},
            "spec": {},
        }
        self.resources = resources
        self.objects: dict[tuple[str, str], dict] = {}
        self.writes: list[tuple[str, str]] = []
        self.events: list[str] = []

    def get_endpoint(self, namespace, name):
        return copy.deepcopy(self.endpoint) if name == "shared" else None

    def list_resources_in(self, namespace):
        return copy.deepcopy(self.resources)

    def read(self, kind, name, namespace):
        return copy.deepcopy(self.objects.get((kind, name)))

    def apply(self, obj, manager=None):
        self.writes.append((obj["kind"], obj["metadata"]["name"]))
        self.objects[(obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(obj)
        return obj

    def apply_endpoint_status(self, namespace, name, status):
        self.writes.append(("status", name))
        self.endpoint["status"] = copy.deepcopy(status)

    def post_event(self, cr, reason, message, *, warning=False, kind=None):
        self.events.append(reason)


def reconciler(api: FakeAPI, tmp_path) -> EndpointReconciler:
    r = EndpointReconciler(api, Settings(router_image="router:1", policy_path=tmp_path / "none.yaml"))
    return r


def test_sync_applies_the_router_and_reports_the_models(tmp_path):
    api = FakeAPI([resource("a"), resource("b", model={"uri": "pvc://m/b", "servedName": "coder"})])
    r = reconciler(api, tmp_path)
    r.sync("ns", "shared")
    kinds = sorted(k for k, _ in api.writes if k != "status")
    assert kinds == sorted(
        [
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "NetworkPolicy",
        ]
    )
    status = api.endpoint["status"]
    assert status["endpoint"] == "http://shared.ns.svc:8000"
    assert [m["name"] for m in status["models"]] == ["a", "coder"]
    assert status["conditions"][0]["status"] == "True"
    # Nothing changed: nothing is written again.
    api.writes.clear()
    api.endpoint["status"] = status
    r.sync("ns", "shared")
    assert api.writes == []


def test_a_members_status_write_syncs_nothing_and_a_join_or_leave_does(tmp_path):
    api = FakeAPI([resource("a")])
    r = reconciler(api, tmp_path)
    r.member_changed(resource("a"), None)
    assert ("Deployment", "shared") in api.writes
    api.writes.clear()
    changed = resource("a")
    changed["status"] = {"ready": "1/1"}
    r.member_changed(changed, "MODIFIED")  # a status write: the member's part is unchanged
    assert api.writes == []
    # It leaves: the endpoint it named is synced (its router loses the pool).
    api.resources = []
    r.member_changed(resource("a", router={}), "MODIFIED")
    assert ("Deployment", "shared") in api.writes
    assert "--pool" not in args_of([api.objects[("Deployment", "shared")]])
    assert api.endpoint["status"]["conditions"][0]["reason"] == "NoModels"


def test_a_foreign_object_of_the_endpoints_name_is_not_taken_over(tmp_path):
    api = FakeAPI([resource("a")])
    api.objects[("Service", "shared")] = {
        "metadata": {"name": "shared", "labels": {"app": "someone-elses"}},
        "spec": {"selector": {"app": "theirs"}},
    }
    r = reconciler(api, tmp_path)
    r.sync("ns", "shared")
    assert ("Service", "shared") not in api.writes
    condition = api.endpoint["status"]["conditions"][0]
    assert (condition["status"], condition["reason"]) == ("False", "ChildConflict")
    assert api.events == ["ChildConflict"]
    r.sync("ns", "shared")  # said once
    assert api.events == ["ChildConflict"]


def test_left_out_members_are_reported(tmp_path):
    api = FakeAPI(
        [
            resource("a", model={"uri": "pvc://m/a", "servedName": "llm"}),
            resource("b", "2026-12-06T11:00:00Z", model={"uri": "pvc://m/b", "servedName": "llm"}),
        ]
    )
    r = reconciler(api, tmp_path)
    r.sync("ns", "shared")
    condition = api.endpoint["status"]["conditions"][0]
    assert condition["reason"] == "MembersLeftOut" and "b: model 'llm'" in condition["message"]
    assert [m["inferenceDeployment"] for m in api.endpoint["status"]["models"]] == ["a"]


def test_a_member_naming_a_missing_endpoint_is_told_once(tmp_path):
    api = FakeAPI([resource("a", router={"endpoint": "shraed"})])
    r = reconciler(api, tmp_path)
    typo = resource("a", router={"endpoint": "shraed"})
    r.member_changed(typo, None)
    assert api.events == ["EndpointNotFound"] and api.writes == []
    r.member_changed(typo, "MODIFIED")  # its next event: the same part, nothing said again
    assert api.events == ["EndpointNotFound"]
    api.resources = [resource("a")]
    r.member_changed(resource("a"), "MODIFIED")  # fixed: the endpoint gets its pool, no event
    assert api.events == ["EndpointNotFound"] and ("Deployment", "shared") in api.writes


def test_a_keyed_members_pool_checks_its_workers_key_at_the_shared_router():
    """A member with server.apiKeySecret: its pool gets keys= (the file its Secret is mounted as),
    so the shared router refuses a stranger before that model's queue and wake-up, and another
    member's key does not open it; an open member's pool has none."""
    found, _ = members(
        "shared",
        [
            resource("a", "2026-12-06T10:00:01Z", server={"apiKeySecret": "a-keys"}),
            resource("b", "2026-12-06T10:00:02Z"),
        ],
    )
    assert found[0].api_key_secret == "a-keys" and found[1].api_key_secret is None
    children = endpoint_children(OWNER, InferenceEndpointSpec(), found, "router:1")
    args = args_of(children)
    assert "a=a,keys=/etc/kvscale/router-api-keys/a/api-key" in args and "b=b" in args
    (dep,) = [c for c in children if c["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    keyed = [v for v in pod["volumes"] if "secret" in v]
    assert keyed == [
        {
            "name": "pool-keys-0",
            "secret": {"secretName": "a-keys", "items": [{"key": "api-key", "path": "api-key"}]},
        }
    ]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["pool-keys-0"] == {
        "name": "pool-keys-0",
        "mountPath": "/etc/kvscale/router-api-keys/a",
        "readOnly": True,
    }
    # The router parses what the operator renders.
    from kvscale.router.pool import parse_pool_specs

    specs = parse_pool_specs([a for i, a in enumerate(args) if i and args[i - 1] == "--pool"])
    assert [(s.model, s.keys) for s in specs] == [
        ("a", "/etc/kvscale/router-api-keys/a/api-key"),
        ("b", None),
    ]
