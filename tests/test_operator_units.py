"""The operator's pure parts: the CRD is generated from the models and committed, the children
say what the spec asks, status follows the Deployment (the lease decisions: test_leader_election.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from pydantic import ValidationError

from kvscale.operator.api.crd import crd, crd_yaml, reference_markdown
from kvscale.operator.api.labels import LABEL_MANAGED_BY, LABEL_OWNER, MANAGER
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.reconcile.children import (
    PRESTOP_SECONDS,
    ROUTER_KEYS,
    Owner,
    all_children,
    children,
    deployment,
    endpoint_url,
    inference_pool,
    key_of,
    replicas_handover,
    router_children,
    router_name,
    selector_labels,
    selector_string,
)
from kvscale.operator.reconcile.status import compute_status

REPO = Path(__file__).resolve().parents[1]
OWNER = Owner("tiny", "ns", "uid-1")


def spec(**fields) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": {"uri": "/models/tiny"}, **fields})


def test_committed_crd_is_generated_from_the_models():
    committed = (REPO / "crds" / "inferencedeployments.kvscale.dev.yaml").read_text()
    assert committed == crd_yaml(), (
        "crds/ is stale: run `kvscale-operator crd > crds/inferencedeployments.kvscale.dev.yaml`"
    )
    committed = (REPO / "crds" / "inferenceendpoints.kvscale.dev.yaml").read_text()
    assert committed == crd_yaml(endpoint=True), (
        "crds/ is stale: run `kvscale-operator crd --endpoint > crds/inferenceendpoints.kvscale.dev.yaml`"
    )


def test_crd_schema_is_structural_and_documented():
    version = crd()["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def walk(node: dict, path: str) -> None:
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        for name, sub in node.get("properties", {}).items():
            assert sub.get("description"), (
                f"{path}.{name} has no description (kubectl explain would be empty)"
            )
            walk(sub, f"{path}.{name}")
        if "items" in node:
            walk(node["items"], path + "[]")

    walk(schema, "spec")
    assert schema["required"] == ["model"]
    assert schema["x-kubernetes-validations"][0]["message"].startswith("with autoscaling the operator's")
    assert schema["properties"]["speculative"]["properties"]["method"]["enum"] == ["draft", "ngram"]
    assert schema["properties"]["autoscaling"]["properties"]["minReplicas"]["minimum"] == 0  # scale to zero
    assert schema["properties"]["replicas"]["default"] == 1  # GET /scale fails on an absent field
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Model",
        "Ready",
        "KV Usage",
        "Status",
        "Age",
    ]
    assert "| `spec.engine.maxNumSeqs` | integer | `256` |" in reference_markdown()


def test_models_refuse_what_the_schema_refuses():
    with pytest.raises(ValidationError):
        spec(autoscaling={"minReplicas": -1, "maxReplicas": 2})
    assert spec(autoscaling={"minReplicas": 0, "maxReplicas": 2}).autoscaling.min_replicas == 0
    with pytest.raises(ValidationError, match="needs the router"):  # nothing would wake it
        spec(autoscaling={"minReplicas": 0, "maxReplicas": 2}, router={"enabled": False})
    with pytest.raises(ValidationError):
        spec(speculative={"method": "medusa"})
    with pytest.raises(ValidationError):
        InferenceDeploymentSpec.model_validate({"replicas": 1})
    with pytest.raises(ValidationError):
        spec(model={"uri": "http://example.com/model"})
    assert spec().desired_replicas == 1
    assert spec(replicas=3).desired_replicas == 3
    assert spec(autoscaling={"maxReplicas": 3}).desired_replicas is None


def test_children_are_owned_labelled_and_follow_the_spec():
    s = spec(
        replicas=2,
        engine={
            "maxNumSeqs": 16,
            "maxModelLen": 1024,
            "enablePrefixCaching": False,
            "extraArgs": ["--seed", "7"],
        },
        server={"drainTimeoutSeconds": 20, "startupTimeoutSeconds": 300, "apiKeySecret": "keys"},
        resources={"gpus": 1, "cpu": "4", "memory": "16Gi"},
        nodeSelector={"gpu": "h100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        env=[
            {"name": "A", "value": "1"},
            {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
    )
    objs = children(OWNER, s, "img:1")
    assert [o["kind"] for o in objs] == ["Deployment", "Service", "PodDisruptionBudget"]
    for o in objs:
        ref = o["metadata"]["ownerReferences"][0]
        assert ref["uid"] == "uid-1" and ref["controller"] and ref["kind"] == "InferenceDeployment"
        assert o["metadata"]["labels"][LABEL_MANAGED_BY] == "kvscale-operator"
        assert o["metadata"]["labels"][LABEL_OWNER] == "tiny"
    dep = objs[0]
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = c["args"]
    assert args[:3] == ["serve", "--model", "/models/tiny"]
    assert (
        args[args.index("--max-num-seqs") + 1] == "16" and args[args.index("--max-model-len") + 1] == "1024"
    )
    assert "--no-enable-prefix-caching" in args and args[-2:] == ["--seed", "7"]
    assert args[args.index("--served-model-name") + 1] == "tiny"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and c["resources"]["requests"]["cpu"] == "4"
    assert (
        c["readinessProbe"]["httpGet"]["path"] == "/ready"
        and c["livenessProbe"]["httpGet"]["path"] == "/health"
    )
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300
    assert pod["terminationGracePeriodSeconds"] > 20 + PRESTOP_SECONDS
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    env = {e["name"]: e for e in c["env"]}
    assert env["KVSCALE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-key"}
    assert env["A"]["value"] == "1" and env["B"]["valueFrom"]["secretKeyRef"]["name"] == "s"
    assert objs[1]["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert objs[2]["spec"]["maxUnavailable"] == 1


def test_autoscaling_leaves_replicas_to_the_autoscaler_and_pvc_models_are_mounted():
    s = spec(
        model={"uri": "pvc://models/llama-8b"},
        speculative={"method": "draft", "draftModelUri": "pvc://models/llama-1b", "numSpeculativeTokens": 5},
        autoscaling={"minReplicas": 1, "maxReplicas": 4},
    )
    dep = deployment(OWNER, s, "img")
    assert "replicas" not in dep["spec"]
    pod = dep["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/models/llama-8b"
    assert args[args.index("--draft-model") + 1] == "/models/models/llama-1b"
    assert args[args.index("--speculative-method") + 1] == "draft"
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert len(claims) == 1 and claims[0]["persistentVolumeClaim"] == {
        "claimName": "models",
        "readOnly": True,
    }


def live_deployment(replicas: int | None, managers: list[tuple[str, str, dict]]) -> dict:
    fields = [{"manager": m, "operation": op, "fieldsV1": f} for m, op, f in managers]
    spec = {} if replicas is None else {"replicas": replicas}
    return {"metadata": {"name": "tiny", "namespace": "ns", "managedFields": fields}, "spec": spec}


def test_switching_to_autoscaling_hands_the_live_replica_count_over():
    ours = (MANAGER, "Apply", {"f:spec": {"f:replicas": {}, "f:template": {}}})
    handover = replicas_handover(live_deployment(3, [ours]))
    assert handover == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "tiny", "namespace": "ns"},
        "spec": {"replicas": 3},  # today's count, so the co-owned field survives our apply
    }
    # Nothing to hand over: the field is not ours (already handed over, or the autoscaler's own
    # scale updates), or ours only through an Update, or there is no count.
    scaler = ("kvscale-autoscaler", "Update", {"f:spec": {"f:replicas": {}}})
    without = (MANAGER, "Apply", {"f:spec": {"f:template": {}}})
    assert replicas_handover(live_deployment(3, [without, scaler])) is None
    assert (
        replicas_handover(live_deployment(3, [(MANAGER, "Update", {"f:spec": {"f:replicas": {}}})])) is None
    )
    assert replicas_handover(live_deployment(None, [ours])) is None
    assert (
        replicas_handover({"metadata": {"name": "tiny", "namespace": "ns"}, "spec": {"replicas": 2}}) is None
    )


def test_the_reconciler_never_writes_the_autoscalers_condition():
    common = {
        "name": "x",
        "generation": 2,
        "selector": "s",
        "now": "t",
        "deployment": deployment_status(2, 2, 2, 2),
    }
    # The autoscaler applies ScalingActive under its own field manager; the reconciler's status
    # leaves it out with or without autoscaling (tests/test_selfheal_units.py: who owns what).
    scaling = {"type": "ScalingActive", "status": "True", "reason": "MetricsAvailable", "message": ""}
    for desired in (None, 2):
        status = compute_status(**common, desired=desired, previous_conditions=[scaling])
        assert "ScalingActive" not in {c["type"] for c in status["conditions"]}


def deployment_status(
    want: int, ready: int, updated: int, replicas: int, generation: int = 1, observed: int = 1
):
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": want},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
        },
    }


def test_status_follows_the_deployment_and_keeps_transition_times():
    common = {"name": "tiny", "generation": 3, "selector": selector_string("tiny")}
    creating = compute_status(**common, desired=2, deployment=None, previous_conditions=[], now="t0")
    cond = {c["type"]: c for c in creating["conditions"]}
    assert cond["Ready"]["status"] == "False" and cond["Progressing"]["reason"] == "Creating"
    rolling = compute_status(
        **common,
        desired=2,
        deployment=deployment_status(2, 1, 1, 3),
        previous_conditions=creating["conditions"],
        now="t1",
    )
    cond = {c["type"]: c for c in rolling["conditions"]}
    assert cond["Progressing"]["reason"] == "RollingOut" and cond["Ready"]["reason"] == "PartiallyReady"
    assert cond["Ready"]["lastTransitionTime"] == "t0"  # still False: no transition
    # All wanted workers ready, but one still on the old spec: not "PartiallyReady 2/2".
    surged = compute_status(
        **common,
        desired=2,
        deployment=deployment_status(2, 3, 1, 3),
        previous_conditions=rolling["conditions"],
        now="t1",
    )
    cond = {c["type"]: c for c in surged["conditions"]}
    assert cond["Ready"]["status"] == "False" and cond["Ready"]["reason"] == "RollingOut"
    assert cond["Ready"]["message"] == "rolling out: 3 workers ready (2 wanted), 1 on the current spec"
    done = compute_status(
        **common,
        desired=2,
        deployment=deployment_status(2, 2, 2, 2),
        previous_conditions=rolling["conditions"],
        now="t2",
    )
    cond = {c["type"]: c for c in done["conditions"]}
    assert cond["Ready"]["status"] == "True" and cond["Ready"]["lastTransitionTime"] == "t2"
    assert cond["Progressing"]["status"] == "False" and cond["Degraded"]["status"] == "False"
    assert done["ready"] == "2/2" and done["observedGeneration"] == 3
    # A Deployment that has not yet seen its new spec is not Ready, whatever its counts say.
    stale = compute_status(
        **common,
        desired=2,
        deployment=deployment_status(2, 2, 2, 2, generation=2, observed=1),
        previous_conditions=[],
        now="t",
    )
    assert {c["type"]: c["status"] for c in stale["conditions"]}["Ready"] == "False"


def test_status_reports_failures_and_scale_to_zero():
    common = {"name": "x", "generation": 1, "selector": "s", "now": "t"}
    failing = deployment_status(1, 0, 1, 1)
    failing["status"]["conditions"] = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "too slow",
        }
    ]
    cond = {
        c["type"]: c
        for c in compute_status(**common, desired=1, deployment=failing, previous_conditions=[])["conditions"]
    }
    assert cond["Degraded"]["status"] == "True" and cond["Degraded"]["reason"] == "ProgressDeadlineExceeded"
    err = compute_status(
        **common, desired=1, deployment=None, previous_conditions=[], apply_error="403 Forbidden"
    )
    assert {c["type"]: c["reason"] for c in err["conditions"]}["Degraded"] == "ApplyFailed"
    zero = compute_status(
        **common, desired=0, deployment=deployment_status(0, 0, 0, 0), previous_conditions=[]
    )
    ready = next(c for c in zero["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "ScaledToZero")  # KServe/Knative: Ready at zero
    # With autoscaling, the Deployment's own replica count is the target.
    auto = compute_status(
        **common, desired=None, deployment=deployment_status(3, 3, 3, 3), previous_conditions=[]
    )
    assert auto["ready"] == "3/3"


def example_resources() -> dict[str, list[dict]]:
    """Every InferenceDeployment of manifests/examples/, by file name."""
    return {
        path.name: [
            d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "InferenceDeployment"
        ]
        for path in sorted((REPO / "manifests" / "examples").glob("*.yaml"))
    }


def test_examples_validate_against_the_models():
    examples = example_resources()
    assert "tiny-cpu.yaml" in examples  # the README's example: a wrong folder finds none
    for name, docs in examples.items():
        assert docs, f"{name} holds no InferenceDeployment"
        for doc in docs:
            InferenceDeploymentSpec.model_validate(doc["spec"])


def test_docs_reference_is_generated_from_the_models():
    doc = (REPO / "docs" / "operator.md").read_text()
    start, end = "<!-- reference:start -->\n", "<!-- reference:end -->"
    embedded = doc[doc.index(start) + len(start) : doc.index(end)]
    assert embedded == reference_markdown(), (
        "docs/operator.md is stale: regenerate with `kvscale-operator crd --markdown`"
    )
    start, end = "<!-- endpoint-reference:start -->\n", "<!-- endpoint-reference:end -->"
    embedded = doc[doc.index(start) + len(start) : doc.index(end)]
    assert embedded == reference_markdown(endpoint=True), (
        "docs/operator.md is stale: regenerate with `kvscale-operator crd --markdown --endpoint`"
    )


# --- the router's children ------------------------------------------------------------------


def router_objects(s: InferenceDeploymentSpec) -> dict[str, dict]:
    return {key_of(o): o for o in router_children(OWNER, s, "router:1")}


def test_the_router_is_deployed_with_its_service_and_least_privilege_rbac():
    objs = router_objects(spec())
    assert sorted(objs) == sorted(ROUTER_KEYS)
    dep, svc = objs["RouterDeployment"], objs["RouterService"]
    assert {o["metadata"]["name"] for o in objs.values()} == {"tiny-router"}
    for o in objs.values():  # owned, and seen by the children's watches (CHILD_SELECTOR)
        assert o["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert (
            o["metadata"]["labels"][LABEL_MANAGED_BY] == MANAGER
            and o["metadata"]["labels"][LABEL_OWNER] == "tiny"
        )
    # The router's pods are not workers: the workers' Service, PDB and autoscaler never see them.
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert not (selector_labels("tiny").items() <= pod_labels.items())
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "router:1" and container["command"] == ["kvscale-router"]
    assert container["args"][:2] == ["--service", "tiny"]  # the workers' Service's EndpointSlices
    assert "--scale-deployment" not in container["args"]  # minReplicas 1: nothing to wake
    assert pod["serviceAccountName"] == "tiny-router" and pod["automountServiceAccountToken"] is True
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    rules = objs["Role"]["rules"]
    assert rules[0] == {
        "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]
    }  # fmt: skip
    assert rules[1]["resources"] == ["deployments/scale"] and rules[1]["resourceNames"] == ["tiny"]
    assert objs["RoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "tiny-router", "namespace": "ns"}
    ]
    assert objs["RoleBinding"]["roleRef"]["name"] == "tiny-router"


def test_the_router_follows_its_spec_and_scale_from_zero():
    objs = router_objects(spec(router={"replicas": 2, "image": "mine:2", "cpu": "1", "memory": "1Gi"}))
    dep = objs["RouterDeployment"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert dep["spec"]["replicas"] == 2 and container["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}
    zero = router_objects(spec(autoscaling={"minReplicas": 0, "maxReplicas": 3}))
    args = zero["RouterDeployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--scale-deployment") + 1] == "tiny"
    startup = InferenceDeploymentSpec.model_validate({"model": {"uri": "/m"}}).server.startup_timeout_seconds
    assert args[args.index("--queue-timeout") + 1] == str(max(60, startup))  # waits out a startup
    assert router_children(OWNER, spec(router={"enabled": False}), "router:1") == []


def test_two_routers_by_default_one_evicted_at_a_time_spread_over_nodes():
    objs = router_objects(spec())
    dep, pdb = objs["RouterDeployment"], objs["RouterPodDisruptionBudget"]
    assert dep["spec"]["replicas"] == 2
    assert pdb["metadata"]["name"] == "tiny-router" and pdb["spec"]["maxUnavailable"] == 1
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert not (selector_labels("tiny").items() <= pdb["spec"]["selector"]["matchLabels"].items())
    (spread,) = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert (
        spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
    )
    assert spread["labelSelector"]["matchLabels"].items() <= pod_labels.items()


def test_the_workers_api_key_secret_is_the_routers_key_file():
    # (The precise index's /tmp aside: tests/test_operator_policy.py.)
    approximate = {"prefixIndex": "approximate"}
    plain = router_objects(spec(router=approximate))["RouterDeployment"]["spec"]["template"]["spec"]
    assert "--api-key-file" not in plain["containers"][0]["args"] and "volumes" not in plain
    keyed = spec(server={"apiKeySecret": "keys"}, router=approximate)
    pod = router_objects(keyed)["RouterDeployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    path = container["args"][container["args"].index("--api-key-file") + 1]
    # The router's own calls to the workers (its tokenizer fetch) carry the same key: without it
    # the precise index of a keyed deployment got 401s and scored nothing.
    assert container["args"][container["args"].index("--upstream-api-key-file") + 1] == path
    (mount,) = container["volumeMounts"]
    (volume,) = pod["volumes"]
    assert volume["secret"] == {"secretName": "keys", "items": [{"key": "api-key", "path": "api-key"}]}
    assert mount["readOnly"] and path == f"{mount['mountPath']}/api-key" and mount["name"] == volume["name"]


def test_router_names_are_dns_labels_and_the_endpoint_is_the_routers_service():
    long = "a" * 63
    assert router_name("tiny") == "tiny-router"
    assert len(router_name(long)) <= 63 and router_name(long).endswith("-router")
    assert router_name(long) != router_name("a" * 62 + "b")
    assert endpoint_url(OWNER, spec()) == "http://tiny-router.ns.svc:8000"
    assert endpoint_url(OWNER, spec(router={"enabled": False})) == "http://tiny.ns.svc:8000"
    status = compute_status(
        name="tiny", generation=1, selector="s", desired=1, deployment=None, previous_conditions=[],
        now="t", endpoint=endpoint_url(OWNER, spec()),
    )  # fmt: skip
    assert status["endpoint"] == "http://tiny-router.ns.svc:8000"


# --- the InferencePool ----------------------------------------------------------------------


def test_the_inference_pool_selects_the_workers_in_gies_v1_fields():
    pool = inference_pool(OWNER, spec())
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["metadata"]["name"] == "tiny" and pool["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert pool["spec"] == {
        "selector": {"matchLabels": selector_labels("tiny")},
        "targetPorts": [{"number": 8000}],
    }
    picked = inference_pool(OWNER, spec(inferencePool={"endpointPicker": {"name": "tiny-epp"}}))
    assert picked["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "tiny-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    keys = [key_of(c) for c in all_children(OWNER, spec(), "w:1", "r:1", pools=True)]
    assert "InferencePool" in keys
    assert "InferencePool" not in [key_of(c) for c in all_children(OWNER, spec(), "w:1", "r:1")]
    off = spec(inferencePool={"enabled": False})
    assert "InferencePool" not in [key_of(c) for c in all_children(OWNER, off, "w:1", "r:1", pools=True)]


def test_discovery_says_whether_inference_pools_are_served():
    from kubernetes.client.rest import ApiException

    from kvscale.operator.kube import inferencepool

    class Discovery:  # a stand-in for the API server's discovery document (tests only)
        def __init__(self, body=None, status=None):
            self.body, self.status, self.asked = body, status, []

        def get_api_resources(self, group, version, **kwargs):
            self.asked.append((group, version, kwargs.get("_preload_content")))
            if self.status:
                raise ApiException(status=self.status, reason="x")
            return SimpleNamespace(data=json.dumps(self.body).encode())

    api = Discovery({"resources": [{"name": "inferencepools"}, {"name": "inferencepools/status"}]})
    assert inferencepool.served(api, 5) and api.asked == [("inference.networking.k8s.io", "v1", False)]
    assert not inferencepool.served(Discovery(status=404), 5)
    assert not inferencepool.served(Discovery({"resources": [{"name": "inferencemodels"}]}), 5)
    with pytest.raises(ApiException):
        inferencepool.served(Discovery(status=503), 5)


def test_the_pool_fits_the_e2e_test_copy_of_the_upstream_crds_shape():
    """Every field we render is one the test copy (e2e/testdata) declares, so the e2e test's API
    server keeps them (an undeclared field would be pruned)."""
    crd = yaml.safe_load((REPO / "e2e" / "testdata" / "inferencepools-crd.test-copy.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    assert crd["spec"]["group"] + "/" + version["name"] == "inference.networking.k8s.io/v1"

    def declared(schema: dict, value, path: str) -> None:
        if isinstance(value, dict) and "properties" in schema:
            for key, sub in value.items():
                assert key in schema["properties"], f"{path}.{key}"
                declared(schema["properties"][key], sub, f"{path}.{key}")
        elif isinstance(value, list):
            for item in value:
                declared(schema["items"], item, f"{path}[]")

    pool = inference_pool(
        OWNER, spec(inferencePool={"endpointPicker": {"name": "epp", "failureMode": "FailOpen"}})
    )
    declared(version["schema"]["openAPIV3Schema"]["properties"]["spec"], pool["spec"], "spec")
