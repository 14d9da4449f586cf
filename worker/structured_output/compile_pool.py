"""A bounded pool of grammar-compile threads that shares its slots fairly between clients.

Each client (an API key, or a peer address) has its own queue; a free thread takes the next job
round-robin from the clients that have fewer than `per_client` jobs running, so one client
sending many heavy schemas occupies at most its share of the threads and the others' compiles
start as soon as a thread frees. Queues are bounded per client and in all (past them: PoolFull,
a 429: the compile could run later). A queued job whose future is cancelled (its client left) is
dropped unrun. xgrammar's compile releases the GIL (measured: the main thread kept ticking every
~20 ms through a 2 s compile) and cannot be interrupted, so a running job always completes; the
budgets (budget.py) keep every accepted compile short. The threads run at a lower priority
(`nice`, 10 by default): a burst of compiles then takes the CPU only when the event loop and the
engine thread leave it, so that /health and the running streams do not wait behind it (bench
hostile on two cores: the worst /health probe during a burst of 48 heavy schemas, docs/server.md).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass

_ANONYMOUS = ("anonymous",)  # the client of jobs submitted without one


class PoolFull(RuntimeError):
    """Too many compiles are queued (for this client, or in all): retry later."""


@dataclass
class _Job:
    fn: Callable[[], object]
    future: Future


def pick_client(
    queued: OrderedDict[Hashable, deque], running: dict[Hashable, int], per_client: int
) -> Hashable | None:
    """The client whose job runs next: the first in round-robin order with a job queued and fewer
    than `per_client` running; None when none may run now."""
    for client, jobs in queued.items():
        if jobs and running.get(client, 0) < per_client:
            return client
    return None


def lower_priority(nice: int) -> None:
    """Raise the calling thread's niceness by `nice` (Linux schedules threads one by one; raising
    it needs no privilege). Elsewhere, or refused, the thread keeps its priority."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (AttributeError, OSError):
        pass


class CompilePool:
    def __init__(
        self, workers: int = 2, per_client: int | None = None, max_queued_per_client: int = 16,
        max_queued: int = 256, nice: int = 10,
    ) -> None:  # fmt: skip
        if workers < 1:
            raise ValueError("the compile pool needs at least one worker")
        self.workers = workers
        # Half the threads by default (one of two): the rest stay free for everyone else.
        self.per_client = per_client if per_client is not None else max(1, workers // 2)
        self.max_queued_per_client = max_queued_per_client
        self.max_queued = max_queued
        self.nice = nice
        self._queued: OrderedDict[Hashable, deque[_Job]] = OrderedDict()
        self._running: dict[Hashable, int] = {}
        self._num_queued = 0
        self._cond = threading.Condition()
        self._stopped = False
        self._threads = [
            threading.Thread(target=self._work, name=f"grammar-compile-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], object], client: Hashable = None, bounded: bool = True) -> Future:
        """Queue `fn` for `client`; PoolFull past the queue bounds (`bounded=False`: the offline
        API, whose caller waits for what it queued, skips them)."""
        future: Future = Future()
        client = _ANONYMOUS if client is None else client  # None means "nobody may run" to pick_client
        with self._cond:
            if self._stopped:
                raise RuntimeError("the compile pool is shut down")
            self._drop_cancelled()
            jobs = self._queued.get(client)
            if bounded and jobs is not None and len(jobs) >= self.max_queued_per_client:
                raise PoolFull(f"{len(jobs)} grammar compiles of this client are already waiting")
            if bounded and self._num_queued >= self.max_queued:
                raise PoolFull(f"{self._num_queued} grammar compiles are already waiting")
            if jobs is None:
                jobs = self._queued[client] = deque()
            jobs.append(_Job(fn, future))
            self._num_queued += 1
            self._cond.notify()
        return future

    @property
    def num_queued(self) -> int:
        with self._cond:
            self._drop_cancelled()
            return self._num_queued

    def running(self, client: Hashable) -> int:
        with self._cond:
            return self._running.get(_ANONYMOUS if client is None else client, 0)

    def _drop_cancelled(self) -> None:
        """Forget queued jobs whose futures were cancelled (their clients left); under the lock."""
        for client in list(self._queued):
            jobs = self._queued[client]
            kept = deque(j for j in jobs if not j.future.cancelled())
            self._num_queued -= len(jobs) - len(kept)
            if kept:
                self._queued[client] = kept
            else:
                del self._queued[client]

    def _take(self) -> tuple[Hashable, _Job] | None:
        with self._cond:
            while True:
                if self._stopped:
                    return None
                self._drop_cancelled()
                client = pick_client(self._queued, self._running, self.per_client)
                if client is not None:
                    job = self._queued[client].popleft()
                    self._num_queued -= 1
                    self._queued.move_to_end(client)  # round-robin: the next job is someone else's
                    if not self._queued[client]:
                        del self._queued[client]
                    if not job.future.set_running_or_notify_cancel():
                        continue  # cancelled just now
                    self._running[client] = self._running.get(client, 0) + 1
                    return client, job
                self._cond.wait()

    def _work(self) -> None:
        lower_priority(self.nice)
        while (taken := self._take()) is not None:
            client, job = taken
            try:
                job.future.set_result(job.fn())
            except BaseException as e:  # the waiter sees it; the thread goes on
                job.future.set_exception(e)
            finally:
                with self._cond:
                    self._running[client] -= 1
                    if not self._running[client]:
                        del self._running[client]
                    self._cond.notify_all()

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            jobs = [job for queued in self._queued.values() for job in queued]
            self._queued.clear()
            self._num_queued = 0
            self._cond.notify_all()
        for job in jobs:  # outside the lock: cancelling runs the futures' done callbacks
            job.future.cancel()
