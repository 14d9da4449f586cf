"""The Helm chart (manifests/charts/kvscale/) against the kustomize install it packages, rendered by
the real helm (built from its Go module: python3 e2e/helm.py build) and the real kustomize
(kubectl kustomize): the same objects, object by object, in both install modes; its CRD is crds/'s;
values.schema.json refuses what it should. e2e/test_helm.py installs it on the real node."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from test_rbac import kubectl

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
CHART = MANIFESTS / "charts" / "kvscale"
HELM_BIN = REPO / "e2e" / ".bin" / "helm"
# The labels Helm charts conventionally add, which a kustomize install has no counterpart for.
HELM_LABELS = {
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
}
PODMONITOR = "monitoring.coreos.com/v1/PodMonitor"

Key = tuple[str, str, str | None]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    if not HELM_BIN.is_file():
        pytest.skip("needs the helm binary: python3 e2e/helm.py build")
    return subprocess.run([str(HELM_BIN), *args], check=check, capture_output=True, text=True)


def template(*args: str, namespace: str = "kvscale-system") -> dict[Key, dict]:
    return by_key(helm("template", "kvscale", str(CHART), "--namespace", namespace, *args).stdout)


def kustomize(path: Path) -> dict[Key, dict]:
    out = subprocess.run([kubectl(), "kustomize", str(path)], check=True, capture_output=True, text=True)
    return by_key(out.stdout)


def by_key(text: str) -> dict[Key, dict]:
    docs = [d for d in yaml.safe_load_all(text) if d]
    keyed = {(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")): d for d in docs}
    assert len(keyed) == len(docs), "two objects with one kind, name and namespace"
    return keyed


def normalized(obj: dict) -> dict:
    """The object less Helm's own labels, with RBAC rules as a sorted list (their order means
    nothing to the authorizer)."""
    obj = json.loads(json.dumps(obj))
    labels = obj["metadata"].get("labels", {})
    for label in HELM_LABELS & labels.keys():
        del labels[label]
    if "rules" in obj and obj["kind"] in ("Role", "ClusterRole"):
        obj["rules"] = sorted(obj["rules"], key=lambda r: json.dumps(r, sort_keys=True))
    return obj


def assert_same(chart: dict[Key, dict], kustomized: dict[Key, dict]) -> None:
    assert chart.keys() == kustomized.keys(), (
        chart.keys() - kustomized.keys(),
        kustomized.keys() - chart.keys(),
    )
    for key in chart:
        assert normalized(chart[key]) == normalized(kustomized[key]), key


def test_the_chart_lints_strictly():
    out = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out.stdout, out.stdout + out.stderr


def test_the_charts_crd_is_the_one_generated_from_the_models():
    """crds/ is checked against `kvscale-operator crd` (tests/test_operator_units.py); the chart's
    copy (Helm reads CRDs only from inside the chart) must be that file, byte for byte."""
    crds = sorted((REPO / "crds").iterdir())
    assert [p.name for p in crds] == [
        "inferencedeployments.kvscale.dev.yaml",
        "inferenceendpoints.kvscale.dev.yaml",
    ]
    for crd in crds:
        assert (CHART / "crds" / crd.name).read_bytes() == crd.read_bytes(), (
            f"the chart's CRD is stale: cp {crd.relative_to(REPO)} {CHART.relative_to(REPO)}/crds/"
        )
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == [p.name for p in crds]


def test_the_default_values_render_the_kustomize_install():
    kustomized = kustomize(MANIFESTS)
    # The release namespace is Helm's to make (--create-namespace); the chart never owns it, so an
    # uninstall cannot delete everything in it.
    del kustomized[("Namespace", "kvscale-system", None)]
    assert_same(template(), kustomized)


def test_the_namespaced_values_render_the_namespaced_kustomize_install():
    kustomized = kustomize(MANIFESTS / "namespaced")
    del kustomized[("Namespace", "kvscale-system", None)]
    chart = template("--set", "scope=namespaced", "--set", "watchNamespaces={kvscale-workloads}")
    assert not [key for key in chart if key[0].startswith("Cluster")]
    assert_same(chart, kustomized)


def test_the_admission_policy_and_the_admin_policy_are_the_manifests_ones():
    chart = template("--set", "admissionPolicy=true")
    assert_same(
        {k: v for k, v in chart.items() if k[0].startswith("ValidatingAdmissionPolicy")},
        kustomize(MANIFESTS / "admission"),
    )
    example = yaml.safe_load((MANIFESTS / "policy-example.yaml").read_text())
    policy = yaml.safe_load(example["data"]["policy.yaml"])
    values = json.dumps({"policy": policy})  # JSON is YAML: helm reads it as a values file
    chart = by_key(
        subprocess.run(
            [str(HELM_BIN), "template", "kvscale", str(CHART), "-n", "kvscale-system", "-f", "-"],
            input=values,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    config = chart[("ConfigMap", "kvscale-operator-policy", "kvscale-system")]
    assert yaml.safe_load(config["data"]["policy.yaml"]) == policy
    assert config["metadata"]["name"] == example["metadata"]["name"]


def test_the_release_namespace_is_used_everywhere():
    chart = template(
        "--set", "admissionPolicy=true", "--set", "podMarksNamespaces={team-a}", namespace="inference"
    )
    text = json.dumps(list(chart.values()))
    assert "kvscale-system" not in text
    namespaced = {key[2] for key in chart if not key[0].startswith(("Cluster", "ValidatingAdmission"))}
    assert namespaced == {"inference", "team-a"}
    binding = chart[("ClusterRoleBinding", "kvscale-operator", None)]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvscale-operator", "namespace": "inference"}
    ]
    assert chart[("RoleBinding", "kvscale-operator-pod-marks", "team-a")]["subjects"] == binding["subjects"]
    policy = chart[("ValidatingAdmissionPolicy", "kvscale-operator-writes", None)]
    assert "system:serviceaccount:inference:kvscale-operator" in json.dumps(policy["spec"]["matchConditions"])


def test_values_reach_the_operators_pod():
    chart = template(
        "--set",
        "image.tag=9.9.9",
        "--set",
        "logLevel=DEBUG",
        "--set",
        "env.KVSCALE_LEASE_DURATION=30",
        "--set",
        "replicas=3",
        "--set",
        "nodeSelector.pool=system",
    )
    deployment = chart[("Deployment", "kvscale-operator", "kvscale-system")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == "ghcr.io/kvscale/kvscale-operator:9.9.9"
    assert env["KVSCALE_LOG_LEVEL"] == "DEBUG" and env["KVSCALE_LEASE_DURATION"] == "30"
    assert deployment["spec"]["replicas"] == 3 and pod["nodeSelector"] == {"pool": "system"}
    # Helm's labels stay off the pod template: a chart upgrade alone rolls no pod.
    assert not HELM_LABELS & deployment["spec"]["template"]["metadata"]["labels"].keys()


def test_pod_monitors_only_where_the_cluster_serves_them():
    assert not [key for key in template() if key[0] == "PodMonitor"]
    chart = template("--api-versions", PODMONITOR)
    monitors = {key[1]: obj for key, obj in chart.items() if key[0] == "PodMonitor"}
    assert monitors.keys() == {"kvscale-operator", "kvscale-workers"}
    assert monitors["kvscale-workers"]["spec"]["namespaceSelector"] == {"any": True}
    assert monitors["kvscale-workers"]["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    scoped = template(
        "--api-versions", PODMONITOR, "--set", "scope=namespaced", "--set", "watchNamespaces={a,b}"
    )
    assert scoped[("PodMonitor", "kvscale-workers", "kvscale-system")]["spec"]["namespaceSelector"] == {
        "matchNames": ["a", "b"]
    }
    off = template("--api-versions", PODMONITOR, "--set", "podMonitors.enabled=false")
    assert not [key for key in off if key[0] == "PodMonitor"]


@pytest.mark.parametrize(
    ("values", "says"),
    [
        (["--set", "replica=3"], "replica"),  # a typo: unknown keys are refused, not ignored
        (["--set", "logLevel=LOUD"], "logLevel"),
        (["--set", "scope=namespaced"], "watchNamespaces"),
        (["--set", "scope=everywhere"], "scope"),
        (["--set", "env.POD_NAME=x"], "POD_NAME"),  # the chart's own variables cannot be overridden
        (["--set", "watchNamespaces={Bad_Name}"], "watchNamespaces"),
        (["--set", "replicas=0"], "replicas"),
        (["--set", "podMonitors.interval=often"], "interval"),
    ],
)
def test_the_values_schema_refuses_bad_values(values, says):
    out = helm("template", "kvscale", str(CHART), *values, check=False)
    assert out.returncode != 0, out.stdout[:500]
    assert says in out.stderr, out.stderr
