"""The autoscaling simulator (operator/simulate.py): report shape, determinism, and that it runs
the operator's own policy."""

from __future__ import annotations

import json

from kvscale.operator import simulate
from kvscale.operator.autoscaling import decide


def small(seed: int) -> dict:
    return simulate.simulate(
        seed=seed,
        slo_s=1.0,
        max_replicas=6,
        trace=simulate.TraceConfig(duration_s=240, quiet_start_s=20, burst_every_s=60, burst_len_s=60),
        model=simulate.WorkerModel(load_time_s=10),
        policies=("kvscale", "request-count", "hpa-utilisation", "oracle", "static-peak"),
    )


def test_report_shape_and_determinism():
    a, b = small(3), small(3)
    assert json.dumps(a) == json.dumps(b)  # same seed, same report
    assert json.dumps(small(4)["results"]) != json.dumps(a["results"])
    names = [r["policy"] for r in a["results"]]
    assert names == ["kvscale", "request-count", "hpa-utilisation", "oracle", "static-peak"]
    for r in a["results"]:
        assert 0.0 <= r["slo_attainment"] <= 1.0
        assert r["replica_seconds"] > 0 and r["requests"] == a["requests"] > 100
        assert r["dropped_429"] >= 0 and r["aborted"] >= 0 and r["scaling_actions"] >= 0
        assert 1 <= r["max_replicas"] <= 6
    static = a["results"][-1]
    assert static["scaling_actions"] == 0
    assert "| kvscale |" in simulate.table(a)


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


def test_the_simulator_uses_the_operators_policy():
    assert simulate.decide is decide


def test_cli_prints_json(capsys):
    assert (
        simulate.main(
            ["--json", "--duration", "120", "--policies", "kvscale,static-peak", "--max-replicas", "3"]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in report["results"]] == ["kvscale", "static-peak"]


def test_workers_count_arrivals_as_the_operator_reads_them():
    m = simulate.WorkerModel(max_queued=1)
    w = simulate.Worker("w", m, ready_at=0.0, started_at=0.0)
    assert w.submit(simulate.Request(0.0, 100, 4)) and not w.submit(simulate.Request(0.0, 100, 4))
    assert w.arrivals() == 2  # one queued, one refused (429)
    for i in range(40):
        w.step(i * 0.05, 0.05)
    assert w.finished_count == 1 and w.in_flight() == 0 and w.arrivals() == 2
