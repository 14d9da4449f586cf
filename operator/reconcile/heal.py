"""Pure decisions of self-healing: has a child drifted from what we apply, which condition an API
refusal becomes and whether it is retried, how long to back off, and a small retry queue.

A child drifts when a field we set has another value on the server (someone ran `kubectl set
image` or `kubectl scale`, removed our label) or is gone. What others added is not drift:
defaults the API server filled in, fields of other field managers (an annotation, an env var
set by hand), which our server-side apply would leave alone as well. Re-applying a child that
has not drifted would be a no-op on the API server, so the watchers do not send it at all.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from kubernetes.utils import parse_quantity

from kvscale.operator.kube.errors import TRANSIENT_4XX

_MISSING = object()

# Condition reasons that mean "this generation cannot be applied": no retry until it changes.
PERMANENT_REASONS = ("InvalidSpec", "ApplyRejected")
# ... and those retried with backoff: a transient failure, and refusals that someone other than
# the spec's author fixes (a raised ResourceQuota, a changed admission policy, granted RBAC),
# after which the resource recovers without a spec edit.
RETRIED_REASONS = ("ApplyFailed", "QuotaExceeded", "AdmissionDenied", "Forbidden")
# The refusals every sync checks again (a policy or a foreign object can change without a spec
# change; no write while the message stays the same).
RECHECKED_REASONS = ("PolicyViolation", "PolicyInvalid", "ChildConflict")
APPLY_FAILURES = (*PERMANENT_REASONS, *RETRIED_REASONS, *RECHECKED_REASONS)
BACKOFF_BASE_S = 2.0
BACKOFF_MAX_S = 300.0


def drifted(desired: Any, live: Any, path: str = "") -> list[str]:
    """The paths where `live` lacks what `desired` sets; empty when the child is as we apply it.

    Maps: every key we set must match (extra keys are defaults or someone else's). Lists of
    maps with a `name` (containers, env, ports, volumes, owner references): each of ours must
    be there by name (others may add theirs). Other lists (args, tolerations): equal, in order.
    Quantities compare by value ("0.5" and "500m" are one CPU request, as the API server
    canonicalises it).
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return [path or "."]
        return [p for k, v in desired.items() for p in drifted(v, live.get(k, _MISSING), f"{path}.{k}")]
    if isinstance(desired, list):
        if not isinstance(live, list):
            return [path]
        if desired and all(isinstance(d, dict) and "name" in d for d in desired):
            by_name = {item.get("name"): item for item in live if isinstance(item, dict)}
            return [
                p
                for d in desired
                for p in drifted(d, by_name.get(d["name"], _MISSING), f"{path}[{d['name']}]")
            ]
        same = len(desired) == len(live) and not any(
            drifted(d, v) for d, v in zip(desired, live, strict=False)
        )
        return [] if same else [path]
    if desired == live and type(desired) is type(live):
        return []
    if isinstance(desired, str) and isinstance(live, str) and _same_quantity(desired, live):
        return []
    return [path]


def _same_quantity(a: str, b: str) -> bool:
    try:
        return parse_quantity(a) == parse_quantity(b)
    except ValueError:
        return False


def api_refusal(status: int | None, reason: str | None, message: str) -> tuple[str, bool]:
    """(condition reason, whether to retry) for an API error: its HTTP status, its Status reason
    (`Forbidden`, `Invalid`, ...) and message. Refusals that the cluster's state decides, not the
    spec, are retried with backoff and named: a ResourceQuota (403 "exceeded quota"), an admission
    webhook (Gatekeeper, Kyverno: "admission webhook ... denied the request", 400 or 403, even 422)
    or a ValidatingAdmissionPolicy ("... denied request"), RBAC (any other 403). What the API
    server itself refuses in what we sent (422 Invalid against a schema, 400, 404 ...) is final
    for the generation: the same request cannot succeed."""
    text = message or ""
    if status is None or not 400 <= status < 500 or status in TRANSIENT_4XX:
        return "ApplyFailed", True  # no answer, a timeout, a 5xx, a conflict: transient
    if "exceeded quota" in text:
        return "QuotaExceeded", True
    webhook = "admission webhook" in text and "denied the request" in text
    if webhook or ("ValidatingAdmissionPolicy" in text and "denied request" in text):
        return "AdmissionDenied", True
    if status == 403 or reason == "Forbidden":
        return "Forbidden", True
    return "ApplyRejected", False


def api_error_refusal(e: Exception) -> tuple[str, bool]:
    """api_refusal() of an exception: an ApiException's status, reason and the body's message
    (a network error, no answer at all: transient)."""
    status = getattr(e, "status", None)
    if not isinstance(status, int):
        return "ApplyFailed", True
    try:
        body = json.loads(getattr(e, "body", None) or "{}")
    except (ValueError, TypeError):
        body = {}
    body = body if isinstance(body, dict) else {}
    return api_refusal(status, body.get("reason") or getattr(e, "reason", None), str(body.get("message", "")))


def backoff_s(failures: int) -> float:
    """Seconds before retry number `failures` (1, 2, ...): doubling from 2 s, at most 5 min."""
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** max(0, failures - 1))


def child_drift(desired: dict[str, Any], live: dict[str, Any] | None) -> list[str]:
    """drifted() for a whole child: missing, or its metadata or spec differ (apiVersion and kind
    are not in a list's items, status is not ours)."""
    if live is None:
        return ["(missing)"]
    return drifted({k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "status")}, live)


def apply_failure(conditions: list[dict[str, Any]], generation: int) -> dict[str, Any] | None:
    """The Degraded condition saying this generation could not be applied, if there is one."""
    for c in conditions or []:
        if (
            c.get("type") == "Degraded"
            and c.get("status") == "True"
            and c.get("reason") in APPLY_FAILURES
            and c.get("observedGeneration") == generation
        ):
            return c
    return None


def rejected(conditions: list[dict[str, Any]], generation: int) -> dict[str, Any] | None:
    """The condition refusing this generation for good, if there is one: the watchers and the
    resync leave such a generation alone until the spec changes."""
    failure = apply_failure(conditions, generation)
    return failure if failure is not None and failure["reason"] in PERMANENT_REASONS else None


class RetryQueue:
    """Keys to sync again after a transient failure, each after its own backoff (doubling per
    consecutive failure, reset by a success); thread-safe, the clock injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._due: dict[Hashable, float] = {}
        self._failures: dict[Hashable, int] = {}

    def failed(self, key: Hashable) -> float:
        with self._lock:
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            delay = backoff_s(failures)
            self._due[key] = self._clock() + delay
            return delay

    def succeeded(self, key: Hashable) -> None:
        with self._lock:
            self._failures.pop(key, None)
            self._due.pop(key, None)

    def after(self, key: Hashable, delay_s: float) -> None:
        """Sync `key` again in `delay_s` (no failure counted), unless it is due sooner."""
        with self._lock:
            at = self._clock() + delay_s
            self._due[key] = min(self._due.get(key, at), at)

    def pop_due(self) -> list[Hashable]:
        with self._lock:
            now = self._clock()
            due = [k for k, at in self._due.items() if at <= now]
            for k in due:
                del self._due[k]
            return due
