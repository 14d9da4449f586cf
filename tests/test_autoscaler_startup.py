"""The autoscaler learns startup from the pods it started (issue 29): each pod's time to Ready (its
status) and time to compiled steps (its worker's kvscale_forward_compiled and
kvscale_forward_compile_seconds) feed the look-ahead; the simulator's new workers serve eagerly,
slower, until their compiled forward is in."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import simulate
from kubernetes import client

from kvscale.operator.autoscaler.pod_state import pod_timing
from kvscale.operator.autoscaler.policy import (
    EAGER_SHARE,
    Autoscaler,
    Params,
    PodLoad,
    PodTiming,
    Sample,
    compiled_of,
    lookahead_of,
)
from kvscale.operator.autoscaler.scrape import parse_metrics

BUDGET = 600.0


def test_the_look_ahead_counts_the_part_of_the_compile_wait_eager_steps_do_not_cover():
    assert lookahead_of(None, None, 0.4) is None
    assert lookahead_of(8.0, None, 0.4) == 8.0  # never compiles (a GPU, enforceEager), or not yet
    assert math.isclose(lookahead_of(8.0, 8.1, 0.4), 8.0 + 0.6 * 0.1)
    assert lookahead_of(8.0, 5.0, 0.4) == 8.0  # a package loaded before Ready
    assert math.isclose(lookahead_of(8.0, 68.0, 0.4), 8.0 + 0.6 * 60.0)
    assert lookahead_of(8.0, 68.0, 1.0) == 8.0 and lookahead_of(8.0, 68.0, 0.0) == 68.0
    # Time to compiled: the startup plus the compile seconds, within the budget.
    pod = PodTiming("a", 100.0, 108.0, compile_s=60.0)
    assert compiled_of(8.0, pod, BUDGET) == 68.0 and compiled_of(8.0, pod, 30.0) == 30.0
    assert compiled_of(None, pod, BUDGET) is None
    assert compiled_of(8.0, PodTiming("a", 100.0, 108.0), BUDGET) is None


def observe(scaler: Autoscaler, t: float, timings: list[PodTiming], params: Params) -> None:
    pods = tuple(PodLoad(p.uid, "ready" if p.ready_since else "starting") for p in timings)
    scaler.observe(Sample(t, pods), timings, params)


def test_each_pod_is_measured_once_and_forgotten_when_gone():
    """A cold pod: Ready 8 s after its container started, compiled 60 s later; the look-ahead
    learns both. Its replacement loads the package from the compile cache (compile_s 0.05 at
    Ready): once the cold pod is gone, the look-ahead is the startup alone."""
    params = Params(lookahead_s=30.0)
    scaler = Autoscaler()
    assert scaler.lookahead_s(params) == 30.0  # nothing measured: params' own
    observe(scaler, 108.0, [PodTiming("cold", 100.0, 108.0)], params)
    assert scaler.startups == {"cold": 8.0} and scaler.compiled == {}
    assert scaler.lookahead_s(params) == 8.0  # eager so far: nothing known about a compile
    observe(scaler, 170.0, [PodTiming("cold", 100.0, 108.0, compile_s=61.5)], params)
    assert scaler.compiled == {"cold": 69.5}
    assert math.isclose(scaler.lookahead_s(params), 8.0 + (1 - EAGER_SHARE) * 61.5)
    observe(scaler, 300.0, [PodTiming("cold", 100.0, 108.0, compile_s=99.0)], params)
    assert scaler.compiled == {"cold": 69.5}  # measured once
    warm = PodTiming("warm", 300.0, 306.0, compile_s=0.05)
    observe(scaler, 306.0, [PodTiming("cold", 100.0, 108.0, 61.5), warm], params)
    assert scaler.compiled == {"cold": 69.5, "warm": 6.05}
    observe(scaler, 310.0, [warm], params)
    assert scaler.startups == {"warm": 6.0} and scaler.compiled == {"warm": 6.05}
    assert math.isclose(scaler.lookahead_s(params), 6.0 + (1 - EAGER_SHARE) * 0.05)


def test_the_worker_metrics_give_the_compile_seconds_once_it_runs_compiled():
    eager = (
        'kvscale_forward_compiled{model_name="m"} 0.0\n'
        'kvscale_forward_compile_seconds{model_name="m"} 0.0\n'
        'kvscale_kv_cache_usage_ratio{model_name="m"} 0.1\n'
    )
    assert "compile_s" not in parse_metrics(eager)
    compiled = eager.replace('compiled{model_name="m"} 0.0', 'compiled{model_name="m"} 1.0').replace(
        'seconds{model_name="m"} 0.0', 'seconds{model_name="m"} 57.25'
    )
    assert parse_metrics(compiled)["compile_s"] == 57.25
    assert "compile_s" not in parse_metrics('vllm:num_requests_waiting{model_name="m"} 1.0\n')  # vLLM


def test_a_pods_timing_carries_what_its_metrics_said():
    started = datetime(2026, 12, 4, 12, 0, 0, tzinfo=UTC)
    ready = datetime(2026, 12, 4, 12, 0, 7, tzinfo=UTC)
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="w", uid="u1"),
        status=client.V1PodStatus(
            conditions=[client.V1PodCondition(type="Ready", status="True", last_transition_time=ready)],
            container_statuses=[
                client.V1ContainerStatus(
                    name="worker",
                    image="i",
                    image_id="",
                    ready=True,
                    restart_count=0,
                    state=client.V1ContainerState(running=client.V1ContainerStateRunning(started_at=started)),
                )
            ],
        ),
    )
    timing = pod_timing(pod, compile_s=55.0)
    assert (timing.uid, timing.ready_since - timing.container_started, timing.compile_s) == ("u1", 7.0, 55.0)
    assert pod_timing(pod).compile_s is None


def test_a_simulated_worker_serves_eagerly_slower_until_its_compiled_forward_is_in():
    """The simulator's two phases: the same requests take a worker still on its eager forward
    (compile_time_s after Ready) longer; once compiled, it runs at the calibrated speed."""

    def tokens_in(model: simulate.WorkerModel, seconds: float) -> float:
        w = simulate.Worker("w", model, ready_at=0.0, started_at=-model.load_time_s)
        for _ in range(8):
            w.submit(simulate.Request(0.0, 64, 10_000))
        t = 0.0
        while t < seconds:
            w.step(t, 0.05)
            t += 0.05
        return sum(s.generated for s in w.running)

    compiled = tokens_in(simulate.WorkerModel(load_time_s=8.0), 10.0)
    eager = tokens_in(simulate.WorkerModel(load_time_s=8.0, compile_time_s=60.0), 10.0)
    assert 0.35 < eager / compiled < 0.5  # eager decodes at 1/2.43 of the compiled rate
    switched = tokens_in(simulate.WorkerModel(load_time_s=8.0, compile_time_s=5.0), 10.0)
    assert eager < switched < compiled


def test_the_simulated_fleet_reports_both_phases_to_the_operators_autoscaler():
    model = simulate.WorkerModel(load_time_s=8.0, compile_time_s=57.0)
    policy = simulate.KvscalePolicy(Params())
    w = simulate.Worker("w1", model, ready_at=0.0, started_at=-8.0)
    policy.decide(1.0, [w], 1)
    assert policy.scaler.startups == {"w1": 8.0} and policy.scaler.compiled == {}
    policy.decide(58.0, [w], 1)
    assert policy.scaler.compiled == {"w1": 65.0}
    assert math.isclose(policy.scaler.lookahead_s(policy.params), 8.0 + (1 - EAGER_SHARE) * 57.0)
