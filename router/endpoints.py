"""Where the workers are: ready, not-terminating endpoints of a Service's EndpointSlices
(discovery.k8s.io/v1, label kubernetes.io/service-name=<service>), or a static list.

`endpoints_from_slices` and `apply_event` are pure (unit-tested); `SliceWatcher` is the thin I/O:
a list, then a watch resumed from the last resourceVersion seen (bookmarks included), and a fresh
list when the API says that version is gone (410 Gone) or the connection failed or went silent,
in a thread of its own (the kubernetes client is synchronous) that hands each new set to the
event loop.

Every call is bounded: the watch asks the API server to end it after `watch_timeout_s`
(timeoutSeconds) and reads with a client read timeout a little longer, so a healthy watch always
ends first, and a connection that went half-open (no bytes, no FIN) is given up within
`read_timeout_s` and replaced by a fresh list. `age()` says how long ago the API was last heard
from (a list, an event or a watch that ended as asked), `stale()` whether that is past the bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
WATCH_TIMEOUT_S = 30  # the API server ends each watch after this (timeoutSeconds)
READ_GRACE_S = 10.0  # the client read timeout: the watch timeout plus this
CONNECT_TIMEOUT_S = 5.0
MAX_BACKOFF_S = 10.0


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address  # IPv6
    return f"http://{host}:{port}"


def _slice_port(slice_: Mapping[str, Any], port_name: str | None) -> int | None:
    ports = slice_.get("ports") or []
    for p in ports:
        if p.get("port") is not None and (port_name is None or p.get("name") == port_name):
            return int(p["port"])
    return None


def endpoints_from_slices(slices: Iterable[Mapping[str, Any]], port_name: str | None = None) -> list[str]:
    """The URLs (sorted, unique) of the endpoints ready to take traffic and not terminating, with the
    slice's port named `port_name` (None: its first port). The API's own rules for unset
    conditions: a nil `ready` is read as ready, a nil `terminating` as not terminating."""
    urls: set[str] = set()
    for s in slices:
        if s.get("addressType", "IPv4") not in ("IPv4", "IPv6"):
            continue  # FQDN slices name no pod
        port = _slice_port(s, port_name)
        if port is None:
            continue
        for ep in s.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            addresses = ep.get("addresses") or []
            if addresses:  # all addresses of one endpoint are the same pod: the first will do
                urls.add(_url(addresses[0], port))
    return sorted(urls)


def apply_event(slices: dict[str, dict], event_type: str, obj: Mapping[str, Any]) -> dict[str, dict]:
    """The slices (by name) after one watch event; BOOKMARK and unknown types change nothing."""
    name = (obj.get("metadata") or {}).get("name")
    if name is None:
        return slices
    out = dict(slices)
    if event_type in ("ADDED", "MODIFIED"):
        out[name] = dict(obj)
    elif event_type == "DELETED":
        out.pop(name, None)
    return out


class StaticEndpoints:
    """A fixed list (--endpoints): synced at once, every endpoint always ready."""

    def __init__(self, urls: Iterable[str]) -> None:
        self.urls = sorted({u.rstrip("/") for u in urls if u.strip()})
        self.synced = True

    def age(self) -> float | None:
        return None  # no API to hear from

    def stale(self) -> bool:
        return False

    def start(self, publish: Callable[[list[str]], None]) -> None:
        publish(self.urls)

    def stop(self) -> None:
        pass


class SliceWatcher:
    """EndpointSlices of one Service through the kubernetes client's list + watch."""

    def __init__(
        self,
        service: str,
        namespace: str,
        port_name: str | None = None,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        api: Any = None,
        watch_factory: Callable[[], Any] | None = None,
        read_timeout_s: float | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service, self.namespace, self.port_name = service, namespace, port_name
        self.watch_timeout_s = watch_timeout_s
        # Longer than the watch itself: a read that waits past it is a dead connection.
        self.read_timeout_s = read_timeout_s or watch_timeout_s + READ_GRACE_S
        self.connect_timeout_s = connect_timeout_s
        # Past this without hearing from the API, the list is stale: a silent watch would have
        # been given up and a fresh list tried (with the longest backoff) by then.
        self.stale_after_s = self.read_timeout_s + connect_timeout_s + MAX_BACKOFF_S
        self.clock = clock
        self.heard_at: float | None = None
        self.synced = False
        self.lists = 0  # how many times it listed (the first, one per 410 Gone or failed watch)
        self.watches = 0  # how many watches it opened (one more each time one ends and is resumed)
        self._api = api
        self._watch_factory = watch_factory
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread: threading.Thread | None = None

    def start(self, publish: Callable[[list[str]], None]) -> None:
        loop = asyncio.get_running_loop()

        def hand_over(urls: list[str]) -> None:
            loop.call_soon_threadsafe(publish, urls)

        self._thread = threading.Thread(
            target=self._run, args=(hand_over,), name="endpointslices", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def age(self) -> float | None:
        """Seconds since the API was last heard from (None: never)."""
        return None if self.heard_at is None else self.clock() - self.heard_at

    def stale(self) -> bool:
        age = self.age()
        return age is not None and age > self.stale_after_s

    def _heard(self) -> None:
        self.heard_at = self.clock()

    def _timeout(self) -> tuple[float, float]:
        return (self.connect_timeout_s, self.read_timeout_s)

    def _client(self):
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.DiscoveryV1Api()
        return self._api

    def _list(self) -> tuple[dict[str, dict], str]:
        resp = self._client().list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=f"{SERVICE_NAME_LABEL}={self.service}",
            _preload_content=False,
            _request_timeout=self._timeout(),
        )
        body = json.loads(resp.data)
        slices = {s["metadata"]["name"]: s for s in body.get("items") or []}
        self.lists += 1
        self._heard()
        return slices, body["metadata"]["resourceVersion"]

    def _run(self, publish: Callable[[list[str]], None]) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        new_watch = self._watch_factory or watch.Watch

        slices: dict[str, dict] = {}
        version: str | None = None
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if version is None:
                    slices, version = self._list()
                    publish(endpoints_from_slices(slices.values(), self.port_name))
                    self.synced = True
                self._watch = new_watch()
                self.watches += 1
                stream = self._watch.stream(
                    self._client().list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=f"{SERVICE_NAME_LABEL}={self.service}",
                    resource_version=version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=self.watch_timeout_s,
                    _request_timeout=self._timeout(),
                )
                for event in stream:
                    self._heard()
                    raw = event.get("raw_object") or {}
                    if event["type"] == "ERROR":
                        if raw.get("code") == 410:
                            version = None  # too old: list again
                        break
                    version = (raw.get("metadata") or {}).get("resourceVersion", version)
                    if event["type"] == "BOOKMARK":
                        continue
                    slices = apply_event(slices, event["type"], raw)
                    publish(endpoints_from_slices(slices.values(), self.port_name))
                else:
                    self._heard()  # the server ended the watch as asked: it is alive
                backoff = 0.5
            except ApiException as e:
                if e.status == 410:
                    version = None
                    continue
                logger.warning("endpointslice watch failed", extra={"status": e.status, "reason": e.reason})
                self._sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
            except Exception as e:
                # The API unreachable, a dropped connection, or one silent past the read timeout
                # (half-open): what it missed is unknown, so list afresh rather than resume.
                logger.warning("endpointslice watch failed; listing again", extra={"error": repr(e)})
                version = None
                self._sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            self._stop.wait(0.1)
