"""KV events in vLLM's format (issue 31's worker side; core/kv_events.py, engine/kv_event_publisher.py):
the wire schema as vLLM's readers decode it, a real engine's stores and evictions read by a real ZMQ
subscriber (the hashes are the block pool's own), replay of what a late subscriber missed, and the
publisher's budgets: garbage on the replay socket, a queue that is full, a config that is wrong."""

from __future__ import annotations

import json
import threading
import time

import msgspec
import pytest
import zmq

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.core.kv_events import BlockRemoved, BlockStored, KVEventBatch, KVEventRecorder
from kvscale.worker.engine.kv_event_publisher import END_OF_REPLAY, KVEventsConfig, ZmqEventPublisher

TOPIC = "kv-events"
CONFIG = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:*",
    "replay_endpoint": "tcp://127.0.0.1:*",
    "topic": TOPIC,
}


def test_the_wire_schema_is_vllms():
    """A batch is msgpack `[ts, [[tag, fields...], ...], data_parallel_rank]` (msgspec array-like
    tagged structs, as vllm/distributed/kv_events.py), decoded here without our types, as a foreign
    reader would."""
    recorder = KVEventRecorder(block_size=4, medium="CPU")
    h1, h2, h3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    recorder.stored([h1, h2], None, [5, 6, 7, 8, 9, 10, 11, 12], lora_id=None)
    recorder.removed(h3)
    recorder.removed(h1)  # consecutive removals share one event
    recorder.stored([h3], h2, [1, 2, 3, 4], lora_id=7)
    batch = KVEventBatch(1.5, recorder.take())
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert raw == [
        1.5,
        [
            ["BlockStored", [h1, h2], None, [5, 6, 7, 8, 9, 10, 11, 12], 4, None, "CPU"],
            ["BlockRemoved", [h3, h1], "CPU"],
            ["BlockStored", [h3], h2, [1, 2, 3, 4], 4, 7, "CPU"],
        ],
        None,  # no data parallelism
    ]
    assert recorder.take() == []


class Subscriber:
    """A reader as vLLM's example subscriber: SUB on the topic, DEALER for replays."""

    def __init__(self, publisher: ZmqEventPublisher) -> None:
        pub, replay = publisher.endpoints
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(pub)
        self.replay = self.context.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        time.sleep(0.3)  # PUB/SUB: a subscription takes a moment to reach the publisher

    def receive(self, timeout_s: float = 2.0) -> list[tuple[int, KVEventBatch]]:
        out = []
        while self.sub.poll(int(timeout_s * 1000)):
            topic, number, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode()
            out.append((int.from_bytes(number, "big"), self.decoder.decode(payload)))
            timeout_s = 0.3
        return out

    def ask_replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while self.replay.poll(2000):
            _, number, payload = self.replay.recv_multipart()
            if number == END_OF_REPLAY:
                assert payload == b""
                return out
            out.append((int.from_bytes(number, "big"), self.decoder.decode(payload)))
        raise AssertionError("no end of replay")

    def close(self) -> None:
        self.context.destroy(linger=0)


@pytest.fixture
def engine(target_model):
    llm = LLM(target_model, device="cpu", num_kv_blocks=24, block_size=8, kv_events_config=json.dumps(CONFIG))
    yield llm
    llm.engine.shutdown()


def events_of(batches, kind):
    return [e for _, b in batches for e in b.events if isinstance(e, kind)]


def test_stores_and_evictions_reach_a_subscriber_with_the_pools_hashes(engine):
    """Five prompts of 48 tokens on a pool of 24 blocks of 8: each prompt's blocks are stored (the
    pool's own hashes, their tokens, chained by parent), and the later prompts evict the earlier
    ones' blocks, each eviction announced once the block left the pool's index."""
    publisher = engine.engine.kv_events
    sub = Subscriber(publisher)
    pool = engine.engine.kv_cache_manager.block_pool
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[0, *range(100 * i + 3, 100 * i + 50)] for i in range(5)]
    first = engine.generate(prompts[:1], params)
    batches = sub.receive()
    stored = events_of(batches, BlockStored)
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == 6  # 48 prompt tokens; the 4 outputs fill no block
    assert all(pool.get_indexed_block(h) is not None for h in hashes)
    assert stored[0].parent_block_hash is None and stored[0].block_size == 8
    assert [t for e in stored for t in e.token_ids] == prompts[0][:48]
    for e in stored[1:]:  # a later run chains onto the one before
        assert e.parent_block_hash == hashes[hashes.index(e.block_hashes[0]) - 1]
    assert first[0].outputs[0].token_ids

    engine.generate(prompts[1:], params)
    batches += sub.receive()
    numbers = [n for n, _ in batches]
    assert numbers == list(range(len(numbers)))  # no gap, from 0
    removed = [h for e in events_of(batches, BlockRemoved) for h in e.block_hashes]
    all_stored = [h for e in events_of(batches, BlockStored) for h in e.block_hashes]
    assert removed, "24 blocks cannot hold 5 prompts of 6 blocks: some were evicted"
    assert set(removed) <= set(all_stored)
    assert all(pool.get_indexed_block(h) is None for h in removed if all_stored.count(h) == removed.count(h))
    indexed = {h for h in all_stored if pool.get_indexed_block(h) is not None}
    assert len(indexed) == pool.num_indexed_blocks  # the subscriber's view is the pool's index

    # A subscriber that missed everything asks from 0 and gets the same batches, in order.
    late = Subscriber(publisher)
    assert [(n, msgspec.msgpack.encode(b)) for n, b in late.ask_replay(0)] == [
        (n, msgspec.msgpack.encode(b)) for n, b in batches
    ]
    assert [n for n, _ in late.ask_replay(len(batches) - 2)] == [len(batches) - 2, len(batches) - 1]
    stats = engine.engine.take_stats()
    assert stats.kv_events_published == len(batches) and stats.kv_events_dropped == 0
    sub.close()
    late.close()


def test_the_replay_socket_ignores_garbage_and_keeps_answering(engine):
    publisher = engine.engine.kv_events
    sub = Subscriber(publisher)
    engine.generate([[0, *range(10, 30)]], SamplingParams(max_tokens=2))
    assert sub.receive()
    for frames in ([b"", b"abc"], [b"", b"x" * 9], [b"z"] * 50, [b"", b"\x00" * 8 * 1000]):
        sub.replay.send_multipart(frames)
    assert not sub.replay.poll(300)  # nothing answers garbage
    assert [n for n, _ in sub.ask_replay(0)] == list(range(publisher.published))
    sub.close()


def test_a_full_queue_drops_and_counts_and_never_blocks(monkeypatch):
    """The sending thread stalled (a starved or wedged publisher), a queue of 2: the engine's
    publish() returns at once however much it sends, and the excess is counted; close() does not
    wait for the stalled thread past its bound."""
    stall = threading.Event()
    monkeypatch.setattr(ZmqEventPublisher, "_run", lambda self: stall.wait())
    config = KVEventsConfig.parse(json.dumps({**CONFIG, "max_queue_size": 2, "replay_endpoint": None}))
    publisher = ZmqEventPublisher(config)
    started = time.perf_counter()
    for _ in range(1000):
        publisher.publish([BlockRemoved([b"\x00" * 32], "CPU")])
    assert time.perf_counter() - started < 0.5
    assert publisher.dropped == 998
    stall.set()
    publisher.close()


@pytest.mark.parametrize(
    "text,message",
    [
        ("[1]", "JSON object"),
        ("{nope", "not JSON"),
        ('{"enable_kv_cache_events": true, "bogus": 1}', "unknown keys"),
        ('{"publisher": "kafka"}', "publisher must be zmq or null"),
        ('{"buffer_steps": 0}', "buffer_steps must be a positive integer"),
        ('{"hwm": "many"}', "hwm must be a positive integer"),
    ],
)
def test_a_bad_config_is_refused_clearly(text, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(text)


def test_off_by_default_and_with_the_null_publisher(target_model):
    for config in (None, json.dumps({"enable_kv_cache_events": True, "publisher": "null"})):
        llm = LLM(target_model, device="cpu", num_kv_blocks=24, block_size=8, kv_events_config=config)
        assert llm.engine.kv_events is None and llm.engine.kv_cache_manager.events is None
