"""Flow control (kvscale.router.queue) under any interleaving of arrivals, clients that
leave, finished requests and capacity changes: no endpoint slot is leaked or handed twice, the
queue stays bounded, nobody waits while a slot is free, and per key (client) it is FIFO."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from kvscale.router.queue import FlowControl, QueueFull

steps = st.lists(
    st.tuples(
        st.one_of(
            st.tuples(st.just("arrive"), st.sampled_from("abc")),
            st.tuples(st.just("leave"), st.integers(0, 30)),
            st.tuples(st.just("finish"), st.integers(0, 30)),
            st.tuples(st.just("capacity"), st.integers(0, 4)),
        ),
        st.booleans(),  # let the woken tasks run before the next step (else: the next step races them)
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(steps, st.integers(1, 5))
def test_no_slot_is_leaked_or_handed_twice(seq, max_queued):
    asyncio.run(_play(seq, max_queued))


async def _play(seq, max_queued):
    capacity, used = [0], [0]

    def choose(hashes):
        if used[0] < capacity[0]:
            used[0] += 1
            handed.append(hashes[0])
            return "e"
        return None

    def release(endpoint):
        used[0] -= 1

    flow = FlowControl(choose, release, max_queued=max_queued, timeout_s=60)
    waiting: list[asyncio.Task] = []
    handed: list[tuple[str, int]] = []  # (model, arrival number), in the order slots were handed
    holding = 0  # slots the served requests hold
    arrivals = {m: 0 for m in "abc"}

    async def request(model, n):
        await flow.acquire(model, [(model, n)])

    def settle_done() -> int:
        served_now = 0
        for t in [t for t in waiting if t.done()]:
            waiting.remove(t)
            if not t.cancelled() and t.exception() is None:
                served_now += 1
            elif not t.cancelled():
                assert isinstance(t.exception(), QueueFull)
        return served_now

    for (kind, arg), settle in seq:
        if kind == "arrive":
            arrivals[arg] += 1
            task = asyncio.create_task(request(arg, arrivals[arg]))
            waiting.append(task)
        elif kind == "leave" and waiting:
            waiting[arg % len(waiting)].cancel()
        elif kind == "finish" and holding:
            holding -= 1
            release("e")
            flow.dispatch()
        elif kind == "capacity":
            capacity[0] = arg
            flow.dispatch()
        assert len(flow) <= max_queued
        if settle:
            for _ in range(10):  # wait_for + shield take a few loop turns to wake a task
                await asyncio.sleep(0)
            holding += settle_done()
            assert used[0] == holding  # every slot taken is held by exactly one served request
            # work-conserving: nobody waits while a slot is free
            assert not [t for t in waiting if not t.cancelling()] or used[0] >= capacity[0]
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    holding += settle_done()
    assert used[0] == holding and len(flow) == 0
    for model in "abc":  # FIFO per model
        order = [n for m, n in handed if m == model]
        assert order == sorted(order)
