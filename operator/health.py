"""The operator's health endpoints: /healthz (liveness), /readyz (readiness), /metrics.

They are served from a thread, so that a blocked event loop cannot keep them from answering, and
so they must not answer "fine" from that thread alone: the process says it is alive by a
heartbeat. A standby beats in its wait for the Lease (main.cmd_run), the leader in a task on the
asyncio loop that runs kopf (`heartbeat`); /healthz fails when no beat came for `stall_s`, or
once kopf's main task has ended. The kubelet then restarts the container: a loop blocked by a
synchronous call, or a kopf that stopped without the process exiting, never recovers by itself.

/readyz answers 200 on the leader ("leading") and on a standby ("standby"): a standby is ready
to do its job, which is to wait, and a not-ready standby would stall every rollout of the
operator's Deployment (maxUnavailable 0 waits for the new pod to be Ready, and a new pod is a
standby until the old leader hands the Lease over). 503 only while starting (before the first
read of the Lease) and once stopping. Who leads: the body, and the kvscale_operator_leader gauge.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvscale.operator import metrics

Clock = Callable[[], float]
BEAT_EVERY_S = 1.0
DEFAULT_STALL_S = 30.0


class Health:
    """What the endpoints report. Written by the operator (any thread), read by the server's
    threads: single attribute writes, which the GIL keeps whole."""

    def __init__(self, stall_s: float = DEFAULT_STALL_S, clock: Clock = time.monotonic) -> None:
        self.stall_s, self.clock = stall_s, clock
        self.beat_at: float | None = None
        self.role = "starting"  # starting | standby | leading | stopping
        self.ended: str | None = None  # why the operator's main task ended (then not live)
        self.may_act: Callable[[], bool] = lambda: True  # the leader's fence (main._lead)
        metrics.LEADER.set_function(lambda: 1.0 if self.leading() else 0.0)

    def beat(self) -> None:
        self.beat_at = self.clock()

    def set_role(self, role: str) -> None:
        self.role = role

    def leading(self) -> bool:
        """The leader, and within its renew deadline: the gauge drops at the deadline, before
        the renewal loop has noticed."""
        return self.role == "leading" and self.may_act()

    def live(self) -> tuple[bool, str]:
        if self.ended is not None:
            return False, self.ended
        if self.beat_at is None:
            return True, "starting"
        stalled = self.clock() - self.beat_at
        if stalled > self.stall_s:
            return (
                False,
                f"the operator's loop has not ticked for {stalled:.0f} s (limit {self.stall_s:.0f} s)",
            )
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        ok, why = self.live()
        if not ok:
            return False, why
        return self.role in ("standby", "leading"), self.role


async def heartbeat(health: Health, every_s: float = BEAT_EVERY_S) -> None:
    """A beat per `every_s` while the loop runs; a loop blocked or gone beats no more."""
    while True:
        health.beat()
        await asyncio.sleep(every_s)


def watch_task(health: Health, task: asyncio.Task, what: str) -> None:
    """Not live once `task` (kopf's main task) has ended, whatever the loop still does."""

    def ended(t: asyncio.Task) -> None:
        health.ended = f"{what} ended" + (
            "" if t.cancelled() or t.exception() is None else f": {t.exception()}"
        )

    task.add_done_callback(ended)


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class _DualStackServer(_IPv6Server):
    """One IPv6 socket that takes IPv4 too (IPV6_V6ONLY off), as http.server's own test server."""

    def server_bind(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _listen(host: str | None, port: int, handler) -> ThreadingHTTPServer:
    """None: every interface of both families (IPv4 only where the kernel has no IPv6)."""
    if host is None:
        try:
            return _DualStackServer(("::", port), handler)
        except OSError:
            return ThreadingHTTPServer(("0.0.0.0", port), handler)
    return (_IPv6Server if ":" in host else ThreadingHTTPServer)((host, port), handler)


def serve(health: Health, host: str | None, port: int) -> ThreadingHTTPServer:
    """Serve the endpoints from a daemon thread; returns the server (its port: server_port)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._answer(200, metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")
                return
            check = {"/healthz": health.live, "/readyz": health.ready}.get(path)
            if check is None:
                self._answer(404, b"not found")
                return
            ok, why = check()
            self._answer(200 if ok else (500 if path == "/healthz" else 503), why.encode())

        def _answer(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = _listen(host, port, Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="health").start()
    return server
