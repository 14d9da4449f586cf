"""Status churn (issue 27): at steady load the autoscaler writes its status at most once a minute
per resource unless something a reader acts on changes; at zero, Ready stays True."""

from __future__ import annotations

from types import SimpleNamespace

from kvscale.operator.autoscaler import scaler
from kvscale.operator.reconcile.status import STATUS_MIN_INTERVAL_S, autoscaler_status_due
from tests.test_autoscaler_io import tick  # noqa: F401 (the fixture)

SHOWN = {
    "desiredReplicas": 2,
    "readyWorkers": 2,
    "startingWorkers": 0,
    "unreadableWorkers": 0,
    "kvCacheUsage": 0.4,
    "waitingRequests": 0.0,
    "lookaheadSeconds": 30.0,
    "lastDecisions": [],
}


def test_gauges_wait_a_minute_and_what_a_reader_acts_on_does_not():
    due = lambda new, age: autoscaler_status_due(SHOWN, new, 100.0, 100.0 + age)  # noqa: E731
    assert autoscaler_status_due(None, SHOWN, 0.0, 0.0)  # nothing written yet
    assert not due(dict(SHOWN), 3600)  # unchanged: never
    moved = {**SHOWN, "kvCacheUsage": 0.45, "waitingRequests": 1.5, "lookaheadSeconds": 31.0}
    assert not due(moved, 2) and not due(moved, STATUS_MIN_INTERVAL_S - 1)
    assert due(moved, STATUS_MIN_INTERVAL_S)
    assert not due({**SHOWN, "unreadableWorkers": 1}, 2)  # flaps under load: a gauge
    for at_once in (
        {"lastDecisions": [{"toReplicas": 3}]},
        {"desiredReplicas": 3},
        {"readyWorkers": 3},
        {"startingWorkers": 1},
        {"unschedulableWorkers": 1},
        {"unreadableWorkers": 2},  # no worker read: ScalingActive turns False
    ):
        assert due({**SHOWN, **at_once}, 2), at_once


def _writes_per_minute(tick, monkeypatch, minutes: int = 5) -> float:  # noqa: F811
    clock = [1000.0]
    monkeypatch.setattr(
        scaler, "time", SimpleNamespace(monotonic=lambda: clock[0], time=lambda: 1.767e9 + clock[0])
    )
    ips = [p.status.pod_ip for p in tick.cache.of("ns", "tiny")]
    for i in range(int(minutes * 60 / scaler.SCRAPE_INTERVAL_S)):
        # A steady load whose KV usage moves at every scrape, as under real traffic.
        for ip in ips:
            tick.scraped[ip] = {
                "kv_usage": (0.35, 0.40, 0.45)[i % 3],
                "waiting": 0.0,
                "running": 1.0,
                "arrivals": 10.0,
            }
        decision = tick.run()
        assert decision is not None and decision.replicas == 2  # steady: no decision
        clock[0] += scaler.SCRAPE_INTERVAL_S
    return len(tick.writes) / minutes


def test_a_steady_load_writes_status_once_a_minute(tick, monkeypatch):  # noqa: F811
    # The code before wrote the gauges at most every 5 s: 7.6 writes a minute in this scenario.
    assert _writes_per_minute(tick, monkeypatch) <= 1.1  # the first write, then one a minute
