"""Leader election on a coordination.k8s.io Lease, fenced by this process's own clock.

The rules are client-go's (k8s.io/client-go/tools/leaderelection):

- A candidate never reads the holder's timestamps. It remembers the lease record it last saw and
  when, by its own monotonic clock, it saw that record change; the lease has expired once the
  record stayed the same for the holder's `leaseDurationSeconds` (`observe`, `may_acquire`). The
  nodes' clocks may be hours apart: nothing compares them.
- The leader renews every retry period, each attempt with a timeout. When no renewal succeeded
  for the renew deadline (shorter than the lease duration) it stops acting (`may_act`): a
  renewal counts from the moment its attempt started, before any candidate can have seen it, so
  the leader's deadline passes before any candidate's expiry does.
- Every write of the process checks the `Fence` first: the Kubernetes client's requests
  (`fence_api_client`) and kopf's own (`fenced_session`: status bookkeeping, events). A leader
  that was frozen, or whose renewals hung, and wakes up after its deadline refuses to write,
  whatever its tasks were doing, before the loop that renews even notices.
- The writes of the Lease compare-and-swap on its resourceVersion: two candidates racing for an
  expired lease cannot both win, the loser's write is refused with 409.
- The renewals run on a thread of their own (`RenewalThread`), with a Kubernetes client of their
  own (`lease_api_client`: its own connection pool, a connect timeout of one retry period, no
  request longer than what is left of the renew deadline). Nothing else the process does (the
  resync, the autoscaler's blocking calls, both on Python's default thread pool) can delay one.

What no client can close: a write that passed its check and was then frozen before its bytes
left the process lands whenever the process resumes. The margin between the renew deadline and
the lease duration covers delays up to that long; the API server offers no fencing token on
ordinary objects for longer ones.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import aiohttp
from kubernetes import client
from kubernetes.client import rest
from kubernetes.client.rest import ApiException

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Every request of the Kubernetes client without its own timeout: (connect, read) seconds.
API_TIMEOUT_S = (5.0, 30.0)
JITTER = 1.2  # client-go's: the renew deadline must leave room for one jittered retry


class NotLeader(Exception):
    """A write refused because this process may no longer act as the leader."""


@dataclasses.dataclass(frozen=True)
class Timings:
    """client-go's defaults: a dead leader is replaced within 15 s, a cut-off one stops after 10."""

    lease_duration_s: int = 15
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if self.retry_period_s <= 0:
            raise ValueError("the retry period must be positive")
        if self.renew_deadline_s <= JITTER * self.retry_period_s:
            raise ValueError(f"the renew deadline must exceed {JITTER} x the retry period")
        if self.lease_duration_s <= self.renew_deadline_s:
            raise ValueError("the lease duration must exceed the renew deadline")


@dataclasses.dataclass(frozen=True)
class Record:
    """What a candidate compares. The times are opaque: only whether they changed matters."""

    holder: str | None
    duration_s: int
    renew_time: str | None
    acquire_time: str | None
    transitions: int

    @classmethod
    def of(cls, spec: client.V1LeaseSpec, default_duration_s: int) -> Record:
        return cls(
            holder=spec.holder_identity or None,
            duration_s=spec.lease_duration_seconds or default_duration_s,
            renew_time=_stamp(spec.renew_time),
            acquire_time=_stamp(spec.acquire_time),
            transitions=spec.lease_transitions or 0,
        )


@dataclasses.dataclass(frozen=True)
class Observation:
    record: Record
    at: float  # this process's monotonic clock when it saw the record change


def observe(previous: Observation | None, record: Record, now: float) -> Observation:
    """The clock of a record restarts whenever the record changes, and only then."""
    if previous is not None and previous.record == record:
        return previous
    return Observation(record, now)


def may_acquire(observed: Observation, identity: str, now: float) -> bool:
    """We may take (or renew) the lease if it is ours, unheld, or unchanged for its duration."""
    holder = observed.record.holder
    if not holder or holder == identity:
        return True
    return now >= observed.at + observed.record.duration_s


def may_act(renewed_at: float | None, timings: Timings, now: float) -> bool:
    """The leader acts only within the renew deadline of its last successful renewal."""
    return renewed_at is not None and now - renewed_at < timings.renew_deadline_s


class Fence:
    """The leadership token: every write asks it first (`check`), against the clock of now."""

    def __init__(self, timings: Timings, clock: Clock = time.monotonic) -> None:
        self.timings, self.clock = timings, clock
        self.renewed_at: float | None = None

    def renewed(self, started: float) -> None:
        if self.renewed_at is None or started > self.renewed_at:
            self.renewed_at = started

    def revoke(self) -> None:
        self.renewed_at = None

    def deadline(self) -> float | None:
        return None if self.renewed_at is None else self.renewed_at + self.timings.renew_deadline_s

    def may_act(self) -> bool:
        return may_act(self.renewed_at, self.timings, self.clock())

    def check(self, method: str, url: object) -> None:
        if method.upper() in WRITES and not self.may_act():
            raise NotLeader(f"not the leader (renew deadline passed): refusing {method.upper()} {url}")


class LeaseLock:
    """The Lease's API calls; the decisions are `observe` and `may_acquire` above."""

    def __init__(
        self,
        coordination: client.CoordinationV1Api,
        namespace: str,
        name: str,
        identity: str,
        timings: Timings,
        clock: Clock = time.monotonic,
    ) -> None:
        self.api, self.namespace, self.name, self.identity = coordination, namespace, name, identity
        self.timings, self.clock = timings, clock
        self.observed: Observation | None = None

    def try_acquire_or_renew(self, deadline: float) -> float | None:
        """Take or renew the lease by `deadline` (this clock's time; the leader's is its renew
        deadline). Held: the time this attempt started (what the next renew deadline counts
        from); not held (another live holder, or a race lost): None."""
        started = self.clock()

        def left() -> float:
            """Each call gets what is left of the attempt's time, and none is made after it:
            an attempt that hung, or was frozen, and resumes late writes nothing."""
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise TimeoutError("the lease attempt ran past its deadline")
            return remaining

        now = dt.datetime.now(dt.UTC)  # written for people and tools; no one here reads it back
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=left())
        except ApiException as e:
            if e.status != 404:
                raise
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=self._spec(client.V1LeaseSpec(lease_transitions=0, acquire_time=now), now),
            )
            created = self._write(self.api.create_namespaced_lease, self.namespace, body, timeout=left())
            return self._held(created, started)
        record = Record.of(lease.spec, self.timings.lease_duration_s)
        self.observed = observe(self.observed, record, self.clock())
        if not may_acquire(self.observed, self.identity, self.clock()):
            return None
        spec = lease.spec
        if spec.holder_identity != self.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
            logger.info("taking over the lease", extra={"lease": self.name, "from": spec.holder_identity})
        lease.spec = self._spec(spec, now)  # metadata.resourceVersion stays: the compare-and-swap
        replaced = self._write(
            self.api.replace_namespaced_lease, self.name, self.namespace, lease, timeout=left()
        )
        return self._held(replaced, started)

    def holder(self) -> str | None:
        """The holder as last seen (None before the first read)."""
        return self.observed.record.holder if self.observed else None

    def release(self, timeout_s: float) -> None:
        """Hand the lease back at once (graceful exit): the next leader need not wait it out."""
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout_s)
            if lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = None
                lease.spec.lease_duration_seconds = 1  # client-go's: candidates wait one second
                self.api.replace_namespaced_lease(
                    self.name, self.namespace, lease, _request_timeout=timeout_s
                )
        except Exception as e:  # best effort: the lease expires by itself
            logger.warning("could not release the lease: %s", e)

    def _spec(self, spec: client.V1LeaseSpec, now: dt.datetime) -> client.V1LeaseSpec:
        spec.holder_identity, spec.renew_time = self.identity, now
        spec.lease_duration_seconds = self.timings.lease_duration_s
        return spec

    def _held(self, written: client.V1Lease | None, started: float) -> float | None:
        if written is None:
            return None
        # Our own write is a change we saw: should we lose it later, candidates' rules apply.
        self.observed = Observation(Record.of(written.spec, self.timings.lease_duration_s), self.clock())
        return started

    @staticmethod
    def _write(call: Callable[..., client.V1Lease], *args: Any, timeout: float) -> client.V1Lease | None:
        try:
            return call(*args, _request_timeout=timeout)
        except ApiException as e:
            if e.status == 409:  # someone else wrote first
                return None
            raise


class RenewalThread(concurrent.futures.ThreadPoolExecutor):
    """The Lease's own thread: one attempt at a time (an attempt that outlived its timeout on
    the loop delays the next one, never doubles it), never shared with Python's default pool,
    which the resync and the autoscaler's blocking API calls (30 s timeouts) may fill."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="lease-renewal")


def lease_api_client(configuration: client.Configuration, timings: Timings) -> client.ApiClient:
    """A Kubernetes client for the Lease only: a copy of `configuration` (its own connection
    pool, so a pool exhausted by other calls cannot delay a renewal), no re-sends inside urllib3
    (a write leaves within its attempt's deadline or not at all), and every request bounded:
    connect within one retry period (a lost SYN is retried inside the deadline), each read
    within half the renew deadline (a connection gone silent leaves time for a retry on a fresh
    one, as client-go retries within its deadline) and within the timeout the attempt passes
    (what is left of its deadline)."""
    config = copy.deepcopy(configuration)
    config.retries = False
    api = client.ApiClient(config)
    rest_client = api.rest_client
    send = rest_client.request
    connect_s = timings.retry_period_s
    read_s = max(timings.retry_period_s, timings.renew_deadline_s / 2)

    def request(method: str, url: str, *args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        total = read_s
        if isinstance(_request_timeout, int | float) and _request_timeout > 0:
            total = min(float(_request_timeout), total)
        # (connect, read): the kubernetes client's pair
        timeout = (min(connect_s, total), total)
        return send(method, url, *args, _request_timeout=timeout, **kwargs)

    rest_client.request = request
    return api


async def keep_renewing(
    lock: LeaseLock,
    fence: Fence,
    stop: asyncio.Event,
    thread: concurrent.futures.Executor | None = None,
) -> bool:
    """The leader's loop: renew every retry period until `stop` (returns False) or until the
    lease is lost (returns True, the fence revoked). Each attempt runs on `thread` (a
    `RenewalThread` of its own when none is given) and gets what is left of the renew deadline
    as its timeout, and a failed one is retried within the deadline, as client-go does;
    another live holder ends it at once. The fence does not wait for this loop: it refuses
    writes from the deadline on, also while an attempt hangs here or the loop is not scheduled."""
    own = thread is None
    renewal_thread = thread or RenewalThread()
    try:
        return await _renew_until_lost(lock, fence, stop, renewal_thread)
    finally:
        if own:  # an attempt still running ends by its own timeout; nothing waits for it
            renewal_thread.shutdown(wait=False)


async def _renew_until_lost(
    lock: LeaseLock, fence: Fence, stop: asyncio.Event, thread: concurrent.futures.Executor
) -> bool:
    loop = asyncio.get_running_loop()
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), fence.timings.retry_period_s)
        if stop.is_set():
            return False
        deadline = fence.deadline()
        left = 0.0 if deadline is None else deadline - fence.clock()
        started = None
        if left > 0:
            try:
                attempt = loop.run_in_executor(thread, lock.try_acquire_or_renew, deadline)
                started = await asyncio.wait_for(attempt, left)
            except TimeoutError:
                logger.error("lease renewal timed out")
            except Exception as e:
                logger.error("lease renewal failed: %s", e)
        if started is not None:
            fence.renewed(started)
        elif not (fence.may_act() and lock.holder() in (None, lock.identity)):
            fence.revoke()
            return True


def _stamp(value: dt.datetime | str | None) -> str | None:
    return value.isoformat() if isinstance(value, dt.datetime) else value


def fence_api_client(api: client.ApiClient, fence: Fence, timeout: Any = API_TIMEOUT_S) -> None:
    """Every request of this Kubernetes client: a write checks the fence, and a request without
    its own timeout gets `timeout` (the client's default is none: a hung call hangs forever).
    Wrapped at the REST client, which every call of every client version goes through."""
    # urllib3 re-sends inside one call (after a connection error, and PUT or DELETE after a read
    # error), seconds after the check: a write leaves once or not at all. The loops above retry.
    api.configuration.retries = False
    rest_client = rest.RESTClientObject(api.configuration)
    # And again on the connection, as the request's bytes are written: between the first check and
    # the send, a connection is taken from the pool or opened (a TCP and TLS handshake), and a
    # process frozen there (a paused VM, SIGSTOP) sent its write when it resumed, after the lease
    # had passed to another (caught by e2e/test_leader.py).
    manager = rest_client.pool_manager
    if hasattr(manager, "pool_classes_by_scheme"):
        manager.pool_classes_by_scheme = _fenced_pools(fence)
    send = rest_client.request

    def request(method: str, url: str, *args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        fence.check(method, url)
        return send(method, url, *args, _request_timeout=_request_timeout or timeout, **kwargs)

    rest_client.request = request
    api.rest_client = rest_client


def _fenced_pools(fence: Fence) -> dict[str, type]:
    """urllib3 connection pools whose connections check the fence as they send a write."""
    from urllib3.connection import HTTPConnection, HTTPSConnection
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

    def fenced(base: type) -> type:
        class Fenced(base):  # type: ignore[misc, valid-type]
            _sending: tuple[str, str] | None = None

            def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
                fence.check(method, url)
                self._sending = (method, url)
                try:
                    return super().request(method, url, *args, **kwargs)
                finally:
                    self._sending = None

            def send(self, data: Any) -> None:
                # And once more as each piece goes out: between request()'s check and the socket
                # the headers are built (and a new connection opened), and a process frozen there
                # sent its write when it resumed (e2e/test_leader.py, twice: 2 and 3.6 ms after).
                if self._sending is not None:
                    fence.check(*self._sending)
                super().send(data)

        return Fenced

    class Pool(HTTPConnectionPool):
        ConnectionCls = fenced(HTTPConnection)

    class TLSPool(HTTPSConnectionPool):
        ConnectionCls = fenced(HTTPSConnection)

    return {"http": Pool, "https": TLSPool}


def fence_trace(fence: Fence) -> aiohttp.TraceConfig:
    """For an aiohttp session: writes check the fence when they start and again once they have a
    connection, right before the request is sent (waiting for a connection may take a while)."""
    trace = aiohttp.TraceConfig()

    async def started(_: Any, ctx: SimpleNamespace, params: aiohttp.TraceRequestStartParams) -> None:
        ctx.method, ctx.url = params.method, params.url
        fence.check(params.method, params.url)

    async def connected(_: Any, ctx: SimpleNamespace, __: Any) -> None:
        fence.check(ctx.method, ctx.url)

    trace.on_request_start.append(started)
    trace.on_connection_create_end.append(connected)
    trace.on_connection_reuseconn.append(connected)
    return trace
