"""The event loop's stall detector (worker/server/loop_watchdog.py): a callback that holds the loop
is reported once, with its stack and length; a loop that only awaits reports nothing."""

from __future__ import annotations

import asyncio
import gc
import time

from prometheus_client import CollectorRegistry

from kvscale.worker.server.loop_watchdog import LoopWatchdog


def _hold_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)  # a blocking call on the loop, as a slow parse or serialisation would be


def _stall_count(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("kvscale_event_loop_stall_seconds_count") or 0.0


async def _run(blocker, registry: CollectorRegistry) -> LoopWatchdog:
    watchdog = LoopWatchdog(registry, threshold_s=0.1, interval_s=0.01)
    watchdog.start()
    try:
        await asyncio.sleep(0.2)
        blocker()
        await asyncio.sleep(0.3)  # the watchdog sees the heartbeat again and records the stall
    finally:
        watchdog.stop()
    return watchdog


def test_a_blocking_callback_is_reported_once_with_its_stack_and_length():
    registry = CollectorRegistry()
    watchdog = asyncio.run(_run(lambda: _hold_the_loop_for(0.4), registry))
    assert _stall_count(registry) == 1
    [(held, stack, in_gc)] = watchdog.recent
    assert 0.3 < held < 1.0, held
    assert any("_hold_the_loop_for" in line for line in stack), stack
    assert not in_gc


def test_a_loop_that_only_awaits_reports_no_stall():
    registry = CollectorRegistry()
    watchdog = asyncio.run(_run(lambda: None, registry))
    assert _stall_count(registry) == 0 and watchdog.recent == []


def test_a_stall_inside_a_garbage_collection_says_so(caplog):
    class Slow:  # a finaliser that blocks, so the collection itself holds the loop
        def __del__(self):
            time.sleep(0.3)

    def collect() -> None:
        a = Slow()
        a.cycle = a
        del a
        gc.collect()

    registry = CollectorRegistry()
    with caplog.at_level("WARNING", logger="kvscale.worker.server.loop_watchdog"):
        watchdog = asyncio.run(_run(collect, registry))
    assert _stall_count(registry) == 1
    assert watchdog.recent[0][2], "the stall happened inside gc.collect()"
    # The collector's own report is logged (its `extra` once named a LogRecord attribute, and the
    # KeyError went to stderr as an unraisable exception from the gc callback instead).
    [pause] = [r for r in caplog.records if r.getMessage() == "garbage collection paused every thread"]
    assert pause.pause_s >= 0.3 and pause.collecting_thread == "MainThread"
