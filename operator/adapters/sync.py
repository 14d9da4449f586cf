"""Keeps each resource's ready workers serving spec.adapters and says so in status.adapters.

One task per resource with adapters (or lora.dynamicLoading), woken by a spec change and every
SYNC_INTERVAL_S. It takes the ready worker pods from the autoscaler's pod cache (no LIST), only
those whose owner chain proves them ours (pods.Ownership), and:

- with lora.dynamicLoading, reads each one's /v1/models (the adapters it serves, and from which
  path) and calls /v1/unload_lora_adapter and /v1/load_lora_adapter until it serves exactly the
  spec's (plan.plan_worker). A new pod starts with none: it gets them within one interval of
  turning Ready (the router prefers the workers that hold an adapter, router/picker.py);
- without it, the adapters are the pods' `--lora-modules`: a Ready pod serves those of its args.

A worker is a network peer: every read is capped and every call has a deadline; what it answers
reaches status truncated (plan.MAX_MESSAGE). Status goes out by server-side apply under the
adapters' own field manager, on change only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes import client
from pydantic import ValidationError

from kvscale.common.capped_body import TooLarge, read_capped
from kvscale.operator.adapters.plan import WorkerView, adapter_status, plan_worker
from kvscale.operator.api.labels import ADAPTERS_MANAGER
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.autoscaler.pod_state import WORKER_CONTAINER, pod_state
from kvscale.operator.kube.client import Kube
from kvscale.operator.kube.pods import Ownership, PodCache, url_of
from kvscale.operator.reconcile.children import PORT, adapter_paths, workload_key

logger = logging.getLogger(__name__)

SYNC_INTERVAL_S = 5.0
READ_TIMEOUT_S = 5.0
LOAD_TIMEOUT_S = 60.0  # reading and checking an adapter's safetensors on the worker
MAX_BODY = 1 << 20  # /v1/models of a worker with the most adapters it keeps (1,024) is ~300 KiB
CONCURRENCY = 16  # workers called at once


@dataclass
class Target:
    name: str
    namespace: str
    uid: str
    spec: dict[str, Any]
    wake: asyncio.Event
    task: asyncio.Task | None = None
    last_status: list[dict[str, object]] | None = None


def wants_sync(spec: dict[str, Any]) -> bool:
    return bool(spec.get("adapters")) or bool((spec.get("lora") or {}).get("dynamicLoading"))


def modules_of(pod: client.V1Pod) -> frozenset[str]:
    """The adapter names of the worker container's `--lora-modules NAME=PATH ...` (static mode)."""
    container = next((c for c in pod.spec.containers if c.name == WORKER_CONTAINER), None)
    args = list((container and container.args) or [])
    if "--lora-modules" not in args:
        return frozenset()
    rest = args[args.index("--lora-modules") + 1 :]
    end = next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))
    return frozenset(a.partition("=")[0] for a in rest[:end])


async def served_adapters(session: aiohttp.ClientSession, ip: str, port: int = PORT) -> dict[str, str] | None:
    """name -> path of the adapters a worker serves (its /v1/models entries with a parent), or None
    when it cannot be read (refused, slow, too large, not JSON of that shape)."""
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            async with session.get(url_of(ip, port, "/v1/models"), allow_redirects=False) as r:
                if r.status != 200:
                    return None
                body = await read_capped(r, MAX_BODY)
        cards = json.loads(body)["data"]
        if not isinstance(cards, list):
            return None
        return {str(c["id"]): str(c["root"]) for c in cards if isinstance(c, dict) and c.get("parent")}
    except (aiohttp.ClientError, TimeoutError, TooLarge, ValueError, KeyError, TypeError):
        return None


async def _post(
    session: aiohttp.ClientSession, ip: str, port: int, path: str, body: dict[str, str]
) -> tuple[int, str]:
    async with asyncio.timeout(LOAD_TIMEOUT_S):
        async with session.post(url_of(ip, port, path), json=body, allow_redirects=False) as r:
            text = (await read_capped(r, 64 * 1024)).decode("utf-8", errors="replace")
            return r.status, text


def _reason(text: str) -> str:
    """The message of an OpenAI-shaped error body, else the body."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text


async def sync_worker(
    session: aiohttp.ClientSession, ip: str, desired: dict[str, str], *, dynamic: bool, port: int = PORT
) -> WorkerView:
    """Read one ready worker and, with dynamic loading, bring it to `desired`."""
    served = await served_adapters(session, ip, port)
    if served is None:
        return WorkerView(None)
    refused: dict[str, str] = {}
    if dynamic:
        plan = plan_worker(desired, served)
        try:
            for name in plan.unload:
                status, text = await _post(session, ip, port, "/v1/unload_lora_adapter", {"lora_name": name})
                if status in (200, 404):  # 404: gone already
                    served.pop(name, None)
            for name, path in plan.load:
                body = {"lora_name": name, "lora_path": path}
                status, text = await _post(session, ip, port, "/v1/load_lora_adapter", body)
                if status == 200:
                    served[name] = path
                elif status in (404, 405):  # an older pod, or one started without the flag
                    refused[name] = (
                        "the worker has no /v1/load_lora_adapter (not started for dynamic loading)"
                    )
                elif 400 <= status < 500 and status != 429:  # the adapter's fault: said in status
                    refused[name] = _reason(text)
        except (aiohttp.ClientError, TimeoutError, TooLarge) as e:
            logger.info("adapters: %s did not answer a load or unload (%r): retried next pass", ip, e)
    return WorkerView(frozenset(served), refused)


class AdapterSync:
    """The adapter tasks of every resource with adapters; reads the autoscaler's pod cache."""

    def __init__(self, kube: Kube, pods: PodCache, owners: Ownership) -> None:
        self.kube, self.pods, self.owners = kube, pods, owners
        self.targets: dict[str, Target] = {}

    async def track(self, body: dict[str, Any], type: str | None) -> None:
        """Start, wake or stop the resource's task (from its kopf events)."""
        meta = body["metadata"]
        spec = dict(body.get("spec") or {})
        wanted = type != "DELETED" and meta.get("deletionTimestamp") is None and wants_sync(spec)
        target = self.targets.get(meta["uid"])
        if not wanted:
            if target is not None:
                self.targets.pop(meta["uid"])
                if target.task is not None:
                    target.task.cancel()
            gone = type == "DELETED" or meta.get("deletionTimestamp") is not None
            if not gone and (body.get("status") or {}).get("adapters") is not None:
                # The adapters were removed: an empty apply drops the field this manager owned.
                await asyncio.to_thread(
                    self.kube.apply_status, meta["namespace"], meta["name"], {}, ADAPTERS_MANAGER
                )
            return
        if target is None:
            target = Target(meta["name"], meta["namespace"], meta["uid"], spec, asyncio.Event())
            shown = (body.get("status") or {}).get("adapters")
            target.last_status = list(shown) if isinstance(shown, list) else None
            self.targets[meta["uid"]] = target
            target.task = asyncio.create_task(
                self._run(target), name=f"adapters {meta['namespace']}/{meta['name']}"
            )
        elif spec != target.spec:
            target.spec = spec
            target.wake.set()

    def stop_all(self) -> None:
        for target in self.targets.values():
            if target.task is not None:
                target.task.cancel()
        self.targets.clear()

    async def _run(self, target: Target) -> None:
        timeout = aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S, connect=READ_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
            while True:
                try:
                    await self.step(target, session)
                except asyncio.CancelledError:
                    raise
                except Exception:  # the next pass retries; a bug must not end the task
                    logger.exception("adapters: %s/%s: sync failed", target.namespace, target.name)
                target.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(target.wake.wait(), SYNC_INTERVAL_S)

    async def step(self, target: Target, session: aiohttp.ClientSession) -> list[dict[str, object]] | None:
        """One pass: every ready worker read (and synced), then status.adapters if it changed."""
        if not self.pods.synced.is_set():
            return None
        try:
            spec = InferenceDeploymentSpec.model_validate(target.spec)
        except ValidationError:
            return None  # reconcile reports it
        if workload_key(spec) != "Deployment":
            return None  # adapters need one rank per copy (the CRD says so)
        desired = adapter_paths(spec)
        pods = self.pods.of(target.namespace, target.name)
        if pods:
            owned = await asyncio.to_thread(
                lambda: [self.owners.owned(p, target.uid, target.name) for p in pods]
            )
            pods = [p for p, ours in zip(pods, owned, strict=True) if ours]
        wall = time.time()
        budget = spec.server.startup_timeout_seconds
        ready = [p for p in pods if pod_state(p, wall, budget) == "ready" and p.status.pod_ip]
        dynamic = spec.lora.dynamic_loading
        if dynamic:
            limit = asyncio.Semaphore(CONCURRENCY)

            async def one(ip: str) -> WorkerView:
                async with limit:
                    return await sync_worker(session, ip, desired, dynamic=True)

            views = list(await asyncio.gather(*(one(p.status.pod_ip) for p in ready)))
        else:
            views = [WorkerView(modules_of(p)) for p in ready]
        status = adapter_status(list(desired), views)
        if status != target.last_status:
            await asyncio.to_thread(
                self.kube.apply_status, target.namespace, target.name, {"adapters": status}, ADAPTERS_MANAGER
            )
            target.last_status = status
        return status
