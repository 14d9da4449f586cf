"""The router's KV-event subscriber against a hostile or broken worker (router/kv_events.py's
budgets): a hand-driven publisher on real ZMQ sockets sends frames of the wrong shape, payloads
that do not decode, a message over the size cap, a stream claiming more blocks than the index
believes, and a replay socket that never answers. Each leaves the endpoint unsynced (scored by the
approximate index), is counted, and the subscriber keeps running and syncs again once the worker
behaves."""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from kvscale.common.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from kvscale.router.kv_events import EndpointSubscriber, KVEventsSource
from kvscale.router.kv_index import KVBlockIndex

WORKER = "http://127.0.0.1:1"
END = (-1).to_bytes(8, "big", signed=True)


def batch(*events) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(0.0, list(events)))


def stored(n: int, first: int = 0) -> BlockStored:
    return BlockStored(
        [i.to_bytes(32, "big") for i in range(first, first + n)], None, [1] * 8 * n, 8, None, None
    )


class HostilePublisher:
    """A worker's two sockets, driven by the test: what the replay answers is set per request."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.pub = context.socket(zmq.PUB)
        self.replay = context.socket(zmq.ROUTER)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.answer: list[tuple[int, bytes]] | None = []  # None: never answer
        self.requests = 0
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            frames = await self.replay.recv_multipart()
            self.requests += 1
            if self.answer is None:
                continue
            client = frames[0]
            for number, payload in self.answer:
                await self.replay.send_multipart([client, b"", number.to_bytes(8, "big"), payload])
            await self.replay.send_multipart([client, b"", END, b""])

    async def send(self, *frames: bytes) -> None:
        await self.pub.send_multipart(list(frames))

    def close(self) -> None:
        self._task.cancel()


async def until(check, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def _hostile() -> None:
    context = zmq.asyncio.Context()
    worker = HostilePublisher(context)
    seen: list[str] = []
    index = KVBlockIndex(max_blocks=50)
    source = KVEventsSource(
        worker.pub_port, worker.replay_port, max_message_bytes=4096, replay_timeout_s=0.3, retry_s=0.1
    )
    sub = EndpointSubscriber(WORKER, index, source, context, on_event=lambda e, what: seen.append(what))
    # First the replay never answers: unsynced after its timeout, asked again, and the task lives.
    worker.answer = None
    task = asyncio.create_task(sub.run())
    await until(lambda: seen.count("timeout") >= 1)
    assert not index.synced(WORKER) and not task.done()
    # It answers with a snapshot: synced.
    worker.answer = [(0, batch(AllBlocksCleared(), stored(3)))]
    await until(lambda: index.synced(WORKER))
    await asyncio.sleep(0.2)  # the SUB connection is up by now
    await worker.send(b"", (1).to_bytes(8, "big"), batch(stored(2, first=10)))
    await until(lambda: index.state(WORKER).seq == 1)
    assert index.size(WORKER) == 5

    # Frames of the wrong shape: counted, ignored, still synced.
    await worker.send(b"only", b"two")
    await worker.send(b"", b"short", b"x")
    await until(lambda: seen.count("bad") >= 2)
    assert index.synced(WORKER)
    # A payload that does not decode: unsynced at once (the set may be wrong), then resynced.
    worker.answer = [(2, batch(AllBlocksCleared(), stored(5)))]
    await worker.send(b"", (2).to_bytes(8, "big"), b"\xc1 not msgpack")
    await until(lambda: seen.count("bad") >= 3)
    await worker.send(b"", (3).to_bytes(8, "big"), batch())
    await until(lambda: index.synced(WORKER) and index.size(WORKER) == 5 and index.state(WORKER).seq == 3)

    # More blocks than the index believes of one endpoint: dropped and unsynced, not kept.
    worker.answer = [(9, batch(AllBlocksCleared(), stored(60, first=1000)))]
    await worker.send(b"", (9).to_bytes(8, "big"), batch())  # a gap: 4..8 are asked for
    await until(lambda: index.state(WORKER).seq >= 9)
    await until(lambda: seen.count("resync") >= 4)
    assert not index.synced(WORKER) and index.size(WORKER) == 0 and not task.done()

    # A snapshot over the message cap never arrives (ZMQ drops it): the replay "times out", the
    # endpoint stays unsynced and is asked again (backing off) until an answer fits.
    worker.answer = [(10, batch(AllBlocksCleared(), stored(40, first=2000)) + b"\0" * 8192)]
    timeouts = seen.count("timeout")
    await until(lambda: seen.count("timeout") > timeouts)
    assert not index.synced(WORKER) and not task.done()
    worker.answer = [(10, batch(AllBlocksCleared(), stored(4, first=3000)))]
    await until(lambda: index.synced(WORKER) and index.size(WORKER) == 4, timeout=15)

    # A stream message over the cap: ZMQ drops the SUB connection without a word to its reader,
    # and an idle worker sends nothing after it that would show the gap. The socket monitor
    # unsyncs the endpoint at once, and it is resynced.
    resyncs = seen.count("resync")
    worker.answer = [(11, batch(AllBlocksCleared(), stored(2, first=4000)))]
    await worker.send(b"", (11).to_bytes(8, "big"), batch(stored(3, first=5000)) + b"\0" * 8192)
    await until(lambda: "disconnect" in seen)
    await until(lambda: seen.count("resync") > resyncs)
    await until(lambda: index.synced(WORKER) and index.size(WORKER) == 2)
    assert not task.done()

    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    worker.close()
    context.destroy(linger=0)


def test_a_hostile_worker_unsyncs_its_endpoint_and_never_stops_the_subscriber():
    asyncio.run(_hostile())
