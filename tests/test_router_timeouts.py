"""Every call of the router is bounded (issue 27): the EndpointSlice watch against an API server
whose connection goes half-open (accepted, then silent), the staleness /ready reports, and a
worker that takes a request and never answers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import parse_qs, urlparse

import aiohttp
import pytest
from aiohttp import web
from kubernetes import client

from kvscale.router.endpoints import SliceWatcher
from tests.test_router_server import BODY, router, serving


def _slice(name: str, address: str) -> dict:
    return {
        "metadata": {"name": name, "resourceVersion": "1"},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
    }


class HalfOpenAPI(BaseHTTPRequestHandler):
    """The EndpointSlice list and watch of an API server whose watches go half-open: a watch gets
    its 200 and headers, then not one byte more, and the connection stays open. Each list answers
    with `states[min(lists, len - 1)]`: a worker is added while the watch is silent."""

    states: ClassVar[list[list[dict]]] = []
    lists: ClassVar[list[float]] = []
    watches: ClassVar[list[dict]] = []
    release: ClassVar[threading.Event] = threading.Event()
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        query = parse_qs(urlparse(self.path).query)
        if query.get("watch") == ["true"]:
            type(self).watches.append({"at": time.monotonic(), **{k: v[0] for k, v in query.items()}})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            type(self).release.wait(60)  # silent: no event, no bookmark, no FIN
            self.close_connection = True
            return
        n = len(type(self).lists)
        type(self).lists.append(time.monotonic())
        items = type(self).states[min(n, len(type(self).states) - 1)]
        body = json.dumps({"items": items, "metadata": {"resourceVersion": str(10 + n)}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def half_open_api():
    HalfOpenAPI.lists, HalfOpenAPI.watches = [], []
    HalfOpenAPI.release = threading.Event()
    HalfOpenAPI.states = [[_slice("a", "10.0.0.1")], [_slice("a", "10.0.0.1"), _slice("b", "10.0.0.2")]]
    server = ThreadingHTTPServer(("127.0.0.1", 0), HalfOpenAPI)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield client.DiscoveryV1Api(
        client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}"))
    )
    HalfOpenAPI.release.set()
    server.shutdown()
    server.server_close()


def test_a_half_open_watch_is_given_up_within_its_read_timeout_and_the_router_lists_again(half_open_api):
    """Before: the watch had no client read timeout, so the silent connection froze the endpoint
    list for good and the new worker never got traffic."""
    read_timeout_s = 1.0
    watcher = SliceWatcher(
        "tiny", "default", api=half_open_api, watch_timeout_s=1, read_timeout_s=read_timeout_s
    )
    published: list[tuple[float, list[str]]] = []

    async def main() -> None:
        watcher.start(lambda urls: published.append((time.monotonic(), urls)))
        deadline = time.monotonic() + 8
        while not any(len(urls) == 2 for _, urls in published) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        watcher.stop()

    asyncio.run(main())
    one, two = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    assert [urls for _, urls in published][:2] == [[one], [one, two]]
    first_watch = HalfOpenAPI.watches[0]
    assert first_watch["timeoutSeconds"] == "1" and first_watch["resourceVersion"] == "10"
    # noticed within the read timeout (+ the first backoff, 0.5 s, and scheduling)
    assert HalfOpenAPI.lists[1] - first_watch["at"] < read_timeout_s + 0.5 + 1.0


def test_ready_reports_an_endpoint_list_past_its_bound_as_stale(half_open_api):
    """The list went quiet (a watch that hangs within its read timeout, on a clock the test moves):
    /ready keeps 200, says `stale` with the list's age, and the age is a metric."""
    now = [100.0]
    watcher = SliceWatcher(
        "tiny", "default", api=half_open_api, watch_timeout_s=30, read_timeout_s=30, clock=lambda: now[0]
    )

    async def main() -> tuple[dict, dict, str]:
        async with router(source=watcher) as (_, url), aiohttp.ClientSession() as s:
            while not watcher.synced:
                await asyncio.sleep(0.02)
            async with s.get(url + "/ready") as r:
                fresh = await r.json()
            now[0] += watcher.stale_after_s + 1
            async with s.get(url + "/ready") as r:
                assert r.status == 200
                stale = await r.json()
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
        return fresh, stale, metrics

    fresh, stale, metrics = asyncio.run(main())
    assert fresh == {"status": "ready", "endpoints": 1, "endpoints_age_s": 0.0}
    assert stale["status"] == "stale" and stale["endpoints_age_s"] > watcher.stale_after_s
    assert f"kvscale_router_endpoints_age_seconds {watcher.stale_after_s + 1}" in metrics
    assert watcher.stale_after_s == 30 + 5.0 + 10.0  # read timeout + connect timeout + longest backoff


def test_a_worker_that_takes_the_request_and_never_answers_gets_a_504_at_the_read_timeout():
    """Before: no upstream read timeout, so the request (and its client) hung for as long as the
    worker held the connection. The silent worker is not retried elsewhere: it may still run it."""
    got: list[str] = []
    release = asyncio.Event()

    async def silent(request: web.Request) -> web.Response:
        got.append(request.path)
        await release.wait()
        return web.json_response({})

    async def no_metrics(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def main() -> tuple[int, dict, float]:
        app = web.Application()
        app.router.add_post("/v1/completions", silent)
        app.router.add_get("/metrics", no_metrics)
        async with serving(app) as w1, serving(app) as w2, router([w1, w2], read_timeout_s=0.5) as (_, url):
            async with aiohttp.ClientSession() as s:
                started = time.monotonic()
                body = {**BODY, "stream": False}
                async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(10)) as r:
                    took = time.monotonic() - started
                    status, answer = r.status, await r.json()
            release.set()
        return status, answer, took

    status, answer, took = asyncio.run(main())
    assert status == 504 and answer["error"]["code"] == "upstream_timeout"
    assert 0.5 <= took < 3 and got == ["/v1/completions"]
