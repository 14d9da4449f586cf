"""A prober in a process of its own: GETs each of `paths` in turn every `period` seconds and reads the
server's RSS, until stopped; each probe's start is kept (time.monotonic(): one clock for every
process on Linux), so a benchmark can take the probes of a phase. Its own interpreter, so that the
benchmark client's event loop (encoding and reading its bodies) cannot delay a probe and have it
blamed on the server. A refused, timed-out or non-200 probe is a failure, counted per path (its
latency still recorded)."""

from __future__ import annotations

import multiprocessing
import time


def _probe(base: str, pid: int, paths: tuple[str, ...], period: float, stop, out) -> None:
    import urllib.request

    import psutil

    proc = psutil.Process(pid)
    latencies: dict[str, list[float]] = {p: [] for p in paths}
    sent: dict[str, list[float]] = {p: [] for p in paths}
    failures: dict[str, list[str]] = {p: [] for p in paths}
    rss: list[int] = []
    turn = 0
    while not stop.is_set():
        path = paths[turn % len(paths)]
        turn += 1
        sent[path].append(time.monotonic())
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(base + path, timeout=10) as r:
                r.read()
                if r.status != 200:
                    failures[path].append(f"status {r.status}")
        except OSError as e:
            failures[path].append(repr(e))
        latencies[path].append(time.perf_counter() - t0)
        rss.append(proc.memory_info().rss)
        stop.wait(period)
    out.put((latencies, sent, rss, failures))


class Probe:
    def __init__(
        self, base: str, pid: int, paths: tuple[str, ...] = ("/health",), period: float = 0.02
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop, self._out = ctx.Event(), ctx.Queue()
        self._proc = ctx.Process(
            target=_probe, args=(base, pid, paths, period, self._stop, self._out), daemon=True
        )
        self.latencies: dict[str, list[float]] = {p: [] for p in paths}
        self.sent: dict[str, list[float]] = {p: [] for p in paths}
        self.failures: dict[str, list[str]] = {p: [] for p in paths}
        self.rss: list[int] = []

    @property
    def health(self) -> list[float]:
        return self.latencies["/health"]

    @property
    def health_failures(self) -> int:
        return len(self.failures["/health"])

    def start(self) -> None:
        self._proc.start()

    def stop(self) -> None:
        self._stop.set()
        self.latencies, self.sent, self.rss, self.failures = self._out.get(timeout=60)

    def during(self, path: str, start: float, end: float) -> list[float]:
        """The latencies of `path`'s probes sent between start and end (time.monotonic())."""
        return [
            lat for t, lat in zip(self.sent[path], self.latencies[path], strict=True) if start <= t <= end
        ]
        self._proc.join(10)
