"""Leader election on a coordination.k8s.io Lease, so two operator replicas never both act.

The decision is a pure function (`may_hold`); LeaseLock does the API calls, with the Lease's
resourceVersion as the compare-and-swap: two candidates racing for an expired lease cannot both
win, the loser's write is refused with 409.
"""

from __future__ import annotations

import datetime as dt
import logging

from kubernetes import client
from kubernetes.client.rest import ApiException

logger = logging.getLogger(__name__)


def may_hold(
    holder: str | None, renewed: dt.datetime | None, duration_s: int, identity: str, now: dt.datetime
) -> bool:
    """We may (re)take the lease if it is ours, unheld, or its holder stopped renewing."""
    if not holder or holder == identity:
        return True
    return renewed is None or now > renewed + dt.timedelta(seconds=duration_s)


class LeaseLock:
    def __init__(
        self, api: client.ApiClient, namespace: str, name: str, identity: str, duration_s: int = 15
    ) -> None:
        self.api = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity, self.duration_s = namespace, name, identity, duration_s

    def try_acquire(self) -> bool:
        """Take or renew the lease; False when another live holder has it (or a race was lost)."""
        now = dt.datetime.now(dt.UTC)
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=client.V1LeaseSpec(
                    holder_identity=self.identity,
                    lease_duration_seconds=self.duration_s,
                    acquire_time=now,
                    renew_time=now,
                    lease_transitions=0,
                ),
            )
            return self._write(self.api.create_namespaced_lease, self.namespace, body)
        spec = lease.spec
        if not may_hold(
            spec.holder_identity,
            spec.renew_time,
            spec.lease_duration_seconds or self.duration_s,
            self.identity,
            now,
        ):
            return False
        if spec.holder_identity != self.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
            logger.info("taking over the lease", extra={"lease": self.name, "from": spec.holder_identity})
        spec.holder_identity, spec.renew_time, spec.lease_duration_seconds = (
            self.identity,
            now,
            self.duration_s,
        )
        return self._write(self.api.replace_namespaced_lease, self.name, self.namespace, lease)

    def release(self) -> None:
        """Hand the lease back at once (graceful exit): the next leader need not wait it out."""
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
            if lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = None
                self.api.replace_namespaced_lease(self.name, self.namespace, lease)
        except ApiException as e:
            logger.warning("could not release the lease: %s", e.reason)

    def _write(self, call, *args) -> bool:
        try:
            call(*args)
            return True
        except ApiException as e:
            if e.status == 409:  # someone else wrote first
                return False
            raise
