"""The resource's scale subresource on the real node: `kubectl scale infd` and an autoscaling/v2
HorizontalPodAutoscaler (kube-controller-manager's own controller, syncing every 5 s here) read
and write `/scale`, and the operator rolls the Deployment to the new count.

The resources leave `replicas` out, as a manifest scaled by something else should: the CRD's
default (1) puts it on the object, so `GET /scale` answers (without it the API server answered
500 "the spec replicas field ".spec.replicas" does not exist", and the HPA reported
AbleToScale=False, FailedGetScale). There is no metrics API here: the HPA scales the resource up
to its minReplicas without metrics, which is what proves it could read and write `/scale`; after
that its ScalingActive condition says it found the selector but no metric (FailedGetPodsMetric,
not InvalidSelector).
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from test_controlplane import wait_for
from test_operator import (  # noqa: F401 (fixtures)
    GROUP,
    PLURAL,
    VERSION,
    apply,
    condition,
    example,
    get_cr,
    namespace,
    operator,
    wait_ready,
)


def unscaled(name: str, ns: str, **spec_overrides) -> dict:
    """The CPU example without `replicas`: what the scale subresource sets is not in the manifest."""
    doc = example(name, ns, **spec_overrides)
    doc["spec"].pop("replicas", None)
    return doc


def scale_of(cluster, name: str, ns: str) -> dict:
    return client.CustomObjectsApi(cluster.api).get_namespaced_custom_object_scale(
        GROUP, VERSION, ns, PLURAL, name
    )


def deployment_replicas(cluster, name: str, ns: str) -> int | None:
    return client.AppsV1Api(cluster.api).read_namespaced_deployment(name, ns).spec.replicas


def test_kubectl_scale_drives_the_workers_through_the_scale_subresource(operator, namespace):  # noqa: F811
    if not operator.local:
        pytest.skip("mounts the fixture model from this machine")
    doc = unscaled("scaled", namespace)
    apply(operator, doc)
    cr = wait_ready(operator, "scaled", namespace, replicas=1)
    assert cr["spec"]["replicas"] == 1  # the CRD's default
    scale = scale_of(operator, "scaled", namespace)
    assert scale["spec"]["replicas"] == 1 and scale["status"]["replicas"] == 1
    assert scale["status"]["selector"] == cr["status"]["selector"]

    # --current-replicas reads /scale first (GET, then PUT): the call that failed on an absent field.
    generation = cr["metadata"]["generation"]
    operator.kubectl("scale", "infd", "scaled", "-n", namespace, "--current-replicas=1", "--replicas=2")
    cr = wait_ready(operator, "scaled", namespace, replicas=2)
    assert cr["metadata"]["generation"] > generation and cr["spec"]["replicas"] == 2
    assert deployment_replicas(operator, "scaled", namespace) == 2
    scale = scale_of(operator, "scaled", namespace)
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2

    # Re-applying the manifest (no replicas in it) leaves the scaled count: the applier never
    # owned the field.
    apply(operator, doc)
    assert get_cr(operator, "scaled", namespace)["spec"]["replicas"] == 2

    # A plain kubectl scale (a merge patch of /scale) to zero: no workers, status says why.
    operator.kubectl("scale", "infd", "scaled", "-n", namespace, "--replicas=0")

    def scaled_to_zero():
        cr = get_cr(operator, "scaled", namespace)
        status = cr.get("status") or {}
        return status.get("replicas") == 0 and condition(cr, "Ready").get("reason") == "ScaledToZero"

    wait_for(scaled_to_zero, timeout=120, interval=0.5, what="the workers to go")
    assert deployment_replicas(operator, "scaled", namespace) == 0
    scale = scale_of(operator, "scaled", namespace)
    # autoscaling/v1 Scale omits a zero replicas (omitempty in its Go types).
    assert scale["spec"].get("replicas", 0) == 0 and scale["status"].get("replicas", 0) == 0


def test_kubectl_scale_of_an_autoscaled_resource_is_refused_with_the_reason(operator, namespace):  # noqa: F811
    """With `autoscaling` the operator's autoscaler owns the count: a scale write (kubectl, an
    HPA, KEDA) is refused by the CRD's rule rather than silently ignored or switching modes."""
    apply(operator, unscaled("auto", namespace, autoscaling={"minReplicas": 1, "maxReplicas": 2}))
    scale = scale_of(operator, "auto", namespace)
    assert scale["spec"]["replicas"] == 1  # readable (the default), and ignored
    result = operator.kubectl("scale", "infd", "auto", "-n", namespace, "--replicas=3", check=False)
    assert result.returncode != 0, result.stdout
    assert "with autoscaling the operator's autoscaler sets the worker count" in result.stderr, result.stderr
    assert "leave replicas out" in result.stderr
    cr = get_cr(operator, "auto", namespace)
    assert cr["spec"]["replicas"] == 1 and cr["spec"]["autoscaling"]["maxReplicas"] == 2


def hpa_status(cluster, name: str, ns: str) -> dict:
    return json.loads(cluster.kubectl("get", "hpa", name, "-n", ns, "-o", "json").stdout).get("status") or {}


def hpa_conditions(cluster, name: str, ns: str) -> dict[str, dict]:
    return {c["type"]: c for c in hpa_status(cluster, name, ns).get("conditions", [])}


def test_an_hpa_scales_the_resource_through_its_scale_subresource(operator, namespace):  # noqa: F811
    if not operator.local:
        pytest.skip("mounts the fixture model from this machine")
    apply(operator, unscaled("hpa", namespace))
    wait_ready(operator, "hpa", namespace, replicas=1)
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "hpa", "namespace": namespace},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "InferenceDeployment",
                "name": "hpa",
            },
            "minReplicas": 2,
            "maxReplicas": 3,
            # The recipe's metric (docs/autoscaling.md); no adapter serves it here.
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "kvscale_kv_cache_usage_ratio"},
                        "target": {"type": "AverageValue", "averageValue": "500m"},
                    },
                }
            ],
        },
    }
    operator.kubectl("apply", "-f", "-", input=json.dumps(hpa))

    # Below minReplicas the HPA scales without metrics: GET /scale, then PUT /scale with 2.
    cr = wait_ready(operator, "hpa", namespace, replicas=2, timeout=240)
    assert cr["spec"]["replicas"] == 2 and deployment_replicas(operator, "hpa", namespace) == 2
    events = operator.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=HorizontalPodAutoscaler"
    ).stdout
    assert "SuccessfulRescale" in events and "New size: 2" in events, events
    assert "FailedGetScale" not in events, events

    # In range, it reads /scale each sync and finds the selector; only the metric is missing.
    def settled():
        conditions = hpa_conditions(operator, "hpa", namespace)
        active = conditions.get("ScalingActive", {})
        return conditions if active.get("status") == "False" and active.get("reason") else None

    conditions = wait_for(settled, timeout=60, interval=1, what="the HPA to try its metric")
    assert conditions["AbleToScale"]["status"] == "True", conditions
    assert conditions["AbleToScale"]["reason"] in ("SucceededGetScale", "SucceededRescale"), conditions
    assert conditions["ScalingActive"]["reason"] == "FailedGetPodsMetric", conditions
    status = hpa_status(operator, "hpa", namespace)
    assert status["currentReplicas"] == 2 and status["desiredReplicas"] == 2, status
    assert get_cr(operator, "hpa", namespace)["spec"]["replicas"] == 2  # nothing else moved it
