"""Flux for real: its source-controller and kustomize-controller (built from their Go modules,
e2e/flux.py) run beside the real control plane and read a git repository served on this machine.
Three commits: crds/ + manifests/ + an InferenceDeployment (Flux applies them, the worker serves,
Flux's health check waits for Ready); a change of the engine's arguments (the rollout follows);
the resource removed (Flux prunes it, and everything it owned goes). Throughout, Flux's re-applies
find nothing changed on the resource: the operator writes its status only, never the fields Flux
owns (no drift)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import flux
import pytest
import yaml
from kubernetes import client
from test_controlplane import wait_for
from test_helm import complete
from test_operator import (  # noqa: F401 (fixtures)
    GROUP,
    PLURAL,
    REPO,
    example,
    get_cr,
    namespace,
    operator,
    wait_ready,
)
from test_probes import worker_pod

pytestmark = pytest.mark.slow

FLUX_NS = "flux-system"
NAME = "gitops"
WORKER_PORT = 8000


def git(work: Path, *args: str) -> str:
    identity = ["-c", "user.name=e2e", "-c", "user.email=e2e@kvscale.invalid"]
    out = subprocess.run(["git", *identity, *args], cwd=work, check=True, capture_output=True, text=True)
    return out.stdout


def commit(work: Path, message: str) -> str:
    """Commit everything in the work tree, push it to main; the commit's sha."""
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", message)
    git(work, "push", "-q", "origin", "HEAD:main")
    return git(work, "rev-parse", "HEAD").strip()


def flux_objects(url: str) -> list[dict]:
    source = {"kind": "GitRepository", "name": "platform"}

    def kustomization(name: str, path: str, prune: bool, depends: str | None, **spec) -> dict:
        return {
            "apiVersion": "kustomize.toolkit.fluxcd.io/v1",
            "kind": "Kustomization",
            "metadata": {"name": name, "namespace": FLUX_NS},
            "spec": {
                "interval": "10s",
                "retryInterval": "5s",
                "path": path,
                "prune": prune,
                "sourceRef": source,
                **({"dependsOn": [{"name": depends}]} if depends else {}),
                **spec,
            },
        }

    return [
        {
            "apiVersion": "source.toolkit.fluxcd.io/v1",
            "kind": "GitRepository",
            "metadata": {"name": "platform", "namespace": FLUX_NS},
            "spec": {"interval": "5s", "url": f"{url}/platform.git", "ref": {"branch": "main"}},
        },
        # The platform's: never pruned (deleting the Kustomization leaves the operator installed).
        kustomization("kvscale-crds", "./crds", False, None),
        kustomization("kvscale", "./manifests", False, "kvscale-crds"),
        # The tenants': pruned, and Ready only once what it applied is (kstatus: Ready condition).
        kustomization("endpoints", "./inference", True, "kvscale", wait=True, timeout="4m"),
    ]


def kustomization_status(cluster, name: str) -> dict:
    obj = client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(
        "kustomize.toolkit.fluxcd.io", "v1", FLUX_NS, "kustomizations", name
    )
    return obj.get("status") or {}


def applied(cluster, name: str, sha: str) -> dict | None:
    """The Kustomization's status once it is Ready at this commit."""
    status = kustomization_status(cluster, name)
    ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})
    ok = ready.get("status") == "True" and status.get("lastAppliedRevision", "").endswith(sha)
    return status if ok else None


def resource_writes(log: Path, start: int, ns: str) -> list[str]:
    """What kustomize-controller's applies since byte `start` of its log did to our resource
    ("unchanged", "configured", "created", ...), one entry per apply that listed it."""
    key = f"InferenceDeployment/{ns}/{NAME}"
    out = []
    for line in log.read_bytes()[start:].decode(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        output = entry.get("output") or {}
        if isinstance(output, dict) and key in output:
            out.append(output[key])
    return out


def test_flux_applies_three_commits_and_sees_no_drift(operator, namespace, tmp_path):  # noqa: F811
    for crd in flux.crds():
        operator.kubectl("apply", "--server-side", "-f", str(crd))
    operator.kubectl(
        "wait", "--for=condition=Established", "crd/kustomizations.kustomize.toolkit.fluxcd.io",
        "crd/gitrepositories.source.toolkit.fluxcd.io", "--timeout=60s",
    )  # fmt: skip
    operator.kubectl("create", "namespace", FLUX_NS, check=False)
    root, work = tmp_path / "git", tmp_path / "work"
    bare = root / "platform.git"
    subprocess.run(["git", "init", "-q", "--bare", "--initial-branch=main", str(bare)], check=True)
    subprocess.run(["git", "clone", "-q", str(bare), str(work)], check=True, capture_output=True)
    shutil.copytree(REPO / "crds", work / "crds")
    shutil.copytree(REPO / "manifests", work / "manifests")
    (work / "inference").mkdir()
    doc = example(NAME, namespace, replicas=1)
    (work / "inference" / "endpoint.yaml").write_text(yaml.safe_dump(doc))
    (work / "inference" / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["endpoint.yaml"]}))
    first = commit(work, "the platform and one endpoint")

    objects = flux_objects("")
    with flux.git_server(root) as url, flux.controllers(operator.kubeconfig, tmp_path) as logs:
        objects = flux_objects(url)
        try:
            for obj in objects:
                operator.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(obj))
            # 1. Flux applies all three; its health check passes once the resource is Ready.
            wait_for(
                lambda: applied(operator, "endpoints", first),
                timeout=300,
                interval=1,
                what="Flux to apply the first commit and see the endpoint Ready",
            )
            cr = wait_ready(operator, NAME, namespace, replicas=1)
            worker = worker_pod(operator, namespace, NAME)
            assert complete(f"{worker.status.pod_ip}:{WORKER_PORT}", NAME)["choices"][0]["text"]

            # No drift: Flux's next applies leave the resource unchanged (the operator wrote
            # status only), and its generation is where Flux left it.
            start = logs["kustomize-controller"].stat().st_size
            wait_for(
                lambda: len(resource_writes(logs["kustomize-controller"], start, namespace)) >= 2,
                timeout=60,
                interval=1,
                what="two more applies by Flux",
            )
            assert set(resource_writes(logs["kustomize-controller"], start, namespace)) == {"unchanged"}
            assert get_cr(operator, NAME, namespace)["metadata"]["generation"] == cr["metadata"]["generation"]

            # 2. The engine's arguments change in git: the workers roll to the new spec.
            doc["spec"]["engine"] = {**doc["spec"].get("engine", {}), "extraArgs": ["--max-num-seqs", "8"]}
            (work / "inference" / "endpoint.yaml").write_text(yaml.safe_dump(doc))
            second = commit(work, "fewer sequences per step")
            wait_for(lambda: applied(operator, "endpoints", second), timeout=300, what="the 2nd commit")
            wait_ready(operator, NAME, namespace, replicas=1)
            rolled = worker_pod(operator, namespace, NAME)
            assert rolled.metadata.uid != worker.metadata.uid
            assert "--max-num-seqs" in json.dumps(rolled.spec.containers[0].to_dict())
            assert complete(f"{rolled.status.pod_ip}:{WORKER_PORT}", NAME)["choices"][0]["text"]

            # 3. The resource leaves git: Flux prunes it, and its children and workers go.
            (work / "inference" / "endpoint.yaml").unlink()
            (work / "inference" / "kustomization.yaml").write_text(yaml.safe_dump({"resources": []}))
            third = commit(work, "the endpoint goes")
            wait_for(lambda: applied(operator, "endpoints", third), timeout=180, what="the 3rd commit")
            apps, core = client.AppsV1Api(operator.api), client.CoreV1Api(operator.api)

            def gone() -> bool:
                infds = client.CustomObjectsApi(operator.api).list_namespaced_custom_object(
                    GROUP, "v1alpha1", namespace, PLURAL
                )["items"]
                return not (
                    infds
                    or apps.list_namespaced_deployment(namespace).items
                    or core.list_namespaced_service(namespace).items
                    or core.list_namespaced_pod(namespace).items
                )

            wait_for(gone, timeout=120, interval=1, what="the resource, its children and its workers to go")
            # The platform Kustomizations applied the operator's install and never pruned it, and
            # kubectl can take the install back without a conflict with Flux's fields.
            assert apps.read_namespaced_deployment("kvscale-operator", "kvscale-system").status.ready_replicas
            operator.kubectl("apply", "--server-side", "-k", str(REPO / "manifests"))
        finally:
            # Flux's objects carry its finalizer: deleted while its controllers still run.
            for obj in reversed(objects):
                obj_json = json.dumps(obj)
                operator.kubectl("delete", "--ignore-not-found", "--timeout=60s", "-f", "-", input=obj_json)
    for crd in flux.crds():
        operator.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", str(crd))
