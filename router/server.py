"""The router's HTTP side (aiohttp): an OpenAI-compatible pass-through.

Per request: read the body (bounded, before any parsing: request_body.read_body, the worker's own
helper), take its model and prompt, hash the prompt's leading blocks, get an endpoint from flow
control (at once, or after queueing), forward the body unchanged and stream the answer back chunk
by chunk as it arrives. Until the first byte of an answer goes to the client, a refused connection
or a 429/503 from the worker moves the request to another endpoint; after it, nothing is retried
(the client already has part of one answer). The worker validates everything else itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvscale.common.capped_body import TooLarge, read_capped
from kvscale.common.errors import APIError
from kvscale.common.request_body import read_body
from kvscale.router.auth import KeyFile, client_key
from kvscale.router.kv_events import KVEventsSource, KVEventSubscriptions
from kvscale.router.pool import (
    EndpointSource,
    Pool,
    PoolParts,
    UnknownModel,
    resolve_pool,
    synthesized_models,
)
from kvscale.router.prefix_index import (
    DEFAULT_BLOCK_CHARS,
    DEFAULT_MAX_BLOCKS,
    block_hashes,
    chat_prefix_text,
    prompt_prefix_text,
)
from kvscale.router.queue import ClientQueueFull, FlowControl, QueueFull, QueueTimeout
from kvscale.router.state import PickRequest, RouterState, WorkerMetrics
from kvscale.router.tokenizer import PromptTokenizer
from kvscale.router.wake import Waker

logger = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp sets itself: never forwarded.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)  # fmt: skip
RETRYABLE_STATUS = (429, 503)
PICK_HEADER = "X-Kvscale-Endpoint"  # with expose_picks: which endpoint answered
MAX_MODEL_LABELS = 32  # model names come from clients: the rest count as "other"
MAX_MODELS_BYTES = 4 << 20  # a worker's /v1/models answer read for the union (pools): a cap
MAX_MODEL_NAME_ECHO = 256  # of an unknown model's name, echoed in its 404


@dataclass
class RouterConfig:
    block_chars: int = DEFAULT_BLOCK_CHARS
    max_blocks: int = DEFAULT_MAX_BLOCKS
    max_body_bytes: int = 8 * 2**20
    max_retries: int = 2  # other endpoints tried before the first byte
    connect_timeout_s: float = 5.0
    # The longest a worker may stay silent: waiting for its answer's headers, or between two
    # chunks of it. A non-streamed completion says nothing until it is done, so this is generous.
    read_timeout_s: float = 600.0
    queue_timeout_s: float = 60.0
    max_queued: int = 256
    # One client's share of the queue (its API key's, else its peer address's): one client cannot
    # fill all max_queued places. None: a quarter of max_queued (at least 1).
    max_queued_per_client: int | None = None
    retry_after_s: int = 1
    scrape_interval_s: float = 0.25
    scrape_timeout_s: float = 1.0
    scrape_concurrency: int = 16
    # A stream waiting in the queue this long gets its headers and an SSE comment, and one more
    # every as long, so proxies and clients keep a long wait (a first worker loading) open.
    heartbeat_s: float = 5.0
    # POST /kvscale/pick/v1/(chat/)completions: the endpoint this router would pick for the body
    # now, sending nothing, and X-Kvscale-Endpoint on answers (how `bench route` measures two
    # replicas' agreement). Off by default: it tells clients the workers' addresses.
    expose_picks: bool = False


@dataclass(frozen=True)
class _Parsed:
    """What the router reads of a request's body before it knows the request's pool."""

    body: bytes
    model: str
    payload: dict
    chat: bool
    stream: bool
    hashes: list[int]


def _error(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


class RouterMetrics:
    def __init__(self, router: Router) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "kvscale_router_requests", "Requests that arrived, by model.", ["model"], registry=r
        )
        self.responses = Counter(
            "kvscale_router_responses",
            "Responses sent, by model and HTTP status.",
            ["model", "code"],
            registry=r,
        )
        self.rejected = Counter(
            "kvscale_router_rejected_requests",
            "Requests the router answered itself, by reason (invalid, unauthorized, unknown_model, "
            "queue_full, client_queue_full, queue_timeout, no_endpoint).",
            ["model", "reason"],
            registry=r,
        )
        self.queued = Gauge(
            "kvscale_router_queued_requests", "Requests waiting in the router.", ["model"], registry=r
        )
        self.in_flight = Gauge(
            "kvscale_router_in_flight_requests",
            "Requests sent to a worker and not finished.",
            ["model"],
            registry=r,
        )
        self.retries = Counter(
            "kvscale_router_retries",
            "Requests moved to another endpoint before their first byte, by reason.",
            ["reason"],
            registry=r,
        )
        self.adapter_picks = Counter(
            "kvscale_router_adapter_picks",
            "Endpoints picked for LoRA adapter requests, by adapter and what the endpoint had: "
            "resident (the adapter in a device slot), room (a slot free for it), none.",
            ["model", "affinity"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvscale_router_queue_wait_seconds",
            "Time requests waited in the router's queue.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.kv_events = Counter(
            "kvscale_router_kv_events",
            "What the workers' KV event streams did, by kind: batch (applied), gap, resync, "
            "synced, restart (a worker's numbers started again), bad (undecodable), timeout (a "
            "replay that did not answer), disconnect (the stream's connection dropped: an "
            "oversize message, or the worker went).",
            ["kind"],
            registry=r,
        )
        self.picks = Counter(
            "kvscale_router_picks",
            "Requests picked for, by the prefix index that scored them: precise (the workers' KV "
            "events, with the request's token ids) or approximate.",
            ["index"],
            registry=r,
        )
        self._models: set[str] = set()
        # The pools' models: named by the router's flags (at most MAX_POOLS), so each has its own
        # label beside the MAX_MODEL_LABELS others (the autoscaler reads each model's demand).
        self._reserved: frozenset[str] = frozenset()
        r.register(_EndpointCollector(router))

    def reserve(self, names: Iterable[str]) -> None:
        self._reserved = frozenset(names)

    def model(self, name: str) -> str:
        if name in self._reserved:
            return name
        if name in self._models or len(self._models) < MAX_MODEL_LABELS:
            self._models.add(name)
            return name
        return "other"

    # -- what the pools report (pool.PoolEvents) ----------------------------------------------------
    def picked(self, request: PickRequest, affinity: str | None) -> None:
        self.picks.labels("precise" if request.prompt is not None else "approximate").inc()
        if affinity is not None and request.model is not None:
            # The model's label was taken (bounded) when it arrived.
            self.adapter_picks.labels(self.model(request.model), affinity).inc()

    def kv_event(self, endpoint: str, what: str) -> None:
        self.kv_events.labels(what).inc()

    def queue_changed(self, label: str, delta: int) -> None:
        self.queued.labels(label).inc(delta)


class _EndpointCollector:
    """Per-endpoint views, read from the router's state at scrape time."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        pools = list(self.router.pools.values())
        ready = set().union(*(p.state.endpoints for p in pools))
        yield GaugeMetricFamily("kvscale_router_endpoints", "Ready endpoints.", value=len(ready))
        age = self.router.source_age()
        if age is not None:
            yield GaugeMetricFamily(
                "kvscale_router_endpoints_age_seconds",
                "Seconds since the endpoint source last heard from the API server.",
                value=age,
            )
        fams = {
            "in_flight": GaugeMetricFamily(
                "kvscale_router_endpoint_in_flight_requests",
                "The router's requests in flight there.",
                labels=["endpoint"],
            ),
            "kv": GaugeMetricFamily(
                "kvscale_router_endpoint_kv_cache_usage_ratio",
                "Its last scraped KV-cache usage.",
                labels=["endpoint"],
            ),
            "waiting": GaugeMetricFamily(
                "kvscale_router_endpoint_requests_waiting",
                "Its last scraped waiting requests.",
                labels=["endpoint"],
            ),
            "index": GaugeMetricFamily(
                "kvscale_router_endpoint_prefix_index_blocks",
                "Blocks its prefix index holds.",
                labels=["endpoint"],
            ),
        }
        seen: set[str] = set()  # a URL in two pools (a misconfiguration) is one series
        for pool in pools:
            state = pool.state
            for e in sorted(state.endpoints - seen):
                seen.add(e)
                m = state.metrics.get(e) or WorkerMetrics()
                fams["in_flight"].add_metric([e], state.in_flight.get(e, 0))
                fams["kv"].add_metric([e], m.kv_usage)
                fams["waiting"].add_metric([e], m.waiting)
                fams["index"].add_metric([e], state.index.size(e))
        yield from fams.values()
        if self.router.legacy:
            return
        # One series per configured pool (at most MAX_POOLS): which model is at zero, which woke.
        endpoints = GaugeMetricFamily(
            "kvscale_router_pool_endpoints", "Ready endpoints of each model's pool.", labels=["model"]
        )
        wakes = CounterMetricFamily(
            "kvscale_router_pool_wakes",
            "Asks for a first worker (scale from zero) made for each model's pool.",
            labels=["model"],
        )
        for pool in pools:
            assert pool.name is not None
            endpoints.add_metric([pool.name], len(pool.state.endpoints))
            wakes.add_metric([pool.name], pool.waker.asks if pool.waker is not None else 0)
        yield endpoints
        yield wakes


WAITING_COMMENT = b": waiting for a worker\n\n"


class Router:
    def __init__(
        self,
        state: RouterState | None = None,
        source: EndpointSource | None = None,
        config: RouterConfig | None = None,
        waker: Waker | None = None,
        api_keys: KeyFile | None = None,
        upstream_key: KeyFile | None = None,
        kv_events: KVEventsSource | None = None,
        tokenizer: PromptTokenizer | None = None,
        tokenizer_from_workers: bool = False,
        pools: Sequence[PoolParts] = (),
    ) -> None:
        """One unnamed pool of workers (`state`, `source`, `waker`, `tokenizer`: every request goes
        there, as with --service/--endpoints), or `pools`: one per model, each request to the one
        its `model` resolves to (--pool). `api_keys`: the client keys the router accepts (None: no
        authentication); `upstream_key`: the workers' key, which replaces the client's
        Authorization on the way to a worker (None: the client's header goes through as it came);
        `kv_events`: where every pool's workers publish their KV events (each pool's precise
        index, its `state.kv_index`, is fed from there); `tokenizer_from_workers`: each pool's
        tokenizer is fetched from one of its ready workers once the router starts."""
        if pools and (state is not None or source is not None or waker is not None or tokenizer is not None):
            raise ValueError("a router takes either pools or one unnamed pool's parts, not both")
        if not pools:
            if state is None or source is None:
                raise ValueError("a router needs a state and an endpoint source, or pools")
            pools = [PoolParts(None, state, source, waker, tokenizer=tokenizer)]
        elif any(p.name is None for p in pools) or len({p.name for p in pools}) < len(pools):
            raise ValueError("pools are named by their models, each once")
        self.api_keys, self.upstream_key = api_keys, upstream_key
        self.config = c = config or RouterConfig()
        self.metrics = RouterMetrics(self)
        per_client = c.max_queued_per_client
        # Each pool its own queue of max_queued places: one model's flood cannot take another's.
        self.pools: dict[str | None, Pool] = {
            p.name: Pool(
                p,
                self.metrics,
                max_queued=c.max_queued,
                max_per_key=max(1, c.max_queued // 4) if per_client is None else per_client,
                queue_timeout_s=c.queue_timeout_s,
                kv_events=kv_events,
                tokenizer_from_workers=tokenizer_from_workers,
            )
            for p in pools
        }
        self.legacy = None in self.pools  # one unnamed pool: every model goes there, as before
        if not self.legacy:
            self.metrics.reserve(name for name in self.pools if name is not None)
        self.started_at = int(time.time())  # `created` of the models /v1/models synthesizes
        self.session: aiohttp.ClientSession | None = None

    # -- the one pool of a router that has one (--service/--endpoints), as before pools ---------------
    @property
    def _only(self) -> Pool:
        if len(self.pools) != 1:
            raise AttributeError("this router has several pools: use router.pools[MODEL]")
        return next(iter(self.pools.values()))

    @property
    def state(self) -> RouterState:
        return self._only.state

    @property
    def source(self) -> EndpointSource:
        return self._only.source

    @property
    def flow(self) -> FlowControl[PickRequest]:
        return self._only.flow

    @property
    def subscriptions(self) -> KVEventSubscriptions | None:
        return self._only.subscriptions

    @property
    def waker(self) -> Waker | None:
        return self._only.waker

    @waker.setter
    def waker(self, waker: Waker | None) -> None:
        self._only.waker = waker

    @property
    def tokenizer(self) -> PromptTokenizer | None:
        return self._only.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: PromptTokenizer | None) -> None:
        self._only.tokenizer = tokenizer

    def set_endpoints(self, urls: list[str]) -> None:
        self._only.set_endpoints(urls)

    def on_metrics(self, endpoint: str, m: WorkerMetrics) -> None:
        self._only.on_metrics(endpoint, m)

    # -- inputs ---------------------------------------------------------------------------------
    def source_age(self) -> float | None:
        """Seconds since the stalest endpoint source last heard from the API (None: none says)."""
        ages = [a for a in (p.age() for p in self.pools.values()) if a is not None]
        return max(ages) if ages else None

    def pool_for(self, model: str) -> Pool:
        """The pool a request for `model` goes to (pool.resolve_pool); UnknownModel when none."""
        if self.legacy:
            return self._only
        key = resolve_pool(
            model,
            {name: frozenset(p.adapters) for name, p in self.pools.items()},
            {name: p.served_adapters() for name, p in self.pools.items()},
        )
        return self.pools[key]

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=30)
        # auto_decompress=False: the bytes a worker sends are the bytes the client gets.
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        c = self.config
        for pool in self.pools.values():
            pool.start(
                self.session,
                scrape_interval_s=c.scrape_interval_s,
                scrape_timeout_s=c.scrape_timeout_s,
                scrape_concurrency=c.scrape_concurrency,
                worker_headers=lambda pool=pool: self._worker_auth(pool),
            )

    def _worker_auth(self, pool: Pool) -> dict[str, str]:
        """The router's own Authorization for a pool's worker (its tokenizer fetch): the pool's
        workers' key (keys=), else the upstream key."""
        keys = pool.api_keys or self.upstream_key
        key = keys.first() if keys is not None else None
        return {"Authorization": f"Bearer {key}"} if key is not None else {}

    async def stop(self, app: web.Application) -> None:
        for pool in self.pools.values():
            await pool.stop()
        if self.session is not None:
            await self.session.close()

    # -- requests ---------------------------------------------------------------------------------
    async def _parse(self, request: web.Request) -> _Parsed:
        limit = self.config.max_body_bytes
        try:
            body = await read_body(request, (limit, limit))
            payload = json.loads(body.decode(request.charset or "utf-8"))
        except web.RequestPayloadError as e:
            raise APIError(400, f"the request body cannot be read: {e}") from None
        except LookupError as e:
            raise APIError(400, f"the request body's charset is unknown: {e}") from None
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(payload, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise APIError(400, "model: a model name (a non-empty string) is required", param="model")
        chat = request.path.endswith("/chat/completions")
        if chat:
            messages = payload.get("messages")
            text = chat_prefix_text(messages) if isinstance(messages, list) else ""
        else:
            text = prompt_prefix_text(payload.get("prompt"))
        hashes = block_hashes(model, text, self.config.block_chars, self.config.max_blocks)
        return _Parsed(body, model, payload, chat, payload.get("stream") is True, hashes)

    def _resolve(self, model: str) -> Pool:
        """The model's pool, or OpenAI's 404 for a model no pool serves (before any queue)."""
        try:
            return self.pool_for(model)
        except UnknownModel:
            shown = model if len(model) <= MAX_MODEL_NAME_ECHO else model[:MAX_MODEL_NAME_ECHO] + "..."
            raise APIError(
                404, f"The model `{shown}` does not exist.", param="model", code="model_not_found"
            ) from None

    @staticmethod
    async def _pick_request(pool: Pool, parsed: _Parsed) -> PickRequest:
        prompt = await pool.token_prompt(parsed.chat, parsed.payload)
        return PickRequest(parsed.hashes, parsed.model, prompt)

    def _forward_headers(self, request: web.Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        if self.upstream_key is not None:  # the client's key stops here; the workers get theirs
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            key = self.upstream_key.first()
            if key is not None:
                headers["Authorization"] = f"Bearer {key}"
        return headers

    def authenticate(self, request: web.Request) -> str:
        """The request's fairness key; raises a 401 APIError when keys are configured and the
        request carries none of them (before its body is read: a stranger costs no upload). With
        pools that each have their own keys (keys=), a key of none of them is refused here too;
        `authorize` then checks the one pool the request's model picks."""
        header = request.headers.get("Authorization", "")
        who = None
        if self.api_keys is not None:
            who = self.api_keys.identify(header)
        elif not self.legacy and all(p.api_keys is not None for p in self.pools.values()):
            who = next((w for p in self.pools.values() if (w := p.api_keys.identify(header))), None)
        else:
            return client_key(None, request.remote)
        if who is None:
            raise self._unauthorized()
        return client_key(who, request.remote)

    def _unauthorized(self) -> APIError:
        self.metrics.rejected.labels("", "unauthorized").inc()  # no model label: not theirs to make
        return APIError(401, "Incorrect or missing API key.", code="invalid_api_key")

    def authorize(self, pool: Pool, request: web.Request, client: str) -> str:
        """The request's fairness key for a pool with its own keys (keys=): a 401 APIError unless
        it carries one of them, whatever another pool or the router accepts (one model's key
        never opens another's queue, its wake-ups or its workers)."""
        if pool.api_keys is None:
            return client
        who = pool.api_keys.identify(request.headers.get("Authorization", ""))
        if who is None:
            raise self._unauthorized()
        return client_key(who, request.remote)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            client = self.authenticate(request)
        except APIError as e:
            self.metrics.responses.labels("", str(e.status)).inc()
            return _error(e)
        try:
            parsed = await self._parse(request)
        except APIError as e:
            self.metrics.rejected.labels("", "invalid").inc()
            self.metrics.responses.labels("", str(e.status)).inc()
            return _error(e)
        try:
            pool = self._resolve(parsed.model)
        except APIError as e:  # the client's name makes no label: it is not a model here
            self.metrics.rejected.labels("", "unknown_model").inc()
            self.metrics.responses.labels("", str(e.status)).inc()
            return _error(e)
        try:
            client = self.authorize(pool, request, client)
        except APIError as e:
            self.metrics.responses.labels("", str(e.status)).inc()
            return _error(e)
        pick = await self._pick_request(pool, parsed)
        label = self.metrics.model(parsed.model)
        self.metrics.requests.labels(label).inc()
        resp = await self._route(request, pool, parsed.body, label, pick, parsed.stream, client)
        self.metrics.responses.labels(label, str(resp.status)).inc()
        return resp

    async def pick(self, request: web.Request) -> web.Response:
        """The dry run of a completion's pick (expose_picks): {"endpoint": URL or null,
        "prefix_match": the blocks of its prefix the index says that endpoint holds}, in the pool
        the request's model resolves to."""
        client = self.authenticate(request)
        parsed = await self._parse(request)
        pool = self._resolve(parsed.model)
        self.authorize(pool, request, client)
        pick = await self._pick_request(pool, parsed)
        state = pool.state
        endpoint, _ = state.peek(pick.hashes, (), pick.model, pick.prompt)
        match = 0
        if endpoint is not None:
            adapter = state.adapter_of(pick.model)
            cands = state.candidates(pick.hashes, adapter, pick.prompt)
            match = next(c.prefix_match for c in cands if c.name == endpoint)
        return web.json_response({"endpoint": endpoint, "prefix_match": match})

    def _refuse(self, label: str, reason: str, err: APIError) -> web.Response:
        self.metrics.rejected.labels(label, reason).inc()
        return _error(err)

    async def _acquire(
        self,
        request: web.Request,
        pool: Pool,
        label: str,
        pick: PickRequest,
        stream: bool,
        client: str = "",
    ):
        """(an endpoint from the pool's flow control, the stream's response if waiting started it).
        While the request waits: asks for a worker when the pool has none ready, and a stream gets
        an SSE comment every heartbeat_s (its 200 and headers go with the first)."""
        pool.wake()
        acquire = asyncio.ensure_future(pool.flow.acquire(client or label, pick, label))
        early: web.StreamResponse | None = None
        try:
            while True:
                done, _ = await asyncio.wait({acquire}, timeout=self.config.heartbeat_s)
                if done:
                    return acquire.result(), early
                pool.wake()
                if stream:
                    if early is None:
                        early = web.StreamResponse(
                            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                        )
                        await early.prepare(request)
                    await early.write(WAITING_COMMENT)
        except BaseException as e:
            if not acquire.done():
                acquire.cancel()  # it leaves the queue
            elif not acquire.cancelled() and acquire.exception() is None:
                pool.done(acquire.result())  # handed one as its client left: it goes back
            if isinstance(e, (QueueFull, QueueTimeout)):
                e.early = early  # type: ignore[attr-defined]
            raise

    async def _route(
        self,
        request: web.Request,
        pool: Pool,
        body: bytes,
        label: str,
        pick: PickRequest,
        stream: bool = False,
        client: str = "",
    ) -> web.StreamResponse:
        c = self.config
        retry_after = {"Retry-After": str(c.retry_after_s)}
        queued_at = time.monotonic()
        early: web.StreamResponse | None = None
        try:
            endpoint, early = await self._acquire(request, pool, label, pick, stream, client)
        except ClientQueueFull:
            return self._refuse(
                label,
                "client_queue_full",
                APIError(
                    429,
                    f"this client already has {pool.flow.max_per_key} requests waiting in the router",
                    "rate_limit_exceeded",
                    code="client_queue_full",
                    headers=retry_after,
                ),
            )
        except QueueFull:
            return self._refuse(
                label,
                "queue_full",
                APIError(
                    429,
                    "the router's queue is full",
                    "rate_limit_exceeded",
                    code="queue_full",
                    headers=retry_after,
                ),
            )
        except QueueTimeout as e:
            refusal = self._refuse(
                label,
                "queue_timeout",
                APIError(
                    503,
                    f"no worker could take the request within {c.queue_timeout_s:g}s",
                    "server_error",
                    code="queue_timeout",
                    headers=retry_after,
                ),
            )
            return await _as_event(getattr(e, "early", None), refusal)
        self.metrics.queue_wait.observe(time.monotonic() - queued_at)
        headers = self._forward_headers(request)
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=c.connect_timeout_s, sock_read=c.read_timeout_s
        )
        tried: list[str] = []
        last: tuple[int, bytes, dict[str, str]] | None = None
        while endpoint is not None:
            tried.append(endpoint)
            in_flight = self.metrics.in_flight.labels(label)
            in_flight.inc()
            try:  # released however the attempt ends: answered, refused, failed, or the client left
                outcome = await self._attempt(
                    request,
                    endpoint,
                    body,
                    headers,
                    timeout,
                    len(tried) <= c.max_retries,
                    early,
                    lambda e=endpoint: pool.state.prefill_done(e, pick.prompt),
                )
            finally:
                in_flight.dec()
                pool.state.request_done(endpoint, pick.prompt)
                pool.done(endpoint)
            if isinstance(outcome, web.StreamResponse):
                return outcome
            reason, answer = outcome
            last = answer or last
            endpoint = self._next(pool, pick, tried)
            if endpoint is not None:
                self.metrics.retries.labels(reason).inc()
        if last is not None:  # every endpoint tried said 429/503: the last one's answer, as it was
            status, data, hdrs = last
            return await _as_event(early, web.Response(status=status, body=data, headers=hdrs))
        refusal = self._refuse(
            label,
            "no_endpoint",
            APIError(
                503, "no worker could be reached", "server_error", code="no_endpoint", headers=retry_after
            ),
        )
        return await _as_event(early, refusal)

    async def _attempt(
        self,
        request: web.Request,
        endpoint: str,
        body: bytes,
        headers: dict[str, str],
        timeout: aiohttp.ClientTimeout,
        may_retry: bool,
        early: web.StreamResponse | None = None,
        first_byte: Callable[[], None] = lambda: None,
    ) -> web.StreamResponse | tuple[str, tuple[int, bytes, dict[str, str]] | None]:
        """One endpoint's try: the client's response once a byte of it went out, else why to retry
        (and the worker's refusal, should every endpoint refuse). `first_byte`: called at the first
        chunk of the answer's body (its prefill is done)."""
        assert self.session is not None
        try:
            upstream = await self.session.request(
                request.method, endpoint + request.path_qs, data=body, headers=headers, timeout=timeout
            )
        except aiohttp.SocketTimeoutError:
            # The worker took the request and said nothing for read_timeout_s: it may still be
            # working on it, so it is not sent to another (that would run it twice).
            logger.warning("endpoint silent past the read timeout", extra={"endpoint": endpoint})
            err = APIError(
                504,
                f"the worker sent nothing within {self.config.read_timeout_s:g}s",
                "server_error",
                code="upstream_timeout",
            )
            return await _as_event(early, _error(err))
        except (aiohttp.ClientConnectionError, TimeoutError) as e:
            logger.info(
                "endpoint failed before the first byte", extra={"endpoint": endpoint, "error": repr(e)}
            )
            return "connect", None
        if upstream.status in RETRYABLE_STATUS and may_retry:
            try:
                return str(upstream.status), (
                    upstream.status,
                    await upstream.read(),
                    _response_headers(upstream),
                )
            except aiohttp.ClientError:
                return str(upstream.status), None
            finally:
                upstream.release()
        if early is not None:
            return await self._stream_into(request, upstream, early, first_byte)
        return await self._stream(request, upstream, first_byte, endpoint)

    def _next(self, pool: Pool, pick: PickRequest, tried: list[str]) -> str | None:
        """Another endpoint of the pool for a retry (never one tried already; a retry does not
        queue)."""
        if len(tried) > self.config.max_retries:
            return None
        return pool.choose(pick, exclude=tried)

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        first_byte: Callable[[], None] = lambda: None,
        endpoint: str | None = None,
    ) -> web.StreamResponse:
        """The worker's answer to the client as it arrives: status, headers, then each chunk (with
        expose_picks, the endpoint that answers in X-Kvscale-Endpoint)."""
        headers = _response_headers(upstream)
        if self.config.expose_picks and endpoint is not None:
            headers[PICK_HEADER] = endpoint
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        if upstream.content_length is not None:
            resp.content_length = upstream.content_length
        try:
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                first_byte()
                await resp.write(chunk)
        except aiohttp.ClientError as e:
            # The worker went away mid-answer: the client's answer ends abruptly too (never a clean
            # end that would pass a truncated answer off as whole).
            logger.warning("endpoint failed mid-stream", extra={"error": repr(e)})
            upstream.close()
            if request.transport is not None:
                request.transport.close()
            return resp
        except BaseException:  # the client left (cancelled): the worker sees its connection close
            upstream.close()
            raise
        upstream.release()
        await resp.write_eof()
        return resp

    async def _stream_into(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        early: web.StreamResponse,
        first_byte: Callable[[], None] = lambda: None,
    ) -> web.StreamResponse:
        """The worker's answer into a stream whose 200 and headers already went out (it waited):
        an SSE answer's chunks as they come; any other answer (an error) as one `data:` event and
        `data: [DONE]`, which is how OpenAI-compatible servers report an error mid-stream."""
        try:
            if upstream.status == 200 and upstream.content_type == "text/event-stream":
                async for chunk in upstream.content.iter_any():
                    first_byte()
                    await early.write(chunk)
                upstream.release()
                await early.write_eof()
                return early
            data = await upstream.read()
            upstream.release()
        except aiohttp.ClientError as e:
            logger.warning("endpoint failed mid-stream", extra={"error": repr(e)})
            upstream.close()
            if request.transport is not None:
                request.transport.close()
            return early
        except BaseException:
            upstream.close()
            raise
        return await _as_event(early, web.Response(status=upstream.status, body=data))

    async def models(self, request: web.Request) -> web.StreamResponse:
        """One pool: a pass-through to one endpoint (any can answer: they serve the same model).
        Pools: the union of each pool's list (from one of its ready endpoints; a pool none of whose
        endpoints answers, at zero or down, listed from its flags), first entry of an id kept.
        Never wakes a pool: listing models is no demand for one."""
        assert self.session is not None
        self.authenticate(request)
        if self.legacy:
            return await self._models_of_one(request, self._only)
        headers = {**self._forward_headers(request), "Accept-Encoding": "identity"}  # parsed here
        # A pool with its own keys is listed only to a client holding one of them: its name is not
        # announced to strangers.
        key = request.headers.get("Authorization", "")
        shown = [p for p in self.pools.values() if p.api_keys is None or p.api_keys.identify(key)]
        answers = await asyncio.gather(*(self._pool_models(p, headers) for p in shown))
        data: list[dict] = []
        seen: set[str] = set()
        for answer in answers:
            if isinstance(answer, web.Response):
                return answer  # a worker refused the client's credentials: that is the answer
            for entry in answer:
                if entry["id"] not in seen:
                    seen.add(entry["id"])
                    data.append(entry)
        return web.json_response({"object": "list", "data": data})

    def _by_load(self, pool: Pool) -> list[str]:
        return sorted(pool.state.endpoints, key=lambda e: pool.state.in_flight.get(e, 0))

    async def _models_of_one(self, request: web.Request, pool: Pool) -> web.StreamResponse:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=10, sock_connect=self.config.connect_timeout_s)
        for endpoint in self._by_load(pool):
            try:
                async with self.session.get(
                    endpoint + "/v1/models", headers=self._forward_headers(request), timeout=timeout
                ) as r:
                    return web.Response(status=r.status, body=await r.read(), headers=_response_headers(r))
            except (aiohttp.ClientError, TimeoutError):
                continue
        return _error(APIError(503, "no worker could be reached", "server_error", code="no_endpoint"))

    async def _pool_models(self, pool: Pool, headers: dict[str, str]) -> list[dict] | web.Response:
        """A pool's /v1/models entries: its endpoints' (least loaded first, the first that answers
        a list within 10 s in all), else its model and adapters= as the flags say. A worker's 401 or
        403 comes back as it was (the client's credentials are the workers' business)."""
        assert self.session is not None and pool.name is not None
        timeout = aiohttp.ClientTimeout(total=10, sock_connect=self.config.connect_timeout_s)
        try:
            async with asyncio.timeout(10):
                for endpoint in self._by_load(pool):
                    try:
                        async with self.session.get(
                            endpoint + "/v1/models", headers=headers, timeout=timeout
                        ) as r:
                            body = await read_capped(r, MAX_MODELS_BYTES)
                            if r.status in (401, 403):
                                return web.Response(status=r.status, body=body, headers=_response_headers(r))
                            if r.status == 200:
                                return _model_entries(json.loads(body))
                    except (aiohttp.ClientError, TimeoutError, TooLarge, ValueError, RecursionError):
                        continue
        except TimeoutError:
            pass
        return synthesized_models(pool.name, pool.adapters, self.started_at)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """503 until every pool's first list; then 200, with the lists' staleness reported: past
        the watch's bound the router keeps routing to the endpoints it last knew (as kube-proxy
        does while the API server is away) rather than turn an API outage into a data-plane one."""
        pools = self.pools.values()
        if not all(p.source.synced for p in pools):
            return web.json_response({"status": "syncing"}, status=503)
        age = self.source_age()
        body: dict = {
            "status": "stale" if any(p.stale() for p in pools) else "ready",
            "endpoints": len(set().union(*(p.state.endpoints for p in pools))),
            "endpoints_age_s": None if age is None else round(age, 1),
        }
        if not self.legacy:
            body["pools"] = {p.name: len(p.state.endpoints) for p in pools}
        return web.json_response(body)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


async def _as_event(early: web.StreamResponse | None, answer: web.Response) -> web.StreamResponse:
    """`answer` as it is, or, into a stream already started, as its last event."""
    if early is None:
        return answer
    body = answer.body if isinstance(answer.body, bytes) else b"{}"
    await early.write(b"data: " + body.replace(b"\n", b" ") + b"\n\ndata: [DONE]\n\n")
    await early.write_eof()
    return early


def _model_entries(answer: object) -> list[dict]:
    """The entries of a worker's /v1/models answer that have an id (the worker is a network peer:
    anything else is dropped); ValueError when it is not a list answer."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise ValueError("not a model list")
    return [e for e in data if isinstance(e, dict) and isinstance(e.get("id"), str)]


def _response_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}


@web.middleware
async def _errors(request: web.Request, handler):
    """aiohttp's own errors (unknown path, wrong method, a body over client_max_size) in OpenAI's shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return _error(
            APIError(e.status, f"{e.reason}: {request.method} {request.path}", code=code, headers=allow)
        )
    except APIError as e:
        return _error(e)


def build_app(router: Router) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=router.config.max_body_bytes)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.completions)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/ready", router.ready)
    app.router.add_get("/metrics", router.prometheus)
    if router.config.expose_picks:
        app.router.add_post("/kvscale/pick/v1/completions", router.pick)
        app.router.add_post("/kvscale/pick/v1/chat/completions", router.pick)
    return app
