"""A pool: the workers that serve one model behind the router, and everything the router keeps
for them (issue 31: one endpoint for many models).

Per pool: its endpoint source (a Service's EndpointSlices, or static URLs), its state (ready set,
scraped metrics, in-flight counts, prefix indexes), its own flow control (so one model's flood
fills its own queue, never another's: a fairness budget per pool), its own waker (a request for a
model at zero wakes that model's Deployment only), its KV-event subscriptions, its tokenizer and
its scrapes. A router started with `--service`/`--endpoints` has one pool, unnamed, which takes
every request as before; with `--pool` each request's `model` picks its pool (`resolve_pool`), and
a model no pool serves is refused before any queue.

`parse_pool_spec(s)` and `resolve_pool` are pure (unit-tested); `Pool` is the thin I/O around them.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from kvscale.router.auth import KeyFile
from kvscale.router.kv_events import KVEventsSource, KVEventSubscriptions
from kvscale.router.kv_index import KVBlockIndex, TokenPrompt
from kvscale.router.queue import FlowControl
from kvscale.router.scrape import Scraper
from kvscale.router.state import PickRequest, RouterState, WorkerMetrics
from kvscale.router.tokenizer import PromptTokenizer, tokenizer_from_workers
from kvscale.router.wake import Waker

# A budget: each pool costs a watch thread, a scrape loop, a queue and label values of its own.
MAX_POOLS = 64
_URL_SCHEMES = ("http://", "https://")
_SERVICE = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")  # RFC 1035 label: a Service's name
_DEPLOYMENT = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # RFC 1123 subdomain
_NAME = re.compile(r"[^\s,=|]+")  # a model or adapter name: what the syntax leaves free
_KEYS = ("scale", "adapters", "keys")


class UnknownModel(LookupError):
    """No pool serves the request's model (the router's 404 `model_not_found`)."""


@dataclass(frozen=True)
class PoolSpec:
    """One `--pool MODEL=SOURCE[,scale=DEPLOYMENT][,adapters=A|B][,keys=FILE]`: exactly one of
    `service` and `urls` is set."""

    model: str
    service: str | None = None
    urls: tuple[str, ...] = ()
    scale: str | None = None  # the Deployment to scale from zero
    adapters: tuple[str, ...] = ()  # LoRA adapters it serves, routed here even while at zero
    # Its workers' API keys (a file, one a line): a client must present one to reach this pool,
    # and the router's own calls to its workers (the tokenizer) carry the first.
    keys: str | None = None


def parse_pool_spec(text: str) -> PoolSpec:
    """One --pool value; ValueError saying what is wrong with it."""
    model, eq, rest = text.partition("=")
    if not eq or not model:
        raise ValueError(
            f"--pool {text!r}: expected MODEL=SOURCE[,scale=DEPLOYMENT][,adapters=A|B][,keys=FILE]"
        )
    if not _NAME.fullmatch(model):
        raise ValueError(f"--pool {text!r}: the model name {model!r} has a space or one of , = |")
    source, *options = rest.split(",")
    if not source:
        raise ValueError(f"--pool {text!r}: the source (a Service, or URLs joined with +) is empty")
    if source.startswith(_URL_SCHEMES):
        urls = tuple(source.split("+"))
        bad = [u for u in urls if not u.startswith(_URL_SCHEMES) or u in _URL_SCHEMES]
        if bad:
            raise ValueError(f"--pool {text!r}: not worker URLs: {bad}")
        spec: dict[str, Any] = {"urls": urls}
    elif _SERVICE.fullmatch(source):
        spec = {"service": source}
    else:
        raise ValueError(
            f"--pool {text!r}: the source {source!r} is neither a Service name nor http(s):// URLs"
        )
    for option in options:
        key, eq, value = option.partition("=")
        if key not in _KEYS:
            raise ValueError(f"--pool {text!r}: unknown key {key!r} (one of {', '.join(_KEYS)})")
        if key in spec:
            raise ValueError(f"--pool {text!r}: {key}= given twice")
        if not eq or not value:
            raise ValueError(f"--pool {text!r}: {key}= is empty")
        if key == "scale":
            if not _DEPLOYMENT.fullmatch(value):
                raise ValueError(f"--pool {text!r}: scale={value!r} is not a Deployment name")
            spec["scale"] = value
        elif key == "keys":
            if not value.startswith("/"):
                raise ValueError(f"--pool {text!r}: keys={value!r} is not an absolute path")
            spec["keys"] = value
        else:
            # `|`: adapter names may hold `+` (the operator's grammar allows ._:/@+-).
            adapters = tuple(value.split("|"))
            if not all(_NAME.fullmatch(a) for a in adapters):
                raise ValueError(f"--pool {text!r}: adapters= has an empty name or a space")
            if len(set(adapters)) < len(adapters) or model in adapters:
                raise ValueError(f"--pool {text!r}: adapters= names one twice, or the model itself")
            spec["adapters"] = adapters
    return PoolSpec(model, **spec)


def parse_pool_specs(texts: Sequence[str]) -> list[PoolSpec]:
    """Every --pool, checked together: at most MAX_POOLS, each model once, and each adapter name in
    one pool only and not another pool's model (a request for it would have two homes)."""
    if len(texts) > MAX_POOLS:
        raise ValueError(f"--pool: at most {MAX_POOLS} pools ({len(texts)} given)")
    specs = [parse_pool_spec(t) for t in texts]
    models = [s.model for s in specs]
    twice = sorted({m for m in models if models.count(m) > 1})
    if twice:
        raise ValueError(f"--pool: each model once; given more than once: {twice}")
    home: dict[str, str] = {}
    for s in specs:
        for a in s.adapters:
            if a in models:
                raise ValueError(f"--pool {s.model}: adapter {a!r} is also a pool's model")
            if a in home:
                raise ValueError(f"--pool: adapter {a!r} listed in pools {home[a]!r} and {s.model!r}")
            home[a] = s.model
    return specs


def resolve_pool(
    model: str,
    adapters: Mapping[str | None, AbstractSet[str]],
    served: Mapping[str | None, AbstractSet[str]] | None = None,
) -> str | None:
    """The key of the pool a request for `model` goes to: the pool named `model`; else the first
    (in the flags' order) whose `adapters=` lists it; else the first whose scraped workers serve
    it as an adapter (`served`); else, for a router of one unnamed pool (key None), that pool,
    which takes every model as before (its workers answer a name they do not know). UnknownModel
    when none: the router refuses it before any queue."""
    if model in adapters:
        return model
    for key, names in adapters.items():
        if model in names:
            return key
    for key, names in (served or {}).items():
        if model in names:
            return key
    if None in adapters:
        return None
    raise UnknownModel(model)


def synthesized_models(model: str, adapters: Iterable[str], created: int) -> list[dict[str, Any]]:
    """/v1/models entries for a pool none of whose workers answered (at zero, or down): its model
    and its configured adapters, as OpenAI's list shapes them (vLLM's `parent` for an adapter)."""
    entry = {"id": model, "object": "model", "created": created, "owned_by": "kvscale"}
    return [entry] + [{**entry, "id": a, "parent": model} for a in adapters]


class EndpointSource(Protocol):
    """endpoints.py's sources (SliceWatcher, StaticEndpoints); `age()`/`stale()` are optional."""

    synced: bool

    def start(self, publish: Callable[[list[str]], None]) -> None: ...

    def stop(self) -> None: ...


class PoolEvents(Protocol):
    """What a pool reports to the router's metrics (server.py's RouterMetrics)."""

    def picked(self, request: PickRequest, affinity: str | None) -> None: ...

    def kv_event(self, endpoint: str, what: str) -> None: ...

    def queue_changed(self, label: str, delta: int) -> None: ...


@dataclass
class PoolParts:
    """What a pool is made of (main.py builds these from the flags; the router adds the parts
    every pool shares: its flow limits, the KV-event ports, the metrics)."""

    name: str | None  # the model it serves; None: the one unnamed pool (--service/--endpoints)
    state: RouterState
    source: EndpointSource
    waker: Waker | None = None
    adapters: tuple[str, ...] = ()
    tokenizer: PromptTokenizer | None = None
    api_keys: KeyFile | None = None  # its workers' keys (keys=): None, open to every client


class Pool:
    def __init__(
        self,
        parts: PoolParts,
        events: PoolEvents,
        *,
        max_queued: int,
        max_per_key: int,
        queue_timeout_s: float,
        kv_events: KVEventsSource | None = None,
        tokenizer_from_workers: bool = False,
    ) -> None:
        """`kv_events`: where the workers publish their KV events (the precise index, which
        `state.kv_index` holds, is fed from there); `tokenizer_from_workers`: the tokenizer is
        fetched from one of this pool's ready workers once the router starts."""
        self.name, self.state, self.source = parts.name, parts.state, parts.source
        self.waker, self.adapters, self.tokenizer = parts.waker, parts.adapters, parts.tokenizer
        self.api_keys = parts.api_keys
        self.events = events
        self.tokenizer_from_workers = tokenizer_from_workers
        self.subscriptions: KVEventSubscriptions | None = None
        if kv_events is not None:
            if self.state.kv_index is None:
                self.state.kv_index = KVBlockIndex()
            self.subscriptions = KVEventSubscriptions(
                self.state.kv_index, kv_events, events.kv_event, self.state.update_load
            )
        self.flow: FlowControl[PickRequest] = FlowControl(
            self.choose,
            self.release,
            max_queued=max_queued,
            timeout_s=queue_timeout_s,
            on_change=events.queue_changed,
            max_per_key=max_per_key,
        )
        self._scraper_task: asyncio.Task | None = None
        self._tokenizer_task: asyncio.Task | None = None

    # -- inputs -----------------------------------------------------------------------------------
    def set_endpoints(self, urls: list[str]) -> None:
        self.state.set_endpoints(urls)
        if self.subscriptions is not None:
            self.subscriptions.set_endpoints(self.state.endpoints)
        self.flow.dispatch()

    def on_metrics(self, endpoint: str, m: WorkerMetrics) -> None:
        self.state.update_metrics(endpoint, m)
        self.flow.dispatch()

    def age(self) -> float | None:
        """Seconds since its source last heard from the API (sources may not say)."""
        age = getattr(self.source, "age", None)
        return age() if age is not None else None

    def stale(self) -> bool:
        stale = getattr(self.source, "stale", None)
        return stale is not None and stale()

    def served_adapters(self) -> frozenset[str]:
        """The adapters its scraped workers say they serve by name (kvscale_lora_adapter_served)."""
        out: frozenset[str] = frozenset()
        for m in self.state.metrics.values():
            if m.served_adapters:
                out |= m.served_adapters
        return out

    # -- picks ------------------------------------------------------------------------------------
    def choose(self, req: PickRequest, exclude: Iterable[str] = ()) -> str | None:
        """The state's pick (counted in flight there), reported with what an adapter found there."""
        endpoint = self.state.choose(req.hashes, exclude, req.model, req.prompt)
        if endpoint is not None:
            affinity = self.state.affinity(endpoint, req.model) if req.model is not None else None
            self.events.picked(req, affinity)
        return endpoint

    def release(self, endpoint: str) -> None:
        self.state.release(endpoint)

    def done(self, endpoint: str) -> None:
        """A request there ended: its place goes to the next in this pool's queue."""
        self.state.release(endpoint)
        self.flow.dispatch()

    def wake(self) -> None:
        if self.waker is not None and not self.state.endpoints:
            self.waker.wake()  # no worker ready: ask this pool's Deployment for one (single-flight)

    async def token_prompt(self, chat: bool, payload: dict) -> TokenPrompt | None:
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

    # -- lifecycle --------------------------------------------------------------------------------
    def start(
        self,
        session: aiohttp.ClientSession,
        *,
        scrape_interval_s: float,
        scrape_timeout_s: float,
        scrape_concurrency: int,
        worker_headers: Callable[[], dict[str, str]],
    ) -> None:
        """Its source, its scrapes, and (with tokenizer_from_workers) the fetch of its tokenizer
        from its own workers; `worker_headers`: what authenticates the router to them."""
        self.source.start(self.set_endpoints)
        scraper = Scraper(
            session,
            lambda: self.state.endpoints,
            self.on_metrics,
            interval_s=scrape_interval_s,
            timeout_s=scrape_timeout_s,
            concurrency=scrape_concurrency,
        )
        self._scraper_task = asyncio.create_task(scraper.run())
        if self.tokenizer is None and self.tokenizer_from_workers:
            self._tokenizer_task = asyncio.create_task(self._fetch_tokenizer(session, worker_headers))

    async def _fetch_tokenizer(
        self, session: aiohttp.ClientSession, worker_headers: Callable[[], dict[str, str]]
    ) -> None:
        self.tokenizer = await tokenizer_from_workers(session, lambda: self.state.endpoints, worker_headers())

    async def stop(self) -> None:
        self.source.stop()
        if self.waker is not None:
            await self.waker.close()
        if self._scraper_task is not None:
            self._scraper_task.cancel()
        if self._tokenizer_task is not None:
            self._tokenizer_task.cancel()
        if self.subscriptions is not None:
            await self.subscriptions.close()
