"""The operator's health endpoints (operator/health.py) over real HTTP: /healthz follows the
heartbeat of an asyncio loop and kopf's task, /readyz the role, /metrics the registry."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request

import pytest

from kvscale.operator import health as health_module
from kvscale.operator import metrics
from kvscale.operator.health import Health, heartbeat, serve, watch_task


def leader_gauge() -> float:
    return metrics.REGISTRY.get_sample_value("kvscale_operator_leader")


def get(server, path: str) -> tuple[int, str]:
    url = f"http://127.0.0.1:{server.server_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def served():
    health = Health(stall_s=0.4)
    server = serve(health, "127.0.0.1", 0)
    yield health, server
    server.shutdown()
    server.server_close()


def test_a_blocked_loop_fails_liveness_while_blocked_and_recovers_after(served):
    health, server = served
    codes: list[int] = []
    block = threading.Event()
    done = threading.Event()

    async def main() -> None:
        beat = asyncio.create_task(heartbeat(health, every_s=0.05))
        while not block.is_set():
            await asyncio.sleep(0.02)
        time.sleep(1.5)  # a synchronous call on the loop: no beat for 1.5 s (limit 0.4 s)
        await asyncio.sleep(0.5)  # beating again
        done.set()
        beat.cancel()

    loop = threading.Thread(target=asyncio.run, args=(main(),))
    loop.start()
    try:
        time.sleep(0.2)
        assert get(server, "/healthz") == (200, "ok")
        block.set()
        deadline = time.monotonic() + 5
        while not done.is_set() and time.monotonic() < deadline:
            codes.append(get(server, "/healthz")[0])
            time.sleep(0.05)
    finally:
        loop.join(10)
    assert codes[0] == 200 and 500 in codes, codes
    assert 200 in codes[codes.index(500) :], codes  # back once the loop ticks again
    # The reason is in the body.
    health.beat_at = time.monotonic() - 10
    code, body = get(server, "/healthz")
    assert code == 500 and "has not ticked for 10 s" in body


def test_liveness_fails_once_kopfs_task_ended(served):
    health, server = served

    async def main() -> None:
        health.beat()
        task = asyncio.create_task(asyncio.sleep(0.01), name="kopf")
        watch_task(health, task, "kopf's main task")
        await task
        await asyncio.sleep(0)  # the done callback runs

    asyncio.run(main())
    health.beat()  # the loop is fine: it is kopf that stopped
    code, body = get(server, "/healthz")
    assert code == 500 and "kopf's main task ended" in body


def test_readiness_is_the_role_and_a_standby_is_ready(served):
    health, server = served
    assert get(server, "/readyz") == (503, "starting")
    assert get(server, "/healthz")[0] == 200  # starting is alive
    health.set_role("standby")
    assert get(server, "/readyz") == (200, "standby")
    assert leader_gauge() == 0
    health.set_role("leading")
    assert get(server, "/readyz") == (200, "leading")
    assert leader_gauge() == 1
    acting = [True]
    health.may_act = lambda: acting[0]
    acting[0] = False  # the renew deadline passed: not the leader any more, whatever the role
    assert leader_gauge() == 0
    health.set_role("stopping")
    assert get(server, "/readyz")[0] == 503 and leader_gauge() == 0
    assert get(server, "/nothing")[0] == 404


def test_metrics_are_served_with_the_operator_prefix(served):
    _, server = served
    metrics.reconciled("ok")
    code, text = get(server, "/metrics")
    assert code == 200
    assert "kvscale_operator_reconciles_total" in text and "kvscale_operator_leader" in text
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    ours = [f for f in families if not f.startswith(("process_", "python_"))]
    assert ours and all(f.startswith("kvscale_operator_") for f in ours), ours


def test_the_liveness_timeout_must_outlast_a_standbys_wait():
    from kvscale.operator import main

    with pytest.raises(SystemExit):
        main.main(["run", "--liveness-timeout", "12", "--renew-deadline", "10", "--retry-period", "2"])
    assert health_module.DEFAULT_STALL_S > 10 + 1.2 * 2


def test_the_leader_beats_on_its_loop_and_is_not_live_once_kopf_ended(monkeypatch):
    """main._lead: the heartbeat runs on kopf's loop while kopf runs; kopf's task ending (here
    with an error, the process still up) turns liveness off, and the role to stopping."""
    import kopf

    from kvscale.operator import main
    from kvscale.operator.kube import leader
    from kvscale.operator.kube.leader import Fence, Timings
    from kvscale.operator.settings import Settings

    beats: list[float] = []
    health = Health(stall_s=5)

    async def operator(**_):
        for _ in range(3):
            await asyncio.sleep(health_module.BEAT_EVERY_S * 1.1)
            beats.append(health.beat_at)
        assert health.live() == (True, "ok") and health.role == "leading"
        raise RuntimeError("kopf crashed")

    async def keep_renewing(lock, fence, stop):
        await stop.wait()
        return False

    monkeypatch.setattr(kopf, "operator", operator)
    monkeypatch.setattr(kopf.on, "login", lambda **_: lambda fn: fn)
    monkeypatch.setattr(kopf.on, "startup", lambda **_: lambda fn: fn)
    monkeypatch.setattr(leader, "keep_renewing", keep_renewing)
    fence = Fence(Timings())
    fence.renewed(time.monotonic())
    lock = type("Lock", (), {"release": lambda self, timeout: None, "holder": lambda self: "me"})()
    with pytest.raises(RuntimeError, match="kopf crashed"):
        registry, _, scaler = main.build(Settings(), None)
        asyncio.run(main._lead(lock, fence, registry, scaler, (), health))
    assert len(set(beats)) == 3  # a fresh beat each time the loop was looked at
    ok, why = health.live()
    assert not ok and "kopf's main task ended: kopf crashed" in why
    assert health.role == "stopping" and leader_gauge() == 0
