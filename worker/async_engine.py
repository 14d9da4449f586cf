"""AsyncLLM: the engine behind an asyncio front.

The engine runs in its own thread and steps continuously while there is work, so a long forward
pass never blocks the event loop (torch releases the GIL inside its kernels). The event loop
talks to it through a command queue (add, abort); the engine thread hands each step's outputs
back with one `call_soon_threadsafe`. Outputs are cumulative, so a slow client simply skips to
the newest one: a request's stream holds only its latest output, never a growing backlog.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvscale.worker.config import EngineArgs
from kvscale.worker.engine import LLMEngine
from kvscale.worker.metrics import EngineMetrics
from kvscale.worker.outputs import RequestOutput
from kvscale.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; the process must be restarted (liveness turns red)."""


@dataclass
class _Stream:
    latest: RequestOutput | None = None
    error: BaseException | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


class AsyncLLM:
    def __init__(self, args: EngineArgs, model_name: str, metrics: EngineMetrics | None = None) -> None:
        self.args = args
        self.metrics = metrics or EngineMetrics(model_name)
        self.engine: LLMEngine | None = None
        self.dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._streams: dict[str, _Stream] = {}
        self._num_pending_adds = 0  # added on the loop side, not yet seen by the engine thread
        self._thread: threading.Thread | None = None

    # -- lifecycle (event loop side) ------------------------------------------------------------
    async def start(self) -> None:
        """Load the model off the event loop, then start the engine thread."""
        self._loop = asyncio.get_running_loop()
        self.engine = await self._loop.run_in_executor(None, LLMEngine, self.args)
        self._publish_metrics()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.dead is None

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # -- requests (event loop side) -------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        """Requests the server has handed to the engine and not yet seen finish."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted to the running batch (queued in the engine or on their way)."""
        assert self.engine is not None
        return len(self.engine.scheduler.waiting) + self._num_pending_adds

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes. Raises ValueError at once when the
        request can never run. Leaving the iteration early (disconnect, cancel) aborts the request."""
        if self.dead is not None:
            raise EngineDeadError("the engine loop has failed") from self.dead
        assert self.engine is not None
        parent = self.engine.make_request(prompt, params, request_id)
        stream = _Stream()
        self._streams[request_id] = stream
        self._num_pending_adds += 1
        self._commands.put(("add", parent))
        self._wake.set()
        finished = False
        try:
            while not finished:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    raise stream.error
                out = stream.latest
                assert out is not None
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def _dispatch(self, outputs: list[RequestOutput], admitted: int) -> None:
        self._num_pending_adds -= admitted
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:  # gone: the client left and its abort is on the way
                stream.latest = out
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
        while not self._stop:
            self._wake.clear()
            admitted = self._apply_commands(engine)
            if not engine.has_unfinished_requests():
                if admitted:
                    loop.call_soon_threadsafe(self._dispatch, [], admitted)
                self._publish_metrics()
                self._wake.wait()
                continue
            try:
                outputs = engine.step()
            except BaseException as e:  # a bug or an OOM: report, fail every stream, stay dead
                logger.exception("engine step failed")
                self.dead = e
                loop.call_soon_threadsafe(self._fail_all, e)
                return
            self._publish_metrics()
            loop.call_soon_threadsafe(self._dispatch, outputs, admitted)

    def _apply_commands(self, engine: LLMEngine) -> int:
        added = 0
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return added
            if kind == "add":
                added += 1
                try:
                    engine.add_prepared(payload)
                except ValueError as e:  # e.g. a request id already in use
                    self._loop.call_soon_threadsafe(self._fail_one, payload.request_id, e)
            else:
                engine.abort_request(payload)

    def _publish_metrics(self) -> None:
        engine = self.engine
        assert engine is not None
        self.metrics.record(engine.take_stats(), engine.scheduler.stats(), engine.kv_cache_manager.num_blocks)
