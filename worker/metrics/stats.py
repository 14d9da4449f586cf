"""What one engine step did and where the scheduler stands, for the metrics: filled by the engine
and the scheduler, read by the Prometheus exporter (prometheus.py), which the server serves."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort"
    e2e_latency: float
    queue_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    lora_name: str | None = None  # the request's LoRA adapter (None: the base model)


@dataclass
class IterationStats:
    # Prompt tokens of requests that produced their first token (vLLM counts them there too).
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    # Speculative decoding: proposals made, tokens proposed and accepted (per position too).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # Structured outputs: constrained requests queued, seconds per grammar compile (each compile,
    # not each request: the cache serves the rest), seconds per step filling and applying masks.
    num_structured_requests: int = 0
    # Async scheduling: steps launched while the previous one's tokens had not reached the host.
    num_async_steps: int = 0
    grammar_compile_times: list[float] = field(default_factory=list)
    grammar_mask_times: list[float] = field(default_factory=list)
    # Seconds of each step (schedule to outputs), with the forward it ran: "eager" while the compiled
    # CPU forward is being built behind, then "compiled" (model/compilation.py).
    step_times: list[tuple[str, float]] = field(default_factory=list)
    # The forward steps run now, and the seconds the compiled one took to get there (its build and
    # load, or its load at start-up; None while it does not exist).
    forward: str = "eager"
    compile_seconds: float | None = None
    # LoRA, per adapter name: prompt tokens of requests that produced their first token, and
    # generated tokens (the base model's are not listed).
    lora_prompt_tokens: dict[str, int] = field(default_factory=dict)
    lora_generation_tokens: dict[str, int] = field(default_factory=dict)
    # LoRA adapters moved since the last stats: host -> device slot copies, slots given to another
    # adapter, adapters dropped from host memory, adapters read from their folders.
    # KV events (engine/kv_event_publisher.py): messages queued for the publisher, and refused by
    # its full queue (the subscribers see a gap).
    kv_events_published: int = 0
    kv_events_dropped: int = 0
    lora_slot_loads: int = 0
    lora_slot_evictions: int = 0
    lora_host_evictions: int = 0
    lora_disk_loads: int = 0
    # The adapters in a device slot now (a state, not an event: kvscale_lora_adapter_resident, what
    # the router's adapter affinity reads); empty without LoRA.
    lora_resident: list[str] = field(default_factory=list)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # LoRA: the adapters of the running and of the waiting requests, by name (vllm:lora_requests_info).
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    # Prompt tokens of the waiting and running requests not computed yet: the prefill work ahead of
    # a new request's first token (a waiting request's cached prefix is counted until it is
    # admitted and matched). What the routers' prefill guard reads, every router's requests in it.
    num_prefill_tokens: int = 0
