"""The autoscaler's I/O: scrape each worker, apply the policy, scale the Deployment, report.

One asyncio task per InferenceDeployment with `spec.autoscaling`, started and stopped by a kopf
event handler. (Not a kopf daemon or timer: kopf puts a finalizer on every resource that has
one, which would write the resource's metadata and keep a resource from being deleted while the
operator is down; see docs/operator.md.) kopf runs only on the Lease holder (main.py), so only
the leader scales.

Every SCRAPE_INTERVAL_S the task takes its worker and router pods from the pod cache (pods.py:
one label-selected watch for all resources, fed on the leader only; no LIST per tick), keeps
those its owner references prove the operator's own (pods.Ownership: a label is no proof), reads
`/metrics` from each ready one directly (pod IP and port, short timeouts, in parallel; at most
SCRAPE_MAX_BYTES, streamed and abandoned past it, parsed off the event loop; the
router's queue and arrivals are demand no worker reports yet), asks `autoscaling.decide`, and on a
change patches the Deployment's scale subresource. A multi-node resource scales groups: its
LeaderWorkerSet's scale subresource, each group one "worker" seen through its leader (rank 0, the
pod that serves and reports the group's metrics). Before removing workers it marks the least
loaded with `controller.kubernetes.io/pod-deletion-cost`, so the ReplicaSet controller removes
exactly those; they then drain (preStop, SIGTERM, the worker finishes in-flight requests).
Status carries the signals and the last decisions: decisions, counts and the condition when
they change, the gauges at most once a minute (`_report`, status.autoscaler_status_due).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from kvscale.common.capped_body import TooLarge, read_capped
from kvscale.operator import access, leaderworkerset, metrics
from kvscale.operator.autoscaling import (
    STARTUP_SLACK_S,
    Autoscaler,
    Decision,
    Params,
    PodLoad,
    PodState,
    PodTiming,
    RouterLoad,
    Sample,
    confirms_idle,
)
from kvscale.operator.children import (
    AUTOSCALER_MANAGER,
    LWS_WORKER_INDEX,
    PORT,
    router_name,
    workload_key,
)
from kvscale.operator.models import GROUP, KIND, PLURAL, VERSION, InferenceDeploymentSpec
from kvscale.operator.pods import Ownership, PodCache, PodFeeder, url_of
from kvscale.operator.status import STATUS_MIN_INTERVAL_S, autoscaler_status_due

logger = logging.getLogger(__name__)

SCRAPE_INTERVAL_S = 2.0
SCRAPE_TIMEOUT_S = 1.5
# A worker's exposition is ~20 KiB; a body past this is no worker's (a tenant's look-alike, a
# bug): the pod counts as unreadable. The operator runs in 512Mi with kopf and the lease on one
# event loop, so nothing it reads from a pod may be unbounded.
SCRAPE_MAX_BYTES = 1 << 20
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
VICTIM_COST = "-1000"  # below every unmarked pod (default 0): removed first
KEEP_DECISIONS = 5
WORKER_CONTAINER = "worker"  # the container children.py runs kvscale-worker in

# Our metric names first, vLLM's as a fallback (so vLLM workers scale too).
METRICS = {
    "kv_usage": ("kvscale_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "waiting": ("kvscale_requests_waiting", "vllm:num_requests_waiting"),
    "running": ("kvscale_requests_running", "vllm:num_requests_running"),
    "finished": ("kvscale_requests_finished_total", "vllm:request_success_total"),
}
# Requests refused for a full queue are demand too (other refusals are not: invalid, draining...).
QUEUE_FULL = ("kvscale_requests_rejected_total", "reason", "queue_full")


def parse_metrics(text: str) -> dict[str, float]:
    """The signals from a Prometheus text exposition (summed over label sets), and `arrivals`:
    the requests the worker has received, a counter (finished + refused for a full queue + in
    flight), whose rate is the demand on it whether or not it keeps up."""
    values: dict[str, float] = {}
    queue_full = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            if sample.name == QUEUE_FULL[0] and sample.labels.get(QUEUE_FULL[1]) == QUEUE_FULL[2]:
                queue_full += sample.value
    out = {}
    for key, names in METRICS.items():
        found = next((values[n] for n in names if n in values), None)
        if found is not None:
            out[key] = found
    if all(k in out for k in ("finished", "running", "waiting")):
        out["arrivals"] = out.pop("finished") + queue_full + out["running"] + out["waiting"]
    out.pop("finished", None)
    return out


# The router's own families (router/server.py), summed over models.
ROUTER_METRICS = {
    "queued": "kvscale_router_queued_requests",
    "in_flight": "kvscale_router_in_flight_requests",
    "arrivals": "kvscale_router_requests_total",
}


def parse_router_metrics(text: str) -> dict[str, float]:
    """The router's queue, in-flight and arrivals counts from its exposition (summed over
    models); a family it does not export yet (no request so far) reads as 0."""
    wanted = {v: k for k, v in ROUTER_METRICS.items()}
    out = dict.fromkeys(ROUTER_METRICS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += sample.value
    return out


# A worker that restarted this often without becoming Ready is crash-looping even between two
# CrashLoopBackOff waits (while the kubelet runs it again, its state is `running`).
CRASH_RESTARTS = 3
# Waiting reasons of a container that cannot start until someone changes something.
CANNOT_START = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)


def _worker_status(status: client.V1PodStatus | None) -> client.V1ContainerStatus | None:
    containers = (status and status.container_statuses) or []
    return next((c for c in containers if c.name == WORKER_CONTAINER), containers[0] if containers else None)


def pod_state(pod: client.V1Pod, now: float | None = None, startup_budget_s: float = 600.0) -> PodState:
    """What a pod is to the autoscaler (autoscaling.PodState), from its status alone: `ready`,
    `terminating`, `starting` (capacity on its way), or one that is not coming: `unschedulable`
    (PodScheduled False, reason Unschedulable), `crashlooping` (a container waiting in
    CrashLoopBackOff, or the worker restarted CRASH_RESTARTS times and not Ready), `stalled` (an
    image or config error, or its container running past the startup budget, Unix time `now`,
    without having been Ready since it started). A Ready pod that turned unready stays
    `starting`: an overloaded worker failing its probe is no reason to scale it away."""
    if pod.metadata.deletion_timestamp is not None:
        return "terminating"
    status = pod.status
    conditions = {c.type: c for c in (status and status.conditions) or []}
    ready = conditions.get("Ready")
    if ready is not None and ready.status == "True" and status.pod_ip:
        return "ready"
    scheduled = conditions.get("PodScheduled")
    if scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable":
        return "unschedulable"
    containers = [
        *((status and status.init_container_statuses) or []),
        *((status and status.container_statuses) or []),
    ]
    waiting = [
        c.state.waiting.reason for c in containers if c.state is not None and c.state.waiting is not None
    ]
    if "CrashLoopBackOff" in waiting:
        return "crashlooping"
    worker = _worker_status(status)
    if worker is not None and (worker.restart_count or 0) >= CRASH_RESTARTS:
        return "crashlooping"
    if CANNOT_START & set(waiting):
        return "stalled"
    running = worker.state.running if worker is not None and worker.state is not None else None
    started = running.started_at.timestamp() if running is not None and running.started_at else None
    if now is not None and started is not None and now - started > startup_budget_s + STARTUP_SLACK_S:
        was_ready = ready is not None and ready.last_transition_time is not None
        if not (was_ready and ready.last_transition_time.timestamp() > started):
            return "stalled"  # not Ready once since its container started, past the budget
    return "starting"


def pod_timing(pod: client.V1Pod) -> PodTiming:
    """The startup facts of a pod's status (`autoscaling.startup_of` judges them): when the worker
    container now running started, and since when the pod is Ready. Not the pod's creation: that
    would count scheduling and image pulls, and for a pod that restarted or whose readiness
    flapped, its whole age."""
    status = pod.status
    ready = next((c for c in (status and status.conditions) or [] if c.type == "Ready"), None)
    ready_since = None
    if ready is not None and ready.status == "True" and ready.last_transition_time is not None:
        ready_since = ready.last_transition_time.timestamp()
    worker = _worker_status(status)
    running = worker.state.running if worker is not None and worker.state is not None else None
    started = running.started_at.timestamp() if running is not None and running.started_at else None
    return PodTiming(pod.metadata.uid or pod.metadata.name, started, ready_since)


async def scrape(
    session: aiohttp.ClientSession,
    ip: str,
    parse=parse_metrics,
    *,
    max_bytes: int = SCRAPE_MAX_BYTES,
    timeout_s: float = SCRAPE_TIMEOUT_S,
    port: int = PORT,
) -> dict[str, float] | None:
    """One pod's /metrics, parsed (in a thread: a large exposition must not stall the loop that
    runs kopf and the lease), or None: refused, too slow (`timeout_s` for all of it, body
    included), too large, or unparsable. The session must not decompress (`new_session`): a small
    gzip body can inflate past any cap before a chunk reaches us."""
    url = url_of(ip, port, "/metrics")
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url, allow_redirects=False, headers={"Accept-Encoding": "identity"}) as r:
                if r.status != 200:
                    return None
                body = await read_capped(r, max_bytes)
        return await asyncio.to_thread(parse, body.decode("utf-8", errors="replace"))
    except TooLarge as e:
        logger.warning("autoscaler: %s answered a body too large to read (%s): counted unreadable", url, e)
        return None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def new_session(timeout_s: float = SCRAPE_TIMEOUT_S) -> aiohttp.ClientSession:
    """The scrapes' session: short timeouts, no decompression (see `scrape`)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s, connect=timeout_s)
    return aiohttp.ClientSession(timeout=timeout, auto_decompress=False)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Target:
    """One autoscaled resource: its latest body (from kopf's events) and its task."""

    name: str
    namespace: str
    uid: str
    spec: dict[str, Any]
    task: asyncio.Task | None = None
    scaler: Autoscaler = field(default_factory=lambda: Autoscaler(interval_s=SCRAPE_INTERVAL_S))
    decisions: list[dict[str, Any]] | None = None
    last_status: dict[str, Any] | None = None
    last_status_at: float = 0.0
    ignored: set[str] = field(default_factory=set)  # look-alike pods' uids, warned about once

    @property
    def body(self) -> dict[str, Any]:  # enough of the resource for kopf's event poster
        meta = {"name": self.name, "namespace": self.namespace, "uid": self.uid}
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": meta}


def read_owner(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    """The metadata of a link of a pod's owner chain (pods.Ownership), None when it is gone."""
    api = _api()
    apps = client.AppsV1Api(api)
    reads = {
        "ReplicaSet": apps.read_namespaced_replica_set,
        "StatefulSet": apps.read_namespaced_stateful_set,
        "Deployment": apps.read_namespaced_deployment,
    }
    try:
        if kind == "LeaderWorkerSet":
            body = client.CustomObjectsApi(api).get_namespaced_custom_object(
                leaderworkerset.GROUP,
                leaderworkerset.VERSION,
                namespace,
                leaderworkerset.PLURAL,
                name,
                _request_timeout=SCRAPE_TIMEOUT_S * 4,
            )
        elif kind in reads:
            response = reads[kind](
                name, namespace, _preload_content=False, _request_timeout=SCRAPE_TIMEOUT_S * 4
            )
            body = json.loads(response.data)
        else:
            return None
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return body.get("metadata") or {}


_targets: dict[str, Target] = {}
_pods = PodCache()
_feeder = PodFeeder(_pods)
_owners = Ownership(lambda kind, ns, name: read_owner(kind, ns, name))


@kopf.on.startup()
def start_pod_cache(**_: Any) -> None:
    """The pod cache is fed while kopf runs: on the leader only (main._lead)."""
    from kvscale.operator import handlers

    _feeder.start(client.CoreV1Api(_api()), handlers.watch_namespaces)


@kopf.on.cleanup()
def stop_pod_cache(**_: Any) -> None:
    _feeder.stop()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def track(body: kopf.Body, type: str | None, **_: Any) -> None:
    """Start, update or stop the autoscaler task of this resource."""
    meta = body["metadata"]
    uid = meta["uid"]
    wanted = type != "DELETED" and meta.get("deletionTimestamp") is None
    wanted = wanted and bool((body.get("spec") or {}).get("autoscaling"))
    target = _targets.get(uid)
    if not wanted:
        if target is not None:
            _targets.pop(uid)
            if target.task is not None:
                target.task.cancel()
            metrics.forget(target.namespace, target.name)
        return
    if target is None:
        target = _targets[uid] = Target(meta["name"], meta["namespace"], uid, dict(body["spec"]))
        shown = dict((body.get("status") or {}).get("autoscaling") or {})
        target.decisions = list(shown.get("lastDecisions") or [])
        # What the object shows is what was last applied (by this leader or the one before): an
        # unchanged tick after a takeover writes nothing either.
        shown.pop("lastScrapeTime", None)
        target.last_status = shown or None
        target.task = asyncio.create_task(_run(target), name=f"autoscaler {meta['namespace']}/{meta['name']}")
    target.spec = dict(body["spec"])


async def _run(target: Target) -> None:
    async with new_session() as session:
        while True:
            started = time.monotonic()
            try:
                await step(target, session)
            except asyncio.CancelledError:
                raise
            except ApiException as e:
                if e.status == 404:
                    logger.info("autoscaler: %s/%s not found yet", target.namespace, target.name)
                else:
                    metrics.errored(metrics.error_kind(e))
                    logger.warning("autoscaler step failed: %s %s", e.status, e.reason)
            except Exception as e:
                metrics.errored(metrics.error_kind(e))
                logger.exception("autoscaler step failed")
            await asyncio.sleep(max(0.1, SCRAPE_INTERVAL_S - (time.monotonic() - started)))


async def step(target: Target, session: aiohttp.ClientSession) -> Decision | None:
    """One tick: the pods from the cache (no LIST), their metrics, a decision, a scale, status."""
    if not _pods.synced.is_set():
        return None  # the cache's first LIST is not in: no pods is not yet "no pods"
    try:
        spec = InferenceDeploymentSpec.model_validate(target.spec)
    except ValidationError:
        return None  # reconcile reports it
    if spec.autoscaling is None:
        return None
    params = Params.from_spec(spec.autoscaling, startup_budget_s=spec.server.startup_timeout_seconds)
    name, ns = target.name, target.namespace
    grouped = workload_key(spec) == "LeaderWorkerSet"
    if grouped:  # groups of pods: the LeaderWorkerSet's replicas, each group seen by its leader
        current = await asyncio.to_thread(leaderworkerset.read_scale, _api(), name, ns, SCRAPE_TIMEOUT_S * 4)
        pods = [p for p in _pods.of(ns, name) if (p.metadata.labels or {}).get(LWS_WORKER_INDEX) == "0"]
    else:
        apps = client.AppsV1Api(_api())
        deployment = await asyncio.to_thread(apps.read_namespaced_deployment, name, ns)
        current = deployment.spec.replicas if deployment.spec.replicas is not None else 1
        pods = _pods.of(ns, name)
    pods = await _own(pods, target, name)
    wall = time.time()
    states = {p.metadata.name: pod_state(p, wall, params.startup_budget_s) for p in pods}
    sample = await _sample(session, pods, states, target)
    target.scaler.observe(sample, [pod_timing(p) for p in pods], params)
    decision = target.scaler.decide(current, params)
    metrics.decided(ns, name, current, decision.replicas)
    zero = None
    if decision.replicas == 0 and not grouped:
        # Scale to zero rests on a scrape taken before the victims were marked (one API call
        # each, up to 30 s on a slow API server): right before the write, a fresh scrape must
        # confirm that nothing arrived since, and the write carries this tick's resourceVersion.

        async def confirmed() -> bool:
            return confirms_idle(sample, await _sample(session, pods, states, target))

        zero = (confirmed, deployment.metadata.resource_version)
    if decision.changed(current) and not await _scale(
        target, pods, current, decision, grouped=grouped, zero=zero
    ):
        return decision  # withheld: the next tick decides again, on what it sees then
    await _report(target, decision, current)
    return decision


async def _sample(
    session: aiohttp.ClientSession, pods: list[client.V1Pod], states: dict[str, PodState], target: Target
) -> Sample:
    """One scrape of the ready workers and the resource's routers."""
    ns, name = target.namespace, target.name
    ready = [p for p in pods if states[p.metadata.name] == "ready"]
    scraped = await asyncio.gather(*(scrape(session, p.status.pod_ip) for p in ready))
    read = {p.metadata.name: m for p, m in zip(ready, scraped, strict=True)}
    failed = sum(m is None for m in scraped)
    if failed:
        metrics.SCRAPE_FAILURES.labels(ns, name).inc(failed)
    loads = []
    for p in pods:
        m = read.get(p.metadata.name) or {}
        loads.append(
            PodLoad(
                p.metadata.name,
                states[p.metadata.name],
                kv_usage=m.get("kv_usage"),
                waiting=m.get("waiting"),
                running=m.get("running"),
                arrivals=m.get("arrivals"),
            )
        )
    return Sample(
        time.monotonic(),
        tuple(sorted(loads, key=lambda p: p.name)),
        await _routers(session, await _own(_pods.routers_of(ns, name), target, router_name(name))),
    )


async def _own(pods: list[client.V1Pod], target: Target, workload: str) -> list[client.V1Pod]:
    """The pods the operator's workload `workload` created (pods.Ownership; reads off the loop)."""
    if not pods:
        return pods
    owned = await asyncio.to_thread(lambda: [_owners.owned(p, target.uid, workload) for p in pods])
    for p, ours in zip(pods, owned, strict=True):
        if not ours and p.metadata.uid not in target.ignored:
            if len(target.ignored) > 1024:  # bounded: a tenant churning look-alike pods
                target.ignored.clear()
            target.ignored.add(p.metadata.uid)
            logger.warning(
                "autoscaler: %s/%s carries the labels of %s's pods but was not created by its "
                "workload (owner references): ignored, never scraped",
                target.namespace,
                p.metadata.name,
                target.name,
            )
    return [p for p, ours in zip(pods, owned, strict=True) if ours]


async def _routers(session: aiohttp.ClientSession, pods: list[client.V1Pod]) -> tuple[RouterLoad, ...]:
    """The ready router pods' counts (one RouterLoad per pod, values None when unread)."""
    ready = [p for p in pods if pod_state(p) == "ready"]
    scraped = await asyncio.gather(*(scrape(session, p.status.pod_ip, parse_router_metrics) for p in ready))
    return tuple(
        RouterLoad(p.metadata.name, **(m or {}))
        for p, m in sorted(zip(ready, scraped, strict=True), key=lambda pm: pm[0].metadata.name)
    )


async def _scale(
    target: Target,
    pods: list[client.V1Pod],
    current: int,
    decision: Decision,
    *,
    grouped: bool = False,
    zero: tuple[Callable[[], Awaitable[bool]], str] | None = None,
) -> bool:
    """Mark the victims and write the count; False when it was withheld. `zero`, for a scale to
    zero: (a check that the resource is still idle, the Deployment's resourceVersion as read this
    tick): withheld when the check fails or the Deployment changed since (409)."""
    apps, core = client.AppsV1Api(_api()), client.CoreV1Api(_api())
    name, ns = target.name, target.namespace
    victims = () if grouped else decision.victims
    if grouped:
        # A LeaderWorkerSet removes its highest-numbered groups (a StatefulSet of leaders): no
        # pod-deletion-cost picks which, so no victims are marked or named.
        await asyncio.to_thread(
            leaderworkerset.write_scale, _api(), name, ns, decision.replicas, AUTOSCALER_MANAGER
        )
    elif decision.replicas < current and await asyncio.to_thread(access.allowed, _api(), ns):
        # (Marking is granted per namespace: access.py. Not granted: the ReplicaSet picks.)
        # The ReplicaSet controller removes the pods of lowest deletion cost first: mark exactly
        # the victims, and clear the mark a previous, unfinished decision left on any other pod.
        for p in pods:
            marked = (p.metadata.annotations or {}).get(DELETION_COST) == VICTIM_COST
            victim = p.metadata.name in decision.victims
            if victim != marked and p.metadata.deletion_timestamp is None:
                cost = VICTIM_COST if victim else None
                patch = {"metadata": {"annotations": {DELETION_COST: cost}}}
                await asyncio.to_thread(core.patch_namespaced_pod, p.metadata.name, ns, patch)
    if zero is not None and not await zero[0]():
        logger.info("autoscaler: %s/%s: a request arrived since the decision: not scaled to zero", ns, name)
        return False
    if not grouped and zero is not None:
        body = {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": name, "namespace": ns, "resourceVersion": zero[1]},
            "spec": {"replicas": decision.replicas},
        }
        try:
            await asyncio.to_thread(
                apps.replace_namespaced_deployment_scale, name, ns, body, field_manager=AUTOSCALER_MANAGER
            )
        except ApiException as e:
            if e.status != 409:
                raise
            logger.info("autoscaler: %s/%s changed since this tick's read: not scaled to zero", ns, name)
            return False
    elif not grouped:
        await asyncio.to_thread(
            apps.patch_namespaced_deployment_scale,
            name,
            ns,
            {"spec": {"replicas": decision.replicas}},
            field_manager=AUTOSCALER_MANAGER,
        )
    record = {
        "time": _now(),
        "fromReplicas": current,
        "toReplicas": decision.replicas,
        "reason": decision.reason + (f"; removing {', '.join(victims)}" if victims else ""),
    }
    target.decisions = [*(target.decisions or []), record][-KEEP_DECISIONS:]
    logger.info("autoscaler: %s/%s %s", ns, name, record["reason"])
    kopf.info(target.body, reason="Scaled", message=record["reason"])
    return True


async def _report(target: Target, decision: Decision, current: int) -> None:
    """Signals and decisions into status when status.autoscaler_status_due says so."""
    s = decision.signals
    signals = {
        "desiredReplicas": decision.replicas,
        "readyWorkers": s.ready if s else 0,
        "startingWorkers": s.starting if s else 0,
        "unreadableWorkers": s.unreadable if s else 0,
        "unschedulableWorkers": s.unschedulable if s else 0,
        "crashLoopingWorkers": s.crashlooping if s else 0,
        "stalledWorkers": s.stalled if s else 0,
        "lookaheadSeconds": round(target.scaler.last_lookahead_s, 1),
        "kvCacheUsage": None if s is None or s.mean_kv is None else round(s.mean_kv, 2),
        "waitingRequests": None if s is None or s.mean_waiting is None else round(s.mean_waiting, 1),
        "lastDecisions": target.decisions or [],
    }
    now = time.monotonic()
    # On change only (an unchanged apply is still a request and a watch event), and the gauges
    # at most once a minute (status.autoscaler_status_due).
    if not autoscaler_status_due(
        target.last_status, signals, target.last_status_at, now, STATUS_MIN_INTERVAL_S
    ):
        return
    custom = client.CustomObjectsApi(_api())
    body = await asyncio.to_thread(
        custom.get_namespaced_custom_object, GROUP, VERSION, target.namespace, PLURAL, target.name
    )
    if not (body.get("spec") or {}).get("autoscaling"):
        return  # autoscaling was just removed (this task is being stopped): nothing to report
    conditions = list((body.get("status") or {}).get("conditions") or [])
    active = s is not None and s.known > 0
    before = next((c for c in conditions if c["type"] == "ScalingActive"), None)
    status_word = "True" if active else "False"
    condition = {
        "type": "ScalingActive",
        "status": status_word,
        "reason": "MetricsAvailable" if active else "NoMetrics",
        "message": "scaling on KV-cache usage and queue depth"
        if active
        else "no ready worker's metrics could be read; holding the replica count",
        "lastTransitionTime": before["lastTransitionTime"]
        if before and before.get("status") == status_word and before.get("lastTransitionTime")
        else _now(),
        "observedGeneration": body["metadata"].get("generation", 0),
    }
    # Server-side apply of the autoscaler's own fields and condition only (status.OWNED).
    from kvscale.operator.handlers import apply_status

    status = {
        "kvCacheUsage": signals["kvCacheUsage"],
        "autoscaling": {**signals, "lastScrapeTime": _now()},
        "conditions": [condition],
    }
    await asyncio.to_thread(apply_status, target.namespace, target.name, status, AUTOSCALER_MANAGER)
    target.last_status, target.last_status_at = signals, now


def _api() -> client.ApiClient:
    from kvscale.operator.handlers import api

    return api()


def stop_all() -> None:
    _feeder.stop()
    for target in list(_targets.values()):
        if target.task is not None:
            target.task.cancel()
    with contextlib.suppress(Exception):
        _targets.clear()
