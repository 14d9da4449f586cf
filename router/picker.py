"""The pure picking function: which endpoint takes a request, or None (nobody can: it queues).

Filter, guard, score, pick:
1. filter: an endpoint at its limit cannot take a request: `waiting >= max_waiting`, or a full KV
   cache (`kv_usage >= max_kv_usage`) while requests already wait there. A full KV cache with
   nothing waiting is a busy worker, not a saturated one: it admits as blocks free.
2. bounded load (consistent hashing with bounded loads, Mirrokni et al.; KubeAI's CHWBL): with
   `total` requests of the router in flight on the n endpoints left, none whose in-flight count is
   at or over ceil(c x (total + 1) / n) may take one. The least-loaded endpoint is always under it
   (c >= 1), so the guard never empties the set; a hot prefix spills to the next-best endpoint.
3. score, as llm-d's default scheduling profile (prefix-cache-scorer 3, kv-cache-utilization-scorer
   2, queue-scorer 2): prefix = matched blocks / the request's blocks; kv = 1 - kv_usage;
   queue = 1 - (queued - min) / (max - min) over the endpoints left (1 when all are equal), where
   queued is what waits for admission there: the scraped waiting count (every client's, but a
   scrape old), or, when higher, the router's own requests there beyond the scraped running ones
   (sent since that scrape). As llm-d's queue-scorer, it counts waiting, not running, requests: a
   worker batching more requests is not slower to start one more until it queues them, so a busier
   home keeps its prefixes (the guard bounds how much busier).
   lora (llm-d's lora-affinity scorer idea), only for a request that names a LoRA adapter: 1 where
   the adapter is resident (in a device slot: it runs at once, no copy), 0.75 where a slot is
   empty (copied in, evicting nothing), 0.5 where a slot holds only an idle adapter (copied in,
   evicting that one: another worker would rather keep it), 0 where every slot holds an adapter
   with requests (it waits there for one to drain). A base-model request scores 0 everywhere: no
   effect. The weight, 20, makes the gap between two tiers (a quarter of it: 5) outweigh any kv
   and queue difference (at most 2 + 2): among the endpoints under the bound an adapter goes where
   it is resident, else where it evicts nothing, else where it evicts an idle one, and kv/queue
   choose within a tier (a prefix match, hashed per adapter name, can still tip it: it is where
   the adapter ran lately). Without the empty tier, two adapters alternating on two one-slot
   workers could both prefer the same worker and evict each other at every request. Steps 1 and 2
   are not scores, so no weight overrides them: a hot adapter's holders at the bound spill to the
   next tier, which then loads it (the adapter spreads as its traffic grows).
   prefill guard (optional, `prefill_factor`; the queue-aware policy): with the precise index, the
   router knows what a request would cost each endpoint before its first token: the prompt tokens
   its cache lacks there, behind the prompt tokens of the router's requests already sent there and
   not yet answered (their first byte), less what those found cached, plus what the worker's own
   count of prompt tokens not computed yet held beyond those when it last said it (its load
   message on the KV-event stream, a step old at most; else its scraped gauge): the other
   replicas' requests and other clients' (state.prefill_ahead). An endpoint whose
   `pending_prefill + prefill_cost` is over `prefill_factor` x the least of them (+ `prefill_slack`
   tokens, so small queues do not flap) takes nothing: a hot prefix's home that has a burst of
   prefills queued spills to a worker that can start sooner even without the cache, which is what
   a TTFT tail is made of. Request counts cannot see it: one 6k-token prompt and one 60-token turn
   are one request each. Where it applies (every endpoint left has a known cost: synced) it is
   the load guard, in place of the request-count bound above, which with a few requests in flight
   per endpoint spills a prefix whenever it has two (and two router replicas, each counting only
   its own, spill differently); and the queue score weighs that same work, pending_prefill +
   prefill_cost, instead of queued requests: a prompt cached nowhere (a new tenant's first turn,
   the slowest first tokens of the route benchmark: docs/benchmarks.md) goes where the least
   prefill is ahead of it, not only wherever KV usage is lowest.
4. pick the highest score; ties go by rendezvous hash of (the request's first block, endpoint), so
   that equal endpoints split new prefixes between them deterministically, then by name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash


@dataclass(frozen=True)
class Weights:
    prefix: float = 3.0
    kv: float = 2.0
    queue: float = 2.0
    lora: float = 20.0  # / 4 > kv + queue: an adapter's tier beats any kv/queue difference


@dataclass(frozen=True)
class PickerConfig:
    weights: Weights = Weights()
    load_factor: float = 1.25  # c of the bounded-load guard (>= 1)
    max_waiting: int = 32  # an endpoint with this many waiting requests takes no more
    max_kv_usage: float = 0.95
    prefill_factor: float | None = None  # the prefill guard (None: off)
    prefill_slack: int = 256  # tokens


@dataclass(frozen=True)
class Candidate:
    name: str  # the endpoint's URL
    kv_usage: float = 0.0  # scraped, 0-1
    waiting: int = 0  # scraped
    running: int = 0  # scraped
    in_flight: int = 0  # the router's own requests there now
    prefix_match: int = 0  # leading blocks of this request its index holds
    # The request's blocks in the precise index's units (its workers' block size) when prefix_match
    # is the precise index's; 0: the approximate index's, out of pick's num_blocks.
    prefix_blocks: int = 0
    # The prompt tokens of the router's requests sent there without a first byte yet (less their
    # cached part), and this request's uncached prompt tokens there (-1: unknown, not synced).
    pending_prefill: int = 0
    prefill_cost: int = -1
    # The request's LoRA adapter (all False for a base-model request): in a device slot there; or
    # not, but a slot is empty, or held by an idle adapter it may evict (scraped).
    has_adapter: bool = False
    adapter_empty: bool = False
    adapter_room: bool = False

    @property
    def queued(self) -> int:
        return max(self.waiting, self.in_flight - self.running)


def adapter_affinity(c: Candidate) -> float:
    """The lora score: 1 resident, 0.75 an empty slot, 0.5 an idle adapter's slot, 0 none (and for
    a base-model request)."""
    return 1.0 if c.has_adapter else 0.75 if c.adapter_empty else 0.5 if c.adapter_room else 0.0


def can_take(c: Candidate, config: PickerConfig) -> bool:
    if c.waiting >= config.max_waiting:
        return False
    return not (c.kv_usage >= config.max_kv_usage and c.waiting > 0)


def load_bound(total_in_flight: int, n: int, load_factor: float) -> int:
    """In-flight count at or over which an endpoint takes nothing new (CHWBL's capacity)."""
    return math.ceil(load_factor * (total_in_flight + 1) / n)


def prefill_guard(cands: Sequence[Candidate], factor: float, slack: int) -> list[Candidate]:
    """The candidates whose prefill work ahead of the request's first token (queued + its own) is
    within factor x the least of them + slack; never empty (the least one always passes)."""
    floor = min(c.pending_prefill + c.prefill_cost for c in cands)
    return [c for c in cands if c.pending_prefill + c.prefill_cost <= max(1.0, factor) * floor + slack]


def _tie_break(first_block: int, name: str) -> int:
    return xxhash.xxh3_64_intdigest(first_block.to_bytes(8, "little") + name.encode())


def pick(
    candidates: Sequence[Candidate],
    num_blocks: int,
    first_block: int = 0,
    config: PickerConfig = PickerConfig(),
) -> str | None:
    """The endpoint for a request of `num_blocks` hashed blocks (the first one's hash for tie-breaks),
    or None when no candidate can take it."""
    able = [c for c in candidates if can_take(c, config)]
    if not able:
        return None
    guarded = config.prefill_factor is not None and all(c.prefill_cost >= 0 for c in able)
    if guarded:
        able = prefill_guard(able, config.prefill_factor, config.prefill_slack)
    else:
        bound = load_bound(sum(c.in_flight for c in able), len(able), max(1.0, config.load_factor))
        able = [c for c in able if c.in_flight < bound]

    def ahead(c: Candidate) -> int:
        # With the prefill guard, the queue is the prefill work before this request's first token
        # there (what a TTFT tail is made of: a cold prompt behind another one); else requests.
        return c.pending_prefill + c.prefill_cost if guarded else c.queued

    lo, hi = min(ahead(c) for c in able), max(ahead(c) for c in able)
    w = config.weights

    def score(c: Candidate) -> float:
        total = c.prefix_blocks or num_blocks
        prefix = c.prefix_match / total if total else 0.0
        queue = 1.0 - (ahead(c) - lo) / (hi - lo) if hi > lo else 1.0
        kv = 1.0 - min(1.0, max(0.0, c.kv_usage))
        return w.prefix * prefix + w.kv * kv + w.queue * queue + w.lora * adapter_affinity(c)

    best = max(able, key=lambda c: (score(c), _tie_break(first_block, c.name), c.name))
    return best.name


def pick_round_robin(
    candidates: Sequence[Candidate], turn: int, config: PickerConfig = PickerConfig()
) -> str | None:
    """The baseline: the `turn`-th endpoint (by name) of those that can take a request, as a
    per-request round-robin balancer would; the limits filter applies the same way."""
    able = sorted((c for c in candidates if can_take(c, config)), key=lambda c: c.name)
    return able[turn % len(able)].name if able else None
