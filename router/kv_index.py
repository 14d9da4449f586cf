"""The precise prefix index (issue 31): per endpoint, the exact set of block hashes its worker's
prefix cache holds, as its KV events say (kv_events.py subscribes; this file has no I/O).

The hashes are the worker's own (common/block_hash.py, the block pool's: SHA-256 chained from the cache salt's
root over each block's token ids), so a request the router has token ids for matches them
directly: no key of the router's own, no mapping. A request for a LoRA adapter is not matched
here (its chain starts from the adapter's weight digest, which the events do not carry): it is
scored by the approximate index, as is any request to an endpoint whose index is not `synced`
(never received, or a gap the replay could not fill yet).

In flight: a request sent to an endpoint has its blocks stored there only once its prefill step
ran, and the event reaches the router later still. Meanwhile the same prefix arriving again would
find nothing anywhere and could be sent to another worker, to be prefilled twice. So the router
adds a request's hashes to its endpoint's `pending` blocks when it sends it and takes them back
when the request ends (by then the worker's own events say whether they stayed); a match counts
both. A router replica knows only its own pending blocks: the events make replicas agree again
within a prefill.

Budget: an endpoint's set holds at most `max_blocks` hashes (a worker's pool is thousands to a
few hundred thousand blocks); a worker that claims more is not believed (unsynced until its next
resync) rather than allowed to grow the router's memory without bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvscale.common.block_hash import hash_block_tokens, root_hash
from kvscale.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

DEFAULT_MAX_BLOCKS = 4_000_000  # ~200 MB of hashes at most, per endpoint


@dataclass
class EndpointBlocks:
    blocks: set[bytes] = field(default_factory=set)
    pending: dict[bytes, int] = field(default_factory=dict)  # hash -> requests in flight with it
    block_size: int = 0  # from its BlockStored events (0: none seen yet)
    seq: int = -1  # the last batch applied
    synced: bool = False  # the set is the worker's index as of `seq`
    overflow: bool = False  # it claimed more than max_blocks since its last reset: not believed


@dataclass(frozen=True)
class TokenPrompt:
    """What a precise match reads of a request: its prompt's token ids and cache salt."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    # Computed once per (block size, max blocks, adapter digest): a pick scores, then records, the
    # same hashes.
    _hashes: dict[tuple[int, int, str | None], list[bytes]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def block_hashes(
        self, block_size: int, max_blocks: int, adapter_digest: str | None = None
    ) -> list[bytes]:
        """The worker's hashes of the prompt's full leading blocks (at most max_blocks), for the base
        model or the LoRA adapter of that content digest: the worker matches at most
        (len - 1) // block_size of them, one token is always computed."""
        key = (block_size, max_blocks, adapter_digest)
        if key not in self._hashes:
            n = min((len(self.token_ids) - 1) // block_size if self.token_ids else 0, max_blocks)
            parent, out = root_hash(self.cache_salt, adapter_digest), []
            for i in range(n):
                parent = hash_block_tokens(parent, self.token_ids[i * block_size : (i + 1) * block_size])
                out.append(parent)
            self._hashes[key] = out
        return self._hashes[key]


class KVBlockIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._endpoints: dict[str, EndpointBlocks] = {}

    def state(self, endpoint: str) -> EndpointBlocks:
        return self._endpoints.setdefault(endpoint, EndpointBlocks())

    def remove(self, endpoint: str) -> None:
        self._endpoints.pop(endpoint, None)

    def synced(self, endpoint: str) -> bool:
        s = self._endpoints.get(endpoint)
        return s is not None and s.synced and s.block_size > 0

    def size(self, endpoint: str) -> int:
        s = self._endpoints.get(endpoint)
        return len(s.blocks) if s is not None else 0

    def desync(self, endpoint: str) -> None:
        """Its set may be wrong now (a gap, a bad message): unused until a resync."""
        self.state(endpoint).synced = False

    def apply(self, endpoint: str, seq: int, batch: KVEventBatch) -> None:
        """Batch `seq` of the endpoint's stream. A batch that starts with AllBlocksCleared (a
        snapshot, or the worker's own reset) makes the set exact again: synced from here on."""
        s = self.state(endpoint)
        for event in batch.events:
            if isinstance(event, BlockStored):
                s.blocks.update(event.block_hashes)
                s.block_size = event.block_size
            elif isinstance(event, BlockRemoved):
                s.blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                s.blocks = set()
                s.synced, s.overflow = True, False
        s.seq = seq
        if len(s.blocks) > self.max_blocks:
            s.blocks, s.synced, s.overflow = set(), False, True

    def match_length(self, endpoint: str, hashes: Sequence[bytes]) -> int:
        """How many leading hashes the endpoint's worker holds (chained: the first miss ends it)."""
        s = self._endpoints.get(endpoint)
        if s is None:
            return 0
        n = 0
        for h in hashes:
            if h not in s.blocks and h not in s.pending:
                break
            n += 1
        return n

    def add_pending(self, endpoint: str, hashes: Sequence[bytes]) -> None:
        """A request with these block hashes was sent to the endpoint."""
        pending = self.state(endpoint).pending
        for h in hashes:
            pending[h] = pending.get(h, 0) + 1

    def drop_pending(self, endpoint: str, hashes: Sequence[bytes]) -> None:
        """That request ended (once per add_pending)."""
        s = self._endpoints.get(endpoint)
        if s is None:
            return
        for h in hashes:
            left = s.pending.get(h, 0) - 1
            if left > 0:
                s.pending[h] = left
            else:
                s.pending.pop(h, None)

    def block_size(self, endpoints: Sequence[str]) -> int:
        """The block size of the synced endpoints (a pool's workers share one; 0: none synced)."""
        sizes = {self._endpoints[e].block_size for e in endpoints if self.synced(e)}
        return max(sizes) if sizes else 0
