"""What a pod is to the autoscaler, from its status alone: ready, starting, terminating, or not
coming (unschedulable, crash-looping, stalled); and when its worker started and became Ready."""

from __future__ import annotations

from kubernetes import client

from kvscale.operator.autoscaler.policy import STARTUP_SLACK_S, PodState, PodTiming

WORKER_CONTAINER = "worker"  # the container children.py runs kvscale-worker in

# A worker that restarted this often without becoming Ready is crash-looping even between two
# CrashLoopBackOff waits (while the kubelet runs it again, its state is `running`).
CRASH_RESTARTS = 3
# Waiting reasons of a container that cannot start until someone changes something.
CANNOT_START = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)


def _worker_status(status: client.V1PodStatus | None) -> client.V1ContainerStatus | None:
    containers = (status and status.container_statuses) or []
    return next((c for c in containers if c.name == WORKER_CONTAINER), containers[0] if containers else None)


def pod_state(pod: client.V1Pod, now: float | None = None, startup_budget_s: float = 600.0) -> PodState:
    """What a pod is to the autoscaler (autoscaling.PodState), from its status alone: `ready`,
    `terminating`, `starting` (capacity on its way), or one that is not coming: `unschedulable`
    (PodScheduled False, reason Unschedulable), `crashlooping` (a container waiting in
    CrashLoopBackOff, or the worker restarted CRASH_RESTARTS times and not Ready), `stalled` (an
    image or config error, or its container running past the startup budget, Unix time `now`,
    without having been Ready since it started). A Ready pod that turned unready stays
    `starting`: an overloaded worker failing its probe is no reason to scale it away."""
    if pod.metadata.deletion_timestamp is not None:
        return "terminating"
    status = pod.status
    conditions = {c.type: c for c in (status and status.conditions) or []}
    ready = conditions.get("Ready")
    if ready is not None and ready.status == "True" and status.pod_ip:
        return "ready"
    scheduled = conditions.get("PodScheduled")
    if scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable":
        return "unschedulable"
    containers = [
        *((status and status.init_container_statuses) or []),
        *((status and status.container_statuses) or []),
    ]
    waiting = [
        c.state.waiting.reason for c in containers if c.state is not None and c.state.waiting is not None
    ]
    if "CrashLoopBackOff" in waiting:
        return "crashlooping"
    worker = _worker_status(status)
    if worker is not None and (worker.restart_count or 0) >= CRASH_RESTARTS:
        return "crashlooping"
    if CANNOT_START & set(waiting):
        return "stalled"
    running = worker.state.running if worker is not None and worker.state is not None else None
    started = running.started_at.timestamp() if running is not None and running.started_at else None
    if now is not None and started is not None and now - started > startup_budget_s + STARTUP_SLACK_S:
        was_ready = ready is not None and ready.last_transition_time is not None
        if not (was_ready and ready.last_transition_time.timestamp() > started):
            return "stalled"  # not Ready once since its container started, past the budget
    return "starting"


def pod_timing(pod: client.V1Pod, compile_s: float | None = None) -> PodTiming:
    """The startup facts of a pod's status (`autoscaling.startup_of` judges them): when the worker
    container now running started, and since when the pod is Ready. Not the pod's creation: that
    would count scheduling and image pulls, and for a pod that restarted or whose readiness
    flapped, its whole age. `compile_s`: from its metrics, the seconds its compiled forward took
    once it runs it."""
    status = pod.status
    ready = next((c for c in (status and status.conditions) or [] if c.type == "Ready"), None)
    ready_since = None
    if ready is not None and ready.status == "True" and ready.last_transition_time is not None:
        ready_since = ready.last_transition_time.timestamp()
    worker = _worker_status(status)
    running = worker.state.running if worker is not None and worker.state is not None else None
    started = running.started_at.timestamp() if running is not None and running.started_at else None
    return PodTiming(pod.metadata.uid or pod.metadata.name, started, ready_since, compile_s)
