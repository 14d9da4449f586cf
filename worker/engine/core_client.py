"""MPAsyncLLM: AsyncLLM with its engine in a process of its own (engine/core_proc.py).

This process keeps everything that faces clients: HTTP, tokenizing prompts, the streams, metrics
(the engine sends its stats with each step), probes. The engine process owns torch, the schedule
and the detokenizer. Both bind the socket they read from and connect the one they write to, so a
send never waits for the other side (ZMQ queues it) and a dead peer never blocks a send.

A dead engine process fails every stream at once and calls `on_dead` (the server exits non-zero
within a second: the pod restarts); the engine process dies with this one (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq
import zmq.asyncio

from kvscale.worker.config import EngineArgs
from kvscale.worker.engine.async_llm import AsyncLLM, EngineDeadError, _Stream
from kvscale.worker.engine.core_launch import EngineProcess
from kvscale.worker.lora.request import LoRARequest
from kvscale.worker.metrics.prometheus import EngineMetrics
from kvscale.worker.model.loader import load_tokenizer
from kvscale.worker.sample.sampling_params import SamplingParams
from kvscale.worker.structured_output.manager import GrammarHandle
from kvscale.worker.structured_output.request import GrammarCompileTimeout

logger = logging.getLogger(__name__)


def compiled_grammar() -> GrammarHandle:
    """What prepare_grammar returns here: the compile is done and cached in the engine process,
    where the request's add finds it; this side holds nothing of it."""
    future: Future = Future()
    future.set_result(None)
    return GrammarHandle(("engine-process",), future, lambda: None)


class MPAsyncLLM(AsyncLLM):
    def __init__(
        self,
        args: EngineArgs,
        model_name: str,
        metrics: EngineMetrics | None = None,
        process: EngineProcess | None = None,
    ) -> None:
        """`process`: the engine process, if the caller started it already (the CLI does, early)."""
        super().__init__(args, model_name, metrics)
        self.on_dead: Callable[[], None] | None = None  # the engine process died (not shut down)
        self.process = process
        self._tokenizer = None
        self._context = zmq.asyncio.Context()
        self._to_engine: zmq.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._ready: asyncio.Future | None = None
        self._exited: asyncio.Future | None = None  # the engine process's exit code
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._engine_waiting = 0  # the scheduler's queue at the engine's last message
        # Requests added and not seen finished, and when the engine was last heard from: what it
        # owes progress on, and since when (liveness).
        self._outstanding: set[str] = set()
        self._last_heard = time.monotonic()
        self._stopping = False

    @property
    def pid(self) -> int | None:
        """The engine process's pid (None before it starts)."""
        return None if self.process is None else self.process.proc.pid

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine process (unless started), load the tokenizer here meanwhile, and wait
        for Ready."""
        self._loop = loop = asyncio.get_running_loop()
        process = self.process = self.process or EngineProcess.spawn(self.args)
        inbox = self._context.socket(zmq.PULL)
        inbox.setsockopt(zmq.RCVHWM, 0)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.bind(process.from_engine)
        # A plain (blocking-API) socket: with no high-water mark a send only queues, never waits.
        self._to_engine = zmq.Context.instance().socket(zmq.PUSH)
        self._to_engine.setsockopt(zmq.SNDHWM, 0)
        self._to_engine.setsockopt(zmq.LINGER, 0)
        self._to_engine.connect(process.to_engine)
        self._ready, self._exited = loop.create_future(), loop.create_future()
        self._reader = asyncio.create_task(self._read(inbox), name="kvscale-engine-outputs")

        def watch() -> None:  # a thread of its own: it waits as long as the engine lives
            code = process.proc.wait()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
                loop.call_soon_threadsafe(self._on_exit, code)

        threading.Thread(target=watch, name="kvscale-engine-watch", daemon=True).start()
        tokenizer = loop.run_in_executor(None, load_tokenizer, self.args.tokenizer or self.args.model)
        self.info = info = await self._ready
        self._tokenizer = await tokenizer
        self.metrics.cache_config(
            self.args.block_size,
            info.num_kv_blocks,
            self.args.enable_prefix_caching,
            self.args.max_loras if self.args.enable_lora else 0,
        )
        self._loaded = True

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine process to stop; kill it after `timeout` s."""
        self._stopping = True
        process = self.process
        if process is not None and self._exited is not None and not self._exited.done():
            self._send(("shutdown",))
            try:
                await asyncio.wait_for(asyncio.shield(self._exited), timeout)
            except TimeoutError:
                logger.error("the engine process did not stop; killing it", extra={"timeout_s": timeout})
                process.proc.kill()
                await self._exited
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._to_engine is not None:
            self._to_engine.close()
        self._context.destroy(linger=0)
        if process is not None:
            process.remove_folder()

    def _on_exit(self, code: int) -> None:
        assert self._exited is not None
        self._exited.set_result(code)
        if self._stopping:
            return
        error = EngineDeadError(f"the engine process exited with code {code}")
        logger.error("the engine process died", extra={"code": code, "pid": self.pid})
        self.dead = error
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._fail_all(error)
        if self.on_dead is not None:
            self.on_dead()

    # -- to and from the engine process ---------------------------------------------------------
    def _send(self, message: tuple) -> None:
        if self._to_engine is not None and not self._to_engine.closed:
            self._to_engine.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    async def _read(self, inbox: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frame = await inbox.recv(copy=False)
                self._last_heard = time.monotonic()
                self._handle(pickle.loads(frame.buffer))
        finally:
            inbox.close(linger=0)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, outputs, failed, stats, self._num_taken = message
            self._record(stats)
            self._dispatch(outputs)
            for out in outputs:
                if out.finished:
                    self._outstanding.discard(out.request_id)
            for request_id, error in failed.items():
                self._outstanding.discard(request_id)
                self._fail_one(request_id, error)
        elif kind == "stats":
            _, stats, self._num_taken = message
            self._record(stats)
        elif kind == "rejected":
            _, request_id, error = message
            self._outstanding.discard(request_id)
            self._fail_one(request_id, error)
        elif kind == "reply":
            _, call_id, error, value = message
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                if error is None:
                    future.set_result(value)
                else:
                    future.set_exception(error)
        elif kind == "ready":
            assert self._ready is not None
            self._ready.set_result(message[1])
        elif kind == "load_failed":
            assert self._ready is not None
            self._stopping = True  # it exits next: a failed load, not a death
            self._ready.set_exception(message[1])
        else:
            logger.error("unknown message from the engine process", extra={"kind": kind})

    def _record(self, stats: tuple) -> None:
        self.metrics.record(*stats)
        self._engine_waiting = stats[1].num_waiting

    def _call_soon(self, method: str, *args: Any) -> tuple[int, asyncio.Future]:
        if self.dead is not None:
            raise EngineDeadError("the engine process has died") from self.dead
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(("call", call_id, method, args))
        return call_id, future

    async def _call(self, method: str, *args: Any) -> Any:
        call_id, future = self._call_soon(method, *args)
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    # -- requests -------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        assert self._tokenizer is not None
        return self._tokenizer

    @property
    def num_waiting(self) -> int:
        in_flight = self._num_submitted - self._num_taken + self._num_preparing
        return self._engine_waiting + in_flight

    @property
    def stalled_since(self) -> float | None:
        """Since when the engine has owed progress: requests are outstanding and it has said
        nothing since then (a step's outputs come at least once per step)."""
        return self._last_heard if self._outstanding else None

    async def _submit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        grammar: GrammarHandle | None,
        lora_request: LoRARequest | None,
    ) -> _Stream:
        """Tokenize here (off the event loop), send the add; the engine makes the request."""
        if isinstance(prompt, str):
            self._num_preparing += params.n
            try:
                loop = asyncio.get_running_loop()
                text, ids = prompt, await loop.run_in_executor(None, self.tokenizer.encode, prompt)
            finally:
                self._num_preparing -= params.n
        else:
            text, ids = None, list(prompt)  # checked against the vocabulary by the engine
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream()
        self._streams[request_id] = stream
        self._num_submitted += params.n
        if not self._outstanding:
            self._last_heard = time.monotonic()  # owed from now, not from the last idle message
        self._outstanding.add(request_id)
        self._send(("add", request_id, ids, text, params, lora_request, time.monotonic()))
        return stream

    def abort(self, request_id: str) -> None:
        self._outstanding.discard(request_id)
        self._send(("abort", request_id))

    def publish_metrics_soon(self) -> None:
        self._send(("metrics",))

    async def prepare_grammar(self, params: SamplingParams, client=None) -> GrammarHandle:
        """The constraint checked and compiled in the engine process, bounded by
        grammar_compile_timeout as in-process; a caller that leaves releases the compile."""
        call_id, future = self._call_soon("prepare_grammar", params, client)
        timeout = self.args.grammar_compile_timeout
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            self._send(("release", call_id))
            raise GrammarCompileTimeout(
                f"the grammar did not compile within {timeout} s (--grammar-compile-timeout); it is "
                "cached if it completes, so a retry may succeed"
            ) from None
        except asyncio.CancelledError:
            self._send(("release", call_id))
            raise
        finally:
            self._calls.pop(call_id, None)
        return compiled_grammar()

    async def add_lora(self, lora_request: LoRARequest, allowed_roots: list[str] | None) -> str:
        return await self._call("add_lora", lora_request, allowed_roots)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._call("remove_lora", lora_int_id)


def make_async_llm(args: EngineArgs, model_name: str, process: EngineProcess | None = None) -> AsyncLLM:
    """The server's engine front: in a process of its own with `engine_process` (`process`, if
    the caller started it already), else a thread."""
    if args.engine_process:
        return MPAsyncLLM(args, model_name, process=process)
    return AsyncLLM(args, model_name)
