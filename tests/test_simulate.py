"""The autoscaling simulator (tests/simulate.py): report shape, determinism, that it runs the
operator's own autoscaler, and that a flat load makes it add no workers."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import simulate

from kvscale.operator.api.autoscaling import AutoscalingSpec
from kvscale.operator.autoscaler.policy import Autoscaler, Params


def small(seed: int) -> dict:
    return simulate.simulate(
        seed=seed,
        slo_s=1.0,
        max_replicas=6,
        trace=simulate.TraceConfig(duration_s=240, quiet_start_s=20, burst_every_s=60, burst_len_s=60),
        model=simulate.WorkerModel(load_time_s=10),
        policies=(
            "kvscale",
            "kvscale-round-robin",
            "request-count",
            "hpa-utilisation",
            "oracle",
            "static-peak",
        ),
    )


def test_report_shape_and_determinism():
    a, b = small(3), small(3)
    assert json.dumps(a) == json.dumps(b)  # same seed, same report
    assert json.dumps(small(4)["results"]) != json.dumps(a["results"])
    names = [r["policy"] for r in a["results"]]
    assert names == [
        "kvscale",
        "kvscale-round-robin",
        "request-count",
        "hpa-utilisation",
        "oracle",
        "static-peak",
    ]
    for r in a["results"]:
        assert 0.0 <= r["slo_attainment"] <= 1.0
        assert r["replica_seconds"] > 0 and r["requests"] == a["requests"] > 100
        # A request lost to a 429 or a drain is an SLO miss; each policy but the static one scales.
        lost = r["dropped_429"] + r["aborted"]
        assert r["slo_attainment"] <= 1.0 - lost / r["requests"] + 1e-9, r
        assert (r["scaling_actions"] > 0) == (r["policy"] != "static-peak"), r
        assert 1 <= r["max_replicas"] <= 6
    static = a["results"][-1]
    assert static["scaling_actions"] == 0
    assert "| kvscale |" in simulate.table(a) and "| kvscale-round-robin |" in simulate.table(a)


def test_the_oracle_bound_knows_the_future_and_the_capacity():
    """The oracle row (a bound, not a policy) sizes for the rate one load ahead at static peak's
    per-worker rate: it serves more requests in time than our policy, for less than static peak."""
    report = small(3)
    ours, oracle, static = report["results"][0], report["results"][-2], report["results"][-1]
    assert oracle["policy"] == "oracle" and static["policy"] == "static-peak"
    assert oracle["slo_attainment"] > ours["slo_attainment"]
    assert oracle["replica_seconds"] < static["replica_seconds"]
    assert min(n for _, n, _ in oracle["timeline"]) >= 2  # never a lone worker

    rate = lambda t: 2.0 if t < 100 else 8.0  # noqa: E731
    policy = simulate.OraclePolicy(rate, per_worker=2.0, lead_s=30, lo=2, hi=16)
    assert policy.decide(60.0, [], 2) == (2, ())
    assert policy.decide(75.0, [], 2) == (4, ())  # the step 25 s ahead is within one load
    assert policy.decide(200.0, [], 4) == (4, ())


def test_worker_model_interpolates_the_benchmark():
    m = simulate.WorkerModel()
    assert m.decode_rate(1) == 119.2 and m.decode_rate(64) == 760.8
    assert m.decode_rate(8) < m.decode_rate(20) < m.decode_rate(32)


def test_the_simulator_drives_the_operators_autoscaler_and_is_not_shipped():
    policy = simulate.KvscalePolicy(Params())
    assert type(policy.scaler) is Autoscaler  # the object operator/autoscaler/scaler.py keeps per resource
    workers = [simulate.Worker("w1", simulate.WorkerModel(), ready_at=0.0, started_at=-30.0)]
    policy.decide(0.0, workers, 1)
    assert policy.scaler.startups == {"w1": 30.0} and policy.scaler.lookahead_s(policy.params) == 30.0
    assert importlib.util.find_spec("kvscale.operator.simulate") is None


OLD_TREND = {"trend_t": 0.0, "trend_window_s": 20.0}  # before: every positive slope over 20 s


def _flat(rps: float, workers: int, seed: int, duration: float = 600.0, **overrides):
    """The operator's autoscaler (AutoscalingSpec defaults) on a flat Poisson load, the fleet
    starting at `workers`, with 30 s startups measured on the pods (the look-ahead)."""
    model = simulate.WorkerModel()
    cfg = simulate.TraceConfig(duration_s=duration, base_rps=rps, peak_rps=rps, quiet_start_s=duration)
    params = Params.from_spec(AutoscalingSpec(min_replicas=1, max_replicas=8))
    params = replace(params, **overrides)
    requests, rate = simulate.make_trace(cfg, random.Random(seed))
    policy = simulate.KvscalePolicy(params)
    result = simulate.run(policy, requests, rate, model, cfg.duration_s, slo_s=1.0, initial=workers)
    assert math.isclose(policy.scaler.lookahead_s(params), model.load_time_s)
    return result


def test_a_flat_poisson_load_never_adds_workers():
    """Ten seeds of 10 minutes of a flat Poisson load one worker takes (0.6 requests/s, KV usage
    well under target): no worker is added. Projecting every positive slope of the arrival
    rate's noise 30 s ahead, as the autoscaler did before the significance test, adds workers on
    most seeds."""
    assert [_flat(0.6, 1, seed).max_replicas for seed in range(10)] == [1] * 10
    old = [_flat(0.6, 1, seed, **OLD_TREND).max_replicas for seed in range(10)]
    assert sum(n > 1 for n in old) >= 5, old


def test_under_a_busier_flat_load_the_trend_adds_nothing():
    """3.4 requests/s on 2 workers: long requests push KV usage over target now and then, and the
    fleet moves on that (real load), but the arrival trend adds nothing: every decision is the
    one the autoscaler makes with the look-ahead off. Every positive slope taken: more workers."""
    for seed in range(5):
        ours, off = _flat(3.4, 2, seed), _flat(3.4, 2, seed, trend_t=math.inf)
        assert ours.timeline == off.timeline and ours.scaling_actions == off.scaling_actions, seed
    old, off = _flat(3.4, 2, 0, **OLD_TREND), _flat(3.4, 2, 0, trend_t=math.inf)
    assert old.replica_seconds > off.replica_seconds and old.max_replicas > off.max_replicas


def test_cli_prints_json(capsys):
    assert (
        simulate.main(
            ["--json", "--duration", "120", "--policies", "kvscale,static-peak", "--max-replicas", "3"]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in report["results"]] == ["kvscale", "static-peak"]


def test_the_cli_runs_from_its_place_in_tests():
    repo = Path(__file__).resolve().parents[1]
    args = ["--duration", "60", "--policies", "kvscale", "--max-replicas", "2"]
    out = subprocess.run(
        [sys.executable, "tests/simulate.py", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "| kvscale |" in out


def test_workers_count_arrivals_as_the_operator_reads_them():
    m = simulate.WorkerModel(max_queued=1)
    w = simulate.Worker("w", m, ready_at=0.0, started_at=0.0)
    assert w.submit(simulate.Request(0.0, 100, 4)) and not w.submit(simulate.Request(0.0, 100, 4))
    assert w.arrivals() == 2  # one queued, one refused (429)
    for i in range(40):
        w.step(i * 0.05, 0.05)
    assert w.finished_count == 1 and w.in_flight() == 0 and w.arrivals() == 2


def test_requests_reach_the_workers_through_the_routers_own_picking_function(monkeypatch):
    """Not a model of the router: its picker, called for every routed request, and its queue seen
    by the autoscaler; the round-robin row calls the round-robin baseline instead."""
    from kvscale.router import picker

    calls = {"pick": 0, "round-robin": 0}
    monkeypatch.setattr(
        simulate, "pick", lambda *a: (calls.__setitem__("pick", calls["pick"] + 1), picker.pick(*a))[1]
    )
    rr = picker.pick_round_robin
    monkeypatch.setattr(
        simulate,
        "pick_round_robin",
        lambda *a: (calls.__setitem__("round-robin", calls["round-robin"] + 1), rr(*a))[1],
    )
    views = []
    decide = simulate.KvscalePolicy.decide

    def spy(self, now, workers, current):
        views.append(self.router_view)
        return decide(self, now, workers, current)

    monkeypatch.setattr(simulate.KvscalePolicy, "decide", spy)
    cfg = simulate.TraceConfig(duration_s=120, quiet_start_s=10, burst_every_s=40, burst_len_s=40)
    requests, rate = simulate.make_trace(cfg, random.Random(1))
    model = simulate.WorkerModel(load_time_s=10)
    simulate.run(simulate.KvscalePolicy(Params(max_replicas=1)), requests, rate, model, 120, 1.0)
    assert calls["pick"] >= len(requests) and calls["round-robin"] == 0
    assert max(v.queued for v in views) > 0  # one worker could not take the burst: the router held it
    counted = [v.arrivals for v in views]  # the router's arrivals counter, up to the last decision
    assert counted == sorted(counted) and 0.9 * len(requests) < counted[-1] <= len(requests)
    views.clear()
    simulate.run(simulate.RoundRobinServicePolicy(Params(max_replicas=1)), requests, rate, model, 120, 1.0)
    assert calls["round-robin"] == len(requests) and set(views) == {None}
