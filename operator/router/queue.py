"""Flow control: requests that no endpoint can take now (none ready, or all at their limits) wait
here, in a bounded queue that is fair per model, until an endpoint can, a timeout, or their client
leaves.

Fair per model: each model has its own FIFO and dispatch takes their heads round robin, so a burst
for one model cannot make another's requests wait behind all of it. Nobody jumps the queue: while
requests wait, a new arrival waits behind them even if an endpoint happens to be free. Dispatch
runs whenever something may have freed room (a request finished, a scrape, the endpoint set
changed); it stops at the first request nobody can take (the limits filter does not depend on the
request, so then nobody can take any).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class QueueFull(Exception):
    """Refused at once: the queue holds max_queued requests (429)."""


class QueueTimeout(Exception):
    """Waited queue_timeout_s and nobody could take it (503)."""


@dataclass(eq=False)
class Waiter:
    model: str
    hashes: Sequence[int]
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class FlowControl:
    def __init__(
        self,
        choose: Callable[[Sequence[int]], str | None],
        release: Callable[[str], None],
        max_queued: int = 256,
        timeout_s: float = 60.0,
        on_change: Callable[[str, int], None] | None = None,
    ) -> None:
        self._choose, self._release = choose, release
        self.max_queued, self.timeout_s = max_queued, timeout_s
        self._on_change = on_change or (lambda model, delta: None)
        self._queues: OrderedDict[str, deque[Waiter]] = OrderedDict()  # models in round-robin order
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def queued(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    async def acquire(self, model: str, hashes: Sequence[int]) -> str:
        """An endpoint for the request, counted in flight there (the caller releases it), at once
        when one can take it and nobody waits, else after waiting its turn."""
        if self._size == 0:
            endpoint = self._choose(hashes)
            if endpoint is not None:
                return endpoint
        if self._size >= self.max_queued:
            raise QueueFull
        waiter = Waiter(model, hashes)
        self._queues.setdefault(model, deque()).append(waiter)
        self._size += 1
        self._on_change(model, 1)
        self.dispatch()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), self.timeout_s)
        except BaseException as e:  # timed out, or cancelled: its client left
            handed = (
                waiter.future.result() if waiter.future.done() and not waiter.future.cancelled() else None
            )
            waiter.future.cancel()
            self._leave(waiter)
            if handed is not None:  # handed one in the instant it gave up: the next in line gets it
                self._release(handed)
                self.dispatch()
            if isinstance(e, TimeoutError):
                raise QueueTimeout from None
            raise
        finally:
            self._leave(waiter)

    def _leave(self, waiter: Waiter) -> None:
        q = self._queues.get(waiter.model)
        if q is not None and waiter in q:
            q.remove(waiter)
            self._size -= 1
            self._on_change(waiter.model, -1)
            if not q:
                del self._queues[waiter.model]

    def dispatch(self) -> int:
        """Hands endpoints to waiting requests, one model's head at a time; the count handed."""
        handed = 0
        while self._queues:
            model, q = next(iter(self._queues.items()))
            waiter = q[0]
            endpoint = self._choose(waiter.hashes)
            if endpoint is None:
                break
            q.popleft()
            self._size -= 1
            self._on_change(model, -1)
            del self._queues[model]
            if q:
                self._queues[model] = q  # to the back of the round robin
            if waiter.future.done():  # cancelled in between: its endpoint goes back
                self._release(endpoint)
                continue
            waiter.future.set_result(endpoint)
            handed += 1
        return handed
