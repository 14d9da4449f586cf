"""The router's endpoint source against the real API server: EndpointSlices of a selector-less
Service (so no controller writes them; the test plays the EndpointSlice controller's part) are
listed and watched, and every change reaches the router as the set of ready, not-terminating
endpoints, across watches that time out and resume."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from kubernetes import client

from kvscale.router.endpoints import SliceWatcher


@pytest.fixture
def namespace(cluster):
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _slice(name: str, service: str, endpoints: list[tuple[str, bool, bool]]) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready, "serving": ready, "terminating": terminating}}
            for ip, ready, terminating in endpoints
        ],
    }


def test_the_watcher_follows_endpointslices_through_resumed_watches(cluster, namespace):
    api = client.DiscoveryV1Api(cluster.api)
    core = client.CoreV1Api(cluster.api)
    core.create_namespaced_service(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "tiny"},
            "spec": {"ports": [{"name": "http", "port": 8000}]},  # no selector: nobody else writes its slices
        },
    )
    api.create_namespaced_endpoint_slice(
        namespace, _slice("tiny-a", "tiny", [("10.0.0.1", True, False), ("10.0.0.2", False, False)])
    )
    api.create_namespaced_endpoint_slice(namespace, _slice("other", "other", [("10.0.0.9", True, False)]))
    seen: list[list[str]] = []

    async def main():
        # 2 s watches: the steps below outlast several, so each change after the first arrives on
        # a watch resumed from the last resourceVersion seen.
        watcher = SliceWatcher("tiny", namespace, port_name="http", watch_timeout_s=2, api=api)
        watcher.start(seen.append)

        async def until(expected: list[str], what: str) -> None:
            deadline = time.monotonic() + 30
            while not seen or seen[-1] != expected:
                assert time.monotonic() < deadline, f"{what}: saw {seen[-3:]}"
                await asyncio.sleep(0.1)

        async def resumed() -> None:
            """Until the watch open now has timed out and another one is open (the first watch
            may not be open yet when the first list is seen: then the second)."""
            target, deadline = max(watcher.watches + 1, 2), time.monotonic() + 30
            while watcher.watches < target:
                assert time.monotonic() < deadline, "no watch was resumed"
                await asyncio.sleep(0.1)

        try:
            await until(["http://10.0.0.1:8000"], "the first list")
            assert watcher.synced
            await resumed()
            api.patch_namespaced_endpoint_slice(
                "tiny-a",
                namespace,
                _slice("tiny-a", "tiny", [("10.0.0.1", True, False), ("10.0.0.2", True, False)]),
            )
            await until(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], "the second endpoint ready")
            api.create_namespaced_endpoint_slice(
                namespace, _slice("tiny-b", "tiny", [("10.0.0.3", True, False)])
            )
            await until(
                ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"], "a second slice"
            )
            await resumed()
            api.patch_namespaced_endpoint_slice(  # 10.0.0.1 drains: terminating, no longer ready
                "tiny-a",
                namespace,
                _slice("tiny-a", "tiny", [("10.0.0.1", False, True), ("10.0.0.2", True, False)]),
            )
            await until(["http://10.0.0.2:8000", "http://10.0.0.3:8000"], "a terminating endpoint gone")
            api.delete_namespaced_endpoint_slice("tiny-a", namespace)
            await until(["http://10.0.0.3:8000"], "a deleted slice")
            assert all("10.0.0.9" not in url for urls in seen for url in urls)  # another Service's slice
            assert watcher.lists == 1  # every change came through the watch, never a relist
            assert watcher.watches >= 3  # ... through watches resumed after the first one ended
        finally:
            watcher.stop()

    asyncio.run(main())
