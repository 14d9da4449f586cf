"""Serving benchmark: the real HTTP server under streaming load, against the offline engine, on the
same seeded workload (`code_workload`), greedy, EOS ignored.

1. offline: `kvscale.worker.LLM` with the server's engine args runs the workload
   (`throughput.run_engine`), never while a server runs (they would share the cores);
   `http_over_offline` is the median over --ratio-rounds rounds of HTTP tokens/s at the largest
   concurrency divided by the mean of the offline runs just before and just after it;
2. for each concurrency C: a fresh `kvscale-worker serve` subprocess (fresh, so that no level is
   served from the prefix cache an earlier level filled), a warm-up, then every request as a
   streaming completion (token-id prompt, `max_tokens` = its output length, `ignore_eos`,
   `stream_options.include_usage`) from an asyncio client holding at most C in flight.

Per request: TTFT (request sent -> first chunk carrying text), the gaps between chunks carrying
text, end-to-end latency, and completion tokens from the final usage chunk (from a server that
sends none, the chunks carrying text). ITL is measured per chunk: a chunk usually carries one
token, but may carry several (text the detokenizer held back, or steps a slow client skipped),
so `chunks_per_token` says how close per-chunk is to per-token; TPOT (time per output token
after the first: (last chunk - first chunk) / (tokens - 1)) is the per-token figure. Output
tokens/s = all completion tokens / wall time of the level. Each level also reports the CPU
seconds the client and the server process used during it (both share the machine).
`--profile-server` runs each server with every thread under cProfile (stats files next to the
server logs) to see where the server's time goes.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvscale.worker.bench.workload import Workload

GOAL_HTTP_OVER_OFFLINE = 0.9
WARMUP_PROMPT = [0, 5, 6, 7]


# -- the server subprocess ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command() -> list[str]:
    exe = Path(sys.executable).with_name("kvscale-worker")  # the entry point of this same venv
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "kvscale.worker.cli"]


def serve_args(
    model: str, port: int, flags: list[str] | tuple[str, ...], host: str = "127.0.0.1"
) -> list[str]:
    """The worker CLI's arguments for a server on host:port (a loopback address)."""
    return ["serve", "--model", model, "--host", host, "--port", str(port), *flags]


# Runs the server with every thread under its own cProfile (the engine steps in a thread of its
# own, which `python -m cProfile` would miss); each thread's stats go to PREFIX.<thread name>.
_PROFILED_SERVER = """
import cProfile, os, runpy, sys, threading
prefix = os.environ["KVSCALE_BENCH_PROFILE"]
thread_run = threading.Thread.run
def run(self):
    prof = cProfile.Profile()
    prof.enable()
    try:
        thread_run(self)
    finally:
        prof.disable()
        prof.dump_stats(f"{prefix}.{''.join(c if c.isalnum() else '_' for c in self.name)}")
threading.Thread.run = run
main = cProfile.Profile()
main.enable()
try:
    sys.argv = ["kvscale-worker", *sys.argv[1:]]
    runpy.run_module("kvscale.worker.cli", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
finally:
    main.disable()
    main.dump_stats(f"{prefix}.main")
"""


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    startup_s: float | None = None  # process start to ready (set by launch)
    ready_path: str = "/ready"  # answers 200 once the server serves (llama-server: /health)
    host: str = "127.0.0.1"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + self.ready_path, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready after {timeout}s:\n{self.log_tail()}")

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the server process and the processes under it (the engine
        process, ranks), all threads (Linux /proc; None elsewhere)."""
        ticks, todo, seen = 0, [self.proc.pid], set()
        while todo:
            pid = todo.pop()
            seen.add(pid)
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split() if int(c) not in seen]
            except OSError:
                if pid == self.proc.pid:
                    return None
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def launch(
    cmd: list[str],
    port: int,
    log_path: Path,
    env: dict[str, str] | None = None,
    ready_path: str = "/ready",
    timeout: float = 600.0,
) -> ServerProcess:
    """Any HTTP server process on localhost:port (ours or a peer's), waited for until ready."""
    started = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, port, log_path, ready_path=ready_path)
    try:
        server.wait_ready(timeout)
    except BaseException:
        server.stop()
        raise
    # Process start to ready: what a new worker takes before it serves (the autoscaling
    # simulator's load time, docs/autoscaling.md).
    server.startup_s = time.monotonic() - started
    return server


def start_server(
    model: str, flags: list[str], log_path: Path, profile_prefix: str | None = None, timeout: float = 600.0
) -> ServerProcess:
    port = free_port()
    args = serve_args(model, port, flags)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if profile_prefix is None:
        cmd = [*server_command(), *args]
    else:
        cmd = [sys.executable, "-c", _PROFILED_SERVER, *args]
        env["KVSCALE_BENCH_PROFILE"] = profile_prefix
    return launch(cmd, port, log_path, env, timeout=timeout)


# -- the client --------------------------------------------------------------------------------
@dataclass
class RequestResult:
    expected_tokens: int
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    completion_tokens: int = 0
    usage_reported: bool = False  # False: completion_tokens counts the chunks carrying text
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)


async def _stream_one(session, url: str, prompt: list[int], max_tokens: int) -> RequestResult:
    import aiohttp

    result = RequestResult(max_tokens)
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result.start = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for line in resp.content:  # one SSE field per line
                now = time.perf_counter()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    return result
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    result.chunk_times.append(now)
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                    result.usage_reported = True
    except (aiohttp.ClientError, TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.end = time.perf_counter()
    if not result.usage_reported:  # a server without stream_options: one token per chunk
        result.completion_tokens = len(result.chunk_times)
    if not result.chunk_times:
        result.error = "no text in the stream"
    elif result.completion_tokens != max_tokens:
        result.error = f"{result.completion_tokens} completion tokens, expected {max_tokens}"
    return result


PROBE_PATHS = ("/health", "/metrics")
# Seconds between two probes of one path (--probe-interval). Far more often than a kubelet or
# Prometheus asks, to sample the latencies under load; they cost the served figure ~0.1 of its
# ratio to the offline engine at 8 streams on 2 cores (docs/benchmarks.md), hence 0 to turn them off.
PROBE_INTERVAL = 0.05


async def _probe(session, base_url: str, path: str, latencies: list[float], interval: float) -> None:
    """GET `path` every `interval` s until cancelled, as a kubelet or Prometheus would."""
    while True:
        start = time.perf_counter()
        async with session.get(base_url + path) as resp:
            await resp.read()
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(interval)


async def run_level(
    base_url: str,
    workload: Workload,
    concurrency: int,
    force_close: bool = False,
    probe_interval: float = 0.0,
) -> dict[str, Any]:
    """All requests of the workload, in order, at most `concurrency` in flight. `force_close`: a
    connection per request (llama-server closes some reused keep-alive connections after a stream).
    `probe_interval` > 0: /health and /metrics are polled that often meanwhile (their latencies in
    `probe_ms`)."""
    import aiohttp

    limit = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0, force_close=force_close)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    probes: dict[str, list[float]] = {path: [] for path in PROBE_PATHS} if probe_interval > 0 else {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(prompt: list[int], n: int) -> RequestResult:
            async with limit:
                return await _stream_one(session, base_url, prompt, n)

        probers = [
            asyncio.create_task(_probe(session, base_url, p, v, probe_interval)) for p, v in probes.items()
        ]
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one(p, n) for p, n in zip(workload.prompts, workload.output_lens, strict=True))
        )
        wall = time.perf_counter() - start
        for task in probers:
            task.cancel()
        await asyncio.gather(*probers, return_exceptions=True)
    level = summarize(results, wall, concurrency)
    if probes:
        level["probe_ms"] = {
            path: {**_ms_percentiles(v), "max": round(max(v) * 1000.0, 2) if v else None, "n": len(v)}
            for path, v in probes.items()
        }
    return level


def _ms_percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(values) * 1000.0, [50, 99])
    return {"p50": round(float(p50), 2), "p99": round(float(p99), 2)}


def summarize(results: list[RequestResult], wall: float, concurrency: int) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    tokens = sum(r.completion_tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(errors),
        "error_samples": errors[:3],
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 1),
        "ttft_ms": _ms_percentiles([r.ttft for r in ok]),
        "itl_ms_per_chunk": _ms_percentiles([x for r in ok for x in r.itls]),
        "tpot_ms": _ms_percentiles([t for r in ok if (t := r.tpot) is not None]),
        "e2e_ms": _ms_percentiles([r.end - r.start for r in ok]),
        "chunks_per_token": round(chunks / tokens, 4) if tokens else None,
        "tokens_counted_from_chunks": sum(not r.usage_reported for r in ok),
    }


async def _warm_up(base_url: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for stream in (False, True):
            body = {"prompt": WARMUP_PROMPT, "max_tokens": 4, "stream": stream}
            async with session.post(base_url + "/v1/completions", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"warm-up request failed: HTTP {resp.status}")


def measure_level(
    server: ServerProcess,
    workload: Workload,
    concurrency: int,
    force_close: bool = False,
    probe_interval: float = 0.0,
) -> dict[str, Any]:
    """Warm-up, the workload at `concurrency` (run_level's figures plus the CPU seconds client and
    server used), then the server stopped: each level gets a fresh server from its caller."""
    try:
        asyncio.run(_warm_up(server.base_url))
        server_cpu, client_cpu = server.cpu_seconds(), time.process_time()
        level = asyncio.run(run_level(server.base_url, workload, concurrency, force_close, probe_interval))
        # Where the cores went during the level: both processes share the same machine.
        level["client_cpu_s"] = round(time.process_time() - client_cpu, 2)
        level["server_startup_s"] = round(server.startup_s or 0.0, 2)
        if server_cpu is not None:
            level["server_cpu_s"] = round(server.cpu_seconds() - server_cpu, 2)
    finally:
        code = server.stop()
    if code != 0:
        raise RuntimeError(f"the server exited with {code}:\n{server.log_tail()}")
    return level


# -- the benchmark -----------------------------------------------------------------------------
def offline_engine_args(args, max_num_seqs: int) -> dict[str, Any]:
    """The offline engine's args from the benchmark's flags. The benchmark's first engine is an
    offline one, and it builds the compiled forward in the foreground where no package is cached:
    built behind, a compile would run through the measured rounds (and every server and offline
    engine after it would start one of its own until one finished)."""
    return {
        "compile_in_background": False,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_kv_blocks": args.num_kv_blocks,
        "device": args.device,
        "dtype": args.dtype,
        "stream_interval": args.stream_interval,
    }


def server_flags(args, max_num_seqs: int) -> list[str]:
    """`kvscale-worker serve` flags for the same engine args, and a queue that holds the workload."""
    flags = [
        "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--device", args.device,
        "--dtype", args.dtype,
        "--stream-interval", str(args.stream_interval),
        "--max-queued-requests", str(max(256, args.num_requests)),
    ]  # fmt: skip
    if args.num_kv_blocks is not None:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    return flags + list(getattr(args, "server_flag", None) or [])


def describe_workload(workload: Workload, seed: int) -> dict[str, Any]:
    from kvscale.worker.bench.throughput import _min_median_max

    return {
        "num_requests": len(workload.prompts),
        "prompt_tokens": sum(len(p) for p in workload.prompts),
        "output_tokens": workload.num_output_tokens,
        "output_len_min_median_max": _min_median_max(workload.output_lens),
        "prompt_len_min_median_max": _min_median_max([len(p) for p in workload.prompts]),
        "seed": seed,
    }


def _concurrency_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must list positive integers, got {text!r}")
    return list(dict.fromkeys(levels))


def _offline(args, engine_args: dict[str, Any], workload: Workload | None, measure: bool):
    """(workload, engine info, run_engine's figures or None): one LLM, freed before returning."""
    import torch

    from kvscale.worker import LLM, SamplingParams
    from kvscale.worker.bench.throughput import run_engine
    from kvscale.worker.bench.workload import code_workload

    llm = LLM(args.model, **engine_args)
    if workload is None:
        workload = code_workload(llm.get_tokenizer(), args.num_requests, seed=args.seed)
    info = {
        "device": str(llm.engine.runner.device),
        "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "kv_blocks": llm.engine.kv_cache_manager.num_blocks,
    }
    figures = None
    if measure:
        llm.generate([WARMUP_PROMPT] * 2, SamplingParams(max_tokens=4))  # the server gets a warm-up too
        cpu = time.process_time()
        figures = run_engine(llm, workload)
        figures["cpu_s"] = round(time.process_time() - cpu, 2)
    del llm
    gc.collect()
    return workload, info, figures


def run(args) -> dict[str, Any]:
    levels = _concurrency_levels(args.concurrency)
    max_num_seqs = args.max_num_seqs or max(levels)
    engine_args = offline_engine_args(args, max_num_seqs)

    # Offline before any server exists and again after the last one has exited (never alongside
    # a server: they would share the cores); the ratio uses their mean, which evens out drift.
    workload, info, before = _offline(args, engine_args, None, not args.skip_offline)

    flags = server_flags(args, max_num_seqs)
    log_dir = Path(args.server_log_dir or tempfile.mkdtemp(prefix="kvscale-bench-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    def http_level(c: int, tag: str) -> dict[str, Any]:
        profile = str(log_dir / f"profile-{tag}") if args.profile_server else None
        server = start_server(args.model, flags, log_dir / f"server-{tag}.log", profile)
        return measure_level(server, workload, c, probe_interval=args.probe_interval)

    # A fresh server per level: none reuses the prefix cache another one filled.
    http: dict[str, Any] = {str(c): http_level(c, f"c{c}") for c in levels}

    # The ratio: HTTP at the top level bracketed by offline runs, repeated, alternating
    # (off, http, off, http, off, ...); each round divides by the mean of its two neighbours and
    # the median round is reported, because this shared VM drifts by +-20% within minutes.
    top = max(levels)
    rounds: list[dict[str, Any]] = []
    after = None
    if not args.skip_offline:
        samples = [http[str(top)]["output_tokens_per_s"]]
        offline_runs = [before["output_tokens_per_s"]]
        for r in range(args.ratio_rounds):
            if r > 0:
                samples.append(http_level(top, f"c{top}-round{r + 1}")["output_tokens_per_s"])
            after = _offline(args, engine_args, workload, True)[2]
            offline_runs.append(after["output_tokens_per_s"])
            offline_tps = (offline_runs[-2] + offline_runs[-1]) / 2
            rounds.append(
                {
                    "http": samples[-1],
                    "offline": round(offline_tps, 1),
                    "ratio": round(samples[-1] / offline_tps, 3),
                }
            )

    result: dict[str, Any] = {
        "model": args.model,
        **info,
        "workload": describe_workload(workload, args.seed),
        "engine_args": engine_args,
        "server_logs": str(log_dir),
        "offline": {"before": before, "after": after},
        "http": http,
    }
    if rounds:
        ratio = sorted(r["ratio"] for r in rounds)[len(rounds) // 2]
        result["ratio_rounds"] = rounds
        result["http_over_offline"] = ratio
        result["goals"] = {
            "http_over_offline": {
                "goal": GOAL_HTTP_OVER_OFFLINE,
                "concurrency": top,
                "value": ratio,
                "met": ratio >= GOAL_HTTP_OVER_OFFLINE and http[str(top)]["errors"] == 0,
            }
        }
    return result


def add_engine_flags(p, batched_tokens_help: str | None = None) -> None:
    """The flags offline_engine_args and server_flags read: one engine, served and offline."""
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help=batched_tokens_help)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: the engine sizes its pool")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--stream-interval", type=int, default=1, help="the engine's stream_interval, served and offline"
    )


def add_parser(sub, parents: list) -> None:
    p = sub.add_parser(
        "serve", parents=parents, help="the HTTP server under streaming load against the offline engine"
    )
    p.add_argument("--model", required=True)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument(
        "--concurrency", default="1,8,32,64", help="comma-separated streams in flight, one run each"
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="engine batch cap (default: the largest concurrency)"
    )
    add_engine_flags(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-offline", action="store_true", help="only the HTTP runs (no ratio)")
    p.add_argument(
        "--ratio-rounds", type=int, default=3, help="alternating offline / HTTP rounds for the median ratio"
    )
    p.add_argument("--server-log-dir", default=None, help="where server logs go (default: a temp dir)")
    p.add_argument(
        "--probe-interval",
        type=float,
        default=PROBE_INTERVAL,
        help="seconds between two GETs of /health and of /metrics during each level (0: no probes; "
        "they take CPU from the server, so the ratio to the offline engine reads lower with them)",
    )
    p.add_argument(
        "--server-flag", action="append", help="extra `serve` flag (repeatable; e.g. --engine-process)"
    )
    p.add_argument(
        "--profile-server",
        action="store_true",
        help="run each server under cProfile, one stats file per thread, next to its log",
    )
    p.set_defaults(func=run)
