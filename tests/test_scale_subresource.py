"""The scale subresource that kubectl scale, an HPA and KEDA use.

The API server builds `GET .../scale` from three paths of the resource. An absent
`specReplicasPath` is an error there ("the spec replicas field ... does not exist", a 500: the HPA
reports FailedGetScale, `kubectl scale --current-replicas` fails); absent status paths read as 0
and "". So the spec path carries a default (applied on every write and on every read from etcd,
so resources stored before have it too), and the status paths are fields the reconciler writes
in every status apply. A scale write is a spec change: the Deployment follows it.
"""

from __future__ import annotations

from typing import Any

from kvscale.operator.api.crd import crd
from kvscale.operator.api.labels import MANAGER
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.api.status import OWNED, status_apply
from kvscale.operator.reconcile.children import Owner, deployment, selector_string
from kvscale.operator.reconcile.status import compute_status

OWNER = Owner("tiny", "ns", "uid-1")
NOW = "2026-01-01T00:00:00Z"
SELECTOR = "app.kubernetes.io/name=kvscale-worker,kvscale.dev/inference-deployment=tiny"


def _version() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]


def _at(schema: dict[str, Any], path: str) -> dict[str, Any]:
    for name in path.removeprefix(".").split("."):
        schema = schema["properties"][name]
    return schema


def test_spec_replicas_is_on_every_resource_so_get_scale_never_fails():
    version = _version()
    root = version["schema"]["openAPIV3Schema"]
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas"
    field = _at(root, scale["specReplicasPath"])
    assert field["type"] == "integer" and field["default"] == 1
    assert "spec" in root["required"]  # the default applies inside spec, so spec must exist


def test_the_status_paths_of_scale_are_the_reconcilers_own_fields():
    version = _version()
    root, scale = version["schema"]["openAPIV3Schema"], version["subresources"]["scale"]
    for path, kind in ((scale["statusReplicasPath"], "integer"), (scale["labelSelectorPath"], "string")):
        assert path.startswith(".status.") and _at(root, path)["type"] == kind
        assert path.removeprefix(".status.") in OWNED[MANAGER].fields, path


def _deployment_status(replicas: int, ready: int) -> dict[str, Any]:
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": 2,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas,
        },
    }


def test_every_status_write_carries_replicas_and_the_selector():
    """Each status apply of the reconciler sends all its fields (an omitted one would be removed
    by server-side apply): whatever the state, `/scale` reads a count and a selector."""
    cases = [
        {"deployment": None},  # before the Deployment exists
        {"deployment": _deployment_status(2, 1)},
        {"deployment": _deployment_status(0, 0), "desired": 0},
        {"deployment": None, "apply_error": ("ApplyRejected", "refused"), "applied": False},
        {"deployment": _deployment_status(3, 3), "desired": None},  # autoscaling
    ]
    for case in cases:
        status = compute_status(
            name="tiny",
            generation=2,
            selector=selector_string("tiny"),
            desired=case.get("desired", 2),
            deployment=case["deployment"],
            previous_conditions=[],
            now=NOW,
            apply_error=case.get("apply_error"),
            applied=case.get("applied", True),
        )
        body = status_apply("tiny", "ns", status, MANAGER)["status"]
        replicas = (case["deployment"] or {}).get("status", {}).get("replicas", 0)
        assert body["replicas"] == replicas, case
        assert body["selector"] == selector_string("tiny") == SELECTOR


def test_a_resource_without_replicas_runs_one_worker_and_a_scale_write_reaches_the_deployment():
    omitted = InferenceDeploymentSpec.model_validate({"model": {"uri": "/models/tiny"}})
    assert omitted.replicas == 1 and deployment(OWNER, omitted, "img")["spec"]["replicas"] == 1
    scaled = InferenceDeploymentSpec.model_validate({"model": {"uri": "/models/tiny"}, "replicas": 3})
    assert deployment(OWNER, scaled, "img")["spec"]["replicas"] == 3
    to_zero = InferenceDeploymentSpec.model_validate({"model": {"uri": "/models/tiny"}, "replicas": 0})
    assert deployment(OWNER, to_zero, "img")["spec"]["replicas"] == 0


def test_with_autoscaling_the_default_replicas_is_ignored():
    s = InferenceDeploymentSpec.model_validate(
        {"model": {"uri": "/models/tiny"}, "replicas": 1, "autoscaling": {"maxReplicas": 4}}
    )
    assert s.desired_replicas is None and "replicas" not in deployment(OWNER, s, "img")["spec"]
