"""Prometheus metrics: ours under `kvscale_` (Prometheus naming rules: base units, `_total` on
counters, `_ratio` for 0-1), and the same values under vLLM's names, so that dashboards, KEDA
recipes and the Gateway API inference extension written for vLLM work unchanged.

The engine thread feeds `record` once per step; every value comes from the engine itself
(IterationStats, SchedulerStats), never from a separate estimate.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvscale.worker.metrics.stats import IterationStats, SchedulerStats

# Buckets as vLLM uses them, so histogram_quantile over either name gives the same answer.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# Structured outputs: a grammar compiles in milliseconds to seconds; a step's masks take well under one.
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
# One engine step: a few ms (a compiled decode of one stream) to seconds (a long prefill, eagerly).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
FORWARDS = ("eager", "compiled")
FINISH_REASONS = ("stop", "length", "abort")
REJECT_REASONS = ("queue_full", "draining", "loading", "engine_dead", "invalid")


class _Twin:
    """One value exported under several names (ours first, then vLLM's)."""

    def __init__(
        self, kind, names: Iterable[str], doc: str, registry, labels: dict[str, str], **kwargs
    ) -> None:
        extra = kwargs.pop("extra_labels", ())
        self.metrics = [kind(name, doc, [*labels, *extra], registry=registry, **kwargs) for name in names]
        self.labels = labels
        # The labelled children, looked up once: `labels()` validates and locks on every call, and
        # `record` runs once per engine step (~25 series: 50 us a step, before this cache).
        self._children: dict[tuple[tuple[str, str], ...], list] = {}
        if not extra:
            self.child()  # export the series (at zero) before the first event

    def child(self, **extra: str):
        key = tuple(extra.items())
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = [m.labels(**self.labels, **extra) for m in self.metrics]
        return found

    def set(self, value: float) -> None:
        for m in self.child():
            m.set(value)

    def inc(self, value: float = 1.0, **extra: str) -> None:
        if value:
            for m in self.child(**extra):
                m.inc(value)

    def remove(self, **extra: str) -> None:
        """Drop one labelled series (a state that ended: it must not linger at its last value)."""
        values = [*self.labels.values(), *extra.values()]
        self._children.pop(tuple(extra.items()), None)
        for m in self.metrics:
            m.remove(*values)

    def observe_all(self, values: Iterable[float]) -> None:
        children = self.child()
        for v in values:
            for m in children:
                m.observe(v)


def _set_members(gauge: _Twin, before: frozenset[str], now: frozenset[str]) -> frozenset[str]:
    """A set of adapters as a gauge's series, one at 1 per lora_name: the ones gone removed (a
    state that ended must not linger at its last value), the new ones set. Returns `now`."""
    for name in before - now:
        gauge.remove(lora_name=name)
    for name in now - before:
        for m in gauge.child(lora_name=name):
            m.set(1)
    return now


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        # A scrape must not interleave with a record: it would see ours and vLLM's twin disagree,
        # or a step half applied (tokens counted, the request not yet finished).
        self._lock = threading.Lock()
        r, labels = self.registry, {"model_name": model_name}

        def twin(kind, names, doc, **kw):
            return _Twin(kind, names, doc, r, labels, **kw)

        self.kv_cache_usage = twin(
            Gauge,
            ["kvscale_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
            "KV-cache blocks held by requests over all blocks (1 = full).",
        )
        self.kv_cache_blocks = twin(Gauge, ["kvscale_kv_cache_blocks"], "Blocks in the KV-cache pool.")
        self.num_running = twin(
            Gauge, ["kvscale_requests_running", "vllm:num_requests_running"], "Requests in the running batch."
        )
        self.num_waiting = twin(
            Gauge, ["kvscale_requests_waiting", "vllm:num_requests_waiting"], "Requests queued for admission."
        )
        self.prefill_tokens = twin(
            Gauge,
            ["kvscale_prefill_tokens_pending"],
            "Prompt tokens of waiting and running requests not computed yet: the prefill work ahead "
            "of a new request's first token.",
        )
        self.prompt_tokens = twin(
            Counter,
            ["kvscale_prompt_tokens", "vllm:prompt_tokens"],
            "Prompt tokens of requests that started.",
        )
        self.generation_tokens = twin(
            Counter, ["kvscale_generation_tokens", "vllm:generation_tokens"], "Generated tokens."
        )
        self.prefix_queries = twin(
            Counter,
            ["kvscale_prefix_cache_query_tokens", "vllm:prefix_cache_queries"],
            "Prompt tokens looked up in the prefix cache.",
        )
        self.prefix_hits = twin(
            Counter,
            ["kvscale_prefix_cache_hit_tokens", "vllm:prefix_cache_hits"],
            "Prompt tokens served from the prefix cache.",
        )
        self.preemptions = twin(
            Counter,
            ["kvscale_preemptions", "vllm:num_preemptions"],
            "Requests preempted for lack of KV blocks.",
        )
        self.finished = twin(
            Counter,
            ["kvscale_requests_finished", "vllm:request_success"],
            "Finished requests by reason.",
            extra_labels=("finished_reason",),
        )
        self.ttft = twin(
            Histogram,
            ["kvscale_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"],
            "Arrival to first generated token.",
            buckets=TTFT_BUCKETS,
        )
        self.itl = twin(
            Histogram,
            [
                "kvscale_inter_token_latency_seconds",
                "vllm:inter_token_latency_seconds",
                "vllm:time_per_output_token_seconds",
            ],
            "Time between consecutive generated tokens of a request.",
            buckets=ITL_BUCKETS,
        )
        self.e2e = twin(
            Histogram,
            ["kvscale_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"],
            "Arrival to finish.",
            buckets=LATENCY_BUCKETS,
        )
        self.queue_time = twin(
            Histogram,
            ["kvscale_request_queue_time_seconds", "vllm:request_queue_time_seconds"],
            "Arrival to first scheduled.",
            buckets=LATENCY_BUCKETS,
        )
        self.spec_drafts = twin(
            Counter,
            ["kvscale_spec_decode_drafts", "vllm:spec_decode_num_drafts"],
            "Speculative proposals verified.",
        )
        self.spec_draft_tokens = twin(
            Counter,
            ["kvscale_spec_decode_draft_tokens", "vllm:spec_decode_num_draft_tokens"],
            "Tokens proposed by speculative decoding.",
        )
        self.spec_accepted_tokens = twin(
            Counter,
            ["kvscale_spec_decode_accepted_tokens", "vllm:spec_decode_num_accepted_tokens"],
            "Proposed tokens the target accepted.",
        )
        self.spec_accepted_per_pos = twin(
            Counter,
            [
                "kvscale_spec_decode_accepted_tokens_per_position",
                "vllm:spec_decode_num_accepted_tokens_per_pos",
            ],
            "Accepted proposed tokens by position in the proposal.",
            extra_labels=("position",),
        )
        self.async_steps = twin(
            Counter,
            ["kvscale_async_scheduled_steps"],
            "Steps launched before the previous step's tokens reached the host (--async-scheduling).",
        )
        self.rejected = twin(
            Counter,
            ["kvscale_requests_rejected"],
            "Requests refused before admission, by reason (queue_full, draining, loading, engine_dead, "
            "invalid).",
            extra_labels=("reason",),
        )
        # Structured outputs (vLLM exports no such metrics: ours only).
        self.structured_requests = twin(
            Counter,
            ["kvscale_structured_output_requests"],
            "Requests queued with a structured-output constraint (JSON schema, regex, choice, grammar).",
        )
        self.grammar_compile = twin(
            Histogram,
            ["kvscale_structured_output_compile_seconds"],
            "Time to compile one grammar (a cache hit compiles nothing).",
            buckets=COMPILE_BUCKETS,
        )
        self.grammar_mask = twin(
            Histogram,
            ["kvscale_structured_output_mask_seconds"],
            "Per step with constrained requests: filling their token bitmasks and applying them.",
            buckets=MASK_BUCKETS,
        )
        # Cold start (issue 29): the worker serves on the eager forward while the compiled CPU forward
        # is built behind, then switches (vLLM exports no such metrics: ours only).
        self.step_seconds = twin(
            Histogram,
            ["kvscale_engine_step_seconds"],
            "One engine step (schedule to outputs), by the forward it ran (eager, compiled).",
            buckets=STEP_BUCKETS,
            extra_labels=("forward",),
        )
        self.forward_compiled = twin(
            Gauge,
            ["kvscale_forward_compiled"],
            "1 once steps run the compiled forward (CPU), 0 while they run the eager one.",
        )
        self.forward_compile_seconds = twin(
            Gauge,
            ["kvscale_forward_compile_seconds"],
            "Seconds the compiled forward took to be ready: its build behind and load, or its load at "
            "start-up when a package was found (0 until then).",
        )
        # LoRA adapters, per adapter name (vLLM exports no such metrics: ours only). The base
        # model's requests are not counted here; an adapter's series appears with its first request.
        self.lora_finished = twin(
            Counter,
            ["kvscale_lora_requests_finished"],
            "Finished requests of each LoRA adapter, by reason.",
            extra_labels=("lora_name", "finished_reason"),
        )
        self.lora_prompt_tokens = twin(
            Counter,
            ["kvscale_lora_prompt_tokens"],
            "Prompt tokens of each LoRA adapter's requests that started.",
            extra_labels=("lora_name",),
        )
        self.lora_generation_tokens = twin(
            Counter,
            ["kvscale_lora_generation_tokens"],
            "Tokens generated with each LoRA adapter.",
            extra_labels=("lora_name",),
        )
        self.kv_events_published = twin(
            Counter,
            ["kvscale_kv_events_published"],
            "KV event messages queued for subscribers (one per step).",
        )
        self.kv_events_dropped = twin(
            Counter,
            ["kvscale_kv_events_dropped"],
            "KV event messages dropped by the publisher's full queue: subscribers see a gap and resync.",
        )
        self.lora_moves = {
            kind: twin(Counter, [f"kvscale_lora_{kind}"], doc)
            for kind, doc in (
                ("slot_loads", "LoRA adapters copied into a device slot (from host memory)."),
                (
                    "slot_evictions",
                    "LoRA adapters evicted from a device slot to make room (kept in host memory).",
                ),
                (
                    "host_evictions",
                    "LoRA adapters dropped from host memory (--max-cpu-loras); read again when needed.",
                ),
                ("disk_loads", "LoRA adapters read from their folders."),
            )
        }
        # One series per adapter in a device slot now, gone when it leaves the slot (so at most
        # --max-loras at once; names are bounded as every lora_name label, lora_serving.py). The
        # router's adapter affinity reads it: vllm:lora_requests_info lists only the adapters with
        # requests, not those still resident from earlier ones.
        self.lora_resident = twin(
            Gauge,
            ["kvscale_lora_adapter_resident"],
            "1 for each LoRA adapter in a device slot now (its series goes when it leaves the slot).",
            extra_labels=("lora_name",),
        )
        self._resident: frozenset[str] = frozenset()
        # One series per adapter this server serves by name (--lora-modules and run-time loads),
        # gone at its unload: the router sends an adapter's requests only where it is served, so
        # a pod the operator has not loaded it into yet gets none (rather than answering 404).
        # `digest`: its weights' content digest (worker/lora/adapter.py), the root of its
        # prefix-cache block hashes, from which the router's precise index computes an adapter
        # request's hashes (common/block_hash.py) as it does a base-model request's.
        self.lora_served = twin(
            Gauge,
            ["kvscale_lora_adapter_served"],
            "1 for each LoRA adapter this server serves by name, with the digest of its weights "
            "(the root of its prefix-cache block hashes); its series goes at its unload.",
            extra_labels=("lora_name", "digest"),
        )
        self._served: dict[str, str] = {}
        self._lora_info: Gauge | None = None
        self._lora_labels: dict[str, str] | None = None
        self._max_lora = "0"
        for forward in FORWARDS:
            self.step_seconds.child(forward=forward)
        # Labelled children exist from the start, so rate() sees a zero before the first event.
        for reason in FINISH_REASONS:
            self.finished.child(finished_reason=reason)
        for reason in REJECT_REASONS:
            self.rejected.child(reason=reason)

    def cache_config(
        self, block_size: int, num_blocks: int, enable_prefix_caching: bool, max_lora: int = 0
    ) -> None:
        """vLLM's info gauges, set once the KV pool is sized: the Gateway API inference extension's
        endpoint picker reads the block size and pool size (`vllm:cache_config_info`) and, for
        LoRA affinity, `vllm:lora_requests_info` (max_lora: the adapters one batch holds, 0 without
        LoRA; the running and waiting requests' adapters, updated as they change)."""
        labels = {
            "block_size": str(block_size),
            "num_gpu_blocks": str(num_blocks),
            "enable_prefix_caching": str(enable_prefix_caching),
        }
        with self._lock:
            Gauge(
                "vllm:cache_config_info",
                "Information of the KV-cache config.",
                list(labels),
                registry=self.registry,
            ).labels(**labels).set(1)
            self._lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on LoRA requests.",
                ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                registry=self.registry,
            )
            self._max_lora = str(max_lora)
            self._set_lora_info([], [])

    def _set_lora_info(self, running: list[str], waiting: list[str]) -> None:
        """One series (vLLM's labels: comma-separated adapter names), whose value is when its labels
        last changed; the previous series goes, so a scrape never sees two (lock held)."""
        labels = {
            "max_lora": self._max_lora,
            "running_lora_adapters": ",".join(running),
            "waiting_lora_adapters": ",".join(waiting),
        }
        if labels == self._lora_labels or self._lora_info is None:
            return
        self._lora_info.clear()
        self._lora_info.labels(**labels).set_to_current_time()
        self._lora_labels = labels

    def _set_resident(self, names: Iterable[str]) -> None:
        """The resident adapters' series: one at 1 per adapter in a slot now (lock held)."""
        self._resident = _set_members(self.lora_resident, self._resident, frozenset(names))

    def set_served_adapters(self, digests: Mapping[str, str]) -> None:
        """The adapters the server serves now, name -> content digest (lora_serving.py, at each
        load and unload): a series per (name, digest), the others removed."""
        with self._lock:
            for name, digest in self._served.items():
                if digests.get(name) != digest:
                    self.lora_served.remove(lora_name=name, digest=digest)
            for name, digest in digests.items():
                if self._served.get(name) != digest:
                    for m in self.lora_served.child(lora_name=name, digest=digest):
                        m.set(1)
            self._served = dict(digests)

    def render(self) -> bytes:
        """The Prometheus text exposition, consistent with whole `record` calls."""
        with self._lock:
            return generate_latest(self.registry)

    def record(self, it: IterationStats, sched: SchedulerStats, num_blocks: int) -> None:
        with self._lock:
            self._record(it, sched, num_blocks)

    def _record(self, it: IterationStats, sched: SchedulerStats, num_blocks: int) -> None:
        self.kv_cache_usage.set(sched.kv_cache_usage)
        self.kv_cache_blocks.set(num_blocks)
        self.num_running.set(sched.num_running)
        self.num_waiting.set(sched.num_waiting)
        self.prefill_tokens.set(sched.num_prefill_tokens)
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        self.prefix_queries.inc(it.prefix_cache_queries)
        self.prefix_hits.inc(it.prefix_cache_hits)
        self.preemptions.inc(it.num_preemptions)
        self.ttft.observe_all(it.time_to_first_tokens)
        self.itl.observe_all(it.inter_token_latencies)
        for f in it.finished:
            self.finished.inc(finished_reason=f.finish_reason)
            self.e2e.observe_all([f.e2e_latency])
            if f.queue_time is not None:
                self.queue_time.observe_all([f.queue_time])
        self.spec_drafts.inc(it.num_drafts)
        self.async_steps.inc(it.num_async_steps)
        self.spec_draft_tokens.inc(it.num_draft_tokens)
        self.spec_accepted_tokens.inc(it.num_accepted_tokens)
        self.structured_requests.inc(it.num_structured_requests)
        self.grammar_compile.observe_all(it.grammar_compile_times)
        self.grammar_mask.observe_all(it.grammar_mask_times)
        for forward, seconds in it.step_times:
            for m in self.step_seconds.child(forward=forward):
                m.observe(seconds)
        self._set_lora_info(sched.running_lora_adapters, sched.waiting_lora_adapters)
        for f in it.finished:
            if f.lora_name is not None:
                self.lora_finished.inc(lora_name=f.lora_name, finished_reason=f.finish_reason)
        for name, n in it.lora_prompt_tokens.items():
            self.lora_prompt_tokens.inc(n, lora_name=name)
        for name, n in it.lora_generation_tokens.items():
            self.lora_generation_tokens.inc(n, lora_name=name)
        self.kv_events_published.inc(it.kv_events_published)
        self.kv_events_dropped.inc(it.kv_events_dropped)
        self.lora_moves["slot_loads"].inc(it.lora_slot_loads)
        self.lora_moves["slot_evictions"].inc(it.lora_slot_evictions)
        self.lora_moves["host_evictions"].inc(it.lora_host_evictions)
        self.lora_moves["disk_loads"].inc(it.lora_disk_loads)
        self._set_resident(it.lora_resident)
        self.forward_compiled.set(1.0 if it.forward == "compiled" else 0.0)
        self.forward_compile_seconds.set(it.compile_seconds or 0.0)
        for pos, n in enumerate(it.accepted_per_position):
            self.spec_accepted_per_pos.child(position=str(pos))  # a position never accepted exports 0
            self.spec_accepted_per_pos.inc(n, position=str(pos))
