"""StructuredOutputManager: compiles grammars off the step loop and builds each step's bitmask.

Compiling a grammar takes milliseconds to seconds, far longer than a step, so it runs on a bounded
pool of threads shared fairly between clients (compile_pool.py). The server asks for the compile
first (`prepare`, off its event loop) and waits for it before queueing the request, so a request
reaches the scheduler with its grammar ready; the offline API queues it at once and it waits in
WAITING_FOR_GRAMMAR. Each constraint is parsed once, inside its compile job. Compiled grammars
are cached by their constraint (`StructuredOutputsParams.key`, least recently used out first)
within a byte budget (xgrammar's `memory_size_bytes`), and a compile in flight is shared: the
cache holds futures. A compile nobody waits for any more (its clients left) is cancelled if it
has not started.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvscale.worker.sample.sampling_params import StructuredOutputsParams
from kvscale.worker.structured_output.backend import StructuredOutputBackend
from kvscale.worker.structured_output.compile_pool import CompilePool
from kvscale.worker.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:  # a request is passed in; this layer sits below core/ (tests/test_layers.py)
    from kvscale.worker.core.request import Request

DEFAULT_CACHE_BYTES = 512 * 2**20


@dataclass
class _Entry:
    future: Future
    waiters: int = 0  # server requests waiting for this compile (prepare without release)
    size: int = 0  # bytes, once compiled


@dataclass
class GrammarHandle:
    """A compile asked for by `prepare`: the server waits on `future`, then hands the handle to the
    engine's make_request; `release` when it stops waiting before the compile is done."""

    key: tuple
    future: Future
    _release: Callable[[], None] = field(repr=False)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


@dataclass
class GrammarBitmask:
    """One step's mask: `bitmask` row i belongs to the step's i-th scheduled request; only the
    rows in `rows` (constrained requests that sample this step) were filled."""

    bitmask: torch.Tensor
    rows: list[int]
    apply_rows: Callable[[torch.Tensor, torch.Tensor, list[int]], None]
    seconds: float = 0.0  # filling and applying the rows, this step (the mask-time metric)

    def masker(self, scheduled_indices: list[int]) -> Callable[[torch.Tensor], None] | None:
        """For a sampler batch whose logit row k is scheduled request scheduled_indices[k]: a
        function masking those logits in place (None when no row of that batch is constrained)."""
        filled = set(self.rows)
        logit_rows = [k for k, i in enumerate(scheduled_indices) if i in filled]
        if not logit_rows:
            return None
        bitmask = self.bitmask[torch.tensor(scheduled_indices)]

        def apply(logits: torch.Tensor) -> None:
            start = time.perf_counter()
            self.apply_rows(logits, bitmask, logit_rows)
            self.seconds += time.perf_counter() - start

        return apply


class StructuredOutputManager:
    def __init__(
        self, backend: StructuredOutputBackend, max_workers: int = 2,
        cache_bytes: int = DEFAULT_CACHE_BYTES, per_client: int | None = None,
    ) -> None:  # fmt: skip
        self.backend = backend
        self.cache_bytes = cache_bytes
        self.pool = CompilePool(max_workers, per_client)
        self._cache: OrderedDict[tuple, _Entry] = OrderedDict()
        self._cached_bytes = 0
        # Reentrant: a future done at once runs its done callback (_on_done) in the caller, under the lock.
        self._lock = threading.RLock()
        self._bitmask = backend.allocate_bitmask(8)
        self._verify_bitmask = backend.allocate_bitmask(8)  # speculation's rows (constrain_proposals)
        # Drained by take_compile_times (metrics): seconds per compile, from the pool threads.
        self._compile_times: list[float] = []

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError for a constraint that cannot be enforced; cheap (no grammar parse)."""
        self.backend.validate(params)

    def prepare(self, params: StructuredOutputsParams, client: Hashable = None) -> GrammarHandle:
        """The server's entry (off the event loop): check the constraint, then its compile from the
        cache or queued on the pool for `client`. Raises ValueError (never enforceable) or PoolFull."""
        self.backend.validate(params)
        key = params.key
        entry = self._entry(key, lambda: self.pool.submit(lambda: self._compile(params), client))
        with self._lock:
            entry.waiters += 1
        return GrammarHandle(key, entry.future, lambda: self._release(key, entry))

    def init_request(
        self,
        params: StructuredOutputsParams,
        future: Future | None = None,
        parsed: object = None,
        deadline: float | None = None,
    ) -> StructuredOutputRequest:
        """A sequence's state: its grammar's compile (`future`, from prepare or an earlier call), else
        taken from the cache or queued (`parsed`: the constraint already parsed by the caller, so it
        is not parsed twice). The offline API's compiles are not bounded by the pool's queues."""
        if future is None:
            submit = lambda: self.pool.submit(lambda: self._compile(params, parsed), bounded=False)  # noqa: E731
            future = self._entry(params.key, submit).future
        return StructuredOutputRequest(params, future, self.backend.new_matcher, deadline)

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        """A compile of this constraint is cached or in flight (and has not failed)."""
        with self._lock:
            entry = self._cache.get(params.key)
            return entry is not None and not (entry.future.done() and entry.future.exception() is not None)

    def _entry(self, key: tuple, submit: Callable[[], Future]) -> _Entry:
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None and entry.future.done() and entry.future.exception() is not None:
                entry = None  # a failed compile is not kept: the next request tries again
            if entry is None:
                entry = self._cache[key] = _Entry(submit())
                entry.future.add_done_callback(lambda f: self._on_done(key, entry))
            self._cache.move_to_end(key)
            return entry

    def _on_done(self, key: tuple, entry: _Entry) -> None:
        """Keep a compiled grammar within the byte budget; forget failed and cancelled ones."""
        future = entry.future
        ok = not future.cancelled() and future.exception() is None
        size = self.backend.memory_size_bytes(future.result()) if ok else 0
        with self._lock:
            if self._cache.get(key) is not entry:
                return
            if not ok:
                del self._cache[key]
                return
            entry.size = size
            self._cached_bytes += size
            for k in [k for k, e in self._cache.items() if e.future.done()]:  # least recent first
                if self._cached_bytes <= self.cache_bytes:
                    break
                self._cached_bytes -= self._cache.pop(k).size

    def _release(self, key: tuple, entry: _Entry) -> None:
        with self._lock:
            entry.waiters -= 1
            if entry.waiters > 0 or not entry.future.cancel():  # running or done: let it finish
                return
            if self._cache.get(key) is entry:
                del self._cache[key]

    def _compile(self, params: StructuredOutputsParams, parsed: object = None) -> object:
        start = time.perf_counter()
        compiled = self.backend.compile(params) if parsed is None else self.backend.compile(params, parsed)
        with self._lock:
            self._compile_times.append(time.perf_counter() - start)
        return compiled

    def take_compile_times(self) -> list[float]:
        with self._lock:
            times, self._compile_times = self._compile_times, []
        return times

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def grammar_bitmask(self, requests: list[Request], samples: list[bool]) -> GrammarBitmask | None:
        """Fill the bitmask rows of the scheduled requests that are constrained and sample this
        step (requests[i] samples when samples[i]); None when there are none."""
        rows = [
            i
            for i, (request, sampling) in enumerate(zip(requests, samples, strict=True))
            if sampling and request.structured_output is not None
        ]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(requests):
            self._bitmask = self.backend.allocate_bitmask(max(len(requests), 2 * self._bitmask.shape[0]))
        for i in rows:
            requests[i].structured_output.matcher.fill_bitmask(self._bitmask, i)
        return GrammarBitmask(self._bitmask[: len(requests)], rows, self.backend.apply_bitmask)

    def constrain_proposals(
        self, requests: list[Request], drafts: list[list[int]]
    ) -> tuple[list[list[int]], GrammarBitmask | None]:
        """Speculation: each constrained request's proposals are walked through its grammar and
        cut after the first one it refuses (kept: the masked target gives it probability 0, so
        verification rejects it and samples there exactly as it would have) or the first that ends
        the grammar (nothing may follow it). Each verified position gets the grammar's bitmask row
        as it stands there; the position after such a last proposal stays unmasked (it is never
        emitted: the refused proposal is rejected, the grammar's end stops the request). Rows are
        in the rejection sampler's order: request after request, 1 + kept proposals each. The
        matchers end where they began (rolled back).
        Returns the kept proposals and the mask (None when no speculating request is constrained)."""
        if all(r.structured_output is None for r, d in zip(requests, drafts, strict=True) if d):
            return drafts, None
        total = sum(len(d) + 1 for d in drafts if d)
        if self._verify_bitmask.shape[0] < total:
            self._verify_bitmask = self.backend.allocate_bitmask(
                max(total, 2 * self._verify_bitmask.shape[0])
            )
        bitmask = self._verify_bitmask
        kept: list[list[int]] = []
        rows: list[int] = []
        offset = 0
        for request, proposal in zip(requests, drafts, strict=True):
            so = request.structured_output
            if so is None or not proposal:
                kept.append(proposal)
                offset += len(proposal) + 1 if proposal else 0
                continue
            matcher = so.matcher
            accepted, cut, masked = 0, len(proposal), [0]
            for j, token_id in enumerate(proposal):
                if not matcher.accept_token(token_id):
                    cut = j + 1
                    break
                accepted += 1
                if matcher.is_terminated():
                    cut = j + 1
                    break
                matcher.fill_bitmask(bitmask, offset + j + 1)
                masked.append(j + 1)
            if accepted:
                matcher.rollback(accepted)
            matcher.fill_bitmask(bitmask, offset)  # the first position: where the matcher stands
            rows.extend(offset + k for k in masked)
            kept.append(proposal[:cut])
            offset += cut + 1
        return kept, GrammarBitmask(bitmask[:offset], rows, self.backend.apply_bitmask)

    def shutdown(self) -> None:
        self.pool.shutdown()
