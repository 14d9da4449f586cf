"""What an error of the Kubernetes API means: final for the request that caused it, or worth
retrying; its message for a condition or a log line; its kind for the operator's error counter."""

from __future__ import annotations

import json

from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from kvscale.operator.kube.leader import NotLeader

# 4xx that are worth retrying: a timeout, a conflict (an object being deleted, a lost race),
# too early, too many requests. Every other 4xx is the API refusing what we sent.
TRANSIENT_4XX = frozenset({408, 409, 425, 429})
# No answer, a timeout, a refused or reset connection: retried like a 5xx.
NETWORK_ERRORS = (HTTPError, OSError)


def permanent(status: int | None) -> bool:
    """An API error that retrying the same request cannot fix (None: no answer, a timeout)."""
    return status is not None and 400 <= status < 500 and status not in TRANSIENT_4XX


def api_message(e: Exception) -> str:
    """`STATUS REASON: the Status message` of an API error, else the exception's type and text."""
    if isinstance(e, ApiException):
        try:
            detail = json.loads(e.body or "{}").get("message", "")
        except (ValueError, AttributeError):
            detail = ""
        return f"{e.status} {e.reason}" + (f": {detail}" if detail else "")
    return f"{type(e).__name__}: {e}"


def error_kind(error: BaseException | None = None, *, status: int | None = None) -> str:
    """The `kind` label of an error (metrics.errored): from an API status code, or from the
    exception."""
    if isinstance(error, NotLeader):
        return "not_leader"
    if isinstance(error, ApiException):
        status = error.status
    if status is not None:
        return "api_rejected" if permanent(status) else "api_transient"
    if isinstance(error, (HTTPError, OSError, TimeoutError)):
        return "network"
    return "internal"
