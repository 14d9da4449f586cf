"""What the router knows of its endpoints, and the one place that turns it into picks: the ready
set (from the endpoint source), each one's scraped metrics, the router's own in-flight counts and
the prefix index. No I/O here; server.py, endpoints.py and scrape.py feed it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvscale.router.kv_index import KVBlockIndex, TokenPrompt
from kvscale.router.picker import Candidate, PickerConfig, pick, pick_round_robin
from kvscale.router.prefix_index import DEFAULT_MAX_BLOCKS, PrefixIndex

POLICIES = ("kv-prefix", "round-robin")


@dataclass(frozen=True)
class PickRequest:
    """What a pick reads of a request: its prefix-block hashes (the approximate index's), the model
    it names, and its prompt's token ids where the router has them (the precise index's)."""

    hashes: Sequence[int]
    model: str | None = None
    prompt: TokenPrompt | None = None


@dataclass
class WorkerMetrics:
    """The few values the router reads from a worker's /metrics (scrape.parse_metrics)."""

    kv_usage: float = 0.0
    waiting: int = 0
    running: int = 0
    prefix_queries: float = 0.0  # prompt tokens looked up in its prefix cache, since it started
    prefix_hits: float = 0.0
    kv_blocks: int = 0
    # Prompt tokens its requests have not computed yet, every router's and client's (ours say it;
    # None: a vLLM worker does not).
    prefill_pending: int | None = None
    served_model: str = ""  # its metrics' model_name label: the name its base model is served as
    max_lora: int = 0  # its LoRA device slots (0: no LoRA)
    adapters: frozenset[str] = frozenset()  # the LoRA adapters in its device slots now
    # Slots a request for another adapter can take at once: those not held by an adapter with
    # requests there (running or waiting); an idle resident adapter gives its slot up on demand.
    lora_free_slots: int = 0
    # The adapters it serves by name (loaded); None: it does not say (a vLLM worker): any, maybe.
    served_adapters: frozenset[str] | None = None
    # Each served adapter's content digest, the root of its KV blocks' hashes (ours say it; a
    # vLLM worker does not, and its adapters' requests are scored by the approximate index).
    adapter_digests: Mapping[str, str] = field(default_factory=dict)


class RouterState:
    def __init__(
        self,
        config: PickerConfig | None = None,
        index: PrefixIndex | None = None,
        policy: str = "kv-prefix",
        kv_index: KVBlockIndex | None = None,
    ) -> None:
        """`kv_index`: the precise index (the workers' KV events), which scores a request the router
        has token ids for at each endpoint whose index is synced; the approximate `index` scores
        the rest (and records every pick, so it is warm when events stop)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")
        self.config, self.policy = config or PickerConfig(), policy
        self.index = index or PrefixIndex()
        self.kv_index = kv_index
        self.endpoints: set[str] = set()
        self.metrics: dict[str, WorkerMetrics] = {}
        self.in_flight: dict[str, int] = {}
        # The prefill guard's books: per endpoint, the uncached prompt tokens of the requests sent
        # there and not answered yet; per (endpoint, request), its share, taken back once.
        self.pending_prefill: dict[str, int] = {}
        self._prefill: dict[tuple[str, int], int] = {}
        # Ours at each endpoint when its last scrape came in: what of its own count was ours.
        self._pending_at_scrape: dict[str, int] = {}
        # Each endpoint's prefill work ahead as its load messages say (kv_events.py; fresher than
        # a scrape: sent as it changes), and ours there when the last one came in.
        self._load: dict[str, tuple[int, int]] = {}
        # The precise index's pending blocks of each (endpoint, request) in flight.
        self._in_flight_blocks: dict[tuple[str, int], list[bytes]] = {}
        self._turn = 0

    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        """The ready set now. One that left is forgotten (its index, its metrics); its requests
        still in flight finish and release harmlessly."""
        new = set(endpoints)
        for gone in self.endpoints - new:
            self.index.remove(gone)
            if self.kv_index is not None:
                self.kv_index.remove(gone)
            self.metrics.pop(gone, None)
            self._pending_at_scrape.pop(gone, None)
            self._load.pop(gone, None)
        self.endpoints = new

    def update_metrics(self, endpoint: str, m: WorkerMetrics) -> None:
        if endpoint not in self.endpoints:
            return
        old = self.metrics.get(endpoint)
        if old is not None and (m.prefix_queries < old.prefix_queries or m.prefix_hits < old.prefix_hits):
            self.index.clear(endpoint)  # its counters restarted: so did the worker, and its cache
        self.index.set_capacity(endpoint, m.kv_blocks)
        self.metrics[endpoint] = m
        self._pending_at_scrape[endpoint] = self.pending_prefill.get(endpoint, 0)

    def update_load(self, endpoint: str, prefill_tokens: int | None) -> None:
        """The endpoint's own count of its prefill work ahead, from its load message (None: not
        known any more, its stream dropped: the scrape's count serves again)."""
        if prefill_tokens is None or endpoint not in self.endpoints:
            self._load.pop(endpoint, None)
        else:
            self._load[endpoint] = (prefill_tokens, self.pending_prefill.get(endpoint, 0))

    def prefill_ahead(self, endpoint: str) -> int:
        """The prefill tokens ahead of a new request there: ours not answered yet, plus what the
        worker last said beyond ours then (other router replicas' requests, other clients'; said
        before ours sent since arrived, so those are counted once, by us). What it last said: its
        load message where it sends them (a step old at most), else its last scrape's gauge (a
        scrape old; and the gauge is set after a step, so it misses the step running now)."""
        own = self.pending_prefill.get(endpoint, 0)
        if endpoint in self._load:
            said, own_then = self._load[endpoint]
            return own + max(0, said - own_then)
        m = self.metrics.get(endpoint)
        if m is None or m.prefill_pending is None:
            return own
        return own + max(0, m.prefill_pending - self._pending_at_scrape.get(endpoint, 0))

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model. The workers say
        both halves of the rule in their metrics: a name none of them serves its base model as
        (their model_name label), while some have LoRA slots, is an adapter (vLLM's convention; a
        name no worker knows gets their 404, wherever it goes). Before the first scrape nothing is
        known: every request is the base model's (no affinity, as before)."""
        scraped = self.metrics.values()
        if not model or not any(m.max_lora > 0 for m in scraped):
            return None
        return None if any(m.served_model == model for m in scraped) else model

    def _lora(self, endpoint: str, adapter: str | None) -> tuple[bool, bool, bool]:
        """(has the adapter, has an empty slot, has a slot free for it) there; all False for the
        base model."""
        if adapter is None:
            return False, False, False
        m = self.metrics.get(endpoint) or WorkerMetrics()
        return adapter in m.adapters, m.max_lora > len(m.adapters), m.lora_free_slots > 0

    def candidates(
        self, hashes: Sequence[int], adapter: str | None = None, prompt: TokenPrompt | None = None
    ) -> list[Candidate]:
        out = []
        for name in sorted(self.endpoints):
            m = self.metrics.get(name) or WorkerMetrics()
            has_adapter, adapter_empty, adapter_room = self._lora(name, adapter)
            match, blocks, cost = self.index.match_length(name, hashes), 0, -1
            hashes_there = self._precise_hashes(name, prompt, adapter)
            if hashes_there is not None:
                assert self.kv_index is not None and prompt is not None
                match, blocks = self.kv_index.match_length(name, hashes_there), len(hashes_there)
                cost = max(0, len(prompt.token_ids) - match * self.kv_index.state(name).block_size)
            out.append(
                Candidate(
                    name,
                    kv_usage=m.kv_usage,
                    waiting=m.waiting,
                    running=m.running,
                    in_flight=self.in_flight.get(name, 0),
                    prefix_match=match,
                    prefix_blocks=blocks,
                    pending_prefill=self.prefill_ahead(name),
                    prefill_cost=cost,
                    has_adapter=has_adapter,
                    adapter_empty=adapter_empty,
                    adapter_room=adapter_room,
                )
            )
        return out

    def _precise_hashes(
        self, endpoint: str, prompt: TokenPrompt | None, adapter: str | None
    ) -> list[bytes] | None:
        """The request's block hashes as that endpoint's precise index keys them, or None where it
        cannot score it: no token ids, no synced index there, or an adapter whose digest the
        endpoint has not said (a vLLM worker: the approximate index scores it)."""
        kv = self.kv_index
        if prompt is None or kv is None or not kv.synced(endpoint):
            return None
        digest = None
        if adapter is not None:
            digest = (self.metrics.get(endpoint) or WorkerMetrics()).adapter_digests.get(adapter)
            if digest is None:
                return None
        return prompt.block_hashes(kv.state(endpoint).block_size, DEFAULT_MAX_BLOCKS, digest)

    def serving(self, adapter: str | None) -> set[str] | None:
        """The endpoints a request for `adapter` may go to (None: any). A base-model request goes
        anywhere; an adapter's only where it is served by name (or where the worker does not say,
        a vLLM one), while any worker serves it: a pod the operator has not loaded it into yet
        (dynamic loading), or not yet scraped, gets none of its requests rather than answering
        404. An adapter no worker serves goes anywhere (and gets its 404 there)."""
        if adapter is None:
            return None
        if not any(
            m.served_adapters is not None and adapter in m.served_adapters for m in self.metrics.values()
        ):
            return None
        return {
            e for e, m in self.metrics.items() if m.served_adapters is None or adapter in m.served_adapters
        }

    def affinity(self, endpoint: str, model: str | None) -> str | None:
        """What a request for `model` found at `endpoint`: "resident" (its adapter in a slot),
        "empty" (an empty slot), "room" (an idle adapter's slot), "none"; None for a base-model
        request."""
        adapter = self.adapter_of(model)
        if adapter is None:
            return None
        has, empty, room = self._lora(endpoint, adapter)
        return "resident" if has else "empty" if empty else "room" if room else "none"

    def choose(
        self,
        hashes: Sequence[int],
        exclude: Iterable[str] = (),
        model: str | None = None,
        prompt: TokenPrompt | None = None,
    ) -> str | None:
        """The endpoint for a request with these block hashes naming `model` (not one of `exclude`:
        those a retry already tried), counted in flight there and its blocks recorded; None: nobody
        can take it."""
        chosen, cost = self.peek(hashes, exclude, model, prompt)
        if self.policy == "round-robin":
            self._turn += 1
        if chosen is not None:
            self.in_flight[chosen] = self.in_flight.get(chosen, 0) + 1
            if prompt is not None and cost > 0:
                self._prefill[(chosen, id(prompt))] = cost
                self.pending_prefill[chosen] = self.pending_prefill.get(chosen, 0) + cost
            blocks = self._precise_hashes(chosen, prompt, self.adapter_of(model)) if cost >= 0 else None
            if blocks is not None:
                assert self.kv_index is not None
                self.kv_index.add_pending(chosen, blocks)
                self._in_flight_blocks[(chosen, id(prompt))] = blocks
            if self.policy != "round-robin":
                self.index.record(chosen, hashes)
        return chosen

    def peek(
        self,
        hashes: Sequence[int],
        exclude: Iterable[str] = (),
        model: str | None = None,
        prompt: TokenPrompt | None = None,
    ) -> tuple[str | None, int]:
        """What choose would pick now, and the request's prefill cost there (-1: unknown), changing
        nothing (the pick is a pure function of the state)."""
        skip = set(exclude)
        adapter = self.adapter_of(model)
        allowed = self.serving(adapter)
        cands = [
            c
            for c in self.candidates(hashes, adapter, prompt)
            if c.name not in skip and (allowed is None or c.name in allowed)
        ]
        if self.policy == "round-robin":
            chosen = pick_round_robin(cands, self._turn, self.config)
        else:
            chosen = pick(cands, len(hashes), hashes[0] if hashes else 0, self.config)
        cost = next((c.prefill_cost for c in cands if c.name == chosen), -1)
        return chosen, cost

    def prefill_done(self, endpoint: str, prompt: TokenPrompt | None) -> None:
        """The request's first byte came back from the endpoint (or it ended): its prefill is no
        longer ahead of anyone's there. Once per pick; later calls do nothing."""
        if prompt is None:
            return
        cost = self._prefill.pop((endpoint, id(prompt)), 0)
        if cost:
            left = self.pending_prefill.get(endpoint, 0) - cost
            if left > 0:
                self.pending_prefill[endpoint] = left
            else:
                self.pending_prefill.pop(endpoint, None)

    def request_done(self, endpoint: str, prompt: TokenPrompt | None) -> None:
        """The request sent to the endpoint ended: its prefill is not ahead of anyone's, and its
        blocks are the worker's events' business now. Once per pick; later calls do nothing."""
        self.prefill_done(endpoint, prompt)
        blocks = self._in_flight_blocks.pop((endpoint, id(prompt)), None)
        if blocks is not None and self.kv_index is not None:
            self.kv_index.drop_pending(endpoint, blocks)

    def release(self, endpoint: str) -> None:
        n = self.in_flight.get(endpoint, 0) - 1
        if n > 0:
            self.in_flight[endpoint] = n
        else:
            self.in_flight.pop(endpoint, None)
