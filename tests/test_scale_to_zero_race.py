"""Scale to zero under a request at the worst moment (issue 27): the write of 0 is confirmed by a
fresh scrape right before it (nothing arrived since the decision's sample) and carries the
Deployment's resourceVersion as read this tick, so a request that arrives in the gap, or a writer
that got there first, keeps the workers."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

from kubernetes.client.rest import ApiException

from kvscale.operator.autoscaler import scaler
from kvscale.operator.autoscaler.policy import Autoscaler, PodLoad, RouterLoad, Sample, confirms_idle
from kvscale.operator.autoscaler.scrape import parse_metrics
from tests.test_autoscaler_io import tick  # noqa: F401 (the fixture)

IDLE = Sample(0.0, (PodLoad("w0", "ready", 0.0, 0.0, 0.0, 5.0),), (RouterLoad("r0", 0, 0, 10.0),))


def test_a_fresh_scrape_confirms_idleness_only_if_nothing_arrived():
    assert confirms_idle(IDLE, replace(IDLE, time=1.0))
    arrived = replace(IDLE, time=1.0, routers=(RouterLoad("r0", 0, 1, 11.0),))
    assert not confirms_idle(IDLE, arrived)  # reached the router, in flight
    assert not confirms_idle(IDLE, replace(IDLE, time=1.0, routers=(RouterLoad("r0", 0, 0, 11.0),)))  # done
    assert not confirms_idle(IDLE, replace(IDLE, time=1.0, routers=(RouterLoad("r0", 1, 0, 11.0),)))
    assert not confirms_idle(IDLE, replace(IDLE, time=1.0, routers=(RouterLoad("r0"),)))  # unread
    assert not confirms_idle(IDLE, replace(IDLE, time=1.0, routers=()))  # gone from the list
    direct = replace(IDLE, time=1.0, pods=(PodLoad("w0", "ready", 0.0, 0.0, 0.0, 6.0),))
    assert not confirms_idle(IDLE, direct)  # a client that bypasses the router
    assert not confirms_idle(IDLE, replace(IDLE, time=1.0, pods=(PodLoad("w0", "ready"),)))  # unread


ZERO_SPEC = {
    "model": {"uri": "/models/tiny"},
    "router": {"enabled": True},
    "autoscaling": {"minReplicas": 0, "maxReplicas": 4, "scaleToZeroAfterSeconds": 0},
}


class Apps:
    """The workers' Deployment: its replicas and resourceVersion; every scale write recorded."""

    def __init__(self, _api=None):
        pass

    state = SimpleNamespace(replicas=2, rv="7", writes=[], conflict=False)

    def read_namespaced_deployment(self, name, namespace, **_):
        s = Apps.state
        return SimpleNamespace(
            spec=SimpleNamespace(replicas=s.replicas), metadata=SimpleNamespace(resource_version=s.rv)
        )

    def replace_namespaced_deployment_scale(self, name, namespace, body, **_):
        s = Apps.state
        if Apps.state.conflict or body["metadata"]["resourceVersion"] != s.rv:
            raise ApiException(status=409, reason="Conflict")
        s.writes.append(("replace", body["spec"]["replicas"], body["metadata"]["resourceVersion"]))
        s.replicas = body["spec"]["replicas"]

    def patch_namespaced_deployment_scale(self, name, namespace, body, **_):
        Apps.state.writes.append(("patch", body["spec"]["replicas"], None))  # a blind write
        Apps.state.replicas = body["spec"]["replicas"]


def _zero_tick(tick, monkeypatch, arrive_between: bool):  # noqa: F811
    """One tick of an idle resource deciding zero; with `arrive_between`, one request reaches a
    worker between the decision's scrape and the write (the worst moment)."""
    Apps.state = SimpleNamespace(replicas=2, rv="7", writes=[], conflict=False)
    monkeypatch.setattr(scaler.client, "AppsV1Api", Apps)
    tick.target.spec = dict(ZERO_SPEC)
    tick.target.scaler = Autoscaler(interval_s=scaler.SCRAPE_INTERVAL_S)
    scrapes: dict[str, int] = {}

    async def scrape(session, ip, parse=parse_metrics, **_):
        scrapes[ip] = scrapes.get(ip, 0) + 1
        late = arrive_between and scrapes[ip] > 1
        return {
            "kv_usage": 0.0,
            "waiting": 0.0,
            "running": 1.0 if late else 0.0,
            "arrivals": 11.0 if late else 10.0,
        }

    monkeypatch.setattr(scaler, "scrape", scrape)
    return asyncio.run(tick.scaler.step(tick.target, None))


def test_a_request_at_the_worst_moment_keeps_the_workers_every_time(tick, monkeypatch):  # noqa: F811
    for _ in range(50):
        decision = _zero_tick(tick, monkeypatch, arrive_between=True)
        assert Apps.state.writes == [] and Apps.state.replicas == 2, decision.reason
    decision = _zero_tick(tick, monkeypatch, arrive_between=False)
    assert decision.replicas == 0
    assert Apps.state.writes == [("replace", 0, "7")]  # conditional on this tick's read, not a blind patch


def test_a_writer_that_got_there_first_wins(tick, monkeypatch):  # noqa: F811
    class Raced(Apps):
        def read_namespaced_deployment(self, name, namespace, **_):
            read = super().read_namespaced_deployment(name, namespace)
            Apps.state.rv = "8"  # the router's wake, kubectl, ... write after this tick's read
            return read

    Apps.state = SimpleNamespace(replicas=2, rv="7", writes=[], conflict=False)
    monkeypatch.setattr(scaler.client, "AppsV1Api", Raced)
    monkeypatch.setattr(scaler, "scrape", _idle_scrape)
    tick.target.spec = dict(ZERO_SPEC)
    decision = asyncio.run(tick.scaler.step(tick.target, None))
    assert decision.replicas == 0  # decided, but not written over the newer version
    assert Apps.state.writes == [] and Apps.state.replicas == 2 and not tick.target.decisions


async def _idle_scrape(session, ip, parse=parse_metrics, **_):
    return {"kv_usage": 0.0, "waiting": 0.0, "running": 0.0, "arrivals": 10.0}
