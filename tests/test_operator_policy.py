"""The admin policy (reconcile/admin_policy.py) refusing each field, the confused-deputy specs
refused (Secrets through env, a Hub token sent elsewhere, another's object taken over), and the
NetworkPolicies selecting the right pods and ports."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from kvscale.operator.api.labels import LABEL_MANAGED_BY, LABEL_OWNER, MANAGER
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.reconcile import admin_policy
from kvscale.operator.reconcile.admin_policy import AdminPolicy, NetworkPolicySettings, check
from kvscale.operator.reconcile.children import (
    Owner,
    all_children,
    foreign,
    key_of,
    network_policies,
    router_selector_labels,
    selector_labels,
)
from kvscale.operator.reconcile.reconciler import Reconciler
from kvscale.operator.settings import DEFAULT_POLICY_PATH, Settings

OWNER = Owner("tiny", "ns", "uid-1")


def spec(**fields) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": {"uri": "/models/tiny"}, **fields})


def fields(s: InferenceDeploymentSpec, p: AdminPolicy | None = None) -> list[str]:
    return [v.field for v in check(s, p or AdminPolicy())]


def pol(**fields) -> AdminPolicy:
    return AdminPolicy.model_validate(fields)


HF = {"uri": "hf://org/model"}


def test_a_plain_spec_passes_the_default_and_a_strict_policy():
    strict = pol(
        images=["registry.example.com/kvscale/*"],
        tolerations=[],
        nodeSelectors={},
        hfEndpoints=["https://huggingface.co"],
        secrets=[],
        maxGpusPerPod=1,
        maxReplicas=2,
        maxGpus=2,
    )
    assert fields(spec()) == []
    assert fields(spec(), strict) == []


# --- each field of the policy ------------------------------------------------------------------


def test_images_outside_the_allowed_patterns_are_refused():
    p = pol(images=["registry.example.com/kvscale/*"])
    assert fields(spec(image="registry.example.com/kvscale/worker:1"), p) == []
    assert fields(spec(image="docker.io/evil/miner:latest"), p) == ["spec.image"]
    assert fields(spec(router={"image": "docker.io/evil/router:1"}), p) == ["spec.router.image"]
    assert fields(spec(image="docker.io/evil/miner:latest")) == []  # no list: any image


def test_priority_classes_are_refused_unless_listed():
    s = spec(priorityClassName="system-node-critical")
    assert fields(s) == ["spec.priorityClassName"]  # the default allows none
    assert fields(s, pol(priorityClassNames=["system-node-critical"])) == []
    assert fields(spec(priorityClassName="tenant-a-batch"), pol(priorityClassNames=["tenant-a-*"])) == []
    assert fields(spec(priorityClassName="gpu-high"), pol(priorityClassNames=["gpu-low"])) == [
        "spec.priorityClassName"
    ]


def test_runtime_classes_are_refused_unless_listed():
    s = spec(runtimeClassName="nvidia")
    assert fields(s) == ["spec.runtimeClassName"]
    assert fields(s, pol(runtimeClassNames=["nvidia"])) == []


def test_a_toleration_of_every_taint_is_always_refused():
    s = spec(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}, {"operator": "Exists"}])
    assert fields(s) == ["spec.tolerations[1]"]
    everything = pol(tolerations=[{"key": "nvidia.com/gpu"}])
    assert fields(s, everything) == ["spec.tolerations[1]"]


def test_tolerations_must_match_a_listed_rule():
    p = pol(tolerations=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}])
    ok = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert fields(spec(tolerations=[ok]), p) == []
    assert fields(spec(tolerations=[{**ok, "effect": "NoExecute"}]), p) == ["spec.tolerations[0]"]
    assert fields(spec(tolerations=[{**ok, "effect": None}]), p) == ["spec.tolerations[0]"]  # every effect
    other = {"key": "tenant-b/reserved", "operator": "Exists"}
    assert fields(spec(tolerations=[ok, other]), p) == ["spec.tolerations[1]"]
    assert fields(spec(tolerations=[other])) == []  # no list: any with a key


def test_node_selectors_must_be_listed_and_node_affinity_is_refused_with_them():
    p = pol(nodeSelectors={"pool": ["tenant-a"], "kubernetes.io/arch": []})
    assert fields(spec(nodeSelector={"pool": "tenant-a", "kubernetes.io/arch": "amd64"}), p) == []
    assert fields(spec(nodeSelector={"pool": "tenant-b"}), p) == ["spec.nodeSelector[pool]"]
    assert fields(spec(nodeSelector={"zone": "a"}), p) == ["spec.nodeSelector[zone]"]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}
    assert fields(spec(affinity=affinity), p) == ["spec.affinity.nodeAffinity"]
    assert fields(spec(affinity=affinity, nodeSelector={"zone": "a"})) == []


def test_hub_endpoints_must_be_listed_and_the_default_hub_counts_as_one():
    p = pol(hfEndpoints=["https://hf-mirror.example.com/hub"])
    assert fields(spec(model={**HF, "hfEndpoint": "https://hf-mirror.example.com/hub/"}), p) == []
    assert fields(spec(model={**HF, "hfEndpoint": "https://hf-mirror.example.com/hubx"}), p) == [
        "spec.model.hfEndpoint"
    ]
    assert fields(spec(model={**HF, "hfEndpoint": "https://evil.example.com"}), p) == [
        "spec.model.hfEndpoint"
    ]
    assert fields(spec(model={**HF, "hfEndpoint": "http://hf-mirror.example.com/hub"}), p) == [
        "spec.model.hfEndpoint"  # the scheme is part of the match
    ]
    assert fields(spec(model=HF), p) == ["spec.model.uri"]  # https://huggingface.co, not listed
    assert fields(spec(model=HF), pol(hfEndpoints=["https://huggingface.co"])) == []
    assert fields(spec(), p) == []  # no hf:// model: no endpoint used


def test_claims_outside_the_allowed_patterns_are_refused():
    p = pol(claims=["models-*"])
    assert fields(spec(model={"uri": "pvc://models-shared/llama"}), p) == []
    assert fields(spec(model={"uri": "pvc://billing-db/data"}), p) == ["spec.model.uri"]
    assert fields(spec(model={**HF, "cacheClaim": "billing-db"}), p) == ["spec.model.cacheClaim"]
    draft = {"method": "draft", "draftModelUri": "pvc://other/draft"}
    assert fields(spec(model={"uri": "pvc://models-a/m"}, speculative=draft), p) == [
        "spec.speculative.draftModelUri"
    ]
    assert fields(spec(model={"uri": "pvc://billing-db/data"})) == []  # no list: any claim


def test_limits_on_gpus_and_replicas():
    gpu = {"gpus": 4, "cpu": "8", "memory": "64Gi"}
    assert fields(spec(resources=gpu), pol(maxGpusPerPod=2)) == ["spec.resources.gpus"]
    assert fields(spec(replicas=5), pol(maxReplicas=4)) == ["spec.replicas"]
    auto = {"minReplicas": 1, "maxReplicas": 10}
    assert fields(spec(autoscaling=auto), pol(maxReplicas=4)) == ["spec.autoscaling.maxReplicas"]
    assert fields(spec(router={"replicas": 8}), pol(maxReplicas=4)) == ["spec.router.replicas"]
    # 2 GPUs x 2 pods per group x 3 groups = 12.
    group = {"resources": {"gpus": 2}, "parallelism": {"tensor": 4, "nodes": 2}, "replicas": 3}
    (v,) = check(spec(**group), pol(maxGpus=8))
    assert v.field == "spec.replicas" and "12 GPUs" in v.message


# --- confused deputy ---------------------------------------------------------------------------


def env_secret(name: str, secret: str) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": "k"}}}


def test_env_may_not_mount_a_secret_the_spec_does_not_name_for_a_purpose():
    s = spec(env=[env_secret("DB", "tenant-b-database")])
    assert fields(s) == ["spec.env[DB].valueFrom.secretKeyRef.name"]
    # The Secrets named for a purpose may be read through env too; a ConfigMap always.
    named = spec(
        model={**HF, "hfTokenSecret": {"name": "hub"}},
        server={"apiKeySecret": "keys"},
        env=[
            env_secret("A", "hub"),
            env_secret("B", "keys"),
            {"name": "C", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}},
        ],
    )
    assert fields(named) == []
    # A pull Secret is for the kubelet: not a way to get one into the container.
    pull = spec(imagePullSecrets=[{"name": "regcred"}], env=[env_secret("R", "regcred")])
    assert fields(pull) == ["spec.env[R].valueFrom.secretKeyRef.name"]


def test_with_a_secrets_list_every_secret_reference_must_match_it():
    p = pol(secrets=["tiny-*"])
    s = spec(
        model={**HF, "hfTokenSecret": {"name": "cluster-admin-token"}},
        server={"apiKeySecret": "tiny-keys"},
        imagePullSecrets=[{"name": "other-regcred"}],
        env=[env_secret("X", "tiny-extra"), env_secret("Y", "vault-root")],
    )
    assert fields(s, p) == [
        "spec.model.hfTokenSecret.name",
        "spec.imagePullSecrets[other-regcred]",
        "spec.env[Y].valueFrom.secretKeyRef.name",
    ]


def test_the_hub_token_is_never_sent_in_the_clear():
    plain = {**HF, "hfTokenSecret": {"name": "hub"}, "hfEndpoint": "http://mirror.internal:8080"}
    assert fields(spec(model=plain)) == ["spec.model.hfEndpoint"]
    assert fields(spec(model={**plain, "hfEndpoint": "https://mirror.internal"})) == []
    assert fields(spec(model={**HF, "hfEndpoint": "http://mirror.internal"})) == []  # no token to leak
    # Only the admin can vouch for an http mirror; the allow-list alone does not.
    assert fields(spec(model=plain), pol(insecureHfEndpoints=["http://mirror.internal:*"])) == []
    assert fields(spec(model=plain), pol(hfEndpoints=["http://mirror.internal:8080"])) == [
        "spec.model.hfEndpoint"
    ]


def test_env_may_not_replace_the_endpoint_or_the_token_the_policy_checks():
    s = spec(
        model={**HF, "hfTokenSecret": {"name": "hub"}},
        env=[{"name": "HF_ENDPOINT", "value": "http://evil.example.com"}, {"name": "HF_TOKEN", "value": "x"}],
    )
    assert fields(s) == ["spec.env[HF_ENDPOINT]", "spec.env[HF_TOKEN]"]


def test_an_object_of_a_childs_name_is_taken_only_when_it_is_ours():
    ours = {"metadata": {"ownerReferences": [{"uid": "uid-1", "kind": "InferenceDeployment"}]}}
    assert foreign(None, OWNER) is None
    assert foreign(ours, OWNER) is None
    # A previous resource of this name, gone before the garbage collector took its children.
    previous = {
        "metadata": {
            "ownerReferences": [
                {"uid": "old", "kind": "InferenceDeployment", "apiVersion": "kvscale.dev/v1alpha1",
                 "name": "tiny", "controller": True}
            ]
        }
    }  # fmt: skip
    assert foreign(previous, OWNER) is None
    orphan = {"metadata": {"labels": {LABEL_MANAGED_BY: MANAGER, LABEL_OWNER: "tiny"}}}
    assert foreign(orphan, OWNER) is None
    # Someone else's: a Service made by hand, a Helm release's, another resource's child.
    assert foreign({"metadata": {"name": "tiny"}}, OWNER) == "not created by the operator"
    helm = {"metadata": {"labels": {LABEL_MANAGED_BY: "Helm"}}}
    assert foreign(helm, OWNER) == "managed by Helm"
    other = {
        "metadata": {
            "ownerReferences": [{"uid": "u", "kind": "Deployment", "name": "web", "controller": True}]
        }
    }
    assert foreign(other, OWNER) == "controlled by Deployment web"
    another = {"metadata": {"labels": {LABEL_MANAGED_BY: MANAGER, LABEL_OWNER: "other"}}}
    assert foreign(another, OWNER) is not None


# --- the sync: a refusal is reported once, and nothing is applied ------------------------------


class FakeApi:
    """The reconciler's Kubernetes API (read, apply, status), recorded."""

    def __init__(self, cr: dict, live: dict[tuple[str, str], dict] | None = None) -> None:
        self.cr, self.live = cr, dict(live or {})
        self.applied: list[tuple[str, str]] = []
        self.statuses: list[dict] = []

    def reconciler(self, policy_path: Path, settings: Settings | None = None) -> Reconciler:
        """A reconciler over this API, with the admin policy at `policy_path`."""
        return Reconciler(self, replace(settings or Settings(), policy_path=policy_path))

    def get_resource(self, namespace: str, name: str) -> dict:
        return self.cr

    def read(self, kind: str, name: str, namespace: str) -> dict | None:
        return self.live.get((kind, name))

    def post_event(self, *args, **kwargs) -> None:
        pass

    def apply(self, obj: dict, manager: str = MANAGER) -> dict:
        self.applied.append((obj["kind"], obj["metadata"]["name"]))
        out = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(len(self.applied))}}
        self.live[(obj["kind"], obj["metadata"]["name"])] = out
        return out

    def apply_status(self, namespace: str, name: str, status: dict, manager: str) -> None:
        self.statuses.append(status)
        self.cr["status"] = {**self.cr.get("status", {}), **status}

    def degraded(self) -> dict:
        return next(c for c in self.cr["status"]["conditions"] if c["type"] == "Degraded")


def resource(**spec_fields) -> dict:
    return {
        "metadata": {"name": "tiny", "namespace": "ns", "uid": "uid-1", "generation": 1},
        "spec": {"model": {"uri": "/models/tiny"}, **spec_fields},
    }


@pytest.fixture
def policy_file(tmp_path) -> Path:
    return tmp_path / "policy.yaml"


def test_a_refused_spec_applies_nothing_and_is_reported_once(monkeypatch, policy_file):
    fake = FakeApi(
        resource(priorityClassName="system-cluster-critical", tolerations=[{"operator": "Exists"}])
    )
    sync = fake.reconciler(policy_file).sync
    assert sync("ns", "tiny", apply_all=True) is None  # not retried: nothing transient
    assert fake.applied == []
    d = fake.degraded()
    assert d["status"] == "True" and d["reason"] == "PolicyViolation"
    assert "spec.priorityClassName" in d["message"] and "spec.tolerations[0]" in d["message"]
    for _ in range(3):  # the watchers and the resync: no write while nothing changes
        sync("ns", "tiny")
    assert len(fake.statuses) == 1 and fake.applied == []
    # The admin allows it: the next sync applies, without a spec change.
    policy_file.write_text("priorityClassNames: [system-cluster-critical]\n")
    fake.cr["spec"]["tolerations"] = [{"key": "gpu", "operator": "Exists"}]  # (the same generation)
    sync("ns", "tiny")
    assert ("Deployment", "tiny") in fake.applied
    assert fake.degraded()["status"] == "False"


def test_an_invalid_policy_file_applies_nothing(monkeypatch, policy_file):
    policy_file.write_text("maxGpus: lots\n")
    fake = FakeApi(resource())
    sync = fake.reconciler(policy_file).sync
    sync("ns", "tiny", apply_all=True)
    assert fake.applied == [] and fake.degraded()["reason"] == "PolicyInvalid"


def test_a_service_of_the_same_name_owned_by_someone_else_is_not_taken(monkeypatch, policy_file):
    theirs = {"metadata": {"name": "tiny", "resourceVersion": "9", "labels": {"app": "web"}}, "spec": {}}
    fake = FakeApi(resource(), live={("Service", "tiny"): theirs})
    sync = fake.reconciler(policy_file).sync
    assert sync("ns", "tiny", apply_all=True) is None
    assert ("Service", "tiny") not in fake.applied
    assert fake.live[("Service", "tiny")] is theirs
    d = fake.degraded()
    assert d["reason"] == "ChildConflict" and "Service ns/tiny" in d["message"]
    assert "not created by the operator" in d["message"]


def test_a_role_of_the_routers_name_owned_by_someone_else_is_not_taken(monkeypatch, policy_file):
    theirs = {"metadata": {"name": "tiny-router", "resourceVersion": "3"}, "rules": []}
    fake = FakeApi(resource(), live={("Role", "tiny-router"): theirs})
    sync = fake.reconciler(policy_file).sync
    sync("ns", "tiny", apply_all=True)
    assert ("Role", "tiny-router") not in fake.applied and ("RoleBinding", "tiny-router") not in fake.applied
    assert fake.degraded()["reason"] == "ChildConflict"


# --- pods and NetworkPolicies ------------------------------------------------------------------


def pod_specs(objs: list[dict]) -> list[dict]:
    return [o["spec"]["template"]["spec"] for o in objs if o["kind"] == "Deployment"]


def test_pods_run_as_non_root_without_a_fixed_uid_unless_the_policy_sets_one():
    for pod in pod_specs(all_children(OWNER, spec(), "w:1", "r:1")):  # workers and router
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True
        assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(ctx)
    ids = pol(podSecurity={"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000})
    worker, router = pod_specs(all_children(OWNER, spec(), "w:1", "r:1", policy=ids))
    assert worker["securityContext"]["runAsUser"] == 1000 and worker["securityContext"]["fsGroup"] == 1000
    assert router["securityContext"]["runAsUser"] == 1000 and "fsGroup" not in router["securityContext"]


def test_the_dockerfile_sets_a_numeric_user():
    text = (Path(__file__).resolve().parents[1] / "Dockerfile").read_text()
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert users and all(u.split(":")[0].isdigit() for u in users)  # runAsNonRoot checks a number


def peers(rule: dict) -> list[dict]:
    return rule["from"]


def ports(rule: dict) -> list:
    return [p["port"] for p in rule.get("ports", [])]


def test_workers_accept_only_their_router_and_the_operators_scrapes():
    objs = {key_of(o): o for o in all_children(OWNER, spec(), "w:1", "r:1", operator_namespace="ops")}
    worker = objs["NetworkPolicy"]["spec"]
    assert worker["podSelector"] == {"matchLabels": selector_labels("tiny")}
    assert worker["policyTypes"] == ["Ingress"]
    router_rule, scrape_rule = worker["ingress"]
    assert peers(router_rule) == [{"podSelector": {"matchLabels": router_selector_labels("tiny")}}]
    assert peers(scrape_rule) == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvscale-operator"}},
        }
    ]
    # The routers also subscribe to the workers' KV events (the precise index, the default); the
    # scrapers reach the API port only.
    assert ports(router_rule) == [8000, 5557, 5558] and ports(scrape_rule) == [8000]
    # The router's own pods are not the workers': its policy selects them, not the workers.
    router = objs["RouterNetworkPolicy"]
    assert router["metadata"]["name"] == "tiny-router"
    assert router["spec"]["podSelector"] == {"matchLabels": router_selector_labels("tiny")}
    clients, scrapes = router["spec"]["ingress"]
    assert peers(clients) == [{"podSelector": {}}]  # default: the resource's namespace
    assert ports(clients) == [8000] and peers(scrapes) == peers(scrape_rule)


def test_the_policy_chooses_the_routers_clients_and_extra_scrapers():
    net = NetworkPolicySettings.model_validate(
        {
            "clientsFrom": [{"namespaceSelector": {"matchLabels": {"gateway": "true"}}}],
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
        }
    )
    worker, router = network_policies(OWNER, spec(), net, "ops")
    assert peers(router["spec"]["ingress"][0]) == net.clients_from
    assert net.metrics_from[0] in peers(worker["spec"]["ingress"][1])
    assert net.clients_from[0] not in [p for r in worker["spec"]["ingress"] for p in peers(r)]
    # Without the router, the clients reach the workers directly, and no router policy is left.
    (direct,) = network_policies(OWNER, spec(router={"enabled": False}), net, "ops")
    assert peers(direct["spec"]["ingress"][0]) == net.clients_from
    assert network_policies(OWNER, spec(), NetworkPolicySettings(enabled=False), "ops") == []


def test_with_an_inference_pool_the_gateways_clients_reach_the_workers_too():
    objs = {key_of(o): o for o in all_children(OWNER, spec(), "w:1", "r:1", pools=True)}
    assert "InferencePool" in objs
    rules = objs["NetworkPolicy"]["spec"]["ingress"]
    assert [peers(r) for r in rules][:2] == [
        [{"podSelector": {"matchLabels": router_selector_labels("tiny")}}],
        [{"podSelector": {}}],  # the clients, as the router's
    ]
    off = spec(inferencePool={"enabled": False})
    rules = {key_of(o): o for o in all_children(OWNER, off, "w:1", "r:1", pools=True)}["NetworkPolicy"]
    assert [{"podSelector": {}}] not in [peers(r) for r in rules["spec"]["ingress"]]


def test_a_multi_node_groups_ranks_reach_each_other_on_every_port():
    group = spec(parallelism={"tensor": 2, "nodes": 2})
    worker = network_policies(OWNER, group, NetworkPolicySettings(), "ops")[0]["spec"]
    ranks = worker["ingress"][-1]
    assert (
        peers(ranks) == [{"podSelector": {"matchLabels": selector_labels("tiny")}}] and "ports" not in ranks
    )
    assert all(
        "ports" in r
        for r in network_policies(OWNER, spec(), NetworkPolicySettings(), "ops")[0]["spec"]["ingress"]
    )


REPO = Path(__file__).resolve().parents[1]


def test_the_example_policy_parses_and_the_examples_pass_the_default_policy():
    (cm,) = [d for d in yaml.safe_load_all((REPO / "manifests" / "policy-example.yaml").read_text()) if d]
    example = admin_policy.parse(cm["data"]["policy.yaml"])
    assert example.network_policy.clients_from and example.max_gpus == 32
    checked = []
    for path in sorted((REPO / "manifests" / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferenceDeployment":
                assert check(InferenceDeploymentSpec.model_validate(doc["spec"]), AdminPolicy()) == [], path
                checked.append(path.name)
    assert "tiny-cpu.yaml" in checked  # a wrong folder checks nothing


def test_the_operator_mounts_the_policy_where_it_reads_it():
    dep = yaml.safe_load((REPO / "manifests" / "base" / "deployment.yaml").read_text())
    pod = dep["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("configMap")]
    assert volume["configMap"] == {"name": "kvscale-operator-policy", "optional": True}
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert str(Path(mount["mountPath"]) / "policy.yaml") == DEFAULT_POLICY_PATH


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_each_policy_selects_exactly_its_pods_and_the_peers_match_the_real_pod_labels():
    objs = {key_of(o): o for o in all_children(OWNER, spec(), "w:1", "r:1")}
    other = {key_of(o): o for o in all_children(Owner("other", "ns", "uid-2"), spec(), "w:1", "r:1")}
    worker_pod = objs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    router_pod = objs["RouterDeployment"]["spec"]["template"]["metadata"]["labels"]
    other_router = other["RouterDeployment"]["spec"]["template"]["metadata"]["labels"]
    other_worker = other["Deployment"]["spec"]["template"]["metadata"]["labels"]
    workers, router = objs["NetworkPolicy"]["spec"], objs["RouterNetworkPolicy"]["spec"]
    assert selects(workers["podSelector"], worker_pod) and not selects(workers["podSelector"], router_pod)
    assert not selects(workers["podSelector"], other_worker)
    assert selects(router["podSelector"], router_pod) and not selects(router["podSelector"], worker_pod)
    from_router = workers["ingress"][0]["from"][0]["podSelector"]
    assert selects(from_router, router_pod)
    assert not selects(from_router, other_router)  # another resource's router is not let in
    assert not selects(from_router, worker_pod)
    # The operator's peer matches the operator's own pods (manifests/base/deployment.yaml).
    operator_dep = yaml.safe_load((REPO / "manifests" / "base" / "deployment.yaml").read_text())
    operator_pod = operator_dep["spec"]["template"]["metadata"]["labels"]
    assert selects(workers["ingress"][1]["from"][0]["podSelector"], operator_pod)
    # The ports the peers may use are the ones the containers serve (the API and /metrics; to the
    # routers, the KV events too).
    (container,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    served = [p["containerPort"] for p in container["ports"]]
    assert [p["port"] for p in workers["ingress"][0]["ports"]] == served
    assert [p["port"] for p in workers["ingress"][1]["ports"]] == served[:1]


def test_the_sync_applies_the_policys_pod_ids_and_its_network_peers(monkeypatch, policy_file):
    policy_file.write_text(
        "podSecurity: {runAsUser: 1000700000}\n"
        "networkPolicy: {clientsFrom: [{namespaceSelector: {matchLabels: {gw: 'yes'}}}]}\n"
    )
    fake = FakeApi(resource())
    # The operator's namespace as its Deployment tells it (the downward API's POD_NAMESPACE).
    sync = fake.reconciler(policy_file, Settings.from_env({"POD_NAMESPACE": "platform-ops"})).sync
    sync("ns", "tiny", apply_all=True)
    dep = fake.live[("Deployment", "tiny")]
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 1000700000
    router = fake.live[("NetworkPolicy", "tiny-router")]["spec"]["ingress"]
    assert router[0]["from"] == [{"namespaceSelector": {"matchLabels": {"gw": "yes"}}}]
    workers = fake.live[("NetworkPolicy", "tiny")]["spec"]["ingress"]
    assert workers[1]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "platform-ops"
    }


def test_the_precise_index_wires_the_workers_events_to_the_routers_and_approximate_does_not():
    """prefixIndex precise (the default): the workers publish KV events on 5557/5558 (named ports),
    the routers subscribe there and fetch the tokenizer from the workers; approximate: none of it."""
    from kvscale.operator.reconcile.children import router_args, worker_args

    precise, approximate = spec(), spec(router={"prefixIndex": "approximate"})
    args = worker_args("tiny", precise, "/models/tiny", None)
    config = json.loads(args[args.index("--kv-events-config") + 1])
    assert config["enable_kv_cache_events"] and config["endpoint"] == "tcp://*:5557"
    assert config["replay_endpoint"] == "tcp://*:5558"
    r = router_args(OWNER, precise)
    assert r[r.index("--kv-events-port") + 1] == "5557" and r[r.index("--tokenizer") + 1] == "workers"
    assert "--kv-events-config" not in worker_args("tiny", approximate, "/models/tiny", None)
    assert "--kv-events-port" not in router_args(OWNER, approximate)
    (worker, _) = network_policies(OWNER, approximate, NetworkPolicySettings(), "ops")
    assert ports(worker["spec"]["ingress"][0]) == [8000]
    # No router: nobody subscribes, so the workers publish nothing.
    assert "--kv-events-config" not in worker_args("tiny", spec(router={"enabled": False}), "/m", None)
    # A multi-node group: only the leader's engine has a block pool; its other ranks publish nothing.
    from kvscale.operator.reconcile.children import leader_worker_set

    group = leader_worker_set(OWNER, spec(parallelism={"tensor": 2, "nodes": 2}), "img")
    templates = group["spec"]["leaderWorkerTemplate"]
    (leader,) = templates["leaderTemplate"]["spec"]["containers"]
    (follower,) = templates["workerTemplate"]["spec"]["containers"]
    assert "--kv-events-config" in leader["args"] and "--kv-events-config" not in follower["args"]
    assert "kv-events" in {p["name"] for p in leader["ports"]}
    assert "kv-events" not in {p["name"] for p in follower["ports"]}


def test_a_precise_router_has_a_writable_tmp_for_the_tokenizer_it_fetches():
    """The router's root filesystem is read-only; the tokenizer it fetches from a worker is written
    to a temp folder first: the precise index gets a small /tmp, approximate none."""
    from kvscale.operator.reconcile.children import router_deployment

    pod = router_deployment(OWNER, spec(), "img")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "128Mi"}} in pod["volumes"]
    plain = router_deployment(OWNER, spec(router={"prefixIndex": "approximate"}), "img")["spec"]["template"]
    assert "volumes" not in plain["spec"]
