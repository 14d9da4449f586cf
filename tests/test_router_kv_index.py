"""The router's precise prefix index (issue 31; router/kv_index.py, router/kv_events.py) against a
real engine publishing its KV events over real ZMQ sockets: the index is the worker's prefix-cache
index at every batch (stores, and evictions under memory pressure, seen at the batch that carries
them), a router that restarts and one that loses a batch both recover by resync (the replay, or
the worker's snapshot once its buffer no longer reaches back), two router replicas hold the same
index and pick alike, and the picker sends a prefix where its blocks are until they are evicted."""

from __future__ import annotations

import asyncio
import json

import pytest
import zmq.asyncio

from kvscale.router.kv_events import EndpointSubscriber, KVEventsSource, KVEventSubscriptions
from kvscale.router.kv_index import KVBlockIndex, TokenPrompt
from kvscale.router.state import RouterState, WorkerMetrics
from kvscale.worker import LLM, SamplingParams
from kvscale.worker.core.kv_events import BlockRemoved, BlockStored, KVEventBatch

CONFIG = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:*",
    "replay_endpoint": "tcp://127.0.0.1:*",
    "buffer_steps": 4,  # short: a late router gets the snapshot, not the history
}
WORKER = "http://127.0.0.1:1"  # the endpoint's URL: only its host is used here (no HTTP)
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture
def engine(target_model):
    llm = LLM(target_model, device="cpu", num_kv_blocks=24, block_size=8, kv_events_config=json.dumps(CONFIG))
    yield llm
    llm.engine.shutdown()


def source_of(llm) -> KVEventsSource:
    pub, replay = llm.engine.kv_events.endpoints
    return KVEventsSource(int(pub.rsplit(":", 1)[1]), int(replay.rsplit(":", 1)[1]), replay_timeout_s=2)


def pool_hashes(llm) -> set[bytes]:
    return set(llm.engine.kv_cache_manager.block_pool._index)


async def caught_up(index: KVBlockIndex, llm, timeout: float = 10.0) -> None:
    """Until the index has applied every batch the worker published, in sync."""
    publisher = llm.engine.kv_events
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        state = index.state(WORKER)
        if state.synced and state.seq == publisher.published - 1 and publisher.queued == publisher.published:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not caught up: {index.state(WORKER).seq} of {publisher.published - 1}")


def prompts(n: int) -> list[list[int]]:
    return [[0, *range(100 * i + 3, 100 * i + 44)] for i in range(n)]  # 42 tokens: 5 full blocks


def test_the_index_is_the_workers_through_evictions_restarts_and_lost_batches(engine):
    asyncio.run(_index_follows(engine))


async def _index_follows(engine):
    events: list[str] = []
    index = KVBlockIndex()
    subs = KVEventSubscriptions(index, source_of(engine), lambda e, what: events.append(what))
    subs.set_endpoints({WORKER})
    first = prompts(1)[0]
    await asyncio.to_thread(engine.generate, [first], PARAMS)
    await caught_up(index, engine)
    assert index.state(WORKER).blocks == pool_hashes(engine) != set()
    held = TokenPrompt([*first, 7, 7]).block_hashes(8, 64)
    assert index.match_length(WORKER, held) == 5

    # Memory pressure: 24 blocks cannot keep 5 more prompts of 6 blocks; the first one's blocks go.
    # After each step's batch the index is the pool's index: an eviction is seen at its batch.
    seen_at: list[int] = []
    for p in prompts(6)[1:]:
        await asyncio.to_thread(engine.generate, [p], PARAMS)
        await caught_up(index, engine)
        assert index.state(WORKER).blocks == pool_hashes(engine)
        seen_at.append(index.match_length(WORKER, held))
    assert seen_at[-1] < 5 and "gap" not in events

    # A router that restarts: a new index, whose first resync is a snapshot (the buffer holds 4 of
    # the batches), exact at once.
    restarted = KVBlockIndex()
    subs2 = KVEventSubscriptions(restarted, source_of(engine))
    subs2.set_endpoints({WORKER})
    await caught_up(restarted, engine)
    assert restarted.state(WORKER).blocks == pool_hashes(engine)
    # Two replicas agree.
    assert restarted.state(WORKER).blocks == index.state(WORKER).blocks

    # A lost batch: the next one shows the gap, the replay fills it.
    await subs2.close()
    await subs.close()
    lossy = KVBlockIndex()
    lost = []
    context = zmq.asyncio.Context()
    sub = EndpointSubscriber(WORKER, lossy, source_of(engine), context, on_event=lambda e, w: lost.append(w))
    real = sub._on_stream

    async def drop_one(frames):
        if not lost.count("dropped"):
            lost.append("dropped")
            return
        await real(frames)

    task = asyncio.create_task(sub.run())
    await caught_up(lossy, engine)
    sub._on_stream = drop_one
    for p in prompts(8)[6:]:
        await asyncio.to_thread(engine.generate, [p], PARAMS)
    await caught_up(lossy, engine)
    assert "dropped" in lost and "gap" in lost
    assert lossy.state(WORKER).blocks == pool_hashes(engine)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    context.destroy(linger=0)


def test_a_gap_the_replay_cannot_fill_unsyncs_and_a_snapshot_resyncs():
    index = KVBlockIndex()
    index.state(WORKER).synced = True
    index.apply(WORKER, 0, KVEventBatch(0.0, [BlockStored([b"a" * 32], None, list(range(8)), 8, None, None)]))
    assert index.synced(WORKER) and index.match_length(WORKER, [b"a" * 32]) == 1
    index.apply(WORKER, 1, KVEventBatch(0.0, [BlockRemoved([b"a" * 32], None)]))
    assert index.match_length(WORKER, [b"a" * 32]) == 0
    index.desync(WORKER)
    assert not index.synced(WORKER)


def test_the_picker_follows_the_precise_index_and_leaves_at_the_eviction():
    """Two equal workers; the one whose index holds the prompt's blocks gets it, while the other
    one's approximate index had recorded it. When its BlockRemoved arrives, the prefix no longer
    pulls there."""
    a, b = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    index = KVBlockIndex()
    state = RouterState(kv_index=index)
    state.set_endpoints([a, b])
    for e in (a, b):
        state.update_metrics(e, WorkerMetrics(kv_blocks=100))
        index.state(e).synced = True
        index.apply(e, 0, KVEventBatch(0.0, [BlockStored([], None, [], 8, None, None)]))
    prompt = TokenPrompt(list(range(1, 42)))
    hashes = prompt.block_hashes(8, 64)
    state.index.record(a, [11, 12, 13])  # the approximate index thinks a
    index.apply(b, 1, KVEventBatch(0.0, [BlockStored(hashes, None, list(range(1, 41)), 8, None, None)]))
    picks = {state.choose([11, 12, 13], prompt=prompt) for _ in range(1)}
    assert picks == {b}
    state.release(b)
    state.request_done(b, prompt)
    index.apply(b, 2, KVEventBatch(0.0, [BlockRemoved(hashes[:1], None)]))  # its first block evicted
    cands = {c.name: c for c in state.candidates([11, 12, 13], None, prompt)}
    assert cands[b].prefix_match == 0 and cands[b].prefix_blocks == 5
    # Unsynced: the approximate index scores it again.
    index.desync(b)
    index.desync(a)
    cands = {c.name: c for c in state.candidates([11, 12, 13], None, prompt)}
    assert cands[a].prefix_match == 3 and cands[a].prefix_blocks == 0


def test_the_prefill_guard_spills_a_prefix_whose_home_has_a_burst_of_prefills_queued():
    """The queue-aware policy: b holds the prompt's blocks, but the router has sent b 3,000 prompt
    tokens that have not started answering; a would prefill the whole prompt (328 tokens) at once.
    Without the guard b wins (prefix affinity); with it, a. Once b's first bytes come back, b wins
    again. Without precise costs (unsynced) the guard stands aside."""
    from kvscale.router.picker import PickerConfig

    a, b = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    prompt = TokenPrompt(list(range(1, 330)))
    hashes = prompt.block_hashes(8, 64)
    busy = [TokenPrompt(list(range(1000 * i, 1000 * i + 1000))) for i in range(1, 4)]

    def router(guard: float | None) -> tuple[RouterState, KVBlockIndex]:
        index = KVBlockIndex()
        state = RouterState(PickerConfig(prefill_factor=guard, load_factor=100), kv_index=index)
        state.set_endpoints([a, b])
        for e in (a, b):
            index.state(e).synced = True
            index.apply(e, 0, KVEventBatch(0.0, [BlockStored([], None, [], 8, None, None)]))
        stored = BlockStored(hashes, None, prompt.token_ids[:328], 8, None, None)
        index.apply(b, 1, KVEventBatch(0.0, [stored]))
        for p in busy:  # three long prompts went to b and are prefilling there
            state.in_flight[b] = state.in_flight.get(b, 0) + 1
            state._prefill[(b, id(p))] = 1000
            state.pending_prefill[b] = state.pending_prefill.get(b, 0) + 1000
        return state, index

    state, _ = router(None)
    assert state.choose([1], prompt=prompt) == b
    state, index = router(1.25)
    assert state.choose([1], prompt=prompt) == a
    assert state.pending_prefill[a] == 329  # its whole prompt is a's to prefill
    state.prefill_done(a, prompt)
    state.prefill_done(a, prompt)  # once only
    assert a not in state.pending_prefill
    state.request_done(a, prompt)  # its blocks no longer pending at a
    state.release(a)
    for p in busy:
        state.prefill_done(b, p)
    assert state.choose([1], prompt=prompt) == b
    state, index = router(1.25)
    index.desync(a)
    assert state.choose([1], prompt=prompt) == b  # a's cost unknown: no guard


def test_a_prefix_in_flight_counts_where_it_was_sent_until_the_request_ends():
    """Nothing stored anywhere yet: the first request picks by load; a second one with the same
    prefix, sent before the first one's blocks are stored (its events on the way), goes to the
    same endpoint. Once the first ends, only the worker's events speak for those blocks."""
    a, b = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    index = KVBlockIndex()
    state = RouterState(kv_index=index)
    state.set_endpoints([a, b])
    for e in (a, b):
        index.state(e).synced = True
        index.apply(e, 0, KVEventBatch(0.0, [BlockStored([], None, [], 8, None, None)]))
    first, second = TokenPrompt(list(range(1, 90))), TokenPrompt([*range(1, 81), 5, 5, 5])
    sent = state.choose([1], prompt=first)
    other = b if sent == a else a
    state.in_flight[other] = 0  # even with the other endpoint idle, the prefix pulls
    cands = {c.name: c for c in state.candidates([1], None, second)}
    assert cands[sent].prefix_match == 10 and cands[other].prefix_match == 0
    assert state.choose([1], prompt=second) == sent
    state.request_done(sent, first)
    state.request_done(sent, first)  # once only
    state.request_done(sent, second)
    assert index.state(sent).pending == {}
    assert {c.name: c.prefix_match for c in state.candidates([1], None, second)} == {a: 0, b: 0}


def test_an_adapters_blocks_are_scored_precisely_from_its_digest(target_model, tmp_path):
    """A LoRA engine publishing its events; a prompt ran under adapter `a`. The router, told a's
    content digest by the worker's served-adapter series, matches every full block of an `a`
    request there, while the same tokens for the base model or for adapter `b` (whose blocks are
    rooted elsewhere) match nothing: the worker's own rule, an adapter's KV serves only its own
    requests. A worker that does not say a digest (vLLM) leaves an adapter request to the
    approximate index."""
    pytest.importorskip("peft")
    from pathlib import Path

    from test_lora_peft_parity import ATTENTION, make_adapter

    from kvscale.worker import LoRARequest

    requests = {
        n: LoRARequest(
            n,
            i + 1,
            str(make_adapter(Path(target_model), tmp_path / n, seed=i, r=4, target_modules=ATTENTION)),
        )
        for i, n in enumerate(["a", "b"])
    }
    llm = LLM(
        target_model,
        device="cpu",
        num_kv_blocks=64,
        block_size=8,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        kv_events_config=json.dumps(CONFIG),
    )
    try:
        digests = {n: llm.engine.add_lora(r).digest for n, r in requests.items()}
        asyncio.run(_adapter_scored(llm, requests, digests))
    finally:
        llm.engine.shutdown()


async def _adapter_scored(llm, requests, digests):
    index = KVBlockIndex()
    subs = KVEventSubscriptions(index, source_of(llm))
    subs.set_endpoints({WORKER})
    prompt = prompts(1)[0]
    await asyncio.to_thread(llm.generate, [prompt], PARAMS, lora_request=requests["a"])
    await caught_up(index, llm)
    await subs.close()
    state = RouterState(kv_index=index)
    state.set_endpoints([WORKER])
    said = WorkerMetrics(kv_blocks=64, served_model="tiny", max_lora=2, adapter_digests=digests)
    state.update_metrics(WORKER, said)
    asked = TokenPrompt([*prompt, 7, 7])

    def scored(model: str | None) -> tuple[int, int, int]:
        (c,) = state.candidates([1], state.adapter_of(model), asked)
        return c.prefix_match, c.prefix_blocks, c.prefill_cost

    assert scored("a") == (5, 5, len(asked.token_ids) - 40)
    assert scored(None) == (0, 5, len(asked.token_ids))  # the base model: not its blocks
    assert scored("b") == (0, 5, len(asked.token_ids))
    state.update_metrics(WORKER, WorkerMetrics(kv_blocks=64, served_model="tiny", max_lora=2))
    assert scored("a") == (0, 0, -1)  # no digest said: the approximate index's (empty) score
    # A pick of an `a` request counts its blocks pending there, under a's root.
    state.update_metrics(WORKER, said)
    assert state.choose([1], model="a", prompt=asked) == WORKER
    assert state._in_flight_blocks[(WORKER, id(asked))] == asked.block_hashes(8, 64, digests["a"])


def test_the_prefill_guard_counts_the_workers_backlog_beyond_its_own_requests():
    """Two router replicas each see only their own requests; the worker's own count of prompt
    tokens not computed yet (kvscale_prefill_tokens_pending, every replica's) fills in the rest:
    at each scrape, what it counts beyond this replica's pending tokens then is the others'. A
    worker that does not say it (vLLM) leaves the replica's own count."""
    a = "http://10.0.0.1:8000"
    state = RouterState()
    state.set_endpoints([a])
    state.update_metrics(a, WorkerMetrics(kv_blocks=64))
    assert state.prefill_ahead(a) == 0
    mine = TokenPrompt(list(range(300)))
    state._prefill[(a, id(mine))] = 300
    state.pending_prefill[a] = 300
    assert state.prefill_ahead(a) == 300  # no worker count: ours alone
    state.update_metrics(a, WorkerMetrics(kv_blocks=64, prefill_pending=1000))  # 700 not ours
    assert state.prefill_ahead(a) == 1000
    later = TokenPrompt(list(range(200)))
    state._prefill[(a, id(later))] = 200
    state.pending_prefill[a] += 200  # sent since the scrape: counted once, by us
    assert state.prefill_ahead(a) == 1200
    state.prefill_done(a, mine)
    assert state.prefill_ahead(a) == 900
    state.update_metrics(a, WorkerMetrics(kv_blocks=64, prefill_pending=150))  # less than ours
    assert state.prefill_ahead(a) == 200
    (c,) = state.candidates([1])
    assert c.pending_prefill == 200
