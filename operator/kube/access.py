"""What the operator may do in a namespace, asked of the API server (a SelfSubjectAccessReview,
which every authenticated user may create) rather than learnt from a 403.

The cluster-wide install grants no `pods: patch` (it would let the operator change any pod's
image in the cluster): marking the pods a scale-down removes (pod-deletion-cost) is granted per
namespace, by a RoleBinding to the ClusterRole kvscale-operator-pod-marks (manifests/rbac.yaml).
Where it is not granted the autoscaler marks nothing and the ReplicaSet controller picks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kubernetes import client
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

logger = logging.getLogger(__name__)

TTL_S = 300.0  # a RoleBinding added (or removed) is seen within this
TIMEOUT_S = 10


def review(namespace: str, verb: str, resource: str) -> dict:
    """The SelfSubjectAccessReview body for one verb on one resource in `namespace`."""
    return {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {"namespace": namespace, "verb": verb, "resource": resource}},
    }


class AccessReviews:
    """Answers of SelfSubjectAccessReviews, each kept TTL_S (thread-safe: asked from the
    autoscaler's worker threads)."""

    def __init__(self) -> None:
        self._answers: dict[tuple[str, str, str], tuple[float, bool]] = {}
        self._guard = threading.Lock()

    def allowed(
        self,
        api: client.ApiClient,
        namespace: str,
        verb: str = "patch",
        resource: str = "pods",
        clock: Callable[[], float] = time.monotonic,
    ) -> bool:
        """Whether the operator may `verb` `resource` in `namespace` (cached TTL_S); False when the
        API server cannot say (nothing is attempted then)."""
        key = (namespace, verb, resource)
        with self._guard:
            cached = self._answers.get(key)
        if cached is not None and clock() - cached[0] < TTL_S:
            return cached[1]
        try:
            answer = client.AuthorizationV1Api(api).create_self_subject_access_review(
                review(namespace, verb, resource), _request_timeout=TIMEOUT_S
            )
            ok = bool(answer.status.allowed)
        except (ApiException, HTTPError, OSError) as e:  # no answer: do without
            logger.warning("could not ask whether %s %s is allowed in %s: %s", verb, resource, namespace, e)
            ok = False
        if cached is None or cached[1] != ok:
            logger.info("%s %s in %s: %s", verb, resource, namespace, "allowed" if ok else "not granted")
        with self._guard:
            self._answers[key] = (clock(), ok)
        return ok
