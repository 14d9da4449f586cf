"""Scale from zero, the router's side: one ask however many requests wait (a single-flight), the
write only at zero, requests held and served once a worker is ready, SSE comments to a waiting
stream. Stand-in workers from test_router_server.py; a stand-in for the API's scale subresource."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
from kubernetes.client.rest import ApiException
from test_router_server import BODY, SSE, ManualSource, StandInWorker, router, run, workers

from kvscale.router.wake import Waker, scale_up_from_zero


def test_one_ask_however_many_wake_and_again_only_after_retry_s():
    async def main():
        clock = [0.0]
        started = asyncio.Event()
        release = asyncio.Event()

        async def scale_up() -> bool:
            started.set()
            await release.wait()
            return True

        waker = Waker(scale_up, retry_s=10.0, clock=lambda: clock[0])
        for _ in range(50):
            waker.wake()
        await started.wait()
        clock[0] = 30.0
        waker.wake()  # still in flight: no second ask
        assert waker.asks == 1
        release.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert waker.writes == 1
        clock[0] = 35.0
        waker.wake()  # the last ask began at 0, 35 s ago: ask again
        await asyncio.sleep(0)
        assert waker.asks == 2
        waker.wake()
        await asyncio.sleep(0)
        assert waker.asks == 2

    run(main())


class StandInScale:
    """A stand-in for the API server's deployments/scale (tests only): a replica count and a
    resourceVersion; an update with an old resourceVersion is a conflict (409)."""

    def __init__(self, replicas: int) -> None:
        self.replicas, self.rv, self.updates = replicas, 1, []

    def read_namespaced_deployment_scale(self, name, namespace, **_):
        return SimpleNamespace(
            spec=SimpleNamespace(replicas=self.replicas),
            metadata=SimpleNamespace(resource_version=str(self.rv)),
        )

    def replace_namespaced_deployment_scale(self, name, namespace, body, **_):
        if body["metadata"]["resourceVersion"] != str(self.rv):
            raise ApiException(status=409, reason="Conflict")
        self.updates.append((name, namespace, body["spec"]["replicas"]))
        self.replicas, self.rv = body["spec"]["replicas"], self.rv + 1


def test_the_ask_writes_only_at_zero_and_loses_a_race_quietly():
    scale = StandInScale(0)
    ask = scale_up_from_zero(scale, "tiny", "ns")
    assert run(ask()) is True and scale.updates == [("tiny", "ns", 1)]
    assert run(ask()) is False and len(scale.updates) == 1  # starting already: not written again
    racing = StandInScale(0)
    read = racing.read_namespaced_deployment_scale

    def read_then_lose(*a, **k):
        seen = read(*a, **k)
        racing.rv += 1  # the autoscaler wrote in between
        return seen

    racing.read_namespaced_deployment_scale = read_then_lose
    assert run(scale_up_from_zero(racing, "tiny", "ns")()) is False and racing.updates == []


def test_twenty_requests_at_zero_ask_once_and_all_get_served_when_a_worker_is_ready():
    async def main():
        scale = StandInScale(0)
        w = StandInWorker()
        source = ManualSource()
        async with workers(w) as urls:

            async def scale_up() -> bool:
                wrote = await scale_up_from_zero(scale, "tiny", "ns")()
                if wrote:  # the Deployment's first pod: ready a little later
                    asyncio.get_running_loop().call_later(0.5, source.publish, urls)
                return wrote

            async with router(source=source) as (r, url), aiohttp.ClientSession() as s:
                r.waker = Waker(scale_up, retry_s=0.2)

                async def one() -> tuple[int, bytes]:
                    body = {**BODY, "stream": False}
                    async with s.post(url + "/v1/completions", json=body) as resp:
                        return resp.status, await resp.read()

                results = await asyncio.gather(*(one() for _ in range(20)))
                assert [status for status, _ in results] == [200] * 20
                assert scale.updates == [("tiny", "ns", 1)]  # exactly one scale-up
                assert r.waker.writes == 1 and len(w.received) == 20

    run(main())


def test_a_waiting_stream_gets_comments_then_the_workers_answer():
    async def main():
        w = StandInWorker()
        source = ManualSource()
        async with workers(w) as urls, router(source=source, heartbeat_s=0.1) as (r, url):
            asks = []

            async def scale_up() -> bool:
                asks.append(1)
                asyncio.get_running_loop().call_later(0.45, source.publish, urls)
                return True

            r.waker = Waker(scale_up, retry_s=60)
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
                got = await resp.read()
            comments = got[: got.index(SSE[0])]
            assert comments and comments == b": waiting for a worker\n\n" * comments.count(b": waiting")
            assert got[len(comments) :] == b"".join(SSE)  # then the worker's answer, unchanged
            assert asks == [1]

    run(main())


def test_a_stream_that_waited_gets_a_worker_error_as_its_last_event():
    async def main():
        w = StandInWorker("503")
        source = ManualSource()
        async with workers(w) as urls, router(source=source, heartbeat_s=0.1, max_retries=0) as (r, url):

            async def scale_up() -> bool:
                asyncio.get_running_loop().call_later(0.25, source.publish, urls)
                return True

            r.waker = Waker(scale_up)
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=BODY) as resp:
                got = await resp.read()
            assert got.startswith(b": waiting for a worker\n\n")
            assert got.endswith(b'data: {"error": {"message": "draining"}}\n\ndata: [DONE]\n\n')

    run(main())


def test_a_request_served_at_once_is_never_started_early_and_nothing_asks():
    async def main():
        w = StandInWorker()
        async with workers(w) as urls, router(urls, heartbeat_s=0.05) as (r, url):
            asks = []

            async def scale_up() -> bool:
                asks.append(1)
                return True

            r.waker = Waker(scale_up)
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=BODY) as resp:
                assert await resp.read() == b"".join(SSE)
            assert asks == []

    run(main())


def test_the_cli_wakes_only_with_scale_deployment(monkeypatch):
    from kvscale.router import main

    scale = StandInScale(0)
    monkeypatch.setattr(main, "_apps_api", lambda: scale)
    args = main.build_parser().parse_args(
        [
            "--endpoints",
            "http://127.0.0.1:1",
            "--namespace",
            "ns",
            "--scale-deployment",
            "tiny",
            "--heartbeat",
            "2",
        ]
    )
    r = main.build_router(args)
    assert r.config.heartbeat_s == 2.0 and r.waker is not None
    assert run(r.waker._scale_up()) is True and scale.updates == [("tiny", "ns", 1)]
    plain = main.build_router(main.build_parser().parse_args(["--endpoints", "http://127.0.0.1:1"]))
    assert plain.waker is None and plain.config.heartbeat_s == 5.0
