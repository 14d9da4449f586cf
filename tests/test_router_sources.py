"""The router's inputs: EndpointSlices to endpoints, watch events, and the workers' /metrics."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from kvscale.router.endpoints import StaticEndpoints, apply_event, endpoints_from_slices
from kvscale.router.scrape import Scraper, parse_metrics
from kvscale.worker.metrics.prometheus import EngineMetrics
from kvscale.worker.metrics.stats import IterationStats, SchedulerStats


def eps(*items):
    return [{"addresses": [a], "conditions": c} for a, c in items]


def slice_(name, endpoints, ports=None, address_type="IPv4"):
    return {
        "metadata": {"name": name, "resourceVersion": "1"},
        "addressType": address_type,
        "ports": ports if ports is not None else [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def test_only_ready_not_terminating_endpoints_and_nil_conditions_per_the_api():
    s = slice_(
        "svc-abc",
        eps(
            ("10.0.0.1", {"ready": True, "serving": True, "terminating": False}),
            ("10.0.0.2", {"ready": False}),  # not ready (loading)
            ("10.0.0.3", {"ready": False, "serving": True, "terminating": True}),  # draining
            ("10.0.0.4", {}),  # unknown: ready, not terminating
            ("10.0.0.5", {"ready": True, "terminating": True}),
        ),
    )
    assert endpoints_from_slices([s]) == ["http://10.0.0.1:8000", "http://10.0.0.4:8000"]


def test_ports_by_name_ipv6_fqdn_and_several_slices():
    a = slice_(
        "a",
        eps(("10.0.0.1", {"ready": True})),
        ports=[{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
    )
    b = slice_("b", eps(("fd00::7", {"ready": True})), address_type="IPv6")
    c = slice_("c", eps(("worker.example", {"ready": True})), address_type="FQDN")
    d = slice_("d", eps(("10.0.0.9", {"ready": True})), ports=[])  # no port yet
    assert endpoints_from_slices([a, b, c, d], port_name="http") == [
        "http://10.0.0.1:8000",
        "http://[fd00::7]:8000",
    ]
    assert endpoints_from_slices([a]) == ["http://10.0.0.1:9000"]  # no name asked: the first port


def test_watch_events_add_modify_delete_and_ignore_bookmarks():
    s1 = slice_("a", eps(("10.0.0.1", {"ready": True})))
    s1b = slice_("a", eps(("10.0.0.1", {"ready": True}), ("10.0.0.2", {"ready": True})))
    state = apply_event({}, "ADDED", s1)
    assert endpoints_from_slices(state.values()) == ["http://10.0.0.1:8000"]
    state = apply_event(state, "MODIFIED", s1b)
    assert len(endpoints_from_slices(state.values())) == 2
    state = apply_event(state, "BOOKMARK", {"metadata": {"name": "a", "resourceVersion": "9"}})
    assert len(endpoints_from_slices(state.values())) == 2
    state = apply_event(state, "DELETED", s1b)
    assert endpoints_from_slices(state.values()) == []


def test_static_endpoints_are_synced_and_deduplicated():
    got = []
    src = StaticEndpoints(["http://b:1/", "http://a:1", "http://b:1", " "])
    src.start(got.append)
    assert src.synced and got == [["http://a:1", "http://b:1"]]


def _worker_exposition(**values) -> str:
    """What a real worker's EngineMetrics renders (its registry, its names), with these values."""
    m = EngineMetrics("tiny-code-target")
    m.kv_cache_usage.set(values.get("kv", 0.0))
    m.num_waiting.set(values.get("waiting", 0))
    m.num_running.set(values.get("running", 0))
    m.prefix_queries.inc(values.get("queries", 0))
    m.prefix_hits.inc(values.get("hits", 0))
    m.kv_cache_blocks.set(values.get("blocks", 0))
    m.prefill_tokens.set(values.get("prefill", 0))
    return m.render().decode()


def test_parse_reads_the_workers_own_exposition():
    got = parse_metrics(
        _worker_exposition(kv=0.42, waiting=3, running=5, queries=900, hits=300, blocks=128, prefill=4321)
    )
    assert got.kv_usage == pytest.approx(0.42)
    assert (got.waiting, got.running, got.kv_blocks, got.prefill_pending) == (3, 5, 128, 4321)
    assert (got.prefix_queries, got.prefix_hits) == (900, 300)


def test_parse_reads_the_lora_slots_from_the_workers_own_exposition():
    """What the engine publishes (EngineMetrics.record, as the server runs it): the adapters in
    device slots, the served name, and the slots an adapter can take at once."""
    m = EngineMetrics("tiny-code-target")
    m.cache_config(block_size=16, num_blocks=64, enable_prefix_caching=True, max_lora=4)
    sched = SchedulerStats(1, 1, 0.1, 0, 0, 0, running_lora_adapters=["sql"], waiting_lora_adapters=["w3"])
    m.record(IterationStats(lora_resident=["doc", "sql"]), sched, num_blocks=64)
    got = parse_metrics(m.render().decode())
    assert got.served_model == "tiny-code-target"
    assert got.max_lora == 4 and got.adapters == {"doc", "sql"}
    assert got.lora_free_slots == 2  # sql runs and w3 waits: theirs; doc is idle: its slot is free
    m.record(IterationStats(lora_resident=["sql", "w3"]), SchedulerStats(0, 0, 0.0, 0, 0, 0), 64)
    got = parse_metrics(m.render().decode())
    assert got.adapters == {"sql", "w3"} and got.lora_free_slots == 4  # doc left its slot; all idle
    assert got.served_adapters == frozenset()  # a LoRA worker serving none yet (a new pod)
    digests = {"sql": "1" * 64, "doc": "2" * 64, "w3": "3" * 64}
    m.set_served_adapters(digests)
    got = parse_metrics(m.render().decode())
    assert got.served_adapters == {"sql", "doc", "w3"} and got.adapter_digests == digests
    # doc unloaded (its series goes), sql loaded again from other weights (only the new digest).
    m.set_served_adapters({"sql": "4" * 64, "w3": "3" * 64})
    got = parse_metrics(m.render().decode())
    assert got.served_adapters == {"sql", "w3"}
    assert got.adapter_digests == {"sql": "4" * 64, "w3": "3" * 64}
    assert m.render().decode().count('lora_name="sql"') == 2  # resident and served: one series each
    plain = EngineMetrics("tiny")
    plain.cache_config(block_size=16, num_blocks=64, enable_prefix_caching=True)
    got = parse_metrics(plain.render().decode())
    assert (got.served_model, got.max_lora, got.lora_free_slots, got.adapters) == ("tiny", 0, 0, frozenset())


def test_parse_takes_the_latest_of_vllms_lora_info_series():
    """vLLM keeps a series per label set its lora info ever had, valued by when it was set: the
    latest is the state (hand-written, vLLM's shape); its running adapters are in slots too."""
    page = (
        "# HELP vllm:lora_requests_info Running stats on LoRA requests.\n"
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.8e9\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="c",waiting_lora_adapters=""} 1.9e9\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="d",waiting_lora_adapters="e"} 1.7e9\n'
    )
    got = parse_metrics(page)
    assert got.adapters == {"c"} and (got.max_lora, got.lora_free_slots) == (2, 1)
    assert got.served_adapters is None  # vLLM does not say which it serves: not filtered out


def test_parse_of_an_empty_or_foreign_page_is_zeros():
    assert parse_metrics("").kv_usage == 0.0
    assert parse_metrics("# TYPE other gauge\nother 3\n").waiting == 0


def test_scraper_polls_each_endpoint_and_survives_a_dead_one():
    asyncio.run(_scrape_twice())


async def _scrape_twice():
    import aiohttp

    page = _worker_exposition(kv=0.5, waiting=1, running=2, blocks=64)
    hits = []

    async def metrics(request):
        hits.append(request.path)
        return web.Response(text=page, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    good, dead = f"http://127.0.0.1:{port}", "http://127.0.0.1:9"  # discard port: refused
    seen = {}
    async with aiohttp.ClientSession() as session:
        scraper = Scraper(session, lambda: [good, dead], seen.__setitem__, interval_s=0.05, timeout_s=0.5)
        task = asyncio.create_task(scraper.run())
        await asyncio.sleep(0.4)
        task.cancel()
    await runner.cleanup()
    assert seen[good].kv_blocks == 64 and dead not in seen
    assert len(hits) >= 3  # sub-second polling: several scrapes in 0.4 s
    assert scraper.errors >= 1


def test_scraper_drops_an_endless_metrics_body_at_its_cap_and_keeps_scraping_the_rest():
    """Issue 27: a pod in the worker Service's endpoints (a tenant's look-alike, a bug) that answers
    /metrics with an endless body costs the router one failed scrape, capped, not its memory."""
    asyncio.run(_scrape_endless())


async def _scrape_endless():
    import aiohttp

    page = _worker_exposition(kv=0.5, waiting=1, running=2, blocks=64)
    sent = [0]
    chunk = b"vllm:num_requests_waiting 1\n" * 2048  # ~56 KiB of lines the parser would keep

    async def good(request):
        return web.Response(text=page, content_type="text/plain")

    async def endless(request):
        response = web.StreamResponse()  # chunked, no Content-Length
        await response.prepare(request)
        while sent[0] < 64 << 20:  # a regression stops here rather than exhaust the machine
            await response.write(chunk)
            sent[0] += len(chunk)
        return response

    runners, urls = [], []
    for handler in (good, endless):
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    seen = {}
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        scraper = Scraper(session, lambda: urls, seen.__setitem__, interval_s=0.05, timeout_s=5.0)
        await scraper.scrape_all()
    for runner in runners:
        await runner.cleanup()
    assert urls[0] in seen and urls[1] not in seen
    assert scraper.errors == 1
    assert sent[0] < 8 << 20, f"the router read {sent[0]} bytes of an endless body"


# -- the watch loop, against stand-ins for the API server ----------------------------------------
class StandInSliceAPI:
    """A stand-in for the API server's EndpointSlice list (unit tests only; e2e/test_router_endpoints.py
    runs the watcher against the real one): answers each list with the next scripted state."""

    def __init__(self, states):
        self.states = list(states)

    def list_namespaced_endpoint_slice(self, namespace, label_selector, _preload_content=True, **kw):
        from types import SimpleNamespace

        assert label_selector == "kubernetes.io/service-name=tiny" and not _preload_content
        items, version = self.states.pop(0)
        return SimpleNamespace(data=json.dumps({"items": items, "metadata": {"resourceVersion": version}}))


class StandInWatch:
    """A stand-in for kubernetes.watch.Watch: each stream() plays the next script (events as the
    client yields them, then an exception to raise or None for a watch that timed out)."""

    def __init__(self, scripts, versions, watcher):
        self.scripts, self.versions, self.watcher = scripts, versions, watcher

    def stream(self, func, namespace, resource_version, **kw):
        assert kw["allow_watch_bookmarks"] and kw["label_selector"] == "kubernetes.io/service-name=tiny"
        self.versions.append(resource_version)
        if not self.scripts:
            self.watcher.stop()
            return
        events, error = self.scripts.pop(0)
        yield from events
        if error is not None:
            raise error

    def stop(self):
        pass


def _event(kind, obj):
    return {"type": kind, "object": None, "raw_object": obj}


def test_the_watch_resumes_from_the_last_version_and_lists_again_on_410():
    from kubernetes.client.exceptions import ApiException

    from kvscale.router.endpoints import SliceWatcher

    a = slice_("a", eps(("10.0.0.1", {"ready": True})))
    b = {
        **slice_("b", eps(("10.0.0.2", {"ready": True}))),
        "metadata": {"name": "b", "resourceVersion": "11"},
    }
    b_down = {
        **slice_("b", eps(("10.0.0.2", {"ready": False}))),
        "metadata": {"name": "b", "resourceVersion": "31"},
    }
    api = StandInSliceAPI([([a], "10"), ([b], "20"), ([a, b], "30")])
    scripts = [
        (
            [_event("ADDED", b), _event("BOOKMARK", {"metadata": {"name": "x", "resourceVersion": "12"}})],
            None,
        ),
        ([_event("ERROR", {"kind": "Status", "code": 410, "reason": "Expired"})], None),  # as an event
        ([], ApiException(status=410, reason="Gone")),  # as the client raises it
        ([_event("MODIFIED", b_down)], None),
    ]
    versions: list[str] = []
    published: list[list[str]] = []

    async def main():
        watcher = SliceWatcher("tiny", "default", api=api)
        watcher._watch_factory = lambda: StandInWatch(scripts, versions, watcher)
        watcher.start(published.append)
        await asyncio.get_running_loop().run_in_executor(None, watcher._thread.join, 10)
        await asyncio.sleep(0.05)  # the hand-overs queued on the loop
        return watcher

    watcher = asyncio.run(main())
    assert versions == ["10", "12", "20", "30", "31"]  # resumed from the bookmark, relisted twice
    assert watcher.lists == 3 and watcher.synced
    one, two = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    assert published == [[one], [one, two], [two], [one, two], [one]]


def test_an_adapter_digest_that_is_not_sha256_hex_is_ignored():
    """The digest label is a hash input the worker chooses: anything but 64 hex digits (a path, a
    megabyte of text) is dropped, and that adapter's requests are scored approximately."""
    page = (
        "# TYPE kvscale_lora_adapter_served gauge\n"
        'kvscale_lora_adapter_served{{model_name="m",lora_name="ok",digest="{}"}} 1\n'
        'kvscale_lora_adapter_served{{model_name="m",lora_name="path",digest="../../etc/passwd"}} 1\n'
        'kvscale_lora_adapter_served{{model_name="m",lora_name="long",digest="{}"}} 1\n'
        'kvscale_lora_adapter_served{{model_name="m",lora_name="gone",digest="{}"}} 0\n'
    ).format("a" * 64, "b" * 65, "c" * 64)
    got = parse_metrics(page)
    assert got.served_adapters == {"ok", "path", "long"}
    assert got.adapter_digests == {"ok": "a" * 64}
