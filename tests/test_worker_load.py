"""The worker's load on its KV-event stream (kvscale's `load_topic`; issue 31's prefill guard): a
real engine says its prefill work ahead as a step that computes a prompt is launched and again
once it is done, readers of the KV topic never see it, a router's subscriber hands it to the
router's state (fresher than a scrape, which misses the step running now), and a bad or vanished
load is never believed."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvscale.common.kv_events import WorkerLoad
from kvscale.router.kv_events import EndpointSubscriber, KVEventsSource
from kvscale.router.kv_index import KVBlockIndex, TokenPrompt
from kvscale.router.state import RouterState, WorkerMetrics
from kvscale.worker import LLM, SamplingParams
from kvscale.worker.engine.kv_event_publisher import KVEventsConfig

LOAD_TOPIC = "kvscale.load"
CONFIG = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:*",
    "replay_endpoint": "tcp://127.0.0.1:*",
    "topic": "kv-events",
    "load_topic": LOAD_TOPIC,
}


def read_all(sub: zmq.Socket, timeout_s: float = 2.0) -> list[list[bytes]]:
    out = []
    while sub.poll(int(timeout_s * 1000)):
        out.append(sub.recv_multipart())
        timeout_s = 0.3
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_says_its_prefill_work_as_a_step_launches_and_ends(target_model, async_scheduling):
    """A 48-token prompt: the load goes 0 -> 48 as its prefill step is launched (the gauge, set
    after a step, never shows it), back to 0 once that step is done, and the decode steps send
    nothing (no change). The second run of the same prompt finds 40 tokens cached: 8 ahead. A
    reader subscribed to the KV topic gets only three-frame batches."""
    llm = LLM(
        target_model,
        device="cpu",
        num_kv_blocks=24,
        block_size=8,
        kv_events_config=json.dumps(CONFIG),
        async_scheduling=async_scheduling,
    )
    try:
        pub, _ = llm.engine.kv_events.endpoints
        context = zmq.Context()
        load, kv = context.socket(zmq.SUB), context.socket(zmq.SUB)
        load.setsockopt_string(zmq.SUBSCRIBE, LOAD_TOPIC)
        kv.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
        load.connect(pub)
        kv.connect(pub)
        time.sleep(0.3)  # the subscriptions reach the publisher
        prompt = [0, *range(10, 57)]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        decoder = msgspec.msgpack.Decoder(WorkerLoad)

        def loads() -> list[int]:
            frames = read_all(load)
            assert all(len(f) == 2 and f[0] == LOAD_TOPIC.encode() for f in frames)
            return [decoder.decode(f[1]).prefill_tokens for f in frames]

        llm.generate([prompt], params)
        assert loads() == [48, 0]
        llm.generate([prompt], params)
        assert loads() == [8, 0]  # 40 tokens (5 full blocks) found in the prefix cache
        assert all(len(f) == 3 for f in read_all(kv))
        context.destroy(linger=0)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    "load_topic",
    ['""', '"kv-events"', '"kv-events.load"', "7"],
    ids=["empty", "the KV topic", "under the KV topic", "not a string"],
)
def test_a_load_topic_that_would_mix_with_the_events_is_refused(load_topic):
    """ZMQ matches topics by prefix: a load topic starting with the KV topic would reach its
    subscribers (readers of three-frame batches)."""
    text = f'{{"enable_kv_cache_events": true, "topic": "kv-events", "load_topic": {load_topic}}}'
    with pytest.raises(ValueError, match="load_topic must be a non-empty string, not topic or one starting"):
        KVEventsConfig.parse(text)
    assert KVEventsConfig.parse(
        text.replace('"kv-events"', '"kv"', 1).replace(load_topic, '"load"')
    ).load_topic


def test_the_load_overrides_the_scrape_and_counts_other_replicas_work_once():
    """The scraped gauge is set after each step: it says 0 while a 384-token prefill runs. The load
    message (sent as the step launched) says 384: another replica's cold prompt is ahead there.
    Ours sent after it are counted once (ours), and a stream that drops hands back to the scrape."""
    a = "http://10.0.0.1:8000"
    state = RouterState()
    state.set_endpoints([a])
    state.update_metrics(a, WorkerMetrics(kv_blocks=64, prefill_pending=0))
    state.update_load(a, 384)
    assert state.prefill_ahead(a) == 384
    state.update_metrics(a, WorkerMetrics(kv_blocks=64, prefill_pending=0))  # a later, staler scrape
    assert state.prefill_ahead(a) == 384
    mine = TokenPrompt(list(range(100)))
    state._prefill[(a, id(mine))] = 100
    state.pending_prefill[a] = 100  # sent after the load message: not in it
    assert state.prefill_ahead(a) == 484
    state.update_load(a, 484)  # it arrived: the worker's count holds ours now
    assert state.prefill_ahead(a) == 484
    state.update_load(a, 100)  # the other replica's prefill is done
    assert state.prefill_ahead(a) == 100
    state.update_load(a, None)  # the stream dropped: the scrape's word again
    assert state.prefill_ahead(a) == 100
    state.update_load("http://10.0.0.9:8000", 5000)  # not in the ready set: ignored
    assert "http://10.0.0.9:8000" not in state._load
    state.update_load(a, 7)
    state.set_endpoints([])
    assert a not in state._load


async def _subscriber_hands_loads_over() -> None:
    context = zmq.asyncio.Context()
    pub, replay = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    source = KVEventsSource(
        pub.bind_to_random_port("tcp://127.0.0.1"),
        replay.bind_to_random_port("tcp://127.0.0.1"),
        max_message_bytes=4096,
        replay_timeout_s=0.2,
        retry_s=5.0,
    )
    endpoint = "http://127.0.0.1:1"
    seen: list[str] = []
    loads: list[int | None] = []
    sub = EndpointSubscriber(
        endpoint,
        KVBlockIndex(),
        source,
        context,
        on_event=lambda e, what: seen.append(what),
        on_load=lambda e, tokens: loads.append(tokens),
    )
    task = asyncio.create_task(sub.run())
    await asyncio.sleep(0.5)  # connected, subscribed (its replay went unanswered: unsynced)
    encode = msgspec.msgpack.encode
    for frames in (
        [b"kvscale.load", encode(WorkerLoad(1.0, 384))],
        [b"kvscale.load", b"\xc1 not msgpack"],
        [b"kvscale.load", encode(["WorkerLoad", 1.0, -5])],  # a negative load: not believed
        [b"kvscale.load", encode(["WorkerLoad", 1.0, "many"])],
        [b"kvscale.load", encode(WorkerLoad(2.0, 0))],
    ):
        await pub.send_multipart(frames)
    deadline = asyncio.get_running_loop().time() + 5
    while len(loads) < 2 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    assert loads == [384, 0]  # the load is handed over even while the index is unsynced
    assert seen.count("load") == 2 and seen.count("bad") == 3
    # The connection drops (a message over the cap): the load is withdrawn, not left stale.
    await pub.send_multipart([b"kvscale.load", b"\0" * 8192])
    while None not in loads and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    assert loads[-1] is None and not task.done()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    context.destroy(linger=0)


def test_the_routers_subscriber_hands_loads_over_and_refuses_bad_ones():
    asyncio.run(_subscriber_hands_loads_over())


async def _flood() -> tuple[int, float]:
    context = zmq.asyncio.Context()
    pub, replay = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    pub.setsockopt(zmq.SNDHWM, 0)  # nothing dropped at the sender: the whole flood arrives
    source = KVEventsSource(
        pub.bind_to_random_port("tcp://127.0.0.1"),
        replay.bind_to_random_port("tcp://127.0.0.1"),
        replay_timeout_s=0.2,
        retry_s=30.0,
    )
    loads: list[int | None] = []
    sub = EndpointSubscriber(
        "http://127.0.0.1:1", KVBlockIndex(), source, context, on_load=lambda e, t: loads.append(t)
    )
    task = asyncio.create_task(sub.run())
    await asyncio.sleep(0.5)
    payload = msgspec.msgpack.encode(WorkerLoad(1.0, 5))
    for _ in range(20_000):
        pub.send_multipart([b"kvscale.load", payload])  # queued at once, not awaited
    loop = asyncio.get_running_loop()
    last = started = loop.time()
    worst = 0.0
    while len(loads) < 20_000 and loop.time() - started < 30:
        await asyncio.sleep(0.001)
        worst, last = max(worst, loop.time() - last), loop.time()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    context.destroy(linger=0)
    return len(loads), worst


def test_a_worker_flooding_loads_never_stalls_the_routers_event_loop():
    """20,000 load messages at once from one worker (a hostile or broken one): the subscriber
    takes them one at a time, yielding between them, so the router's other tasks (requests,
    probes) keep running: no gap in the loop over 100 ms (a drain-all loop: the whole flood)."""
    received, worst = asyncio.run(_flood())
    assert received == 20_000
    assert worst < 0.1, f"the event loop stalled {worst * 1000:.0f} ms"
