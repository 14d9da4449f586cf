"""Publishing KV events (core/kv_events.py) over ZeroMQ as vLLM does (`--kv-events-config`,
vLLM's keys), so that routers (ours, llm-d's indexer) subscribe to workers unchanged.

Wire format (vLLM's ZmqEventPublisher):
- a PUB socket bound at `endpoint` sends each step's batch as three frames: the topic, the batch's
  sequence number (8 bytes, big-endian, from 0, +1 per batch) and the msgpack batch;
- a ROUTER socket bound at `replay_endpoint` answers a request whose last frame is a start
  sequence number (8 bytes, big-endian) with one `[seq, batch]` message per buffered batch from
  that number on (the last `buffer_steps` batches), then `[-1 (8 bytes, signed), b""]`: a
  subscriber that sees a gap in the numbers asks for what it missed. Ours goes one step further
  where vLLM's cannot help: a start older than the buffer (a router that restarted, or fell
  further behind than `buffer_steps`) gets a snapshot instead, one batch numbered with the last
  sequence sent: `AllBlocksCleared`, then a `BlockStored` for every block in the index at that
  number (kept by this thread from the batches it sent, so it is exact at that number). Any
  reader of vLLM's events understands it: it is made of vLLM's own events.

Load (kvscale's, off unless `load_topic` is set): the worker's prefill work ahead
(common/kv_events.py `WorkerLoad`), as two frames `[load_topic, payload]` on the same PUB socket,
unnumbered and never replayed (only the latest matters), each time it changes. The router's prefill
guard reads it: a scrape is up to its interval old, a cold prompt's prefill a few hundred ms.

Budgets: the engine thread never waits on the network. It hands each batch to a queue of at most
`max_queue_size` batches (a full queue drops the batch and counts it: the subscribers see the gap
and the replay cannot fill it, so they resync); one thread here encodes and sends. A subscriber
that reads slowly loses messages at the PUB socket's high-water mark (`hwm`), as with vLLM, and
finds the gap. A replay request that is not one 8-byte number is ignored; the replies to one
request are at most the buffer.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields

import msgspec
import zmq

from kvscale.worker.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    WorkerLoad,
)

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig keys and defaults (its topic default is empty: every topic)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    load_topic: str | None = None  # kvscale's: publish WorkerLoad under this topic (None: not)

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """From `--kv-events-config`'s JSON; unknown keys and bad values are refused (ValueError)."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown} (known: {sorted(known)})")
        config = cls(**raw)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be zmq or null, got {config.publisher!r}")
        # ZMQ topics match by prefix: a load topic that starts with the KV topic would reach the
        # KV topic's subscribers, who read three frames. (An empty KV topic reaches everyone.)
        if config.load_topic is not None and (
            not isinstance(config.load_topic, str)
            or not config.load_topic
            or (config.topic and config.load_topic.startswith(config.topic))
        ):
            raise ValueError(
                "--kv-events-config: load_topic must be a non-empty string, not topic or one starting with it"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(config, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--kv-events-config: {name} must be a positive integer, got {value!r}")
        return config

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.config = config
        self.rank = data_parallel_rank
        self.queued = 0  # batches handed to the sending thread (the engine thread's count)
        self.dropped = 0  # batches the full queue refused (the engine thread's count)
        self.published = 0  # batches sent (the sending thread's count)
        self._last_load: int | None = None  # the engine thread's: the last load queued
        self._queue: queue.Queue[KVEventBatch | WorkerLoad] = queue.Queue(maxsize=config.max_queue_size)
        self._stop = threading.Event()
        self._context = zmq.Context()
        # Bound here, in the caller's thread, so that a bad or busy endpoint fails the start.
        # IPV6 on both sockets: `tcp://*:port` then binds dual-stack, so that routers reach a pod
        # on an IPv6 cluster as on an IPv4 one.
        self._context.setsockopt(zmq.IPV6, 1)
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._index = IndexMirror()  # the sending thread's: what a snapshot is made of
        self._thread = threading.Thread(target=self._run, name="kvscale-kv-events", daemon=True)
        self._thread.start()

    @property
    def endpoints(self) -> tuple[str, str | None]:
        """The bound addresses (a `tcp://*:0` endpoint's port is the one the system picked)."""
        replay = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT), replay

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queue one step's events (the engine thread: never blocks)."""
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), list(events), self.rank))
            self.queued += 1
        except queue.Full:
            self.dropped += 1

    def publish_load(self, prefill_tokens: int) -> None:
        """Queue the worker's load if it changed (the engine thread: never blocks; a full queue
        drops it and the next change says it again)."""
        if self.config.load_topic is None or prefill_tokens == self._last_load:
            return
        try:
            self._queue.put_nowait(WorkerLoad(time.time(), prefill_tokens))
            self._last_load = prefill_tokens
        except queue.Full:
            pass

    def close(self) -> None:
        """Send what is queued (for up to 5 s), then close the sockets."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        load_topic = (self.config.load_topic or "").encode()
        seq = 0
        while True:
            try:
                batch = self._queue.get(timeout=0.01)
            except queue.Empty:
                if self._stop.is_set():
                    return
                batch = None
            try:
                if isinstance(batch, WorkerLoad):
                    self._pub.send_multipart((load_topic, encoder.encode(batch)), copy=False)
                elif batch is not None:
                    payload = encoder.encode(batch)
                    number = seq.to_bytes(8, "big")
                    self._pub.send_multipart((topic, number, payload), copy=False)
                    self._buffer.append((seq, payload))
                    if self._replay is not None:
                        self._index.apply(batch.events)
                    seq += 1
                    self.published += 1
                if self._replay is not None:
                    self._serve_replays()
            except zmq.ZMQError as e:  # the context went away (close), or a socket failed
                if e.errno == zmq.ETERM:
                    return
                logger.warning("KV events: %s", e)

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) < 2 or len(frames[-1]) != 8:
                continue  # not a replay request: nothing to answer
            client, start = frames[0], int.from_bytes(frames[-1], "big")
            sent = list(self._buffer)
            if sent and start < sent[0][0]:  # older than the buffer: the index as of the last batch
                last = sent[-1][0]
                snapshot = KVEventBatch(time.time(), self._index.snapshot(), self.rank)
                payload = msgspec.msgpack.encode(snapshot)
                self._replay.send_multipart((client, b"", last.to_bytes(8, "big"), payload))
                sent = []
            for number, payload in sent:
                if number >= start:
                    self._replay.send_multipart((client, b"", number.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))


class IndexMirror:
    """The worker's prefix-cache index as the published events tell it: block hash -> (parent hash,
    token ids, block size, adapter, medium), in the order the blocks were stored. About 200 bytes a
    block (a worker's pool is thousands to a few hundred thousand blocks)."""

    def __init__(self) -> None:
        self._blocks: dict[bytes, tuple[bytes | None, list[int], int, int | None, str | None]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, events: Sequence[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                parent, size = event.parent_block_hash, event.block_size
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * size : (i + 1) * size]
                    self._blocks[block_hash] = (parent, tokens, size, event.lora_id, event.medium)
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._blocks.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                self._blocks.clear()

    def snapshot(self) -> list[KVCacheEvent]:
        """AllBlocksCleared, then one BlockStored per block, parents before their children where the
        store order had them so."""
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        for block_hash, (parent, tokens, size, lora_id, medium) in self._blocks.items():
            events.append(BlockStored([block_hash], parent, tokens, size, lora_id, medium))
        return events
