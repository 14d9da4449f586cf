"""KV-cache events in vLLM's format (issue 31): the wire schema the workers publish
(worker/engine/kv_event_publisher.py) and the routers read (router/kv_events.py), vLLM's own
(`vllm/distributed/kv_events.py`), so that a reader of vLLM's events (llm-d's KV-cache indexer)
reads ours unchanged: msgspec structs, array-like and tagged, so a batch is the msgpack array
`[ts, [event, ...], data_parallel_rank]` and an event `[tag, field, ...]`. What each field means:
worker/core/kv_events.py and docs/router.md.
"""

from __future__ import annotations

import msgspec

# vLLM's ExternalBlockHash is bytes | int; ours are always 32-byte digests.
BlockHash = bytes


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (tagged with the class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class WorkerLoad(msgspec.Struct, array_like=True, gc=False, tag=True):
    """kvscale's own message on the same stream, under a topic of its own (`load_topic`, off unless
    set): the worker's prefill work ahead, sent as it changes (a step launched, a step done), so a
    router replica sees another's cold prompt within a step instead of a scrape later. Two frames,
    `[topic, msgpack ["WorkerLoad", ts, prefill_tokens]]`: a KV-event reader (three frames) that
    subscribes to every topic can tell it apart by its frame count."""

    ts: float
    # Prompt tokens of its requests (every client's) whose prefill is not done: waiting, or in a
    # step not finished yet.
    prefill_tokens: int
