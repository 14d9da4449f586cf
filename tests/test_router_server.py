"""The router's HTTP side against stand-ins for workers: small aiohttp apps in this file that play
a worker's part of the protocol (an SSE stream, a 503, a dropped connection, a /metrics page in the
worker's own names). Real workers behind the router run in the benchmark
(`python -m kvscale.worker.bench route`)."""

from __future__ import annotations

import asyncio
import json
import socket
from contextlib import asynccontextmanager, suppress

import aiohttp
from aiohttp import web

from kvscale.router.endpoints import StaticEndpoints
from kvscale.router.picker import PickerConfig
from kvscale.router.server import Router, RouterConfig, build_app
from kvscale.router.state import RouterState
from kvscale.worker.metrics.prometheus import EngineMetrics
from kvscale.worker.metrics.stats import IterationStats, SchedulerStats

SSE = [
    b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"def"}]}\n\n',
    b": a comment line, which a client must get too\n\n",
    b'data: {"id":"cmpl-1","choices":[{"index":0,"text":" f(\\u00e9)"}]}\n',  # a chunk ending mid-event
    b'\ndata: {"id":"cmpl-1","choices":[{"index":0,"text":":","finish_reason":"length"}]}\n\n',
    b"data: [DONE]\n\n",
]
BODY = {"model": "tiny", "prompt": "def fibonacci(n):\n    " * 8, "max_tokens": 3, "stream": True}


def run(coro):
    return asyncio.run(coro)


class StandInWorker:
    """A stand-in for a kvscale worker (tests only): `behavior` is ok (streams SSE), 503 (refuses
    before any body byte, as a draining worker does), or partial (one chunk, then the connection
    drops). /metrics renders a real EngineMetrics with the given waiting count and KV usage, and
    LoRA slots: `max_lora` of them, `adapters` in them, `running_adapters` with requests."""

    def __init__(
        self,
        behavior: str = "ok",
        waiting: int = 0,
        kv: float = 0.0,
        max_lora: int = 0,
        adapters: tuple[str, ...] = (),
        running_adapters: tuple[str, ...] = (),
    ) -> None:
        self.behavior, self.waiting, self.kv = behavior, waiting, kv
        self.max_lora, self.adapters, self.running_adapters = max_lora, adapters, running_adapters
        self.received: list[bytes] = []
        self.gate: asyncio.Event | None = None  # when set: the last chunk waits for it
        self.cancelled = 0
        self.url = ""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.read())
        if self.behavior == "hold":  # no answer until the gate opens; notes it if its client left
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if self.behavior == "503":
            return web.json_response(
                {"error": {"message": "draining"}}, status=503, headers={"Retry-After": "5"}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if self.behavior == "partial":
            await resp.write(SSE[0])
            await asyncio.sleep(0.05)
            request.transport.close()
            return resp
        for i, chunk in enumerate(SSE):
            if i == len(SSE) - 1 and self.gate is not None:
                await self.gate.wait()
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def metrics(self, request: web.Request) -> web.Response:
        m = EngineMetrics("tiny")
        m.cache_config(block_size=16, num_blocks=512, enable_prefix_caching=True, max_lora=self.max_lora)
        sched = SchedulerStats(
            0, self.waiting, self.kv, 0, 0, 0, running_lora_adapters=list(self.running_adapters)
        )
        m.record(IterationStats(lora_resident=list(self.adapters)), sched, num_blocks=512)
        return web.Response(body=m.render(), content_type="text/plain")

    def models_received(self) -> list[str]:
        return [json.loads(body)["model"] for body in self.received]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        return app


@asynccontextmanager
async def serving(app: web.Application):
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def workers(*stand_ins: StandInWorker):
    urls = []
    ctxs = [serving(w.app()) for w in stand_ins]
    try:
        for w, c in zip(stand_ins, ctxs, strict=True):
            w.url = await c.__aenter__()
            urls.append(w.url)
        yield urls
    finally:
        for c in ctxs:
            await c.__aexit__(None, None, None)


class ManualSource:
    """Endpoint source the test drives (the router's interface: synced, start, stop)."""

    def __init__(self, synced: bool = True) -> None:
        self.synced = synced

    def start(self, publish) -> None:
        self.publish = publish
        publish([])

    def stop(self) -> None:
        pass


@asynccontextmanager
async def router(endpoints=None, source=None, picker: PickerConfig | None = None, **config):
    config.setdefault("scrape_interval_s", 0.05)
    r = Router(RouterState(picker), source or StaticEndpoints(endpoints or []), RouterConfig(**config))
    async with serving(build_app(r)) as url:
        yield r, url


async def until(condition, what: str, timeout: float = 5.0):
    """Poll `condition` (a callable, or a coroutine function) until it returns something true, and
    return that: what a fixed sleep would only hope for (a scrape every 50 ms, a queued request)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        assert loop.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.01)


def scraped(r: Router, *urls: str, **expected) -> bool:
    """Whether the router has scraped each of `urls`, with the field values `expected`."""
    return all(
        (m := r.state.metrics.get(u)) is not None and all(getattr(m, k) == v for k, v in expected.items())
        for u in urls
    )


def refused_url() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# -- streaming ------------------------------------------------------------------------------------
def test_sse_passes_through_byte_for_byte_and_chunk_by_chunk():
    async def main():
        w = StandInWorker()
        w.gate = asyncio.Event()
        async with workers(w) as urls, router(urls) as (_, url), aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"] == "text/event-stream"
                got = b""
                while len(got) < sum(map(len, SSE[:-1])):  # all but the gated last chunk arrive first
                    got += await asyncio.wait_for(resp.content.readany(), 5)
                assert not w.gate.is_set()
                w.gate.set()
                got += await resp.read()
            assert got == b"".join(SSE)
            assert json.loads(w.received[0]) == BODY  # the body went through unchanged

    run(main())


def test_a_non_streaming_answer_and_a_worker_4xx_pass_through():
    async def bad(request):
        return web.json_response({"error": {"message": "max_tokens: bad", "param": "max_tokens"}}, status=400)

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", bad)
        async with (
            serving(app) as wurl,
            router([wurl]) as (_, url),
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/completions", json={**BODY, "max_tokens": -1}) as resp,
        ):
            assert resp.status == 400  # a worker's refusal is the client's answer: never retried
            assert (await resp.json())["error"]["param"] == "max_tokens"

    run(main())


# -- retries --------------------------------------------------------------------------------------
def test_retry_before_the_first_byte_on_a_refused_connection_and_on_503():
    async def main():
        busy_good = StandInWorker(waiting=6)  # its load makes the router try the bad one first
        draining = StandInWorker("503")
        async with (
            workers(busy_good, draining) as urls,
            router([urls[0], urls[1], refused_url()]) as (r, url),
        ):
            await until(lambda: scraped(r, urls[0], waiting=6) and scraped(r, urls[1]), "the scrapes")
            async with aiohttp.ClientSession() as s:
                for _ in range(4):
                    async with s.post(url + "/v1/completions", json=BODY) as resp:
                        assert resp.status == 200
                        assert await resp.read() == b"".join(SSE)
            assert len(busy_good.received) == 4
            assert len(draining.received) >= 1
            async with aiohttp.ClientSession() as s:
                page = await (await s.get(url + "/metrics")).text()
            assert 'kvscale_router_retries_total{reason="503"}' in page
            assert 'kvscale_router_retries_total{reason="connect"}' in page
            assert sum(r.state.in_flight.values()) == 0

    run(main())


def test_every_endpoint_refusing_gives_the_last_answer_and_a_dead_set_503():
    async def main():
        a, b = StandInWorker("503"), StandInWorker("503")
        async with workers(a, b) as urls, router(urls) as (_, url), aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "5"
            assert len(a.received) == len(b.received) == 1  # each tried once, no more
        async with (
            router([refused_url(), refused_url()]) as (_, url),
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/completions", json=BODY) as resp,
        ):
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "no_endpoint"
            assert "Retry-After" in resp.headers

    run(main())


def test_no_retry_after_the_first_byte():
    async def main():
        dropping = StandInWorker("partial")
        good = StandInWorker(waiting=6)
        async with workers(dropping, good) as urls, router(urls) as (r, url):
            await until(lambda: scraped(r, urls[0]) and scraped(r, urls[1], waiting=6), "the scrapes")
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
                got = b""
                try:
                    async for chunk in resp.content.iter_any():
                        got += chunk
                except aiohttp.ClientPayloadError:
                    pass  # the answer ends abruptly, as the worker's did
            assert got == SSE[0]
            assert len(dropping.received) == 1 and good.received == []
            assert sum(r.state.in_flight.values()) == 0

    run(main())


def test_a_client_that_leaves_mid_request_frees_its_slot_and_the_worker_sees_it_go():
    async def main():
        held, streaming = StandInWorker("hold"), StandInWorker()
        held.gate, streaming.gate = asyncio.Event(), asyncio.Event()
        for w in (held, streaming):
            async with workers(w) as urls, router(urls) as (r, url):
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
                    with suppress(TimeoutError):  # before any byte (held) or mid-stream (streaming)
                        async with s.post(url + "/v1/completions", json=BODY) as resp:
                            await resp.read()
                for _ in range(100):
                    if not r.state.in_flight and (w is streaming or held.cancelled):
                        break
                    await asyncio.sleep(0.02)
                assert r.state.in_flight == {}
                page = await _get(url)
                assert 'kvscale_router_in_flight_requests{model="tiny"} 0.0' in page
        assert held.cancelled == 1

    run(main())


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


# -- flow control ----------------------------------------------------------------------------------
def test_the_queue_holds_a_request_until_an_endpoint_becomes_ready():
    async def main():
        w = StandInWorker()
        source = ManualSource()
        async with workers(w) as urls, router(source=source) as (r, url), aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(url + "/v1/completions", json=BODY))
            await until(lambda: len(r.flow) == 1, "the request to be queued")
            assert not task.done()
            page = await (await s.get(url + "/metrics")).text()
            assert 'kvscale_router_queued_requests{model="tiny"} 1.0' in page
            source.publish(urls)  # the first worker is ready
            resp = await asyncio.wait_for(task, 5)
            assert resp.status == 200 and await resp.read() == b"".join(SSE)
            assert len(r.flow) == 0

    run(main())


def test_an_endpoint_at_its_limit_holds_requests_until_its_queue_drains():
    async def main():
        w = StandInWorker(waiting=4)
        async with workers(w) as urls, router(urls, picker=PickerConfig(max_waiting=4)) as (r, url):
            await until(lambda: scraped(r, urls[0], waiting=4), "the scrape of the full worker")
            async with aiohttp.ClientSession() as s:
                task = asyncio.create_task(s.post(url + "/v1/completions", json=BODY))
                await until(lambda: len(r.flow) == 1, "the request to be queued")
                assert w.received == []
                w.waiting = 0  # the next scrape sees room
                resp = await asyncio.wait_for(task, 5)
                assert resp.status == 200

    run(main())


def test_a_full_queue_answers_429_with_retry_after_and_a_timeout_503():
    async def main():
        async with router(source=ManualSource(), max_queued=1, queue_timeout_s=1.0) as (r, url):
            async with aiohttp.ClientSession() as s:
                first = asyncio.create_task(s.post(url + "/v1/completions", json=BODY))
                await until(lambda: len(r.flow) == 1, "the first request to be queued")
                async with s.post(url + "/v1/completions", json=BODY) as resp:
                    assert resp.status == 429
                    assert resp.headers["Retry-After"] == "1"
                    err = (await resp.json())["error"]
                    assert err["code"] == "queue_full" and err["type"] == "rate_limit_exceeded"
                resp = await first
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "queue_timeout"
            assert len(r.flow) == 0

    run(main())


def test_a_client_that_disconnects_leaves_the_queue():
    async def main():
        w = StandInWorker()
        source = ManualSource()
        async with workers(w) as urls, router(source=source) as (r, url):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
                with suppress(TimeoutError):
                    await s.post(url + "/v1/completions", json=BODY)
            for _ in range(50):
                if len(r.flow) == 0:
                    break
                await asyncio.sleep(0.02)
            assert len(r.flow) == 0
            source.publish(urls)
            # A request after it is served: had the one that left still been queued, it would
            # have gone first (the queue is FIFO per model).
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200 and await resp.read() == b"".join(SSE)
            assert len(w.received) == 1 and sum(r.state.in_flight.values()) == 0  # nothing was sent for it

    run(main())


def test_fair_per_model_dispatch_alternates_models():
    async def main():
        from kvscale.router.queue import FlowControl

        free = [0]
        order = []
        flow = FlowControl(lambda h: "e" if free[0] > 0 else None, lambda e: None)

        async def one(model, i):
            await flow.acquire(model, [i])
            order.append(model)

        tasks = [asyncio.create_task(one("a", i)) for i in range(4)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(one("b", i)) for i in range(2)]
        await asyncio.sleep(0)
        free[0] = 1
        flow.dispatch()
        await asyncio.gather(*tasks)
        assert order == ["a", "b", "a", "b", "a", "a"]

    run(main())


# -- bad input ------------------------------------------------------------------------------------
def test_bad_bodies_get_4xx_in_openai_shape_and_do_not_stall_others():
    async def main():
        w = StandInWorker()
        async with workers(w) as urls, router(urls) as (_, url), aiohttp.ClientSession() as s:
            for data, status, param in (
                (b"{not json", 400, None),
                (b"[1, 2]", 400, None),
                (json.dumps({"prompt": "x"}).encode(), 400, "model"),
                (json.dumps({"model": 7, "prompt": "x"}).encode(), 400, "model"),
            ):
                async with s.post(
                    url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
                ) as r:
                    assert r.status == status, data
                    err = (await r.json())["error"]
                    assert err["type"] == "invalid_request_error" and err["param"] == param
            async with s.post(url + "/v1/completions", data=b"x" * 15_000_000) as r:
                assert r.status == 413
                assert (await r.json())["error"]["code"] == "request_too_large"

            async def slow_huge():  # 15 MB, chunked (no Content-Length), 1 MB at a time
                for _ in range(15):
                    yield b'{"model": "tiny", "prompt": "' if _ == 0 else b"a" * 1_000_000
                    await asyncio.sleep(0.05)

            huge = asyncio.create_task(s.post(url + "/v1/completions", data=slow_huge()))
            await asyncio.sleep(0.1)
            async with s.post(url + "/v1/completions", json=BODY) as r:
                assert r.status == 200 and await r.read() == b"".join(SSE)
            assert not huge.done()  # the good request finished while the huge one was still arriving
            try:
                r = await huge
                assert r.status == 413
            except aiohttp.ClientError:
                pass  # the router may close the connection on an upload it refused halfway
            assert len(w.received) == 1

    run(main())


# -- LoRA adapter affinity -------------------------------------------------------------------------
def test_adapter_requests_go_where_the_adapter_is_and_spread_past_the_load_bound():
    """Three stand-ins serving base model "tiny" with two LoRA slots each: `holder` has adapter sql
    in one, `room` a free one (and a fuller KV cache), `full` both slots busy with other adapters'
    requests. One at a time, sql's requests all go to the holder; seven at once (held open), the
    holder takes up to the load bound and the spill goes to the empty slot before `full`. The
    router's /metrics counts each pick by what the endpoint had."""

    async def main():
        holder = StandInWorker(max_lora=2, adapters=("sql",))
        room = StandInWorker(max_lora=2, kv=0.5)
        full = StandInWorker(max_lora=2, adapters=("a", "b"), running_adapters=("a", "b"))
        stand_ins = (holder, room, full)
        sql = {**BODY, "model": "sql"}
        async with workers(*stand_ins) as urls, router(urls) as (r, url), aiohttp.ClientSession() as s:
            await until(
                lambda: (
                    scraped(r, *urls, served_model="tiny", max_lora=2)
                    and scraped(r, holder.url, adapters={"sql"})
                ),
                "the scrape of the adapters",
            )
            for body in (sql, sql, sql, BODY):  # and one for the base model: no adapter pick
                async with s.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
            assert [w.models_received().count("sql") for w in stand_ins] == [3, 0, 0]

            for w in stand_ins:
                w.behavior, w.gate = "hold", asyncio.Event()
            tasks = [asyncio.create_task(s.post(url + "/v1/completions", json=sql)) for _ in range(7)]
            await until(
                lambda: sum(w.models_received().count("sql") for w in stand_ins) == 10,
                "the seven requests to reach the stand-ins",
            )
            assert [w.models_received().count("sql") for w in stand_ins] == [3 + 3, 3, 1]
            for w in stand_ins:
                w.gate.set()
            for task in tasks:
                resp = await task
                assert resp.status == 200 and await resp.read() == b"".join(SSE)

            page = await _get(url)
            assert 'kvscale_router_adapter_picks_total{affinity="resident",model="sql"} 6.0' in page
            assert 'kvscale_router_adapter_picks_total{affinity="empty",model="sql"} 3.0' in page
            assert 'kvscale_router_adapter_picks_total{affinity="none",model="sql"} 1.0' in page
            picks = [line for line in page.splitlines() if line.startswith("kvscale_router_adapter_picks")]
            assert not [line for line in picks if 'model="tiny"' in line]  # the base model's: none

    run(main())


# -- the rest of the surface ----------------------------------------------------------------------------
def test_models_health_ready_and_metrics():
    async def main():
        w = StandInWorker()
        source = ManualSource(synced=False)
        async with workers(w) as urls, router(source=source) as (_, url), aiohttp.ClientSession() as s:
            assert (await s.get(url + "/health")).status == 200
            assert (await s.get(url + "/ready")).status == 503
            assert (await s.get(url + "/v1/models")).status == 503
            source.synced = True
            source.publish(urls)
            assert (await s.get(url + "/ready")).status == 200
            models = await (await s.get(url + "/v1/models")).json()
            assert models["data"][0]["id"] == "tiny"
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 50}], "stream": True}
            async with s.post(url + "/v1/chat/completions", json=chat) as resp:
                assert resp.status == 200 and await resp.read() == b"".join(SSE)

            async def counted() -> str | None:  # counted when the stream has ended at the router
                page = await (await s.get(url + "/metrics")).text()
                return page if 'kvscale_router_responses_total{code="200",model="tiny"} 1.0' in page else None

            page = await until(counted, "the response to be counted")
            assert 'kvscale_router_requests_total{model="tiny"} 1.0' in page
            assert 'kvscale_router_responses_total{code="200",model="tiny"} 1.0' in page
            assert "kvscale_router_endpoints 1.0" in page
            assert f'kvscale_router_endpoint_prefix_index_blocks{{endpoint="{urls[0]}"}}' in page
            assert (await s.get(url + "/nope")).status == 404

    run(main())
