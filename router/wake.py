"""Scale from zero: the router asks for a first worker when a request arrives and none is ready.

Single-flight: however many requests wait, one ask is in flight at a time, and a new one starts
only `retry_s` after the last (while requests still wait at zero: a lost write, or an autoscaler
that put the count back to zero before it saw the demand). The ask itself writes only when the
workers' Deployment is at zero (`scale_up_from_zero`), so a Deployment already starting its
first worker is never written again: one scale-up per wake, however many requests and asks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)


class Waker:
    def __init__(
        self,
        scale_up: Callable[[], Awaitable[bool]],
        retry_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._scale_up, self.retry_s, self._clock = scale_up, retry_s, clock
        self._task: asyncio.Task | None = None
        self._last: float | None = None
        self.asks = 0  # scale_up calls
        self.writes = 0  # of which wrote a scale-up

    def wake(self) -> None:
        """Ask for a worker unless an ask is in flight or the last began under retry_s ago."""
        if self._task is not None and not self._task.done():
            return
        now = self._clock()
        if self._last is not None and now - self._last < self.retry_s:
            return
        self._last = now
        self._task = asyncio.get_running_loop().create_task(self._ask())

    async def _ask(self) -> None:
        self.asks += 1
        try:
            if await self._scale_up():
                self.writes += 1
                logger.info("asked for a first worker")
        except Exception as e:  # logged; the next wake after retry_s asks again
            logger.warning("asking for a first worker failed", extra={"error": repr(e)})

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


def scale_up_from_zero(apps: Any, deployment: str, namespace: str) -> Callable[[], Awaitable[bool]]:
    """The ask, through the Deployment's scale subresource (apps/v1 deployments/scale, get and
    update: the router's Role): replicas 0 -> 1 with the read's resourceVersion, so a concurrent
    writer (the autoscaler, another router replica) wins and this write fails with a conflict
    instead of overwriting it. True when it wrote."""
    from kubernetes.client.rest import ApiException

    def ask() -> bool:
        scale = apps.read_namespaced_deployment_scale(deployment, namespace, _request_timeout=10)
        if (scale.spec.replicas or 0) > 0:
            return False  # already on its way (or serving: its endpoints will come)
        body = {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                "name": deployment,
                "namespace": namespace,
                "resourceVersion": scale.metadata.resource_version,
            },
            "spec": {"replicas": 1},
        }
        try:
            apps.replace_namespaced_deployment_scale(deployment, namespace, body, _request_timeout=10)
        except ApiException as e:
            if e.status == 409:
                return False  # someone else changed it first
            raise
        return True

    return lambda: asyncio.to_thread(ask)
