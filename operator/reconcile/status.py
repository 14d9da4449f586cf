"""Pure functions: what the Deployment reports -> the InferenceDeployment's status and conditions,
and when each writer writes (which writer owns which fields: api/status.py).

Ready: every wanted worker is ready and on the current spec. Progressing: a rollout or a scale
is under way. Degraded: the Deployment reports a failure (progress deadline exceeded, replica
failure), the operator could not apply the spec, or a worker's model download (hf://) failed.
While an hf:// model downloads, Progressing says DownloadingModel (and Ready too, while no worker
is ready); when a download fails, Degraded says ModelDownloadFailed with the downloader's reason
(a refused token, an unknown revision), read from the pods' initContainerStatuses.
lastTransitionTime only moves when a condition's status changes, so a steady resource keeps a
steady status.

Two writers share the status, each through server-side apply under its own field manager and
each sending only its own fields (`conditions` is a map keyed by `type`, so a writer owns its
entries, not the list): the reconciler (every apply of the children and every status refresh,
one at a time per resource) and the autoscaler. Neither reads the other's fields back into a
write, so neither can put back a stale one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from kvscale.operator.api.status import pruned
from kvscale.operator.reconcile.children import DOWNLOAD_SUFFIX


def status_changed(current: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether applying `new` (one writer's fields) would change the live status: status is
    written on change only, never on a timer."""
    current = current or {}
    new = pruned(new)
    if any(current.get(k) != v for k, v in new.items() if k != "conditions"):
        return True
    live = {c.get("type"): c for c in current.get("conditions") or []}
    return any(live.get(c["type"]) != c for c in new.get("conditions", []))


# The autoscaler's status: fields a reader acts on are written when they change; the gauges
# that move with every scrape under load are written at most once per STATUS_MIN_INTERVAL_S.
STATUS_MIN_INTERVAL_S = 60.0
AUTOSCALER_GAUGES = frozenset({"kvCacheUsage", "waitingRequests", "lookaheadSeconds", "unreadableWorkers"})


def _scaling_active(signals: dict[str, Any]) -> bool:
    """The ScalingActive condition's status: some ready worker's metrics were read."""
    return (signals.get("readyWorkers") or 0) - (signals.get("unreadableWorkers") or 0) > 0


def autoscaler_status_due(
    previous: dict[str, Any] | None,
    new: dict[str, Any],
    last_at: float,
    now: float,
    min_interval_s: float = STATUS_MIN_INTERVAL_S,
) -> bool:
    """Whether the autoscaler writes `new` (its status.autoscaling) now, `previous` being what it
    last wrote (or what the object showed at a takeover) at `last_at` (seconds, any clock): at
    once when a decision, the desired count, the workers by state or the ScalingActive condition
    changed; when only the gauges moved (KV usage, waiting, look-ahead, unreadable count), at most
    once per `min_interval_s`; never when nothing changed. So a steady load costs one write a
    minute, not one every scrape (each one a watch event for Argo CD, Flux and every controller
    watching the resource)."""
    if previous is None:
        return True
    before, after = pruned(previous), pruned(new)
    if before == after:
        return False
    if _scaling_active(before) != _scaling_active(after):
        return True
    moved = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    return bool(moved - AUTOSCALER_GAUGES) or now - last_at >= min_interval_s


@dataclass(frozen=True)
class PodDownload:
    """Where one worker pod's model download stands (the pod watch keeps one per pod)."""

    state: Literal["downloading", "failed"]
    container: str
    message: str = ""  # failed: why, from the container's termination message


MESSAGE_MAX = 512


def _last_line(text: str | None) -> str:
    """The downloader writes one line; a log tail (FallbackToLogsOnError) ends with the error."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:MESSAGE_MAX] if lines else ""


def pod_download(pod: dict[str, Any]) -> PodDownload | None:
    """A worker pod's model download from its initContainerStatuses: failed when its last run
    exited non-zero (also while the kubelet restarts it: a crash loop is one state, not a flap
    that writes status on every restart), downloading while it runs, else None (done, not
    started yet, or no download at all)."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    statuses = {s.get("name"): s for s in (pod.get("status") or {}).get("initContainerStatuses") or []}
    for c in (pod.get("spec") or {}).get("initContainers") or []:
        if not c["name"].endswith(DOWNLOAD_SUFFIX):
            continue
        status = statuses.get(c["name"])
        if status is None:
            return None  # not scheduled or not started yet
        state, last = status.get("state") or {}, status.get("lastState") or {}
        if (state.get("terminated") or {}).get("exitCode") == 0:
            continue  # done: the next download, if any
        for run in (state.get("terminated"), last.get("terminated")):
            if run and run.get("exitCode", 0) != 0:
                why = (
                    _last_line(run.get("message")) or f"exit code {run['exitCode']} ({run.get('reason', '')})"
                )
                return PodDownload("failed", c["name"], why)
        return PodDownload("downloading", c["name"]) if "running" in state else None
    return None


def download_condition(downloads: Iterable[PodDownload | None]) -> tuple[str, str] | None:
    """(reason, message) of the workers' downloads for the conditions: a failure first (the same
    message for every pod that failed alike), then how many still download; None: nothing to say."""
    found = [d for d in downloads if d is not None]
    failed = sorted({(d.container, d.message) for d in found if d.state == "failed"})
    if failed:
        container, message = failed[0]
        return "ModelDownloadFailed", f"{container}: {message}"
    downloading = sum(d.state == "downloading" for d in found)
    if downloading:
        pods = "pod" if downloading == 1 else "pods"
        return "DownloadingModel", (
            f"downloading the model in {downloading} worker {pods} (kubectl logs POD -c {DOWNLOAD_SUFFIX})"
        )
    return None


def _condition(
    type_: str, ok: bool, reason: str, message: str, generation: int, previous: dict[str, dict], now: str
) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = previous.get(type_)
    changed = before is None or before.get("status") != status
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


def compute_status(
    *,
    name: str,
    generation: int,
    selector: str,
    desired: int | None,
    deployment: dict[str, Any] | None,
    previous_conditions: list[dict[str, Any]],
    now: str,
    apply_error: str | tuple[str, str] | None = None,
    applied: bool = True,
    last_applied: int | None = None,
    download: tuple[str, str] | None = None,
    endpoint: str | None = None,
) -> dict[str, Any]:
    """The reconciler's status fields. `desired` is the replica count the spec asks for; None
    when the autoscaler sets it, in which case the Deployment's own spec.replicas is the target.

    `apply_error`: (reason, message) when this generation's children could not be applied
    (ApplyFailed: retried; ApplyRejected, InvalidSpec: refused until the spec changes; a bare
    message is ApplyFailed). `observedGeneration` is the last generation whose children were
    all applied: this one when `applied`, else `last_applied` (None: none yet). Flux and kstatus
    compare it with metadata.generation; each condition says which generation it describes.
    `download`: download_condition() of the worker pods. `endpoint`: the URL clients use
    (children.endpoint_url), shown as it is."""
    if isinstance(apply_error, str):
        apply_error = ("ApplyFailed", apply_error)
    previous = {c["type"]: c for c in previous_conditions or []}
    dep_spec = (deployment or {}).get("spec", {})
    dep_status = (deployment or {}).get("status", {})
    dep_meta = (deployment or {}).get("metadata", {})
    want = desired if desired is not None else int(dep_spec.get("replicas", 1))
    replicas = int(dep_status.get("replicas", 0))
    ready = int(dep_status.get("readyReplicas", 0))
    updated = int(dep_status.get("updatedReplicas", 0))
    dep_conditions = {c["type"]: c for c in dep_status.get("conditions", [])}
    observed = deployment is not None and dep_status.get("observedGeneration", 0) >= dep_meta.get(
        "generation", 0
    )
    scaled = deployment is not None and (desired is None or dep_spec.get("replicas") == desired)

    settled = scaled and observed and updated == want and replicas == want and ready >= want
    if settled:  # every wanted worker serves: no download can matter (nor a pod the watch lost)
        download = None
    failure = None
    progress = dep_conditions.get("Progressing", {})
    download_failed = download is not None and download[0] == "ModelDownloadFailed"
    if apply_error:
        failure = apply_error
    elif download_failed:
        failure = download
    elif progress.get("status") == "False" and progress.get("reason") == "ProgressDeadlineExceeded":
        failure = ("ProgressDeadlineExceeded", progress.get("message", ""))
    elif dep_conditions.get("ReplicaFailure", {}).get("status") == "True":
        failure = ("ReplicaFailure", dep_conditions["ReplicaFailure"].get("message", ""))

    if deployment is None:
        progressing = (True, "Creating", "creating the worker Deployment")
    elif not settled and download is not None and not download_failed:
        progressing = (True, *download)
    elif not settled:
        reason = (
            "RollingOut"
            if updated < replicas or replicas > want
            else "ScalingUp"
            if replicas < want
            else "WaitingForReady"
        )
        progressing = (True, reason, f"{ready}/{want} workers ready, {updated} on the current spec")
    else:
        progressing = (False, "Complete", f"all {want} workers on the current spec")

    if apply_error:  # whatever the workers do, they do not run the spec asked for
        readiness = (False, *apply_error)
    elif want == 0:
        # Ready at zero (KServe's and Knative's practice): nothing is wrong, and with the router a
        # request wakes a worker. Ready=False here failed every Ready-based health check (Argo
        # CD, kstatus) of an idle resource.
        readiness = (True, "ScaledToZero", "no workers are wanted (a request wakes one through the router)")
    elif settled:
        readiness = (True, "AllWorkersReady", f"{ready}/{want} workers ready")
    elif ready >= want:  # enough ready workers, but some run an old spec or the rollout is on
        readiness = (
            False,
            "RollingOut",
            f"rolling out: {ready} workers ready ({want} wanted), {updated} on the current spec",
        )
    elif ready > 0:
        readiness = (False, "PartiallyReady", f"{ready}/{want} workers ready")
    elif download is not None:  # nothing serves yet, and this is why
        readiness = (False, *download)
    else:
        readiness = (False, "NoWorkerReady", f"0/{want} workers ready")

    conditions = [
        _condition("Ready", *readiness, generation, previous, now),
        _condition("Progressing", *progressing, generation, previous, now),
        _condition(
            "Degraded", failure is not None, *(failure or ("AsExpected", "")), generation, previous, now
        ),
    ]
    return {
        "observedGeneration": generation if applied else last_applied,
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "ready": f"{ready}/{want}",
        "selector": selector,
        "endpoint": endpoint,
        "conditions": conditions,
    }
