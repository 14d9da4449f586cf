"""Routing benchmark: 3 real workers behind kvscale-router, one seeded multi-turn workload whose
shared prefixes do not fit one worker's KV cache, four policies in one run (`--order`):

- `round-robin`: the router as a per-request balancer (a plain Service's behaviour);
- `approximate`: the router's default, prefix affinity from its own guess (prefix_index.py);
- `precise`: the workers publish KV events, the router scores by their exact index (kv_index.py),
  tokenizing with the model's tokenizer (`--tokenizer`);
- `precise-queue`: precise, plus the prefill guard (`--prefill-guard`, picker.py).

Every mode runs `--router-replicas` routers (2, the operator's default) in front of the same
workers, a conversation's turns alternating between them as requests through a Service do: each
approximate replica guesses from its own half of the traffic, while the precise ones share the
workers' events. Before each turn
of a prefix-affinity mode the client asks the other replica for its dry-run pick of that very
request, and the serving one names its pick in a header (`--expose-picks`): `replica_agreement`
is the fraction of turns where they name the same worker, `replica_agreement_on_cached` the same
over the turns whose prefix the other replica matched (the same prefix, held somewhere). The
probes cost CPU on the cores the workers use, which round-robin never pays: the `--pairs` passes
that judge TTFT and throughput run without them (every other pair the policy first).
Workers listen on their own loopback addresses (127.0.0.2, .3, ...: all of 127/8 is this host's),
so that every worker's events are on the same ports, as pods have theirs on their own IPs.

Workload (`conversations`): S system prompts (held-out code, `--system-tokens` each) shared by C
conversations (conversation i has prompt i mod S) of T turns; each turn appends a user message
(another held-out snippet) to the conversation so far, including the assistant's previous reply,
so every turn extends the one before it. At most `--concurrency` conversations run at once (each
one's turns in order), every turn a streaming chat completion, greedy, EOS ignored, `--max-tokens`.
The workers' KV pools (`--num-kv-blocks`) hold fewer tokens than the S system prompts together, so
a worker that sees every conversation (round-robin) keeps evicting them, and one that sees only
its share (prefix affinity) keeps them.

Per mode: fresh workers (no mode inherits another's cache) and a fresh router (a subprocess, the
console script) in front of them; each worker gets one warm-up request, straight, before the
measured part. Reported per mode: the prefix-cache hit rate from the workers' own counters
(vllm:prefix_cache_hits / vllm:prefix_cache_queries, the deltas over the measured part), TTFT
p50/p99 (request sent -> first chunk with content, at the client), output tokens/s over the wall
time, and per-worker load (requests finished, prompt tokens, hit rate; balance = max/mean of the
requests), the router's CPU per request. `comparison`: each policy against round-robin, and
precise against approximate (issue 31's goals).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscale.worker.bench.serve import ServerProcess, _ms_percentiles, free_port, serve_args, server_command
from kvscale.worker.bench.workload import held_out_sources

GOALS = {"hit_rate_ratio": 1.5, "ttft_p50_reduction": 0.30, "throughput_ratio": 1.0}
# Issue 31: precise against approximate's hit rate; TTFT p99 and throughput against round-robin's.
PRECISE_GOALS = {"hit_rate_over_approximate": 1.2, "ttft_p99_over_round_robin": 1.0, "throughput_ratio": 1.0}
AGREEMENT_GOAL = 0.95
SERVED_NAME = "tiny"
MODES = ("round-robin", "approximate", "precise", "precise-queue")
EVENTS_PORT, REPLAY_PORT = 5557, 5558


@dataclass
class Conversation:
    system: str
    users: list[str]  # one per turn


def conversations(
    tokenizer,
    num_system: int,
    system_tokens: int,
    num_conversations: int,
    turns: int,
    user_tokens: int,
    seed: int,
) -> list[Conversation]:
    rng = random.Random(seed)
    files = [p for p in held_out_sources(True) if p.stat().st_size > 8 * (system_tokens + user_tokens)]
    encoded: dict[Path, list[int]] = {}  # only the files drawn are tokenized

    def snippet(n: int) -> str:
        path = rng.choice(files)
        if path not in encoded:
            encoded[path] = tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)
        ids = encoded[path]
        start = rng.randrange(0, max(1, len(ids) - n))
        return tokenizer.decode(ids[start : start + n])

    systems = [snippet(system_tokens) for _ in range(num_system)]
    return [
        Conversation(systems[i % num_system], [snippet(user_tokens) for _ in range(turns)])
        for i in range(num_conversations)
    ]


# -- processes -------------------------------------------------------------------------------------
def _router_command() -> list[str]:
    exe = Path(sys.executable).with_name("kvscale-router")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "kvscale.router.main"]


def _start(
    cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None, host: str = "127.0.0.1"
) -> ServerProcess:
    import os
    import subprocess

    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    return ServerProcess(proc, port, log_path, host=host)


def worker_host(i: int) -> str:
    return f"127.0.0.{i + 2}"


def events_config(host: str) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{host}:{EVENTS_PORT}",
            "replay_endpoint": f"tcp://{host}:{REPLAY_PORT}",
            "load_topic": "kvscale.load",
        }
    )


def start_workers(
    n: int, model: str, flags: list[str], log_dir: Path, tag: str, threads: int = 0, events: bool = False
) -> list[ServerProcess]:
    """n workers started together (their model loads overlap), each waited for. `threads`: torch's
    threads per worker (0: torch's default, every core each): three workers with two OpenMP
    threads each on two cores spend their time in each other's barriers, which no router fixes."""
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    workers = []
    try:
        for i in range(n):
            port, host = free_port(), worker_host(i)
            extra = ["--kv-events-config", events_config(host)] if events else []
            cmd = [*server_command(), *serve_args(model, port, [*flags, *extra], host)]
            workers.append(_start(cmd, port, log_dir / f"worker-{tag}-{i}.log", env, host))
        for w in workers:
            w.wait_ready(600)
    except BaseException:
        stop_all(workers)
        raise
    return workers


def stop_all(procs: list[ServerProcess]) -> None:
    """SIGTERM to all, then wait for each: their drains and exits overlap."""
    import signal

    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        p.stop()


def scrape(url: str) -> dict[str, float]:
    """Sums of the worker's counters the report needs (all label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    wanted = {
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:request_success",
        "vllm:prompt_tokens",
    }
    out = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            out[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


# -- the client --------------------------------------------------------------------------------------
@dataclass
class TurnResult:
    start: float = 0.0
    first: float | None = None
    end: float = 0.0
    completion_tokens: int = 0
    error: str | None = None
    endpoint: str | None = None  # the worker that answered (X-Kvscale-Endpoint, with --expose-picks)
    router: str = ""  # the replica it went through
    prompt_tokens: int = 0  # from the answer's usage
    cached_tokens: int = 0  # of them, found in that worker's prefix cache


@dataclass
class ClientRun:
    turns: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0
    agreement: list[bool] = field(default_factory=list)  # per turn: the replicas' picks agreed
    agreement_on_cached: list[bool] = field(default_factory=list)  # of turns some replica matched


async def _turn(session, url: str, messages: list[dict], max_tokens: int) -> tuple[TurnResult, str]:
    import aiohttp

    result, text = TurnResult(), []
    body = {
        "model": SERVED_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result.start, result.router = time.perf_counter(), url
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result, ""
            result.endpoint = resp.headers.get("X-Kvscale-Endpoint")
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    return result, ""
                if chunk.get("choices") and (piece := chunk["choices"][0].get("delta", {}).get("content")):
                    if result.first is None:
                        result.first = time.perf_counter()
                    text.append(piece)
                if usage := chunk.get("usage"):
                    result.completion_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except (aiohttp.ClientError, TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result, ""
    result.end = time.perf_counter()
    if result.first is None:
        result.error = "no content in the stream"
    return result, "".join(text)


async def run_client(
    urls: list[str], convs: list[Conversation], concurrency: int, max_tokens: int, compare_picks: bool = False
) -> ClientRun:
    """Turn t of conversation i through router urls[(i + t) % len(urls)]: consecutive turns reach
    different replicas, as requests through a Service do. `compare_picks`: before each turn, every
    router's dry-run pick of it (ClientRun.agreement: the turns where they all named one worker)."""
    import aiohttp

    run = ClientRun()
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def picks(messages: list[dict], serving: str) -> tuple[set[str | None], bool]:
            """The other replicas' dry-run picks, and whether any matched a cached prefix there
            (the serving replica's own pick comes back with the answer)."""
            body = {"model": SERVED_NAME, "messages": messages, "max_tokens": max_tokens}
            out, cached = set(), False
            for url in urls:
                if url == serving:
                    continue
                async with session.post(url + "/kvscale/pick/v1/chat/completions", json=body) as r:
                    answer = await r.json() if r.status == 200 else {"endpoint": f"HTTP {r.status}"}
                out.add(answer.get("endpoint"))
                cached = cached or answer.get("prefix_match", 0) > 0
            return out, cached

        async def converse(i: int, c: Conversation) -> None:
            async with limit:
                messages = [{"role": "system", "content": c.system}]
                for t, user in enumerate(c.users):
                    messages.append({"role": "user", "content": user})
                    url = urls[(i + t) % len(urls)]
                    named, cached = await picks(messages, url) if compare_picks else (set(), False)
                    result, reply = await _turn(session, url, messages, max_tokens)
                    if compare_picks and result.endpoint is not None:
                        agreed = named == {result.endpoint}
                        run.agreement.append(agreed)
                        if cached:
                            run.agreement_on_cached.append(agreed)
                    run.turns.append(result)
                    if result.error is not None:
                        return
                    messages.append({"role": "assistant", "content": reply})

        started = time.perf_counter()
        await asyncio.gather(*(converse(i, c) for i, c in enumerate(convs)))
        run.wall_s = time.perf_counter() - started
    return run


async def _warm_up(url: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2}
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"warm-up request failed: HTTP {r.status}")


# -- one mode --------------------------------------------------------------------------------------
def run_mode(
    args, mode: str, convs: list[Conversation], log_dir: Path, probe_picks: bool = True
) -> dict[str, Any]:
    """One pass of `mode` on fresh workers and routers. `probe_picks`: ask the other replica's
    dry-run pick before each turn (the agreement figures); off for the timed pairs."""
    flags = [
        "--served-model-name", SERVED_NAME,
        "--num-kv-blocks", str(args.num_kv_blocks),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--device", args.device,
        "--dtype", args.dtype,
    ]  # fmt: skip
    precise = mode.startswith("precise")
    workers = start_workers(args.workers, args.model, flags, log_dir, mode, args.worker_threads, precise)
    routers: list[ServerProcess] = []
    try:
        for w in workers:
            asyncio.run(_warm_up(w.base_url))
        policy = "round-robin" if mode == "round-robin" else "kv-prefix"
        extra = ["--expose-picks"]  # round-robin's too: the trace names every turn's worker
        if precise:
            extra += [
                "--kv-events-port", str(EVENTS_PORT), "--kv-events-replay-port", str(REPLAY_PORT),
                "--tokenizer", args.model,
            ]  # fmt: skip
        if mode == "precise-queue":
            extra += ["--prefill-guard", str(args.prefill_guard)]
        for r in range(args.router_replicas):
            port = free_port()
            cmd = [
                *_router_command(),
                "--endpoints", ",".join(w.base_url for w in workers),
                "--host", "127.0.0.1", "--port", str(port),
                "--policy", policy,
                "--log-format", "text", "--log-level", "WARNING",
                *extra, *args.router_flag,
            ]  # fmt: skip
            routers.append(_start(cmd, port, log_dir / f"router-{mode}-{r}.log"))
        for router in routers:
            router.wait_ready(60)
            if precise:
                _wait_synced(router.base_url, len(workers))
        before = [scrape(w.base_url) for w in workers]
        cpu_before = [r.cpu_seconds() for r in routers]
        urls = [r.base_url for r in routers]
        compare_picks = probe_picks and policy == "kv-prefix" and len(urls) > 1
        run = asyncio.run(run_client(urls, convs, args.concurrency, args.max_tokens, compare_picks))
        cpu = [r.cpu_seconds() for r in routers]
        router_cpu = None
        if None not in cpu and None not in cpu_before:
            router_cpu = round(sum(a - b for a, b in zip(cpu, cpu_before, strict=True)), 2)
        after = [scrape(w.base_url) for w in workers]
        # What the routers' event streams carried (the workers' loads: the guard's fresh backlog).
        events = [router_kv_events(r.base_url) for r in routers] if precise else []
    finally:
        stop_all([*workers, *routers])
    write_trace(run, log_dir, mode)
    out = summarize(run, before, after, router_cpu)
    out["routers"] = len(routers)
    if events:
        out["router_kv_events"] = {k: sum(e.get(k, 0) for e in events) for k in sorted(set().union(*events))}
    if run.agreement:
        out["replica_agreement"] = round(sum(run.agreement) / len(run.agreement), 4)
    if run.agreement_on_cached:
        out["replica_agreement_on_cached"] = round(
            sum(run.agreement_on_cached) / len(run.agreement_on_cached), 4
        )
    # The prefix-affinity modes' routers also answered a dry-run pick per turn (the other
    # replica's: a parse, a tokenization with the precise index, a pick; no proxying).
    calls = len(run.turns) + len(run.agreement) * (len(routers) - 1)
    out["router_calls"] = calls
    if router_cpu is not None and calls:
        out["router_cpu_ms_per_call"] = round(1000 * router_cpu / calls, 3)
    return out


def router_kv_events(url: str) -> dict[str, float]:
    """A router's KV-event stream counts by kind (kvscale_router_kv_events_total: "batch",
    "synced", "load", ...)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    prefix = 'kvscale_router_kv_events_total{kind="'
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            kind = line[len(prefix) :].split('"', 1)[0]
            counts[kind] = counts.get(kind, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _wait_synced(url: str, workers: int, timeout: float = 60.0) -> None:
    """Until the router's precise index has synced with every worker (its events counter)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router_kv_events(url).get("synced", 0) >= workers:
            return
        time.sleep(0.2)
    raise RuntimeError(f"router {url} did not sync with {workers} workers' KV events in {timeout:.0f}s")


def write_trace(run: ClientRun, log_dir: Path, mode: str) -> Path:
    """Every turn of a pass as a JSON line (times in s from the pass's first request), the file
    named for the mode and the passes of it already written."""
    n = len(list(log_dir.glob(f"trace-{mode}-*.jsonl")))
    path = log_dir / f"trace-{mode}-{n}.jsonl"
    t0 = min((t.start for t in run.turns), default=0.0)
    with path.open("w") as f:
        for t in run.turns:
            row = {k: v for k, v in vars(t).items() if k not in ("start", "first", "end")}
            row |= {"start": t.start - t0, "first": None if t.first is None else t.first - t0}
            f.write(json.dumps(row | {"end": t.end - t0}) + "\n")
    return path


def ttft_tail(turns: list[TurnResult], n: int = 3) -> list[dict[str, Any]]:
    """The n slowest first tokens and what was ahead of each at its worker when it was sent: the
    turns there still without a first token (prefills queued or running: `ahead`, their uncached
    prompt tokens `ahead_tokens`) and those still streaming (`busy`)."""
    ok = [t for t in turns if t.error is None and t.first is not None]
    out = []
    for t in sorted(ok, key=lambda t: t.first - t.start, reverse=True)[:n]:
        there = [o for o in ok if o is not t and o.endpoint == t.endpoint and o.start <= t.start]
        ahead = [o for o in there if o.first > t.start]
        out.append(
            {
                "ttft_ms": round(1000 * (t.first - t.start), 1),
                "endpoint": t.endpoint,
                "prompt_tokens": t.prompt_tokens,
                "cached_tokens": t.cached_tokens,
                "ahead": len(ahead),
                "ahead_tokens": sum(o.prompt_tokens - o.cached_tokens for o in ahead),
                "busy": sum(1 for o in there if o.end > t.start),
            }
        )
    return out


def summarize(
    run: ClientRun, before: list[dict], after: list[dict], router_cpu: float | None
) -> dict[str, Any]:
    ok = [t for t in run.turns if t.error is None]
    errors = [t.error for t in run.turns if t.error is not None]
    per_worker = []
    for b, a in zip(before, after, strict=True):
        d = {k: a[k] - b[k] for k in a}
        q = d["vllm:prefix_cache_queries"]
        per_worker.append(
            {
                "requests": int(d["vllm:request_success"]),
                "prompt_tokens": int(d["vllm:prompt_tokens"]),
                "prefix_cache_hit_rate": round(d["vllm:prefix_cache_hits"] / q, 4) if q else None,
            }
        )
    hits = sum(
        a["vllm:prefix_cache_hits"] - b["vllm:prefix_cache_hits"] for b, a in zip(before, after, strict=True)
    )
    queries = sum(
        a["vllm:prefix_cache_queries"] - b["vllm:prefix_cache_queries"]
        for b, a in zip(before, after, strict=True)
    )
    requests = [w["requests"] for w in per_worker]
    tokens = sum(t.completion_tokens for t in ok)
    mean = sum(requests) / len(requests) if requests else 0
    return {
        "requests": len(run.turns),
        "errors": len(errors),
        "error_samples": errors[:3],
        "wall_s": round(run.wall_s, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / run.wall_s, 1) if run.wall_s else None,
        "ttft_ms": _ms_percentiles([t.first - t.start for t in ok if t.first is not None]),
        "e2e_ms": _ms_percentiles([t.end - t.start for t in ok]),
        "ttft_tail": ttft_tail(ok),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "per_worker": per_worker,
        "load_balance_max_over_mean": round(max(requests) / mean, 3) if mean else None,
        "router_cpu_s": router_cpu,
        "router_cpu_ms_per_request": round(1000 * router_cpu / len(run.turns), 3)
        if router_cpu is not None and run.turns
        else None,
    }


def compare(router: dict[str, Any], rr: dict[str, Any]) -> dict[str, Any]:
    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    hit = ratio(router["prefix_cache_hit_rate"], rr["prefix_cache_hit_rate"])
    p50_r, p50_b = router["ttft_ms"]["p50"], rr["ttft_ms"]["p50"]
    reduction = round(1 - p50_r / p50_b, 3) if p50_r is not None and p50_b else None
    tput = ratio(router["output_tokens_per_s"], rr["output_tokens_per_s"])
    clean = router["errors"] == 0 and rr["errors"] == 0
    return {
        "hit_rate_ratio": hit,
        "ttft_p50_reduction": reduction,
        "throughput_ratio": tput,
        "goals": {
            name: {
                "goal": goal,
                "value": value,
                "met": value is not None and value >= goal and clean,
            }
            for name, goal, value in (
                ("hit_rate_ratio", GOALS["hit_rate_ratio"], hit),
                ("ttft_p50_reduction", GOALS["ttft_p50_reduction"], reduction),
                ("throughput_ratio", GOALS["throughput_ratio"], tput),
            )
        },
    }


def compare_precise(
    precise: dict[str, Any],
    approx: dict[str, Any],
    rr: dict[str, Any],
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Issue 31's goals for a precise mode: hit rate over approximate's, TTFT p99 and throughput
    against round-robin's (p99 at most round-robin's: a ratio <= 1), replicas agreeing. With
    `pairs` (round-robin and this mode back to back, `--pairs`), the TTFT and throughput ratios
    are the median pair's, every pair's listed: one pass of each moves 10-30 % on a shared VM."""

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    pairs = pairs or [(rr, precise)]
    clean = approx["errors"] == 0 and all(a["errors"] == 0 and b["errors"] == 0 for a, b in pairs)
    p99s = [ratio(b["ttft_ms"]["p99"], a["ttft_ms"]["p99"]) for a, b in pairs]
    tputs = [ratio(b["output_tokens_per_s"], a["output_tokens_per_s"]) for a, b in pairs]
    values = {
        "hit_rate_over_approximate": ratio(precise["prefix_cache_hit_rate"], approx["prefix_cache_hit_rate"]),
        "ttft_p99_over_round_robin": _median(p99s),
        "throughput_ratio": _median(tputs),
        # "Their picks for the same prefix": over the turns whose prefix a replica matched (a
        # first turn of a new prefix is placed by load, which each replica counts for itself).
        "replica_agreement_on_cached": precise.get("replica_agreement_on_cached"),
        "replica_agreement": precise.get("replica_agreement"),
    }
    goals = {**PRECISE_GOALS, "replica_agreement_on_cached": AGREEMENT_GOAL}
    if len(pairs) > 1:
        values["pairs"] = {"ttft_p99_over_round_robin": p99s, "throughput_ratio": tputs}
    at_most = {"ttft_p99_over_round_robin"}
    return {
        **values,
        "goals": {
            name: {
                "goal": goal,
                "value": values[name],
                "met": values[name] is not None
                and clean
                and (values[name] <= goal if name in at_most else values[name] >= goal),
            }
            for name, goal in goals.items()
        },
    }


def _median(values: list[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    if len(known) != len(values) or not known:
        return None
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else round((known[mid - 1] + known[mid]) / 2, 3)


def run(args) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    convs = conversations(
        tokenizer,
        args.system_prompts,
        args.system_tokens,
        args.conversations,
        args.turns,
        args.user_tokens,
        args.seed,
    )
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvscale-bench-route-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    order = [m.strip() for m in args.order.split(",") if m.strip()]
    if not order or len(set(order)) != len(order) or not set(order) <= set(MODES):
        raise ValueError(f"--order must name {' and/or '.join(MODES)}, each at most once, got {args.order!r}")
    modes = {mode: run_mode(args, mode, convs, log_dir) for mode in order}
    # (round-robin, pair policy) passes back to back, none probing picks: the probes are a
    # measuring device (a parse, a tokenization and a pick on the other replica per turn, ~8 ms of
    # CPU) that round-robin's pass never pays, on the same two cores as the workers.
    # Every other pair runs the policy first: whatever favours a pass's place in a pair (a VM
    # whose speed drifts, caches warmed by the pass before) falls on each side alike.
    pairs = []
    if args.pairs > 1 and "round-robin" in modes and args.pair_policy in modes:
        for i in range(args.pairs):
            first, second = ("round-robin", args.pair_policy)[:: 1 if i % 2 == 0 else -1]
            a = run_mode(args, first, convs, log_dir, probe_picks=False)
            b = run_mode(args, second, convs, log_dir, probe_picks=False)
            pairs.append((a, b) if i % 2 == 0 else (b, a))
    block_size = 16
    return {
        "model": args.model,
        "workers": args.workers,
        "workload": {
            "system_prompts": args.system_prompts,
            "system_tokens": args.system_tokens,
            "conversations": args.conversations,
            "turns": args.turns,
            "user_tokens": args.user_tokens,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "seed": args.seed,
            # the shared prefixes against one worker's pool: > 1 means they do not fit one worker
            "system_tokens_over_one_kv_pool": round(
                args.system_prompts * args.system_tokens / (args.num_kv_blocks * block_size), 2
            ),
        },
        "worker_flags": {
            "num_kv_blocks": args.num_kv_blocks,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "device": args.device,
            "dtype": args.dtype,
            "torch_threads": args.worker_threads or "default",
        },
        "router_flags": args.router_flag,
        "prefill_guard": args.prefill_guard,
        "logs": str(log_dir),
        "modes": modes,
        # Only what ran (a single mode is for checking the setup).
        "comparison": {
            **{
                f"{m}_vs_round_robin": compare(modes[m], modes["round-robin"])
                for m in modes
                if m != "round-robin" and "round-robin" in modes
            },
            **{
                f"{m}_issue_31": compare_precise(
                    modes[m],
                    modes["approximate"],
                    modes["round-robin"],
                    pairs if m == args.pair_policy else [],
                )
                for m in ("precise", "precise-queue")
                if m in modes and "approximate" in modes and "round-robin" in modes
            },
        },
        "pairs": [
            {"round_robin": _pair_view(rr), args.pair_policy: _pair_view(other)} for rr, other in pairs
        ],
    }


def _pair_view(summary: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "prefix_cache_hit_rate",
        "ttft_ms",
        "ttft_tail",
        "output_tokens_per_s",
        "errors",
        "replica_agreement_on_cached",
        "router_kv_events",
    )
    return {k: summary.get(k) for k in keys}


def add_parser(sub, parents: list) -> None:
    p = sub.add_parser(
        "route", parents=parents, help="kvscale-router in front of real workers against round-robin"
    )
    p.add_argument("--model", required=True)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=384)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=6, help="conversations in flight")
    p.add_argument("--num-kv-blocks", type=int, default=160, help="each worker's KV pool (16-token blocks)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--worker-threads", type=int, default=1, help="torch threads per worker (0: torch's default)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--order",
        default=",".join(MODES),
        help="the modes, in the order they run (one alone: a setup check)",
    )
    p.add_argument("--prefill-guard", type=float, default=1.25, help="precise-queue's --prefill-guard factor")
    p.add_argument("--router-replicas", type=int, default=2, help="routers per mode (operator's default)")
    p.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="after the --order passes, round-robin and --pair-policy run this many more times, back to "
        "back, without the replicas' pick probes: issue 31's TTFT and throughput goals on the median pair",
    )
    p.add_argument("--pair-policy", default="precise-queue", choices=MODES[1:])
    p.add_argument(
        "--router-flag",
        action="append",
        default=[],
        help="an extra kvscale-router flag (repeatable, e.g. --router-flag=--load-factor=1.5)",
    )
    p.add_argument("--log-dir", default=None, help="where worker and router logs go (default: a temp dir)")
    p.set_defaults(func=run)
