"""Leader election and fencing (operator/kube/leader.py), client-go's rules, on a fake clock:

- a candidate judges expiry by its own clock since it saw the lease record change, never by the
  holder's timestamps (a holder's clock hours behind or ahead changes nothing);
- a leader whose renewals fail or hang stops acting at its renew deadline, before the lease can
  expire for anyone else, and its writes are refused at the client (the Kubernetes client's and
  kopf's aiohttp session) without reaching the API server; every call carries a timeout.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.rest import ApiException

from kvscale.operator.kube.leader import (
    Fence,
    LeaseLock,
    NotLeader,
    Observation,
    Record,
    Timings,
    fence_api_client,
    fence_trace,
    keep_renewing,
    may_acquire,
    may_act,
    observe,
)

T = Timings(lease_duration_s=15, renew_deadline_s=10, retry_period_s=2)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def record(holder: str | None = "other", renew_time: str | None = "2026-01-01T12:00:00Z", **kw) -> Record:
    return Record(
        holder=holder,
        duration_s=kw.get("duration_s", 15),
        renew_time=renew_time,
        acquire_time=kw.get("acquire_time"),
        transitions=kw.get("transitions", 0),
    )


def test_timings_follow_client_go():
    Timings()  # 15 / 10 / 2
    for bad in ((10, 10, 2), (15, 2, 2), (15, 10, 0)):
        with pytest.raises(ValueError):
            Timings(*bad)


def test_expiry_counts_from_when_this_process_saw_the_record_change():
    seen = observe(None, record(), now=100.0)
    assert not may_acquire(seen, "me", 114.9)
    assert may_acquire(seen, "me", 115.0)
    # The same record again: the clock keeps running from the first sighting.
    assert observe(seen, record(), now=110.0) is seen
    # A renewal (the record changed): the clock restarts.
    renewed = observe(seen, record(renew_time="2026-01-01T12:00:02Z"), now=112.0)
    assert renewed.at == 112.0 and not may_acquire(renewed, "me", 120.0)
    assert may_acquire(renewed, "me", 127.0)
    # The holder's own duration counts, not ours.
    short = observe(None, record(duration_s=3), now=0.0)
    assert may_acquire(short, "me", 3.0)


def test_own_or_unheld_lease_is_free():
    assert may_acquire(Observation(record(holder=None), 0.0), "me", 0.0)
    assert may_acquire(Observation(record(holder="me"), 0.0), "me", 0.0)
    assert not may_acquire(Observation(record(holder="other"), 0.0), "me", 0.0)


@pytest.mark.parametrize("offset", [-86_400, -3600, 0, 3600, 86_400 * 365])
def test_the_holders_clock_does_not_matter(offset):
    """The holder's renewTime hours in the past or the future: the same decisions at the same
    local times (today's code took over a live holder whose clock lags at once, and never
    replaced a dead one whose clock ran ahead)."""
    stamp = (dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=offset)).isoformat()
    seen = observe(None, record(renew_time=stamp), now=50.0)
    assert [may_acquire(seen, "me", t) for t in (50.0, 64.0, 65.0)] == [False, False, True]


def test_may_act_within_the_renew_deadline_only():
    assert not may_act(None, T, 0.0)
    assert may_act(100.0, T, 109.9)
    assert not may_act(100.0, T, 110.0)


@settings(max_examples=300, deadline=None)
@given(
    starts=st.lists(st.floats(0, 100), min_size=1, max_size=8, unique=True),
    commit_delays=st.lists(st.floats(0, 3), min_size=8, max_size=8),
    polls=st.lists(st.floats(0, 200), min_size=1, max_size=40),
    skew=st.integers(-(10**6), 10**6),
)
def test_no_instant_with_two_leaders(starts, commit_delays, polls, skew):
    """The leader renews at `starts` (each write committed a little later), then its renewals
    hang for good. A candidate polls whenever it likes. Wherever the candidate may take the
    lease, the leader, even crediting each renewal the moment it committed, may no longer act.
    The holder's timestamps carry an arbitrary clock offset."""
    starts = sorted(starts)
    commits = [s + d for s, d in zip(starts, commit_delays, strict=False)]
    seen = None
    for poll in sorted(polls):
        done = [i for i, c in enumerate(commits) if c <= poll]
        if not done:
            continue
        last = done[-1]
        stamp = f"{starts[last] + skew}"  # what the holder wrote, by its own clock
        seen = observe(seen, record(renew_time=stamp), poll)
        if may_acquire(seen, "candidate", poll):
            assert not may_act(starts[last], T, poll)


class FakeLeases:
    """The API server's side of a Lease: 404 before it exists, resourceVersion compare-and-swap
    (409 for a stale write), and the timeout of every call recorded."""

    def __init__(self) -> None:
        self.lease: client.V1Lease | None = None
        self.version = 0
        self.timeouts: list[float | None] = []
        self.writes = 0
        self.hang: threading.Event | None = None

    def _stored(self, body: client.V1Lease) -> client.V1Lease:
        self.version += 1
        self.writes += 1
        body = copy.deepcopy(body)
        body.metadata.resource_version = str(self.version)
        self.lease = body
        return copy.deepcopy(body)

    def read_namespaced_lease(self, name, namespace, _request_timeout=None):
        self.timeouts.append(_request_timeout)
        if self.hang is not None:
            self.hang.wait()
        if self.lease is None:
            raise ApiException(status=404)
        return copy.deepcopy(self.lease)

    def create_namespaced_lease(self, namespace, body, _request_timeout=None):
        self.timeouts.append(_request_timeout)
        if self.lease is not None:
            raise ApiException(status=409)
        return self._stored(body)

    def replace_namespaced_lease(self, name, namespace, body, _request_timeout=None):
        self.timeouts.append(_request_timeout)
        if body.metadata.resource_version != self.lease.metadata.resource_version:
            raise ApiException(status=409)
        return self._stored(body)

    def someone_renews(self, holder: str, renew_time: dt.datetime, duration_s: int = 15) -> None:
        """Another process holds the lease and renews it (with whatever its clock says)."""
        spec = client.V1LeaseSpec(
            holder_identity=holder, renew_time=renew_time, lease_duration_seconds=duration_s
        )
        self._stored(client.V1Lease(metadata=client.V1ObjectMeta(name="l", namespace="ns"), spec=spec))


def lock(leases: FakeLeases, identity: str, clock: FakeClock) -> LeaseLock:
    return LeaseLock(leases, "ns", "l", identity, T, clock=clock)  # type: ignore[arg-type]


def test_lock_creates_renews_and_reports_when_the_attempt_started():
    leases, clock = FakeLeases(), FakeClock(10.0)
    me = lock(leases, "me", clock)
    assert me.try_acquire_or_renew(clock.t + 5.0) == 10.0
    assert leases.lease.spec.holder_identity == "me" and leases.lease.spec.lease_duration_seconds == 15
    clock.t = 12.0
    assert me.try_acquire_or_renew(clock.t + 5.0) == 12.0  # our own lease: renewed
    assert leases.writes == 2
    assert leases.timeouts and all(t is not None and 0 < t <= 5.0 for t in leases.timeouts)


@pytest.mark.parametrize("holder_offset_s", [-3600.0, 0.0, 3600.0 * 24 * 30])
def test_lock_waits_a_full_lease_of_silence_whatever_the_holders_clock(holder_offset_s):
    leases, clock = FakeLeases(), FakeClock(0.0)
    holder_clock = dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=holder_offset_s)
    standby = lock(leases, "standby", clock)
    # The holder renews every 2 s for a minute: the standby never takes over.
    for step in range(30):
        clock.t = step * 2.0
        leases.someone_renews("leader", holder_clock + dt.timedelta(seconds=clock.t))
        assert standby.try_acquire_or_renew(clock.t + 5.0) is None
    assert leases.lease.spec.holder_identity == "leader"
    # It stops (dead, or frozen): 15 s after the standby last saw a change, and not before.
    last_seen = clock.t
    clock.t = last_seen + 14.0
    assert standby.try_acquire_or_renew(clock.t + 5.0) is None
    clock.t = last_seen + 15.0
    assert standby.try_acquire_or_renew(clock.t + 5.0) == last_seen + 15.0
    spec = leases.lease.spec
    assert spec.holder_identity == "standby" and spec.lease_transitions == 1


def test_a_standby_that_starts_late_still_waits_a_full_lease():
    """A fresh process has seen nothing: the lease's renewTime (an hour old here) is no proof."""
    leases, clock = FakeLeases(), FakeClock(0.0)
    leases.someone_renews("leader", dt.datetime.now(dt.UTC) - dt.timedelta(hours=1))
    standby = lock(leases, "standby", clock)
    assert standby.try_acquire_or_renew(clock.t + 5.0) is None
    clock.t = 14.9
    assert standby.try_acquire_or_renew(clock.t + 5.0) is None
    clock.t = 15.0
    assert standby.try_acquire_or_renew(clock.t + 5.0) is not None


def test_two_candidates_racing_cannot_both_win():
    leases, clock = FakeLeases(), FakeClock(0.0)
    leases.someone_renews("dead", dt.datetime.now(dt.UTC))
    a, b = lock(leases, "a", clock), lock(leases, "b", clock)
    assert a.try_acquire_or_renew(clock.t + 5.0) is None and b.try_acquire_or_renew(clock.t + 5.0) is None
    clock.t = 20.0
    stale = leases.read_namespaced_lease("l", "ns")
    assert a.try_acquire_or_renew(clock.t + 5.0) is not None
    # b read the expired lease before a's write landed: its write carries the old version.
    leases.read_namespaced_lease = lambda *args, **kw: copy.deepcopy(stale)
    assert b.try_acquire_or_renew(clock.t + 5.0) is None
    assert leases.lease.spec.holder_identity == "a"


def test_a_resumed_leader_sees_the_new_holder_and_does_not_write():
    leases, clock = FakeLeases(), FakeClock(0.0)
    old = lock(leases, "old", clock)
    assert old.try_acquire_or_renew(clock.t + 5.0) == 0.0
    leases.someone_renews("new", dt.datetime.now(dt.UTC))  # while old was frozen
    clock.t = 60.0  # old wakes up: its last sighting of the lease is a minute old
    writes = leases.writes
    assert old.try_acquire_or_renew(clock.t + 5.0) is None
    assert leases.writes == writes and old.holder() == "new"


def test_release_hands_the_lease_back_only_if_ours():
    leases, clock = FakeLeases(), FakeClock(0.0)
    me = lock(leases, "me", clock)
    me.try_acquire_or_renew(clock.t + 5.0)
    me.release(1.0)
    assert leases.lease.spec.holder_identity is None
    leases.someone_renews("other", dt.datetime.now(dt.UTC))
    writes = leases.writes
    me.release(1.0)
    assert leases.writes == writes and leases.lease.spec.holder_identity == "other"


def test_fence_refuses_writes_from_the_renew_deadline_on():
    clock = FakeClock(0.0)
    fence = Fence(T, clock=clock)
    with pytest.raises(NotLeader):
        fence.check("PATCH", "/x")  # never led
    fence.renewed(0.0)
    fence.check("PATCH", "/x")
    clock.t = 9.99
    fence.check("POST", "/x")
    clock.t = 10.0  # e.g. the first instant after a SIGSTOP of 30 s: no renewal needed to see it
    for method in ("POST", "PUT", "PATCH", "DELETE", "patch"):
        with pytest.raises(NotLeader):
            fence.check(method, "/x")
    fence.check("GET", "/x")  # reads stay allowed
    fence.renewed(5.0)  # a renewal that started at 5 s and succeeded late
    assert fence.may_act() and fence.deadline() == 15.0
    fence.renewed(1.0)  # an older attempt's late success never moves the deadline back
    assert fence.deadline() == 15.0
    fence.revoke()
    assert not fence.may_act()


def test_a_hung_renewal_stops_the_leader_before_the_lease_expires():
    """keep_renewing on the real clock, scaled down (lease 2 s, renew deadline 1 s): the first
    renewal hangs; the fence closes at the deadline and the loop reports the loss well before a
    candidate could take the lease (2 s after it last saw it change, i.e. after our last renewal)."""
    timings = Timings(lease_duration_s=2, renew_deadline_s=1.0, retry_period_s=0.2)
    leases = FakeLeases()
    me = LeaseLock(leases, "ns", "l", "me", timings)  # type: ignore[arg-type]
    fence = Fence(timings)
    fence.renewed(me.try_acquire_or_renew(time.monotonic() + 1.0))
    renewed_at = fence.renewed_at
    leases.hang = threading.Event()

    async def run() -> tuple[bool, float, list[tuple[float, bool]]]:
        stop = asyncio.Event()
        samples: list[tuple[float, bool]] = []

        async def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - renewed_at, fence.may_act()))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        lost = await asyncio.wait_for(keep_renewing(me, fence, stop), timeout=5)
        took = time.monotonic() - renewed_at
        stop.set()
        await sampler
        leases.hang.set()  # let the hung call return (the executor waits for it at exit)
        return lost, took, samples

    writes = leases.writes
    lost, took, samples = asyncio.run(run())
    assert lost and not fence.may_act()
    assert leases.writes == writes  # the hung attempt, released late, wrote nothing
    assert took < timings.lease_duration_s, took
    assert all(acting for t, acting in samples if t < 0.95)
    assert not any(acting for t, acting in samples if t >= 1.0)
    # Each attempt was given what was left of the deadline as its timeout.
    assert all(t is not None and t <= 1.0 for t in leases.timeouts)


def test_keep_renewing_renews_and_stops_on_request():
    timings = Timings(lease_duration_s=2, renew_deadline_s=1.0, retry_period_s=0.1)
    leases = FakeLeases()
    me = LeaseLock(leases, "ns", "l", "me", timings)  # type: ignore[arg-type]
    fence = Fence(timings)
    fence.renewed(me.try_acquire_or_renew(time.monotonic() + 1.0))

    async def run() -> bool:
        stop = asyncio.Event()
        task = asyncio.create_task(keep_renewing(me, fence, stop))
        await asyncio.sleep(1.5)  # past one renew deadline: the renewals kept us leading
        assert fence.may_act()
        stop.set()
        return await task

    assert asyncio.run(run()) is False
    assert leases.writes >= 5


def test_keep_renewing_gives_up_at_once_when_another_holds_the_lease():
    timings = Timings(lease_duration_s=2, renew_deadline_s=1.0, retry_period_s=0.1)
    leases = FakeLeases()
    me = LeaseLock(leases, "ns", "l", "me", timings)  # type: ignore[arg-type]
    fence = Fence(timings)
    fence.renewed(me.try_acquire_or_renew(time.monotonic() + 1.0))
    leases.someone_renews("other", dt.datetime.now(dt.UTC))
    started = time.monotonic()
    assert asyncio.run(keep_renewing(me, fence, asyncio.Event())) is True
    assert time.monotonic() - started < 0.5 and not fence.may_act()


class Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str]]] = []

    def _answer(self) -> None:
        type(self).seen.append((self.command, self.path))
        if "hang" in self.path:
            time.sleep(30)
        if "drop" in self.path:  # the connection breaks before an answer
            self.close_connection = True
            return
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        body = json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PATCH = do_POST = do_DELETE = do_PUT = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def api_server():
    Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_kubernetes_client_is_fenced_and_times_out(api_server):
    clock = FakeClock(0.0)
    fence = Fence(T, clock=clock)
    fence.renewed(0.0)
    api = client.ApiClient(client.Configuration(host=api_server))
    fence_api_client(api, fence, timeout=(1.0, 0.3))
    core = client.CoreV1Api(api)
    core.patch_namespaced_config_map("x", "ns", {"data": {"a": "b"}})
    assert [m for m, _ in Recorder.seen] == ["PATCH"]
    clock.t = 10.0  # the renew deadline passed
    with pytest.raises(NotLeader):
        core.patch_namespaced_config_map("x", "ns", {"data": {"a": "c"}})
    with pytest.raises(NotLeader):
        core.delete_namespaced_config_map("x", "ns")
    core.read_namespaced_config_map("x", "ns")
    assert [m for m, _ in Recorder.seen] == ["PATCH", "GET"]  # the refused writes never left
    # A call without its own timeout gets the default one: a hung API server does not hang us.
    started = time.monotonic()
    with pytest.raises(Exception, match=r"(?i)timed? ?out"):
        core.read_namespaced_config_map("hang", "ns")
    assert time.monotonic() - started < 10  # the server answers after 30 s
    # A write leaves once: urllib3 would re-send a PUT whose connection broke, past the check.
    Recorder.seen.clear()
    clock.t = 0.0
    with pytest.raises(Exception, match=r"(?i)disconnect|aborted|closed"):
        core.replace_namespaced_config_map("drop", "ns", {"metadata": {"name": "drop"}})
    assert Recorder.seen == [("PUT", "/api/v1/namespaces/ns/configmaps/drop")]


def _write_frozen_while(api_server: str, freeze) -> None:
    """A ConfigMap patch through a fenced client whose new connection passes through
    `freeze(connection_maker, clock)` (where the process "freezes" past its renew deadline): the
    write must be refused and never reach the server."""
    clock = FakeClock(0.0)
    fence = Fence(T, clock=clock)
    fence.renewed(0.0)
    api = client.ApiClient(client.Configuration(host=api_server))
    fence_api_client(api, fence, timeout=(1.0, 0.3))
    pool = api.rest_client.pool_manager.connection_from_url(api_server)
    make = pool._new_conn
    pool._new_conn = lambda: freeze(make, clock)
    Recorder.seen.clear()
    with pytest.raises(NotLeader):
        client.CoreV1Api(api).patch_namespaced_config_map("x", "ns", {"data": {"a": "b"}})
    assert Recorder.seen == []  # it never left


def test_a_write_is_checked_again_on_the_connection_as_it_is_sent(api_server):
    """A process frozen after the client's check (while a connection was taken or opened) and
    resumed after its lease passed on must not send the write: the connection checks again."""

    def frozen_then_resumed(make, clock):
        clock.t = 10.0  # the renew deadline passes while the connection is being made
        return make()

    _write_frozen_while(api_server, frozen_then_resumed)


def test_a_write_is_checked_again_as_its_bytes_go_out(api_server):
    """Frozen after the connection's own check, while the request's headers were being built: the
    check as the bytes go out refuses it, and nothing reaches the server."""

    def frozen_in_putheader(make, clock):
        conn = make()
        putheader = conn.putheader

        def frozen(*args):
            clock.t = 10.0  # the renew deadline passes between request()'s check and the send
            return putheader(*args)

        conn.putheader = frozen
        return conn

    _write_frozen_while(api_server, frozen_in_putheader)


async def _aiohttp_server(seen: list[str], release: asyncio.Event) -> web.AppRunner:
    async def handle(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.path}")
        if request.path == "/slow":
            await release.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def _port(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


def test_kopfs_session_is_fenced_before_the_request_and_again_once_connected():
    clock = FakeClock(0.0)
    fence = Fence(T, clock=clock)
    fence.renewed(0.0)

    async def run() -> list[str]:
        seen: list[str] = []
        release = asyncio.Event()
        runner = await _aiohttp_server(seen, release)
        base = f"http://127.0.0.1:{_port(runner)}"
        connector = aiohttp.TCPConnector(limit=1)  # one connection: a second request must wait
        async with aiohttp.ClientSession(connector=connector, trace_configs=[fence_trace(fence)]) as s:
            async with s.patch(f"{base}/ok", json={}) as r:
                assert r.status == 200
            slow = asyncio.ensure_future(s.get(f"{base}/slow"))
            while "GET /slow" not in seen:
                await asyncio.sleep(0.01)
            waiting = asyncio.ensure_future(s.post(f"{base}/late", json={}))
            await asyncio.sleep(0.1)  # the POST passed its first check and waits for the connection
            clock.t = 10.0  # ... while the renew deadline passes
            release.set()
            (await slow).release()
            with pytest.raises(NotLeader):
                await waiting
            with pytest.raises(NotLeader):
                await s.delete(f"{base}/x")
            async with s.get(f"{base}/read") as r:
                assert r.status == 200
        await runner.cleanup()
        return seen

    assert asyncio.run(run()) == ["PATCH /ok", "GET /slow", "GET /read"]


async def _login(fence: Fence, server: str, tmp_path, monkeypatch):
    """main._fenced_login with kopf's credentials from a kubeconfig that points at `server`."""
    import kopf
    from kubernetes.config import kube_config

    from kvscale.operator.main import _fenced_login

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "secret-token"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    (tmp_path / "kubeconfig").write_text(json.dumps(config))
    # (the client reads $KUBECONFIG once, at import)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    login = _fenced_login(fence)
    return await login(logger=logging.getLogger("t"), settings=kopf.OperatorSettings())


@pytest.fixture
def default_config():
    yield
    client.Configuration.set_default(None)  # login_via_client loads the kubeconfig as the default


def test_kopf_logs_in_with_a_fenced_session(tmp_path, monkeypatch, default_config):
    clock = FakeClock(0.0)
    fence = Fence(T, clock=clock)
    fence.renewed(0.0)

    async def run() -> list[str]:
        seen: list[str] = []
        runner = await _aiohttp_server(seen, asyncio.Event())
        server = f"http://127.0.0.1:{_port(runner)}"
        info = await _login(fence, server, tmp_path, monkeypatch)
        assert info.server == server
        session = info.aiohttp_session
        assert session.headers["Authorization"] == "Bearer secret-token"
        try:
            async with session.patch(f"{server}/a", json={}) as r:
                assert r.status == 200
            clock.t = 11.0
            with pytest.raises(NotLeader):
                await session.patch(f"{server}/b", json={})
        finally:
            await session.close()
            await runner.cleanup()
        return seen

    assert asyncio.run(run()) == ["PATCH /a"]


def test_kopfs_own_requests_are_refused_once_not_retried(tmp_path, monkeypatch, default_config):
    """Through kopf's request path (its vault, its retrying `api.request`; kopf internals, pinned
    in requirements/operator.txt): a refused write is not one of the errors kopf retries."""
    import kopf
    from kopf._cogs.clients import api as kopf_api
    from kopf._cogs.clients import auth as kopf_auth
    from kopf._cogs.structs import credentials

    clock = FakeClock(0.0)
    fence = Fence(T, clock=clock)
    fence.renewed(0.0)
    settings = kopf.OperatorSettings()
    settings.networking.error_backoffs = [0.01, 0.01]
    log = logging.getLogger("t")

    async def run() -> list[str]:
        seen: list[str] = []
        runner = await _aiohttp_server(seen, asyncio.Event())
        info = await _login(fence, f"http://127.0.0.1:{_port(runner)}", tmp_path, monkeypatch)
        vault = credentials.Vault()
        await vault.populate({"fenced": info})
        kopf_auth.vault_var.set(vault)
        try:
            await kopf_api.patch("/apis/x/status", payload={}, settings=settings, logger=log)
            clock.t = 10.0
            with pytest.raises(NotLeader):
                await kopf_api.patch("/apis/x/status", payload={}, settings=settings, logger=log)
            with pytest.raises(NotLeader):
                await kopf_api.post("/api/v1/namespaces/ns/events", payload={}, settings=settings, logger=log)
            await kopf_api.get("/apis/x", settings=settings, logger=log)
        finally:
            await vault.close()
            await runner.cleanup()
        return seen

    assert asyncio.run(run()) == ["PATCH /apis/x/status", "GET /apis/x"]


def test_kopf_gets_a_timeout_on_every_call():
    import kopf

    from kvscale.operator.main import _timeouts

    settings = kopf.OperatorSettings()
    settings.networking.request_timeout = None
    settings.watching.server_timeout = 300
    _timeouts(settings)
    assert settings.networking.request_timeout and settings.networking.connect_timeout
    assert settings.watching.connect_timeout
    assert settings.watching.client_timeout > settings.watching.server_timeout


def test_lease_timings_from_flags_and_env(monkeypatch):
    from kvscale.operator import main

    with pytest.raises(SystemExit):
        main.main(["run", "--lease-duration", "5", "--renew-deadline", "6"])
    monkeypatch.setenv("KVSCALE_RENEW_DEADLINE", "20")
    with pytest.raises(SystemExit):
        main.main(["run"])  # a renew deadline past the default lease duration (15 s)


# --- The renewals' own thread and client (issue 27) ---------------------------------------------


def test_renewals_keep_their_deadline_while_the_default_thread_pool_is_full():
    """The resync and the autoscaler's blocking API calls (30 s timeouts) run on Python's
    default pool: with it full of calls that hang, the lease is still renewed every retry
    period (before: the renewal queued behind them, missed its deadline, and the leader quit)."""
    timings = Timings(lease_duration_s=2, renew_deadline_s=1.0, retry_period_s=0.1)
    leases = FakeLeases()
    me = LeaseLock(leases, "ns", "l", "me", timings)  # type: ignore[arg-type]
    fence = Fence(timings)
    fence.renewed(me.try_acquire_or_renew(time.monotonic() + 1.0))
    release = threading.Event()

    async def run() -> tuple[bool, list[bool], int]:
        from concurrent.futures import ThreadPoolExecutor

        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(max_workers=2)
        loop.set_default_executor(pool)
        busy = [asyncio.to_thread(release.wait, 10) for _ in range(6)]  # 2 hang, 4 queued
        busy_tasks = [asyncio.ensure_future(b) for b in busy]
        stop = asyncio.Event()
        renewing = asyncio.create_task(keep_renewing(me, fence, stop))
        writes, acting = leases.writes, []
        # ten renewals (1 s at a 0.1 s retry period), and the fence open at every sample
        while leases.writes < writes + 10 and not renewing.done():
            acting.append(fence.may_act())
            await asyncio.sleep(0.02)
        lost = renewing.done() and renewing.result()
        stop.set()
        release.set()
        await asyncio.gather(*busy_tasks)
        result = await renewing
        pool.shutdown()
        return lost or result, acting, leases.writes - writes

    lost, acting, renewals = asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert not lost and all(acting) and renewals >= 10


class LeaseServer(BaseHTTPRequestHandler):
    """The Lease endpoints of an API server (create, read, replace with a resourceVersion
    compare-and-swap); once `frozen` is set it accepts every request and never answers."""

    lease: ClassVar[dict | None] = None
    requests: ClassVar[list[tuple[float, str]]] = []
    frozen: ClassVar[threading.Event] = threading.Event()
    release: ClassVar[threading.Event] = threading.Event()

    def _answer(self) -> None:
        type(self).requests.append((time.monotonic(), self.command))
        if type(self).frozen.is_set():
            type(self).release.wait(30)  # accepted, read, and never answered
            self.close_connection = True
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, answer = 200, type(self).lease
        if self.command in ("POST", "PUT"):
            written = json.loads(body)
            current = type(self).lease
            version = int(current["metadata"]["resourceVersion"]) if current else 0
            if self.command == "PUT" and written["metadata"].get("resourceVersion") != str(version):
                status = 409
            else:
                written["metadata"]["resourceVersion"] = str(version + 1)
                type(self).lease = answer = written
                status = 201 if self.command == "POST" else 200
        elif answer is None:
            status = 404
        payload = json.dumps(answer or {"kind": "Status", "code": status}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def lease_server():
    LeaseServer.lease, LeaseServer.requests = None, []
    LeaseServer.frozen, LeaseServer.release = threading.Event(), threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), LeaseServer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    LeaseServer.release.set()
    server.shutdown()
    server.server_close()


def test_a_frozen_api_server_the_leader_acts_to_its_deadline_then_steps_down_once(lease_server, caplog):
    """Through the real Kubernetes client (`lease_api_client`) against an API server that, once
    frozen, accepts every request and never answers: the leader keeps acting until the renew
    deadline of its last renewal (before the term after which a candidate may take the lease),
    then reports the loss once; each attempt ends by its timeout (one error line per attempt,
    no storm), and the renewal thread is free again rather than stuck on a dead socket."""
    from kubernetes.client import CoordinationV1Api

    from kvscale.operator.kube.leader import RenewalThread, lease_api_client

    timings = Timings(lease_duration_s=3, renew_deadline_s=1.5, retry_period_s=0.2)
    api = lease_api_client(client.Configuration(host=lease_server), timings)
    me = LeaseLock(CoordinationV1Api(api), "ns", "l", "me", timings)
    fence = Fence(timings)
    fence.renewed(me.try_acquire_or_renew(time.monotonic() + timings.renew_deadline_s))
    assert LeaseServer.lease["spec"]["holderIdentity"] == "me"
    thread = RenewalThread()

    async def run() -> tuple[bool, float, float, float, list[tuple[float, bool]]]:
        stop = asyncio.Event()
        renewing = asyncio.create_task(keep_renewing(me, fence, stop, thread))
        while sum(m == "PUT" for _, m in LeaseServer.requests) < 3:  # renewing normally
            await asyncio.sleep(0.02)
        frozen_at = time.monotonic()
        LeaseServer.frozen.set()
        samples: list[tuple[float, bool]] = []
        last_renewal = fence.renewed_at
        while not renewing.done():
            last_renewal = fence.renewed_at or last_renewal
            samples.append((time.monotonic(), fence.may_act()))
            await asyncio.sleep(0.02)
        return renewing.result(), time.monotonic(), frozen_at, last_renewal, samples

    caplog.set_level(logging.ERROR, logger="kvscale.operator.kube.leader")
    lost, lost_at, frozen_at, last_renewal, samples = asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert lost and not fence.may_act()
    assert last_renewal <= frozen_at  # no renewal got through the frozen server
    deadline = last_renewal + timings.renew_deadline_s
    assert all(acting for t, acting in samples if t < deadline - 0.05)  # led to its deadline
    assert not any(acting for t, acting in samples if t >= deadline)
    assert lost_at < last_renewal + timings.lease_duration_s  # stepped down within its term
    # a read waits at most half the renew deadline: the attempt was retried within it
    assert len([m for t, m in LeaseServer.requests if t >= frozen_at]) >= 2
    # one error line per attempt, each a timeout or a failed request: no storm
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    max_attempts = timings.renew_deadline_s / timings.retry_period_s
    assert 1 <= len(errors) <= max_attempts, errors
    assert all("timed out" in e or "failed" in e for e in errors), errors
    # the hung request ended by its own timeout: the thread takes new work within a deadline
    free = thread.submit(lambda: "free")
    assert free.result(timeout=timings.renew_deadline_s + 1) == "free"
    thread.shutdown()
