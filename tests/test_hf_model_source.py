"""hf:// model sources in the operator: the CRD and the models refuse malformed URIs with a
readable message, and the pod template downloads the snapshot in an init container into a volume
the worker then loads from (an emptyDir by default, a named PVC cache when given)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub_standin import HubStandIn, Repo, serving
from model_fixtures import DRAFT, REPO
from pydantic import ValidationError
from test_operator_specs import crd_errors, resource, spec_of
from test_operator_units import deployment_status

from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.handlers import Handlers
from kvscale.operator.reconcile.children import Owner, deployment
from kvscale.operator.reconcile.reconciler import Reconciler
from kvscale.operator.reconcile.status import (
    PodDownload,
    compute_status,
    download_condition,
    pod_download,
    status_changed,
)
from kvscale.operator.settings import Settings
from kvscale.worker.cli import main as worker_cli

HF_MESSAGE = "hf:// needs a Hugging Face repository"
OWNER = Owner("tiny", "ns", "uid-1")


@pytest.mark.parametrize(
    "uri",
    [
        "hf://",
        "hf://onlyorg",
        "hf://a/b@",
        "hf://a/b/c",
        "hf://-a/b",
        "hf://a./b",
        "hf://a/b@x..y",
        "hf://a--b/c",
        "hf://a/b@@main",
        "hf://a/b@main/",
    ],
)
def test_malformed_hf_uris_are_refused_by_the_crd_and_the_models(uri):
    for spec in (
        spec_of(model={"uri": uri}),
        spec_of(speculative={"method": "draft", "draftModelUri": uri}),
    ):
        errors = crd_errors(resource(spec))
        assert any(HF_MESSAGE in e for e in errors) or any("'..' path" in e for e in errors), errors
        with pytest.raises(ValidationError, match=r"hf:// needs|'\.\.' path"):
            InferenceDeploymentSpec.model_validate(spec)


@pytest.mark.parametrize(
    "spec",
    [
        spec_of(model={"uri": "hf://kvscale/tiny"}),
        spec_of(model={"uri": "hf://meta-llama/Llama-3.1-8B-Instruct@main"}),
        spec_of(model={"uri": "hf://Org_1/model.v2@refs/pr/3"}),
        spec_of(model={"uri": "hf://a/b@0123456789abcdef0123456789abcdef01234567"}),
        spec_of(
            model={
                "uri": "hf://kvscale/tiny@v1",
                "hfTokenSecret": {"name": "hf-token"},
                "hfEndpoint": "http://10.0.0.1:8080",
                "cacheClaim": "hf-cache",
                "cacheSize": "5Gi",
            },
            speculative={"method": "draft", "draftModelUri": "hf://kvscale/tiny-draft"},
        ),
    ],
)
def test_hf_uris_and_their_settings_are_accepted(spec):
    assert crd_errors(resource(spec)) == []
    InferenceDeploymentSpec.model_validate(spec)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"uri": "hf://a/b", "hfEndpoint": "huggingface.co"}, "hfEndpoint"),
        ({"uri": "hf://a/b", "hfTokenSecret": {"name": "HF_Token"}}, "must be the name of a Secret"),
        ({"uri": "hf://a/b", "hfTokenSecret": {"name": "t", "key": "a/b"}}, "hfTokenSecret.key"),
        ({"uri": "hf://a/b", "cacheClaim": "Cache"}, "must be the name of a PersistentVolumeClaim"),
        ({"uri": "hf://a/b", "cacheSize": "20GB"}, "must be a positive Kubernetes quantity"),
    ],
)
def test_bad_hf_settings_are_refused(model, message):
    errors = crd_errors(resource(spec_of(model=model)))
    assert any(message in e for e in errors), errors
    with pytest.raises(ValidationError):
        InferenceDeploymentSpec.model_validate(spec_of(model=model))


def pod_spec(**fields) -> dict:
    spec = InferenceDeploymentSpec.model_validate(spec_of(**fields))
    return deployment(OWNER, spec, "worker:1")["spec"]["template"]["spec"]


def env_of(container: dict) -> dict:
    return {v["name"]: v.get("value", v.get("valueFrom")) for v in container["env"]}


def test_an_hf_model_is_downloaded_by_an_init_container_into_an_emptydir_the_worker_loads():
    spec = pod_spec(
        model={
            "uri": "hf://kvscale/tiny@v1",
            "hfTokenSecret": {"name": "hf-token", "key": "token"},
            "hfEndpoint": "http://10.0.0.1:8080",
        }
    )
    (init,) = spec["initContainers"]
    (worker,) = spec["containers"]
    path = "/models/hf/kvscale/tiny/v1"
    assert init["name"] == "model-download" and init["image"] == "worker:1"
    assert init["command"] == ["kvscale-worker"]
    assert init["args"] == ["--log-format", "text", "download", "hf://kvscale/tiny@v1", "--dest", path]
    env = env_of(init)
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert env["HF_ENDPOINT"] == "http://10.0.0.1:8080"
    assert env["HF_HUB_DISABLE_TELEMETRY"] == "1" and env["HF_HUB_OFFLINE"] == "0"  # the image says 1
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert init["resources"]["limits"] == worker["resources"]["limits"]  # the pod stays Guaranteed
    assert {"name": "hf-models", "mountPath": "/models/hf"} in init["volumeMounts"]

    args = worker["args"]
    assert args[args.index("--model") + 1] == path
    assert {"name": "hf-models", "mountPath": "/models/hf", "readOnly": True} in worker["volumeMounts"]
    assert env_of(worker)["HF_HUB_OFFLINE"] == "1" and "HF_TOKEN" not in env_of(worker)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["hf-models"] == {"name": "hf-models", "emptyDir": {"sizeLimit": "20Gi"}}


def test_a_named_claim_is_the_shared_cache_and_the_revision_defaults_to_main():
    spec = pod_spec(model={"uri": "hf://kvscale/tiny", "cacheClaim": "hf-cache"})
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["hf-models"] == {"name": "hf-models", "persistentVolumeClaim": {"claimName": "hf-cache"}}
    (init,) = spec["initContainers"]
    assert init["args"][-1] == "/models/hf/kvscale/tiny/main"
    assert "HF_TOKEN" not in env_of(init) and "HF_ENDPOINT" not in env_of(init)


def test_a_revision_with_slashes_is_one_folder():
    (init,) = pod_spec(model={"uri": "hf://kvscale/tiny@refs/pr/1"})["initContainers"]
    assert init["args"][-1] == "/models/hf/kvscale/tiny/refs%2Fpr%2F1"


def test_an_hf_draft_model_gets_its_own_init_container_on_the_same_volume():
    spec = pod_spec(
        model={"uri": "pvc://models/target", "hfTokenSecret": {"name": "hf-token"}},
        speculative={"method": "draft", "draftModelUri": "hf://kvscale/tiny-draft@v2"},
    )
    (init,) = spec["initContainers"]
    assert init["name"] == "draft-model-download"
    assert env_of(init)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}
    args = spec["containers"][0]["args"]
    assert args[args.index("--draft-model") + 1] == "/models/hf/kvscale/tiny-draft/v2"
    assert args[args.index("--model") + 1] == "/models/models/target"
    assert [v["name"] for v in spec["volumes"]].count("hf-models") == 1

    both = pod_spec(
        model={"uri": "hf://kvscale/tiny"},
        speculative={"method": "draft", "draftModelUri": "hf://kvscale/tiny-draft"},
    )
    assert [c["name"] for c in both["initContainers"]] == ["model-download", "draft-model-download"]


def test_a_user_env_reaches_the_download_and_wins():
    (init,) = pod_spec(
        model={"uri": "hf://kvscale/tiny", "hfEndpoint": "https://mirror.example.com"},
        env=[
            {"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
            {"name": "HF_ENDPOINT", "value": "http://x"},
        ],
    )["initContainers"]
    env = env_of(init)
    assert env["HTTPS_PROXY"] == "http://proxy:3128" and env["HF_ENDPOINT"] == "http://x"
    assert [v["name"] for v in init["env"]].count("HF_ENDPOINT") == 1


@pytest.mark.parametrize(
    "uri", ["/models/tiny", "file:///models/tiny", "pvc://models/tiny", "builtin://tiny-llama"]
)
def test_other_sources_have_no_init_container_and_no_download_volume(uri):
    spec = pod_spec(model={"uri": uri, "hfTokenSecret": {"name": "hf-token"}})
    assert "initContainers" not in spec
    assert "hf-models" not in {v["name"] for v in spec["volumes"]}


# --- status: the pods' downloads in the conditions -------------------------------------------

TOKEN_REASON = "the Hub refused the token for kvscale/tiny (401): check the Secret in model.hfTokenSecret"


def worker_pod(*init_statuses: dict, name: str = "tiny-abc", draft: bool = False) -> dict:
    """A worker pod as the API server shows it, with the statuses of its download init containers."""
    names = ["model-download", *(["draft-model-download"] if draft else [])]
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": {"kvscale.dev/inference-deployment": "tiny"}},
        "spec": {"initContainers": [{"name": n} for n in names], "containers": [{"name": "worker"}]},
        "status": {
            "initContainerStatuses": [{"name": n, **s} for n, s in zip(names, init_statuses, strict=False)]
        },
    }


RUNNING = {"state": {"running": {"startedAt": "t"}}, "restartCount": 0}
DONE = {"state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
FAILED = {"state": {"terminated": {"exitCode": 1, "reason": "Error", "message": TOKEN_REASON + "\n"}}}


def crash_loop(restarts: int, running: bool = False) -> dict:
    """The kubelet restarting a failed download: waiting in back-off, or running again."""
    last = {"terminated": {"exitCode": 1, "reason": "Error", "message": TOKEN_REASON + "\n"}}
    state = {"running": {"startedAt": "t"}} if running else {"waiting": {"reason": "CrashLoopBackOff"}}
    return {"state": state, "lastState": last, "restartCount": restarts}


def test_a_pods_download_state_comes_from_its_init_container_status():
    assert pod_download(worker_pod(RUNNING)) == PodDownload("downloading", "model-download")
    assert pod_download(worker_pod(DONE)) is None
    assert pod_download(worker_pod()) is None  # not started (pending)
    waiting = {"state": {"waiting": {"reason": "PodInitializing"}}}
    assert pod_download(worker_pod(waiting)) is None
    failed = PodDownload("failed", "model-download", TOKEN_REASON)
    assert pod_download(worker_pod(FAILED)) == failed
    # A crash loop is one state: in back-off and running again alike, until a run succeeds.
    for restarts in range(1, 5):
        assert pod_download(worker_pod(crash_loop(restarts))) == failed
        assert pod_download(worker_pod(crash_loop(restarts, running=True))) == failed
    # The draft model's download follows the model's.
    assert pod_download(worker_pod(DONE, RUNNING, draft=True)) == PodDownload(
        "downloading", "draft-model-download"
    )
    # A log tail (FallbackToLogsOnError): its last line.
    tail = {"state": {"terminated": {"exitCode": 2, "message": "starting\nerror: no such thing\n"}}}
    assert pod_download(worker_pod(tail)).message == "error: no such thing"
    killed = {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
    assert pod_download(worker_pod(killed)).message == "exit code 137 (OOMKilled)"
    gone = worker_pod(FAILED)
    gone["metadata"]["deletionTimestamp"] = "t"
    assert pod_download(gone) is None
    assert pod_download({"metadata": {}, "spec": {"containers": [{"name": "worker"}]}, "status": {}}) is None


def test_the_downloads_of_the_pods_make_one_reason():
    failed = PodDownload("failed", "model-download", TOKEN_REASON)
    downloading = PodDownload("downloading", "model-download")
    assert download_condition([]) is None and download_condition([None]) is None
    assert download_condition([downloading, downloading]) == (
        "DownloadingModel",
        "downloading the model in 2 worker pods (kubectl logs POD -c model-download)",
    )
    assert download_condition([downloading, failed, failed]) == (
        "ModelDownloadFailed",
        f"model-download: {TOKEN_REASON}",
    )


def conditions_of(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


STATUS = {"name": "tiny", "generation": 1, "selector": "s", "desired": 2}


def test_the_conditions_say_the_model_is_downloading_then_why_it_failed():
    starting = deployment_status(2, 0, 2, 2)
    downloading = compute_status(
        **STATUS,
        deployment=starting,
        previous_conditions=[],
        now="t0",
        download=download_condition([PodDownload("downloading", "model-download")] * 2),
    )
    cond = conditions_of(downloading)
    assert cond["Progressing"]["status"] == "True" and cond["Progressing"]["reason"] == "DownloadingModel"
    assert cond["Ready"]["reason"] == "DownloadingModel" and cond["Degraded"]["status"] == "False"

    failed = compute_status(
        **STATUS,
        deployment=starting,
        previous_conditions=downloading["conditions"],
        now="t1",
        download=download_condition([PodDownload("failed", "model-download", TOKEN_REASON)] * 2),
    )
    cond = conditions_of(failed)
    assert cond["Degraded"]["status"] == "True" and cond["Degraded"]["reason"] == "ModelDownloadFailed"
    assert TOKEN_REASON in cond["Degraded"]["message"] and TOKEN_REASON in cond["Ready"]["message"]
    assert cond["Degraded"]["lastTransitionTime"] == "t1"

    # One worker serves, the other's download failed: Degraded, Ready partially.
    partial = compute_status(
        **STATUS,
        deployment=deployment_status(2, 1, 2, 2),
        previous_conditions=[],
        now="t",
        download=download_condition([PodDownload("failed", "model-download", TOKEN_REASON)]),
    )
    cond = conditions_of(partial)
    assert cond["Degraded"]["reason"] == "ModelDownloadFailed" and cond["Ready"]["reason"] == "PartiallyReady"

    # Downloaded and serving: nothing about downloads is left.
    ready = compute_status(
        **STATUS, deployment=deployment_status(2, 2, 2, 2), previous_conditions=failed["conditions"], now="t2"
    )
    assert {c["reason"] for c in ready["conditions"]} == {"AllWorkersReady", "Complete", "AsExpected"}


def test_a_crash_looping_download_is_reported_once(monkeypatch):
    """Each restart of the failing init container is a pod event; the status is written (and
    the Degraded event posted) at the first failure only."""
    synced: list[str] = []
    reconciler = Reconciler(None, Settings())
    monkeypatch.setattr(reconciler, "sync_or_retry", lambda ns, name, **kw: synced.append(name))
    handlers = Handlers(reconciler, None)
    writes, status = 0, {"conditions": []}
    events = [("ADDED", RUNNING), ("MODIFIED", FAILED)]
    events += [("MODIFIED", crash_loop(n, running=bool(n % 2))) for n in range(1, 8)]
    for kind, init in events:
        before = len(synced)
        handlers.pod_changed(body=worker_pod(init), type=kind)
        new = compute_status(
            **STATUS,
            deployment=deployment_status(2, 0, 2, 2),
            previous_conditions=status["conditions"],
            now="t",
            download=download_condition(reconciler.pods.downloads_of("ns", "tiny")),
        )
        if len(synced) > before and status_changed(status, new):
            writes, status = writes + 1, new
    assert synced == ["tiny", "tiny"]  # it started; it failed. The restarts change nothing.
    assert writes == 2 and conditions_of(status)["Degraded"]["reason"] == "ModelDownloadFailed"
    handlers.pod_changed(body=worker_pod(DONE), type="MODIFIED")  # a later run succeeded
    handlers.pod_changed(body=worker_pod(DONE), type="DELETED")
    assert synced == ["tiny"] * 3 and reconciler.pods.downloads_of("ns", "tiny") == []


def worker_image_env() -> dict[str, str]:
    """The ENV of the Dockerfile's worker stage: what the init container starts with."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    stage = text[text.index("FROM base AS worker") :]
    env: dict[str, str] = {}
    for line in stage.splitlines():
        if line.startswith("ENV "):
            env.update(pair.split("=", 1) for pair in line[4:].split())
    assert "HF_HUB_OFFLINE" in env, "the worker image is offline by default"
    return env


def test_the_rendered_init_container_fills_the_folder_the_worker_loads(tmp_path, monkeypatch):
    """The operator's init container (its args and env, the Secret's value in place of the
    secretKeyRef) run against the Hub stand-in: the worker's --model folder is the snapshot."""
    if not DRAFT.is_dir():
        pytest.skip("needs ../shared/models/tiny-code-draft")
    standin = HubStandIn({"kvscale/tiny": Repo({"main": DRAFT})}, token="hf_secret")
    sha = standin.repos["kvscale/tiny"].heads["main"]
    secrets = {("hf-token", "HF_TOKEN"): "hf_secret"}
    with serving(standin) as url:
        spec = pod_spec(
            model={
                "uri": f"hf://kvscale/tiny@{sha}",
                "hfTokenSecret": {"name": "hf-token"},
                "hfEndpoint": url,
            }
        )
        (init,) = spec["initContainers"]
        root = tmp_path / "volume"  # the hf-models volume, here
        for name, value in worker_image_env().items():  # the image's ENV, then the container's
            monkeypatch.setenv(name, value)
        for var in init["env"]:
            ref = (var.get("valueFrom") or {}).get("secretKeyRef")
            value = secrets[(ref["name"], ref["key"])] if ref else var["value"]
            monkeypatch.setenv(var["name"], value.replace("/tmp", str(tmp_path)))
        args = [a.replace("/models/hf", str(root)) for a in init["args"]]
        assert worker_cli([*args, "--termination-log", str(tmp_path / "log")]) == 0
    worker_args = spec["containers"][0]["args"]
    model = Path(worker_args[worker_args.index("--model") + 1].replace("/models/hf", str(root)))
    assert {p.name: p.read_bytes() for p in DRAFT.iterdir()} == {
        p.name: p.read_bytes() for p in model.iterdir() if p.is_file() and not p.name.startswith(".")
    }


def test_a_download_left_over_from_a_lost_pod_does_not_degrade_a_settled_resource():
    """The pod watch may miss a deletion (a re-list after a watch error reports no DELETED): once
    every wanted worker serves, no download state counts."""
    stale = download_condition([PodDownload("failed", "model-download", TOKEN_REASON)])
    status = compute_status(
        **STATUS, deployment=deployment_status(2, 2, 2, 2), previous_conditions=[], now="t", download=stale
    )
    assert {c["reason"] for c in status["conditions"]} == {"AllWorkersReady", "Complete", "AsExpected"}
