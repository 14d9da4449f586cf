"""The autoscaler on a shared cluster (issue 27): a pod's /metrics is read capped, streamed and
with a deadline, only pods the operator's own workload created are read, IPv6 pod IPs work."""

from __future__ import annotations

import asyncio
import socket
import time
import zlib

import psutil
import pytest
from aiohttp import web

from kvscale.operator.autoscaler import scaler, scrape
from kvscale.operator.kube.pods import Ownership, url_of
from tests.test_autoscaler_io import OWNERS, ctrl, pod, rs_ref, tick  # noqa: F401 (the fixture)

EXPOSITION = (
    "# TYPE kvscale_kv_cache_usage_ratio gauge\nkvscale_kv_cache_usage_ratio 0.25\n"
    "# TYPE kvscale_requests_waiting gauge\nkvscale_requests_waiting 3\n"
)
CHUNK = b"x" * (64 << 10)
SAFETY_BYTES = 128 << 20  # the endless body stops here, so a regression cannot exhaust the machine


async def _serve(host: str, handler) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def _scrape_from(host: str, handler, **kwargs):
    runner, port = await _serve(host, handler)
    try:
        async with scrape.new_session() as session:
            started = time.monotonic()
            result = await scrape.scrape(session, host, port=port, **kwargs)
            return result, time.monotonic() - started
    finally:
        await runner.cleanup()


def test_an_endless_metrics_body_is_unreadable_fast_and_costs_no_memory():
    sent = [0]

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()  # no Content-Length: chunked, never ending
        await response.prepare(request)
        while sent[0] < SAFETY_BYTES:
            await response.write(CHUNK)
            sent[0] += len(CHUNK)
        return response

    process = psutil.Process()
    rss = process.memory_info().rss
    result, took = asyncio.run(_scrape_from("127.0.0.1", endless))
    grown = process.memory_info().rss - rss
    assert result is None  # unreadable, not parsed
    assert took < scrape.SCRAPE_TIMEOUT_S  # abandoned at the cap, not at the deadline
    assert sent[0] < SAFETY_BYTES  # the client hung up
    assert grown < 8 << 20, f"RSS grew {grown} bytes"


def test_a_declared_huge_body_is_refused_before_reading_it():
    async def huge(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Length": str(1 << 30)})
        await response.prepare(request)
        for _ in range(64):
            await response.write(CHUNK)
        return response

    result, took = asyncio.run(_scrape_from("127.0.0.1", huge))
    assert result is None and took < scrape.SCRAPE_TIMEOUT_S


def test_a_gzip_bomb_is_not_inflated():
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip; 64 MiB of zeros, ~64 KiB on the wire
    zeros = bytes(1 << 20)
    bomb = b"".join(packer.compress(zeros) for _ in range(64)) + packer.flush()

    async def gzipped(request: web.Request) -> web.Response:
        return web.Response(body=bomb, headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})

    process = psutil.Process()
    rss = process.memory_info().rss
    result, _ = asyncio.run(_scrape_from("127.0.0.1", gzipped))
    assert not result  # raw gzip bytes are no exposition
    assert process.memory_info().rss - rss < 32 << 20


def test_a_body_that_never_ends_slowly_is_cut_at_the_deadline():
    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(100):
            await response.write(b"# x\n")
            await asyncio.sleep(0.1)
        return response

    result, took = asyncio.run(_scrape_from("127.0.0.1", trickle, timeout_s=0.5))
    assert result is None and took < 1.5


def test_a_real_exposition_is_read():
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text=EXPOSITION)

    result, _ = asyncio.run(_scrape_from("127.0.0.1", ok))
    assert result == {"kv_usage": 0.25, "waiting": 3.0}


# --- IPv6 ----------------------------------------------------------------------------------------


def test_pod_urls_bracket_ipv6():
    assert url_of("10.1.2.3", 8000, "/metrics") == "http://10.1.2.3:8000/metrics"
    assert url_of("fd00::1", 8000, "/metrics") == "http://[fd00::1]:8000/metrics"
    assert url_of("2001:db8::a:b", 9000) == "http://[2001:db8::a:b]:9000"
    assert url_of("::ffff:10.0.0.1", 1) == "http://[::ffff:10.0.0.1]:1"


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_a_worker_on_an_ipv6_address_is_scraped():
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text=EXPOSITION)

    result, _ = asyncio.run(_scrape_from("::1", ok))
    assert result == {"kv_usage": 0.25, "waiting": 3.0}


# --- only the operator's own pods ------------------------------------------------------------------


def _scraped_ips(tick, monkeypatch) -> list[str]:  # noqa: F811
    asked: list[str] = []

    async def fake_scrape(session, ip, parse=scrape.parse_metrics, **_):
        asked.append(ip)
        return {"kv_usage": 0.5, "waiting": 0.0, "running": 1.0, "arrivals": 10.0}

    monkeypatch.setattr(scaler, "scrape", fake_scrape)
    decision = tick.run()
    assert decision is not None
    return asked


def test_a_pod_labelled_as_a_worker_without_our_owner_chain_is_never_scraped(tick, monkeypatch):  # noqa: F811
    # A tenant's pods with our labels: no owner at all; a forged reference to our ReplicaSet's
    # name under another uid; a real ReplicaSet of a Deployment the tenant made and pointed at
    # the InferenceDeployment.
    OWNERS[("ReplicaSet", "ns", "evil-rs")] = {
        "uid": "rs-evil",
        "ownerReferences": [ctrl("Deployment", "evil", "dep-evil")],
    }
    OWNERS[("Deployment", "ns", "evil")] = {
        "uid": "dep-evil",
        "ownerReferences": [ctrl("InferenceDeployment", "tiny", "uid-1")],
    }
    try:
        evil = rs_ref("tiny", uid="forged")
        tenant = rs_ref("tiny", uid="rs-evil")
        tenant[0].name = "evil-rs"
        tick.cache.apply("ADDED", pod("tiny-x", refs=[], ip="10.9.9.1"))
        tick.cache.apply("ADDED", pod("tiny-y", refs=evil, ip="10.9.9.2"))
        tick.cache.apply("ADDED", pod("tiny-z", refs=tenant, ip="10.9.9.3"))
        asked = _scraped_ips(tick, monkeypatch)
    finally:
        OWNERS.pop(("ReplicaSet", "ns", "evil-rs"))
        OWNERS.pop(("Deployment", "ns", "evil"))
    assert len(asked) == 2 and not any(ip.startswith("10.9.9.") for ip in asked)
    assert tick.target.scaler.history[-1].pods[0].name == "tiny-1"
    assert [p.name for p in tick.target.scaler.history[-1].pods] == ["tiny-1", "tiny-2"]
    assert len(tick.target.ignored) == 3


def test_the_owner_chain_is_read_once_per_link():
    reads: list[tuple] = []

    def read(kind, ns, name):
        reads.append((kind, name))
        return OWNERS.get((kind, ns, name))

    owners = Ownership(read)
    pods = [pod(f"tiny-{i}") for i in range(5)]
    assert all(owners.owned(p, "uid-1", "tiny") for p in pods)
    assert not owners.owned(pods[0], "another-uid", "tiny")  # another resource's pods are not these
    assert not owners.owned(pods[0], "uid-1", "tiny-router")
    assert sorted(set(reads)) == [("Deployment", "tiny"), ("ReplicaSet", "tiny-abc")] and len(reads) == 2
