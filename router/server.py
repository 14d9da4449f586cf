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
from collections.abc import Callable, Iterable
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
from prometheus_client.core import GaugeMetricFamily

from kvscale.common.errors import APIError
from kvscale.common.request_body import read_body
from kvscale.router.auth import KeyFile, client_key
from kvscale.router.kv_events import KVEventsSource, KVEventSubscriptions
from kvscale.router.kv_index import KVBlockIndex, TokenPrompt
from kvscale.router.prefix_index import (
    DEFAULT_BLOCK_CHARS,
    DEFAULT_MAX_BLOCKS,
    block_hashes,
    chat_prefix_text,
    prompt_prefix_text,
)
from kvscale.router.queue import ClientQueueFull, FlowControl, QueueFull, QueueTimeout
from kvscale.router.scrape import Scraper
from kvscale.router.state import PickRequest, RouterState, WorkerMetrics
from kvscale.router.tokenizer import PromptTokenizer, tokenizer_from_workers
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
            "Requests the router answered itself, by reason (invalid, unauthorized, queue_full, "
            "client_queue_full, queue_timeout, no_endpoint).",
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
            "replay that did not answer).",
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
        r.register(_EndpointCollector(router))

    def model(self, name: str) -> str:
        if name in self._models or len(self._models) < MAX_MODEL_LABELS:
            self._models.add(name)
            return name
        return "other"


class _EndpointCollector:
    """Per-endpoint views, read from the router's state at scrape time."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        state = self.router.state
        yield GaugeMetricFamily("kvscale_router_endpoints", "Ready endpoints.", value=len(state.endpoints))
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
        for e in sorted(state.endpoints):
            m = state.metrics.get(e) or WorkerMetrics()
            fams["in_flight"].add_metric([e], state.in_flight.get(e, 0))
            fams["kv"].add_metric([e], m.kv_usage)
            fams["waiting"].add_metric([e], m.waiting)
            fams["index"].add_metric([e], state.index.size(e))
        yield from fams.values()


WAITING_COMMENT = b": waiting for a worker\n\n"


class Router:
    def __init__(
        self,
        state: RouterState,
        source,
        config: RouterConfig | None = None,
        waker: Waker | None = None,
        api_keys: KeyFile | None = None,
        upstream_key: KeyFile | None = None,
        kv_events: KVEventsSource | None = None,
        tokenizer: PromptTokenizer | None = None,
        tokenizer_from_workers: bool = False,
    ) -> None:
        """`api_keys`: the client keys the router accepts (None: no authentication);
        `upstream_key`: the workers' key, which replaces the client's Authorization on the way
        to a worker (None: the client's header goes through as it came); `kv_events`: where the
        workers publish their KV events (the precise index, which `state.kv_index` holds, is fed
        from there), `tokenizer`: the model's, for the token ids it matches."""
        self.state, self.source, self.waker = state, source, waker
        self.tokenizer = tokenizer
        # `tokenizer_from_workers`: fetched from a ready worker once the router starts.
        self.tokenizer_from_workers = tokenizer_from_workers
        self._tokenizer_task: asyncio.Task | None = None
        self.subscriptions: KVEventSubscriptions | None = None
        if kv_events is not None:
            if state.kv_index is None:
                state.kv_index = KVBlockIndex()
            self.subscriptions = KVEventSubscriptions(state.kv_index, kv_events, self._on_kv_event)
        self.api_keys, self.upstream_key = api_keys, upstream_key
        self.config = c = config or RouterConfig()
        self.metrics = RouterMetrics(self)
        per_client = c.max_queued_per_client
        self.flow: FlowControl[PickRequest] = FlowControl(
            self._choose,
            self._release,
            max_queued=c.max_queued,
            timeout_s=c.queue_timeout_s,
            on_change=lambda label, d: self.metrics.queued.labels(label).inc(d),
            max_per_key=max(1, c.max_queued // 4) if per_client is None else per_client,
        )
        self.session: aiohttp.ClientSession | None = None
        self._scraper_task: asyncio.Task | None = None

    # -- inputs ---------------------------------------------------------------------------------
    def source_age(self) -> float | None:
        """Seconds since the endpoint source last heard from the API (sources may not say)."""
        age = getattr(self.source, "age", None)
        return age() if age is not None else None

    def set_endpoints(self, urls: list[str]) -> None:
        self.state.set_endpoints(urls)
        if self.subscriptions is not None:
            self.subscriptions.set_endpoints(self.state.endpoints)
        self.flow.dispatch()

    def _on_kv_event(self, endpoint: str, what: str) -> None:
        self.metrics.kv_events.labels(what).inc()

    def on_metrics(self, endpoint: str, m: WorkerMetrics) -> None:
        self.state.update_metrics(endpoint, m)
        self.flow.dispatch()

    def _choose(self, req: PickRequest, exclude: Iterable[str] = ()) -> str | None:
        """The state's pick (counted in flight there), and, for an adapter, what it found there."""
        endpoint = self.state.choose(req.hashes, exclude, req.model, req.prompt)
        if endpoint is not None:
            self.metrics.picks.labels("precise" if req.prompt is not None else "approximate").inc()
        if endpoint is not None and req.model is not None:
            affinity = self.state.affinity(endpoint, req.model)
            if affinity is not None:  # the model's label was taken (bounded) when it arrived
                self.metrics.adapter_picks.labels(self.metrics.model(req.model), affinity).inc()
        return endpoint

    def _release(self, endpoint: str) -> None:
        self.state.release(endpoint)

    def _done(self, endpoint: str) -> None:
        self.state.release(endpoint)
        self.flow.dispatch()

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=30)
        # auto_decompress=False: the bytes a worker sends are the bytes the client gets.
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.source.start(self.set_endpoints)
        c = self.config
        scraper = Scraper(
            self.session,
            lambda: self.state.endpoints,
            self.on_metrics,
            interval_s=c.scrape_interval_s,
            timeout_s=c.scrape_timeout_s,
            concurrency=c.scrape_concurrency,
        )
        self._scraper_task = asyncio.create_task(scraper.run())
        if self.tokenizer is None and self.tokenizer_from_workers:
            self._tokenizer_task = asyncio.create_task(self._fetch_tokenizer())

    async def _fetch_tokenizer(self) -> None:
        assert self.session is not None
        headers = {}
        key = self.upstream_key.first() if self.upstream_key is not None else None
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        self.tokenizer = await tokenizer_from_workers(self.session, lambda: self.state.endpoints, headers)

    async def stop(self, app: web.Application) -> None:
        self.source.stop()
        if self.waker is not None:
            await self.waker.close()
        if self._scraper_task is not None:
            self._scraper_task.cancel()
        if self._tokenizer_task is not None:
            self._tokenizer_task.cancel()
        if self.subscriptions is not None:
            await self.subscriptions.close()
        if self.session is not None:
            await self.session.close()

    # -- requests ---------------------------------------------------------------------------------
    async def _parse(self, request: web.Request) -> tuple[bytes, str, PickRequest, bool]:
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
        return (
            body,
            model,
            PickRequest(hashes, model, await self._token_prompt(chat, payload)),
            (payload.get("stream") is True),
        )

    async def _token_prompt(self, chat: bool, payload: dict) -> TokenPrompt | None:
        """The prompt as the worker's token ids (for the precise index), when it has any synced
        endpoint to match them at and the ids can be had: a prompt of ids, or the tokenizer."""
        kv = self.state.kv_index
        if kv is None or not any(kv.synced(e) for e in self.state.endpoints):
            return None
        salt = payload.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        prompt = payload.get("prompt")
        if not chat and isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return TokenPrompt(prompt, salt)
        if self.tokenizer is None:
            return None
        ids = await self.tokenizer.token_ids_async(chat, payload)
        return TokenPrompt(ids, salt) if ids else None

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
        request carries none of them (before its body is read: a stranger costs no upload)."""
        who = None
        if self.api_keys is not None:
            who = self.api_keys.identify(request.headers.get("Authorization", ""))
            if who is None:
                self.metrics.rejected.labels("", "unauthorized").inc()
                raise APIError(401, "Incorrect or missing API key.", code="invalid_api_key")
        return client_key(who, request.remote)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            client = self.authenticate(request)
        except APIError as e:
            self.metrics.responses.labels("", str(e.status)).inc()
            return _error(e)
        try:
            body, model, pick, stream = await self._parse(request)
        except APIError as e:
            self.metrics.rejected.labels("", "invalid").inc()
            self.metrics.responses.labels("", str(e.status)).inc()
            return _error(e)
        label = self.metrics.model(model)
        self.metrics.requests.labels(label).inc()
        resp = await self._route(request, body, label, pick, stream, client)
        self.metrics.responses.labels(label, str(resp.status)).inc()
        return resp

    async def pick(self, request: web.Request) -> web.Response:
        """The dry run of a completion's pick (expose_picks): {"endpoint": URL or null,
        "prefix_match": the blocks of its prefix the index says that endpoint holds}."""
        self.authenticate(request)
        _, _, pick, _ = await self._parse(request)
        endpoint, _ = self.state.peek(pick.hashes, (), pick.model, pick.prompt)
        match = 0
        if endpoint is not None:
            adapter = self.state.adapter_of(pick.model)
            cands = self.state.candidates(pick.hashes, adapter, pick.prompt)
            match = next(c.prefix_match for c in cands if c.name == endpoint)
        return web.json_response({"endpoint": endpoint, "prefix_match": match})

    def _refuse(self, label: str, reason: str, err: APIError) -> web.Response:
        self.metrics.rejected.labels(label, reason).inc()
        return _error(err)

    def _wake(self) -> None:
        if self.waker is not None and not self.state.endpoints:
            self.waker.wake()  # no worker ready: ask for one (single-flight)

    async def _acquire(
        self, request: web.Request, label: str, pick: PickRequest, stream: bool, client: str = ""
    ):
        """(an endpoint from flow control, the stream's response if waiting started it). While the
        request waits: asks for a worker when none is ready, and a stream gets an SSE comment
        every heartbeat_s (its 200 and headers go with the first)."""
        self._wake()
        acquire = asyncio.ensure_future(self.flow.acquire(client or label, pick, label))
        early: web.StreamResponse | None = None
        try:
            while True:
                done, _ = await asyncio.wait({acquire}, timeout=self.config.heartbeat_s)
                if done:
                    return acquire.result(), early
                self._wake()
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
                self._done(acquire.result())  # handed one as its client left: it goes back
            if isinstance(e, (QueueFull, QueueTimeout)):
                e.early = early  # type: ignore[attr-defined]
            raise

    async def _route(
        self,
        request: web.Request,
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
            endpoint, early = await self._acquire(request, label, pick, stream, client)
        except ClientQueueFull:
            return self._refuse(
                label,
                "client_queue_full",
                APIError(
                    429,
                    f"this client already has {self.flow.max_per_key} requests waiting in the router",
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
                    lambda e=endpoint: self.state.prefill_done(e, pick.prompt),
                )
            finally:
                in_flight.dec()
                self.state.request_done(endpoint, pick.prompt)
                self._done(endpoint)
            if isinstance(outcome, web.StreamResponse):
                return outcome
            reason, answer = outcome
            last = answer or last
            endpoint = self._next(pick, tried)
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

    def _next(self, pick: PickRequest, tried: list[str]) -> str | None:
        """Another endpoint for a retry (never one tried already; a retry does not queue)."""
        if len(tried) > self.config.max_retries:
            return None
        return self._choose(pick, exclude=tried)

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
        """Pass-through to one endpoint (any can answer: they serve the same model)."""
        assert self.session is not None
        self.authenticate(request)
        timeout = aiohttp.ClientTimeout(total=10, sock_connect=self.config.connect_timeout_s)
        for endpoint in sorted(self.state.endpoints, key=lambda e: self.state.in_flight.get(e, 0)):
            try:
                async with self.session.get(
                    endpoint + "/v1/models", headers=self._forward_headers(request), timeout=timeout
                ) as r:
                    return web.Response(status=r.status, body=await r.read(), headers=_response_headers(r))
            except (aiohttp.ClientError, TimeoutError):
                continue
        return _error(APIError(503, "no worker could be reached", "server_error", code="no_endpoint"))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """503 until the first list; then 200, with the list's staleness reported: past the
        watch's bound the router keeps routing to the endpoints it last knew (as kube-proxy does
        while the API server is away) rather than turn an API outage into a data-plane one."""
        if not self.source.synced:
            return web.json_response({"status": "syncing"}, status=503)
        age = self.source_age()
        stale = getattr(self.source, "stale", None)
        body = {
            "status": "stale" if stale is not None and stale() else "ready",
            "endpoints": len(self.state.endpoints),
            "endpoints_age_s": None if age is None else round(age, 1),
        }
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
