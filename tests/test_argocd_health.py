"""Argo CD's health check for InferenceDeployment (manifests/argocd/), run in Lua 5.1 (Argo CD's
dialect; `lupa`'s interpreter) against status objects the operator's own status function writes
for each situation a user meets: Healthy only when every wanted worker serves the current spec (or
none is wanted), Degraded for what will not heal by waiting, Progressing otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvscale.operator.reconcile.status import compute_status

lupa = pytest.importorskip("lupa.lua51")

ARGOCD = Path(__file__).resolve().parents[1] / "manifests" / "argocd"
SCRIPT = (ARGOCD / "inferencedeployment-health.lua").read_text()
NOW = "2026-12-06T00:00:00Z"


def health(obj: dict) -> tuple[str, str]:
    """(status, message) as Argo CD gets them: the script run with `obj` as a global."""
    lua = lupa.LuaRuntime()
    lua.globals().obj = lua.table_from(obj, recursive=True)
    hs = lua.execute(SCRIPT)
    return hs["status"], hs["message"]


def deployment(replicas: int, ready: int, updated: int, *conditions: dict, generation: int = 3) -> dict:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": generation,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "conditions": list(conditions),
        },
    }


def resource(generation: int = 5, **status_args) -> dict:
    status = compute_status(
        name="llama",
        generation=generation,
        selector="x",
        desired=status_args.pop("desired", 2),
        previous_conditions=[],
        now=NOW,
        **status_args,
    )
    return {"metadata": {"name": "llama", "generation": generation}, "status": status}


def test_the_configmap_carries_the_script_unchanged():
    (cm,) = [d for d in yaml.safe_load_all((ARGOCD / "argocd-cm.yaml").read_text()) if d]
    assert cm["data"]["resource.customizations.health.kvscale.dev_InferenceDeployment"] == SCRIPT
    ignored = yaml.safe_load(
        cm["data"]["resource.customizations.ignoreResourceUpdates.kvscale.dev_InferenceDeployment"]
    )
    assert ignored == {"jsonPointers": ["/status/autoscaling", "/status/kvCacheUsage"]}


@pytest.mark.parametrize(
    ("name", "obj", "want", "says"),
    [
        ("no status yet", {"metadata": {"generation": 1}}, "Progressing", "operator"),
        ("every worker ready", resource(deployment=deployment(2, 2, 2)), "Healthy", "2/2 workers ready"),
        ("scaled to zero", resource(desired=0, deployment=deployment(0, 0, 0)), "Healthy", "no workers"),
        ("starting", resource(deployment=deployment(2, 0, 2)), "Progressing", "NoWorkerReady"),
        ("one of two ready", resource(deployment=deployment(2, 1, 2)), "Progressing", "PartiallyReady"),
        ("rolling out", resource(deployment=deployment(3, 2, 1)), "Progressing", "RollingOut"),
        (
            "model downloading",
            resource(deployment=deployment(2, 0, 2), download=("DownloadingModel", "fetching org/m")),
            "Progressing",
            "DownloadingModel",
        ),
        (
            "a refused spec (never applied)",
            resource(
                apply_error=("InvalidSpec", "adapter 'llama' has the base model's served name"),
                applied=False,
                last_applied=4,
                deployment=deployment(2, 2, 2),
            ),
            "Degraded",
            "InvalidSpec: adapter 'llama'",
        ),
        (
            "a download refused",
            resource(
                deployment=deployment(2, 0, 2),
                download=("ModelDownloadFailed", "the Hub refused the token (401)"),
            ),
            "Degraded",
            "the Hub refused the token",
        ),
        (
            "a rollout past its deadline",
            resource(
                deployment=deployment(
                    2,
                    1,
                    1,
                    {
                        "type": "Progressing",
                        "status": "False",
                        "reason": "ProgressDeadlineExceeded",
                        "message": "late",
                    },
                )
            ),
            "Degraded",
            "ProgressDeadlineExceeded",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_health_of_the_status_the_operator_writes(name, obj, want, says):
    status, message = health(obj)
    assert status == want and says in message, (status, message)


def test_a_new_generation_is_progressing_until_applied_and_an_old_failure_does_not_stick():
    """The user fixed a refused spec (generation 6): the Degraded of generation 5 says nothing of it,
    and until the operator applies 6 the resource is Progressing."""
    old = resource(
        generation=5,
        apply_error=("InvalidSpec", "bad"),
        applied=False,
        last_applied=4,
        deployment=deployment(2, 2, 2),
    )
    new = {**old, "metadata": {"name": "llama", "generation": 6}}
    assert health(new) == ("Progressing", "the operator has not applied generation 6 yet")
    healthy = resource(deployment=deployment(2, 2, 2))
    assert health({**healthy, "metadata": {"name": "llama", "generation": 6}})[0] == "Progressing"


def test_a_refused_adapter_is_degraded_and_a_loading_one_is_not():
    obj = resource(deployment=deployment(2, 2, 2))
    loading = {
        "name": "sql",
        "state": "Loading",
        "readyWorkers": 1,
        "message": "served by 1 of 2 ready workers",
    }
    obj["status"]["adapters"] = [loading]
    assert health(obj)[0] == "Healthy"  # the base model serves; the sync is under way
    refused = {"name": "big", "state": "Failed", "readyWorkers": 0, "message": "rank 64 > --max-lora-rank 16"}
    obj["status"]["adapters"] = [loading, refused]
    assert health(obj) == ("Degraded", "adapter big failed: rank 64 > --max-lora-rank 16")
