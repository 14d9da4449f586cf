"""Hostile-client benchmark (issue 26's must-show 2): named attack bodies against a live worker.

One fresh `kvscale-worker serve` subprocess; throughout, a prober in a process of its own GETs
`/health` every 20 ms and reads the server's RSS. Phases, in order:

1. `idle`: the plain request (a short greedy completion) alone, `--plain-repeats` times;
2. `deep_schema`: the 24 KB JSON schema nested 400 levels deep (the issue's 11 s loop stall);
3. `choice_lists`: 256 distinct choice lists, each at the per-request budget, from 64
   concurrent connections;
4. `schema_burst`: 48 distinct heavy schemas (within the budgets) sent at once, beside the plain
   request repeated; its latency during the burst is compared with its idle latency.

Reported: every status seen per phase (a 5xx or a request past `--request-timeout` is a
failure), `/health` p50/p100 latency over the whole run, the plain request's idle and burst
latency (median) and their ratio, the server's peak RSS over its idle RSS, the KV-cache
usage after the last phase (must be back to 0), and the event-loop stalls the server's watchdog
logged (what held the loop, worker/server/loop_watchdog.py). `goals` says which of the issue's goals were met:
0 × 5xx, 0 hangs, `/health` p100 < 100 ms, burst latency <= 2 x idle.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvscale.worker.bench.prober import Probe
from kvscale.worker.bench.serve import start_server

HEALTH_P100_GOAL_S = 0.1
BURST_OVER_IDLE_GOAL = 2.0


def deep_schema(depth: int = 400) -> dict[str, Any]:
    """An object nested `depth` levels, padded to ~24 KB like the issue's body."""
    schema: dict[str, Any] = {"type": "string", "maxLength": 4}
    for i in range(depth):
        schema = {
            "type": "object",
            "properties": {f"k{i:03d}_padding_x": schema},
            "required": [f"k{i:03d}_padding_x"],
        }
    return schema


def choice_list(i: int, count: int, width: int) -> list[str]:
    return [f"{i:04d}-{j:04d}-" + "x" * max(0, width - 10) for j in range(count)]


def heavy_schema(i: int, props: int = 48) -> dict[str, Any]:
    """A wide, distinct schema: many properties with enums and bounded strings."""
    properties = {
        f"p{i}_{j}": {"type": "string", "enum": [f"v{i}_{j}_{k}" for k in range(8)]}
        if j % 2
        else {"type": "string", "maxLength": 12, "pattern": f"[a-z]{{1,{4 + j % 5}}}"}
        for j in range(props)
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def plain_body() -> dict[str, Any]:
    return {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}


def constrained_body(**constraint: Any) -> dict[str, Any]:
    return {"prompt": "x = ", "max_tokens": 8, "temperature": 0, "structured_outputs": constraint}


async def post(session, base: str, body: dict[str, Any], timeout: float) -> tuple[int | str, float]:
    import aiohttp

    t0 = time.perf_counter()
    try:
        async with session.post(
            base + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as r:
            await r.read()
            return r.status, time.perf_counter() - t0
    except TimeoutError:
        return "timeout", time.perf_counter() - t0


def tally(results: list[tuple[int | str, float]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status, _ in results:
        counts[str(status)] = counts.get(str(status), 0) + 1
    return counts


async def plain_latency(session, base: str, repeats: int, timeout: float) -> list[float]:
    out = []
    for _ in range(repeats):
        status, dt = await post(session, base, plain_body(), timeout)
        out.append(dt if status == 200 else float("inf"))
    return out


async def attack(base: str, pid: int, args) -> dict[str, Any]:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        import psutil

        probe = Probe(base, pid)
        probe.start()
        await asyncio.sleep(2.0)  # the prober's interpreter starts
        idle_rss = psutil.Process(pid).memory_info().rss
        phases: dict[str, Any] = {}
        t = args.request_timeout

        idle = await plain_latency(session, base, args.plain_repeats, t)
        phases["idle"] = {"plain_s": idle}

        phases["deep_schema"] = tally([await post(session, base, constrained_body(json=deep_schema()), t)])

        sem = asyncio.Semaphore(64)

        async def one_choice(i: int):
            async with sem:
                return await post(
                    session, base, constrained_body(choice=choice_list(i, args.choices, args.choice_width)), t
                )

        phases["choice_lists"] = tally(await asyncio.gather(*(one_choice(i) for i in range(256))))

        burst = [
            asyncio.create_task(post(session, base, constrained_body(json=heavy_schema(i)), t))
            for i in range(48)
        ]
        during = await plain_latency(session, base, args.plain_repeats, t)
        phases["schema_burst"] = {**tally(await asyncio.gather(*burst)), "plain_s": during}

        await asyncio.sleep(0.5)
        probe.stop()
        async with session.get(base + "/metrics") as r:
            metrics = await r.text()
    kv = next(
        (
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("kvscale_kv_cache_usage_ratio")
        ),
        None,
    )
    attacks = [phases[p] for p in ("deep_schema", "choice_lists", "schema_burst")]
    server_errors = sum(n for counts in attacks for s, n in counts.items() if s.startswith("5"))
    hangs = sum(counts.get("timeout", 0) for counts in attacks)
    idle_med, burst_med = statistics.median(idle), statistics.median(during)
    ratio = burst_med / idle_med
    health_p100 = max(probe.health)
    return {
        "phases": phases,
        "health_p50_s": statistics.median(probe.health),
        "health_p100_s": health_p100,
        "health_failures": probe.health_failures,
        "plain_idle_median_s": idle_med,
        "plain_burst_median_s": burst_med,
        "burst_over_idle": ratio,
        "rss_idle_mb": idle_rss / 2**20,
        "rss_peak_mb": max(probe.rss) / 2**20,
        "kv_cache_usage_after": kv,
        "goals": {
            "no_5xx": "met" if server_errors == 0 else f"missed ({server_errors})",
            "no_hangs": "met" if hangs == 0 else f"missed ({hangs})",
            "health_p100_under_100ms": "met"
            if health_p100 < HEALTH_P100_GOAL_S and not probe.health_failures
            else "missed",
            "burst_latency_within_2x": "met" if ratio <= BURST_OVER_IDLE_GOAL else "missed",
            "kv_back_to_zero": "met" if kv == 0 else "missed",
        },
    }


def loop_stalls(log_path: Path, top: int = 5) -> dict[str, Any]:
    """The server's "event loop stalled" records (worker/server/loop_watchdog.py): how many, the
    longest, and the `top` longest with the innermost frames of what held the loop."""
    stalls, pauses = [], []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("msg") == "event loop stalled":
            stalls.append(entry)
        if isinstance(entry, dict) and entry.get("msg") == "garbage collection paused every thread":
            pauses.append(entry)
    stalls.sort(key=lambda e: -e["stall_s"])
    return {
        "gc_pauses": [
            {k: e.get(k) for k in ("pause_s", "generation", "collected", "thread")} for e in pauses
        ],
        "count": len(stalls),
        "max_s": stalls[0]["stall_s"] if stalls else 0.0,
        "longest": [
            {k: e.get(k) for k in ("stall_s", "sampled_after_s", "in_gc", "threads")}
            | {"stack": e["stack"].strip().splitlines()[-4:]}
            for e in stalls[:top]
        ],
    }


def run(args) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        server = start_server(args.model, list(args.server_flag or []), log)
        try:
            result = asyncio.run(attack(server.base_url, server.proc.pid, args))
        finally:
            server.stop()
        result["loop_stalls"] = loop_stalls(log)
    result["config"] = {k: v for k, v in vars(args).items() if k not in ("func", "json")}
    return result


def add_parser(sub, parents: list) -> None:
    p = sub.add_parser(
        "hostile", parents=parents, help="named hostile bodies against a live server (issue 26)"
    )
    p.add_argument("--model", required=True, help="model folder (e.g. ../shared/models/tiny-code-target)")
    p.add_argument("--choices", type=int, default=256, help="strings per choice list")
    p.add_argument("--choice-width", type=int, default=64, help="characters per choice")
    p.add_argument("--plain-repeats", type=int, default=5)
    p.add_argument("--request-timeout", type=float, default=120.0, help="a request past this is a hang")
    p.add_argument(
        "--server-flag",
        action="append",
        help="extra `serve` flag (repeatable, e.g. --server-flag=--max-num-seqs=64)",
    )
    p.set_defaults(func=run)
