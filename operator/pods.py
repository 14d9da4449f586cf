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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from kvscale.operator import metrics
from kvscale.operator.children import LABEL_INSTANCE, LABEL_NAME, LABEL_OWNER, ROUTER, WORKER

logger = logging.getLogger(__name__)

# Every worker pod of every InferenceDeployment (children.selector_labels), selected by the server.
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

    def routers_of(self, namespace: str, owner: str) -> list[client.V1Pod]:
        """The router pods of one InferenceDeployment (children.router_selector_labels)."""
        with self._lock:
            pods = [
                p
                for p in self._pods.values()
                if p.metadata.namespace == namespace
                and (p.metadata.labels or {}).get(LABEL_NAME) == ROUTER
                and (p.metadata.labels or {}).get(LABEL_INSTANCE) == owner
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
                metrics.errored(metrics.error_kind(e))
                logger.warning("watching the worker pods failed: %s %s", e.status, e.reason)
                stop.wait(retry_s)
        except Exception as e:  # a network error, a timeout: list again after a pause
            version = None
            metrics.errored(metrics.error_kind(e))
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
