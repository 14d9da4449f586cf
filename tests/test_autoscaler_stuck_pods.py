"""Pods that are not coming (issue 27): an unschedulable, crash-looping or stalled pod is not
"starting", so it no longer freezes scale-down, scale to zero or queue-driven scale-up, is the
first pod a scale-down removes, and is reported in status."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

from kubernetes import client

from kvscale.operator.autoscaler.pod_state import pod_state
from kvscale.operator.autoscaler.policy import Params, PodLoad, RouterLoad, Sample, decide, signals
from tests.test_autoscaler_io import pod, tick  # noqa: F401 (the fixture)

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
NOW = T0.timestamp() + 60.0
P = Params(
    min_replicas=1, max_replicas=3, target_kv_usage=0.8, target_queue=4, up_window_s=6, down_window_s=30
)
TICK = 2.0


def _pod(
    *,
    scheduled: tuple[str, str | None] = ("True", None),
    ready: str = "False",
    ready_at: dt.datetime = T0,
    waiting: str | None = None,
    init_waiting: str | None = None,
    restarts: int = 0,
    started: dt.datetime | None = T0,
) -> client.V1Pod:
    state = (
        client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason=waiting))
        if waiting
        else client.V1ContainerState(running=client.V1ContainerStateRunning(started_at=started))
        if started
        else client.V1ContainerState()
    )

    def status(name: str, st: client.V1ContainerState) -> client.V1ContainerStatus:
        return client.V1ContainerStatus(
            name=name, image="i", image_id="", ready=ready == "True", restart_count=restarts, state=st
        )

    init = None
    if init_waiting:
        init = [
            status(
                "download",
                client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason=init_waiting)),
            )
        ]
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name="p"),
        status=client.V1PodStatus(
            pod_ip="10.0.0.9" if scheduled[0] == "True" else None,
            conditions=[
                client.V1PodCondition(type="PodScheduled", status=scheduled[0], reason=scheduled[1]),
                client.V1PodCondition(type="Ready", status=ready, last_transition_time=ready_at),
            ],
            container_statuses=[status("worker", state)],
            init_container_statuses=init,
        ),
    )


def test_pod_states_tell_a_pod_on_its_way_from_one_that_is_not_coming():
    budget = 600.0
    assert pod_state(_pod(ready="True"), NOW, budget) == "ready"
    assert pod_state(_pod(), NOW, budget) == "starting"  # loading, 60 s into a 600 s budget
    assert pod_state(_pod(scheduled=("False", "Unschedulable"), started=None), NOW, budget) == "unschedulable"
    assert pod_state(_pod(waiting="CrashLoopBackOff", restarts=1), NOW, budget) == "crashlooping"
    assert pod_state(_pod(init_waiting="CrashLoopBackOff", started=None), NOW, budget) == "crashlooping"
    assert pod_state(_pod(restarts=3), NOW, budget) == "crashlooping"  # running again, between backoffs
    assert pod_state(_pod(waiting="ImagePullBackOff"), NOW, budget) == "stalled"
    assert pod_state(_pod(), NOW + 700, budget) == "stalled"  # never Ready, past the budget
    # Ready once since it started, unready now (an overloaded worker failing its probe): on its way.
    assert pod_state(_pod(ready_at=T0 + dt.timedelta(seconds=30)), NOW + 700, budget) == "starting"
    assert pod_state(_pod(scheduled=("False", "SchedulingGated"), started=None), NOW, budget) == "starting"


def idle(name: str, arrivals: float = 5.0) -> PodLoad:
    return PodLoad(name, "ready", 0.0, 0.0, 0.0, arrivals)


def frames(pods: tuple[PodLoad, ...], n: int = 20, routers: tuple[RouterLoad, ...] = ()) -> list[Sample]:
    return [Sample(i * TICK, pods, routers) for i in range(n)]


def test_an_unschedulable_pod_does_not_freeze_scale_down_and_goes_first():
    # maxReplicas 3: two idle workers and a third the scheduler cannot place (no free GPU).
    for stuck in ("unschedulable", "crashlooping", "stalled"):
        h = frames((idle("w0"), idle("w1"), PodLoad("w2", stuck)))
        d = decide(h, 3, P)
        assert d.replicas == 2 and "scale down 3 -> 2" in d.reason, (stuck, d.reason)
        assert d.victims == ("w2",)  # the pod that is not coming, not a serving one
        assert f"1 {stuck.replace('crashlooping', 'crash-looping')}" in d.reason
    # A pod still starting within its budget holds, as before.
    d = decide(frames((idle("w0"), idle("w1"), PodLoad("w2", "starting"))), 3, P)
    assert d.replicas == 3 and "holding (workers starting)" in d.reason


def test_a_crash_looping_pod_does_not_keep_an_idle_resource_from_zero():
    z = replace(P, min_replicas=0, scale_to_zero_after_s=20)
    h = frames((idle("w0"), PodLoad("w1", "crashlooping")), routers=(RouterLoad("r0", 0, 0, 10.0),))
    d = decide(h, 2, z)
    assert d.replicas == 0 and set(d.victims) == {"w0", "w1"}


def test_queue_driven_scale_up_is_not_disabled_by_a_stuck_pod():
    # One ready worker with a deep queue and one crash-looping pod: the queue asks for more.
    pods = (PodLoad("w0", "ready", 0.3, 20.0, 4.0), PodLoad("w1", "crashlooping"))
    d = decide(frames(pods, 5), 2, P)
    assert d.replicas == 3 and "scale up 2 -> 3" in d.reason
    sig = signals(frames(pods, 1)[0], P)
    assert (sig.starting, sig.crashlooping, sig.stuck) == (0, 1, 1)


def test_stuck_pods_are_reported_in_status(tick):  # noqa: F811
    unschedulable = pod("tiny-3", ready=False)
    unschedulable.status.conditions.append(
        client.V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable")
    )
    tick.cache.apply("ADDED", unschedulable)
    tick.run()
    shown = tick.writes[-1]["autoscaling"]
    assert (shown["readyWorkers"], shown["startingWorkers"], shown["unschedulableWorkers"]) == (2, 0, 1)
    assert shown["crashLoopingWorkers"] == 0 and shown["stalledWorkers"] == 0
