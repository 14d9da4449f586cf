"""The worker pods as one watch sees them: a small informer, so that the autoscaler reads its
pods from memory instead of LISTing them every tick for every resource.

`PodCache` holds the pods by uid; `feed` keeps it current the way client-go's reflector does:
one LIST (which replaces the whole cache: a pod deleted while nothing watched goes too), then a
WATCH from the list's resourceVersion (bookmarks keep it fresh), resumed from the last
resourceVersion seen when a stream ends, and a fresh LIST after a 410 Gone (that version is
compacted away), after an error, and every RELIST_S (a safety net against a lost event).
The LIST and WATCH carry a server-side label selector: only our workers are streamed.

Not a kopf index: kopf re-lists after a 410 without dropping what the new list lacks, so a pod
deleted in the gap would stay in an index for good (and the autoscaler would count it as an
unreadable worker). Only reads: the leader's fence lets them through; `feed` runs on the leader
only (started and stopped with kopf, autoscaler.py).

Labels select what is streamed, never what is trusted: anyone who may create pods in a namespace
can label one as a worker. `Ownership` admits a pod only when its chain of controller owner
references, each checked by uid against the live object, reaches the InferenceDeployment: pod ->
ReplicaSet -> Deployment -> InferenceDeployment (or pod -> StatefulSet -> LeaderWorkerSet ->
InferenceDeployment for a group's leader). A tenant's look-alike pod has no such chain (the
ReplicaSet controller releases a pod its selector does not match, and adopts, so owns and counts,
one it does).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from kvscale.operator import metrics
from kvscale.operator.api.endpoint import ENDPOINT_KIND
from kvscale.operator.api.groupversion import KIND
from kvscale.operator.api.labels import (
    LABEL_ENDPOINT,
    LABEL_INSTANCE,
    LABEL_NAME,
    LABEL_OWNER,
    ROUTER,
    WORKER,
)
from kvscale.operator.kube.errors import error_kind

logger = logging.getLogger(__name__)

# Every worker pod of every InferenceDeployment (reconcile/children.selector_labels), selected by the server.
POD_SELECTOR = f"{LABEL_NAME} in ({WORKER},{ROUTER})"  # the workers and the routers
WATCH_S = 300  # the server ends each watch after this long; it is then resumed
RELIST_S = 1800.0
RETRY_S = 2.0
API_TIMEOUT_S = 30

# (namespace or None for all) -> (pods, resourceVersion)
Lister = Callable[[str | None], tuple[list[client.V1Pod], str]]
# (namespace or None, resourceVersion) -> events: (ADDED | MODIFIED | DELETED | BOOKMARK, the pod
# (None for a bookmark), the resourceVersion to resume from); a 410 Gone raises ApiException.
Watcher = Callable[[str | None, str], Iterable[tuple[str, client.V1Pod | None, str | None]]]


class PodCache:
    """Pods by uid, thread-safe: the feeder writes, the autoscaler's tasks read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[str, client.V1Pod] = {}
        self.synced = threading.Event()  # set once the first LIST is in

    def replace(self, pods: Iterable[client.V1Pod], namespace: str | None = None) -> None:
        """What a LIST returned: every pod of `namespace` (None: of all) is replaced by these."""
        with self._lock:
            kept = (
                {}
                if namespace is None
                else {uid: p for uid, p in self._pods.items() if p.metadata.namespace != namespace}
            )
            kept.update((p.metadata.uid, p) for p in pods)
            self._pods = kept
            metrics.POD_CACHE_PODS.set(len(kept))
        self.synced.set()

    def apply(self, event_type: str, pod: client.V1Pod) -> None:
        """One watch event."""
        with self._lock:
            if event_type == "DELETED":
                self._pods.pop(pod.metadata.uid, None)
            elif event_type in ("ADDED", "MODIFIED"):
                self._pods[pod.metadata.uid] = pod
            metrics.POD_CACHE_PODS.set(len(self._pods))

    def of(self, namespace: str, owner: str) -> list[client.V1Pod]:
        """The worker pods of one InferenceDeployment, by name."""
        with self._lock:
            pods = [
                p
                for p in self._pods.values()
                if p.metadata.namespace == namespace and (p.metadata.labels or {}).get(LABEL_OWNER) == owner
            ]
        return sorted(pods, key=lambda p: p.metadata.name)

    def endpoint_routers_of(self, namespace: str, endpoint: str) -> list[client.V1Pod]:
        """The router pods of one InferenceEndpoint (children.endpoint_selector_labels)."""
        return self._routers(namespace, LABEL_ENDPOINT, endpoint)

    def routers_of(self, namespace: str, owner: str) -> list[client.V1Pod]:
        """The router pods of one InferenceDeployment (children.router_selector_labels)."""
        return self._routers(namespace, LABEL_INSTANCE, owner)

    def _routers(self, namespace: str, label: str, value: str) -> list[client.V1Pod]:
        with self._lock:
            pods = [
                p
                for p in self._pods.values()
                if p.metadata.namespace == namespace
                and (p.metadata.labels or {}).get(LABEL_NAME) == ROUTER
                and (p.metadata.labels or {}).get(label) == value
            ]
        return sorted(pods, key=lambda p: p.metadata.name)


def feed(
    cache: PodCache,
    lister: Lister,
    watcher: Watcher,
    stop: threading.Event,
    namespace: str | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    relist_s: float = RELIST_S,
    retry_s: float = RETRY_S,
) -> None:
    """Keep `cache` current for `namespace` (None: every namespace) until `stop` is set."""
    version: str | None = None
    listed_at = 0.0
    while not stop.is_set():
        try:
            if version is None or clock() - listed_at >= relist_s:
                pods, version = lister(namespace)
                listed_at = clock()
                cache.replace(pods, namespace)
                metrics.POD_CACHE_RELISTS.inc()
            opened, events = clock(), 0
            for event_type, pod, seen in watcher(namespace, version):
                if stop.is_set():
                    return
                events += 1
                version = seen or version
                if pod is not None:
                    cache.apply(event_type, pod)
                if clock() - listed_at >= relist_s:
                    break  # the relist above
            if not events and clock() - opened < 1.0:
                stop.wait(retry_s)  # a stream the server ends at once: no busy loop of watches
        except ApiException as e:
            version = None  # 410 Gone or another refusal: start over from a LIST
            if e.status != 410:
                metrics.errored(error_kind(e))
                logger.warning("watching the worker pods failed: %s %s", e.status, e.reason)
                stop.wait(retry_s)
        except Exception as e:  # a network error, a timeout: list again after a pause
            version = None
            metrics.errored(error_kind(e))
            logger.warning("watching the worker pods failed: %s", e)
            stop.wait(retry_s)


def api_lister(core: client.CoreV1Api) -> Lister:
    def lister(namespace: str | None) -> tuple[list[client.V1Pod], str]:
        query = {"label_selector": POD_SELECTOR, "_request_timeout": API_TIMEOUT_S}
        if namespace is None:
            listed = core.list_pod_for_all_namespaces(**query)
        else:
            listed = core.list_namespaced_pod(namespace, **query)
        return listed.items, listed.metadata.resource_version

    return lister


def api_watcher(core: client.CoreV1Api) -> Watcher:
    def watcher(namespace: str | None, version: str) -> Iterator[tuple[str, client.V1Pod | None, str | None]]:
        query: dict[str, Any] = {
            "label_selector": POD_SELECTOR,
            "resource_version": version,
            "allow_watch_bookmarks": True,
            "timeout_seconds": WATCH_S,
            "_request_timeout": (10, WATCH_S + 60),  # a stream silent past its end is dead
        }
        w = watch.Watch()
        if namespace is None:
            stream = w.stream(core.list_pod_for_all_namespaces, **query)
        else:
            stream = w.stream(core.list_namespaced_pod, namespace, **query)
        # With timeout_seconds, the client raises ApiException on an ERROR event (a 410 Gone).
        for event in stream:
            if event["type"] == "BOOKMARK":  # not deserialized: the raw object, its version only
                yield (
                    "BOOKMARK",
                    None,
                    ((event["raw_object"] or {}).get("metadata") or {}).get("resourceVersion"),
                )
            else:
                pod = event["object"]
                yield event["type"], pod, pod.metadata.resource_version

    return watcher


def url_of(ip: str, port: int, path: str = "") -> str:
    """`http://ip:port/path` for a pod IP: an IPv6 address in brackets (RFC 3986; unbracketed,
    `fd00::1:8000` reads as a host and a port of "1:8000", and every IPv6 scrape fails)."""
    try:
        v6 = ipaddress.ip_address(ip).version == 6
    except ValueError:
        v6 = ":" in ip  # not an address (a test's name): bracket anything that would break
    return f"http://[{ip}]:{port}{path}" if v6 else f"http://{ip}:{port}{path}"


@dataclass(frozen=True)
class OwnerRef:
    kind: str
    name: str
    uid: str


def controller_of(meta: Mapping[str, Any] | client.V1ObjectMeta | None) -> OwnerRef | None:
    """The owner reference marked `controller: true` of an object's metadata (a dict or the typed
    client's), None when it has none."""
    if meta is None:
        return None
    refs = meta.get("ownerReferences") if isinstance(meta, Mapping) else meta.owner_references
    for r in refs or []:
        # The typed V1OwnerReference's attributes have the JSON keys' names.
        kind, name, uid, controls = (
            r.get(k) if isinstance(r, Mapping) else getattr(r, k, None)
            for k in ("kind", "name", "uid", "controller")
        )
        if controls and kind and name and uid:
            return OwnerRef(kind, name, uid)
    return None


# Who may own whom on the way up from a pod: (the pod's controller, its controller) per workload.
CHAINS = (("ReplicaSet", "Deployment"), ("StatefulSet", "LeaderWorkerSet"))
ROOT_KIND = KIND
# (kind, namespace, name) -> that object's metadata (a dict), None when it does not exist.
OwnerReader = Callable[[str, str, str], Mapping[str, Any] | None]


class Ownership:
    """Whether a pod was created by the operator's own workload of one InferenceDeployment: its
    controller chain, each link read from the API server once (by uid, which no other object ever
    has) and cached for `ttl_s` (an orphaned ReplicaSet drops out within that). Thread-safe; the
    reads block, so the autoscaler calls `owned` off the event loop."""

    def __init__(
        self, read: OwnerReader, *, ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._read, self._ttl_s, self._clock = read, ttl_s, clock
        self._lock = threading.Lock()
        self._links: dict[str, tuple[float, OwnerRef | None]] = {}  # uid -> (when read, its controller)
        self.reads = 0

    def _controller(self, ref: OwnerRef, namespace: str) -> OwnerRef | None:
        """The controller of the object `ref` names, None when that object is not the one the
        reference means (gone, or another uid under that name: a forged reference)."""
        now = self._clock()
        with self._lock:
            hit = self._links.get(ref.uid)
            if hit is not None and now - hit[0] < self._ttl_s:
                return hit[1]
        self.reads += 1
        meta = self._read(ref.kind, namespace, ref.name)
        link = controller_of(meta) if meta is not None and meta.get("uid") == ref.uid else None
        with self._lock:
            if len(self._links) > 4096:  # bounded: look-alike pods naming ever new owners
                self._links.clear()
            self._links[ref.uid] = (now, link)
        return link

    def owned(
        self, pod: client.V1Pod, root_uid: str | None, workload: str, *, endpoint: str | None = None
    ) -> bool:
        """Whether `pod`'s controller chain ends at the InferenceDeployment `root_uid` through its
        workload named `workload` (one name per kind and namespace: a Deployment a tenant made
        and pointed at the InferenceDeployment is not the operator's). With `endpoint`: at the
        InferenceEndpoint of that name instead (a member's autoscaler does not know its uid; the
        Deployment of that name, read by its uid, is the one that names it)."""
        first = controller_of(pod.metadata)
        namespace = pod.metadata.namespace
        for kinds in CHAINS:
            if first is None or first.kind != kinds[0]:
                continue
            owner = self._controller(first, namespace)
            if owner is None or owner.kind != kinds[1] or owner.name != workload:
                return False
            root = self._controller(owner, namespace)
            if root is None:
                return False
            if endpoint is not None:
                return root.kind == ENDPOINT_KIND and root.name == endpoint
            return root.kind == ROOT_KIND and root.uid == root_uid
        return False


class PodFeeder:
    """The feeder threads (one per watched namespace, or one for all) of one cache."""

    def __init__(self, cache: PodCache) -> None:
        self.cache = cache
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, core: client.CoreV1Api, namespaces: tuple[str, ...] = ()) -> None:
        self._stop = threading.Event()  # of this start: a thread still in an old watch stays stopped
        for namespace in namespaces or (None,):
            t = threading.Thread(
                target=feed,
                args=(self.cache, api_lister(core), api_watcher(core), self._stop, namespace),
                daemon=True,
                name=f"pods {namespace or 'all'}",
            )
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._threads.clear()
