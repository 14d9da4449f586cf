"""Every server we ship listens on IPv4 and IPv6 by default (issue 27: IPv6 and dual-stack
clusters): a pod on an IPv6 or IPv6-first dual-stack cluster is probed and reached on its IPv6
address, which a "0.0.0.0" default would refuse. Checked live on 127.0.0.1 and ::1."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest

from kvscale.operator import main as operator_main
from kvscale.operator.health import Health, serve
from kvscale.router import main as router_main
from kvscale.worker import cli as worker_cli
from kvscale.worker.server.api_server import ServerConfig

pytestmark = pytest.mark.skipif(not socket.has_ipv6, reason="this Python has no IPv6")


def _free_port() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", 0))
        return s.getsockname()[1]


def _get(host: str, port: int, path: str) -> int:
    with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as r:
        return r.status


def test_the_defaults_are_every_interface(monkeypatch):
    monkeypatch.delenv("KVSCALE_HOST", raising=False)
    assert ServerConfig().host is None
    serve_args = worker_cli.build_parser().parse_args(["serve"])
    assert serve_args.host is None
    assert router_main.build_parser().parse_args(["--endpoints", "http://x:1"]).host is None
    assert operator_main.build_parser().parse_args(["run"]).health_host is None


def test_the_operator_health_server_answers_on_both_families():
    server = serve(Health(30.0), None, 0)
    try:
        for host in ("127.0.0.1", "[::1]"):
            with pytest.raises(urllib.error.HTTPError) as e:  # not ready yet: 503, but answered
                _get(host, server.server_port, "/readyz")
            assert e.value.code == 503
    finally:
        server.shutdown()


def test_the_router_answers_on_both_families():
    port = _free_port()
    args = router_main.build_parser().parse_args(["--endpoints", "http://127.0.0.1:9", "--port", str(port)])

    async def run() -> list[int]:
        task = asyncio.create_task(router_main.serve(args))
        try:
            for _ in range(100):
                try:
                    await asyncio.to_thread(_get, "127.0.0.1", port, "/health")
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            return [await asyncio.to_thread(_get, h, port, "/health") for h in ("127.0.0.1", "[::1]")]
        finally:
            task.cancel()

    assert asyncio.run(run()) == [200, 200]
