"""Reading a worker's or a router's /metrics: the signals the policy takes, from a Prometheus
exposition that may be a tenant's look-alike (a size cap, a deadline, parsed off the event loop)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvscale.common.capped_body import TooLarge, read_capped
from kvscale.operator.kube.pods import url_of
from kvscale.operator.reconcile.children import PORT

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 1.5
# A worker's exposition is ~20 KiB; a body past this is no worker's (a tenant's look-alike, a
# bug): the pod counts as unreadable. The operator runs in 512Mi with kopf and the lease on one
# event loop, so nothing it reads from a pod may be unbounded.
SCRAPE_MAX_BYTES = 1 << 20

# Our metric names first, vLLM's as a fallback (so vLLM workers scale too).
METRICS = {
    "kv_usage": ("kvscale_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "waiting": ("kvscale_requests_waiting", "vllm:num_requests_waiting"),
    "running": ("kvscale_requests_running", "vllm:num_requests_running"),
    "finished": ("kvscale_requests_finished_total", "vllm:request_success_total"),
    # The compiled forward (issue 29): 1 once steps run it, and the seconds it took.
    "compiled": ("kvscale_forward_compiled",),
    "compile_s": ("kvscale_forward_compile_seconds",),
}
# Requests refused for a full queue are demand too (other refusals are not: invalid, draining...).
QUEUE_FULL = ("kvscale_requests_rejected_total", "reason", "queue_full")


def parse_metrics(text: str) -> dict[str, float]:
    """The signals from a Prometheus text exposition (summed over label sets), and `arrivals`:
    the requests the worker has received, a counter (finished + refused for a full queue + in
    flight), whose rate is the demand on it whether or not it keeps up; and `compile_s`, the
    seconds its compiled forward took, once it runs it."""
    values: dict[str, float] = {}
    queue_full = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            if sample.name == QUEUE_FULL[0] and sample.labels.get(QUEUE_FULL[1]) == QUEUE_FULL[2]:
                queue_full += sample.value
    out = {}
    for key, names in METRICS.items():
        found = next((values[n] for n in names if n in values), None)
        if found is not None:
            out[key] = found
    if all(k in out for k in ("finished", "running", "waiting")):
        out["arrivals"] = out.pop("finished") + queue_full + out["running"] + out["waiting"]
    out.pop("finished", None)
    compile_s = out.pop("compile_s", None)
    if out.pop("compiled", None) == 1.0 and compile_s is not None:
        out["compile_s"] = compile_s  # only once the compiled forward serves
    return out


# The router's own families (router/server.py), summed over models.
ROUTER_METRICS = {
    "queued": "kvscale_router_queued_requests",
    "in_flight": "kvscale_router_in_flight_requests",
    "arrivals": "kvscale_router_requests_total",
}


def parse_router_metrics(text: str, models: frozenset[str] | None = None) -> dict[str, float]:
    """The router's queue, in-flight and arrivals counts from its exposition (summed over
    models, or over `models` only: a shared InferenceEndpoint's router, whose other models'
    demand is not this resource's); a family it does not export yet (no request so far) reads
    as 0."""
    wanted = {v: k for k, v in ROUTER_METRICS.items()}
    out = dict.fromkeys(ROUTER_METRICS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and (models is None or sample.labels.get("model") in models):
                out[wanted[sample.name]] += sample.value
    return out


async def scrape(
    session: aiohttp.ClientSession,
    ip: str,
    parse=parse_metrics,
    *,
    max_bytes: int = SCRAPE_MAX_BYTES,
    timeout_s: float = SCRAPE_TIMEOUT_S,
    port: int = PORT,
) -> dict[str, float] | None:
    """One pod's /metrics, parsed (in a thread: a large exposition must not stall the loop that
    runs kopf and the lease), or None: refused, too slow (`timeout_s` for all of it, body
    included), too large, or unparsable. The session must not decompress (`new_session`): a small
    gzip body can inflate past any cap before a chunk reaches us."""
    url = url_of(ip, port, "/metrics")
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url, allow_redirects=False, headers={"Accept-Encoding": "identity"}) as r:
                if r.status != 200:
                    return None
                body = await read_capped(r, max_bytes)
        return await asyncio.to_thread(parse, body.decode("utf-8", errors="replace"))
    except TooLarge as e:
        logger.warning("autoscaler: %s answered a body too large to read (%s): counted unreadable", url, e)
        return None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def new_session(timeout_s: float = SCRAPE_TIMEOUT_S) -> aiohttp.ClientSession:
    """The scrapes' session: short timeouts, no decompression (see `scrape`)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s, connect=timeout_s)
    return aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
