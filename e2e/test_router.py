"""The router the operator deploys, end to end on the real node: scale from zero, requests
through the router while a worker goes, and the InferencePool where its CRD is installed.

- An InferenceDeployment with `autoscaling.minReplicas: 0` goes to zero when idle; 20 concurrent
  requests to the router's Service make exactly one scale-up (the audit log's writes to the
  workers' deployments/scale: one, by the router's ServiceAccount) and all return 200; idle again,
  the autoscaler takes it back to zero.
- Requests through the router keep flowing while a worker is deleted: 0 failed; each router
  replica subscribed to every worker's KV events (the replacement's too) and scored requests by
  the precise index, with the tokenizer it fetched from a worker.
- Two routers (the default) with their PodDisruptionBudget: one is evicted, a second eviction
  at once is refused (429), and requests keep flowing meanwhile: 0 failed.
- With a test copy of the InferencePool CRD installed (e2e/testdata), the operator applies a pool
  selecting the workers.

The router's Service is reached from the host by its ClusterIP (kube-proxy on this node), as
e2e/test_autoscaling.py reaches the workers' Service.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from audit import audit_lines
from kubernetes import client
from service_route import wait_routed
from test_controlplane import wait_for
from test_operator import (  # noqa: F401 (fixtures)
    OPERATOR_USER,
    apply,
    example,
    get_cr,
    namespace,
    operator,
    wait_ready,
)

TESTDATA = Path(__file__).parent / "testdata"
POOLS = ("inference.networking.k8s.io", "v1", "inferencepools")
WORKERS = "app.kubernetes.io/name=kvscale-worker"


def router_pods(cluster, name: str, ns: str) -> list[client.V1Pod]:
    selector = f"app.kubernetes.io/name=kvscale-router,app.kubernetes.io/instance={name}"
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(ns, label_selector=selector).items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def router_ip(cluster, name: str, ns: str) -> str:
    svc = client.CoreV1Api(cluster.api).read_namespaced_service(f"{name}-router", ns).spec
    assert svc.ports[0].port == 8000
    return svc.cluster_ip


def wait_router(cluster, name: str, ns: str, timeout: float = 180) -> str:
    """The router's ClusterIP once its Deployment has a ready pod and kube-proxy routes it."""
    apps = client.AppsV1Api(cluster.api)

    def ready():
        try:
            dep = apps.read_namespaced_deployment(f"{name}-router", ns)
        except client.ApiException:
            return False
        return (dep.status.ready_replicas or 0) >= 1

    wait_for(ready, timeout=timeout, interval=0.5, what="the router to be ready")
    ip = router_ip(cluster, name, ns)
    wait_routed(ip, 8000)
    return ip


def complete(ip: str, model: str, stream: bool = False, timeout: float = 600) -> tuple[int, bytes]:
    body = {
        "model": model,
        "prompt": "def fibonacci(n):",
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }
    request = urllib.request.Request(
        f"http://{ip}:8000/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except Exception as e:  # a failure is a failure: reported, not raised from a thread
        return -1, f"{type(e).__name__}: {e}".encode()


def scale_writes(cluster, since: int, ns: str, name: str) -> list[str]:
    """Who wrote the workers' Deployment's scale subresource after audit line `since`."""
    out = []
    for line in (cluster.state_dir / "audit.log").read_text().splitlines()[since:]:
        event = json.loads(line)
        ref = event.get("objectRef") or {}
        if (
            ref.get("resource") == "deployments"
            and ref.get("subresource") == "scale"
            and ref.get("namespace") == ns
            and ref.get("name") == name
            and event["verb"] in ("update", "patch")
            and event.get("responseStatus", {}).get("code") == 200
        ):
            out.append(event["user"].get("username"))
    return out


def worker_pods(cluster, ns: str) -> list[client.V1Pod]:
    return client.CoreV1Api(cluster.api).list_namespaced_pod(ns, label_selector=WORKERS).items


def test_from_zero_twenty_requests_make_one_scale_up_all_200_and_idle_goes_back_to_zero(
    operator,  # noqa: F811
    namespace,  # noqa: F811
):
    if not operator.local:
        pytest.skip("reads the local API server's audit log")
    ns, name = namespace, "zero"
    doc = example(name, ns)
    del doc["spec"]["replicas"]
    doc["spec"]["autoscaling"] = {
        "minReplicas": 0,
        "maxReplicas": 1,  # only the scale from zero can add a worker here
        "scaleToZeroAfterSeconds": 15,
        "scaleDownStabilizationSeconds": 10,
    }
    apply(operator, doc)
    apps = client.AppsV1Api(operator.api)
    router_sa = f"system:serviceaccount:{ns}:{name}-router"

    # A new Deployment starts at 1 (its default): loaded and idle for 15 s, it goes to zero.
    def at_zero():
        try:
            replicas = apps.read_namespaced_deployment(name, ns).spec.replicas
        except client.ApiException as e:
            if e.status == 404:
                return False  # the operator has not created it yet
            raise
        return replicas == 0 and not worker_pods(operator, ns)

    wait_for(at_zero, timeout=420, interval=1, what="the idle resource to reach zero")
    ip = wait_router(operator, name, ns)
    cr = get_cr(operator, name, ns)
    assert cr["status"]["endpoint"] == f"http://{name}-router.{ns}.svc:8000"
    mark = audit_lines(operator)

    with ThreadPoolExecutor(max_workers=20) as pool:
        futures = [pool.submit(complete, ip, name, stream=(i % 10 == 0)) for i in range(20)]
        results = [f.result() for f in futures]
    assert [status for status, _ in results] == [200] * 20, [r for r in results if r[0] != 200][:3]
    streams = [body for i, (_, body) in enumerate(results) if i % 10 == 0]
    assert all(body.rstrip().endswith(b"data: [DONE]") for body in streams), streams
    # Exactly one scale-up: the router's one write (0 -> 1); the autoscaler held at zero.
    assert scale_writes(operator, mark, ns, name) == [router_sa]
    assert apps.read_namespaced_deployment(name, ns).spec.replicas == 1

    # Idle again: back to zero after the cooldown, by the autoscaler; nothing woke it again.
    wait_for(at_zero, timeout=240, interval=1, what="the resource to return to zero")
    writers = scale_writes(operator, mark, ns, name)
    assert writers[0] == router_sa and writers.count(router_sa) == 1, writers
    assert len(writers) == 2 and writers[1] == OPERATOR_USER, writers
    decisions = get_cr(operator, name, ns)["status"]["autoscaling"]["lastDecisions"]
    assert "scale to zero 1 -> 0" in decisions[-1]["reason"], decisions


class ClientLoad:
    """Three client threads (one streaming) sending completions through `ip` until stopped,
    started once ten have been served; `results` holds every status, `errors` the failed bodies."""

    def __init__(self, ip: str, name: str, what: str) -> None:
        self.results: list[int] = []
        self.errors: list[bytes] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, args=(ip, name, i == 0), daemon=True) for i in range(3)
        ]
        for t in self._threads:
            t.start()
        wait_for(lambda: len(self.results) >= 10, timeout=120, interval=0.5, what=what)

    def _loop(self, ip: str, name: str, stream: bool) -> None:
        while not self._stop.is_set():
            status, body = complete(ip, name, stream=stream, timeout=120)
            with self._lock:
                self.results.append(status)
                if status != 200:
                    self.errors.append(body[:300])

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)


def test_requests_through_the_router_keep_flowing_while_a_worker_is_removed(
    operator,  # noqa: F811
    namespace,  # noqa: F811
):
    ns, name = namespace, "flow"
    apply(operator, example(name, ns, replicas=2))
    wait_ready(operator, name, ns, replicas=2)
    ip = wait_router(operator, name, ns)
    load = ClientLoad(ip, name, "requests through the router")
    results = load.results
    victim = worker_pods(operator, ns)[0].metadata.name
    operator.kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
    before = len(results)
    wait_for(
        lambda: all(p.metadata.name != victim for p in worker_pods(operator, ns)),
        timeout=120,
        interval=0.5,
        what="the deleted worker to drain and go",
    )
    wait_ready(operator, name, ns, replicas=2)  # its replacement
    served = len(results)
    wait_for(
        lambda: len(results) >= served + 10,
        timeout=120,
        interval=0.2,
        what="requests served by the new set of workers",
    )
    load.stop()
    assert not load.errors, load.errors[:5]
    assert len(results) > before  # requests were served while the worker went
    assert set(results) == {200}
    # The precise prefix index (the default): each router replica subscribed to every worker's KV
    # events (the replacement's too), fetched the tokenizer from a worker, and scored by them.
    for pod in router_pods(operator, name, ns):
        metrics = router_metrics(pod.status.pod_ip)
        assert metrics.get('kvscale_router_kv_events_total{kind="synced"}', 0) >= 3, metrics
        assert metrics.get('kvscale_router_kv_events_total{kind="batch"}', 0) >= 1, metrics
        assert metrics.get('kvscale_router_picks_total{index="precise"}', 0) >= 1, metrics


def router_metrics(pod_ip: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{pod_ip}:8000/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(("kvscale_router_kv_events_total", "kvscale_router_picks_total"))
    }


def test_an_inference_pool_appears_where_its_crd_is_installed(operator, namespace):  # noqa: F811
    # Left installed: the session's later resources get pools too, which nothing else minds (and
    # deleting it would fail applies until the operator's next discovery).
    crd = TESTDATA / "inferencepools-crd.test-copy.yaml"
    operator.kubectl("apply", "--server-side", "-f", str(crd))
    operator.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/inferencepools.inference.networking.k8s.io",
        "--timeout=60s",
    )
    ns, name = namespace, "pooled"
    apply(operator, example(name, ns, replicas=1))
    custom = client.CustomObjectsApi(operator.api)

    def pool():
        try:
            return custom.get_namespaced_custom_object(*POOLS[:2], ns, POOLS[2], name)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    # Discovery is asked every 30 s (KVSCALE_DISCOVERY_SECONDS), then every resource gets its pool.
    found = wait_for(pool, timeout=120, interval=1, what="the InferencePool")
    dep = client.AppsV1Api(operator.api).read_namespaced_deployment(name, ns)
    assert found["spec"]["selector"]["matchLabels"] == dep.spec.selector.match_labels
    assert found["spec"]["targetPorts"] == [{"number": 8000}]
    uid = get_cr(operator, name, ns)["metadata"]["uid"]
    assert [r["uid"] for r in found["metadata"]["ownerReferences"]] == [uid]
    # Deleted by hand, the next resync (KVSCALE_RESYNC_SECONDS, 300) puts it back: not waited for
    # here; tests/test_selfheal_units.py shows it.


def test_two_routers_one_evicted_at_a_time_while_requests_keep_flowing(
    operator,  # noqa: F811
    namespace,  # noqa: F811
):
    ns, name = namespace, "ha"
    apply(operator, example(name, ns, replicas=1))
    wait_ready(operator, name, ns, replicas=1)
    apps, core = client.AppsV1Api(operator.api), client.CoreV1Api(operator.api)
    policy = client.PolicyV1Api(operator.api)

    def routers_ready() -> bool:
        dep = apps.read_namespaced_deployment(f"{name}-router", ns)
        return dep.spec.replicas == 2 and (dep.status.ready_replicas or 0) == 2

    wait_for(routers_ready, timeout=180, interval=0.5, what="two ready routers")
    pdb = wait_for(
        lambda: (
            (p := policy.read_namespaced_pod_disruption_budget(f"{name}-router", ns)).status
            and p.status.disruptions_allowed == 1
            and p
        ),
        timeout=60,
        interval=0.5,
        what="the router's PodDisruptionBudget to allow one disruption",
    )
    assert pdb.spec.max_unavailable == 1
    ip = router_ip(operator, name, ns)
    wait_routed(ip, 8000)
    load = ClientLoad(ip, name, "requests through the routers")
    results = load.results
    first, second = (p.metadata.name for p in router_pods(operator, name, ns))

    def evict(pod: str) -> None:
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=ns))
        core.create_namespaced_pod_eviction(pod, ns, body)

    evict(first)
    with pytest.raises(client.ApiException) as refused:
        evict(second)  # the budget is spent until the first one's replacement is ready
    assert refused.value.status == 429, refused.value.body
    before = len(results)
    wait_for(
        lambda: first not in {p.metadata.name for p in router_pods(operator, name, ns)} and routers_ready(),
        timeout=180,
        interval=0.5,
        what="the evicted router replaced",
    )
    served = len(results)
    wait_for(
        lambda: len(results) >= served + 10,
        timeout=120,
        interval=0.2,
        what="requests served through the new set of routers",
    )
    load.stop()
    assert not load.errors, load.errors[:5]
    assert len(results) > before  # served while a router went
    assert set(results) == {200}
