"""EngineCoreProc: the engine in a process of its own (vLLM V1's engine core).

The API process (engine/core_client.py) starts `python -m kvscale.worker.engine.core_proc`, writes
the EngineArgs and two socket addresses to its stdin, and from then on the two talk over ZMQ
(PUSH/PULL over ipc sockets in a private folder, pickled tuples): requests, aborts and calls in,
each step's outputs and stats out. This process schedules, runs the forward, samples, detokenizes
and checks stops; it owns torch and its OpenMP threads, so nothing the HTTP side does (parsing,
SSE framing, probes, a collection of its heap) takes the GIL from a step, and nothing a step does
holds a probe.

Messages in (API -> engine):
  ("add", request_id, prompt_ids, prompt_text, params, lora_request, arrival_time)
  ("abort", request_id)
  ("call", call_id, method, args)    -> ("reply", call_id, error, value)
  ("release", call_id)               a prepare_grammar whose caller stopped waiting
  ("metrics",)                       publish the stats now, idle or not
  ("shutdown",)
Messages out (engine -> API):
  ("ready", EngineInfo) | ("load_failed", error)
  ("step", outputs, failed, stats, num_taken)    stats: (IterationStats, SchedulerStats, blocks)
  ("stats", stats, num_taken)                    published while idle
  ("rejected", request_id, error)                make_request refused it (it can never run)
  ("reply", call_id, error, value)

The process dies with its parent (PR_SET_PDEATHSIG): a `kill -9` of the API process leaves no
engine behind, and the tensor-parallel ranks this engine starts die with it in turn.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import zmq

from kvscale.worker.config import EngineArgs
from kvscale.worker.engine.async_llm import stats_due
from kvscale.worker.engine.engine_info import EngineInfo
from kvscale.worker.executor.rank_worker import die_with_parent

logger = logging.getLogger("kvscale.worker.engine.core_proc")  # __main__ when run with -m

# An idle tensor-parallel engine reaches its ranks this often (seconds), as in the in-process loop.
RANK_PING_INTERVAL_MS = 2000
# An idle engine whose compiled forward is being built behind looks for it this often.
COMPILE_POLL_MS = 500


def dumps(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def picklable_error(error: BaseException) -> BaseException:
    """The error itself when it survives pickling (ValueError, PoolFull...), else a RuntimeError
    with its text: an error the other side cannot rebuild must still reach it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class _Outbox:
    """Sends to the API process from any thread: ZMQ sockets are not thread-safe, so each thread
    (the step loop, the call threads, the grammar compile pool's callbacks) gets its own PUSH
    socket to the API's PULL."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self._context, self._address = context, address
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()

    def send(self, message: tuple) -> None:
        sock = getattr(self._local, "socket", None)
        if sock is None:
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the API reads as fast as we step
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(self._address)
            self._local.socket = sock
            with self._lock:
                self._sockets.append(sock)
        sock.send(dumps(message), copy=False)

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                sock.close()


class EngineCoreProc:
    def __init__(self, args: EngineArgs, input_address: str, output_address: str) -> None:
        self.args = args
        self.context = zmq.Context()
        # Bound here before the model loads: the API process connects and may queue requests
        # (never before Ready, but a connect races nothing this way).
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.RCVHWM, 0)
        self.inbox.bind(input_address)
        self.input_address = input_address
        self.outbox = _Outbox(self.context, output_address)
        self.engine = None
        # Calls that read from disk (an adapter) run here, off the step loop.
        self.calls = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvscale-call")
        # prepare_grammar calls whose compile is still running: call id -> handle.
        self.grammars: dict[int, object] = {}
        self.num_taken = 0  # sequences of added requests taken off the inbox (the API's num_waiting)
        self._sent: tuple[float, tuple] = (0.0, ())  # (when, _state()) of the last step or stats message
        self.stopping = False

    # -- lifecycle --------------------------------------------------------------------------
    def run(self) -> int:
        from kvscale.worker.engine.llm_engine import LLMEngine

        if self.args.tensor_parallel_size > 1:
            from kvscale.worker.executor.launcher import on_group_failure

            # A rank died (its monitor has killed this host's others): a collective with a dead peer
            # may never return, so exit now; the API process sees it and exits in turn.
            on_group_failure(lambda reason: os._exit(1))
        try:
            self.engine = engine = LLMEngine(self.args)
            # The grammar library's vocabulary tables before Ready, as in the in-process engine.
            with contextlib.suppress(ValueError):
                _ = engine.structured_output
            compiler = engine.runner.compiler
            if compiler is not None:
                compiler.on_done = self._wake
        except BaseException as e:
            logger.exception("the engine failed to load")
            self.outbox.send(("load_failed", picklable_error(e)))
            self.outbox.close()
            return 1
        self.outbox.send(("ready", EngineInfo.of(engine)))
        self._publish_idle()
        try:
            self._loop()
        except BaseException:
            logger.exception("the engine loop failed; the engine process exits")
            return 1
        finally:
            self.calls.shutdown(wait=False, cancel_futures=True)
            engine.shutdown()
            self.outbox.close()
        return 0

    def _wake(self) -> None:
        """Wake an idle loop from another thread (a compiled forward finished building)."""
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.input_address)
        sock.send(dumps(("metrics",)))
        sock.close()

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while not self.stopping:
            busy = engine.has_unfinished_requests()
            if not busy:
                timeout = None
                if engine.tp_driver is not None:
                    timeout = RANK_PING_INTERVAL_MS
                elif engine.runner.compiler is not None:
                    timeout = COMPILE_POLL_MS
                if not poller.poll(timeout):
                    if engine.tp_driver is not None:
                        engine.ping_ranks()  # a lost rank ends the loop (TensorParallelError)
                    engine.runner.maybe_switch()
                    continue
            self._take_inbox()
            if self.stopping:
                return
            if not engine.has_unfinished_requests():
                engine.runner.maybe_switch()  # a compiled forward built behind, between two steps
                self._publish_idle()
                continue
            outputs = engine.step()
            failed = {rid: picklable_error(e) for rid, e in engine.take_failed().items()}
            now = time.monotonic()
            # Under --stream-interval most steps have no outputs, and each message wakes the API
            # process: such a step sends one only when its stats are due (an add taken, whose
            # num_waiting the API waits for, a request count changed, or 20 ms passed: liveness
            # then also hears from a stepping engine that often).
            state = self._state()
            if outputs or failed or stats_due(self._sent, now, state):
                self.outbox.send(("step", outputs, failed, self._stats(), self.num_taken))
                self._sent = (now, state)

    def _state(self) -> tuple[int, int, int]:
        """What the API process must never see stale: adds taken, requests running and waiting."""
        sched = self.engine.scheduler
        return self.num_taken, len(sched.running), len(sched.waiting)

    def _stats(self) -> tuple:
        engine = self.engine
        return engine.take_stats(), engine.scheduler.stats(), engine.kv_cache_manager.num_blocks

    def _publish_idle(self) -> None:
        self.outbox.send(("stats", self._stats(), self.num_taken))
        self._sent = (time.monotonic(), self._state())

    def _take_inbox(self) -> None:
        """Apply every message waiting, without blocking."""
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._apply(pickle.loads(raw.buffer))

    def _apply(self, message: tuple) -> None:
        engine = self.engine
        kind = message[0]
        if kind == "add":
            _, request_id, prompt_ids, prompt_text, params, lora_request, arrival = message
            self.num_taken += params.n
            try:
                parent = engine.make_request(
                    prompt_ids, params, request_id, arrival, lora_request=lora_request
                )
                parent.prompt = prompt_text
                engine.add_prepared(parent)
            except ValueError as e:  # it can never run, or its id is in use
                self.outbox.send(("rejected", request_id, picklable_error(e)))
        elif kind == "abort":
            engine.abort_request(message[1])
        elif kind == "call":
            self._call(*message[1:])
        elif kind == "release":
            handle = self.grammars.pop(message[1], None)
            if handle is not None:
                handle.release()
        elif kind == "metrics":
            self._publish_idle()
        elif kind == "shutdown":
            self.stopping = True
        else:
            logger.error("unknown message from the API process", extra={"kind": kind})

    # -- calls ------------------------------------------------------------------------------
    def _reply(self, call_id: int, error: BaseException | None, value=None) -> None:
        self.outbox.send(("reply", call_id, None if error is None else picklable_error(error), value))

    def _call(self, call_id: int, method: str, args: tuple) -> None:
        engine = self.engine
        if method == "prepare_grammar":
            self._prepare_grammar(call_id, *args)
        elif method == "add_lora":
            future = self.calls.submit(lambda: engine.add_lora(*args).digest)
            future.add_done_callback(lambda f: self._reply_with(call_id, f))
        elif method == "remove_lora":
            removed = engine.remove_lora(*args)
            self._reply(call_id, None, removed)
            self._publish_idle()  # no longer resident for the router, even while idle
        else:
            self._reply(call_id, ValueError(f"unknown call {method!r}"))

    def _reply_with(self, call_id: int, future: Future) -> None:
        error = future.exception()
        self._reply(call_id, error, None if error is not None else future.result())

    def _prepare_grammar(self, call_id: int, params, client) -> None:
        """Check the constraint and start (or find) its compile here, on the loop (budget checks,
        no parsing); the reply goes when the compile is done, from the compile pool's thread. The
        compiled grammar stays in this process's cache, where the request's add finds it."""
        try:
            handle = self.engine.prepare_grammar(params, client)
        except Exception as e:  # ValueError, PoolFull
            self._reply(call_id, e)
            return
        self.grammars[call_id] = handle

        def done(future: Future) -> None:
            self.grammars.pop(call_id, None)
            if future.cancelled():
                self._reply(call_id, RuntimeError("the grammar compile was cancelled"))
            else:
                self._reply(call_id, future.exception())

        handle.future.add_done_callback(done)


def main() -> int:
    """`python -m kvscale.worker.engine.core_proc`: read (args, input address, output address,
    parent pid, log level, log format) from stdin (pickled), run the engine until told to stop."""
    args, input_address, output_address, parent_pid, log_level, log_format = pickle.load(sys.stdin.buffer)
    die_with_parent(parent_pid)
    # The API process decides when to stop (after its drain) and says so; a Ctrl-C in a terminal
    # reaches the whole process group, and must not end the engine under the streams it drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from kvscale.common.json_logging import configure_logging

    configure_logging(log_level, log_format)
    from kvscale.worker.engine.async_llm import ENGINE_THREAD, name_native_thread

    name_native_thread(ENGINE_THREAD)
    proc = EngineCoreProc(args, input_address, output_address)
    logger.info("engine process started", extra={"pid": os.getpid()})
    return proc.run()


if __name__ == "__main__":
    sys.exit(main())
