"""AsyncLLM: the engine behind an asyncio front.

The engine runs in its own thread and steps continuously while there is work, so a long forward
pass never blocks the event loop (torch releases the GIL inside its kernels). The event loop
talks to it through a command queue (add, abort); the engine thread hands each step's outputs
back with one `call_soon_threadsafe`. Outputs are deltas (only what each step added); the deltas
a slow client has not taken yet merge into one, so its stream holds one pending output, never a
queue of them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field

from kvscale.worker.config import EngineArgs
from kvscale.worker.engine.engine_info import EngineInfo
from kvscale.worker.engine.llm_engine import LLMEngine
from kvscale.worker.engine.outputs import RequestOutput, RequestOutputAccumulator, add_delta
from kvscale.worker.lora.request import LoRARequest
from kvscale.worker.metrics.prometheus import EngineMetrics
from kvscale.worker.sample.sampling_params import SamplingParams
from kvscale.worker.structured_output.manager import GrammarHandle
from kvscale.worker.structured_output.request import GrammarCompileTimeout

logger = logging.getLogger(__name__)

ENGINE_THREAD = "kvscale-engine"  # at most 15 bytes: Linux's limit for a thread's name


def name_native_thread(name: str) -> None:
    """Give the calling thread `name` in the OS too (Python sets it itself only from 3.14)."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # a name is a convenience; never a reason not to serve


# While it steps, the engine thread publishes its metrics at most this often (seconds), unless a
# step changed the running or waiting requests (the autoscaler ranks workers by them, the routers
# read them: they are never stale) or finished or failed one (a client that has its whole answer
# finds it counted). Publishing took ~0.1 ms, 3-5 % of a one-stream step; the counters lose nothing
# (the engine's stats accumulate meanwhile), and a scrape cannot tell KV usage 20 ms old.
METRICS_INTERVAL = 0.02


def stats_due(last: tuple[float, tuple], now: float, state: tuple) -> bool:
    """Whether the engine's stats go out though nothing else sends them: `state` (the request counts
    the API side must never see stale) changed since `last` = (when, state) of the last time they
    went out, or METRICS_INTERVAL has passed. The engine thread's publish and the engine process's
    step messages both follow it."""
    at, last_state = last
    return state != last_state or now - at >= METRICS_INTERVAL


def publish_due(
    published: tuple[float, tuple[int, int]],
    now: float,
    counts: tuple[int, int],
    outputs: list[RequestOutput],
) -> bool:
    """Whether the engine thread publishes its metrics after a step with these outputs, `counts`
    (running, waiting) now; `published`: (when, counts) of the last publish."""
    return stats_due(published, now, counts) or any(o.finished for o in outputs)


class EngineDeadError(RuntimeError):
    """The engine loop failed; the process must be restarted (liveness turns red)."""


@dataclass
class _Stream:
    # Deltas not yet taken: the one delta itself, or several merged (a client that fell behind).
    # Most steps find the previous delta taken, and hand theirs over as it is.
    pending: RequestOutput | RequestOutputAccumulator | None = None
    error: BaseException | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


# An idle tensor-parallel engine reaches its ranks this often (seconds): a rank lost on another host
# then fails /health within about this long, request or not.
RANK_PING_INTERVAL = 2.0


class AsyncLLM:
    def __init__(self, args: EngineArgs, model_name: str, metrics: EngineMetrics | None = None) -> None:
        self.args = args
        self.metrics = metrics or EngineMetrics(model_name)
        self.engine: LLMEngine | None = None
        self.info: EngineInfo | None = None  # the loaded engine's limits (set with `engine`)
        # Set by the engine thread once the engine and its warm-up are done (`engine` is set before
        # the grammar tables are built): until then the server says "loading".
        self._loaded = False
        self.dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._streams: dict[str, _Stream] = {}
        # Sequences of added requests, counted when the event loop queues the add and again when the
        # engine thread takes it: each counter has a single writer, so no update is ever lost.
        self._num_submitted = 0
        self._num_preparing = 0  # sequences of requests being made off the loop (generate)
        self._num_taken = 0
        # (_num_submitted after the add, when it was queued) of adds the engine thread may not have
        # taken yet; event loop side. A thread hung while idle never starts a pass (busy_since
        # stays None), but the adds it does not take show it.
        self._added_at: collections.deque[tuple[int, float]] = collections.deque()
        self._thread: threading.Thread | None = None
        # When the engine thread's current pass over its loop began (time.monotonic()); None while
        # it sleeps for want of work. Written by the engine thread only, read by liveness: a pass
        # that never ends (a step, a command or a metrics update that never returns) is a stuck
        # engine, wherever in the loop it hangs.
        self.busy_since: float | None = None
        # (monotonic time, (running, waiting)) of the engine thread's last publish of its metrics.
        self._published: tuple[float, tuple[int, int]] = (0.0, (0, 0))

    # -- lifecycle (event loop side) ------------------------------------------------------------
    async def start(self) -> None:
        """Load the model in the engine thread, off the event loop, and keep stepping there.

        Every torch call happens on that one thread: the OpenMP (libgomp) thread pool belongs to
        the thread that first ran a parallel op, so loading in one thread and stepping in another
        would run two pools on the same cores, whose workers then sleep between ops (measured:
        every kernel slower, 25% fewer tokens/s at 64 streams).
        """
        self._loop = loop = asyncio.get_running_loop()
        loaded: asyncio.Future = loop.create_future()

        def main() -> None:
            # The OS sees the name too (top -H, /proc/<pid>/task/*/comm): what an operator looking
            # at a hung worker, and the stuck-engine e2e test, find the thread by.
            name_native_thread(ENGINE_THREAD)
            try:
                self.engine = LLMEngine(self.args)
                self.info = EngineInfo.of(self.engine)
                # The grammar library's vocabulary tables, before Ready: built by the first
                # constrained request, they held the GIL (and so the event loop) for ~100 ms.
                with contextlib.suppress(ValueError):  # no xgrammar: constraints are refused later
                    _ = self.engine.structured_output
                compiler = self.engine.runner.compiler
                if compiler is not None:  # built behind: an idle engine thread installs it too
                    compiler.on_done = self._wake.set
                self.metrics.cache_config(
                    self.args.block_size,
                    self.engine.kv_cache_manager.num_blocks,
                    self.args.enable_prefix_caching,
                    self.args.max_loras if self.args.enable_lora else 0,
                )
                self._publish_metrics()
            except BaseException as e:
                loop.call_soon_threadsafe(loaded.set_exception, e)
                return
            self._loaded = True
            loop.call_soon_threadsafe(loaded.set_result, None)
            try:
                self._run()
            finally:  # the tensor-parallel ranks stop with the engine thread (which owns torch)
                self.engine.shutdown()

        self._thread = threading.Thread(target=main, name=ENGINE_THREAD, daemon=True)
        self._thread.start()
        await loaded

    @property
    def is_ready(self) -> bool:
        return self._loaded and self.dead is None

    # -- what the server asks of the engine besides requests ------------------------------------
    @property
    def tokenizer(self):
        assert self.engine is not None
        return self.engine.tokenizer

    async def add_lora(self, lora_request: LoRARequest, allowed_roots: list[str] | None) -> str:
        """Read and check an adapter (LLMEngine.add_lora, off the event loop); its weights' digest.
        ValueError says why it will not be served."""
        assert self.engine is not None
        loop = asyncio.get_running_loop()
        adapter = await loop.run_in_executor(None, self.engine.add_lora, lora_request, allowed_roots)
        return adapter.digest

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests already running on it finish on it."""
        assert self.engine is not None
        removed = self.engine.remove_lora(lora_int_id)
        self.publish_metrics_soon()  # no longer resident for the router, even while idle
        return removed

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; give up after `timeout` s (a stuck thread never stops, and a
        daemon thread does not hold the process, so the pod exits on SIGTERM, not SIGKILL)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
            if self._thread.is_alive():
                logger.error(
                    "the engine thread did not stop; exiting without it", extra={"timeout_s": timeout}
                )

    def publish_metrics_soon(self) -> None:
        """Have the engine thread publish its metrics now, idle or not (it does after each step and
        when it goes idle): a change made between steps, an adapter unloaded out of its slot, then
        shows within one pass instead of at the next request."""
        self._wake.set()

    @property
    def stalled_since(self) -> float | None:
        """Since when the engine thread has owed progress (None: it owes none): the start of its
        current loop pass, or the oldest add it has not taken yet. Event loop side."""
        self._forget_taken_adds()
        owed = [
            t for t in (self.busy_since, self._added_at[0][1] if self._added_at else None) if t is not None
        ]
        return min(owed, default=None)

    def _forget_taken_adds(self) -> None:
        while self._added_at and self._added_at[0][0] <= self._num_taken:
            self._added_at.popleft()

    # -- requests (event loop side) -------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        """Requests the server has handed to the engine and not yet seen finish."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted to the running batch (queued in the engine or on their way)."""
        assert self.engine is not None
        # The engine thread counts an add as taken before the scheduler queues it: never counted twice.
        in_flight = self._num_submitted - self._num_taken + self._num_preparing
        return len(self.engine.scheduler.waiting) + in_flight

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        grammar: GrammarHandle | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield deltas (what is new since the previous one) until the request finishes. Raises
        ValueError at once when the request can never run. Leaving the iteration early
        (disconnect, cancel) aborts the request. A constrained request needs `grammar`, from
        prepare_grammar (prepared here when not given). make_request (tokenizing, bad words) runs
        in the default executor: nothing client-shaped is parsed on the event loop."""
        if self.dead is not None:
            raise EngineDeadError("the engine loop has failed") from self.dead
        if params.structured_outputs is not None and grammar is None:
            grammar = await self.prepare_grammar(params)
        stream = await self._submit(prompt, params, request_id, grammar, lora_request)
        finished = False
        try:
            while not finished:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    raise stream.error
                pending, stream.pending = stream.pending, None
                assert pending is not None
                out = pending if isinstance(pending, RequestOutput) else pending.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def _submit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        grammar: GrammarHandle | None,
        lora_request: LoRARequest | None,
    ) -> _Stream:
        """Make the request and queue it for the engine thread; its stream is registered."""
        assert self.engine is not None
        engine = self.engine
        # Counted as waiting while it is made, so that the admission check of a request arriving
        # meanwhile sees it (the server's check and this add are not one step any more).
        self._num_preparing += params.n
        try:
            parent = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: engine.make_request(
                    prompt, params, request_id, grammar=grammar, lora_request=lora_request
                ),
            )
        finally:
            self._num_preparing -= params.n
        stream = _Stream()
        self._streams[request_id] = stream
        self._num_submitted += len(parent.children)
        self._forget_taken_adds()  # bounded by the adds in flight, with or without probes
        self._added_at.append((self._num_submitted, time.monotonic()))
        self._commands.put(("add", parent))
        self._wake.set()
        return stream

    async def prepare_grammar(self, params: SamplingParams, client: Hashable = None) -> GrammarHandle:
        """The constraint checked and compiled (or taken from the cache) before the request is
        queued, all off the event loop; the wait counts toward no admission cap, and it is bounded
        by grammar_compile_timeout (GrammarCompileTimeout). A caller that leaves (cancelled) stops
        waiting: a compile nobody else waits for is dropped unrun. Raises ValueError for a
        constraint that cannot be enforced, PoolFull while the compile queues are full."""
        assert self.engine is not None
        loop = asyncio.get_running_loop()
        handle = await loop.run_in_executor(None, self.engine.prepare_grammar, params, client)
        waiting = asyncio.wrap_future(handle.future)
        # Never cancel `waiting`: that would cancel the compile other requests share.
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            done, _ = await asyncio.wait([waiting], timeout=self.args.grammar_compile_timeout)
        except BaseException:
            handle.release()
            raise
        if not done:
            handle.release()
            raise GrammarCompileTimeout(
                f"the grammar did not compile within {self.args.grammar_compile_timeout} s "
                "(--grammar-compile-timeout); it is cached if it completes, so a retry may succeed"
            )
        if waiting.cancelled():  # the pool shut down
            raise EngineDeadError("the grammar compile was cancelled: the server is shutting down")
        error = waiting.exception()
        if error is not None:
            raise error if isinstance(error, ValueError) else ValueError(f"grammar compile failed: {error}")
        return handle

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # gone: the client left and its abort is on the way
                continue
            pending = stream.pending
            if pending is None:
                stream.pending = out
            elif isinstance(pending, RequestOutput):  # the client is behind: merge from now on
                stream.pending = add_delta(RequestOutputAccumulator(pending), out)
            else:
                pending.add(out)
            stream.event.set()

    def _fail_one(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.error = error
            stream.event.set()

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.error = EngineDeadError(f"the engine loop failed: {error!r}")
            stream.event.set()

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine, loop = self.engine, self._loop
        assert engine is not None and loop is not None
        try:
            self._step_until_stopped(engine, loop)
        # A step fails a request alone where it can (RequestFailedError to that stream); what still
        # escapes (a broken device, a bug in an add/abort) fails every stream and the engine stays dead.
        except BaseException as e:
            logger.exception("engine step failed")
            self.dead = e
            loop.call_soon_threadsafe(self._fail_all, e)

    def _step_until_stopped(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            self.busy_since = time.monotonic()
            # Clear the wake-up before looking at _stop: a shutdown() landing between the two would
            # otherwise have its wake-up cleared, and the thread would sleep forever (join hangs).
            self._wake.clear()
            if self._stop:
                return
            self._apply_commands(engine)
            if not engine.has_unfinished_requests():
                engine.runner.maybe_switch()  # a compiled forward built behind, between two steps
                self._publish_metrics()
                self.busy_since = None
                if engine.tp_driver is None:
                    self._wake.wait()
                elif not self._wake.wait(RANK_PING_INTERVAL):
                    engine.ping_ranks()  # a lost rank ends the loop (TensorParallelError)
                continue
            outputs = engine.step()
            if self._stop:  # shut down while the step ran (shutdown gave up on it): nobody listens
                return
            failed = engine.take_failed()
            sched = engine.scheduler
            counts = (len(sched.running), len(sched.waiting))
            if failed or publish_due(self._published, time.monotonic(), counts, outputs):
                self._publish_metrics()
            if outputs:  # none in most steps under --stream-interval: the loop sleeps on
                loop.call_soon_threadsafe(self._dispatch, outputs)
            for request_id, error in failed.items():  # failed alone; the engine goes on
                loop.call_soon_threadsafe(self._fail_one, request_id, error)

    def _apply_commands(self, engine: LLMEngine) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._num_taken += len(payload.children)
                try:
                    engine.add_prepared(payload)
                except ValueError as e:  # e.g. a request id already in use
                    self._loop.call_soon_threadsafe(self._fail_one, payload.request_id, e)
            else:
                engine.abort_request(payload)

    def _publish_metrics(self) -> None:
        engine = self.engine
        assert engine is not None
        sched = engine.scheduler.stats()
        self._published = (time.monotonic(), (sched.num_running, sched.num_waiting))
        self.metrics.record(engine.take_stats(), sched, engine.kv_cache_manager.num_blocks)
