"""One endpoint for many models (issue 31, must-show 4), the router's half: one pool of workers per
model behind one router (`--pool`). Each model's requests reach only its pool's workers; an
unknown model is OpenAI's 404 before any queue; `/v1/models` is the union (a pool at zero listed
from its flags, not woken); each pool wakes alone and queues alone. Stand-in workers from
test_router_server.py; the pure parts (parsing --pool, resolving a model) directly."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from test_router_server import BODY, SSE, ManualSource, StandInWorker, run, serving, until, workers

from kvscale.router import main
from kvscale.router.endpoints import SliceWatcher, StaticEndpoints
from kvscale.router.kv_events import KVEventsSource
from kvscale.router.pool import (
    MAX_POOLS,
    PoolParts,
    PoolSpec,
    UnknownModel,
    parse_pool_spec,
    parse_pool_specs,
    resolve_pool,
)
from kvscale.router.server import Router, RouterConfig, build_app
from kvscale.router.state import RouterState
from kvscale.router.wake import Waker
from kvscale.worker.metrics.prometheus import EngineMetrics
from kvscale.worker.metrics.stats import IterationStats, SchedulerStats

PLAIN = {**BODY, "stream": False}


def body(model: str, **extra) -> dict:
    return {**PLAIN, "model": model, **extra}


class ModelWorker(StandInWorker):
    """A stand-in worker of one model: its /v1/models lists `model` and the adapters it serves,
    its /metrics says it serves them (kvscale_lora_adapter_served), and it counts the router's
    asks for its tokenizer (answered 404: no tokenizer is loaded here)."""

    def __init__(self, model: str, served: tuple[str, ...] = (), **kwargs) -> None:
        super().__init__(**kwargs)
        self.model, self.served = model, served
        self.models_asked = 0
        self.tokenizer_asked = 0
        self.tokenizer_auth: list[str | None] = []  # the Authorization of each tokenizer ask

    async def models(self, request: web.Request) -> web.Response:
        self.models_asked += 1
        entry = {"object": "model", "created": 1, "owned_by": "kvscale"}
        data = [{**entry, "id": self.model}] + [{**entry, "id": a, "parent": self.model} for a in self.served]
        return web.json_response({"object": "list", "data": data})

    async def metrics(self, request: web.Request) -> web.Response:
        m = EngineMetrics(self.model)
        m.cache_config(block_size=16, num_blocks=512, enable_prefix_caching=True, max_lora=2)
        m.set_served_adapters({a: "0" * 64 for a in self.served})
        m.record(IterationStats(), SchedulerStats(0, self.waiting, self.kv, 0, 0, 0), num_blocks=512)
        return web.Response(body=m.render(), content_type="text/plain")

    async def tokenizer(self, request: web.Request) -> web.Response:
        self.tokenizer_asked += 1
        self.tokenizer_auth.append(request.headers.get("Authorization"))
        return web.json_response({"error": {"message": "no tokenizer here"}}, status=404)

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/v1/kvscale/tokenizer", self.tokenizer)
        return app


class CountingWaker(Waker):
    """A waker whose ask is recorded (and, given `then`, runs it: the pool's first pod appears)."""

    def __init__(self, then=None) -> None:
        self.calls = 0

        async def ask() -> bool:
            self.calls += 1
            if then is not None:
                then()
            return True

        super().__init__(ask, retry_s=60)


@asynccontextmanager
async def pooled(pools: list[PoolParts], **config):
    config.setdefault("scrape_interval_s", 0.05)
    r = Router(config=RouterConfig(**config), pools=pools)
    async with serving(build_app(r)) as url:
        yield r, url


def static(model: str, urls: list[str], **kw) -> PoolParts:
    return PoolParts(model, RouterState(), StaticEndpoints(urls), **kw)


async def post(s: aiohttp.ClientSession, url: str, payload: dict, path: str = "/v1/completions"):
    async with s.post(url + path, json=payload) as resp:
        return resp.status, await resp.read()


async def metrics_page(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(url + "/metrics") as resp:
        return await resp.text()


# -- pure: parsing --pool -------------------------------------------------------------------------
def test_a_pool_spec_parses_service_urls_scale_and_adapters():
    assert parse_pool_spec("llama=llama-svc") == PoolSpec("llama", service="llama-svc")
    assert parse_pool_spec("meta-llama/Llama-3.1-8B=llama,scale=llama,adapters=sql|chat") == PoolSpec(
        "meta-llama/Llama-3.1-8B", service="llama", scale="llama", adapters=("sql", "chat")
    )
    assert parse_pool_spec("q=http://10.0.0.1:8000+https://[::1]:8000,adapters=x") == PoolSpec(
        "q", urls=("http://10.0.0.1:8000", "https://[::1]:8000"), adapters=("x",)
    )
    # Adapter names may hold `+` (the operator's grammar: ._:/@+-); `|` separates them.
    assert parse_pool_spec("m=svc,adapters=c++@v1|org/sql:2").adapters == ("c++@v1", "org/sql:2")
    assert parse_pool_spec("m=svc,keys=/etc/keys/m/api-key").keys == "/etc/keys/m/api-key"


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("llama", "expected MODEL=SOURCE"),
        ("=svc", "expected MODEL=SOURCE"),
        ("llama=", "source"),
        ("llama=svc,", "unknown key ''"),
        ("llama=svc,zone=a", "unknown key 'zone'"),
        ("llama=svc,scale=", "scale= is empty"),
        ("llama=svc,adapters=", "adapters= is empty"),
        ("llama=svc,adapters=a||b", "empty name"),
        ("llama=svc,adapters=a|a", "twice"),
        ("llama=svc,adapters=llama", "the model itself"),
        ("llama=svc,scale=a,scale=b", "given twice"),
        ("llama=svc,scale=Not_A_Name", "not a Deployment name"),
        ("llama=Not_A_Service", "neither a Service name"),
        ("llama=http://a:1+", "not worker URLs"),
        ("llama=http://a:1+10.0.0.2:8000", "not worker URLs"),
        ("my model=svc", "space"),
        ("llama=svc,keys=api-key", "not an absolute path"),
    ],
)
def test_a_bad_pool_spec_says_what_is_wrong(value, says):
    with pytest.raises(ValueError, match="--pool") as e:
        parse_pool_spec(value)
    assert says in str(e.value)


def test_the_pools_together_each_model_once_each_adapter_one_home_and_a_budget():
    with pytest.raises(ValueError, match=r"more than once: \['a'\]"):
        parse_pool_specs(["a=s1", "b=s2", "a=s3"])
    with pytest.raises(ValueError, match="listed in pools 'a' and 'b'"):
        parse_pool_specs(["a=s1,adapters=x", "b=s2,adapters=x"])
    with pytest.raises(ValueError, match="also a pool's model"):
        parse_pool_specs(["a=s1,adapters=b", "b=s2"])
    at_budget = [f"m{i}=s{i}" for i in range(MAX_POOLS)]
    assert len(parse_pool_specs(at_budget)) == MAX_POOLS
    with pytest.raises(ValueError, match=f"at most {MAX_POOLS} pools"):
        parse_pool_specs([*at_budget, "one-more=s"])


def _cli_error(argv: list[str], capsys) -> str:
    parser = main.build_parser()
    with pytest.raises(SystemExit) as e:
        main.pool_specs(parser, parser.parse_args(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_the_cli_refuses_bad_pools_with_argparse_errors(capsys):
    assert "unknown key 'zone'" in _cli_error(["--pool", "a=s,zone=1"], capsys)
    assert "more than once" in _cli_error(["--pool", "a=s", "--pool", "a=t"], capsys)
    assert "not allowed with argument" in _cli_error(["--pool", "a=s", "--service", "s"], capsys)
    too_many = [arg for i in range(MAX_POOLS + 1) for arg in ("--pool", f"m{i}=s{i}")]
    assert f"at most {MAX_POOLS} pools" in _cli_error(too_many, capsys)
    assert "scale=" in _cli_error(["--pool", "a=s", "--scale-deployment", "a"], capsys)
    two = ["--pool", "a=s", "--pool", "b=t"]
    assert "--tokenizer workers" in _cli_error([*two, "--tokenizer", "/models/a"], capsys)
    parser = main.build_parser()
    assert len(main.pool_specs(parser, parser.parse_args([*two, "--tokenizer", "workers"]))) == 2
    one = parser.parse_args(["--pool", "a=s", "--tokenizer", "/models/a"])  # one pool: not ambiguous
    assert main.pool_specs(parser, one) == [PoolSpec("a", service="s")]


def test_the_cli_builds_one_pool_per_model_with_its_source_and_waker(monkeypatch):
    from test_router_wake import StandInScale

    scale = StandInScale(0)
    monkeypatch.setattr(main, "_apps_api", lambda: scale)
    args = main.build_parser().parse_args(
        ["--pool", "a=http://127.0.0.1:1+http://127.0.0.1:2,adapters=a-sql", "--namespace", "ns",
         "--pool", "b=b-workers,scale=b-dep", "--max-queued", "9"]
    )  # fmt: skip
    r = main.build_router(args)
    a, b = r.pools["a"], r.pools["b"]
    assert list(r.pools) == ["a", "b"] and not r.legacy
    assert isinstance(a.source, StaticEndpoints) and a.source.urls == [
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
    ]
    assert a.adapters == ("a-sql",) and a.waker is None
    assert isinstance(b.source, SliceWatcher) and (b.source.service, b.source.namespace) == (
        "b-workers",
        "ns",
    )
    assert a.state is not b.state and a.flow is not b.flow
    assert a.flow.max_queued == b.flow.max_queued == 9  # the limits apply to each pool
    assert b.waker is not None and run(b.waker._scale_up()) is True
    assert scale.updates == [("b-dep", "ns", 1)]  # b's own Deployment
    with pytest.raises(AttributeError, match="several pools"):
        _ = r.state


# -- pure: which pool a model goes to ---------------------------------------------------------------
def test_a_model_resolves_to_its_pool_then_a_listed_adapter_then_a_served_one():
    adapters = {"a": frozenset({"a-sql"}), "b": frozenset({"b-chat"})}
    served = {"a": frozenset({"a-live", "b-chat"}), "b": frozenset()}
    assert resolve_pool("a", adapters, served) == "a"
    assert resolve_pool("b", adapters, served) == "b"
    assert resolve_pool("a-sql", adapters, served) == "a"
    assert resolve_pool("b-chat", adapters, served) == "b"  # the flags' adapters= before a scrape
    assert resolve_pool("a-live", adapters, served) == "a"  # served by a's workers: a
    for unknown in ("c", "", "A", "a-sql "):
        with pytest.raises(UnknownModel):
            resolve_pool(unknown, adapters, served)
    assert resolve_pool("anything", {None: frozenset()}) is None  # one unnamed pool takes all


# -- the router with pools --------------------------------------------------------------------------
def test_each_models_requests_reach_only_its_pools_workers():
    async def main_():
        a1, a2, b1 = ModelWorker("a"), ModelWorker("a"), ModelWorker("b")
        async with workers(a1, a2) as a_urls, workers(b1) as b_urls:
            pools = [static("a", a_urls), static("b", b_urls)]
            async with pooled(pools) as (_, url), aiohttp.ClientSession() as s:
                models = ["a", "b", "a", "a", "b", "a", "b", "a"]
                results = await asyncio.gather(*(post(s, url, body(m)) for m in models))
                assert [status for status, _ in results] == [200] * len(models)
                assert a1.models_received() + a2.models_received() == ["a"] * 5
                assert b1.models_received() == ["b"] * 3
                page = await until(
                    lambda: _with(s, url, 'kvscale_router_responses_total{code="200",model="b"} 3.0'),
                    "the responses to be counted",
                )
                assert 'kvscale_router_requests_total{model="a"} 5.0' in page
                assert "kvscale_router_endpoints 3.0" in page  # the total over pools

    run(main_())


async def _with(s: aiohttp.ClientSession, url: str, line: str) -> str | None:
    page = await metrics_page(s, url)
    return page if line in page else None


def test_an_unknown_model_is_openais_404_before_any_queue_and_makes_no_label():
    async def main_():
        a1 = ModelWorker("a")
        waker = CountingWaker()
        async with workers(a1) as a_urls:
            pools = [static("a", a_urls), PoolParts("b", RouterState(), ManualSource(), waker)]
            async with pooled(pools) as (r, url), aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/completions", json=body("gpt-5")) as resp:
                    assert resp.status == 404
                    assert await resp.json() == {
                        "error": {
                            "message": "The model `gpt-5` does not exist.",
                            "type": "invalid_request_error",
                            "param": "model",
                            "code": "model_not_found",
                        }
                    }
                chat = {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}
                status, _ = await post(s, url, chat, "/v1/chat/completions")
                assert status == 404
                assert a1.received == [] and waker.calls == 0  # no worker saw it, no pool woke
                assert len(r.pools["a"].flow) == len(r.pools["b"].flow) == 0
                page = await metrics_page(s, url)
                assert 'kvscale_router_rejected_requests_total{model="",reason="unknown_model"} 2.0' in page
                assert 'kvscale_router_responses_total{code="404",model=""} 2.0' in page
                assert "gpt-5" not in page  # a client's name makes no label value

    run(main_())


def test_one_unnamed_pool_still_takes_every_model_as_before():
    async def main_():
        w = StandInWorker()
        async with workers(w) as urls, aiohttp.ClientSession() as s:
            r = Router(RouterState(), StaticEndpoints(urls), RouterConfig(scrape_interval_s=0.05))
            async with serving(build_app(r)) as url:
                assert await post(s, url, body("any-name-at-all")) == (200, b"".join(SSE))
                assert w.models_received() == ["any-name-at-all"]  # the worker decides, as before
                async with s.get(url + "/ready") as resp:
                    assert "pools" not in await resp.json()
                assert "kvscale_router_pool_" not in await metrics_page(s, url)

    run(main_())


def test_models_is_the_union_and_a_pool_at_zero_is_listed_from_its_flags_without_waking():
    async def main_():
        a1 = ModelWorker("a", served=("a-sql",))
        c1 = ModelWorker("c", served=("a-sql",))  # the same adapter name in two pools: listed once
        waker = CountingWaker()
        async with workers(a1) as a_urls, workers(c1) as c_urls:
            pools = [
                static("a", a_urls),
                PoolParts("b", RouterState(), ManualSource(), waker, adapters=("b-chat", "b-sql")),
                static("c", c_urls),
            ]
            async with pooled(pools) as (r, url), aiohttp.ClientSession() as s:
                async with s.get(url + "/v1/models") as resp:
                    assert resp.status == 200
                    listed = await resp.json()
                assert listed["object"] == "list"
                assert [m["id"] for m in listed["data"]] == ["a", "a-sql", "b", "b-chat", "b-sql", "c"]
                synthesized = {"object": "model", "created": r.started_at, "owned_by": "kvscale"}
                by_id = {m["id"]: m for m in listed["data"]}
                assert by_id["b"] == {"id": "b", **synthesized}
                assert by_id["b-chat"] == {"id": "b-chat", **synthesized, "parent": "b"}
                assert by_id["a"]["created"] == 1  # a ready pool's entries are its worker's
                assert waker.calls == 0 and len(r.pools["b"].flow) == 0  # listing wakes nobody
                assert a1.models_asked == c1.models_asked == 1

    run(main_())


def test_a_pool_whose_workers_do_not_answer_models_is_listed_from_its_flags():
    async def main_():
        from test_router_server import refused_url

        pools = [static("a", [refused_url()], adapters=("a-x",))]
        async with (
            pooled(pools) as (_, url),
            aiohttp.ClientSession() as s,
            s.get(url + "/v1/models") as resp,
        ):
            assert resp.status == 200
            assert [m["id"] for m in (await resp.json())["data"]] == ["a", "a-x"]

    run(main_())


def test_ready_waits_for_every_pool_and_metrics_count_each_pool():
    async def main_():
        a1 = ModelWorker("a")
        b_source = ManualSource(synced=False)
        async with workers(a1) as a_urls:
            pools = [static("a", a_urls), PoolParts("b", RouterState(), b_source)]
            async with pooled(pools) as (_, url), aiohttp.ClientSession() as s:
                async with s.get(url + "/ready") as resp:
                    assert resp.status == 503  # b has not listed yet
                b_source.synced = True
                async with s.get(url + "/ready") as resp:
                    assert resp.status == 200
                    assert (await resp.json())["pools"] == {"a": 1, "b": 0}
                page = await metrics_page(s, url)
                assert 'kvscale_router_pool_endpoints{model="a"} 1.0' in page
                assert 'kvscale_router_pool_endpoints{model="b"} 0.0' in page
                assert 'kvscale_router_pool_wakes_total{model="b"} 0.0' in page

    run(main_())


def test_a_pool_at_zero_wakes_alone_while_the_other_keeps_serving():
    async def main_():
        a1, b1 = ModelWorker("a"), ModelWorker("b")
        a_source = ManualSource()
        a_waker, b_waker = CountingWaker(), CountingWaker()
        async with workers(a1) as a_urls, workers(b1) as b_urls:
            pools = [
                PoolParts("a", RouterState(), a_source, a_waker),
                static("b", b_urls, waker=b_waker),
            ]
            async with pooled(pools) as (r, url), aiohttp.ClientSession() as s:
                waiting = asyncio.create_task(post(s, url, body("a")))
                await until(lambda: len(r.pools["a"].flow) == 1, "a's request to wait")
                await until(lambda: a_waker.calls == 1, "a's Deployment to be asked")
                for _ in range(3):  # b serves on while a waits for its first worker
                    assert await post(s, url, body("b")) == (200, b"".join(SSE))
                assert not waiting.done() and b1.models_received() == ["b"] * 3
                assert b_waker.calls == 0 and a1.received == []
                a_source.publish(a_urls)  # a's first pod is ready: its queued request goes there
                assert await asyncio.wait_for(waiting, 5) == (200, b"".join(SSE))
                assert a1.models_received() == ["a"] and b1.models_received() == ["b"] * 3
                page = await metrics_page(s, url)
                assert 'kvscale_router_pool_wakes_total{model="a"} 1.0' in page
                assert 'kvscale_router_pool_wakes_total{model="b"} 0.0' in page
                assert 'kvscale_router_pool_endpoints{model="a"} 1.0' in page

    run(main_())


def test_an_adapter_goes_to_its_pool_listed_or_scraped_even_at_zero():
    async def main_():
        a1, b1 = ModelWorker("a", served=("a-live",)), ModelWorker("b")
        c_source = ManualSource()
        c_waker = CountingWaker()
        async with workers(a1) as a_urls, workers(b1) as b_urls:
            pools = [
                static("a", a_urls),
                static("b", b_urls, adapters=("b-sql",)),
                PoolParts("c", RouterState(), c_source, c_waker, adapters=("c-chat",)),
            ]
            async with pooled(pools) as (r, url), aiohttp.ClientSession() as s:
                assert (await post(s, url, body("b-sql")))[0] == 200  # adapters= of b
                assert b1.models_received() == ["b-sql"] and a1.received == []
                await until(lambda: "a-live" in r.pools["a"].served_adapters(), "a's workers scraped")
                assert (await post(s, url, body("a-live")))[0] == 200  # a's workers serve it
                assert a1.models_received() == ["a-live"]
                # c is at zero: its adapter's request waits in c's queue and wakes c.
                waiting = asyncio.create_task(post(s, url, body("c-chat")))
                await until(lambda: len(r.pools["c"].flow) == 1, "c-chat to wait in c's queue")
                assert c_waker.calls == 1
                waiting.cancel()

    run(main_())


def test_a_flood_to_one_model_fills_only_its_own_queue():
    async def main_():
        a1, b1 = ModelWorker("a"), ModelWorker("b")
        a_source = ManualSource()
        async with workers(a1) as a_urls, workers(b1) as b_urls:
            pools = [PoolParts("a", RouterState(), a_source), static("b", b_urls)]
            config = {"max_queued": 2, "max_queued_per_client": 2, "queue_timeout_s": 30}
            async with pooled(pools, **config) as (r, url), aiohttp.ClientSession() as s:
                flood = [asyncio.create_task(post(s, url, body("a"))) for _ in range(2)]
                await until(lambda: len(r.pools["a"].flow) == 2, "a's queue to fill")
                async with s.post(url + "/v1/completions", json=body("a")) as resp:
                    assert resp.status == 429 and (await resp.json())["error"]["code"] == "queue_full"
                # b's budget is its own: served at once, though a's queue is full.
                assert await post(s, url, body("b")) == (200, b"".join(SSE))
                assert b1.models_received() == ["b"]
                a_source.publish(a_urls)
                assert [status for status, _ in await asyncio.gather(*flood)] == [200, 200]

    run(main_())


def test_the_dry_run_pick_resolves_the_pool():
    async def main_():
        a1, b1 = ModelWorker("a"), ModelWorker("b")
        async with workers(a1) as a_urls, workers(b1) as b_urls:
            pools = [static("a", a_urls), static("b", b_urls, adapters=("b-sql",))]
            async with pooled(pools, expose_picks=True) as (_, url), aiohttp.ClientSession() as s:
                pick = "/kvscale/pick/v1/completions"
                for model, where in (("a", a_urls[0]), ("b", b_urls[0]), ("b-sql", b_urls[0])):
                    async with s.post(url + pick, json=body(model)) as resp:
                        assert (await resp.json())["endpoint"] == where
                async with s.post(url + pick, json=body("nope")) as resp:
                    assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
                assert a1.received == b1.received == []  # a dry run sends nothing

    run(main_())


def test_each_pool_fetches_its_tokenizer_from_its_own_workers_and_subscribes_to_them():
    async def main_():
        a1, b1 = ModelWorker("a"), ModelWorker("b")
        async with workers(a1) as a_urls, workers(b1) as b_urls:
            pools = [static("a", a_urls), static("b", b_urls)]
            r = Router(
                config=RouterConfig(scrape_interval_s=0.05),
                pools=pools,
                kv_events=KVEventsSource(port=1, replay_port=2),
                tokenizer_from_workers=True,
            )
            async with serving(build_app(r)):
                await until(lambda: a1.tokenizer_asked and b1.tokenizer_asked, "each pool's fetch")
                a, b = r.pools["a"], r.pools["b"]
                assert a.state.kv_index is not None and a.state.kv_index is not b.state.kv_index
                assert a.subscriptions is not None and b.subscriptions is not None
                assert set(a.subscriptions._tasks) == set(a_urls)  # a's workers' events only
                assert set(b.subscriptions._tasks) == set(b_urls)

    run(main_())


def test_a_pool_with_its_own_keys_admits_only_its_keys_clients(tmp_path):
    """Attack test for the shared router: models a and b each require their workers' key (keys=),
    c is open. A stranger reaches c, but neither a nor b: 401 before a's queue, its worker and its
    waker (a stranger cannot wake a model scaled to zero, nor list it); b's key does not open a.
    /v1/models lists only what the client's key opens. Each pool's own calls to its workers (the
    tokenizer) carry that pool's key, an open pool's none."""
    keys = {}
    for name in ("a", "b"):
        keys[name] = tmp_path / f"{name}-keys"
        keys[name].write_text(f"key-{name}\n")

    async def main_():
        from kvscale.router.auth import KeyFile

        a1, c1 = ModelWorker("a"), ModelWorker("c")
        waker = CountingWaker()
        async with workers(a1) as a_urls, workers(c1) as c_urls:
            pools = [
                static("a", a_urls, api_keys=KeyFile(keys["a"])),
                PoolParts("b", RouterState(), ManualSource(), waker, api_keys=KeyFile(keys["b"])),
                static("c", c_urls),
            ]
            r = Router(
                config=RouterConfig(scrape_interval_s=0.05, expose_picks=True),
                pools=pools,
                kv_events=KVEventsSource(port=1, replay_port=2),
                tokenizer_from_workers=True,
            )
            async with serving(build_app(r)) as url, aiohttp.ClientSession() as s:

                async def ask(model: str, key: str | None, path: str = "/v1/completions") -> int:
                    headers = {"Authorization": f"Bearer {key}"} if key else {}
                    async with s.post(url + path, json=body(model), headers=headers) as resp:
                        if resp.status == 401:
                            assert (await resp.json())["error"]["code"] == "invalid_api_key"
                        return resp.status

                assert await ask("c", None) == 200
                assert [await ask("a", k) for k in (None, "key-b", "nope")] == [401, 401, 401]
                assert [await ask("b", k) for k in (None, "key-a")] == [401, 401]
                assert waker.calls == 0 and len(r.pools["b"].flow) == 0  # b was never woken
                assert a1.received == []  # nothing reached a's worker
                assert await ask("a", "key-a") == 200 and a1.models_received() == ["a"]
                assert await ask("a", "key-b", "/kvscale/pick/v1/completions") == 401

                async def listed(key: str | None) -> list[str]:
                    headers = {"Authorization": f"Bearer {key}"} if key else {}
                    async with s.get(url + "/v1/models", headers=headers) as resp:
                        assert resp.status == 200
                        return [m["id"] for m in (await resp.json())["data"]]

                assert await listed(None) == ["c"]
                assert await listed("key-a") == ["a", "c"]
                assert await listed("key-b") == ["b", "c"]
                await until(lambda: a1.tokenizer_asked and c1.tokenizer_asked, "each pool's fetch")
                assert a1.tokenizer_auth[0] == "Bearer key-a" and c1.tokenizer_auth[0] is None
                page = await metrics_page(s, url)
                assert 'kvscale_router_rejected_requests_total{model="",reason="unauthorized"} 6.0' in page

    run(main_())


def test_when_every_pool_has_keys_a_stranger_is_refused_before_its_body():
    """No open pool: a request with none of the pools' keys is refused at the door, before its body
    is read (a stranger costs no upload), as with the router's own --api-key-file."""

    async def main_(tmp):
        from kvscale.router.auth import KeyFile

        (tmp / "k").write_text("key-a\n")
        a1 = ModelWorker("a")
        async with (
            workers(a1) as a_urls,
            pooled([static("a", a_urls, api_keys=KeyFile(tmp / "k"))]) as (_, url),
        ):
            reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
            # Headers promising a 1 GB body that never comes: the answer cannot wait for it.
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000000\r\n\r\n"
            )
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), 10)
            assert status.startswith(b"HTTP/1.1 401"), status
            writer.close()
            assert a1.received == []

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        run(main_(Path(tmp)))
