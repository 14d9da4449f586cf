"""The autoscaling policy (operator/autoscaler/policy.py): unit and property tests."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvscale.operator.api.autoscaling import AutoscalingSpec
from kvscale.operator.autoscaler.policy import (
    Params,
    PodLoad,
    RouterLoad,
    Sample,
    arrival_rates,
    decide,
    least_loaded,
    signals,
)

P = Params(
    min_replicas=1,
    max_replicas=8,
    target_kv_usage=0.8,
    target_queue=4,
    up_window_s=6,
    down_window_s=30,
    max_up_step=4,
    max_down_step=1,
)
TICK = 2.0


def fleet(kv: list[float], waiting: list[float] | None = None, starting: int = 0, terminating: int = 0):
    waiting = waiting or [0.0] * len(kv)
    pods = [PodLoad(f"w{i}", "ready", k, q, 1.0) for i, (k, q) in enumerate(zip(kv, waiting, strict=True))]
    pods += [PodLoad(f"s{i}", "starting") for i in range(starting)]
    pods += [PodLoad(f"t{i}", "terminating") for i in range(terminating)]
    return tuple(pods)


def history(frames, start: float = 0.0) -> list[Sample]:
    return [Sample(start + i * TICK, pods) for i, pods in enumerate(frames)]


def test_params_from_spec_defaults():
    p = Params.from_spec(AutoscalingSpec(max_replicas=5))
    assert (p.min_replicas, p.max_replicas, p.target_kv_usage, p.target_queue) == (1, 5, 0.5, 2.0)
    assert p.up_window_s < p.down_window_s and p.max_down_step == 1


def test_scales_up_when_kv_usage_stays_over_target():
    h = history([fleet([0.95, 0.9])] * 5)
    d = decide(h, 2, P)
    assert d.replicas == 3 and "scale up 2 -> 3" in d.reason  # 1.85 / 0.8 -> 3 workers


def test_scales_up_on_queue_alone():
    h = history([fleet([0.3, 0.3], [10, 12])] * 5)
    assert decide(h, 2, P).replicas == 6  # 22 waiting / 4 per worker


def test_a_single_spike_inside_the_up_window_does_not_scale():
    frames = [fleet([0.5, 0.5])] * 4 + [fleet([1.0, 1.0], [20, 20])]
    assert decide(history(frames), 2, P).replicas == 2


def test_up_step_and_max_bound():
    h = history([fleet([1.0] * 2, [40, 40])] * 5)
    assert decide(h, 2, P).replicas == 6  # wants 20, at most 4 more per decision
    h7 = history([fleet([1.0] * 7, [40] * 7)] * 5)
    assert decide(h7, 7, P).replicas == 8  # never above max
    h8 = history([fleet([1.0] * 8, [40] * 8)] * 5)
    assert decide(h8, 8, P).replicas == 8 and "at maxReplicas" in decide(h8, 8, P).reason


def test_holds_while_new_workers_load():
    # 2 ready and saturated, 2 asked for more are loading: the queue is a backlog they will absorb.
    h = history([fleet([0.95, 0.95], [30, 30], starting=2)] * 5)
    d = decide(h, 4, P)
    assert d.replicas == 4 and "starting" in d.reason
    # KV usage of the ready workers alone may still ask for more than is on its way.
    h = history([fleet([1.0] * 4, [30] * 4, starting=1)] * 5)
    assert decide(h, 5, P).replicas == 5  # 4.0 / 0.8 = 5: already on its way
    h = history([fleet([1.0] * 6, [30] * 6, starting=1)] * 5)
    assert decide(h, 7, P).replicas == 8  # 6.0 / 0.8 = 7.5: one more than on its way


def test_a_rising_load_is_met_where_it_will_be_when_new_workers_are_ready():
    rising = [fleet([0.1 + 0.03 * i] * 2) for i in range(16)]  # +0.03 KV-units/s, now 1.1
    p = Params(target_kv_usage=0.8, up_window_s=6, trend_window_s=30)
    assert decide(history(rising), 2, p).replicas == 2  # 1.1 / 0.8: still fits on 2
    # 30 s ahead the fleet holds about 1.1 + 0.9 = 2.0 KV-units: more than 2 workers at 0.8.
    d = decide(history(rising), 2, replace(p, lookahead_s=30))
    assert d.replicas == 3 and "rising" in d.reason
    flat = [fleet([0.35, 0.35])] * 16
    assert decide(history(flat), 2, replace(p, lookahead_s=30)).replicas == 2


def counted(frames, rates: list[float]):
    """The frames with each ready pod's `arrivals` counter advanced at its share of `rates` (req/s)."""
    out, total = [], 0.0
    for pods, rate in zip(frames, rates, strict=True):
        ready = [p for p in pods if p.state == "ready"]
        total += rate * TICK
        out.append(tuple(replace(p, arrivals=total / len(ready)) if p in ready else p for p in pods))
    return out


def test_arrival_rates_from_the_counters():
    h = history(counted([fleet([0.2, 0.2])] * 4, [3.0, 3.0, 3.0, 3.0]))
    assert [round(r, 6) for _, r in arrival_rates(h)] == [3.0, 3.0, 3.0]
    # A pod read at one end only (new, or a failed scrape) adds nothing; a reset counts as 0.
    a = Sample(0.0, (PodLoad("w0", "ready", 0.2, 0, 1, 100.0), PodLoad("w1", "ready", 0.2, 0, 1, 50.0)))
    b = Sample(2.0, (PodLoad("w0", "ready", 0.2, 0, 1, 104.0), PodLoad("w1", "ready", 0.2, 0, 1, 3.0),
                     PodLoad("w2", "ready", 0.0, 0, 0, 1.0)))  # fmt: skip
    assert arrival_rates([a, b]) == [(2.0, 2.0)]
    assert arrival_rates(history([fleet([0.2])] * 3)) == []  # no counters exported


def test_the_look_ahead_follows_arrivals_not_kv_usage():
    p = Params(target_kv_usage=0.8, up_window_s=6, trend_window_s=20, lookahead_s=30)
    # KV usage steady under target (1.2 / 0.8 fits on 2), arrivals rising 14 -> 32/s over the
    # window (5 standard errors of their Poisson noise): in 30 s there will be about twice as
    # many, 2.3 / 0.8 -> 3 workers.
    flat_kv = counted([fleet([0.6, 0.6])] * 16, [2.0 + 2 * i for i in range(16)])
    d = decide(history(flat_kv), 2, p)
    assert d.replicas == 3 and "arrivals" in d.reason
    # Rising 2 -> 4/s over the window is within that noise (under one standard error): no trend.
    weak = counted([fleet([0.6, 0.6])] * 16, [2.0 + 0.13 * i for i in range(16)])
    assert decide(history(weak), 2, p).replicas == 2
    # KV usage climbing on a steady arrival rate (saturated workers slowing down, a backlog being
    # admitted) is no growth in demand: it stays where it fits (1.56 / 0.8 -> 2 workers).
    climbing = [fleet([0.5 + 0.0185 * i] * 2) for i in range(16)]
    assert decide(history(counted(climbing, [3.0] * 16)), 2, p).replicas == 2
    # Without the counters, the KV demand's own trend is projected (as for workers that lack them).
    assert decide(history(climbing), 2, p).replicas > 2


def test_pods_not_yet_created_count_as_on_the_way():
    h = history([fleet([0.95, 0.95], [30, 30])] * 5)
    assert decide(h, 4, P).replicas == 4  # asked for 4, 2 exist: hold


def test_scale_down_only_when_load_fits_on_fewer_for_the_whole_window():
    quiet = fleet([0.2, 0.2, 0.1])
    assert decide(history([quiet] * 5), 3, P).replicas == 3  # window not covered yet
    d = decide(history([quiet] * 16), 3, P)
    assert d.replicas == 2 and d.victims == ("w2",)  # the least loaded goes
    busy_once = [quiet] * 8 + [fleet([0.7, 0.6, 0.5])] + [quiet] * 7
    assert decide(history(busy_once), 3, P).replicas == 3


def test_n_minus_one_fit_uses_the_margin():
    # 3 workers at 0.45: 1.35 on 2 workers = 0.675 > 0.8 x (1 - 0.2) = 0.64: stays at 3.
    assert decide(history([fleet([0.45] * 3)] * 16), 3, P).replicas == 3
    # at 0.42: 1.26 / 2 = 0.63 fits under 0.64: down to 2.
    assert decide(history([fleet([0.42] * 3)] * 16), 3, P).replicas == 2


def test_no_scale_down_blind_or_while_pods_change():
    unknown = (*fleet([0.0, 0.0]), PodLoad("w9", "ready"))  # a ready worker we could not scrape
    assert decide(history([unknown] * 16), 3, P).replicas == 3
    assert decide(history([fleet([0.0, 0.0], terminating=1)] * 16), 2, P).replicas == 2
    assert decide(history([fleet([0.0, 0.0], starting=1)] * 16), 3, P).replicas == 3


def test_bounds_are_enforced_first():
    assert decide([], 0, P).replicas == 1
    assert decide([], 12, P).replicas == 8
    assert decide(history([fleet([0.0])] * 16), 1, P).replicas == 1  # never below min


def test_least_loaded_orders_by_requests_then_kv():
    pods = (
        PodLoad("a", "ready", 0.5, 0, 3),
        PodLoad("b", "ready", 0.1, 2, 1),
        PodLoad("c", "ready", 0.2, 0, 1),
        PodLoad("e", "ready", 0.1, 0, 1),
        PodLoad("d", "starting"),
    )
    assert least_loaded(pods, 3) == ("e", "c", "b")


def test_least_loaded_ranks_on_the_window_not_one_scrape():
    """Short requests: a scrape can find the busier worker between two of them. The e2e scale-down
    once removed the worker with three streams for the one with one that way."""

    def at(t: float, busy_running: float, light_running: float) -> Sample:
        return Sample(
            t,
            (
                PodLoad("busy", "ready", 0.3, 0, busy_running),
                PodLoad("light", "ready", 0.1, 0, light_running),
            ),
        )

    window = [at(t, 3, 1) for t in range(9)] + [at(9, 0, 1)]  # the last scrape: busy between requests
    assert least_loaded(window[-1].pods, 1) == ("busy",)  # one instant's ranking
    assert least_loaded(window[-1].pods, 1, window) == ("light",)
    # A worker the window never read (it just turned ready) is ranked on the latest scrape.
    fresh = (*window[-1].pods, PodLoad("fresh", "ready", 0.0, 0, 2))
    assert least_loaded(fresh, 3, window) == ("light", "fresh", "busy")
    # decide passes its down-window: the same history, scaled down, removes the light worker.
    p = Params(min_replicas=1, max_replicas=4, target_kv_usage=0.8, down_window_s=8, up_window_s=2)
    d = decide(window, 2, p)
    assert d.replicas == 1 and d.victims == ("light",), d


# -- properties ---------------------------------------------------------------------------------

frames_st = st.lists(
    st.tuples(
        st.lists(
            st.tuples(st.floats(0, 1), st.floats(0, 50)),
            min_size=0,
            max_size=8,
        ),
        st.integers(0, 3),
        st.integers(0, 2),
    ),
    min_size=1,
    max_size=30,
)
params_st = st.builds(
    Params,
    min_replicas=st.integers(1, 4),
    max_replicas=st.integers(4, 12),
    target_kv_usage=st.floats(0.1, 1.0),
    target_queue=st.sampled_from([0.0, 1.0, 4.0, 16.0]),
    up_window_s=st.sampled_from([0.0, 4.0, 10.0]),
    down_window_s=st.sampled_from([0.0, 10.0, 60.0]),
    max_up_step=st.integers(1, 5),
    max_down_step=st.integers(1, 3),
)


def _frames(raw):
    return history([fleet([k for k, _ in r], [q for _, q in r], s, t) for r, s, t in raw])


@settings(max_examples=300, deadline=None)
@given(frames_st, params_st, st.integers(0, 15))
def test_never_leaves_the_bounds_and_moves_at_most_a_step(raw, params, current):
    d = decide(_frames(raw), current, params)
    assert params.min_replicas <= d.replicas <= params.max_replicas
    if params.min_replicas <= current <= params.max_replicas:
        assert current - params.max_down_step <= d.replicas <= current + params.max_up_step
        if d.replicas < current:
            assert len(d.victims) == current - d.replicas


@settings(max_examples=300, deadline=None)
@given(frames_st, params_st, st.integers(1, 12))
def test_scale_down_only_when_the_load_fits_on_the_new_count(raw, params, current):
    """The simulated fit: every sample of the down-window, its total KV usage and queue spread over
    the new count, stays under target with the margin."""
    h = _frames(raw)
    d = decide(h, current, params)
    if not (params.min_replicas <= current <= params.max_replicas) or d.replicas >= current:
        return
    now = h[-1].time
    for s in h:
        if s.time < now - params.down_window_s - 1e-9:
            continue
        sig = signals(s, params)
        assert sig.starting == 0 and sig.known == sig.ready > 0
        limit_kv = params.target_kv_usage * (1 - params.margin) * d.replicas
        assert sig.total_kv <= limit_kv + 1e-6
        if params.target_queue > 0:
            assert sig.total_waiting <= params.target_queue * (1 - params.margin) * d.replicas + 1e-6


@settings(max_examples=300, deadline=None)
@given(frames_st, params_st, st.integers(1, 12))
def test_holds_scale_up_on_queue_while_workers_load(raw, params, current):
    h = _frames(raw)
    d = decide(h, current, params)
    last = signals(h[-1], params)
    if (
        params.min_replicas <= current <= params.max_replicas
        and d.replicas > current
        and (last.starting or last.ready + last.terminating < current)
    ):
        # only the KV usage of ready workers may add more than is already on its way
        assert last.up_kv is not None and last.up_kv > current


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.0, 4.0),
    st.floats(0.0, 4.0),
    st.floats(0.0, 30.0),
    st.floats(0.0, 30.0),
    st.integers(1, 5),
    st.integers(1, 8),
)
def test_load_oscillating_around_a_threshold_never_flaps(kv_a, kv_b, q_a, q_b, period, start):
    """Total load alternating between two levels (period up to the down-window): the replica count
    moves in one direction only, then settles. Pods follow the decisions at once."""
    params = Params(min_replicas=1, max_replicas=10, up_window_s=4, down_window_s=30)
    replicas, hist, moves = start, [], []
    for i in range(120):
        phase_a = (i // period) % 2 == 0
        total_kv, total_q = (kv_a, q_a) if phase_a else (kv_b, q_b)
        per_kv = min(1.0, total_kv / replicas)
        hist.append(Sample(i * TICK, fleet([per_kv] * replicas, [total_q / replicas] * replicas)))
        d = decide(hist[-40:], replicas, params)
        if d.replicas != replicas:
            moves.append(math.copysign(1, d.replicas - replicas))
            replicas = d.replicas
    assert len(set(moves)) <= 1, moves


# -- the autoscaler's pure helpers (operator/autoscaler/scrape.py, pod_state.py) -----------------


def test_metrics_are_read_under_our_names_or_vllms():
    from prometheus_client import CollectorRegistry, generate_latest

    from kvscale.operator.autoscaler.scrape import parse_metrics
    from kvscale.worker.metrics.prometheus import EngineMetrics

    metrics = EngineMetrics("m", CollectorRegistry())
    metrics.kv_cache_usage.set(0.625)
    metrics.num_waiting.set(3)
    metrics.num_running.set(7)
    metrics.finished.inc(finished_reason="stop")
    metrics.finished.inc(2, finished_reason="length")
    metrics.rejected.inc(reason="queue_full")
    metrics.rejected.inc(reason="invalid")  # not demand
    assert parse_metrics(generate_latest(metrics.registry).decode()) == {
        "kv_usage": 0.625,
        "waiting": 3.0,
        "running": 7.0,
        "arrivals": 3 + 1 + 7 + 3,  # finished + refused for a full queue + in flight
    }
    vllm = 'vllm:kv_cache_usage_perc{model_name="x"} 0.5\nvllm:num_requests_waiting{model_name="x"} 2\n'
    assert parse_metrics(vllm) == {"kv_usage": 0.5, "waiting": 2.0}


def test_pod_states():
    import datetime as dt

    from kubernetes import client

    from kvscale.operator.autoscaler.pod_state import pod_state

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    def pod(name, ready, deleting=False):
        status = "True" if ready else "False"
        cond = client.V1PodCondition(type="Ready", status=status, last_transition_time=t0)
        return client.V1Pod(
            metadata=client.V1ObjectMeta(
                name=name, creation_timestamp=t0, deletion_timestamp=t0 if deleting else None
            ),
            status=client.V1PodStatus(pod_ip="127.0.0.2", conditions=[cond]),
        )

    pods = [pod("a", True), pod("d", False), pod("e", True, True)]
    assert [pod_state(p) for p in pods] == ["ready", "starting", "terminating"]
    # The startup the look-ahead uses: tests/test_autoscaler_runaway.py.


# --- scale to zero and the router's view ---------------------------------------------------------

Z = replace(P, min_replicas=0, scale_to_zero_after_s=20)


def idle_pod(name: str = "w0", arrivals: float = 5.0) -> PodLoad:
    return PodLoad(name, "ready", 0.0, 0.0, 0.0, arrivals)


def router(queued: float = 0, in_flight: float = 0, arrivals: float = 10.0) -> RouterLoad:
    return RouterLoad("r0", queued, in_flight, arrivals)


def test_an_idle_resource_goes_to_zero_after_the_cooldown_and_not_before():
    frames = [Sample(i * TICK, (idle_pod(),), (router(),)) for i in range(12)]  # 22 s, all idle
    assert decide(frames[:10], 1, Z).replicas == 1  # 18 s: not yet covered
    d = decide(frames, 1, Z)
    assert d.replicas == 0 and "scale to zero 1 -> 0" in d.reason and d.victims == ("w0",)
    assert decide(frames, 1, replace(Z, min_replicas=1)).replicas == 1  # only with minReplicas 0
    assert Params.from_spec(AutoscalingSpec(min_replicas=0, max_replicas=2)).scale_to_zero_after_s == 300


def test_any_arrival_queue_or_running_request_in_the_cooldown_keeps_a_worker():
    base = [Sample(i * TICK, (idle_pod(),), (router(),)) for i in range(12)]
    arrived = [*base[:6], *(replace(s, routers=(router(arrivals=11.0),)) for s in base[6:])]
    assert decide(arrived, 1, Z).replicas == 1  # one request reached the router 10 s ago
    worker_arrived = [*base[:6], *(replace(s, pods=(idle_pod(arrivals=6.0),)) for s in base[6:])]
    assert decide(worker_arrived, 1, Z).replicas == 1
    held = [*base[:-1], replace(base[-1], routers=(router(queued=1),))]
    assert decide(held, 1, Z).replicas == 1
    running = [*base[:-1], replace(base[-1], pods=(PodLoad("w0", "ready", 0.1, 0.0, 1.0, 5.0),))]
    assert decide(running, 1, Z).replicas == 1
    unread = [*base[:-1], replace(base[-1], routers=(RouterLoad("r0"),))]  # a router we could not read
    assert decide(unread, 1, Z).replicas == 1


def test_a_worker_that_is_not_ready_is_never_scaled_away_and_zero_holds():
    # The router just woke the resource: its pod is loading, nothing is ready yet.
    frames = [Sample(i * TICK, (PodLoad("w0", "starting"),), (router(queued=20),)) for i in range(15)]
    assert decide(frames, 1, Z).replicas == 1
    # Two workers, one loading: no scale-down (to zero or not) while it loads.
    frames = [Sample(i * TICK, (idle_pod(), PodLoad("w1", "starting")), (router(),)) for i in range(15)]
    assert decide(frames, 2, Z).replicas == 2
    # At zero the autoscaler holds, even with requests waiting: the router asks (once).
    frames = [Sample(i * TICK, (), (router(queued=20, arrivals=float(i)),)) for i in range(5)]
    d = decide(frames, 0, Z)
    assert d.replicas == 0 and "router asks" in d.reason


def test_requests_held_at_the_router_are_demand():
    frames = [Sample(i * TICK, fleet([0.3, 0.3], [0, 0]), (router(queued=30),)) for i in range(5)]
    d = decide(frames, 2, P)
    assert d.replicas == 6 and "30 at the router" in d.reason  # 30 waiting / 4 per worker -> 8, step 4
    assert signals(frames[-1], P).total_waiting == 30
    assert decide([replace(s, routers=()) for s in frames], 2, P).replicas == 2  # without it: steady


def test_router_arrivals_are_the_arrival_signal_when_read():
    frames = [
        Sample(i * TICK, (PodLoad("w0", "ready", 0.2, 0, 1, 100.0),), (router(arrivals=10.0 * i),))
        for i in range(4)
    ]
    assert [r for _, r in arrival_rates(frames)] == [5.0, 5.0, 5.0]  # the router's 10 per 2 s
    workers_only = [replace(s, routers=()) for s in frames]
    assert [r for _, r in arrival_rates(workers_only)] == [0.0, 0.0, 0.0]  # the workers saw none new
    # Clients that bypass the router (the workers' Service): the workers' counters count more.
    bypass = [
        Sample(i * TICK, (PodLoad("w0", "ready", 0.2, 0, 1, 6.0 * i),), (router(arrivals=0.0),))
        for i in range(4)
    ]
    assert [r for _, r in arrival_rates(bypass)] == [3.0, 3.0, 3.0]


def test_the_routers_metrics_are_read_from_its_own_exposition():
    from prometheus_client import generate_latest

    from kvscale.operator.autoscaler.scrape import parse_router_metrics
    from kvscale.router.endpoints import StaticEndpoints
    from kvscale.router.server import Router
    from kvscale.router.state import RouterState

    r = Router(RouterState(), StaticEndpoints([]))
    assert parse_router_metrics(generate_latest(r.metrics.registry).decode()) == {
        "queued": 0.0,
        "in_flight": 0.0,
        "arrivals": 0.0,
    }  # before any request: no labelled series yet
    r.metrics.requests.labels("a").inc(5)
    r.metrics.requests.labels("b").inc(2)
    r.metrics.queued.labels("a").set(3)
    r.metrics.in_flight.labels("b").set(1)
    assert parse_router_metrics(generate_latest(r.metrics.registry).decode()) == {
        "queued": 3.0,
        "in_flight": 1.0,
        "arrivals": 7.0,
    }
