"""Tensor parallelism in the operator: GPUs mapped to ranks, multi-node groups as LeaderWorkerSets.

Golden manifests (tests/golden/*.yaml) pin every field the operator renders for a single-pod TP
worker and an LWS group, CPU and GPU; the tests beside them assert what each field must be and
why, so a golden file regenerated over a bug (KVSCALE_REGEN_GOLDEN=1) still fails here. Refusals
go through the CRD's rules (cel-python, tests/test_operator_specs.py's machinery) and the models.
The LeaderWorkerSet's fields are checked against the upstream CRD the e2e test installs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from lws import lws_crd_path
from pydantic import ValidationError
from test_operator_specs import crd_errors, resource

from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.kube import leaderworkerset
from kvscale.operator.reconcile.children import (
    LWS_WORKER_INDEX,
    MASTER_PORT,
    Owner,
    all_children,
    inference_pool,
    key_of,
    selector_labels,
    times,
)
from kvscale.operator.reconcile.status import compute_status

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
OWNER = Owner("big", "ns", "uid-1")
# The upstream CRD, as the e2e test fetches it (e2e/lws.py: the Go module through the module
# proxy); where it has not been fetched on this machine, the test that needs it is skipped.
LWS_CRD = lws_crd_path()


def spec(**fields) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": {"uri": "/models/big"}, **fields})


CASES = {
    "tp2-gpu": {"resources": {"gpus": 2, "memory": "64Gi"}},
    "tp2-cpu": {"parallelism": {"tensor": 2}},
    "lws-tp2x2-cpu": {"parallelism": {"tensor": 2, "nodes": 2}, "replicas": 3},
    "lws-tp4x2-gpu": {"parallelism": {"tensor": 4, "nodes": 2}, "resources": {"gpus": 2}, "replicas": 2},
}


def rendered(case: str) -> list[dict]:
    return all_children(OWNER, spec(**CASES[case]), "worker:1", "router:1", pools=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_children_match_their_golden_manifests(case):
    path = GOLDEN / f"{case}.yaml"
    text = yaml.safe_dump_all(rendered(case), sort_keys=True)
    if os.environ.get("KVSCALE_REGEN_GOLDEN"):
        path.write_text(text)
    assert path.read_text() == text, (
        f"{path} differs: KVSCALE_REGEN_GOLDEN=1 rewrites it, then review the diff"
    )


def by_key(case: str) -> dict[str, dict]:
    return {key_of(o): o for o in rendered(case)}


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_gpus_on_one_pod_become_its_tensor_parallel_ranks():
    objs = by_key("tp2-gpu")
    assert "LeaderWorkerSet" not in objs
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert flag(c["args"], "--tensor-parallel-size") == "2" and "--nnodes" not in c["args"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" == c["resources"]["requests"]["nvidia.com/gpu"]
    shm = {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": "2Gi"}  # sharedMemory (1Gi) per rank
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # One GPU: one rank, no flag (the worker's default), the /dev/shm it always had.
    one = all_children(OWNER, spec(resources={"gpus": 1}), "w", "r")[0]["spec"]["template"]["spec"]
    assert "--tensor-parallel-size" not in one["containers"][0]["args"]
    assert {v["name"]: v for v in one["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "1Gi"


def test_cpu_ranks_get_the_flag_and_a_shared_memory_without_gpus():
    pod = by_key("tp2-cpu")["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert flag(c["args"], "--tensor-parallel-size") == "2"
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "2Gi"
    # A plain CPU worker has no /dev/shm volume (the runtime's 64 MiB serves one process).
    plain = all_children(OWNER, spec(), "w", "r")[0]["spec"]["template"]["spec"]
    assert "dshm" not in {v["name"] for v in plain["volumes"]}


def test_shared_memory_is_multiplied_in_its_own_unit():
    assert times("1Gi", 4) == "4Gi" and times("512Mi", 3) == "1536Mi" and times(".5Gi", 2) == "1Gi"
    assert times("1.5G", 2) == "3G" and times("1e9", 2) == "2e9" and times("2Gi", 1) == "2Gi"


@pytest.mark.parametrize("case", ["lws-tp2x2-cpu", "lws-tp4x2-gpu"])
def test_a_multi_node_resource_is_a_leader_worker_set_of_groups(case):
    objs = by_key(case)
    assert "Deployment" not in objs  # nothing of the single-pod shape is rendered beside it
    lws = objs["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["metadata"]["name"] == "big"
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    s = lws["spec"]
    assert s["replicas"] == CASES[case]["replicas"]  # groups, not pods
    t = s["leaderWorkerTemplate"]
    assert t["size"] == 2 and t["restartPolicy"] == "RecreateGroupOnPodRestart"
    # A headless Service per group (NAME-G): the Shared one would be named NAME, as our Service
    # is, and the controller would then make none; the followers could not resolve the leader.
    assert s["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    assert objs["Service"]["metadata"]["name"] == lws["metadata"]["name"]
    # The Deployment's default (surge 1, none unavailable), but at least one group unavailable:
    # the LWS controller's StatefulSet refuses maxUnavailable 0.
    assert s["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxSurge": 1, "maxUnavailable": 1}
    tensor, gpus = CASES[case]["parallelism"]["tensor"], CASES[case].get("resources", {}).get("gpus", 0)
    for role in ("leaderTemplate", "workerTemplate"):
        pod = t[role]
        (c,) = pod["spec"]["containers"]
        args = c["args"]
        assert flag(args, "--tensor-parallel-size") == str(tensor) and flag(args, "--nnodes") == "2"
        assert flag(args, "--node-rank") == "$(LWS_WORKER_INDEX)"
        assert flag(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert flag(args, "--master-port") == str(MASTER_PORT) == "29500"
        assert {"name": "dist", "containerPort": 29500, "protocol": "TCP"} in c["ports"]
        assert pod["metadata"]["labels"] == {**pod["metadata"]["labels"], **selector_labels("big")}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        if gpus or tensor // 2 > 1:  # per rank, the pod's ranks: tensor / nodes
            assert volumes["dshm"]["emptyDir"]["sizeLimit"] == f"{tensor // 2}Gi"
        else:  # one CPU rank per pod: its peers are across the network (gloo over TCP)
            assert "dshm" not in volumes
        if gpus:
            assert c["resources"]["limits"]["nvidia.com/gpu"] == str(gpus) == str(tensor // 2)
        else:
            assert "nvidia.com/gpu" not in c["resources"]["limits"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    # Only the leader (rank 0) serves the API and its metrics.
    assert t["leaderTemplate"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert "prometheus.io/scrape" not in t["workerTemplate"]["metadata"]["annotations"]
    leaders = {**selector_labels("big"), LWS_WORKER_INDEX: "0"}
    assert objs["Service"]["spec"]["selector"] == leaders
    assert objs["InferencePool"]["spec"]["selector"]["matchLabels"] == leaders
    # The disruption budget counts pods: one pod at a time is one group at a time.
    assert objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector_labels("big")
    assert objs["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1


def test_autoscaled_groups_leave_the_replicas_to_the_autoscaler():
    s = spec(parallelism={"tensor": 2, "nodes": 2}, autoscaling={"minReplicas": 1, "maxReplicas": 4})
    lws = {key_of(o): o for o in all_children(OWNER, s, "w", "r")}["LeaderWorkerSet"]
    assert "replicas" not in lws["spec"]


def test_single_pod_resources_keep_their_service_and_pool_selectors():
    s = spec(resources={"gpus": 2})
    assert inference_pool(OWNER, s)["spec"]["selector"]["matchLabels"] == selector_labels("big")
    assert by_key("tp2-gpu")["Service"]["spec"]["selector"] == selector_labels("big")


# --- refusals ----------------------------------------------------------------------------------

REFUSED = [
    ({"resources": {"gpus": 9}}, "gpus must be at most 8"),
    (
        {"parallelism": {"tensor": 6, "nodes": 4}},
        "parallelism.tensor must be a multiple of parallelism.nodes",
    ),
    (
        {"parallelism": {"tensor": 4, "nodes": 2}, "resources": {"gpus": 4}},
        "resources.gpus must be parallelism.tensor / parallelism.nodes",
    ),
    (
        {"parallelism": {"tensor": 2, "nodes": 2}, "autoscaling": {"minReplicas": 0, "maxReplicas": 3}},
        "not supported with parallelism.nodes above 1",
    ),
]


@pytest.mark.parametrize(("fields", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_layouts_that_cannot_be_rendered_are_refused_by_the_crd_and_the_models(fields, message):
    errors = crd_errors(resource({"model": {"uri": "/models/big"}, **fields}))
    assert any(message in e for e in errors), errors
    with pytest.raises(ValidationError, match=message):
        spec(**fields)


def test_tensor_parallel_size_follows_parallelism_then_the_gpus():
    assert spec().tensor_parallel_size == 1 and spec(resources={"gpus": 4}).tensor_parallel_size == 4
    s = spec(parallelism={"tensor": 8, "nodes": 2}, resources={"gpus": 4})
    assert (s.tensor_parallel_size, s.nodes, s.ranks_per_pod) == (8, 2, 4)
    cpu = spec(parallelism={"tensor": 4, "nodes": 2})
    assert (cpu.tensor_parallel_size, cpu.nodes, cpu.ranks_per_pod) == (4, 2, 2)


# --- the upstream LeaderWorkerSet CRD keeps every field we render ------------------------------


@pytest.mark.skipif(not LWS_CRD.exists(), reason="no copy of sigs.k8s.io/lws: python e2e/lws.py fetches one")
def test_the_leader_worker_set_fits_the_upstream_crd():
    crd = yaml.safe_load(LWS_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert crd["spec"]["group"] == "leaderworkerset.x-k8s.io" and version["served"]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def declared(node: dict, value, path: str) -> None:
        if node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string"):
            return
        if isinstance(value, dict) and "properties" in node:
            for key, sub in value.items():
                assert key in node["properties"], f"{path}.{key} is not in the upstream schema"
                declared(node["properties"][key], sub, f"{path}.{key}")
        elif isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
            for key, sub in value.items():
                declared(node["additionalProperties"], sub, f"{path}.{key}")
        elif isinstance(value, list):
            for item in value:
                declared(node["items"], item, f"{path}[]")
        elif "enum" in node:
            assert value in node["enum"], f"{path}: {value!r} not in {node['enum']}"

    for case in ("lws-tp2x2-cpu", "lws-tp4x2-gpu"):
        declared(schema, by_key(case)["LeaderWorkerSet"]["spec"], "spec")
    t = schema["properties"]["leaderWorkerTemplate"]["properties"]
    assert "RecreateGroupOnPodRestart" in t["restartPolicy"]["enum"]


# --- status and sync ------------------------------------------------------------------------


def test_status_counts_groups_from_the_leader_worker_set():
    lws = {
        "metadata": {"generation": 3},
        "spec": {"replicas": 2},
        "status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2},
    }

    def status_of(lws: dict) -> dict:
        return compute_status(
            name="big",
            generation=1,
            selector="x",
            desired=2,
            deployment=leaderworkerset.as_deployment(lws),
            previous_conditions=[],
            now="t",
        )

    status = status_of(lws)
    assert status["ready"] == "1/2" and status["readyReplicas"] == 1
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "PartiallyReady"
    lws["status"]["readyReplicas"] = 2
    done = status_of(lws)
    assert {c["type"]: c for c in done["conditions"]}["Ready"]["reason"] == "AllWorkersReady"
    assert leaderworkerset.as_deployment(None) is None
