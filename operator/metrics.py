"""The operator's own Prometheus metrics, served on /metrics by the health server (health.py).

A registry of its own (not prometheus_client's global one): /metrics shows exactly these and the
process' own figures, whatever else the process imports. Every name starts `kvscale_operator_`.
The code paths count through the small functions below, so the label values stay few and known.
"""

from __future__ import annotations

import contextlib

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

RESULTS = ("ok", "permanent_error", "transient_error")
DIRECTIONS = ("up", "down", "hold")

RECONCILES = Counter(
    "kvscale_operator_reconciles_total",
    "Syncs of one InferenceDeployment (reconcile, a child's event, the resync), by result: "
    "ok, permanent_error (refused until the spec changes), transient_error (retried).",
    ["result"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "kvscale_operator_errors_total",
    "Errors of the operator's API calls and steps, by kind: invalid_spec, api_rejected (a 4xx that "
    "retrying cannot fix), api_transient (5xx, 408, 409, 429), network (no answer, a timeout), "
    "not_leader (a write refused by the fence), internal (anything else).",
    ["kind"],
    registry=REGISTRY,
)
CHILD_REAPPLIES = Counter(
    "kvscale_operator_child_reapplies_total",
    "Children re-applied because they drifted or were deleted (heal.child_drift), by kind.",
    ["kind"],
    registry=REGISTRY,
)
STATUS_WRITES = Counter(
    "kvscale_operator_status_writes_total",
    "Server-side applies of an InferenceDeployment's status, by field manager.",
    ["manager"],
    registry=REGISTRY,
)
SCRAPE_FAILURES = Counter(
    "kvscale_operator_autoscaler_scrape_failures_total",
    "Ready workers whose /metrics the autoscaler could not read, per InferenceDeployment.",
    ["namespace", "name"],
    registry=REGISTRY,
)
DECISIONS = Counter(
    "kvscale_operator_autoscaler_decisions_total",
    "Autoscaler decisions per InferenceDeployment, by direction: up, down, hold.",
    ["namespace", "name", "direction"],
    registry=REGISTRY,
)
DESIRED_REPLICAS = Gauge(
    "kvscale_operator_autoscaler_desired_replicas",
    "The replica count the autoscaler last decided, per InferenceDeployment.",
    ["namespace", "name"],
    registry=REGISTRY,
)
LEADER = Gauge(
    "kvscale_operator_leader",
    "1 while this replica holds the Lease and may act, else 0 (a standby).",
    registry=REGISTRY,
)
POD_CACHE_PODS = Gauge(
    "kvscale_operator_pod_cache_pods",
    "Worker pods in the operator's pod cache (fed by one label-selected watch).",
    registry=REGISTRY,
)
POD_CACHE_RELISTS = Counter(
    "kvscale_operator_pod_cache_relists_total",
    "Full LISTs of the worker pods: at start, after a 410 Gone, and every relist period.",
    registry=REGISTRY,
)


def reconciled(result: str) -> None:
    RECONCILES.labels(result).inc()


def errored(kind: str) -> None:
    ERRORS.labels(kind).inc()


def decided(namespace: str, name: str, current: int, desired: int) -> None:
    direction = "up" if desired > current else "down" if desired < current else "hold"
    DECISIONS.labels(namespace, name, direction).inc()
    DESIRED_REPLICAS.labels(namespace, name).set(desired)


def forget(namespace: str, name: str) -> None:
    """Drop a resource's series (it was deleted, or stopped autoscaling): no stale gauges."""
    for metric, labels in (
        (SCRAPE_FAILURES, [(namespace, name)]),
        (DESIRED_REPLICAS, [(namespace, name)]),
        (DECISIONS, [(namespace, name, d) for d in DIRECTIONS]),
    ):
        for values in labels:
            with contextlib.suppress(KeyError):
                metric.remove(*values)


def exposition() -> bytes:
    """The text exposition of REGISTRY (what /metrics answers)."""
    return generate_latest(REGISTRY)
