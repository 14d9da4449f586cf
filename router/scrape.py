"""Each endpoint's /metrics at sub-second intervals, parsed with prometheus-client's text parser.

Only the families the router reads are parsed: the rest of the exposition (histograms, mostly) is
dropped line by line first, so a scrape costs the event loop a few hundred lines, not thousands.
Sums over label sets (a worker serves one model, so there is one of each); the base model's
served name is their model_name label. LoRA: the adapters in device slots
(`kvscale_lora_adapter_resident`), those it serves at all (`kvscale_lora_adapter_served`; a worker
without it, as vLLM, is taken to serve every adapter) with each one's content digest (its label
`digest`: the root of that adapter's block hashes in the precise index), and the slots
(`vllm:lora_requests_info`: max_lora, and the adapters with running or waiting requests, which hold
theirs). A body past
`max_bytes` (1 MiB; a worker's is ~20 KiB) is never read whole: the endpoint counts as a failed
scrape (capped_body.py says why every scrape of a pod is capped).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvscale.common.capped_body import TooLarge, read_capped
from kvscale.router.state import WorkerMetrics

logger = logging.getLogger(__name__)

# The worker's names (worker/metrics/prometheus.py): vLLM's, which every vLLM-compatible server
# exports, and our KV pool size (the prefix index's per-endpoint capacity).
FAMILIES = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "kvscale_kv_cache_blocks": "kv_blocks",
    "kvscale_prefill_tokens_pending": "prefill_pending",
}
RESIDENT = "kvscale_lora_adapter_resident"  # ours: one series per adapter in a device slot
SERVED = "kvscale_lora_adapter_served"  # ours: a series per adapter served by name, with its digest
LORA_INFO = "vllm:lora_requests_info"  # vLLM's: one series (the latest by value) with lists in labels
_PREFIXES = (*FAMILIES, RESIDENT, SERVED, LORA_INFO)
MAX_BYTES = 1 << 20
DIGEST = re.compile(r"[0-9a-f]{64}")  # an adapter's content digest: SHA-256, hex (worker/lora/adapter.py)


def _wanted(line: str) -> bool:
    """A line of a family we read (`# HELP name`, `# TYPE name`, or a sample), or of one whose name
    only extends it (`_created`: dropped below by its family name)."""
    if line.startswith("# "):
        parts = line.split(" ", 3)
        return len(parts) > 2 and parts[2].startswith(_PREFIXES)
    return line.startswith(_PREFIXES)


def _names(labels: dict[str, str], key: str) -> frozenset[str]:
    """A comma-separated list label of vllm:lora_requests_info, as a set."""
    return frozenset(n for n in labels.get(key, "").split(",") if n)


def _max_lora(labels: dict[str, str]) -> int:
    try:
        return max(0, int(labels.get("max_lora", "0")))
    except ValueError:
        return 0


def parse_metrics(text: str) -> WorkerMetrics:
    kept = "\n".join(line for line in text.splitlines() if _wanted(line)) + "\n"
    values: dict[str, float] = {}
    served = ""
    resident: set[str] = set()
    served_adapters: frozenset[str] | None = None  # None: the worker does not say (vLLM)
    digests: dict[str, str] = {}
    info: dict[str, str] = {}
    info_time = float("-inf")
    for family in text_string_to_metric_families(kept):
        samples = [s for s in family.samples if s.name in (family.name, family.name + "_total")]
        if family.name == RESIDENT:
            resident.update(s.labels.get("lora_name", "") for s in samples if s.value > 0)
        elif family.name == SERVED:
            live = [s.labels for s in samples if s.value > 0]
            served_adapters = (served_adapters or frozenset()) | {x.get("lora_name", "") for x in live}
            # A digest is a hash input, never a path or a key the worker chooses for us: a
            # malformed one (not SHA-256 hex) is ignored, and that adapter scored approximately.
            digests |= {x["lora_name"]: x["digest"] for x in live if DIGEST.fullmatch(x.get("digest", ""))}
        elif family.name == LORA_INFO:
            for sample in samples:  # vLLM may keep old series: the latest (its value is a time) wins
                if sample.value > info_time:
                    info, info_time = sample.labels, sample.value
        elif (field := FAMILIES.get(family.name)) is not None:
            for sample in samples:
                values[field] = values.get(field, 0.0) + sample.value
                served = served or sample.labels.get("model_name", "")
    running = _names(info, "running_lora_adapters")
    # An adapter with requests holds its slot; an idle resident one gives it up on demand.
    busy = running | _names(info, "waiting_lora_adapters")
    max_lora = _max_lora(info)
    return WorkerMetrics(
        kv_usage=values.get("kv_usage", 0.0),
        waiting=int(values.get("waiting", 0)),
        running=int(values.get("running", 0)),
        prefix_queries=values.get("prefix_queries", 0.0),
        prefix_hits=values.get("prefix_hits", 0.0),
        kv_blocks=int(values.get("kv_blocks", 0)),
        prefill_pending=int(values["prefill_pending"]) if "prefill_pending" in values else None,
        served_model=served,
        max_lora=max_lora,
        # A running adapter is in a slot too: all a vLLM worker, without our gauge, tells of them.
        adapters=frozenset(resident | running),
        lora_free_slots=max(0, max_lora - len(busy)),
        served_adapters=served_adapters,
        adapter_digests=digests,
    )


class Scraper:
    """Scrapes every endpoint each `interval_s`, at most `concurrency` at once, each within
    `timeout_s`; a failed scrape keeps the endpoint's last metrics (its readiness is the
    EndpointSlice's business, and a dead one is skipped by the proxy's retry)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        endpoints: Callable[[], Iterable[str]],
        on_metrics: Callable[[str, WorkerMetrics], None],
        interval_s: float = 0.25,
        timeout_s: float = 1.0,
        concurrency: int = 16,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.session, self.endpoints, self.on_metrics = session, endpoints, on_metrics
        self.interval_s, self.timeout_s, self.max_bytes = interval_s, timeout_s, max_bytes
        self._limit = asyncio.Semaphore(concurrency)
        self.errors = 0
        self.scrapes = 0

    async def scrape_one(self, url: str) -> None:
        async with self._limit:
            try:
                timeout = aiohttp.ClientTimeout(total=self.timeout_s)
                # Identity encoding: the session does not decompress (main.py), so a gzip body
                # would not parse; asking for none keeps the cap a cap on what we parse.
                headers = {"Accept-Encoding": "identity"}
                get = self.session.get(
                    url + "/metrics", timeout=timeout, headers=headers, allow_redirects=False
                )
                async with get as resp:
                    if resp.status != 200:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                    body = await read_capped(resp, self.max_bytes)
                metrics = parse_metrics(body.decode("utf-8", errors="replace"))
            except (aiohttp.ClientError, TimeoutError, ValueError, TooLarge) as e:
                self.errors += 1
                logger.debug("scrape failed", extra={"endpoint": url, "error": repr(e)})
                return
        self.scrapes += 1
        self.on_metrics(url, metrics)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape_one(u) for u in list(self.endpoints())))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.scrape_all()
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))
