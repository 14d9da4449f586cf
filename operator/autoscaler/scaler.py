"""The autoscaler's I/O: scrape each worker, apply the policy, scale the Deployment, report.

One asyncio task per InferenceDeployment with `spec.autoscaling`, started and stopped by `track`
(kopf's event handler, handlers.py). (Not a kopf daemon or timer: kopf puts a finalizer on every
resource that has one, which would write the resource's metadata and keep a resource from being
deleted while the operator is down; see docs/operator.md.) kopf runs only on the Lease holder
(main.py), so only the leader scales.

Every SCRAPE_INTERVAL_S the task takes its worker and router pods from the pod cache (kube/pods.py:
one label-selected watch for all resources, fed on the leader only; no LIST per tick), keeps
those its owner references prove the operator's own (pods.Ownership: a label is no proof), reads
`/metrics` from each ready one directly (scrape.py: pod IP and port, short timeouts, in parallel;
at most SCRAPE_MAX_BYTES, streamed and abandoned past it, parsed off the event loop; the router's
queue and arrivals are demand no worker reports yet), asks the policy (policy.py), and on a
change patches the Deployment's scale subresource. A multi-node resource scales groups: its
LeaderWorkerSet's scale subresource, each group one "worker" seen through its leader (rank 0, the
pod that serves and reports the group's metrics). Before removing workers it marks the least
loaded with `controller.kubernetes.io/pod-deletion-cost`, so the ReplicaSet controller removes
exactly those; they then drain (preStop, SIGTERM, the worker finishes in-flight requests).
Status carries the signals and the last decisions: decisions, counts and the condition when
they change, the gauges at most once a minute (`_report`, status.autoscaler_status_due).

All I/O goes through the `Kube` it is given (its ApiClient, its status writes); all state is the
`Scaler`'s own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
from pydantic import ValidationError

from kvscale.operator import metrics
from kvscale.operator.api.groupversion import GROUP, KIND, PLURAL, VERSION
from kvscale.operator.api.labels import AUTOSCALER_MANAGER
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.autoscaler.pod_state import pod_state, pod_timing
from kvscale.operator.autoscaler.policy import (
    Autoscaler,
    Decision,
    Params,
    PodLoad,
    PodState,
    RouterLoad,
    Sample,
    confirms_idle,
)
from kvscale.operator.autoscaler.scrape import (
    SCRAPE_TIMEOUT_S,
    new_session,
    parse_router_metrics,
    scrape,
)
from kvscale.operator.kube import leaderworkerset
from kvscale.operator.kube.access import AccessReviews
from kvscale.operator.kube.client import Kube, now
from kvscale.operator.kube.errors import error_kind
from kvscale.operator.kube.pods import Ownership, PodCache, PodFeeder
from kvscale.operator.reconcile.children import LWS_WORKER_INDEX, router_name, workload_key
from kvscale.operator.reconcile.status import STATUS_MIN_INTERVAL_S, autoscaler_status_due

logger = logging.getLogger(__name__)

SCRAPE_INTERVAL_S = 2.0
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
VICTIM_COST = "-1000"  # below every unmarked pod (default 0): removed first
KEEP_DECISIONS = 5


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


class Scaler:
    """The autoscaler tasks of every autoscaled resource, and the pod cache they read (the adapter
    sync, operator/adapters/, reads it too, and stops with it: `also_stop`)."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.targets: dict[str, Target] = {}
        self.pods = PodCache()
        self.feeder = PodFeeder(self.pods)
        self.owners = Ownership(self.read_owner)
        self.access = AccessReviews()
        self.also_stop: list[Callable[[], None]] = []  # other tasks on the pod cache, stopped with it

    def read_owner(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The metadata of a link of a pod's owner chain (pods.Ownership), None when it is gone."""
        apps = client.AppsV1Api(self.kube.api)
        reads = {
            "ReplicaSet": apps.read_namespaced_replica_set,
            "StatefulSet": apps.read_namespaced_stateful_set,
            "Deployment": apps.read_namespaced_deployment,
        }
        try:
            if kind == "LeaderWorkerSet":
                body = client.CustomObjectsApi(self.kube.api).get_namespaced_custom_object(
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

    def start(self) -> None:
        """Feed the pod cache (while kopf runs: on the leader only, main._lead)."""
        self.feeder.start(client.CoreV1Api(self.kube.api), self.kube.namespaces)

    def stop(self) -> None:
        self.feeder.stop()

    async def track(self, body: dict[str, Any], type: str | None) -> None:
        """Start, update or stop the autoscaler task of this resource (from its kopf events)."""
        meta = body["metadata"]
        uid = meta["uid"]
        wanted = type != "DELETED" and meta.get("deletionTimestamp") is None
        wanted = wanted and bool((body.get("spec") or {}).get("autoscaling"))
        target = self.targets.get(uid)
        if not wanted:
            if target is not None:
                self.targets.pop(uid)
                if target.task is not None:
                    target.task.cancel()
                metrics.forget(target.namespace, target.name)
            return
        if target is None:
            target = self.targets[uid] = Target(meta["name"], meta["namespace"], uid, dict(body["spec"]))
            shown = dict((body.get("status") or {}).get("autoscaling") or {})
            target.decisions = list(shown.get("lastDecisions") or [])
            # What the object shows is what was last applied (by this leader or the one before):
            # an unchanged tick after a takeover writes nothing either.
            shown.pop("lastScrapeTime", None)
            target.last_status = shown or None
            target.task = asyncio.create_task(
                self._run(target), name=f"autoscaler {meta['namespace']}/{meta['name']}"
            )
        target.spec = dict(body["spec"])

    async def _run(self, target: Target) -> None:
        async with new_session() as session:
            while True:
                started = time.monotonic()
                try:
                    await self.step(target, session)
                except asyncio.CancelledError:
                    raise
                except ApiException as e:
                    if e.status == 404:
                        logger.info("autoscaler: %s/%s not found yet", target.namespace, target.name)
                    else:
                        metrics.errored(error_kind(e))
                        logger.warning("autoscaler step failed: %s %s", e.status, e.reason)
                except Exception as e:
                    metrics.errored(error_kind(e))
                    logger.exception("autoscaler step failed")
                await asyncio.sleep(max(0.1, SCRAPE_INTERVAL_S - (time.monotonic() - started)))

    async def step(self, target: Target, session: aiohttp.ClientSession) -> Decision | None:
        """One tick: the pods from the cache (no LIST), their metrics, a decision, a scale, status."""
        if not self.pods.synced.is_set():
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
            current = await asyncio.to_thread(
                leaderworkerset.read_scale, self.kube.api, name, ns, SCRAPE_TIMEOUT_S * 4
            )
            pods = [
                p for p in self.pods.of(ns, name) if (p.metadata.labels or {}).get(LWS_WORKER_INDEX) == "0"
            ]
        else:
            apps = client.AppsV1Api(self.kube.api)
            deployment = await asyncio.to_thread(apps.read_namespaced_deployment, name, ns)
            current = deployment.spec.replicas if deployment.spec.replicas is not None else 1
            pods = self.pods.of(ns, name)
        pods = await self._own(pods, target, name)
        wall = time.time()
        states = {p.metadata.name: pod_state(p, wall, params.startup_budget_s) for p in pods}
        sample = await self._sample(session, pods, states, target)
        compiled = {p.name: p.compile_s for p in sample.pods}
        target.scaler.observe(sample, [pod_timing(p, compiled.get(p.metadata.name)) for p in pods], params)
        decision = target.scaler.decide(current, params)
        metrics.decided(ns, name, current, decision.replicas)
        zero = None
        if decision.replicas == 0 and not grouped:
            # Scale to zero rests on a scrape taken before the victims were marked (one API call
            # each, up to 30 s on a slow API server): right before the write, a fresh scrape must
            # confirm that nothing arrived since, and the write carries this tick's resourceVersion.

            async def confirmed() -> bool:
                return confirms_idle(sample, await self._sample(session, pods, states, target))

            zero = (confirmed, deployment.metadata.resource_version)
        if decision.changed(current) and not await self._scale(
            target, pods, current, decision, grouped=grouped, zero=zero
        ):
            return decision  # withheld: the next tick decides again, on what it sees then
        await self._report(target, decision, current)
        return decision

    async def _sample(
        self,
        session: aiohttp.ClientSession,
        pods: list[client.V1Pod],
        states: dict[str, PodState],
        target: Target,
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
                    marked=(p.metadata.annotations or {}).get(DELETION_COST) == VICTIM_COST,
                    compile_s=m.get("compile_s"),
                )
            )
        router = target.spec.get("router") or {}
        endpoint = router.get("endpoint") if router.get("enabled", True) else None
        if endpoint is None:
            routers = await self._own(self.pods.routers_of(ns, name), target, router_name(name))
            parse = parse_router_metrics
        else:  # the shared router of an InferenceEndpoint: its samples of this model's names only
            routers = await self._own(self.pods.endpoint_routers_of(ns, endpoint), target, endpoint, endpoint)
            parse = functools.partial(parse_router_metrics, models=served_names(name, target.spec))
        return Sample(
            time.monotonic(),
            tuple(sorted(loads, key=lambda p: p.name)),
            await _routers(session, routers, parse),
        )

    async def _own(
        self, pods: list[client.V1Pod], target: Target, workload: str, endpoint: str | None = None
    ) -> list[client.V1Pod]:
        """The pods the operator's workload `workload` created (pods.Ownership; reads off the
        loop): the target's, or with `endpoint` the InferenceEndpoint of that name's."""
        if not pods:
            return pods
        owned = await asyncio.to_thread(
            lambda: [self.owners.owned(p, target.uid, workload, endpoint=endpoint) for p in pods]
        )
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

    async def _scale(
        self,
        target: Target,
        pods: list[client.V1Pod],
        current: int,
        decision: Decision,
        *,
        grouped: bool = False,
        zero: tuple[Callable[[], Awaitable[bool]], str] | None = None,
    ) -> bool:
        """Mark the victims and write the count; False when it was withheld. `zero`, for a scale to
        zero: (a check that the resource is still idle, the Deployment's resourceVersion as read
        this tick): withheld when the check fails or the Deployment changed since (409)."""
        api = self.kube.api
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        name, ns = target.name, target.namespace
        victims = () if grouped else decision.victims
        if grouped:
            # A LeaderWorkerSet removes its highest-numbered groups (a StatefulSet of leaders): no
            # pod-deletion-cost picks which, so no victims are marked or named.
            await asyncio.to_thread(
                leaderworkerset.write_scale, api, name, ns, decision.replicas, AUTOSCALER_MANAGER
            )
        elif 0 < decision.replicas < current and await asyncio.to_thread(self.access.allowed, api, ns):
            # (Marking is granted per namespace: access.py. Not granted: the ReplicaSet picks. At
            # zero every pod goes: nothing to pick.) The ReplicaSet controller removes the pods of
            # lowest deletion cost first: mark exactly the victims, and clear the mark a previous,
            # unfinished decision left on any other pod.
            newly_marked = []
            for p in pods:
                marked = (p.metadata.annotations or {}).get(DELETION_COST) == VICTIM_COST
                victim = p.metadata.name in decision.victims
                if victim != marked and p.metadata.deletion_timestamp is None:
                    cost = VICTIM_COST if victim else None
                    patch = {"metadata": {"annotations": {DELETION_COST: cost}}}
                    await asyncio.to_thread(core.patch_namespaced_pod, p.metadata.name, ns, patch)
                    if victim:
                        newly_marked.append(p.metadata.name)
            if newly_marked:
                # The ReplicaSet controller picks from its own pod cache, fed by another watch
                # than the one the count's change reaches it by: written together, a mark can
                # arrive after the pick (suspected when, in a cold CI run here, the least-loaded
                # worker was not gone 90 s after the scale-down). So the count waits for a tick
                # whose pods, from our watch, carry the marks; least_loaded keeps them the victims.
                logger.info(
                    "autoscaler: %s/%s: marked %s for removal; scaling down once the marks are seen",
                    ns,
                    name,
                    ", ".join(newly_marked),
                )
                return False
        if zero is not None and not await zero[0]():
            logger.info(
                "autoscaler: %s/%s: a request arrived since the decision: not scaled to zero", ns, name
            )
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
            "time": now(),
            "fromReplicas": current,
            "toReplicas": decision.replicas,
            "reason": decision.reason + (f"; removing {', '.join(victims)}" if victims else ""),
        }
        target.decisions = [*(target.decisions or []), record][-KEEP_DECISIONS:]
        logger.info("autoscaler: %s/%s %s", ns, name, record["reason"])
        kopf.info(target.body, reason="Scaled", message=record["reason"])
        return True

    async def _report(self, target: Target, decision: Decision, current: int) -> None:
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
        at = time.monotonic()
        # On change only (an unchanged apply is still a request and a watch event), and the gauges
        # at most once a minute (status.autoscaler_status_due).
        if not autoscaler_status_due(
            target.last_status, signals, target.last_status_at, at, STATUS_MIN_INTERVAL_S
        ):
            return
        custom = client.CustomObjectsApi(self.kube.api)
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
            else now(),
            "observedGeneration": body["metadata"].get("generation", 0),
        }
        # Server-side apply of the autoscaler's own fields and condition only (api/status.OWNED).
        status = {
            "kvCacheUsage": signals["kvCacheUsage"],
            "autoscaling": {**signals, "lastScrapeTime": now()},
            "conditions": [condition],
        }
        await asyncio.to_thread(
            self.kube.apply_status, target.namespace, target.name, status, AUTOSCALER_MANAGER
        )
        target.last_status, target.last_status_at = signals, at

    def stop_all(self) -> None:
        """Stop the pod cache and every task (the lease is lost, or the operator stops)."""
        self.feeder.stop()
        for stop in self.also_stop:
            stop()
        for target in list(self.targets.values()):
            if target.task is not None:
                target.task.cancel()
        with contextlib.suppress(Exception):
            self.targets.clear()


def served_names(name: str, spec: dict[str, Any]) -> frozenset[str]:
    """The `model` names a resource serves: its served name and its adapters' (the router's
    `model` label values of its requests)."""
    served = (spec.get("model") or {}).get("servedName") or name
    return frozenset([served, *(a.get("name") for a in spec.get("adapters") or [] if a.get("name"))])


async def _routers(
    session: aiohttp.ClientSession, pods: list[client.V1Pod], parse=parse_router_metrics
) -> tuple[RouterLoad, ...]:
    """The ready router pods' counts (one RouterLoad per pod, values None when unread)."""
    ready = [p for p in pods if pod_state(p) == "ready"]
    scraped = await asyncio.gather(*(scrape(session, p.status.pod_ip, parse) for p in ready))
    return tuple(
        RouterLoad(p.metadata.name, **(m or {}))
        for p, m in sorted(zip(ready, scraped, strict=True), key=lambda pm: pm[0].metadata.name)
    )
