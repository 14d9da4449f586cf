"""Refusals the cluster decides (issue 27): a ResourceQuota, an admission webhook or policy, RBAC
are retried with a capped backoff and reported once under their own reason, so when they are
fixed the resource recovers without a spec edit; a spec the API server calls invalid stays final."""

from __future__ import annotations

import json

import kopf
import pytest
from kubernetes.client.rest import ApiException

from kvscale.operator.api.labels import MANAGER
from kvscale.operator.reconcile.children import key_of
from kvscale.operator.reconcile.heal import api_error_refusal, api_refusal, backoff_s
from tests.test_selfheal_units import cluster, degraded, reconcile  # noqa: F401 (the fixture)

QUOTA = (
    'services "tiny" is forbidden: exceeded quota: object-counts, requested: services=1, '
    "used: services=10, limited: services=10"
)
GATEKEEPER = 'admission webhook "validation.gatekeeper.sh" denied the request: [must-have-team] missing label'
KYVERNO = 'admission webhook "validate.kyverno.svc-fail" denied the request: policy require-labels'
VAP = (
    "deployments.apps \"tiny\" is forbidden: ValidatingAdmissionPolicy 'no-latest' with binding "
    "'no-latest' denied request: image tag latest"
)
RBAC = (
    'services "tiny" is forbidden: User "system:serviceaccount:kvscale-system:kvscale-operator" cannot patch'
)


def test_refusals_the_cluster_decides_are_retried_and_named_and_invalid_specs_are_final():
    assert api_refusal(403, "Forbidden", QUOTA) == ("QuotaExceeded", True)
    assert api_refusal(403, "Forbidden", GATEKEEPER) == ("AdmissionDenied", True)
    assert api_refusal(400, "BadRequest", KYVERNO) == ("AdmissionDenied", True)
    assert api_refusal(422, "Invalid", GATEKEEPER) == ("AdmissionDenied", True)  # a webhook's own code
    assert api_refusal(403, "Forbidden", VAP) == ("AdmissionDenied", True)
    assert api_refusal(403, "Forbidden", RBAC) == ("Forbidden", True)
    assert api_refusal(422, "Invalid", 'Deployment.apps "tiny" is invalid: spec.replicas') == (
        "ApplyRejected",
        False,
    )
    assert api_refusal(400, "BadRequest", "json: cannot unmarshal") == ("ApplyRejected", False)
    assert api_refusal(404, "NotFound", "") == ("ApplyRejected", False)
    for transient in (None, 408, 409, 429, 500, 503):
        assert api_refusal(transient, None, QUOTA if transient else "") == ("ApplyFailed", True)


def _exception(status: int, reason: str, message: str) -> ApiException:
    e = ApiException(status=status, reason=reason)
    e.body = json.dumps(
        {"kind": "Status", "status": "Failure", "reason": reason, "message": message, "code": status}
    )
    return e


def test_the_exception_is_read_for_its_status_reason_and_message():
    assert api_error_refusal(_exception(403, "Forbidden", QUOTA)) == ("QuotaExceeded", True)
    assert api_error_refusal(_exception(422, "Invalid", "is invalid")) == ("ApplyRejected", False)
    e = ApiException(status=403, reason="Forbidden")  # no body at all
    assert api_error_refusal(e) == ("Forbidden", True)
    e.body = "not json"
    assert api_error_refusal(e) == ("Forbidden", True)
    assert api_error_refusal(ConnectionResetError()) == ("ApplyFailed", True)


@pytest.mark.parametrize(("message", "reason"), [(QUOTA, "QuotaExceeded"), (GATEKEEPER, "AdmissionDenied")])
def test_a_fixed_quota_or_policy_recovers_without_a_spec_edit(cluster, monkeypatch, message, reason):  # noqa: F811
    denied = {"on": True}
    apply = cluster.apply

    def quota(obj, manager=MANAGER):
        if denied["on"] and key_of(obj) == "Service":
            cluster.calls.append(("patch", "Service"))
            raise _exception(403, "Forbidden", message)
        return apply(obj, manager)

    monkeypatch.setattr(cluster, "apply", quota)
    with pytest.raises(kopf.TemporaryError) as raised:  # kopf retries it, backed off
        reconcile(cluster, retry=1)
    assert raised.value.delay == backoff_s(2)
    assert degraded(cluster)["reason"] == reason and message in degraded(cluster)["message"]
    warnings = [e for e in cluster.events if e[0] == "warn"]
    assert len(warnings) == 1 and reason in warnings[0][2]
    # The resync and the retry queue try again (the old code left such a generation alone for
    # good), each failure doubling the wait, and report nothing new.
    writes = len([c for c in cluster.writes() if c[1].startswith("status/")])
    tries = cluster.calls.count(("patch", "Service"))
    delays = []
    for _ in range(3):
        cluster.reconciler.sync_or_retry("ns", "tiny")  # what the resync does for each resource
        delays.append(backoff_s(cluster.reconciler.retries._failures[("ns", "tiny")]))
    assert cluster.calls.count(("patch", "Service")) == tries + 3
    assert delays == [2, 4, 8]  # backing off, doubling (to at most 5 min)
    assert len([c for c in cluster.writes() if c[1].startswith("status/")]) == writes  # reported once
    assert len([e for e in cluster.events if e[0] == "warn"]) == 1
    # The admin raises the quota (or fixes the policy): the next try applies it, no spec edit.
    denied["on"] = False
    cluster.reconciler.sync_or_retry("ns", "tiny", apply_all=True)  # the retry queue's sync
    assert "Service" in cluster.objects and cluster.resource["status"]["observedGeneration"] == 1
    assert degraded(cluster)["status"] == "False" and not cluster.reconciler.retries._due


def test_an_invalid_spec_stays_final(cluster):  # noqa: F811
    cluster.refuse["Deployment"] = 422
    reconcile(cluster)  # no TemporaryError
    assert degraded(cluster)["reason"] == "ApplyRejected"
    cluster.calls.clear()
    cluster.reconciler.sync_or_retry("ns", "tiny")
    assert cluster.writes() == [] and cluster.reconciler.retries.pop_due() == []
