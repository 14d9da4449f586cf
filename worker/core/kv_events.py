"""KV-cache events in vLLM's format (issue 31): what the prefix-cache index gained and lost, so that
a router can keep an exact index of every worker's cache instead of guessing.

The types and their encoding are vLLM's (`vllm/distributed/kv_events.py`), so that a reader of
vLLM's events (llm-d's KV-cache indexer) reads ours unchanged: msgspec structs, array-like and
tagged, so a batch is the msgpack array `[ts, [event, ...], data_parallel_rank]` and an event
`[tag, field, ...]`:

- `BlockStored`: consecutive blocks one request put into the index in a step: their hashes (our
  32-byte SHA-256 chain, block_pool.py), the hash of the block before the first (None for a chain's
  first block, as vLLM), their token ids (block_size each, in order: what lets a reader recompute
  its own keys), the block size, the adapter's `lora_int_id` (None: the base model), the medium.
- `BlockRemoved`: hashes that left the index (evicted for a new allocation, dropped by a prefix
  cache reset, or taken back after a failed step whose KV was never written).
- `AllBlocksCleared`: the whole index dropped at once (not emitted today: a reset removes only the
  blocks no request holds, so it sends their BlockRemoved).

The structs live in common/kv_events.py (the routers read them too); `KVEventRecorder` collects
one step's events (no I/O); the engine hands them to the publisher
(engine/kv_event_publisher.py) after the step.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvscale.common.kv_events import (  # noqa: F401 (the schema, re-exported)
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    WorkerLoad,
)


class KVEventRecorder:
    """A step's events, in the order they happened; consecutive removals share one BlockRemoved."""

    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size = block_size
        self.medium = medium
        self._events: list[KVCacheEvent] = []

    def stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        lora_id: int | None,
    ) -> None:
        if block_hashes:
            self._events.append(
                BlockStored(
                    list(block_hashes), parent, list(token_ids), self.block_size, lora_id, self.medium
                )
            )

    def removed(self, block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash], self.medium))

    def take(self) -> list[KVCacheEvent]:
        taken, self._events = self._events, []
        return taken
