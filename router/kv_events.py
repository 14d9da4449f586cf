"""Subscribing to the workers' KV events (issue 31): one task per endpoint keeps its entry of the
precise index (kv_index.py) equal to the worker's prefix cache.

Per endpoint: a SUB socket on the worker's event stream and a DEALER on its replay socket
(worker/engine/kv_event_publisher.py has the wire format, vLLM's). The stream's batches are
numbered; the index applies them in order:

- on start (a new endpoint, a router that restarted), it asks the replay for everything from 0:
  the whole history while the worker's buffer still has it, else a snapshot of its index;
- a gap in the numbers (a batch the network or a high-water mark dropped) asks for what is missing
  the same way; until the answer arrives the endpoint is unsynced (the approximate index scores it),
  and a resync that fails is asked again from 0 after 2 s, doubling to 60 s;
- numbers that go backwards mean a new publisher (the worker restarted): start over from 0.

The same stream carries the worker's load when it publishes one (`load_topic`, kvscale's: two
frames, common/kv_events.py `WorkerLoad`): handed to `on_load` as it comes (RouterState.update_load),
and withdrawn (None) when the connection drops, so a stale one is never believed.

Budgets, the worker being a network peer: a message is at most `max_message_bytes` (ZMQ refuses
larger ones: a snapshot of a 500k-block index is ~50 MB); a replay must answer each message within
`replay_timeout_s` or the endpoint stays unsynced and is asked again after the backoff; a batch
that does not decode desyncs the endpoint and asks for a resync (counted). Decoding runs on the event
loop: a step's batch is a few hundred bytes; a snapshot, tens of milliseconds once per resync.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from kvscale.common.kv_events import AllBlocksCleared, KVEventBatch, WorkerLoad
from kvscale.router.kv_index import KVBlockIndex

logger = logging.getLogger(__name__)

END_OF_REPLAY = -1


@dataclass(frozen=True)
class KVEventsSource:
    """Where an endpoint's worker publishes: the same host, these ports (the worker's
    `--kv-events-config` endpoint and replay_endpoint)."""

    port: int = 5557
    replay_port: int = 5558
    max_message_bytes: int = 64 << 20
    replay_timeout_s: float = 5.0
    retry_s: float = 2.0  # the first wait after a failed resync, doubling up to max_retry_s
    max_retry_s: float = 60.0

    def addresses(self, endpoint_url: str) -> tuple[str, str]:
        host = urlsplit(endpoint_url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        return f"tcp://{host}:{self.port}", f"tcp://{host}:{self.replay_port}"


class EndpointSubscriber:
    """One endpoint's subscription; `run()` until cancelled."""

    def __init__(
        self,
        endpoint: str,
        index: KVBlockIndex,
        source: KVEventsSource,
        context: zmq.asyncio.Context,
        on_event: Callable[[str, str], None] = lambda endpoint, what: None,
        on_load: Callable[[str, int | None], None] = lambda endpoint, tokens: None,
    ) -> None:
        self.endpoint, self.index, self.source = endpoint, index, source
        self.context = context
        # (endpoint, what): "batch", "gap", "resync", "synced", "restart", "bad", "timeout",
        # "disconnect" or "load".
        self.on_event = on_event
        self.on_load = on_load  # (endpoint, its prefill tokens ahead; None: not known any more)
        self._load_decoder = msgspec.msgpack.Decoder(WorkerLoad)
        self.pub, self.replay = source.addresses(endpoint)
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._last_stream_seq: int | None = None
        self._next_resync = 0.0
        self._backoff = source.retry_s

    async def run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self.source.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        # A message over MAXMSGSIZE makes ZMQ drop the connection (and reconnect) without a word
        # to the socket's reader: the monitor says so, and what the worker sent since is unknown.
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        loop = asyncio.get_running_loop()
        try:
            sub.connect(self.pub)
            while True:
                # Unsynced (never yet, or a resync that failed): ask again once the backoff is
                # over, whether or not the worker publishes meanwhile (an idle one does not).
                if not self.index.state(self.endpoint).synced and loop.time() >= self._next_resync:
                    await self._resync(0)
                ready = dict(await poller.poll(self.source.retry_s * 1000))
                if monitor in ready:
                    await monitor.recv_multipart()
                    self._on_disconnect()
                if sub in ready:
                    await self._on_stream(await sub.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _on_disconnect(self) -> None:
        """The stream's connection dropped (an oversize message, or the worker went): batches may
        be lost with no later one to show the gap, so the set is not believed until a resync."""
        self.on_event(self.endpoint, "disconnect")
        self.on_load(self.endpoint, None)
        if self.index.synced(self.endpoint):
            self.index.desync(self.endpoint)
            self._next_resync = 0.0  # at once: the worker may well be fine

    async def _on_stream(self, frames: list[bytes]) -> None:
        if len(frames) == 2:
            self._on_load(frames[1])
            return
        if len(frames) != 3 or len(frames[1]) != 8:
            self.on_event(self.endpoint, "bad")
            return
        seq = int.from_bytes(frames[1], "big")
        if self._last_stream_seq is not None and seq < self._last_stream_seq:
            self.on_event(self.endpoint, "restart")  # a new publisher: its numbers start again
            self._last_stream_seq = seq
            await self._resync(0)
            return
        self._last_stream_seq = seq
        state = self.index.state(self.endpoint)
        if not state.synced:
            return  # run() resyncs from 0 when the backoff allows
        if seq <= state.seq:
            return  # a replay brought it already
        if seq > state.seq + 1:
            self.on_event(self.endpoint, "gap")
            await self._resync(state.seq + 1)
            if not self.index.synced(self.endpoint) or seq <= self.index.state(self.endpoint).seq:
                return
        self._apply(seq, self._decode(frames[2]))

    def _on_load(self, payload: bytes) -> None:
        try:
            load = self._load_decoder.decode(payload)
        except msgspec.DecodeError:
            load = None
        if load is None or load.prefill_tokens < 0:
            self.on_event(self.endpoint, "bad")
            return
        self.on_event(self.endpoint, "load")
        self.on_load(self.endpoint, load.prefill_tokens)

    def _decode(self, payload: bytes) -> KVEventBatch | None:
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError:
            self.on_event(self.endpoint, "bad")
            return None

    def _apply(self, seq: int, batch: KVEventBatch | None) -> None:
        if batch is None:
            self.index.desync(self.endpoint)
            return
        self.index.apply(self.endpoint, seq, batch)
        self.on_event(self.endpoint, "batch")

    async def _resync(self, start: int) -> bool:
        """Ask the replay for the batches from `start` and apply them; True when the endpoint's set
        is exact after it: it was exact as of start - 1 (or start is 0) and the replay continued it
        without a hole, or the replay sent a snapshot. A fresh DEALER per resync: a late answer to
        an abandoned one can never be read as this one's."""
        self.on_event(self.endpoint, "resync")
        state = self.index.state(self.endpoint)
        if start == 0:
            state.blocks, state.seq, state.overflow = set(), -1, False
        exact = start == 0 or state.synced
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.source.max_message_bytes)
        try:
            dealer.connect(self.replay)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(self.source.replay_timeout_s * 1000):
                    self.on_event(self.endpoint, "timeout")
                    exact = False
                    break
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.on_event(self.endpoint, "bad")
                    exact = False
                    continue
                number = int.from_bytes(frames[1], "big", signed=True)
                if number == END_OF_REPLAY:
                    break
                batch = self._decode(frames[2])
                state = self.index.state(self.endpoint)
                if batch is not None and batch.events and isinstance(batch.events[0], AllBlocksCleared):
                    exact = True  # a snapshot: the set starts again from it
                elif number <= state.seq:
                    continue
                elif number != state.seq + 1 or batch is None:
                    exact = False  # a hole the replay could not fill (a worker without snapshots)
                self._apply(number, batch)
        finally:
            dealer.close(linger=0)
        exact = exact and not self.index.state(self.endpoint).overflow  # over budget: not believed
        self.index.state(self.endpoint).synced = exact
        if exact:
            self.on_event(self.endpoint, "synced")
            self._backoff = self.source.retry_s
        else:
            # Doubling up to max_retry_s: a worker that can never be synced (a vLLM one whose buffer
            # rolled) is asked for its whole buffer once a minute, not every 2 s.
            self._next_resync = asyncio.get_running_loop().time() + self._backoff
            self._backoff = min(self._backoff * 2, self.source.max_retry_s)
        return exact


class KVEventSubscriptions:
    """A subscriber per endpoint of the ready set (the router's set_endpoints keeps it in step)."""

    def __init__(
        self,
        index: KVBlockIndex,
        source: KVEventsSource,
        on_event: Callable[[str, str], None] = lambda endpoint, what: None,
        on_load: Callable[[str, int | None], None] = lambda endpoint, tokens: None,
    ) -> None:
        self.index, self.source, self.on_event, self.on_load = index, source, on_event, on_load
        self._context = zmq.asyncio.Context()
        self._context.setsockopt(zmq.IPV6, 1)  # a worker's address may be IPv6
        self._tasks: dict[str, asyncio.Task] = {}

    def set_endpoints(self, endpoints: set[str]) -> None:
        for gone in set(self._tasks) - endpoints:
            self._tasks.pop(gone).cancel()
            self.index.remove(gone)
        for new in endpoints - set(self._tasks):
            sub = EndpointSubscriber(new, self.index, self.source, self._context, self.on_event, self.on_load)
            self._tasks[new] = asyncio.create_task(sub.run(), name=f"kv-events {new}")

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        self._context.destroy(linger=0)
