"""The operator on the real node: its own pod from its image, under the ServiceAccount and RBAC
of manifests/. The CRD refuses bad resources; manifests/examples/ becomes worker pods (the worker
image, the fixture model mounted from a PersistentVolume through `pvc://`) that the kubelet's
probes turn Ready and that answer completions through the Service's ClusterIP (kube-proxy);
spec changes roll out, status tells the truth, restarts converge without touching unchanged
children, deletion collects everything, and the operator does all of it under its RBAC (checked
in the API server's audit log)."""

from __future__ import annotations

import copy
import ipaddress
import json
import os
import signal
import threading
import urllib.error
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest
import yaml
from audit import OPERATOR_USER, applied, audit_lines
from images import WORKER_IMAGE
from kubernetes import client
from model_fixtures import SHARED_MODELS, TARGET
from realnode import NODE_IP, POD_CIDR, SERVICE_CIDR
from service_route import wait_routed
from test_controlplane import wait_for

REPO = Path(__file__).resolve().parents[1]
OPERATOR_NS, OPERATOR = "kvscale-system", "kvscale-operator"
GROUP, VERSION, PLURAL = "kvscale.dev", "v1alpha1", "inferencedeployments"


# What the suite's resources ask beyond the default admin policy (operator/reconcile/admin_policy.py): the
# pod-template test's PriorityClass and RuntimeClass, the stand-in Hub's plain-http endpoint on
# the node (e2e/test_hf_model.py), which gets a token.
E2E_POLICY = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {"name": "kvscale-operator-policy", "namespace": OPERATOR_NS},
    "data": {
        "policy.yaml": json.dumps(
            {
                "priorityClassNames": ["kvscale-*"],
                "runtimeClassNames": ["kvscale-e2e"],
                "insecureHfEndpoints": [f"http://{NODE_IP}:*"],
            }
        )
    },
}


@pytest.fixture(scope="module")
def operator(cluster):
    """crds/ and manifests/ applied as a user would; the operator pods run (from the operator
    image, under the ServiceAccount of manifests/) until one holds the lease."""
    cluster.require_node()
    if not TARGET.is_dir():
        pytest.skip("needs ../shared/models/tiny-code-target for the worker pods")
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    for plural in (PLURAL, "inferenceendpoints"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{plural}.{GROUP}", "--timeout=60s")
    # The admin policy first, so the operator's pods mount it from their start.
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "manifests" / "base" / "namespace.yaml"))
    cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(E2E_POLICY))
    cluster.kubectl("apply", "--server-side", "-k", str(REPO / "manifests"))
    cluster.kubectl("rollout", "status", f"deployment/{OPERATOR}", "-n", OPERATOR_NS, "--timeout=120s")
    coord = client.CoordinationV1Api(cluster.api)

    def leader():
        try:
            return coord.read_namespaced_lease(OPERATOR, OPERATOR_NS).spec.holder_identity
        except client.ApiException:
            return None

    wait_for(leader, timeout=60, what="an operator to take the lease")
    return cluster


def wait_for_new_leader(cluster, old_pods: set[str]) -> str:
    """The operator's rollout is done, a pod of the new ReplicaSet holds the Lease and the old
    pods are gone (none of them can send another request)."""
    cluster.kubectl("rollout", "status", f"deployment/{OPERATOR}", "-n", OPERATOR_NS, "--timeout=180s")
    coord = client.CoordinationV1Api(cluster.api)

    def new_leader():
        try:
            holder = coord.read_namespaced_lease(OPERATOR, OPERATOR_NS).spec.holder_identity
        except client.ApiException:
            return None
        return holder if holder and holder not in old_pods else None

    leader = wait_for(new_leader, timeout=120, interval=0.5, what="a pod of the new rollout to lead")
    wait_for(lambda: not operator_pods(cluster) & old_pods, timeout=60, what="the old operator pods to go")
    return leader


def operator_pods(cluster) -> set[str]:
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(
        OPERATOR_NS, label_selector="app.kubernetes.io/name=kvscale-operator"
    )
    return {p.metadata.name for p in pods.items}


MODELS_CLAIM = "models"  # in each test namespace: ../shared/models, read-only


def models_volume(cluster, namespace: str, host_path: Path, claim: str = MODELS_CLAIM) -> None:
    """A hostPath PersistentVolume of host_path bound to the claim `claim` in namespace: workers
    mount it for `pvc://CLAIM/...` (the PV goes with the namespace, see `namespace`)."""
    pv = f"{claim}-{namespace}"
    docs = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv, "labels": {"kvscale.dev/test-namespace": namespace}},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(host_path.resolve()), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]
    for doc in docs:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(doc))
    wait_for(
        lambda: (
            cluster.kubectl("get", "pvc", claim, "-n", namespace, "-o", "jsonpath={.status.phase}").stdout
            == "Bound"
        ),
        timeout=60,
        what=f"the claim {claim} to bind",
    )


@pytest.fixture
def namespace(operator):
    name = f"op-{uuid.uuid4().hex[:6]}"
    operator.kubectl("create", "namespace", name)
    if operator.local:
        models_volume(operator, name, SHARED_MODELS)
    yield name
    operator.kubectl("delete", "namespace", name, "--wait=false", check=False)
    if operator.local:
        operator.kubectl(
            "delete", "pv", "-l", f"kvscale.dev/test-namespace={name}", "--wait=false", check=False
        )


@pytest.fixture(scope="module")
def refusing_namespace(operator):
    """One namespace for the module's tests whose every resource the API server refuses: nothing
    is ever created in it (each test checks), so the tests cannot see each other's, and it needs
    no model volume (no pod runs)."""
    name = f"refused-{uuid.uuid4().hex[:6]}"
    operator.kubectl("create", "namespace", name)
    yield name
    operator.kubectl("delete", "namespace", name, "--wait=false", check=False)


# Per worker: two workers and a rollout's surge (three) plus both operator pods fit the node's
# two CPUs; the kubelet enforces the limit (requests = limits).
WORKER_RESOURCES = {"cpu": "500m", "memory": "2Gi"}


def example(name: str, namespace: str, **spec_overrides) -> dict:
    doc = yaml.safe_load((REPO / "manifests" / "examples" / "tiny-cpu.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"]["model"]["uri"] = f"pvc://{MODELS_CLAIM}/{TARGET.name}"  # the fixture model, from its PV
    doc["spec"]["resources"] = dict(WORKER_RESOURCES)
    # Eager workers, as tests/conftest.py makes its engines: compiling the forward (the image's
    # default on CPU) costs a cold pod at 500m ~115 s before Ready, against ~8 s eager, and the suite
    # starts dozens of pods. e2e/test_worker_compile.py runs the default in a pod.
    doc["spec"]["env"] = [{"name": "KVSCALE_ENFORCE_EAGER", "value": "1"}]
    for key, value in spec_overrides.items():
        doc["spec"][key] = value
    return doc


def apply(cluster, doc: dict) -> None:
    cluster.kubectl("apply", "--server-side", "--field-manager=e2e-user", "-f", "-", input=json.dumps(doc))


def get_cr(cluster, name: str, namespace: str) -> dict:
    return client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name
    )


def condition(cr: dict, type_: str) -> dict:
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def wait_ready(cluster, name: str, namespace: str, replicas: int, timeout: float = 180) -> dict:
    def ready():
        cr = get_cr(cluster, name, namespace)
        status = cr.get("status") or {}
        ok = condition(cr, "Ready").get("status") == "True" and status.get("readyReplicas") == replicas
        return cr if ok and status.get("observedGeneration") == cr["metadata"]["generation"] else None

    what = f"{name} to be Ready with {replicas} workers"
    try:
        return wait_for(ready, timeout=timeout, interval=0.5, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{explain(cluster, name, namespace)}") from None


def respelled(doc: dict) -> dict:
    """doc as a new generation that renders the same children: its CPU spelled as a decimal
    ("500m" -> "0.5"), which the API server stores in the Deployment as it stores "500m"."""
    out = copy.deepcopy(doc)
    assert out["spec"]["resources"]["cpu"] == "500m"
    out["spec"]["resources"]["cpu"] = "0.5"
    return out


def wait_applied(cluster, name: str, namespace: str, timeout: float = 60) -> dict:
    """The resource once status.observedGeneration has reached its generation: the operator has
    applied that generation in full (the status write is the last step of its sync)."""

    def applied_now():
        cr = get_cr(cluster, name, namespace)
        observed = (cr.get("status") or {}).get("observedGeneration") or 0
        return cr if observed >= cr["metadata"]["generation"] else None

    return wait_for(applied_now, timeout=timeout, interval=0.2, what=f"{name}'s generation to be applied")


def explain(cluster, name: str, namespace: str) -> str:
    """What a failure report needs: the resource's status, its pods' states, events and log tails."""
    selector = f"kvscale.dev/inference-deployment={name}"
    parts = [
        cluster.kubectl("get", "infd", name, "-n", namespace, "-o", "jsonpath={.status}", check=False).stdout,
        cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "wide", check=False).stdout,
        cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout,
    ]
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(namespace, label_selector=selector).items
    for pod in pods:
        for c in [*(pod.spec.init_containers or []), *pod.spec.containers]:
            logs = cluster.kubectl(
                "logs", pod.metadata.name, "-n", namespace, "-c", c.name, "--tail=30", check=False
            )
            parts.append(f"--- {pod.metadata.name}/{c.name}\n{logs.stdout}{logs.stderr}")
    return "\n".join(parts)


def children_versions(cluster, name: str, namespace: str) -> dict[str, str]:
    apps, core, policy = (
        client.AppsV1Api(cluster.api),
        client.CoreV1Api(cluster.api),
        client.PolicyV1Api(cluster.api),
    )
    return {
        "Deployment": apps.read_namespaced_deployment(name, namespace).metadata.resource_version,
        "Service": core.read_namespaced_service(name, namespace).metadata.resource_version,
        "PodDisruptionBudget": policy.read_namespaced_pod_disruption_budget(
            name, namespace
        ).metadata.resource_version,
    }


def complete(address: str, served_name: str) -> dict:
    """A completion from the worker(s) at address (host:port: a ClusterIP, or a pod)."""
    body = json.dumps(
        {"model": served_name, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}
    )
    request = urllib.request.Request(
        f"http://{address}/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def complete_when_routed(address: str, served_name: str, timeout: float = 60.0) -> dict:
    """complete() through a Service whose pods just turned Ready, once kube-proxy routes it."""
    host, port = address.rsplit(":", 1)
    wait_routed(host.strip("[]"), int(port), timeout)
    return complete(address, served_name)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (  # also what kubectl scale, an HPA or KEDA meet on an autoscaled resource (test_scale.py)
            {"model": {"uri": "/m"}, "replicas": 3, "autoscaling": {"maxReplicas": 2}},
            "with autoscaling the operator's autoscaler sets the worker count: leave replicas out",
        ),
        (
            {
                "model": {"uri": "/m"},
                "router": {"enabled": False},
                "autoscaling": {"minReplicas": 0, "maxReplicas": 2},
            },
            "autoscaling.minReplicas 0 needs the router",
        ),
        ({"model": {"uri": "/m"}, "autoscaling": {"maxReplicas": 0}}, "spec.autoscaling.maxReplicas"),
        (
            {"model": {"uri": "/m"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
            "minReplicas must not exceed",
        ),
        ({"model": {"uri": "/m"}, "replicas": -1}, "spec.replicas"),
        ({"model": {"uri": "/m"}, "speculative": {"method": "medusa"}}, 'Unsupported value: "medusa"'),
        ({"model": {"uri": "/m"}, "speculative": {"method": "draft"}}, "method draft needs draftModelUri"),
        ({"engine": {"maxNumSeqs": 8}}, "spec.model: Required value"),
        ({"model": {"uri": "https://hub/model"}}, "spec.model.uri"),
        # Specs that passed before and made children the API server refuses (the field and the
        # rule's message, as kubectl prints them).
        *(
            ({"model": {"uri": "/m"}, "resources": {field: value}}, f"spec.resources.{field}")
            for field, value in (("cpu", "1.2.3"), ("memory", "2Gim"), ("cpu", "0"), ("memory", "-1Gi"))
        ),
        (
            {"model": {"uri": "/m"}, "resources": {"memory": "2Gim"}},
            "must be a positive Kubernetes quantity such as 512Mi or 8Gi",
        ),
        (
            {"model": {"uri": "/m"}, "resources": {"ephemeralStorage": "1.2.3"}},
            "positive Kubernetes quantity",
        ),
        ({"model": {"uri": "pvc://"}}, "pvc:// needs the name of a PersistentVolumeClaim"),
        ({"model": {"uri": "pvc:///llama"}}, "pvc:// needs the name of a PersistentVolumeClaim"),
        ({"model": {"uri": "pvc://.models/llama"}}, "pvc:// needs the name of a PersistentVolumeClaim"),
        ({"model": {"uri": "pvc://models./llama"}}, "pvc:// needs the name of a PersistentVolumeClaim"),
        ({"model": {"uri": "pvc://models/../etc"}}, "must not contain '..' path segments"),
        (
            {"model": {"uri": "/m"}, "speculative": {"method": "draft", "draftModelUri": "pvc://"}},
            "spec.speculative.draftModelUri",
        ),
        (
            {"model": {"uri": "/m"}, "resources": {"gpus": 9}},
            "gpus must be at most 8: one pod's tensor-parallel ranks share one node",
        ),
        ({"model": {"uri": "/m"}, "resources": {"gpus": 16}}, "spec.resources.gpus"),
        (
            {"model": {"uri": "/m"}, "parallelism": {"tensor": 3, "nodes": 2}},
            "parallelism.tensor must be a multiple of parallelism.nodes",
        ),
        (
            {"model": {"uri": "/m"}, "parallelism": {"tensor": 8, "nodes": 2}, "resources": {"gpus": 2}},
            "resources.gpus must be parallelism.tensor / parallelism.nodes",
        ),
        (
            {"model": {"uri": "/m"}, "env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]},
            "spec.env[1]: Duplicate value",
        ),
        ({"model": {"uri": "/m"}, "server": {"apiKeySecret": "Api_Keys"}}, "must be the name of a Secret"),
        ({"model": {"uri": "/m"}, "nodeSelector": {"gpu type": "h100"}}, "keys must be label keys"),
        ({"model": {"uri": "/m"}, "nodeSelector": {"gpu": "-h100"}}, "must be a label value"),
        (
            {"model": {"uri": "/m"}, "tolerations": [{"operator": "Equal", "value": "x"}]},
            "operator must be Exists when key is empty",
        ),
        (
            {"model": {"uri": "/m"}, "podMetadata": {"labels": {"app.kubernetes.io/name": "mine"}}},
            "are the operator's labels",
        ),
        (
            {"model": {"uri": "/m"}, "podMetadata": {"labels": {"kvscale.dev/inference-deployment": "x"}}},
            "are the operator's labels",
        ),
        (
            {"model": {"uri": "/m"}, "rollout": {"maxSurge": 0}},
            "maxSurge and maxUnavailable cannot both be 0",
        ),
        ({"model": {"uri": "/m"}, "priorityClassName": "High"}, "must be the name of a PriorityClass"),
        (
            {"model": {"uri": "/m"}, "imagePullSecrets": [{"name": "r"}, {"name": "r"}]},
            "spec.imagePullSecrets[1]: Duplicate value",
        ),
    ],
)
def test_invalid_resources_are_refused_by_the_api_server(operator, refusing_namespace, spec, message):
    namespace = refusing_namespace
    doc = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceDeployment",
        "metadata": {"name": "bad"},
        "spec": spec,
    }
    result = operator.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert operator.kubectl("get", "infd", "-n", namespace, "-o", "name").stdout == ""


@pytest.mark.parametrize("name", ["a" * 64, "models.llama", "8b-llama"])
def test_names_that_cannot_name_the_children_are_refused_by_the_api_server(
    operator, refusing_namespace, name
):
    """Valid names for the resource itself (a DNS subdomain) but not for its children: a label
    value has at most 63 characters, a Service name is a DNS-1035 label (no dots, a letter first)."""
    namespace = refusing_namespace
    doc = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"uri": "/m"}},
    }
    result = operator.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False)
    assert result.returncode != 0, result.stdout
    assert "metadata.name must be at most 63 lowercase letters" in result.stderr, result.stderr
    assert operator.kubectl("get", "infd", "-n", namespace, "-o", "name").stdout == ""


def test_a_status_with_a_condition_type_the_crd_does_not_know_is_accepted(operator, namespace):
    """A newer operator may write condition types this CRD has never heard of: the status
    subresource takes them (no enum on the type)."""
    apply(operator, example("future", namespace, replicas=0))
    custom = client.CustomObjectsApi(operator.api)
    condition_ = {"type": "FromANewerOperator", "status": "True", "reason": "Newer", "message": "m"}
    written = custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "future", {"status": {"conditions": [condition_]}}
    )
    assert condition_ in written["status"]["conditions"]


def test_pod_template_fields_reach_the_deployment_and_the_workers(operator, namespace):
    """The spec's pod template fields end up in a Deployment the API server accepted (server-side
    apply refuses an invalid one), and those a CPU node can run in a worker that turns Ready."""
    if not operator.local:
        pytest.skip("mounts the fixture model from this machine")
    scheduling = client.SchedulingV1Api(operator.api)
    priority = f"kvscale-{namespace}"
    scheduling.create_priority_class(
        client.V1PriorityClass(metadata=client.V1ObjectMeta(name=priority), value=1000)
    )
    try:
        _pod_template_fields(operator, namespace, priority)
    finally:
        scheduling.delete_priority_class(priority)


def _pod_template_fields(cluster, namespace: str, priority: str) -> None:
    apps, core = client.AppsV1Api(cluster.api), client.CoreV1Api(cluster.api)
    prefer_linux = {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": 1,
                "preference": {
                    "matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]
                },
            }
        ]
    }
    spread = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
    fields = {
        "resources": {**WORKER_RESOURCES, "ephemeralStorage": "1Gi"},
        "affinity": {"nodeAffinity": prefer_linux},
        "topologySpreadConstraints": [spread],
        "priorityClassName": priority,
        "podMetadata": {
            "labels": {"team": "search"},
            "annotations": {"prometheus.io/scrape": "false", "example.com/owner": "search"},
        },
        "rollout": {"maxSurge": 0, "maxUnavailable": 1},
    }
    # First with no workers, so a RuntimeClass and a pull Secret that do not exist cannot stop
    # pods from starting: the Deployment itself must carry everything.
    doc = example(
        "podtpl",
        namespace,
        replicas=0,
        runtimeClassName="kvscale-e2e",
        imagePullSecrets=[{"name": "registry"}],
        **fields,
    )
    apply(cluster, doc)

    def deployed():
        try:
            dep = apps.read_namespaced_deployment("podtpl", namespace)
        except client.ApiException:
            return None
        return dep if dep.spec.template.spec.runtime_class_name == "kvscale-e2e" else None

    dep = wait_for(deployed, timeout=60, what="the Deployment with the pod template fields")
    pod = dep.spec.template.spec
    assert dep.spec.strategy.rolling_update.max_surge == 0
    assert dep.spec.strategy.rolling_update.max_unavailable == 1
    assert pod.runtime_class_name == "kvscale-e2e" and pod.priority_class_name == priority
    assert [s.name for s in pod.image_pull_secrets] == ["registry"]
    assert pod.affinity.node_affinity.preferred_during_scheduling_ignored_during_execution[0].weight == 1
    (constraint,) = pod.topology_spread_constraints
    assert constraint.label_selector.match_labels == dep.spec.selector.match_labels  # ours by default
    assert dep.spec.template.metadata.labels["team"] == "search"
    assert dep.spec.template.metadata.annotations["prometheus.io/scrape"] == "false"
    volumes = {v.name: v for v in pod.volumes}
    assert volumes["tmp"].empty_dir.size_limit == "1Gi"
    assert pod.containers[0].resources.requests["ephemeral-storage"] == "1Gi"
    # The operator applies the children one after the other (Deployment, Service, PDB): the PDB may
    # come a moment after the Deployment the wait above saw.
    policy = client.PolicyV1Api(cluster.api)

    def pdb_applied():
        try:
            return policy.read_namespaced_pod_disruption_budget("podtpl", namespace)
        except client.ApiException as e:
            if e.status != 404:
                raise
            return None

    pdb = wait_for(pdb_applied, timeout=60, what="the PodDisruptionBudget")
    assert pdb.spec.unhealthy_pod_eviction_policy == "AlwaysAllow"

    # Then a real worker, with what this node has: the scheduler, the kubelet and the admission
    # plugins (Priority) take the template as it is.
    doc = example("podtpl", namespace, replicas=1, **fields)
    apply(cluster, doc)
    cr = wait_ready(cluster, "podtpl", namespace, replicas=1)
    (worker,) = [
        p
        for p in core.list_namespaced_pod(namespace, label_selector=cr["status"]["selector"]).items
        if p.metadata.deletion_timestamp is None
    ]
    assert worker.spec.priority_class_name == priority and worker.spec.priority == 1000
    assert worker.spec.runtime_class_name is None and not worker.spec.image_pull_secrets
    assert worker.metadata.labels["team"] == "search"
    assert worker.metadata.annotations["example.com/owner"] == "search"
    assert worker.spec.containers[0].resources.requests["ephemeral-storage"] == "1Gi"
    assert {v.name: v for v in worker.spec.volumes}["tmp"].empty_dir.size_limit == "1Gi"


def test_cpu_example_runs_real_workers_rolls_out_changes_and_is_collected(operator, namespace):
    if not operator.local:
        pytest.skip("mounts the fixture model from this machine")
    doc = example("tiny", namespace)
    apply(operator, doc)
    cr = wait_ready(operator, "tiny", namespace, replicas=2)
    uid = cr["metadata"]["uid"]
    assert cr["status"]["ready"] == "2/2" and condition(cr, "Degraded")["status"] == "False"
    assert (
        cr["status"]["selector"]
        == "app.kubernetes.io/name=kvscale-worker,kvscale.dev/inference-deployment=tiny"
    )

    apps, core, policy = (
        client.AppsV1Api(operator.api),
        client.CoreV1Api(operator.api),
        client.PolicyV1Api(operator.api),
    )
    for child in (
        apps.read_namespaced_deployment("tiny", namespace),
        core.read_namespaced_service("tiny", namespace),
        policy.read_namespaced_pod_disruption_budget("tiny", namespace),
    ):
        (ref,) = child.metadata.owner_references
        assert (ref.kind, ref.name, ref.uid, ref.controller) == ("InferenceDeployment", "tiny", uid, True)
    pods = core.list_namespaced_pod(namespace, label_selector=cr["status"]["selector"]).items
    pod_net = ipaddress.ip_network(POD_CIDR)
    assert len(pods) == 2 and all(ipaddress.ip_address(p.status.pod_ip) in pod_net for p in pods)
    for pod in pods:  # the kubelet ran the image as the securityContext says, the model from its PV
        (worker,) = pod.spec.containers
        assert worker.image == WORKER_IMAGE and worker.security_context.read_only_root_filesystem
        # No fixed UID (OpenShift's restricted-v2 assigns one): the kubelet checked the image's
        # numeric USER against runAsNonRoot, and the pod started.
        assert pod.spec.security_context.run_as_non_root and pod.spec.security_context.run_as_user is None
        assert "/models/models/tiny-code-target" in worker.args
        assert [
            v.persistent_volume_claim.claim_name for v in pod.spec.volumes if v.persistent_volume_claim
        ] == [MODELS_CLAIM]
        assert pod.status.container_statuses[0].ready and pod.status.container_statuses[0].started
    service = core.read_namespaced_service("tiny", namespace)
    assert ipaddress.ip_address(service.spec.cluster_ip) in ipaddress.ip_network(SERVICE_CIDR)
    address = f"{service.spec.cluster_ip}:{service.spec.ports[0].port}"
    complete_when_routed(address, "tiny")
    for _ in range(4):  # through kube-proxy's rules, to either worker
        answer = complete(address, "tiny")
        assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 8
    printed = operator.kubectl("get", "infd", "tiny", "-n", namespace).stdout
    assert "2/2" in printed and "AllWorkersReady" in printed
    events = operator.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=tiny"
    ).stdout
    assert "Created" in events and "ReadyTrue" in events

    # Re-applying the same resource writes nothing to any child (a no-op on the API server: no
    # event), nor does a new generation that renders the same children: once observedGeneration
    # says the operator applied it in full, every child has the resourceVersion it had.
    before = children_versions(operator, "tiny", namespace)
    apply(operator, doc)
    apply(operator, respelled(doc))
    wait_applied(operator, "tiny", namespace)
    assert children_versions(operator, "tiny", namespace) == before

    # An engine change rolls the workers through the Deployment: Progressing, then Ready again.
    # ... under load through the ClusterIP: the kubelet runs each old pod's preStop, SIGTERM and
    # drain while kube-proxy moves the traffic to the new ones; no request may fail.
    old_pods = {p.metadata.name for p in pods}
    outcomes: list[str] = []
    stop_load = threading.Event()

    def load() -> None:
        while not stop_load.is_set():
            try:
                answer = complete(f"{service.spec.cluster_ip}:{service.spec.ports[0].port}", "tiny")
                outcomes.append("ok" if answer["usage"]["completion_tokens"] == 8 else str(answer))
            except Exception as e:
                outcomes.append(f"{type(e).__name__}: {e}")

    clients = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for t in clients:
        t.start()
    changed = copy.deepcopy(doc)
    changed["spec"]["engine"]["maxNumSeqs"] = 8
    apply(operator, changed)
    wait_for(
        lambda: condition(get_cr(operator, "tiny", namespace), "Progressing").get("status") == "True",
        timeout=60,
        interval=0.2,
        what="Progressing=True during the rollout",
    )
    cr = wait_ready(operator, "tiny", namespace, replicas=2)
    wait_for(
        lambda: not any(p.metadata.name in old_pods for p in core.list_namespaced_pod(namespace).items),
        timeout=120,
        what="the old workers to drain and go",
    )
    stop_load.set()
    for t in clients:
        t.join(timeout=60)
    failed = [o for o in outcomes if o != "ok"]
    assert outcomes and not failed, failed[:5]
    assert condition(cr, "Progressing")["status"] == "False"
    new_pods = core.list_namespaced_pod(namespace, label_selector=cr["status"]["selector"]).items
    new_pods = [p for p in new_pods if p.metadata.deletion_timestamp is None]
    assert old_pods.isdisjoint(p.metadata.name for p in new_pods)
    for p in new_pods:
        args = p.spec.containers[0].args
        assert args[args.index("--max-num-seqs") + 1] == "8"

    # Deleting the resource collects every child.
    client.CustomObjectsApi(operator.api).delete_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "tiny"
    )
    wait_for(
        lambda: not apps.list_namespaced_deployment(namespace).items, what="the Deployment to be collected"
    )
    wait_for(lambda: not core.list_namespaced_service(namespace).items, what="the Service to be collected")
    wait_for(
        lambda: not policy.list_namespaced_pod_disruption_budget(namespace).items,
        what="the PDB to be collected",
    )
    wait_for(
        lambda: not core.list_namespaced_pod(namespace).items, timeout=90, what="the worker pods to be gone"
    )


def test_killing_the_operator_mid_reconcile_converges_without_duplicates(operator, namespace):
    if not operator.local:
        pytest.skip("kills the operator's process on the local node")
    core = client.CoreV1Api(operator.api)
    coord = client.CoordinationV1Api(operator.api)
    leader = coord.read_namespaced_lease(OPERATOR, OPERATOR_NS).spec.holder_identity
    pod = core.read_namespaced_pod(leader, OPERATOR_NS)
    pid = operator.node.container_pid(pod.status.container_statuses[0].container_id)

    apply(operator, example("crash", namespace, replicas=1))
    wait_for(
        lambda: client.AppsV1Api(operator.api).list_namespaced_deployment(namespace).items,
        interval=0.05,
        what="the reconcile to start",
    )
    os.kill(pid, signal.SIGKILL)  # mid-reconcile: the Service and PDB may not exist yet

    cr = wait_ready(operator, "crash", namespace, replicas=1, timeout=180)
    assert cr["status"]["ready"] == "1/1"
    for kind, lister, names in (
        ("Deployment", client.AppsV1Api(operator.api).list_namespaced_deployment, ["crash", "crash-router"]),
        ("Service", core.list_namespaced_service, ["crash", "crash-router"]),
        (
            "PodDisruptionBudget",
            client.PolicyV1Api(operator.api).list_namespaced_pod_disruption_budget,
            ["crash", "crash-router"],
        ),
    ):  # the workers' children and the router's, once each
        assert sorted(o.metadata.name for o in lister(namespace).items) == names, kind
    replica_sets = client.AppsV1Api(operator.api).list_namespaced_replica_set(namespace).items
    workers = [r for r in replica_sets if not r.metadata.name.startswith("crash-router-")]
    assert len(workers) == 1  # the restart did not produce a second pod template

    # A later restart (a new leader resuming every resource applies each child again) writes
    # nothing to converged children: once the audit log shows the new leader's apply of each of
    # them, none has a new resourceVersion.
    before = children_versions(operator, "crash", namespace)
    mark = audit_lines(operator)
    leader = coord.read_namespaced_lease(OPERATOR, OPERATOR_NS).spec.holder_identity
    operator.kubectl("delete", "pod", leader, "-n", OPERATOR_NS, "--wait=false")
    wait_for(
        lambda: coord.read_namespaced_lease(OPERATOR, OPERATOR_NS).spec.holder_identity not in (None, leader),
        timeout=90,
        interval=0.5,
        what="another operator to take over",
    )
    resent = {("deployments", "crash"), ("services", "crash"), ("poddisruptionbudgets", "crash")}
    wait_for(
        lambda: resent <= applied(operator, mark, namespace),
        timeout=90,
        interval=0.5,
        what="the new leader to apply the children again",
    )
    assert children_versions(operator, "crash", namespace) == before


def test_only_the_lease_holder_acts(operator):
    pods = client.CoreV1Api(operator.api).list_namespaced_pod(
        OPERATOR_NS, label_selector="app.kubernetes.io/name=kvscale-operator"
    )
    running = [p for p in pods.items if p.status.phase == "Running" and p.metadata.deletion_timestamp is None]
    assert len(running) == 2
    leader = (
        client.CoordinationV1Api(operator.api)
        .read_namespaced_lease(OPERATOR, OPERATOR_NS)
        .spec.holder_identity
    )
    logs = {
        p.metadata.name: operator.kubectl("logs", p.metadata.name, "-n", OPERATOR_NS).stdout for p in running
    }
    standby = [name for name in logs if name != leader]
    assert leader in logs and len(standby) == 1
    assert '"msg": "leading"' in logs[leader]
    assert '"msg": "leading"' not in logs[standby[0]] and "waiting for the lease" in logs[standby[0]]


# Granted for the autoscaler alone: exercised only when e2e/test_autoscaling.py runs too. (Pods
# list and watch are not: the leader's pod cache, operator/kube/pods.py, sends them from its start.)
# replicasets get: the owner chain of each scraped pod (pods.Ownership); pod marks are bound per
# namespace (the kvscale-operator-pod-marks ClusterRole), so no cluster-wide pods patch.
AUTOSCALER_GRANTS = {
    ("apps", "deployments/scale", "patch"),
    ("apps", "replicasets", "get"),
}
# Never sent: the OwnerReferencesPermissionEnforcement admission plugin (on in e2e/controlplane)
# asks the authorizer for them on our children's writes (blockOwnerDeletion; adopting an orphan).
# Proven by no write being refused by that plugin (below), not by the audit log's requests.
ADMISSION_GRANTS = {
    (GROUP, f"{PLURAL}/finalizers", "update"),
    (GROUP, "inferenceendpoints/finalizers", "update"),  # the shared router's children's
    ("apps", "deployments", "delete"),
    ("", "services", "delete"),
    ("policy", "poddisruptionbudgets", "delete"),
    # Also sent when a router is switched off (Reconciler._remove): no test here does.
    ("", "serviceaccounts", "delete"),
    ("rbac.authorization.k8s.io", "roles", "delete"),
    ("rbac.authorization.k8s.io", "rolebindings", "delete"),
    ("inference.networking.k8s.io", "inferencepools", "delete"),
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "delete"),
    ("networking.k8s.io", "networkpolicies", "delete"),
}
# Never sent: held because the router's Role grants them (RBAC's escalation check).
ROUTER_ROLE_GRANTS = {
    ("apps", "deployments/scale", "get"),
    ("apps", "deployments/scale", "update"),
    ("discovery.k8s.io", "endpointslices", "get"),
    ("discovery.k8s.io", "endpointslices", "list"),
    ("discovery.k8s.io", "endpointslices", "watch"),
}
# Used only once an InferenceEndpoint exists: e2e/test_endpoint.py makes one.
ENDPOINT_GRANTS = {(GROUP, "inferenceendpoints", "get"), (GROUP, "inferenceendpoints/status", "patch")}
# Used only where the InferencePool CRD is installed: e2e/test_router.py installs it.
POOL_GRANTS = {
    ("inference.networking.k8s.io", "inferencepools", v) for v in ("get", "list", "patch", "create")
}
# Used by e2e/test_parallelism.py (which installs the LeaderWorkerSet CRD); the scale
# subresource only by the autoscaler of an autoscaled group, which no e2e test runs yet.
LWS_GRANTS = {("leaderworkerset.x-k8s.io", "leaderworkersets", v) for v in ("get", "list", "patch", "create")}
LWS_SCALE_GRANTS = {("leaderworkerset.x-k8s.io", "leaderworkersets/scale", v) for v in ("get", "patch")}
LWS_SCALE_GRANTS.add(("apps", "statefulsets", "get"))  # an autoscaled group leader's owner chain
OPERATOR_SA = {"kind": "ServiceAccount", "name": OPERATOR, "namespace": OPERATOR_NS}


def operator_grants(cluster, kustomization: Path) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every role that the rendered kustomization binds to the
    operator's ServiceAccount."""
    objects = [o for o in yaml.safe_load_all(cluster.kubectl("kustomize", str(kustomization)).stdout) if o]
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objects if o["kind"] in ("Role", "ClusterRole")}
    granted = set()
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any({k: s.get(k) for k in OPERATOR_SA} == OPERATOR_SA for s in binding["subjects"]):
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add((group, resource, verb))
    return granted


def test_operator_uses_exactly_its_rbac_and_is_never_forbidden(operator, request):
    """Runs last in the session (e2e/conftest.py): by now the operator has done all it does. The
    API server's audit log lists every request the operator's ServiceAccount made."""
    if not operator.local:
        pytest.skip("reads the local API server's audit log")
    used: Counter = Counter()
    forbidden = []
    for line in (operator.state_dir / "audit.log").read_text().splitlines():
        event = json.loads(line)
        if event["user"].get("username") != OPERATOR_USER or "objectRef" not in event:
            continue
        ref = event["objectRef"]
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used[(ref.get("apiGroup", ""), resource, event["verb"])] += 1
        if event["verb"] == "patch" and event.get("responseStatus", {}).get("code") == 201:
            used[(ref.get("apiGroup", ""), resource, "create")] += 1  # a server-side apply that created
        # Refused by RBAC, or by OwnerReferencesPermissionEnforcement for want of a grant (its
        # messages: "cannot set blockOwnerDeletion ...", "cannot set an ownerRef ..."). Another
        # 403 that RBAC allowed is admission's: e.g. an Event posted into a namespace being
        # deleted, which NamespaceLifecycle refuses.
        decision = event.get("annotations", {}).get("authorization.k8s.io/decision")
        status = event.get("responseStatus", {})
        refused_owner_ref = status.get("code") == 403 and (
            "blockOwnerDeletion" in status.get("message", "") or "an ownerRef" in status.get("message", "")
        )
        if decision == "forbid" or (status.get("code") == 403 and decision != "allow") or refused_owner_ref:
            forbidden.append((resource, event["verb"], event["requestURI"], status.get("message")))
    assert not forbidden, forbidden

    # Some of the children were written: the plugin checked them (and let them through).
    assert used[("apps", "deployments", "create")], sorted(used)
    granted = operator_grants(operator, REPO / "manifests") - ADMISSION_GRANTS - ROUTER_ROLE_GRANTS
    autoscaled = any(item.path.name == "test_autoscaling.py" for item in request.session.items)
    if not autoscaled:  # run without the autoscaler's test: its grants cannot have been used
        granted -= AUTOSCALER_GRANTS
    if not any(item.path.name == "test_router.py" for item in request.session.items):
        granted -= POOL_GRANTS  # no InferencePool CRD without it
    if not any(item.path.name == "test_endpoint.py" for item in request.session.items):
        granted -= ENDPOINT_GRANTS
    if not any(item.path.name == "test_parallelism.py" for item in request.session.items):
        granted -= LWS_GRANTS  # no LeaderWorkerSet CRD without it
    granted -= LWS_SCALE_GRANTS
    unused = sorted(g for g in granted if g not in used)
    assert not unused, f"RBAC grants verbs the operator never used: {unused}; used: {sorted(used)}"
