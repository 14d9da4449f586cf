"""Bad specs are refused, good ones make valid children.

Each bad spec below passed the CRD and the models before and produced a child the API server
refuses (or one that silently misbehaves). Each is now refused twice with the same readable
message: by the models, and by the generated CRD's rules, evaluated here with a real CEL
interpreter (cel-python) over the generated schema, defaults applied first as the API server
does. The API server's own verdict on the same specs is e2e/test_operator.py's
test_invalid_resources_are_refused_by_the_api_server.
"""

from __future__ import annotations

import re
from typing import Any

import celpy
import pytest
from celpy import celtypes
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvscale.operator.api.crd import crd
from kvscale.operator.api.labels import LABEL_OWNER
from kvscale.operator.api.pod import RESERVED_LABELS, RESERVED_PREFIX
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.api.status import Condition
from kvscale.operator.api.validation import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    LABEL_VALUE,
    NAME_RULE,
    QUANTITY,
    name_problem,
)
from kvscale.operator.api.workers import GPUS_MESSAGE
from kvscale.operator.reconcile.children import (
    Owner,
    all_children,
    claim_volume_name,
    deployment,
    labels,
    pod_disruption_budget,
    selector_labels,
)

OWNER = Owner("tiny", "ns", "uid-1")
VERSION = crd()["spec"]["versions"][0]
ROOT = VERSION["schema"]["openAPIV3Schema"]


# --- the CRD's validation, offline -------------------------------------------------------------

_SUFFIX = {
    **{s: 1024**i for i, s in enumerate(["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"])},
    **{"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18},
}


def _quantity(text: Any) -> float:
    """Kubernetes' quantity library for the interpreter (isQuantity, quantity, isGreaterThan). The
    grammar is the models' regex, so this checks the CEL expressions, not isQuantity itself:
    the e2e test does, against the real API server."""
    match = re.search(QUANTITY, str(text))
    if match is None:
        raise ValueError(f"invalid quantity {text!r}")
    number, suffix = str(text)[: match.start(3)] if match.group(3) else str(text), match.group(3) or ""
    if suffix[:1] in "eE" and suffix[1:]:
        return float(number) * 10 ** int(suffix[1:])
    return float(number) * _SUFFIX[suffix]


CEL_FUNCTIONS = {
    "isQuantity": lambda s: celtypes.BoolType(re.search(QUANTITY, str(s)) is not None),
    "quantity": lambda s: celtypes.DoubleType(_quantity(s)),
    "isGreaterThan": lambda q, other: celtypes.BoolType(q > other),
    "hasValue": lambda o: celtypes.BoolType(not isinstance(o, celtypes.NullType)),
}
_CEL = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _rule_holds(rule: str, value: Any, old: Any = None) -> bool:
    """The rule on `value`; `old` the stored object on an update (None: a create). Only rules
    with optionalOldSelf see `oldSelf` on a create (as none)."""
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _CEL.program(_CEL.compile(rule), functions=CEL_FUNCTIONS)
    activation = {"self": celpy.json_to_cel(value)}
    activation["oldSelf"] = celtypes.NullType() if old is None else celpy.json_to_cel(old)
    result = _PROGRAMS[rule].evaluate(activation)
    assert isinstance(result, celtypes.BoolType), f"{rule!r} gave {result!r}"
    return bool(result)


def crd_errors(value: Any, schema: dict = ROOT, path: str = "") -> list[str]:
    """What the API server would say about `value` (OpenAPI checks and CEL rules), as
    `path: message`. Defaults are filled in first, as the API server does before validating."""
    errors: list[str] = []
    kind = schema.get("type")
    if kind == "object" and isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = sub["default"]
        errors += [f"{path}.{r}: Required value" for r in schema.get("required", []) if r not in value]
        for name, item in value.items():
            sub = schema.get("properties", {}).get(name) or schema.get("additionalProperties")
            if isinstance(sub, dict) and not sub.get("x-kubernetes-preserve-unknown-fields"):
                errors += crd_errors(item, sub, f"{path}.{name}")
        if len(value) > schema.get("maxProperties", len(value)):
            errors.append(f"{path}: Too many")
    elif kind == "array" and isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{path}: Too many")
        for i, item in enumerate(value):
            errors += crd_errors(item, schema["items"], f"{path}[{i}]")
        if schema.get("x-kubernetes-list-type") == "map":
            keys = [tuple(item.get(k) for k in schema["x-kubernetes-list-map-keys"]) for item in value]
            errors += [f"{path}: Duplicate value: {k}" for i, k in enumerate(keys) if k in keys[:i]]
    elif kind == "string":
        if not isinstance(value, str):
            return [f"{path}: Invalid type"]
        if len(value) > schema.get("maxLength", len(value)) or len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: Too long or short")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: should match '{schema['pattern']}'")
    elif kind == "integer":
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: should be greater than or equal to {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: should be less than or equal to {schema['maximum']}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: Unsupported value: {value!r}")
    if errors:  # like the API server: CEL runs on values that passed the OpenAPI checks
        return errors
    for rule in schema.get("x-kubernetes-validations", []):
        if not _rule_holds(rule["rule"], value):
            errors.append(f"{path}: {rule['message']}")
    return errors


def resource(spec: dict, name: str = "tiny") -> dict:
    return {
        "apiVersion": "kvscale.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": spec,
    }


def spec_of(**fields: Any) -> dict:
    return {"model": {"uri": "/models/tiny"}, **fields}


# --- bad specs: refused by the CRD and by the models alike -----------------------------------

QUANTITY_MESSAGE = "must be a positive Kubernetes quantity"
PVC_MESSAGE = "pvc:// needs the name of a PersistentVolumeClaim"
RESERVED_MESSAGE = "are the operator's labels"
TENSOR_NODES_MESSAGE = "parallelism.tensor must be a multiple of parallelism.nodes"
GPUS_PER_POD_MESSAGE = "resources.gpus must be parallelism.tensor / parallelism.nodes"

BAD_SPECS = [
    # Quantities the old pattern let through; the kubelet or the API server refuses them later.
    (spec_of(resources={"cpu": "1.2.3"}), QUANTITY_MESSAGE),
    (spec_of(resources={"memory": "2Gim"}), QUANTITY_MESSAGE),
    (spec_of(resources={"memory": "8GB"}), QUANTITY_MESSAGE),
    (spec_of(resources={"cpu": "-1"}), QUANTITY_MESSAGE),
    (spec_of(resources={"cpu": "0"}), QUANTITY_MESSAGE),
    (spec_of(resources={"ephemeralStorage": "lots"}), QUANTITY_MESSAGE),
    (spec_of(resources={"sharedMemory": "1..5Gi"}), QUANTITY_MESSAGE),
    # pvc:// without a claim name, or with one no PersistentVolumeClaim can have.
    (spec_of(model={"uri": "pvc://"}), PVC_MESSAGE),
    (spec_of(model={"uri": "pvc:///llama"}), PVC_MESSAGE),
    (spec_of(model={"uri": "pvc://.models/llama"}), PVC_MESSAGE),
    (spec_of(model={"uri": "pvc://models./llama"}), PVC_MESSAGE),
    (spec_of(model={"uri": "pvc://Models/llama"}), PVC_MESSAGE),
    (spec_of(model={"uri": "pvc://a..b/llama"}), PVC_MESSAGE),
    (
        spec_of(speculative={"method": "draft", "draftModelUri": "pvc:///draft"}),
        PVC_MESSAGE,
    ),
    (spec_of(model={"uri": "pvc://models/../etc"}), "must not contain '..' path segments"),
    (spec_of(model={"uri": "/models/.."}), "must not contain '..' path segments"),
    (spec_of(model={"uri": f"pvc://{'a' * 254}/llama"}), "must be at most 253 characters"),
    # More GPUs than a node has: a pod's ranks share one node.
    (spec_of(resources={"gpus": 9}), GPUS_MESSAGE),
    (spec_of(resources={"gpus": 16}), GPUS_MESSAGE),
    # Parallelism that cannot be laid out over the pods, or the pods' GPUs.
    (spec_of(parallelism={"tensor": 3, "nodes": 2}), TENSOR_NODES_MESSAGE),
    (spec_of(parallelism={"tensor": 2, "nodes": 4}), TENSOR_NODES_MESSAGE),
    (spec_of(parallelism={"tensor": 8, "nodes": 2}, resources={"gpus": 2}), GPUS_PER_POD_MESSAGE),
    (spec_of(parallelism={"tensor": 2}, resources={"gpus": 1}), GPUS_PER_POD_MESSAGE),
    (spec_of(parallelism={"tensor": 4, "nodes": 2}, resources={"gpus": 4}), GPUS_PER_POD_MESSAGE),
    (spec_of(parallelism={"tensor": 0}), "greater than or equal to 1"),
    (spec_of(parallelism={"tensor": 65}), "less than or equal to 64"),
    (spec_of(parallelism={"tensor": 32, "nodes": 32}), "less than or equal to 16"),
    (spec_of(parallelism={"nodes": 2}), "Required|required"),
    (
        spec_of(parallelism={"tensor": 2, "nodes": 2}, autoscaling={"minReplicas": 0, "maxReplicas": 2}),
        "not supported with parallelism.nodes above 1",
    ),
    # Env: one name twice is refused (the Deployment's env is keyed by name).
    (spec_of(env=[{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]), "Duplicate value|unique"),
    # Names and keys the Deployment would refuse.
    (spec_of(server={"apiKeySecret": "Api_Keys"}), "must be the name of a Secret"),
    (
        spec_of(env=[{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "a/b"}}}]),
        "should match|String should match",
    ),
    (spec_of(nodeSelector={"gpu type": "h100"}), "keys must be label keys"),
    (spec_of(nodeSelector={"gpu": "-h100"}), "must be a label value"),
    (spec_of(tolerations=[{"operator": "Equal", "value": "x"}]), "operator must be Exists when key is empty"),
    (
        spec_of(tolerations=[{"key": "k", "operator": "Exists", "value": "x"}]),
        "value must be empty when operator is Exists",
    ),
    (
        spec_of(tolerations=[{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 5}]),
        "tolerationSeconds needs effect NoExecute",
    ),
    (spec_of(image="repo/worker:1 "), "should match|String should match"),
    # Pod template fields.
    (spec_of(podMetadata={"labels": {"app.kubernetes.io/name": "mine"}}), RESERVED_MESSAGE),
    (spec_of(podMetadata={"labels": {"kvscale.dev/inference-deployment": "x"}}), RESERVED_MESSAGE),
    (spec_of(podMetadata={"labels": {"team": "a b"}}), "must be a label value"),
    (spec_of(podMetadata={"annotations": {"not a key": "x"}}), "keys must be label keys"),
    (spec_of(rollout={"maxSurge": 0, "maxUnavailable": 0}), "cannot both be 0"),
    (spec_of(rollout={"maxSurge": 0}), "cannot both be 0"),
    (spec_of(priorityClassName="High"), "must be the name of a PriorityClass"),
    (spec_of(runtimeClassName="nvidia runtime"), "must be the name of a RuntimeClass"),
    (spec_of(imagePullSecrets=[{"name": "r"}, {"name": "r"}]), "Duplicate value|unique"),
    (
        spec_of(
            topologySpreadConstraints=[
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "minDomains": 2,
                }
            ]
        ),
        "minDomains needs whenUnsatisfiable DoNotSchedule",
    ),
    (
        spec_of(
            topologySpreadConstraints=[
                {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},
                {"maxSkew": 2, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},
            ]
        ),
        "Duplicate value|unique",
    ),
    # The rules that were in the CRD only; the models now say the same.
    # kubectl scale, an HPA or KEDA writing spec.replicas of an autoscaled resource.
    (spec_of(replicas=3, autoscaling={"maxReplicas": 2}), "leave replicas out"),
    (spec_of(replicas=0, autoscaling={"maxReplicas": 2}), "leave replicas out"),
    (spec_of(speculative={"method": "draft"}), "method draft needs draftModelUri"),
    (spec_of(autoscaling={"minReplicas": 3, "maxReplicas": 2}), "minReplicas must not exceed"),
    # LoRA adapters (operator/api/lora.py): what the worker would refuse in a crash loop.
    (
        spec_of(adapters=[{"name": "a", "uri": "/a"}], speculative={"method": "ngram"}),
        "cannot be combined with speculative decoding",
    ),
    (spec_of(adapters=[{"name": "a", "uri": "/a"}], parallelism={"tensor": 2}), "tensor parallelism 1"),
    (spec_of(adapters=[{"name": "a", "uri": "/a"}], resources={"gpus": 2}), "tensor parallelism 1"),
    (
        spec_of(
            adapters=[{"name": "a", "uri": "/a"}], lora={"dynamicLoading": True}, server={"apiKeySecret": "k"}
        ),
        "not supported with server.apiKeySecret",
    ),
    (spec_of(lora={"maxLoras": 8, "maxCpuLoras": 4}), "maxCpuLoras must be at least maxLoras"),
    (spec_of(adapters=[{"name": "a", "uri": "builtin://tiny-llama"}]), "not builtin://"),
    (spec_of(adapters=[{"name": "a,b", "uri": "/a"}]), "should match"),
    (spec_of(adapters=[{"name": "a", "uri": "pvc://adapters/../x"}]), "must not contain '..' path segments"),
    (
        spec_of(adapters=[{"name": "a", "uri": "/a"}, {"name": "a", "uri": "/b"}]),
        "Duplicate value|unique",
    ),
]


@pytest.mark.parametrize(("spec", "message"), BAD_SPECS, ids=[m for _, m in BAD_SPECS])
def test_bad_specs_are_refused_by_the_crd_and_the_models(spec, message):
    """`message`: what the error says (alternatives separated by |: the API server's wording for
    a structural check, pydantic's for the same check)."""
    errors = crd_errors(resource(spec))
    assert any(alt in e for alt in message.split("|") for e in errors), errors
    with pytest.raises(ValidationError) as refused:
        InferenceDeploymentSpec.model_validate(spec)
    assert any(alt in str(refused.value) for alt in message.split("|")), refused.value


@pytest.mark.parametrize("name", ["a" * 64, "models.llama", "8b-llama", "llama-", "-llama"])
def test_names_that_cannot_name_the_children_are_refused(name):
    """A name of 64 characters is a valid name for the resource but not a label value; a dotted
    one is not a Service name; the Service name must start with a letter."""
    assert crd_errors(resource(spec_of(), name=name)) == [f": {NAME_RULE.message}"]
    assert name_problem(name) == NAME_RULE.message


def test_the_name_rule_leaves_status_writes_to_older_resources_alone():
    """A resource created under an older CRD with a name the rule refuses still takes status
    writes (a rule at the root runs on every write, status included): the rule holds on updates."""
    (rule,) = ROOT["x-kubernetes-validations"]
    assert rule["optionalOldSelf"] is True
    stored = resource(spec_of(), name="models.llama")
    updated = {**stored, "status": {"ready": "0/1"}}
    assert not _rule_holds(rule["rule"], updated)  # a create
    assert _rule_holds(rule["rule"], updated, old=stored)  # an update


@pytest.mark.parametrize("name", ["a" * 63, "tiny", "llama-3-8b", "a"])
def test_names_that_fit_are_accepted(name):
    assert crd_errors(resource(spec_of(), name=name)) == []
    assert name_problem(name) is None
    spec = InferenceDeploymentSpec.model_validate(spec_of())
    for child in all_children(Owner(name, "ns", "u"), spec, "img", "router-img", pools=True):
        assert all(len(v) <= 63 and re.search(LABEL_VALUE, v) for v in child["metadata"]["labels"].values())
        # Every child's name is a DNS label (the router's Service NAME-router too).
        assert len(child["metadata"]["name"]) <= 63 and re.search(DNS_LABEL, child["metadata"]["name"])


GOOD_SPECS = [
    spec_of(resources={"cpu": "500m", "memory": "512Mi", "ephemeralStorage": "1e9", "sharedMemory": ".5Gi"}),
    spec_of(resources={"cpu": "1.5", "memory": "8G", "gpus": 1}),
    spec_of(resources={"cpu": "+2", "memory": "1E"}),
    spec_of(model={"uri": "pvc://my.models/llama-8b"}),
    spec_of(model={"uri": "pvc://models"}),
    spec_of(model={"uri": "file:///models/llama..old"}),
    spec_of(model={"uri": "builtin://tiny-llama"}),
    spec_of(env=[{"name": "HF_HUB_OFFLINE", "value": "0"}, {"name": "HOME", "value": "/home"}]),
    spec_of(
        tolerations=[{"operator": "Exists"}, {"key": "k", "effect": "NoExecute", "tolerationSeconds": 3}]
    ),
    spec_of(rollout={"maxSurge": 0, "maxUnavailable": 1}),
    spec_of(podMetadata={"labels": {"team": "search", "example.com/tier": "gold"}}),
    spec_of(podMetadata={"annotations": {"prometheus.io/scrape": "false", "a.b/c": "anything at all"}}),
    spec_of(nodeSelector={"nvidia.com/gpu.present": "true", "pool": ""}),
    spec_of(autoscaling={"maxReplicas": 2}),  # replicas defaults to 1, which autoscaling ignores
    spec_of(replicas=1, autoscaling={"maxReplicas": 2}),  # the default written out: accepted, ignored
    # Tensor parallelism: one rank per GPU in a pod, CPU ranks, groups of pods.
    spec_of(resources={"gpus": 2}),
    spec_of(resources={"gpus": 8}),
    spec_of(parallelism={"tensor": 2}),
    spec_of(parallelism={"tensor": 4}, resources={"gpus": 4}),
    spec_of(parallelism={"tensor": 2, "nodes": 2}),
    spec_of(parallelism={"tensor": 16, "nodes": 2}, resources={"gpus": 8}),
    spec_of(parallelism={"tensor": 4, "nodes": 2}, autoscaling={"minReplicas": 1, "maxReplicas": 4}),
    spec_of(
        adapters=[
            {"name": "sql", "uri": "pvc://adapters/sql"},
            {"name": "org/chat@v2", "uri": "hf://org/chat@v2"},
        ],
        lora={"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 8, "dynamicLoading": True},
        resources={"gpus": 1},
    ),
]


@pytest.mark.parametrize("spec", GOOD_SPECS)
def test_good_specs_pass_both(spec):
    assert crd_errors(resource(spec)) == []
    InferenceDeploymentSpec.model_validate(spec)


def test_quantity_rules_accept_what_kubernetes_accepts():
    for good in ["1", "500m", "0.5", ".5", "1.", "+1", "8Gi", "1Ki", "1e3", "1E3", "2E", "100u", "1n"]:
        assert re.search(QUANTITY, good), good
    for bad in ["1.2.3", "2Gim", "8GB", "1e", "1e1.5", "Gi", "", " 1", "1 ", "1mi", "0x10"]:
        assert not re.search(QUANTITY, bad), bad


# --- env: the user's value wins, one entry per name -------------------------------------------


def test_a_user_env_named_like_ours_replaces_ours():
    spec = InferenceDeploymentSpec.model_validate(
        spec_of(
            server={"apiKeySecret": "keys"},
            env=[
                {"name": "HF_HUB_OFFLINE", "value": "0"},
                {"name": "KVSCALE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "other", "key": "k"}}},
                {"name": "EXTRA", "value": "$(HOME)/x"},
            ],
        )
    )
    env = deployment(OWNER, spec, "img")["spec"]["template"]["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)), names  # server-side apply refuses a repeated key
    by_name = {e["name"]: e for e in env}
    assert by_name["HF_HUB_OFFLINE"] == {"name": "HF_HUB_OFFLINE", "value": "0"}
    assert by_name["KVSCALE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "other", "key": "k"}
    assert names.index("HOME") < names.index("EXTRA")  # ours first: $(HOME) expands


# --- the pod template users need -------------------------------------------------------------


def test_pod_template_fields_reach_the_deployment():
    spread = {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "ScheduleAnyway",
    }
    own_selector = {"matchLabels": {"team": "search"}}
    anti = {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {
                "labelSelector": {"matchLabels": selector_labels("tiny")},
                "topologyKey": "kubernetes.io/hostname",
            }
        ]
    }
    spec = InferenceDeploymentSpec.model_validate(
        spec_of(
            resources={"gpus": 1, "ephemeralStorage": "5Gi", "sharedMemory": "2Gi"},
            affinity={"podAntiAffinity": anti},
            topologySpreadConstraints=[
                spread,
                {**spread, "whenUnsatisfiable": "DoNotSchedule", "labelSelector": own_selector, "maxSkew": 2},
            ],
            priorityClassName="inference-high",
            runtimeClassName="nvidia",
            imagePullSecrets=[{"name": "registry"}],
            podMetadata={
                "labels": {"team": "search"},
                "annotations": {"prometheus.io/scrape": "false", "example.com/owner": "search"},
            },
            rollout={"maxSurge": 0, "maxUnavailable": 1},
        )
    )
    dep = deployment(OWNER, spec, "img")
    template = dep["spec"]["template"]
    pod = template["spec"]
    assert dep["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    assert pod["affinity"] == {"podAntiAffinity": anti}
    first, second = pod["topologySpreadConstraints"]
    assert first == {**spread, "labelSelector": {"matchLabels": selector_labels("tiny")}}  # ours by default
    assert second["labelSelector"] == own_selector and second["maxSkew"] == 2
    assert pod["priorityClassName"] == "inference-high" and pod["runtimeClassName"] == "nvidia"
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert template["metadata"]["labels"] == {"team": "search", **labels("tiny")}
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "false"  # the user's wins
    assert template["metadata"]["annotations"]["example.com/owner"] == "search"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tmp"]["emptyDir"] == {"sizeLimit": "5Gi"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    resources = pod["containers"][0]["resources"]
    assert resources["requests"]["ephemeral-storage"] == "5Gi"
    assert "ephemeral-storage" not in resources["limits"]  # bounded by /tmp's size limit instead
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"]  # still Guaranteed QoS


def test_pod_template_defaults_are_bounded_and_safe():
    dep = deployment(OWNER, InferenceDeploymentSpec.model_validate(spec_of()), "img")
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert all(v["emptyDir"].get("sizeLimit") for v in pod["volumes"] if "emptyDir" in v)
    assert pod["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "2Gi"
    for key in ("affinity", "topologySpreadConstraints", "priorityClassName", "runtimeClassName"):
        assert key not in pod
    assert "imagePullSecrets" not in pod
    pdb = pod_disruption_budget(OWNER)
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_user_labels_never_replace_the_selector():
    """The CRD refuses them; a resource stored under an older CRD keeps its selector anyway."""
    spec = InferenceDeploymentSpec.model_validate(spec_of())
    spec.pod_metadata.labels.update({LABEL_OWNER: "other", "app.kubernetes.io/name": "x", "team": "t"})
    dep = deployment(OWNER, spec, "img")
    template_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert template_labels["team"] == "t"
    assert set(labels("x")) <= set(RESERVED_LABELS) | {
        k for k in labels("x") if k.startswith(RESERVED_PREFIX)
    }


# --- any valid spec makes valid children -----------------------------------------------------

# At most 10 labels of 22: within a claim name's 253 characters.
claims = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?){0,9}\Z")
names = st.from_regex(r"\A[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
env_names = st.sampled_from(
    ["HOME", "HF_HOME", "HF_HUB_OFFLINE", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "KVSCALE_API_KEY", "A"]
)


@settings(max_examples=150, deadline=None)
@given(name=names, model=claims, draft=claims, env=st.lists(env_names, unique=True, max_size=6))
def test_valid_specs_make_valid_children(name, model, draft, env):
    raw = spec_of(
        model={"uri": f"pvc://{model}/m"},
        speculative={"method": "draft", "draftModelUri": f"pvc://{draft}/d"},
        server={"apiKeySecret": "keys"},
        env=[{"name": n, "value": "v"} for n in env],
    )
    assert crd_errors(resource(raw, name=name)) == []
    spec = InferenceDeploymentSpec.model_validate(raw)
    pod = deployment(Owner(name, "ns", "u"), spec, "img")["spec"]["template"]["spec"]
    volumes = [v["name"] for v in pod["volumes"]]
    assert all(len(v) <= 63 and re.search(DNS_LABEL, v) for v in volumes), volumes
    assert len(volumes) == len(set(volumes)) == 2 + (model != draft)  # tmp, and a volume per claim
    env_out = [e["name"] for e in pod["containers"][0]["env"]]
    assert len(env_out) == len(set(env_out))
    mounts = [m["name"] for m in pod["containers"][0]["volumeMounts"]]
    assert sorted(mounts) == sorted(volumes)


def test_long_and_dotted_claims_get_distinct_volume_names():
    long = "a" * 200 + ".b"
    pairs = [("a.b", "a-b"), (long, long[:-1] + "c"), ("x" * 59, "x" * 60)]
    for one, other in pairs:
        for claim in (one, other):
            assert re.search(DNS_SUBDOMAIN, claim)
            volume = claim_volume_name(claim)
            assert len(volume) <= 63 and re.search(DNS_LABEL, volume), volume
        assert claim_volume_name(one) != claim_volume_name(other)
    assert claim_volume_name("models") == "pvc-models"  # readable where it can be


# --- status: open condition types ------------------------------------------------------------


def test_the_schema_accepts_condition_types_it_does_not_know():
    """A newer operator may add a condition type; an older CRD must still take its status."""
    status_schema = ROOT["properties"]["status"]
    conditions = status_schema["properties"]["conditions"]
    assert "enum" not in conditions["items"]["properties"]["type"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    status = {
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "AllWorkersReady"},
            {"type": "ModelDownloading", "status": "True", "reason": "Downloading", "message": "40%"},
        ]
    }
    assert crd_errors(status, status_schema, "status") == []
    Condition.model_validate(status["conditions"][1])
    twice = {"conditions": [status["conditions"][0], status["conditions"][0]]}
    assert any("Duplicate" in e for e in crd_errors(twice, status_schema, "status"))


# --- the rules fit the API server's cost budget ----------------------------------------------


def test_every_rule_is_bounded_for_the_cost_estimator():
    """The API server estimates each rule's worst case from maxLength / maxItems / maxProperties
    and refuses a CRD whose rules could cost too much: every string a rule reads has a
    maxLength, and every list or map above a rule a maxItems / maxProperties."""
    problems: list[str] = []

    def walk(node: dict, path: str, unbounded: list[str]) -> None:
        if node.get("x-kubernetes-validations"):
            if unbounded:
                problems.append(f"{path}: rule under unbounded {unbounded}")
            if node.get("type") == "string" and "maxLength" not in node:
                problems.append(f"{path}: rule on a string without maxLength")
            for sub_name, sub in node.get("properties", {}).items():
                rules = " ".join(r["rule"] for r in node["x-kubernetes-validations"])
                read = sub.get("type") == "string" and f"self.{sub_name}" in rules and "enum" not in sub
                if read and "maxLength" not in sub and not re.search(rf"has\(self\.{sub_name}\)", rules):
                    problems.append(f"{path}.{sub_name}: read by a rule without maxLength")
        for name, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{name}", unbounded)
        if "items" in node:
            walk(node["items"], f"{path}[]", unbounded + ([path] if "maxItems" not in node else []))
        if isinstance(node.get("additionalProperties"), dict):
            bound = [] if "maxProperties" in node else [path]
            walk(node["additionalProperties"], f"{path}{{}}", unbounded + bound)

    walk(ROOT["properties"]["spec"], "spec", [])
    assert not problems, problems
    rules = []

    def collect(node: dict) -> None:
        rules.extend(r["rule"] for r in node.get("x-kubernetes-validations", []))
        for sub in node.get("properties", {}).values():
            collect(sub)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                collect(node[key])

    collect(ROOT)
    for rule in rules:  # each compiles in a real CEL parser
        _CEL.compile(rule)
