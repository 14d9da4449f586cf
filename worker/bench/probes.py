"""Probes against a saturated engine (issue 33, must-show 3's measure): `/health` and `/metrics`
latency while `--streams` streaming completions keep the engine busy.

One fresh `kvscale-worker serve` subprocess (the compiled forward: `kvscale-worker compile` builds
its package first, or finds it built, so the server loads it at start); `--streams` clients each
send long completions back to back (`--max-tokens` each, EOS ignored, greedy) for `--seconds`, so
the engine never idles; a prober in a process of its own (prober.py) GETs `/health` and `/metrics`
in turn every 20 ms throughout. Reported: each path's p50/p99/p100 latency over the probes sent
while every stream was busy (from 1 s after the start to `--seconds`) and failures, the streams'
chunks/s (about a token each), and the goal (p99 < 50 ms for both). Today the engine runs in the
server's process, a thread beside the event loop, sharing its GIL: this is the figure an engine-core
process of its own is to be measured against."""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvscale.worker.bench.prober import Probe
from kvscale.worker.bench.serve import server_command, start_server

P99_GOAL_S = 0.05
PATHS = ("/health", "/metrics")


async def saturate(base: str, streams: int, max_tokens: int, seconds: float) -> dict[str, Any]:
    """`streams` clients sending streaming completions back to back until `seconds` pass; the
    output tokens they received and the errors."""
    import aiohttp

    body = {
        "prompt": "def fibonacci(n):",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    deadline = time.monotonic() + seconds
    chunks, errors = [0], []

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            try:
                async with session.post(base + "/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        errors.append(f"status {resp.status}")
                        continue
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            chunks[0] += 1
            except aiohttp.ClientError as e:
                errors.append(repr(e))

    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(streams)))
        wall = time.monotonic() - started
    return {"wall_s": round(wall, 2), "chunks_per_s": round(chunks[0] / wall, 1), "errors": errors[:5]}


def latency_summary(values: list[float], failures: list[str]) -> dict[str, Any]:
    ms = np.asarray(values) * 1000
    return {
        "probes": len(values),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "p100_ms": round(float(ms.max()), 2),
        "failures": len(failures),
        "failure_samples": failures[:3],
    }


def run(args) -> dict[str, Any]:
    flags = ["--max-num-seqs", str(max(args.streams, 1)), *(args.server_flag or [])]
    if args.enforce_eager:
        flags.append("--enforce-eager")
    else:
        subprocess.run(
            [*server_command(), "--log-format", "text", "compile", "--model", args.model], check=True
        )
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(args.model, flags, Path(tmp) / "server.log")
        try:
            probe = Probe(server.base_url, server.proc.pid, PATHS)
            probe.start()
            time.sleep(2.0)  # the prober's interpreter starts
            # Saturated from the first stream's prefill on; the probes before are idle ones.
            busy = time.monotonic() + 1.0
            load = asyncio.run(saturate(server.base_url, args.streams, args.max_tokens, args.seconds))
            done = busy - 1.0 + args.seconds  # after it, the last requests drain
            probe.stop()
        finally:
            server.stop()
    paths = {p: latency_summary(probe.during(p, busy, done), probe.failures[p]) for p in PATHS}
    met = all(s["p99_ms"] < P99_GOAL_S * 1000 and not s["failures"] for s in paths.values())
    return {
        "model": args.model,
        "streams": args.streams,
        "load": load,
        "probes": paths,
        "goal": {"p99_ms_under": P99_GOAL_S * 1000, "met": met and not load["errors"]},
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "json")},
    }


def add_parser(sub, parents: list) -> None:
    p = sub.add_parser(
        "probes", parents=parents, help="/health and /metrics under a saturated engine (issue 33)"
    )
    p.add_argument("--model", required=True, help="model folder (e.g. ../shared/models/tiny-code-target)")
    p.add_argument("--streams", type=int, default=64, help="completions in flight")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per completion (EOS ignored)")
    p.add_argument("--seconds", type=float, default=30.0, help="how long the streams keep the engine busy")
    p.add_argument("--enforce-eager", action="store_true", help="the eager forward (no package to build)")
    p.add_argument("--server-flag", action="append", help="extra `serve` flag (repeatable)")
    p.set_defaults(func=run)
