"""LLMEngine: the step loop. schedule -> one forward -> sample -> update requests -> free blocks.

Synchronous and network-free: the offline API drives it directly and the server runs it from
its own loop. A request with n > 1 fans out into n sequences that share the prompt (and, through
the prefix cache, its KV blocks); their outputs are gathered under the parent's id. Each step
hands back deltas (only what is new), so a step's cost does not grow with how much a request has
generated; RequestOutputAccumulator rebuilds whole outputs (LLM.generate uses it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Hashable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from itertools import count

import torch

from kvscale.worker.config import EngineArgs
from kvscale.worker.core.kv_cache_manager import KVCacheManager
from kvscale.worker.core.kv_events import KVEventRecorder
from kvscale.worker.core.request import Request, RequestStatus
from kvscale.worker.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvscale.worker.distributed.parallel_state import TensorParallelError
from kvscale.worker.engine.detokenizer import IncrementalDetokenizer
from kvscale.worker.engine.kv_event_publisher import KVEventsConfig, ZmqEventPublisher
from kvscale.worker.engine.outputs import CompletionOutput, RequestOutput, completion_delta, stream_now
from kvscale.worker.lora.adapter import LoRAAdapter
from kvscale.worker.lora.manager import LoRAStats
from kvscale.worker.lora.request import LoRARequest
from kvscale.worker.metrics.stats import FinishedRequestStats, IterationStats
from kvscale.worker.model.llama import DecoderSpec
from kvscale.worker.model.loader import load_config, load_generation_defaults, load_tokenizer
from kvscale.worker.model.model_runner import LaunchedStep, ModelRunner
from kvscale.worker.sample.sampling_params import SamplingParams
from kvscale.worker.spec_decode.decoder import SpeculativeDecoder, profile_step_costs
from kvscale.worker.spec_decode.draft_proposer import DraftModelProposer
from kvscale.worker.spec_decode.ngram_proposer import NgramProposer
from kvscale.worker.structured_output.manager import GrammarHandle, StructuredOutputManager
from kvscale.worker.structured_output.request import GrammarCompileTimeout

logger = logging.getLogger(__name__)

# A step that fails as a whole (forward, sampler) fails the requests in it and the engine goes on;
# this many in a row means the engine itself is broken (e.g. a sticky CUDA error): raise, die.
MAX_CONSECUTIVE_FAILED_STEPS = 3


def fatal_step_failure(error: Exception, tensor_parallel: bool, consecutive_failures: int) -> str | None:
    """Why a step that failed as a whole must end the engine, or None: fail its requests, go on.

    Under tensor parallelism any failure is fatal: rank 0 failing alone (its sampler, a grammar
    mask, the draft model) leaves the other ranks inside or before that step's collectives, so
    every later collective would pair up out of step (a hang, or wrong output with no error); a
    group cannot be resynchronised in place, the worker exits and its pod restarts."""
    if isinstance(error, TensorParallelError):
        return f"a tensor-parallel rank is gone: {error}"
    if tensor_parallel:
        return f"a step failed under tensor parallelism, the ranks are out of step: {error!r}"
    if consecutive_failures >= MAX_CONSECUTIVE_FAILED_STEPS:
        return f"{consecutive_failures} steps failed in a row (a broken device?): {error!r}"
    return None


class RequestFailedError(RuntimeError):
    """A step failed for this request (the engine goes on serving the others); __cause__ says why."""


def eos_token_ids(model_path: str, hf_config, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (which may list several), the config and the tokenizer."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        gen = None
    for value in (gen, getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's reading of `bad_words`: each word as written (leading spaces dropped) and after a
    space, the second only where the space gives a different first token and as many tokens (the
    word in the middle of a text)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def _finished_stats(request: Request) -> FinishedRequestStats:
    end = request.finished_time or time.monotonic()
    return FinishedRequestStats(
        finish_reason=request.status.finish_reason or "abort",
        e2e_latency=end - request.arrival_time,
        queue_time=None
        if request.first_scheduled_time is None
        else request.first_scheduled_time - request.arrival_time,
        num_prompt_tokens=request.num_prompt_tokens,
        num_generation_tokens=request.num_output_tokens,
        lora_name=request.lora_name,
    )


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    # Output tokens already given to each child's detokenizer.
    num_fed: list[int] = field(default_factory=list)
    # Output tokens already handed out in a delta (behind num_fed while stream_interval holds some).
    num_sent: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # pinned in host memory from add_prepared to its end


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        if not args.model:
            raise ValueError("no model given: pass the path of a Hugging Face model folder")
        self.args = args
        load_draft = None
        if args.speculative_method == "draft":

            def load_draft(device, dtype, max_model_len, vocab_size):
                return DraftModelProposer(args, device, dtype, max_model_len, vocab_size)

        # Tensor parallelism: this process is rank 0 (scheduler, sampler, speculation); the ranks it
        # starts, and those of other nodes, run the same forwards on their shards.
        self.tp_driver = None
        if args.tensor_parallel_size > 1:
            if args.node_rank != 0:
                raise ValueError("only node_rank 0 runs the engine; other nodes run ranks only")
            # Refuse a size the heads cannot be split into before any process starts.
            DecoderSpec.from_hf_config(load_config(args.model)).layout(0, args.tensor_parallel_size)
            from kvscale.worker.executor.launcher import TensorParallelDriver

            self.tp_driver = TensorParallelDriver(args)
        try:
            self.runner = ModelRunner(args, load_draft, tp=self.tp_driver.tp if self.tp_driver else None)
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.eos_token_ids = eos_token_ids(args.model, self.runner.hf_config, self.tokenizer)
        # What generation_config.json sets; fills the sampling fields a request leaves unset.
        self.default_sampling_params = load_generation_defaults(args.model)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.spec.vocab_size
        # KV events (core/kv_events.py): recorded by the cache as it indexes and evicts blocks,
        # published after each step by a thread of their own.
        self.kv_events: ZmqEventPublisher | None = None
        recorder = None
        config = KVEventsConfig.parse(args.kv_events_config) if args.kv_events_config else None
        if config is not None and config.enabled:
            medium = "GPU" if self.runner.device.type == "cuda" else "CPU"
            recorder = KVEventRecorder(args.block_size, medium)
            self.kv_events = ZmqEventPublisher(config)
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks, args.block_size, args.enable_prefix_caching, recorder
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                args.max_num_seqs,
                args.max_num_batched_tokens,
                self.max_model_len,
                max_loras=args.max_loras if args.enable_lora else 0,
            ),
            self.kv_cache_manager,
        )
        self.spec_decoder = self._make_spec_decoder(args) if args.speculative_method else None
        self._parents: dict[str, ParentRequest] = {}
        self._child_to_parent: dict[str, str] = {}
        self._ids = count()
        self._stats = IterationStats()
        self._seen_preemptions = 0
        self._seen_prefix = (0, 0)
        self._seen_lora = LoRAStats()
        self._seen_kv_events = (0, 0)  # the publisher's queued and dropped counts at the last take_stats
        self._failed: dict[str, RequestFailedError] = {}
        self._consecutive_failed_steps = 0
        # Async scheduling (docs/engine.md): the step launched and not yet processed, and how many
        # steps were launched with one in flight. Not with speculation (proposals need the last
        # token on the host) nor tensor parallelism (the ranks get the step's tokens from the host).
        self._async_scheduling = (
            args.async_scheduling and self.spec_decoder is None and self.tp_driver is None
        )
        if args.async_scheduling and not self._async_scheduling:
            logger.warning("async scheduling is off: not with speculative decoding or tensor parallelism")
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self._launched = False  # the current step() launched a forward (it is timed)
        self.num_async_steps = 0
        self._seen_async_steps = 0  # num_async_steps at the last take_stats
        # Made with the first constrained request (the grammar library reads the whole vocabulary).
        self._structured_output: StructuredOutputManager | None = None
        self._structured_output_lock = threading.Lock()

    def _make_spec_decoder(self, args: EngineArgs) -> SpeculativeDecoder:
        runner = self.runner
        proposer = runner.draft or NgramProposer(args.ngram_prompt_lookup_max, args.ngram_prompt_lookup_min)
        decoder = SpeculativeDecoder(args, self.scheduler, proposer, self.max_model_len)
        if args.speculative_adaptive:
            with torch.inference_mode():
                decoder.costs = profile_step_costs(
                    runner.forward,
                    proposer,
                    runner.device,
                    args.num_lookahead_tokens,
                    args.max_num_seqs,
                    args.max_num_batched_tokens,
                    self.max_model_len,
                    runner.num_blocks,
                    args.block_size,
                )
        return decoder

    @property
    def structured_output(self) -> StructuredOutputManager:
        with self._structured_output_lock:  # make_request runs on the server's thread
            if self._structured_output is None:
                try:
                    from kvscale.worker.structured_output.xgrammar_backend import XgrammarBackend
                except ImportError as e:
                    raise ValueError(
                        f"structured outputs need xgrammar (pip install xgrammar): {e}"
                    ) from None
                backend = XgrammarBackend(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
                self._structured_output = StructuredOutputManager(
                    backend, self.args.grammar_compile_workers, self.args.grammar_cache_bytes
                )
            return self._structured_output

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Refuse (ValueError) a constraint that cannot be enforced, before anything is queued:
        its budgets and the keywords the grammar library would ignore (no grammar is parsed). The
        first call loads the grammar library's view of the vocabulary: the server calls this off
        its event loop."""
        if params.min_tokens > 0:
            # min_tokens bans EOS, which is all a complete grammar allows: nothing could be sampled.
            raise ValueError("min_tokens cannot be combined with structured outputs")
        self.structured_output.validate(params.structured_outputs)

    def prepare_grammar(self, params: SamplingParams, client: Hashable = None) -> GrammarHandle:
        """The server's first step for a constrained request (off its event loop): the checks of
        check_structured_outputs, then the grammar's compile, cached or queued on the compile pool
        for `client`. The server waits for the handle's future, then passes the handle to
        make_request: one parse and one compile per distinct constraint. Raises ValueError or
        PoolFull."""
        if params.min_tokens > 0:
            raise ValueError("min_tokens cannot be combined with structured outputs")
        return self.structured_output.prepare(params.structured_outputs, client)

    # -- LoRA adapters -----------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest, allowed_roots: list[str] | None = None) -> LoRAAdapter:
        """Read and check an adapter into host memory (vLLM's add_lora). Any thread: the server
        calls it off its event loop. Raises ValueError for an adapter this engine will not serve;
        `allowed_roots`: the folders its files must resolve into (None: anywhere)."""
        lora = self.runner.lora
        if lora is None:
            raise ValueError("LoRA adapters are not enabled on this engine (enable_lora, --enable-lora)")
        return lora.load(lora_request, allowed_roots)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests already running on it finish on it. Returns whether it was known."""
        return self.runner.lora is not None and self.runner.lora.remove(lora_int_id)

    def _release_lora(self, parent: ParentRequest) -> None:
        if parent.lora_request is not None and self.runner.lora is not None:
            self.runner.lora.unpin(parent.lora_request.lora_int_id)

    # -- requests in and out -----------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        return None, ids

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        grammar: GrammarHandle | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ParentRequest:
        """Tokenize and validate a request without queueing it (raises ValueError when it can never
        run). Touches no scheduler state, so the server calls it from its own thread. `grammar`:
        the constraint's compile from prepare_grammar (nothing about it is checked or parsed
        again); without it the constraint is checked and parsed here, and compiles in the
        background. `lora_request`: the adapter to run with, read into host memory here if it is
        not there (so that the engine thread never waits on the disk for it)."""
        adapter_digest = None if lora_request is None else self.add_lora(lora_request).digest
        params = (params or SamplingParams()).with_defaults(self.default_sampling_params)
        if request_id is None:  # skip ids the caller chose for earlier requests
            request_id = str(next(self._ids))
            while request_id in self._parents or request_id in self.scheduler.requests:
                request_id = str(next(self._ids))
        text, prompt_ids = self.tokenize(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        max_tokens = self.scheduler.max_tokens_for(len(prompt_ids), params.max_tokens)
        grammar_future = None if grammar is None else grammar.future
        parsed = None
        if params.structured_outputs is not None and grammar is None:
            self.check_structured_outputs(params)
            if not self.structured_output.is_cached(params.structured_outputs):
                # Parsed here, so that a malformed constraint is refused now; compiled once, from this.
                parsed = self.structured_output.backend.parse(params.structured_outputs)
        if params.allowed_token_ids is not None:
            bad = [t for t in params.allowed_token_ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"allowed_token_ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else []
        # Offline, nothing waited for the compile before this: the scheduler gives up on it at this
        # deadline (the server's prepare_grammar waited already, bounded the same way).
        timeout = self.args.grammar_compile_timeout
        grammar_deadline = None if grammar is not None or timeout is None else time.monotonic() + timeout
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child = Request(
                request_id=child_id,
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
                max_tokens=max_tokens,
                arrival_time=arrival,
                prompt=text,
                bad_words_token_ids=bad_words,
                lora_request=lora_request,
                adapter_digest=adapter_digest,
            )
            if i > 0:
                child.prompt_logprobs = None  # the first sequence computes them for all
            if params.seed is not None:
                # Its own seed per sequence; the sampler derives each position's noise from it.
                child.seed = params.seed + i
            if params.structured_outputs is not None:  # compiles (once, cached) in the background
                so = self.structured_output.init_request(
                    params.structured_outputs, grammar_future, parsed, grammar_deadline
                )
                child.structured_output, grammar_future = so, so.compiled
            children.append(child)
        self.scheduler.check_admissible(children[0])
        detokenizers = [
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
            for _ in children
        ]
        return ParentRequest(
            request_id, text, children, detokenizers, [0] * len(children), [0] * len(children),
            lora_request=lora_request,
        )  # fmt: skip

    def add_prepared(self, parent: ParentRequest) -> str:
        """Queue a request made by make_request."""
        if parent.request_id in self._parents:
            raise ValueError(f"request id {parent.request_id!r} is already in use")
        # Check every child id before queueing any: a half-added request would have no parent.
        taken = [c.request_id for c in parent.children if c.request_id in self.scheduler.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        if parent.lora_request is not None:
            if self.runner.lora is None:
                raise ValueError("LoRA adapters are not enabled on this engine (enable_lora, --enable-lora)")
            self.runner.lora.pin(parent.lora_request)  # released when the request ends
        for child in parent.children:
            self.scheduler.add_request(child)
            self._child_to_parent[child.request_id] = parent.request_id
        self._parents[parent.request_id] = parent
        if parent.children[0].structured_output is not None:
            self._stats.num_structured_requests += 1
        return parent.request_id

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request; raises ValueError (nothing queued) when it can never run."""
        return self.add_prepared(
            self.make_request(prompt, params, request_id, arrival_time, lora_request=lora_request)
        )

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Finish requests now and free their KV blocks; unknown or finished ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            aborted = self.scheduler.finish_requests(
                [c.request_id for c in parent.children], RequestStatus.FINISHED_ABORTED
            )
            for child in aborted:
                self._stats.finished.append(_finished_stats(child))
            for child in parent.children:
                self._child_to_parent.pop(child.request_id, None)
            self._release_lora(parent)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a launched step whose outputs are still to be processed."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step (_step), timed for the metrics with the forward it ran."""
        started = time.perf_counter()
        outputs = self._step()
        if self.kv_events is not None:
            events = self.kv_cache_manager.events.take()
            if events:
                self.kv_events.publish(events)
            self._publish_load()
        if self._launched:
            self._launched = False
            self._stats.step_times.append((self.runner.forward_kind, time.perf_counter() - started))
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One step: schedule, run the forward, sample, and return what the requests gained.

        With async scheduling (vLLM's), the next step is scheduled and launched before this one's
        tokens reach the host, which then processes them (stop checks, detokenizing, outputs) while
        the device runs the next forward: each call returns the outputs of the step launched by the
        call before. A request that stops on a token costs one wasted token of a step already
        launched. Per row: a request with a grammar sits out a step while its token is pending
        (its next mask needs it on the host); penalties count a pending token on the device."""
        async_scheduled = self._async_scheduling
        scheduled = self.scheduler.schedule(async_scheduled)
        self._fail_grammar_failures()
        if scheduled.is_empty():
            if self._in_flight is not None:
                return self._take_in_flight()
            self._wait_for_grammars()
            return []
        launching = False  # rank 0's own work until the launch, which reaches the other ranks
        try:
            if self.spec_decoder is not None:
                self.spec_decoder.propose(scheduled)
            if self._structured_output is not None:
                self._constrain_proposals(scheduled)
                self._fill_grammar_bitmask(scheduled)
            # Speculation's look-ahead slots may have indexed blocks too.
            scheduled.new_cached_blocks += self.kv_cache_manager.take_newly_cached()
            launching = True
            self._publish_load(scheduled)
            launched = self.runner.launch(scheduled)
            self._launched = True
        except Exception as e:
            self._step_failed(scheduled, e, reached_ranks=launching)
            return self._take_in_flight() if self._in_flight is not None else []
        if not async_scheduled:
            return self._finish_step(scheduled, launched)
        for i in launched.plain:
            scheduled.requests[i].num_pending_tokens += 1
        # The new step is in flight before the previous one is processed: should that one fail,
        # _step_failed sees the new step (which may have read the failed step's KV).
        previous, self._in_flight = self._in_flight, (scheduled, launched)
        if previous is None:
            return []
        self.num_async_steps += 1
        return self._finish_step(*previous)

    def _publish_load(self, launching: SchedulerOutput | None = None) -> None:
        """Tell the routers the prefill work ahead here (the publisher sends it only when it
        changed): the prompt tokens not computed, counting those of a step still running (being
        launched, or in flight under async scheduling, whose requests count them as computed)."""
        if self.kv_events is None or self.kv_events.config.load_topic is None:
            return
        running = [s for s in (launching, self._in_flight and self._in_flight[0]) if s is not None]
        in_steps = sum(s.num_prompt_tokens for s in running if s.async_scheduled)
        self.kv_events.publish_load(self.scheduler.num_prefill_tokens() + in_steps)

    def _take_in_flight(self) -> list[RequestOutput]:
        assert self._in_flight is not None
        (scheduled, launched), self._in_flight = self._in_flight, None
        return self._finish_step(scheduled, launched)

    def _step_failed(
        self,
        scheduled: SchedulerOutput,
        error: Exception,
        later: SchedulerOutput | None = None,
        reached_ranks: bool = True,
    ) -> None:
        """Fail the step's requests (the engine goes on), or raise when the engine itself is broken.
        Either way the blocks the step was to write leave the prefix index first: their KV was
        never (or only partly) written, and a later request sharing the prefix would read it.
        `later`: the step launched after this one (async scheduling), already in flight.
        `reached_ranks`: False when it failed in rank 0's own preparation (proposals, grammar
        masks), before the launch: the other ranks never saw the step, the group is in step."""
        failing = self._poisoned_parents(scheduled, later)
        self._consecutive_failed_steps += 1
        tensor_parallel = isinstance(error, TensorParallelError) or (
            self.tp_driver is not None and reached_ranks
        )
        reason = fatal_step_failure(error, tensor_parallel, self._consecutive_failed_steps)
        if reason is not None:
            logger.error("the engine cannot go on: %s", reason)
            if tensor_parallel:  # /health answers 500 and the server exits 1 (api_server.exit_soon)
                from kvscale.worker.executor.launcher import record_group_failure

                record_group_failure(reason)
            raise error
        logger.error("step failed: failing the %d requests in it", len(failing), exc_info=error)
        for parent_id in failing:
            self._fail(parent_id, error)

    def _poisoned_parents(self, failed: SchedulerOutput, later: SchedulerOutput | None) -> list[str]:
        """Unindex the blocks the failed step indexed, and return the requests (parent ids) to fail:
        the step's own, and those of the step launched after it (async scheduling) that hold one of
        those blocks (a prefix hit on KV never written), whose blocks indexed by that later step are
        unindexed too (computed on top of it)."""
        kv = self.kv_cache_manager
        kv.uncache(failed.new_cached_blocks)
        parents = dict.fromkeys(self._child_to_parent.get(r.request_id) for r in failed.requests)
        if later is not None:
            poisoned = {id(block) for _, block, _ in failed.new_cached_blocks}
            for request in later.requests:
                if any(id(b) in poisoned for b in kv.req_to_blocks.get(request.request_id, ())):
                    parents[self._child_to_parent.get(request.request_id)] = None
            kv.uncache([e for e in later.new_cached_blocks if self._child_to_parent.get(e[0]) in parents])
        return [p for p in parents if p is not None]

    def _finish_step(self, scheduled: SchedulerOutput, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens, update its requests and make their outputs."""
        try:
            result = launched.get()
            for i, entries in result.prompt_logprobs.items():
                filled = scheduled.requests[i].prompt_logprobs
                if filled is not None:
                    for position, lp in entries:
                        filled[position] = lp
            masks = [m for m in (scheduled.grammar_bitmask, scheduled.verify_bitmask) if m is not None]
            if masks:
                self._stats.grammar_mask_times.append(sum(m.seconds for m in masks))
            if self.spec_decoder is not None:
                self.spec_decoder.record(scheduled, result.sampled_token_ids, self._stats)
            updated = self.scheduler.update_from_output(
                scheduled, result.sampled_token_ids, logprobs=result.logprobs
            )
        except Exception as e:
            self._step_failed(scheduled, e, later=self._in_flight[0] if self._in_flight is not None else None)
            return []
        self._consecutive_failed_steps = 0
        touched: dict[str, tuple[ParentRequest, list[CompletionOutput]]] = {}
        interval = self.args.stream_interval
        for request in updated:
            parent = self._parents.get(self._child_to_parent.get(request.request_id, ""))
            if parent is None:  # failed earlier in this step (another of its sequences)
                continue
            try:  # this request's own bookkeeping: an error in it fails the request alone
                i = parent.children.index(request)
                self._detokenize(parent, i, request)
                sent = parent.num_sent[i]
                if not stream_now(sent, request.num_output_tokens, request.is_finished, interval):
                    continue
                # Text is what is safe to stream: a tail that may still become a stop string is
                # held back until it is known not to be one, so streamed text is never taken back.
                text = parent.detokenizers[i].get_next_output_text(finished=request.is_finished, delta=True)
                delta = completion_delta(i, request, text, sent)
                parent.num_sent[i] = request.num_output_tokens
            except Exception as e:
                logger.exception("request %s failed", parent.request_id)
                self._fail(parent.request_id, e)
                touched.pop(parent.request_id, None)
                continue
            touched.setdefault(parent.request_id, (parent, []))[1].append(delta)
        outputs = []
        for parent, deltas in touched.values():
            try:
                outputs.append(self._make_output(parent, deltas))
            except Exception as e:
                logger.exception("request %s failed", parent.request_id)
                self._fail(parent.request_id, e)
        return outputs

    def ping_ranks(self) -> None:
        """While idle: reach every tensor-parallel rank, so that one lost on another host fails the
        engine now rather than at the next request (raises TensorParallelError)."""
        if self.tp_driver is not None:
            self.tp_driver.ping()

    def shutdown(self, keep_compiling: bool = False) -> None:
        """Stop the tensor-parallel ranks, and a compile still building behind unless keep_compiling
        (the CLI's generate leaves it to finish, so that the next run loads it)."""
        runner = getattr(self, "runner", None)
        if runner is not None and not keep_compiling:
            runner.stop_compile()
        publisher, self.kv_events = getattr(self, "kv_events", None), None
        if publisher is not None:
            publisher.close()
        driver, self.tp_driver = self.tp_driver, None
        if driver is not None:
            driver.shutdown()

    def _constrain_proposals(self, scheduled) -> None:
        """Speculating constrained requests' proposals are cut where their grammar refuses one, and
        get a mask row per verified position (structured_output.manager.constrain_proposals)."""
        if not any(scheduled.spec_token_ids):
            return
        start = time.perf_counter()
        kept, bitmask = self._structured_output.constrain_proposals(
            scheduled.requests, scheduled.spec_token_ids
        )
        if bitmask is None:
            return
        for i, (before, after) in enumerate(zip(scheduled.spec_token_ids, kept, strict=True)):
            if len(after) == len(before):
                continue
            probs = scheduled.spec_draft_probs[i]
            scheduled.spec_token_ids[i] = after
            scheduled.spec_draft_probs[i] = probs[: len(after)] if probs is not None else None
            scheduled.num_scheduled_tokens[i] -= len(before) - len(after)
        bitmask.seconds += time.perf_counter() - start
        scheduled.verify_bitmask = bitmask

    def _fill_grammar_bitmask(self, scheduled) -> None:
        """The step's bitmask rows for the constrained requests that sample one token (speculating
        ones got theirs in _constrain_proposals)."""
        start = time.perf_counter()
        # From the step's own start positions: under async scheduling the requests' counters are
        # already advanced past it (and a grammar row is never scheduled with a token pending).
        samples = [
            c + n == r.num_tokens + r.num_pending_tokens
            for r, n, c in zip(
                scheduled.requests, scheduled.num_scheduled_tokens, scheduled.num_computed_tokens, strict=True
            )
        ]
        bitmask = self._structured_output.grammar_bitmask(scheduled.requests, samples)
        if bitmask is not None:
            bitmask.seconds += time.perf_counter() - start
        scheduled.grammar_bitmask = bitmask

    def _fail_grammar_failures(self) -> None:
        for request in self.scheduler.take_grammar_failures():
            error = request.structured_output.error()
            if not isinstance(error, GrammarCompileTimeout):
                error = ValueError(f"grammar compile failed: {error}")
            self._fail(self._child_to_parent.get(request.request_id), error)

    def _wait_for_grammars(self, timeout: float = 0.01) -> None:
        """Nothing could be scheduled: if requests wait for their grammars, sleep until one is
        ready (at most `timeout`) instead of spinning through empty steps."""
        pending = [
            r.structured_output.compiled
            for r in self.scheduler.waiting
            if r.status == RequestStatus.WAITING_FOR_GRAMMAR
        ]
        if pending:
            wait_futures(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def _fail(self, request_id: str | None, error: Exception) -> None:
        """Abort a request (freeing its blocks) and keep the error for take_failed()."""
        if request_id is None or request_id not in self._parents:
            return
        self.abort_request(request_id)
        failed = RequestFailedError(f"the engine failed while running this request: {error!r}")
        failed.__cause__ = error
        self._failed[request_id] = failed

    def take_failed(self) -> dict[str, RequestFailedError]:
        """Requests the steps since the last call failed (already aborted), by request id."""
        failed, self._failed = self._failed, {}
        return failed

    def take_stats(self) -> IterationStats:
        """What happened since the last call (steps and aborts), for the metrics."""
        stats, self._stats = self._stats, IterationStats()
        sched, pc = self.scheduler, self.kv_cache_manager.prefix_cache_stats
        stats.num_preemptions = sched.num_preemptions - self._seen_preemptions
        stats.num_async_steps = self.num_async_steps - self._seen_async_steps
        self._seen_async_steps = self.num_async_steps
        stats.prefix_cache_queries = pc.queries - self._seen_prefix[0]
        stats.prefix_cache_hits = pc.hits - self._seen_prefix[1]
        if self._structured_output is not None:
            stats.grammar_compile_times = self._structured_output.take_compile_times()
        runner = self.runner
        if runner.lora is not None:
            now = runner.lora.stats
            seen = self._seen_lora
            stats.lora_slot_loads = now.slot_loads - seen.slot_loads
            stats.lora_slot_evictions = now.slot_evictions - seen.slot_evictions
            stats.lora_host_evictions = now.host_evictions - seen.host_evictions
            stats.lora_disk_loads = now.disk_loads - seen.disk_loads
            self._seen_lora = dataclasses.replace(now)
            stats.lora_resident = runner.lora.resident_names()
        if self.kv_events is not None:
            queued, dropped = self.kv_events.queued, self.kv_events.dropped
            stats.kv_events_published = queued - self._seen_kv_events[0]
            stats.kv_events_dropped = dropped - self._seen_kv_events[1]
            self._seen_kv_events = (queued, dropped)
        stats.forward = runner.forward_kind
        stats.compile_seconds = runner.compiler_seconds or runner.compile_seconds
        self._seen_preemptions, self._seen_prefix = sched.num_preemptions, (pc.queries, pc.hits)
        return stats

    def _detokenize(self, parent: ParentRequest, i: int, request: Request) -> None:
        detok = parent.detokenizers[i]
        seen = parent.num_fed[i]
        new_ids = request.output_token_ids[seen:]
        if request.status == RequestStatus.FINISHED_STOPPED:
            new_ids = new_ids[:-1]  # the EOS / stop token ends the text; it is not part of it
        if len(new_ids) > 1 and detok.stop:
            # Several tokens in one step (an accepted speculative run): feed them one by one, and
            # if a stop string ends early in the run, the tokens after it were never generated.
            stop = None
            for j, token_id in enumerate(new_ids):
                stop = detok.update([token_id])
                if stop is not None:
                    request.truncate_output(seen + j + 1)
                    break
        else:
            stop = detok.update(new_ids)
        parent.num_fed[i] = request.num_output_tokens
        self._record_token_stats(request, seen)
        if stop is None and request.is_finished:
            # Release text held back for a character still incomplete; it may complete a stop string.
            stop = detok.flush()
        if stop is not None and not request.is_finished:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            request.stop_reason = stop
        elif stop is not None:
            # EOS/length arrived together with the stop string, which cut the text: report it as the
            # reason (as vLLM does), not "length" with a truncated text.
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop
        if request.is_finished:
            self._stats.finished.append(_finished_stats(request))

    def _record_token_stats(self, request: Request, seen: int) -> None:
        stats, times = self._stats, request.token_times
        stats.num_generation_tokens += len(times) - seen
        lora = request.lora_name
        if lora is not None:
            stats.lora_generation_tokens[lora] = stats.lora_generation_tokens.get(lora, 0) + len(times) - seen
            if seen == 0:
                stats.lora_prompt_tokens[lora] = (
                    stats.lora_prompt_tokens.get(lora, 0) + request.num_prompt_tokens
                )
        if seen == 0:
            stats.num_prompt_tokens += request.num_prompt_tokens
            stats.time_to_first_tokens.append(times[0] - request.arrival_time)
        stats.inter_token_latencies.extend(times[j] - times[j - 1] for j in range(max(seen, 1), len(times)))

    def _make_output(self, parent: ParentRequest, deltas: list[CompletionOutput]) -> RequestOutput:
        """The step's delta of one request: its sequences that advanced, each with only its new
        tokens and text."""
        finished = all(c.is_finished for c in parent.children)
        if finished:
            del self._parents[parent.request_id]
            for child in parent.children:
                self._child_to_parent.pop(child.request_id, None)
            self._release_lora(parent)
        first = parent.children[0]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=sorted(deltas, key=lambda c: c.index),
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            prompt_logprobs=first.prompt_logprobs,
        )
