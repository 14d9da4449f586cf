"""A stall detector for the server's event loop: what held it, and for how long.

Every request, every stream and the probes share one event loop; a callback that holds it for
100 ms delays them all (issue 26: /health p100 of 0.4-0.5 s under hostile clients). A heartbeat
task stamps the time every `interval_s`; a watchdog thread checks the stamp and, when it is
older than `threshold_s`, records the loop thread's Python stack at that moment, logged once per
stall with the stall's length once the loop runs again. Whether the cyclic garbage collector was
running is noted too (a full collection over many objects is a stall of its own that no stack
shows). Stalls go into `kvscale_event_loop_stall_seconds`.

The stack is taken with `sys._current_frames()`, which needs the GIL: a loop thread inside one
long C call that keeps the GIL (no bytecode boundary) can only be sampled once it returns, so such
a stall shows the stack after it (the log says how late the sample was).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
import traceback

from prometheus_client import CollectorRegistry, Histogram

logger = logging.getLogger(__name__)

STALL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STACK_DEPTH = 16


class LoopWatchdog:
    def __init__(
        self, registry: CollectorRegistry | None = None, threshold_s: float = 0.1, interval_s: float = 0.02
    ) -> None:
        self.threshold_s, self.interval_s = threshold_s, interval_s
        self.stalls = Histogram(
            "kvscale_event_loop_stall_seconds",
            "How long the server's event loop was held by one callback, for holds past the "
            "watchdog's threshold (the loop then serves no request, stream or probe).",
            buckets=STALL_BUCKETS,
            registry=registry,
        )
        self.recent: list[tuple[float, list[str], bool]] = []  # (seconds, stack, in gc), last 32
        self.last_others: dict[str, str] = {}  # the other threads at the last stall
        self._beat = time.monotonic()
        self._loop_thread: int | None = None
        self._stop = threading.Event()
        self._in_gc = False
        self._gc_started = 0.0
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None

    def _on_gc(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._in_gc, self._gc_started = True, now
            return
        self._in_gc = False
        paused = now - self._gc_started
        if paused > self.threshold_s:  # every thread waited this long: the collector holds the GIL
            logger.warning(
                "garbage collection paused every thread",
                extra={
                    "pause_s": round(paused, 3),
                    "generation": info.get("generation"),
                    "collected": info.get("collected"),
                    # Not "thread": a LogRecord attribute, which `extra` may not overwrite (KeyError).
                    "collecting_thread": threading.current_thread().name,
                },
            )

    async def _heartbeat(self) -> None:
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        """From the loop's thread, with the loop running."""
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._heartbeat())
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            beat = self._beat
            if time.monotonic() - beat <= self.threshold_s:
                continue
            frames = sys._current_frames()  # waits for the GIL
            sampled_after = time.monotonic() - beat
            frame = frames.get(self._loop_thread)
            stack = traceback.format_stack(frame, limit=STACK_DEPTH) if frame is not None else []
            # A loop found waiting (in its selector) was kept from the GIL by another thread:
            # where the others are, as they just gave it up, says which.
            others = _innermost(frames, exclude={self._loop_thread, threading.get_ident()})
            in_gc = self._in_gc
            while self._beat == beat and not self._stop.wait(self.interval_s / 2):
                pass
            held = self._beat - beat - self.interval_s  # the heartbeat's own sleep is no stall
            self.stalls.observe(held)
            self.recent = [*self.recent, (held, stack, in_gc)][-32:]
            self.last_others = others
            logger.warning(
                "event loop stalled",
                extra={
                    "stall_s": round(held, 3),
                    "sampled_after_s": round(sampled_after, 3),
                    "in_gc": in_gc,
                    "stack": "".join(stack[-8:]),
                    "threads": others,
                },
            )


def _innermost(frames: dict, exclude: set[int]) -> dict[str, str]:
    """Each other thread's innermost frame ("file:line in function"), by thread name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in frames.items():
        if ident in exclude:
            continue
        code = frame.f_code
        where = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        out[f"{names.get(ident, 'thread')}-{ident}"] = where
    return out
