"""hf:// models on the real node: the init container `model-download` (the worker image,
`kvscale-worker download`, the real huggingface_hub client) fetches the snapshot from the Hub
stand-in (tests/hub_standin.py; these machines reach no hub) that this process serves at the
node's address, with the token from a Secret; the worker then loads it and answers completions.
While it downloads, the resource says DownloadingModel; a wrong token or revision leaves
Degraded=True ModelDownloadFailed with the downloader's reason, reported once while the init
container crash-loops."""

from __future__ import annotations

import pytest
from hub_standin import HubStandIn, Repo, serving
from kubernetes import client
from model_fixtures import TARGET
from realnode import NODE_IP
from test_controlplane import wait_for
from test_operator import (  # noqa: F401 (fixtures)
    apply,
    complete,
    condition,
    example,
    get_cr,
    namespace,
    operator,
    wait_ready,
)

TOKEN = "hf_e2e_standin_token"
REPO_ID = "kvscale/tiny"
WORKER_PORT = 8000


@pytest.fixture(scope="module")
def hub(operator):  # noqa: F811
    """The stand-in Hub serving the fixture model as kvscale/tiny (gated: it wants TOKEN), on a
    free port of the node's address, which the pods reach; its LFS file streams at 4 MiB/s, so the
    download of the 44 MB weights lasts some 10 s."""
    if not operator.local:
        pytest.skip("serves the Hub stand-in from this machine at the real node's address")
    standin = HubStandIn({REPO_ID: Repo({"main": TARGET})}, token=TOKEN, cdn_bytes_per_s=4 * 2**20)
    with serving(standin, host=NODE_IP) as url:
        yield standin, url


def token_secret(cluster, ns: str, name: str, token: str) -> None:
    client.CoreV1Api(cluster.api).create_namespaced_secret(
        ns, {"metadata": {"name": name}, "stringData": {"HF_TOKEN": token}}
    )


def hf_resource(name: str, ns: str, endpoint: str, uri: str, secret: str) -> dict:
    doc = example(name, ns, replicas=1)
    doc["spec"]["model"] = {
        "uri": uri,
        "hfEndpoint": endpoint,
        "hfTokenSecret": {"name": secret},  # key HF_TOKEN
        "cacheSize": "1Gi",
    }
    return doc


def worker_pod(cluster, ns: str, name: str):
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(
        ns, label_selector=f"kvscale.dev/inference-deployment={name}"
    )
    live = [p for p in pods.items if p.metadata.deletion_timestamp is None]
    return live[0] if len(live) == 1 else None


def test_an_hf_model_is_downloaded_by_the_init_container_and_served(operator, namespace, hub):  # noqa: F811
    standin, url = hub
    repo = standin.repos[REPO_ID]
    sha = repo.heads["main"]
    token_secret(operator, namespace, "hf-token", TOKEN)
    apply(operator, hf_resource("hf", namespace, url, f"hf://{REPO_ID}@{sha}", "hf-token"))

    # While the init container runs, the status says so.
    def downloading():
        cr = get_cr(operator, "hf", namespace)
        return cr if condition(cr, "Progressing").get("reason") == "DownloadingModel" else None

    cr = wait_for(downloading, timeout=120, interval=0.2, what="Progressing=DownloadingModel")
    assert condition(cr, "Ready")["reason"] == "DownloadingModel"

    cr = wait_ready(operator, "hf", namespace, replicas=1, timeout=300)
    assert condition(cr, "Degraded")["status"] == "False"
    assert condition(cr, "Progressing")["reason"] == "Complete"

    # The init container fetched every file of the commit from the stand-in (LFS from its CDN).
    commit = repo.commits[sha]
    wanted = {
        f"/cdn/{f.sha256}" if f.lfs else f"/{REPO_ID}/resolve/{sha}/{f.path}" for f in commit.files.values()
    }
    assert wanted <= set(standin.file_gets()), wanted - set(standin.file_gets())

    pod = worker_pod(operator, namespace, "hf")
    (init,) = pod.status.init_container_statuses
    assert init.name == "model-download" and init.state.terminated.exit_code == 0
    path = f"/models/hf/{REPO_ID}/{sha}"
    args = pod.spec.containers[0].args
    assert args[args.index("--model") + 1] == path
    logs = operator.kubectl("logs", pod.metadata.name, "-n", namespace, "-c", "model-download").stdout
    assert f"downloaded hf://{REPO_ID}@{sha} (commit {sha})" in logs, logs
    assert "MiB on disk" in logs, logs  # progress while it ran

    answer = complete(f"{pod.status.pod_ip}:{WORKER_PORT}", "hf")
    assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    ("name", "uri", "token", "reason"),
    [
        (
            "badtoken",
            f"hf://{REPO_ID}",
            "hf_wrong",
            f"the Hub refused the token for {REPO_ID} (401): check the Secret in model.hfTokenSecret",
        ),
        ("badrev", f"hf://{REPO_ID}@nope", TOKEN, f"revision 'nope' not found in {REPO_ID}"),
    ],
)
def test_a_wrong_token_or_revision_leaves_a_condition(operator, namespace, hub, name, uri, token, reason):  # noqa: F811
    _, url = hub
    token_secret(operator, namespace, "token", token)
    apply(operator, hf_resource(name, namespace, url, uri, "token"))

    def failed():
        cr = get_cr(operator, name, namespace)
        return cr if condition(cr, "Degraded").get("reason") == "ModelDownloadFailed" else None

    cr = wait_for(failed, timeout=180, interval=0.5, what=f"Degraded=ModelDownloadFailed on {name}")
    degraded = condition(cr, "Degraded")
    assert degraded["status"] == "True" and reason in degraded["message"], degraded
    assert condition(cr, "Ready")["reason"] == "ModelDownloadFailed"
    assert "ModelDownloadFailed" in operator.kubectl("get", "infd", name, "-n", namespace).stdout

    # The kubelet restarts the failing init container (CrashLoopBackOff): still one condition
    # transition and one event, not one per restart.
    def restarted_twice():
        pod = worker_pod(operator, namespace, name)
        statuses = (pod.status.init_container_statuses or []) if pod else []
        return pod if statuses and statuses[0].restart_count >= 2 else None

    pod = wait_for(restarted_twice, timeout=180, interval=1, what=f"the init container of {name} to restart")
    assert reason in pod.status.init_container_statuses[0].last_state.terminated.message
    after = condition(get_cr(operator, name, namespace), "Degraded")
    assert (
        after["lastTransitionTime"] == degraded["lastTransitionTime"]
        and after["message"] == degraded["message"]
    )
    events = client.CoreV1Api(operator.api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},reason=DegradedTrue"
    )
    assert len(events.items) == 1, [e.message for e in events.items]
    assert reason in events.items[0].message
