"""StructuredOutputManager: compiles grammars off the step loop and builds each step's bitmask.

Compiling a grammar takes milliseconds to seconds (a large schema over a large vocabulary), far
longer than a step, so it runs on a small thread pool; the request waits in WAITING_FOR_GRAMMAR
and the scheduler admits the others meanwhile. Compiled grammars are cached by their constraint
(`StructuredOutputsParams.key`, least recently used out first), and a compile in flight is shared:
the cache holds futures.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvscale.worker.core.request import Request
from kvscale.worker.sample.sampling_params import StructuredOutputsParams
from kvscale.worker.structured_output.backend import StructuredOutputBackend
from kvscale.worker.structured_output.request import StructuredOutputRequest


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
    def __init__(self, backend: StructuredOutputBackend, max_workers: int = 1, cache_size: int = 256) -> None:
        self.backend = backend
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._bitmask = backend.allocate_bitmask(8)
        self._verify_bitmask = backend.allocate_bitmask(8)  # speculation's rows (constrain_proposals)
        # Drained by take_compile_times (metrics): seconds per compile, from the pool threads.
        self._compile_times: list[float] = []

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError for a constraint that cannot be enforced; before the request is queued."""
        self.backend.validate(params)

    def init_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A sequence's state, its grammar taken from the cache or compiled in the background."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and future.done() and future.exception() is not None:
                future = None  # a failed compile is not kept: the next request tries again
            if future is None:
                future = self._cache[key] = self._pool.submit(self._compile, params)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        return StructuredOutputRequest(params, future, self.backend.new_matcher)

    def _compile(self, params: StructuredOutputsParams) -> object:
        start = time.perf_counter()
        compiled = self.backend.compile(params)
        with self._lock:
            self._compile_times.append(time.perf_counter() - start)
        return compiled

    def take_compile_times(self) -> list[float]:
        with self._lock:
            times, self._compile_times = self._compile_times, []
        return times

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
        self._pool.shutdown(wait=False, cancel_futures=True)
