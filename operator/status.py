"""Pure function: what the Deployment reports -> the InferenceDeployment's status and conditions.

Ready: every wanted worker is ready and on the current spec. Progressing: a rollout or a scale
is under way. Degraded: the Deployment reports a failure (progress deadline exceeded, replica
failure) or the operator could not apply the spec. lastTransitionTime only moves when a
condition's status changes, so a steady resource keeps a steady status.
"""

from __future__ import annotations

from typing import Any


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
    apply_error: str | None = None,
) -> dict[str, Any]:
    """`desired` is the replica count the spec asks for; None when the autoscaler sets it, in which
    case the Deployment's own spec.replicas is the target."""
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
    applied = deployment is not None and (desired is None or dep_spec.get("replicas") == desired)

    failure = None
    progress = dep_conditions.get("Progressing", {})
    if apply_error:
        failure = ("ApplyFailed", apply_error)
    elif progress.get("status") == "False" and progress.get("reason") == "ProgressDeadlineExceeded":
        failure = ("ProgressDeadlineExceeded", progress.get("message", ""))
    elif dep_conditions.get("ReplicaFailure", {}).get("status") == "True":
        failure = ("ReplicaFailure", dep_conditions["ReplicaFailure"].get("message", ""))

    settled = applied and observed and updated == want and replicas == want and ready >= want
    if deployment is None:
        progressing = (True, "Creating", "creating the worker Deployment")
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

    if want == 0:
        readiness = (False, "ScaledToZero", "no workers are wanted")
    elif settled:
        readiness = (True, "AllWorkersReady", f"{ready}/{want} workers ready")
    elif ready > 0:
        readiness = (False, "PartiallyReady", f"{ready}/{want} workers ready")
    else:
        readiness = (False, "NoWorkerReady", f"0/{want} workers ready")

    conditions = [
        _condition("Ready", *readiness, generation, previous, now),
        _condition("Progressing", *progressing, generation, previous, now),
        _condition(
            "Degraded", failure is not None, *(failure or ("AsExpected", "")), generation, previous, now
        ),
    ]
    # Owned by the autoscaler: carried over untouched while it runs, dropped once it does not.
    if "ScalingActive" in previous and desired is None:
        conditions.append(previous["ScalingActive"])
    return {
        "observedGeneration": generation,
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "ready": f"{ready}/{want}",
        "selector": selector,
        "conditions": conditions,
    }
