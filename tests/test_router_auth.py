"""The router authenticates (API keys from a file, as a mounted Secret provides them) and keys its
queue's fairness per client, not per model (issue 27): through the router's aiohttp app, with
stand-in workers from test_router_server."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import aiohttp
import pytest

from kvscale.router.auth import KeyFile, _digest, match, parse_keys
from kvscale.router.endpoints import StaticEndpoints
from kvscale.router.queue import ClientQueueFull, FlowControl
from kvscale.router.server import Router, RouterConfig, build_app
from kvscale.router.state import RouterState
from tests.test_router_server import BODY, SSE, ManualSource, StandInWorker, serving, workers

PLAIN = {**BODY, "stream": False}


@asynccontextmanager
async def keyed_router(source, api_keys=None, upstream_key=None, **config):
    config.setdefault("scrape_interval_s", 0.05)
    r = Router(RouterState(), source, RouterConfig(**config), api_keys=api_keys, upstream_key=upstream_key)
    async with serving(build_app(r)) as url:
        yield r, url


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_file_lines_comments_and_matching():
    keys = parse_keys("# team a\nkey-a\n\n  key-b  \n#key-c\n")
    assert keys == ["key-a", "key-b"]
    digests = [_digest(k) for k in keys]
    assert match("Bearer key-b", digests) == match("Bearer key-b", digests[::-1]) is not None
    assert match("Bearer key-a", digests) != match("Bearer key-b", digests)
    for bad in ("Bearer key-c", "key-a", "Bearer key-a ", "Basic key-a", "", "Bearer \udcff"):
        assert match(bad, digests) is None
    assert "key-a" not in (match("Bearer key-a", digests) or "")  # the identity never holds the key


def test_without_a_key_nothing_reaches_a_worker_and_a_listed_key_is_forwarded(tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("# clients\nkey-a\nkey-b\n")

    async def main():
        w = StandInWorker()
        async with (
            workers(w) as urls,
            keyed_router(StaticEndpoints(urls), KeyFile(keys)) as (_, url),
            aiohttp.ClientSession() as s,
        ):
            for headers in ({}, bearer("nope"), {"Authorization": "key-a"}):
                big = {**PLAIN, "prompt": "x" * 2_000_000}  # refused before the body is read
                async with s.post(url + "/v1/completions", json=big, headers=headers) as r:
                    assert r.status == 401
                    err = (await r.json())["error"]
                    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            async with s.get(url + "/v1/models") as r:
                assert r.status == 401
            assert w.received == []
            async with s.post(url + "/v1/completions", json=BODY, headers=bearer("key-b")) as r:
                assert r.status == 200 and await r.read() == b"".join(SSE)
            async with s.get(url + "/v1/models", headers=bearer("key-a")) as r:
                assert r.status == 200
            for probe in ("/health", "/ready", "/metrics"):  # the kubelet and Prometheus carry no key
                async with s.get(url + probe) as r:
                    assert r.status == 200
            page = await (await s.get(url + "/metrics")).text()
            assert 'kvscale_router_rejected_requests_total{model="",reason="unauthorized"} 4.0' in page
        return w

    w = asyncio.run(main())
    assert len(w.received) == 1


def test_the_workers_key_replaces_the_clients_and_keys_rotate_without_a_restart(tmp_path):
    keys, upstream = tmp_path / "api-keys", tmp_path / "worker-key"
    keys.write_text("old-key\n")
    upstream.write_text("worker-key\n")
    seen: list[str | None] = []

    async def main():
        w = StandInWorker()
        completions = w.completions

        async def recording(request):
            seen.append(request.headers.get("Authorization"))
            return await completions(request)

        w.completions = recording
        async with (
            workers(w) as urls,
            keyed_router(StaticEndpoints(urls), KeyFile(keys, recheck_s=0), KeyFile(upstream)) as (_, url),
            aiohttp.ClientSession() as s,
        ):
            async with s.post(url + "/v1/completions", json=PLAIN, headers=bearer("old-key")) as r:
                assert r.status == 200
            keys.write_text("new-key\n")  # the Secret rotated: the kubelet rewrote the file
            async with s.post(url + "/v1/completions", json=PLAIN, headers=bearer("old-key")) as r:
                assert r.status == 401
            async with s.post(url + "/v1/completions", json=PLAIN, headers=bearer("new-key")) as r:
                assert r.status == 200

    asyncio.run(main())
    assert seen == ["Bearer worker-key", "Bearer worker-key"]  # never the client's key


def test_one_client_cannot_fill_the_queue_and_another_still_waits_its_turn(tmp_path):
    """Before: fairness was per model, so one client's burst took every place (here 8) and the
    next client got 429 queue_full. Now a client holds at most max_queued_per_client places."""
    keys = tmp_path / "api-keys"
    keys.write_text("key-a\nkey-b\n")

    async def main():
        w = StandInWorker()
        source = ManualSource()  # no worker ready yet: everything waits
        async with (
            workers(w) as urls,
            keyed_router(source, KeyFile(keys), max_queued=8, max_queued_per_client=4) as (r, url),
            aiohttp.ClientSession() as s,
        ):
            burst = [
                asyncio.create_task(s.post(url + "/v1/completions", json=PLAIN, headers=bearer("key-a")))
                for _ in range(6)
            ]
            while sum(t.done() for t in burst) < 2:  # the 5th and 6th are refused at once
                await asyncio.sleep(0.02)
            refused_tasks = [t for t in burst if t.done()]
            refused = [await t for t in refused_tasks]
            assert [x.status for x in refused] == [429, 429]
            assert {(await x.json())["error"]["code"] for x in refused} == {"client_queue_full"}
            other = asyncio.create_task(s.post(url + "/v1/completions", json=PLAIN, headers=bearer("key-b")))
            while len(r.flow) < 5:
                await asyncio.sleep(0.02)
            assert not other.done()  # it waits, it was not refused
            source.publish(urls)
            served = await asyncio.wait_for(
                asyncio.gather(other, *[t for t in burst if t not in refused_tasks]), 5
            )
            assert [x.status for x in served] == [200] * 5
            page = await (await s.get(url + "/metrics")).text()
            assert 'reason="client_queue_full"} 2.0' in page

    asyncio.run(main())


def test_without_keys_fairness_is_per_peer_address():
    """No --api-key-file: each peer address is a client (127.0.0.2 and 127.0.0.3 here)."""

    async def main():
        w = StandInWorker()
        source = ManualSource()
        async with (
            workers(w) as urls,
            keyed_router(source, max_queued=8, max_queued_per_client=2) as (r, url),
        ):
            sessions = [
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(ip, 0)))
                for ip in ("127.0.0.2", "127.0.0.3")
            ]
            try:
                tasks = [
                    asyncio.create_task(s.post(url + "/v1/completions", json=PLAIN)) for s in sessions * 3
                ]
                while sum(t.done() for t in tasks) < 2:
                    await asyncio.sleep(0.02)
                assert sorted(r.flow.queued(k) for k in ("peer:127.0.0.2", "peer:127.0.0.3")) == [2, 2]
                source.publish(urls)
                statuses = sorted(x.status for x in await asyncio.gather(*tasks))
                assert statuses == [200, 200, 200, 200, 429, 429]
            finally:
                for s in sessions:
                    await s.close()

    asyncio.run(main())


def test_dispatch_takes_clients_in_turn_not_one_clients_burst_first():
    async def main():
        capacity = [0]
        handed: list[str] = []

        def choose(hashes):
            if capacity[0] > 0:
                capacity[0] -= 1
                handed.append(hashes[0])
                return "e"
            return None

        flow = FlowControl(choose, lambda e: None, max_queued=16, max_per_key=8)
        tasks = [asyncio.create_task(flow.acquire("a", [f"a{i}"], "tiny")) for i in range(4)]
        tasks.append(asyncio.create_task(flow.acquire("b", ["b0"], "tiny")))  # same model
        await asyncio.sleep(0)
        with pytest.raises(ClientQueueFull):
            await asyncio.gather(*[flow.acquire("a", ["a-more"]) for _ in range(5)])
        capacity[0] = 5
        flow.dispatch()
        await asyncio.gather(*tasks)
        return handed

    assert asyncio.run(main()) == ["a0", "b0", "a1", "a2", "a3"]
