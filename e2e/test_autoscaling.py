"""The autoscaler end to end on the real node: the operator in its pod under its RBAC, worker
pods from the worker image, run and probed by the kubelet.

A load generator (playing a load-balancing gateway: it sends to the addresses of ready,
non-terminating pods, least outstanding requests first) pushes the one worker's KV-cache usage
over target; the operator scales the Deployment up, a new worker starts, becomes ready and takes
load. Then the heavy load stops; a light load stays, heavier on the new worker than on the old
one, plus one client through the Service's ClusterIP (kube-proxy); after the down-window the
operator scales down, marking the least-loaded pod (the old one, which the ReplicaSet controller
would otherwise keep) with pod-deletion-cost; the kubelet runs its preStop, sends SIGTERM and the
worker drains and goes. Every request of the run, through the ClusterIP too, must succeed.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections import Counter

import pytest
from kubernetes import client, watch
from test_controlplane import wait_for
from test_operator import apply, example, get_cr, namespace, operator  # noqa: F401 (fixtures)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
WORKERS = "app.kubernetes.io/name=kvscale-worker"


class Load:
    """Closed-loop clients: each keeps one completion in flight against a pod chosen by `pick`."""

    def __init__(self, cluster, ns: str, name: str) -> None:
        self.core = client.CoreV1Api(cluster.api)
        self.ns, self.name = ns, name
        self.results: Counter = Counter()  # (pod, "ok" | error) -> count
        self.errors: list[str] = []
        self.in_flight: Counter = Counter()
        self._lock = threading.Lock()
        self._threads: list[tuple[threading.Thread, threading.Event]] = []

    def serving_pods(self) -> dict[str, str]:
        """name -> IP of the pods a Service would route to: ready and not terminating."""
        pods = self.core.list_namespaced_pod(
            self.ns, label_selector=f"kvscale.dev/inference-deployment={self.name}"
        ).items
        return {
            p.metadata.name: p.status.pod_ip
            for p in pods
            if p.metadata.deletion_timestamp is None
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        }

    def start(
        self,
        streams: int,
        prompt_len: int,
        max_tokens: int,
        only: str | None = None,
        via: str | None = None,
    ) -> threading.Event:
        """`streams` clients; `only`: to that pod alone; `via`: to that address (a ClusterIP),
        counted under the name "service"."""
        stop = threading.Event()
        for i in range(streams):
            t = threading.Thread(
                target=self._client, args=(stop, prompt_len, max_tokens, only, via, i), daemon=True
            )
            t.start()
            self._threads.append((t, stop))
        return stop

    def _client(
        self,
        stop: threading.Event,
        prompt_len: int,
        max_tokens: int,
        only: str | None,
        via: str | None,
        seed: int,
    ):
        rng = random.Random(seed)
        while not stop.is_set():
            pods = {"service": via} if via is not None else self.serving_pods()
            if only is not None:
                pods = {k: v for k, v in pods.items() if k == only}
            if not pods:
                time.sleep(0.2)
                continue
            with self._lock:  # least outstanding requests, as a load-balancing gateway would
                pod = min(pods, key=lambda p: (self.in_flight[p], rng.random()))
                self.in_flight[pod] += 1
            body = {
                "model": self.name,
                "prompt": [rng.randrange(10, 4000) for _ in range(prompt_len)],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            request = urllib.request.Request(
                f"http://{pods[pod]}:8000/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=120) as r:
                    answer = json.loads(r.read())
                ok = answer["usage"]["completion_tokens"] == max_tokens
                outcome = "ok" if ok else f"short: {answer['usage']}"
            except Exception as e:  # any failure fails the test
                outcome = f"{type(e).__name__}: {e}"
            with self._lock:
                self.in_flight[pod] -= 1
                self.results[(pod, "ok" if outcome == "ok" else "error")] += 1
                if outcome != "ok":
                    self.errors.append(f"{pod}: {outcome}")

    def stop(self, event: threading.Event) -> None:
        event.set()
        for t, e in self._threads:
            if e is event:
                t.join(timeout=150)

    def served(self, pod: str) -> int:
        return self.results[(pod, "ok")]


def test_scales_on_kv_usage_and_removes_the_least_loaded_worker_without_failing_a_request(
    operator,  # noqa: F811
    namespace,  # noqa: F811
):
    if not operator.local:
        pytest.skip("mounts the fixture model from this machine")
    ns, name = namespace, "auto"
    # The pod-deletion-cost marks are granted per namespace (manifests/rbac.yaml): here they are.
    operator.kubectl(
        "create", "rolebinding", "kvscale-operator-pod-marks", "-n", ns,
        "--clusterrole=kvscale-operator-pod-marks", "--serviceaccount=kvscale-system:kvscale-operator",
    )  # fmt: skip
    doc = example(name, ns)
    del doc["spec"]["replicas"]
    # A small KV cache (128 blocks of 16 tokens): three 400-token prompts fill 59 % of it.
    doc["spec"]["engine"].update({"maxModelLen": 1024, "extraArgs": ["--num-kv-blocks", "128"]})
    doc["spec"]["server"]["drainTimeoutSeconds"] = 30
    doc["spec"]["autoscaling"] = {
        "minReplicas": 1,
        "maxReplicas": 2,
        "targetKvCacheUsage": 0.5,
        "targetQueueLength": 4,
        "scaleUpStabilizationSeconds": 2,
        "scaleDownStabilizationSeconds": 10,
    }
    apply(operator, doc)
    apps = client.AppsV1Api(operator.api)
    load = Load(operator, ns, name)
    wait_for(lambda: len(load.serving_pods()) == 1, timeout=180, interval=0.5, what="the first worker")
    (first,) = load.serving_pods()
    assert apps.read_namespaced_deployment(name, ns).spec.replicas == 1

    # Heavy load: three long requests at a time, KV usage ~0.6-0.9 on one worker.
    heavy = load.start(streams=3, prompt_len=400, max_tokens=64)
    seen_kv = []

    def spread():
        cr = get_cr(operator, name, ns)
        seen_kv.append((cr.get("status") or {}).get("kvCacheUsage") or 0.0)
        pods = load.serving_pods()
        second = [p for p in pods if p != first]
        return second[0] if second and load.served(second[0]) > 0 else None

    second = wait_for(spread, timeout=240, interval=1, what="a second worker serving load")
    assert apps.read_namespaced_deployment(name, ns).spec.replicas == 2
    assert max(seen_kv) > 0.5, seen_kv
    scaled = get_cr(operator, name, ns)["status"]["autoscaling"]
    decisions = scaled["lastDecisions"]
    assert [(d["fromReplicas"], d["toReplicas"]) for d in decisions] == [(1, 2)], decisions
    assert scaled["unreadableWorkers"] == 0  # every ready worker's /metrics was read
    # The look-ahead is the workers' startup as the kubelet reports it (container start to Ready),
    # a few seconds for the fixture model, never the pods' age nor above the startup budget.
    budget = doc["spec"]["server"].get("startupTimeoutSeconds", 600)
    assert 0 < scaled["lookaheadSeconds"] <= min(budget, 120), scaled
    assert "scale up 1 -> 2" in decisions[0]["reason"]

    # Light load, heavier on the new worker: the old one is the least loaded and must be the one
    # removed (left alone, the ReplicaSet controller removes the newest pod). It starts before
    # the heavy load winds down, so no moment of the down-window sees the workers idle.
    light_new = load.start(streams=3, prompt_len=40, max_tokens=64, only=second)
    light_old = load.start(streams=1, prompt_len=40, max_tokens=64, only=first)
    core = client.CoreV1Api(operator.api)
    service = core.read_namespaced_service(name, ns).spec
    assert service.ports[0].port == 8000
    via_service = load.start(streams=1, prompt_len=40, max_tokens=16, via=service.cluster_ip)
    heavy.set()  # each heavy client finishes its request in flight, then stops
    marked = []

    def scaled_down():
        for p in core.list_namespaced_pod(ns).items:
            if (p.metadata.annotations or {}).get(DELETION_COST) and p.metadata.name not in marked:
                marked.append(p.metadata.name)
        return apps.read_namespaced_deployment(name, ns).spec.replicas == 1

    wait_for(scaled_down, timeout=300, interval=0.5, what="the scale-down")
    try:
        wait_for(
            lambda: (
                [p.metadata.name for p in core.list_namespaced_pod(ns, label_selector=WORKERS).items]
                == [second]
            ),  # the workers (the router's pod lives on beside them)
            timeout=90,
            interval=0.5,
            what="the least-loaded worker to drain and go",
        )
    except AssertionError as e:  # which pod went, or which one is still draining, and why
        pods = [
            (
                p.metadata.name,
                p.status.phase,
                p.metadata.deletion_timestamp,
                (p.metadata.annotations or {}).get(DELETION_COST),
            )
            for p in core.list_namespaced_pod(ns, label_selector=WORKERS).items
        ]
        decisions = get_cr(operator, name, ns)["status"]["autoscaling"]["lastDecisions"]
        raise AssertionError(
            f"{e}: first={first} second={second} marked={marked} pods={pods} decisions={decisions}\n"
            + operator.kubectl("get", "events", "-n", ns).stdout[-4000:]
        ) from None
    load.stop(heavy)
    load.stop(light_old)
    # The remaining worker keeps serving, directly and through the Service, after the other went.
    served = load.served(second), load.served("service")
    wait_for(
        lambda: load.served(second) > served[0] and load.served("service") > served[1],
        timeout=120,
        interval=0.2,
        what="the remaining worker to serve again",
    )
    load.stop(light_new)
    load.stop(via_service)

    assert marked == [first]
    decisions = get_cr(operator, name, ns)["status"]["autoscaling"]["lastDecisions"]
    assert [(d["fromReplicas"], d["toReplicas"]) for d in decisions] == [(1, 2), (2, 1)]
    assert decisions[1]["reason"].endswith(f"removing {first}")
    assert not load.errors, load.errors[:5]
    assert load.served(first) > 0 and load.served(second) > 0 and load.served("service") > 0
    # The kubelet ran the removed pod's preStop hook and its drain ended the process itself.
    events = operator.kubectl(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={first}"
    ).stdout
    assert "Killing" in events and "FailedPreStopHook" not in events, events
    printed = operator.kubectl("get", "infd", name, "-n", ns).stdout
    assert "KV USAGE" in printed
    events = operator.kubectl("get", "events", "-n", ns, "--field-selector", "reason=Scaled").stdout
    assert "scale up 1 -> 2" in events and "scale down 2 -> 1" in events, events

    # Autoscaling off (a GitOps change to a fixed count): the count is the spec's again, and the
    # autoscaler's signals leave status rather than going stale.
    fixed = {**doc, "spec": {**doc["spec"], "replicas": 2}}
    del fixed["spec"]["autoscaling"]
    apply(operator, fixed)

    def fixed_and_clean():
        status = get_cr(operator, name, ns).get("status") or {}
        kinds = {c["type"] for c in status.get("conditions", [])}
        return (
            apps.read_namespaced_deployment(name, ns).spec.replicas == 2
            and "autoscaling" not in status
            and "kvCacheUsage" not in status
            and "ScalingActive" not in kinds
        )

    wait_for(fixed_and_clean, timeout=60, interval=0.5, what="replicas 2 and no autoscaler status")
    wait_for(lambda: len(load.serving_pods()) == 2, timeout=180, interval=0.5, what="two workers")

    # And on again: the live count is handed to the autoscaler, so dropping `replicas` from our
    # apply does not reset the Deployment to its default of 1 (the idle workers fit on one, but
    # only after the 60 s down-window may the autoscaler say so).
    doc["spec"]["autoscaling"]["scaleDownStabilizationSeconds"] = 60
    watch_from = apps.read_namespaced_deployment(name, ns).metadata.resource_version
    apply(operator, doc)
    wait_for(
        lambda: "autoscaling" in (get_cr(operator, name, ns).get("status") or {}),
        timeout=60,
        interval=0.5,
        what="the autoscaler to report again",
    )
    seen = [
        e["object"].spec.replicas
        for e in watch.Watch().stream(
            apps.list_namespaced_deployment,
            ns,
            resource_version=watch_from,
            timeout_seconds=5,
        )
    ]
    assert seen and set(seen) == {2}, seen
    owners = {
        f.manager
        for f in apps.read_namespaced_deployment(name, ns).metadata.managed_fields
        if "f:replicas" in (f.fields_v1 or {}).get("f:spec", {})
    }
    assert "kvscale-autoscaler" in owners and "kvscale-operator" not in owners, owners

    # Delete the resource (and wait for its workers) before the namespace goes.
    client.CustomObjectsApi(operator.api).delete_namespaced_custom_object(
        "kvscale.dev", "v1alpha1", ns, "inferencedeployments", name
    )
    wait_for(lambda: not core.list_namespaced_pod(ns).items, timeout=90, what="the workers to be gone")
