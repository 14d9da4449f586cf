"""Continuous batching: decide, each step, which requests compute how many tokens.

One token budget per step (max_num_batched_tokens) and a cap on running sequences (max_num_seqs).
Running requests go first, in admission order (their decodes, or the rest of a chunked prefill);
then waiting requests are admitted in arrival order, their prompts chunked to fit the budget. When
the pool runs out of blocks, the most recently admitted running request is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed (prefix caching usually
gives most of it back). The oldest running request can always grow, so the loop never deadlocks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvscale.worker.core.kv_cache_manager import KVCacheManager, NewlyCached
from kvscale.worker.core.request import Request, RequestStatus
from kvscale.worker.metrics.stats import SchedulerStats
from kvscale.worker.sample.logprobs import TokenLogprobs

logger = logging.getLogger(__name__)


def default_max_tokens(max_model_len: int, pool_tokens: int, prompt_len: int) -> int:
    """max_tokens for a request that sets none: up to the model length clipped to what the whole KV
    pool holds (`pool_tokens`), never 0 (the prompt alone is refused at admission)."""
    return max(1, min(max_model_len, pool_tokens) - prompt_len)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # The most LoRA adapters the running batch may use at once (the device's slots); 0: no limit.
    max_loras: int = 0


@dataclass
class SchedulerOutput:
    # Aligned lists: request i computes num_scheduled_tokens[i] tokens starting at position
    # num_computed_tokens[i] (its num_computed_tokens when scheduled).
    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Speculative decoding, filled after scheduling: tokens proposed per request (included in
    # num_scheduled_tokens) and, for drafts sampled from a distribution, that distribution [n, V].
    spec_token_ids: list[list[int]] = field(default_factory=list)
    spec_draft_probs: list[object | None] = field(default_factory=list)
    # Structured outputs, filled after scheduling: the constrained rows' token bitmask
    # (structured_output.manager.GrammarBitmask); None when no scheduled request is constrained.
    grammar_bitmask: object | None = None
    # With speculation: one row per verified position of the speculating requests, in the
    # rejection sampler's order (None when none of them is constrained).
    verify_bitmask: object | None = None
    # Async scheduling: scheduled before the previous step's tokens were known. Its requests'
    # num_computed_tokens already count this step, and a token still pending is fed from the device.
    async_scheduled: bool = False
    # Blocks indexed for the prefix cache when this step was scheduled (its forward writes their
    # KV): should the step fail, the engine takes them back out of the index (KVCacheManager.uncache).
    new_cached_blocks: list[NewlyCached] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt tokens this step computes (its prefill work)."""
        return sum(
            max(0, min(r.num_prompt_tokens, c + n) - c)
            for r, c, n in zip(
                self.requests, self.num_computed_tokens, self.num_scheduled_tokens, strict=True
            )
        )

    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Requests whose grammar failed to compile, aborted by schedule(); the engine reports
        # them as failed (take_grammar_failures).
        self.grammar_failures: list[Request] = []

    # -- admission ---------------------------------------------------------------------------
    def max_tokens_for(self, prompt_len: int, requested: int | None) -> int:
        """A request's max_tokens, decided here once (the engine's make_request and the server's
        validation both ask): what the client asked for, else up to the model length clipped to
        what the whole KV pool holds, so that it is not refused for a worst case nobody asked
        for. Either way the request ends at the model length (_length_capped)."""
        if requested is not None:
            return requested
        pool = self.kv.num_blocks * self.kv.block_size
        return default_max_tokens(self.config.max_model_len, pool, prompt_len)

    def final_length(self, request: Request) -> int:
        """The most tokens the request can come to hold: prompt + max_tokens, within the model length."""
        return min(request.num_prompt_tokens + request.max_tokens, self.config.max_model_len)

    def check_admissible(self, request: Request) -> None:
        """Raise ValueError when the request could never run: too long for the model or the pool."""
        n, limit = request.num_prompt_tokens, self.config.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty")
        if n > limit:
            raise ValueError(f"the prompt has {n} tokens, more than the maximum model length of {limit}")
        need = self.kv.blocks_needed(self.final_length(request))  # its worst case
        if need > self.kv.num_blocks:
            raise ValueError(
                f"the request needs up to {need} KV blocks ({n} prompt tokens + {request.max_tokens} max "
                f"tokens) but the whole KV cache has {self.kv.num_blocks}; lower max_tokens or give the "
                "cache more memory"
            )

    def add_request(self, request: Request) -> None:
        self.check_admissible(request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if request.structured_output is not None and not request.structured_output.is_ready():
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; frees their blocks. Unknown ids are ignored."""
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finished_time = time.monotonic()
        self.kv.free(request)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ----------------------------------------------------------------------------
    def schedule(self, async_scheduled: bool = False) -> SchedulerOutput:
        """The next step. async_scheduled: the previous step may still be running (its sampled tokens
        pending): each request is advanced past the tokens scheduled now, at once, so that the next
        call can be made before this step's outputs are processed (update_from_output)."""
        out = SchedulerOutput(async_scheduled=async_scheduled)
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self._pending_is_last(request):  # nothing left to compute: it finishes on that token
                i += 1
                continue
            if request.num_pending_tokens and request.needs_host_tokens:
                # Its next mask (a grammar's, bad words') needs the pending token on the host: it
                # sits this step out (the others still run ahead) and runs in the next one.
                i += 1
                continue
            num_left = request.num_tokens + request.num_pending_tokens - request.num_computed_tokens
            num_new = min(num_left, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                self._schedule(out, request, num_new)
                budget -= num_new
                i += 1

        # Admit new work only if nothing was just preempted: a full pool would evict it again.
        # A request whose grammar is still compiling is passed over (it keeps its place in line).
        skipped: list[Request] = []
        adapters = self._running_adapters()
        while (
            self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted
        ):
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                so = request.structured_output
                if so.expired(now):  # offline requests' compile deadline: failed, not waited on
                    self._finish(self.waiting.popleft(), RequestStatus.FINISHED_ABORTED)
                    self.grammar_failures.append(request)
                    continue
                if not so.is_ready():
                    skipped.append(self.waiting.popleft())
                    continue
                if so.error() is not None:
                    self._finish(self.waiting.popleft(), RequestStatus.FINISHED_ABORTED)
                    self.grammar_failures.append(request)
                    continue
                request.status = RequestStatus.WAITING
            if not self._adapter_fits(request, adapters):
                # Its adapter would be one more than the slots hold: it waits (keeping its place)
                # until a running adapter's requests finish; requests behind it may go first.
                skipped.append(self.waiting.popleft())
                continue
            computed_blocks, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0:
                computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - request.num_computed_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(request, num_new, computed_blocks):
                break  # strict arrival order: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.num_computed_tokens += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.kv.record_prefix_lookup(request, num_hit_tokens)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            if request.lora_request is not None:
                adapters.add(request.lora_request.lora_int_id)
            self._schedule(out, request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        out.new_cached_blocks = self.kv.take_newly_cached()
        if async_scheduled:
            for request, n in zip(out.requests, out.num_scheduled_tokens, strict=True):
                request.num_computed_tokens += n
        return out

    def _running_adapters(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _adapter_fits(self, request: Request, adapters: set[int]) -> bool:
        """Whether admitting the request keeps the running batch within max_loras adapters."""
        lora = request.lora_request
        limit = self.config.max_loras
        return lora is None or not limit or lora.lora_int_id in adapters or len(adapters) < limit

    def _pending_is_last(self, request: Request) -> bool:
        """Its pending token will be its last (max_tokens or the model length): known before the
        token is, so async scheduling never schedules a step past a request's end."""
        return request.num_pending_tokens > 0 and self._length_capped(request, request.num_pending_tokens)

    def _length_capped(self, request: Request, ahead: int = 0) -> bool:
        """The request has max_tokens output tokens, or fills the model length (final_length),
        counting `ahead` tokens beyond those it holds."""
        return request.num_tokens + ahead >= self.final_length(request)

    def _schedule(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        out.requests.append(request)
        out.num_scheduled_tokens.append(num_new)
        out.num_computed_tokens.append(request.num_computed_tokens)
        out.block_ids.append(self.kv.get_block_ids(request.request_id))
        out.spec_token_ids.append([])
        out.spec_draft_probs.append(None)

    def reserve_lookahead(self, request: Request, num_lookahead: int) -> int:
        """Slots for up to num_lookahead proposed tokens after the request's next token; returns how
        many fit. Speculation only takes free blocks: it never preempts anyone."""
        for k in range(num_lookahead, 0, -1):
            if self.kv.allocate_slots(request, 1 + k):
                return k
        return 0

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_draft_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled_token_ids: list[list[int]],
        now: float | None = None,
        logprobs: list[list[TokenLogprobs] | None] | None = None,
    ) -> list[Request]:
        """Advance each scheduled request by its computed tokens, append what was sampled (with its
        logprobs, token by token), and finish those that hit EOS, a stop token, max_tokens or the
        model length: tokens after the stop in an accepted speculative run are dropped together with
        their logprobs. Returns the requests that received tokens (finished ones included)."""
        now = time.monotonic() if now is None else now
        if logprobs is None:
            logprobs = [None] * len(out.requests)
        updated = []
        for request, num_tokens, new_ids, drafts, new_lps in zip(
            out.requests,
            out.num_scheduled_tokens,
            sampled_token_ids,
            out.spec_token_ids,
            logprobs,
            strict=True,
        ):
            if request.is_finished:  # aborted (or stopped, under async scheduling) since scheduled
                continue
            if out.async_scheduled:  # advanced when scheduled; its sampled token is pending until now
                request.num_pending_tokens -= len(new_ids)
            else:
                # Proposed tokens after the first rejection were computed but are not the sequence's:
                # their slots are overwritten by the next step's tokens.
                num_rejected = len(drafts) - (len(new_ids) - 1) if drafts else 0
                request.num_computed_tokens += num_tokens - num_rejected
            if not new_ids:
                continue  # a prefill chunk that does not reach the end of the prompt
            for j, token_id in enumerate(new_ids):
                request.append_output_token(token_id, now, new_lps[j] if new_lps else None)
                status = self.check_stop(request, token_id)
                if request.structured_output is not None:
                    status = self._advance_grammar(request, token_id) or status
                if status is not None:
                    # Running, or (async scheduling) preempted while its token was pending.
                    queue = self.running if request.status == RequestStatus.RUNNING else self.waiting
                    queue.remove(request)
                    self._finish(request, status)
                    break
            if not request.is_finished:
                # Slots reserved for proposed tokens that were rejected (or never proposed) go back.
                self.kv.free_excess_blocks(request)
            updated.append(request)
        return updated

    def _advance_grammar(self, request: Request, token_id: int) -> RequestStatus | None:
        """Move the request's matcher past its new token: the grammar's end (its stop token
        accepted) stops the request. A token the grammar refuses cannot come from a masked row; if
        one does, the request is aborted rather than given output that breaks its constraint."""
        matcher = request.structured_output.matcher
        if not matcher.accept_token(token_id):
            logger.error("request %s: token %d refused by its grammar", request.request_id, token_id)
            return RequestStatus.FINISHED_ABORTED
        return RequestStatus.FINISHED_STOPPED if matcher.is_terminated() else None

    def take_grammar_failures(self) -> list[Request]:
        failures, self.grammar_failures = self.grammar_failures, []
        return failures

    def check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if self._length_capped(request):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def stats(self) -> SchedulerStats:
        pc = self.kv.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            running_lora_adapters=sorted({r.lora_name for r in self.running if r.lora_request is not None}),
            waiting_lora_adapters=sorted({r.lora_name for r in self.waiting if r.lora_request is not None}),
            num_prefill_tokens=self.num_prefill_tokens(),
        )

    def num_prefill_tokens(self) -> int:
        """Prompt tokens of the unfinished requests not computed yet (those of a step scheduled
        and not processed count as computed under async scheduling, not otherwise)."""
        return sum(
            max(0, r.num_prompt_tokens - r.num_computed_tokens)
            for queue in (self.waiting, self.running)
            for r in queue
        )
