"""The autoscaler's I/O without a cluster: its pods come from one watch-fed cache (kube/pods.py),
not from a LIST per tick; its status is written when it changes; its metrics move."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from types import SimpleNamespace
from typing import ClassVar

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kvscale.operator import metrics
from kvscale.operator.api.groupversion import KIND
from kvscale.operator.api.labels import LABEL_NAME, LABEL_OWNER, WORKER
from kvscale.operator.autoscaler import scaler
from kvscale.operator.autoscaler.pod_state import pod_state
from kvscale.operator.autoscaler.policy import Decision, PodLoad, least_loaded
from kvscale.operator.autoscaler.scaler import Scaler, Target
from kvscale.operator.kube.pods import Ownership, PodCache, feed

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def rs_ref(owner: str, uid: str | None = None) -> list[client.V1OwnerReference]:
    """The controller reference the ReplicaSet controller puts on `owner`'s worker pods."""
    return [
        client.V1OwnerReference(
            api_version="apps/v1",
            kind="ReplicaSet",
            name=f"{owner}-abc",
            uid=uid or f"rs-{owner}",
            controller=True,
        )
    ]


def pod(
    name: str,
    owner: str = "tiny",
    namespace: str = "ns",
    *,
    ready: bool = True,
    rv: str = "1",
    refs: list | None = None,
    ip: str | None = None,
    startup_s: float = 0.0,
):
    """A worker pod of `owner`, Ready at T0, its container started `startup_s` before that."""
    started = T0 - dt.timedelta(seconds=startup_s)
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name,
            namespace=namespace,
            uid=f"uid-{namespace}-{name}",
            resource_version=rv,
            labels={LABEL_NAME: WORKER, LABEL_OWNER: owner},
            owner_references=rs_ref(owner) if refs is None else refs,
        ),
        status=client.V1PodStatus(
            pod_ip=ip or f"10.0.0.{abs(hash(name)) % 250 + 1}",
            conditions=[client.V1PodCondition(type="Ready", status=str(ready), last_transition_time=T0)],
            container_statuses=[
                client.V1ContainerStatus(
                    name="worker",
                    image="img",
                    image_id="",
                    ready=ready,
                    restart_count=0,
                    state=client.V1ContainerState(running=client.V1ContainerStateRunning(started_at=started)),
                )
            ],
        ),
    )


def names(pods) -> list[str]:
    return [p.metadata.name for p in pods]


# --- the cache ------------------------------------------------------------------------------


def test_the_cache_yields_each_resources_pods_after_adds_modifies_and_deletes():
    cache = PodCache()
    cache.replace([pod("a-1", "a"), pod("a-2", "a"), pod("b-1", "b"), pod("a-1", "a", "other")])
    assert names(cache.of("ns", "a")) == ["a-1", "a-2"] and names(cache.of("ns", "b")) == ["b-1"]
    assert names(cache.of("other", "a")) == ["a-1"] and cache.of("ns", "c") == []
    cache.apply("ADDED", pod("a-3", "a"))
    cache.apply("MODIFIED", pod("a-1", "a", ready=False, rv="2"))
    cache.apply("DELETED", pod("a-2", "a"))
    cache.apply("DELETED", pod("b-1", "b"))
    assert names(cache.of("ns", "a")) == ["a-1", "a-3"] and cache.of("ns", "b") == []
    (a1,) = [p for p in cache.of("ns", "a") if p.metadata.name == "a-1"]
    assert a1.metadata.resource_version == "2" and pod_state(a1) == "starting"
    # A LIST of one namespace replaces that namespace's pods only.
    cache.replace([pod("c-1", "c", "other")], namespace="other")
    assert names(cache.of("other", "c")) == ["c-1"] and cache.of("other", "a") == []
    assert names(cache.of("ns", "a")) == ["a-1", "a-3"]
    assert metrics.POD_CACHE_PODS._value.get() == 3


def test_the_feeder_resumes_from_the_last_version_and_relists_after_410_dropping_what_the_gap_deleted():
    cache, stop = PodCache(), threading.Event()
    lists = [([pod("a-1"), pod("a-2")], "1"), ([pod("a-1", rv="9"), pod("a-4", rv="9")], "9")]
    asked: list[str] = []

    def lister(namespace):
        assert namespace is None
        return lists.pop(0)

    def watcher(namespace, version):
        asked.append(version)
        if len(asked) == 1:
            yield "MODIFIED", pod("a-1", ready=False, rv="3"), "3"
            yield "DELETED", pod("a-2", rv="4"), "4"
            yield "ADDED", pod("a-3", rv="5"), "5"
            yield "BOOKMARK", None, "7"
            return  # the server ended the stream (timeoutSeconds): resumed from 7
        if len(asked) == 2:
            assert names(cache.of("ns", "tiny")) == ["a-1", "a-3"]
            raise ApiException(status=410, reason="Gone")  # 7 was compacted: list again
        stop.set()
        return
        yield

    relists = metrics.POD_CACHE_RELISTS._value.get()
    feed(cache, lister, watcher, stop, retry_s=0)
    assert asked == ["1", "7", "9"]
    # a-3 was deleted while no watch ran: the relist drops it, a-4 came meanwhile.
    assert names(cache.of("ns", "tiny")) == ["a-1", "a-4"]
    assert metrics.POD_CACHE_RELISTS._value.get() == relists + 2 and cache.synced.is_set()


def test_the_feeder_relists_after_an_error_and_periodically():
    cache, stop = PodCache(), threading.Event()
    clock = [0.0]
    calls: ClassVar[list[str]] = []

    def lister(namespace):
        calls.append("list")
        return [pod("a-1")], str(len(calls))

    def watcher(namespace, version):
        calls.append(f"watch {version}")
        if len(calls) == 2:
            raise ConnectionResetError("reset")
        clock[0] += 100
        if len(calls) >= 6:
            stop.set()
        yield "MODIFIED", pod("a-1", rv="x"), "x"  # the relist period has passed

    errors = metrics.ERRORS.labels("network")._value.get()
    feed(cache, lister, watcher, stop, clock=lambda: clock[0], relist_s=50, retry_s=0)
    assert calls == ["list", "watch 1", "list", "watch 3", "list", "watch 5"]
    assert metrics.ERRORS.labels("network")._value.get() == errors + 1


def test_a_stream_the_server_ends_at_once_is_reopened_after_a_pause_not_in_a_busy_loop():
    class Stop(threading.Event):
        waits: ClassVar[list[float]] = []

        def wait(self, timeout=None):
            Stop.waits.append(timeout)
            if len(Stop.waits) == 3:
                self.set()
            return self.is_set()

    opened: list[str] = []

    def watcher(namespace, version):
        opened.append(version)
        return iter(())  # ended before any event

    feed(PodCache(), lambda ns: ([], "1"), watcher, Stop(), retry_s=2.0)
    assert Stop.waits == [2.0, 2.0, 2.0] and opened == ["1", "1", "1"]


def test_the_api_watcher_streams_pods_and_bookmarks_and_raises_410(monkeypatch):
    """pods.api_watcher through the kubernetes client's own Watch, over a fake HTTP response."""
    import json

    from kvscale.operator.kube.pods import POD_SELECTOR, api_watcher

    lines = [
        {"type": "ADDED", "object": client.ApiClient().sanitize_for_serialization(pod("a-1", rv="5"))},
        {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "8"}}},
        {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "old"}},
    ]
    asked: list[dict] = []

    class Response:
        status = 200

        def stream(self, amt=None, decode_content=False):
            for line in lines:
                yield (json.dumps(line) + "\n").encode()

        def close(self):
            pass

        def release_conn(self):
            pass

    class Core:
        def list_pod_for_all_namespaces(self, **kwargs):
            asked.append(kwargs)
            return Response()

    # As the real client's method is annotated (this module's annotations are strings).
    Core.list_pod_for_all_namespaces.__annotations__["return"] = client.V1PodList

    seen = []
    with pytest.raises(ApiException) as gone:
        for event in api_watcher(Core())(None, "3"):
            seen.append(event)
    assert gone.value.status == 410
    (added, bookmark) = seen
    assert added[0] == "ADDED" and added[1].metadata.name == "a-1" and added[2] == "5"
    assert bookmark == ("BOOKMARK", None, "8")
    (query,) = asked
    assert query["label_selector"] == POD_SELECTOR and query["resource_version"] == "3"
    assert query["allow_watch_bookmarks"] is True and query["watch"] is True and query["timeout_seconds"]


# --- the autoscaler's tick ---------------------------------------------------------------------


class CountingCore:
    """A CoreV1Api that counts every call: the tick must make none but the scale-down marks."""

    calls: ClassVar[list[str]] = []

    def __init__(self, _api=None):
        pass

    def __getattr__(self, name):
        def call(*args, **kwargs):
            CountingCore.calls.append(name)
            return SimpleNamespace(items=[])

        return call


class Apps:
    replicas = 2

    def __init__(self, _api=None):
        pass

    def read_namespaced_deployment(self, name, namespace, **_):
        return SimpleNamespace(spec=SimpleNamespace(replicas=Apps.replicas))

    def patch_namespaced_deployment_scale(self, name, namespace, body, **_):
        Apps.replicas = body["spec"]["replicas"]


SPEC = {
    "model": {"uri": "/models/tiny"},
    "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetKvCacheUsage": 0.5, "targetQueueLength": 2},
}


class Custom:
    def __init__(self, _api=None):
        pass

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **_):
        return {"metadata": {"generation": 1}, "spec": SPEC, "status": {}}


def ctrl(kind: str, name: str, uid: str) -> dict:
    return {"kind": kind, "name": name, "uid": uid, "controller": True}


# The live owner chain: tiny's ReplicaSet -> its Deployment -> the InferenceDeployment uid-1.
OWNERS = {
    ("ReplicaSet", "ns", "tiny-abc"): {
        "uid": "rs-tiny",
        "ownerReferences": [ctrl("Deployment", "tiny", "dep-tiny")],
    },
    ("Deployment", "ns", "tiny"): {"uid": "dep-tiny", "ownerReferences": [ctrl(KIND, "tiny", "uid-1")]},
}


@pytest.fixture
def tick(monkeypatch):
    cache = PodCache()
    # tiny's workers took 12 s and 14 s from their container's start to Ready; another resource's 40 s.
    cache.replace(
        [pod("tiny-1", startup_s=12), pod("tiny-2", startup_s=14), pod("other-1", "other", startup_s=40)]
    )
    load = {"kv_usage": 0.5, "waiting": 0.0, "running": 1.0, "arrivals": 10.0}
    scraped: dict[str, dict | None] = {}
    writes: list[dict] = []

    async def scrape(session, ip):
        return scraped.get(ip, load)

    CountingCore.calls = []
    Apps.replicas = 2
    monkeypatch.setattr(scaler, "scrape", scrape)
    monkeypatch.setattr(scaler.client, "CoreV1Api", CountingCore)
    monkeypatch.setattr(scaler.client, "AppsV1Api", Apps)
    monkeypatch.setattr(scaler.client, "CustomObjectsApi", Custom)
    monkeypatch.setattr(scaler.kopf, "info", lambda *a, **k: None)
    # The Kubernetes API as the autoscaler uses it: the (patched) typed clients, its status writes.
    kube = SimpleNamespace(
        api=None, namespaces=(), apply_status=lambda ns, name, status, manager: writes.append(status)
    )
    autoscaler = Scaler(kube)
    autoscaler.pods = cache
    autoscaler.owners = owners = Ownership(lambda kind, ns, name: OWNERS.get((kind, ns, name)))
    target = Target("tiny", "ns", "uid-1", dict(SPEC))
    run = lambda: asyncio.run(autoscaler.step(target, None))  # noqa: E731
    return SimpleNamespace(
        target=target, run=run, writes=writes, scraped=scraped, cache=cache, owners=owners, scaler=autoscaler
    )


def counter(metric, *labels) -> float:
    return metric.labels(*labels)._value.get()


def test_a_tick_reads_the_pod_cache_and_lists_nothing(tick):
    holds = counter(metrics.DECISIONS, "ns", "tiny", "hold")
    for _ in range(5):
        decision = tick.run()
        assert decision is not None and decision.replicas == 2
    assert CountingCore.calls == []  # no LIST (nor any other pod call) per tick
    # The look-ahead is the median startup of this resource's own pods (of two, the upper one),
    # not the spec's default (0) nor the other resource's pod.
    assert tick.target.scaler.last_lookahead_s == 14.0
    assert counter(metrics.DECISIONS, "ns", "tiny", "hold") == holds + 5
    assert metrics.DESIRED_REPLICAS.labels("ns", "tiny")._value.get() == 2


def test_a_scale_down_marks_its_victims_first_and_writes_the_count_once_they_are_seen(tick):
    """The ReplicaSet controller picks its victims from its own pod cache: the count waits for a
    tick whose pods already carry the marks, so the marked (least-loaded) pod is the one removed."""
    tick.scaler.access = SimpleNamespace(allowed=lambda api, ns: True)
    down = Decision(1, "scale down 2 -> 1", None, ("tiny-1",))
    pods = [pod("tiny-1"), pod("tiny-2")]
    scale = lambda pods: asyncio.run(tick.scaler._scale(tick.target, pods, 2, down))  # noqa: E731
    assert scale(pods) is False  # marked, not scaled
    assert CountingCore.calls == ["patch_namespaced_pod"] and Apps.replicas == 2
    pods[0].metadata.annotations = {scaler.DELETION_COST: scaler.VICTIM_COST}  # our watch saw it
    assert scale(pods) is True
    assert CountingCore.calls == ["patch_namespaced_pod"] and Apps.replicas == 1
    assert "removing tiny-1" in tick.target.decisions[-1]["reason"]
    # Scaling to zero removes every pod: no marks, no tick of delay.
    CountingCore.calls, Apps.replicas = [], 1
    zero = Decision(0, "scale to zero 1 -> 0", None, ("tiny-2",))
    assert asyncio.run(tick.scaler._scale(tick.target, [pod("tiny-2")], 1, zero)) is True
    assert CountingCore.calls == [] and Apps.replicas == 0


def test_least_loaded_keeps_the_marked_pods_the_victims():
    loads = [PodLoad("a", "ready", running=3.0), PodLoad("b", "ready", running=0.0, marked=False)]
    assert least_loaded(loads, 1) == ("b",)
    loads[0] = PodLoad("a", "ready", running=3.0, marked=True)  # named a tick ago, busier since
    assert least_loaded(loads, 1) == ("a",)


def test_a_tick_waits_for_the_caches_first_list(tick):
    tick.cache.synced.clear()
    assert tick.run() is None and tick.writes == []


def test_unchanged_signals_are_written_once(tick):
    for _ in range(10):
        tick.run()
    assert len(tick.writes) == 1
    assert tick.writes[0]["autoscaling"]["readyWorkers"] == 2
    assert tick.writes[0]["conditions"][0]["type"] == "ScalingActive"


def test_a_new_leader_does_not_rewrite_what_the_object_already_shows(tick, monkeypatch):
    for _ in range(3):
        tick.run()
    (written,) = tick.writes
    body = {
        "metadata": {"uid": "uid-1", "name": "tiny", "namespace": "ns"},
        "spec": SPEC,
        "status": {"autoscaling": {**written["autoscaling"]}},
    }
    created: list = []
    monkeypatch.setattr(scaler.asyncio, "create_task", lambda coro, name=None: created.append(coro.close()))
    asyncio.run(tick.scaler.track(body=body, type=None))  # the new leader's first event
    fresh = tick.scaler.targets["uid-1"]
    fresh.scaler = tick.target.scaler  # the same load seen
    tick.writes.clear()
    asyncio.run(tick.scaler.step(fresh, None))
    assert tick.writes == []


def test_scrape_failures_are_counted_per_resource_and_a_change_is_written(tick, monkeypatch):
    monkeypatch.setattr(scaler, "STATUS_MIN_INTERVAL_S", 0.0)  # the gauges too, at once
    tick.run()
    failures = counter(metrics.SCRAPE_FAILURES, "ns", "tiny")
    (one, _) = tick.cache.of("ns", "tiny")
    tick.scraped[one.status.pod_ip] = None  # its /metrics cannot be read
    tick.run()
    tick.run()
    assert counter(metrics.SCRAPE_FAILURES, "ns", "tiny") == failures + 2
    assert len(tick.writes) == 2 and tick.writes[1]["autoscaling"]["unreadableWorkers"] == 1
    metrics.forget("ns", "tiny")  # the resource went: its series go too
    series = {
        (s.labels.get("namespace"), s.labels.get("name"))
        for s in metrics.SCRAPE_FAILURES.collect()[0].samples
    }
    assert ("ns", "tiny") not in series


def test_a_member_of_an_endpoint_reads_the_shared_routers_demand_for_its_own_models_only(tick, monkeypatch):
    """A member of an InferenceEndpoint: its routers are the endpoint's (owned through the
    Deployment named as the endpoint), a look-alike router pod a tenant made is not read, and of
    the shared router's samples only its own models' count (another model's queue is not its
    demand)."""
    from kvscale.operator.api.labels import LABEL_ENDPOINT, ROUTER

    def router_pod(name: str, rs: str, ip: str):
        p = pod(name, refs=[ctrl_ref(rs)], ip=ip)
        p.metadata.labels = {LABEL_NAME: ROUTER, LABEL_ENDPOINT: "shared"}
        return p

    def ctrl_ref(rs: str):
        return client.V1OwnerReference(
            api_version="apps/v1", kind="ReplicaSet", name=rs, uid=f"rs-{rs}", controller=True
        )

    monkeypatch.setitem(
        OWNERS,
        ("ReplicaSet", "ns", "shared-abc"),
        {
            "uid": "rs-shared-abc",
            "ownerReferences": [ctrl("Deployment", "shared", "dep-shared")],
        },
    )
    monkeypatch.setitem(
        OWNERS,
        ("Deployment", "ns", "shared"),
        {
            "uid": "dep-shared",
            "ownerReferences": [ctrl("InferenceEndpoint", "shared", "uid-endpoint")],
        },
    )
    # A tenant's Deployment, pointed at the endpoint but not named as it.
    monkeypatch.setitem(
        OWNERS,
        ("ReplicaSet", "ns", "fake-abc"),
        {
            "uid": "rs-fake-abc",
            "ownerReferences": [ctrl("Deployment", "fake", "dep-fake")],
        },
    )
    monkeypatch.setitem(
        OWNERS,
        ("Deployment", "ns", "fake"),
        {
            "uid": "dep-fake",
            "ownerReferences": [ctrl("InferenceEndpoint", "shared", "uid-endpoint")],
        },
    )
    real, fake = (
        router_pod("shared-abc-1", "shared-abc", "10.9.0.1"),
        router_pod("fake-abc-1", "fake-abc", "10.9.0.2"),
    )
    tick.cache.replace([*tick.cache.of("ns", "tiny"), real, fake])
    exposition = "\n".join(
        [
            "# TYPE kvscale_router_queued_requests gauge",
            'kvscale_router_queued_requests{model="tiny"} 2.0',
            'kvscale_router_queued_requests{model="tiny-sql"} 1.0',
            'kvscale_router_queued_requests{model="other"} 40.0',
            "# TYPE kvscale_router_requests counter",
            'kvscale_router_requests_total{model="tiny"} 7.0',
            'kvscale_router_requests_total{model="other"} 900.0',
        ]
    )
    read: list[str] = []

    async def scrape(session, ip, parse=None):
        if parse is None:
            return {"kv_usage": 0.5, "waiting": 0.0, "running": 1.0, "arrivals": 10.0}
        read.append(ip)
        return parse(exposition)

    monkeypatch.setattr(scaler, "scrape", scrape)
    tick.target.spec = {
        **SPEC,
        "router": {"endpoint": "shared"},
        "adapters": [{"name": "tiny-sql", "uri": "/a"}],
    }
    pods = tick.cache.of("ns", "tiny")
    states = {p.metadata.name: "ready" for p in pods}
    sample = asyncio.run(tick.scaler._sample(None, pods, states, tick.target))
    assert read == ["10.9.0.1"]  # the endpoint's router only, never the look-alike
    (router,) = sample.routers
    assert (router.queued, router.arrivals) == (3.0, 7.0)  # tiny and its adapter; not "other"
