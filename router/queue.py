"""Flow control: requests that no endpoint can take now (none ready, or all at their limits) wait
here, in a bounded queue that is fair per client, until an endpoint can, a timeout, or their
client leaves.

Fair per client (the key the caller gives: the router's is the client's API key, else its peer
address): each key has its own FIFO and dispatch takes their heads round robin, so a burst from
one client cannot make another's requests wait behind all of it; and a key may hold at most
`max_per_key` of the `max_queued` places, so one client cannot fill the queue for everyone
(429 `ClientQueueFull`). Nobody jumps the queue: while
requests wait, a new arrival waits behind them even if an endpoint happens to be free. Dispatch
runs whenever something may have freed room (a request finished, a scrape, the endpoint set
changed); it stops at the first request nobody can take (the limits filter does not depend on the
request, so then nobody can take any).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

R = TypeVar("R")  # what `choose` reads of a request (the router's: its prefix hashes and model)


class QueueFull(Exception):
    """Refused at once: the queue holds max_queued requests (429)."""


class ClientQueueFull(QueueFull):
    """Refused at once: this client already holds max_per_key places (429)."""


class QueueTimeout(Exception):
    """Waited queue_timeout_s and nobody could take it (503)."""


@dataclass(eq=False)
class Waiter(Generic[R]):
    key: str  # whose turn it is: the fairness key
    request: R
    label: str = ""  # what the queued gauge counts it under (the model)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class FlowControl(Generic[R]):
    def __init__(
        self,
        choose: Callable[[R], str | None],
        release: Callable[[str], None],
        max_queued: int = 256,
        timeout_s: float = 60.0,
        on_change: Callable[[str, int], None] | None = None,
        max_per_key: int | None = None,
    ) -> None:
        self._choose, self._release = choose, release
        self.max_queued, self.timeout_s = max_queued, timeout_s
        self.max_per_key = max_queued if max_per_key is None else max_per_key
        self._on_change = on_change or (lambda label, delta: None)
        self._queues: OrderedDict[str, deque[Waiter[R]]] = OrderedDict()  # keys in round-robin order
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def queued(self, key: str) -> int:
        return len(self._queues.get(key, ()))

    async def acquire(self, key: str, request: R, label: str | None = None) -> str:
        """An endpoint for the request of client `key`, counted in flight there (the caller
        releases it), at once when one can take it and nobody waits, else after waiting its turn.
        `label` (default: the key) is what `on_change` reports."""
        if self._size == 0:
            endpoint = self._choose(request)
            if endpoint is not None:
                return endpoint
        if self._size >= self.max_queued:
            raise QueueFull
        if self.queued(key) >= self.max_per_key:
            raise ClientQueueFull
        waiter = Waiter(key, request, key if label is None else label)
        self._queues.setdefault(key, deque()).append(waiter)
        self._size += 1
        self._on_change(waiter.label, 1)
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

    def _leave(self, waiter: Waiter[R]) -> None:
        q = self._queues.get(waiter.key)
        if q is not None and waiter in q:
            q.remove(waiter)
            self._size -= 1
            self._on_change(waiter.label, -1)
            if not q:
                del self._queues[waiter.key]

    def dispatch(self) -> int:
        """Hands endpoints to waiting requests, one key's head at a time; the count handed."""
        handed = 0
        while self._queues:
            key, q = next(iter(self._queues.items()))
            waiter = q[0]
            endpoint = self._choose(waiter.request)
            if endpoint is None:
                break
            q.popleft()
            self._size -= 1
            self._on_change(waiter.label, -1)
            del self._queues[key]
            if q:
                self._queues[key] = q  # to the back of the round robin
            if waiter.future.done():  # cancelled in between: its endpoint goes back
                self._release(endpoint)
                continue
            waiter.future.set_result(endpoint)
            handed += 1
        return handed
