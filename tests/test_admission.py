"""manifests/admission/policy.yaml, the ValidatingAdmissionPolicy bounding the operator's writes,
evaluated with a CEL interpreter (cel-python) on what the operator renders: every Deployment it
applies passes, the writes that would make its ServiceAccount close to cluster-admin do not.
e2e/test_rbac.py runs it on the real API server."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.reconcile.children import Owner, all_children

REPO = Path(__file__).resolve().parents[1]
POLICY, BINDING = [
    d for d in yaml.safe_load_all((REPO / "manifests" / "admission" / "policy.yaml").read_text()) if d
]
OPERATOR = "system:serviceaccount:kvscale-system:kvscale-operator"
_ENV = celpy.Environment()


def _eval(expression: str, activation: dict[str, Any]) -> Any:
    return _ENV.program(_ENV.compile(expression)).evaluate(activation)


def refusals(resource: str, obj: dict, old: dict | None = None, user: str = OPERATOR) -> list[str]:
    """The messages the policy denies the write with (empty: admitted), as the API server
    evaluates it: match conditions, then the variables, then each validation."""
    request = {"resource": {"resource": resource}, "userInfo": {"username": user}}
    base = {
        "request": celpy.json_to_cel(request),
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(old) if old is not None else celpy.celtypes.NullType(),
    }
    spec = POLICY["spec"]
    if not all(bool(_eval(m["expression"], base)) for m in spec["matchConditions"]):
        return []
    variables: dict[str, Any] = {}
    for v in spec["variables"]:  # lazily, as the API server: one a kind has not is never read
        with contextlib.suppress(celpy.CELEvalError):
            variables[v["name"]] = _eval(
                v["expression"], {**base, "variables": celpy.celtypes.MapType(variables)}
            )
    activation = {**base, "variables": celpy.celtypes.MapType(variables)}
    return [v["message"] for v in spec["validations"] if not bool(_eval(v["expression"], activation))]


def spec(**fields) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": {"uri": "hf://org/m"}, **fields})


def deployments(s: InferenceDeploymentSpec) -> list[dict]:
    return [o for o in all_children(Owner("tiny", "ns", "u"), s, "w:1", "r:1") if o["kind"] == "Deployment"]


def test_the_policy_matches_the_operator_and_is_enforced():
    assert BINDING["spec"] == {"policyName": POLICY["metadata"]["name"], "validationActions": ["Deny"]}
    assert POLICY["spec"]["failurePolicy"] == "Fail"


@pytest.mark.parametrize(
    "fields",
    [{}, {"router": {"enabled": False}}, {"resources": {"gpus": 2}}, {"autoscaling": {"maxReplicas": 3}}],
)
def test_every_deployment_the_operator_renders_is_admitted(fields):
    for dep in deployments(spec(**fields)):
        assert refusals("deployments", dep) == [], dep["metadata"]["name"]


def worker() -> dict:
    return copy.deepcopy(deployments(spec(router={"enabled": False}))[0])


def test_a_deployment_that_would_escalate_is_refused():
    pod = lambda d: d["spec"]["template"]["spec"]  # noqa: E731
    cases = []
    d = worker()
    pod(d)["serviceAccountName"] = "kube-system-admin"
    cases.append((d, "ServiceAccount"))
    d = worker()
    pod(d)["automountServiceAccountToken"] = True
    cases.append((d, "ServiceAccount"))
    d = worker()
    pod(d)["hostNetwork"] = True
    cases.append((d, "host network"))
    d = worker()
    pod(d)["volumes"].append({"name": "root", "hostPath": {"path": "/"}})
    cases.append((d, "hostPath"))
    d = worker()
    pod(d)["containers"][0]["securityContext"] = {"privileged": True}
    cases.append((d, "privilege"))
    d = worker()
    pod(d)["initContainers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    cases.append((d, "privilege"))
    d = worker()
    del d["metadata"]["labels"]["app.kubernetes.io/managed-by"]
    cases.append((d, "managed-by"))
    for obj, word in cases:
        got = refusals("deployments", obj)
        assert len(got) == 1 and word in got[0], (word, got)
    # Someone else's writes are not this policy's business.
    d = worker()
    pod(d)["hostNetwork"] = True
    assert refusals("deployments", d, user="system:serviceaccount:other:deployer") == []


def test_pod_writes_may_change_only_metadata():
    pod = {
        "metadata": {"labels": {"app.kubernetes.io/managed-by": "kvscale-operator"}, "annotations": {}},
        "spec": {"containers": [{"name": "worker", "image": "w:1"}]},
    }
    marked = copy.deepcopy(pod)
    marked["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"] = "-1000"
    assert refusals("pods", marked, pod) == []
    swapped = copy.deepcopy(marked)
    swapped["spec"]["containers"][0]["image"] = "evil:1"
    assert refusals("pods", swapped, pod) == [
        "the operator may change only a pod's metadata (the pod-deletion-cost mark)"
    ]
    theirs = {"metadata": {"labels": {"app": "web"}}, "spec": pod["spec"]}
    assert refusals("pods", theirs, theirs)[0].startswith("the operator writes only objects labelled")


def rbac(kind: str) -> dict:
    return copy.deepcopy(
        next(o for o in all_children(Owner("tiny", "ns", "u"), spec(), "w:1", "r:1") if o["kind"] == kind)
    )


def test_the_routers_role_and_binding_are_admitted_and_nothing_wider():
    assert refusals("roles", rbac("Role")) == []
    assert refusals("rolebindings", rbac("RoleBinding")) == []
    wide = rbac("Role")
    wide["rules"].append({"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["create"]})
    assert refusals("roles", wide) == [
        "a Role grants only the router's rights (endpointslices, deployments/scale)"
    ]
    elsewhere = rbac("RoleBinding")
    elsewhere["subjects"].append({"kind": "ServiceAccount", "name": "tiny-router", "namespace": "victim"})
    assert refusals("rolebindings", elsewhere)[0].startswith("a RoleBinding binds its own Role")
    cluster_role = rbac("RoleBinding")
    cluster_role["roleRef"] = {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "admin",
    }
    assert refusals("rolebindings", cluster_role)[0].startswith("a RoleBinding binds its own Role")
