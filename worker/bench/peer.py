"""The llama.cpp peer (issue 19): llama.cpp's `llama-server` and `kvscale-worker serve` on the same
model (a GGUF converted from the same weights), the same seeded workload and the same streaming
client (serve.py's), in one run, plus kvscale's offline engine, at each concurrency level C.

For each C, --rounds rounds of: a fresh kvscale server (`--max-num-seqs C`), a fresh llama-server
(`-np C` slots, continuous batching), then the offline engine (`max_num_seqs` C, no server alive).
Fresh servers, so that no run is served from a cache an earlier run filled. The engines alternate
run by run because this shared machine drifts by +-25% between minutes: each round's ratio
kvscale / llama.cpp (output tokens/s, TPOT p50) pairs runs a minute apart, the level's ratio is the
median over rounds, and issue 33's goals (GOALS) are evaluated on the rounds.

llama-server gets every request on its own connection (it closed some reused keep-alive
connections after a streamed response); prompts are token ids, so the two tokenizers never
matter. Agreement: greedy tokens for the first --agreement-prompts prompts from each server, one at
a time, as the matching prefix; float32 rounding differs between ggml's and torch's kernels, so
some sequences part after a near-tie: a figure, not a check.

An optional peer, never a CI dependency: it runs only when given --llama-server and --gguf
(docs/benchmarks.md, "The llama.cpp peer (issue 19)", has the build and conversion commands).
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from kvscale.worker.bench.serve import (
    _concurrency_levels,
    _offline,
    add_engine_flags,
    describe_workload,
    free_port,
    launch,
    measure_level,
    offline_engine_args,
    server_flags,
    start_server,
)
from kvscale.worker.bench.workload import Workload

KVSCALE, LLAMA, OFFLINE = "kvscale", "llama.cpp", "offline"
RATIO_METRICS = ("output_tokens_per_s", "tpot_ms_p50")
MEDIAN_METRICS = ("output_tokens_per_s", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50")
LOWER_IS_BETTER = {"tpot_ms_p50"}
# Issue 33: name -> (concurrency, ratio, bound, over): the ratio kvscale / llama.cpp of a metric
# (served_over_offline: kvscale's server / its offline engine, tokens/s), bounded in every round
# ("every": the worst round's ratio) or on the median of the rounds. The issue bounds the
# one-stream TPOT against a float32 GGUF and the tokens/s against a float16 one: one run per GGUF.
GOALS: dict[str, tuple[int, str, float, str]] = {
    "tpot_p50_at_1_stream": (1, "tpot_ms_p50", 1.25, "every"),
    "tokens_per_s_at_8_streams": (8, "output_tokens_per_s", 1.0, "median"),
    "tokens_per_s_at_32_streams": (32, "output_tokens_per_s", 1.0, "median"),
    "tokens_per_s_at_64_streams": (64, "output_tokens_per_s", 1.0, "median"),
    "served_over_offline_at_8_streams": (8, "served_over_offline", 0.95, "median"),
    "served_over_offline_at_64_streams": (64, "served_over_offline", 0.95, "median"),
}
LLAMA_CONTEXT = 65536  # tokens of KV over all slots; -np C gives each slot 1/C of it
LLAMA_UBATCH = 512


# -- pure parts: what runs, in which order, and what the figures mean ----------------------------
def missing_inputs(llama_server: str | None, gguf: str | None) -> list[str]:
    problems = []
    for flag, path, what in (
        ("--llama-server", llama_server, "llama.cpp's llama-server binary"),
        ("--gguf", gguf, "the model converted to GGUF"),
    ):
        if path is None:
            problems.append(f"{flag} PATH ({what}) was not given")
        elif not Path(path).is_file():
            problems.append(f"{flag} {path}: no such file ({what})")
    return problems


def schedule(levels: list[int], rounds: int, engines: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """(concurrency, round, engine) in run order: levels one after the other, and within a level
    the engines alternate round by round (kvscale, llama.cpp, [offline,] kvscale, llama.cpp, ...)."""
    return [(c, r, e) for c in levels for r in range(1, rounds + 1) for e in engines]


def llama_context_size(concurrency: int, longest_request: int, floor: int = LLAMA_CONTEXT) -> int:
    """-c for -np C: llama-server splits it evenly over the slots, and each slot must hold the
    longest prompt + output of the workload, or that request would stop short."""
    return max(floor, concurrency * longest_request)


def llama_server_command(
    binary: str,
    gguf: str,
    port: int,
    concurrency: int,
    threads: int,
    context: int,
    batch_tokens: int,
    extra: list[str],
) -> list[str]:
    """Continuous batching over C slots, the prompt batch as large as kvscale's token budget per
    step; `extra` comes last, so a flag there overrides ours."""
    return [
        binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-np", str(concurrency), "-cb", "-c", str(context),
        "-b", str(batch_tokens), "-ub", str(LLAMA_UBATCH), "--no-webui", *extra,
    ]  # fmt: skip


def split_flags(values: list[str]) -> list[str]:
    """Repeated --kvscale-flag / --llama-flag values, each shell-split ('--block-size 32' is two)."""
    return [part for v in values for part in shlex.split(v)]


def http_figures(level: dict[str, Any]) -> dict[str, Any]:
    """One server run, from serve.measure_level's summary."""
    figures = {
        "output_tokens_per_s": level["output_tokens_per_s"],
        "tpot_ms_p50": level["tpot_ms"]["p50"],
        "tpot_ms_p99": level["tpot_ms"]["p99"],
        "ttft_ms_p50": level["ttft_ms"]["p50"],
        "output_tokens": level["output_tokens"],
        "errors": level["errors"],
        "chunks_per_token": level["chunks_per_token"],
        "tokens_counted_from_chunks": level["tokens_counted_from_chunks"],
        "wall_s": level["wall_s"],
        "server_cpu_s": level.get("server_cpu_s"),
        "server_startup_s": level["server_startup_s"],
    }
    if level["errors"]:
        figures["error_samples"] = level["error_samples"]
    return figures


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours is not None and theirs else None


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def summarize_level(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """rounds: per round, engine -> figures. Adds each round's ratio kvscale / llama.cpp, the
    medians over rounds per engine, and the level's ratio: the median of the rounds' ratios."""
    per_round = []
    for r, runs in enumerate(rounds, 1):
        ratio = {m: _ratio(runs[KVSCALE].get(m), runs[LLAMA].get(m)) for m in RATIO_METRICS}
        if OFFLINE in runs:
            tps = "output_tokens_per_s"
            ratio["served_over_offline"] = _ratio(runs[KVSCALE].get(tps), runs[OFFLINE].get(tps))
        per_round.append({"round": r, **runs, "ratio": ratio})
    engines = list(dict.fromkeys(e for runs in rounds for e in runs))
    median = {
        e: {
            **{m: _median([runs[e].get(m) for runs in rounds]) for m in MEDIAN_METRICS if m in rounds[0][e]},
            "errors": sum(runs[e].get("errors", 0) for runs in rounds),
        }
        for e in engines
    }
    ratio = {m: _median([r["ratio"][m] for r in per_round]) for m in per_round[0]["ratio"]}
    return {"rounds": per_round, "median": median, "ratio": ratio}


def evaluate_goals(levels: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Issue 33's goals on the levels' ratios; met is None where the level (or the offline engine)
    was not run, and False where either server failed a request at that level."""
    goals = {}
    for name, (c, metric, bound, over) in GOALS.items():
        level = levels.get(str(c))
        value = None
        if level is not None and over == "median":
            value = level["ratio"].get(metric)
        elif level is not None:  # every round: the worst one
            values = [r["ratio"].get(metric) for r in level["rounds"]]
            if values and None not in values:
                value = max(values) if metric in LOWER_IS_BETTER else min(values)
        if value is None:
            met = None
        else:
            clean = all(level["median"][e]["errors"] == 0 for e in (KVSCALE, LLAMA))
            met = clean and (value <= bound if metric in LOWER_IS_BETTER else value >= bound)
        sense = "<=" if metric in LOWER_IS_BETTER else ">="
        goals[name] = {
            "concurrency": c,
            "ratio": metric,
            "goal": f"{sense} {bound}" + (" in every round" if over == "every" else ""),
            "value": value,
            "met": met,
        }
    return goals


def matching_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement_figures(ours: list[list[str]], theirs: list[list[str]]) -> dict[str, Any]:
    """Per prompt, the tokens both servers generated before the first difference."""
    prefixes = [matching_prefix(a, b) for a, b in zip(ours, theirs, strict=True)]
    tokens = sum(len(a) for a in ours)
    return {
        "prompts": len(ours),
        "identical_prompts": sum(
            p == len(a) == len(b) for p, a, b in zip(prefixes, ours, theirs, strict=True)
        ),
        "matching_prefix_tokens": sum(prefixes),
        "tokens": tokens,
        "matching_prefix_fraction": round(sum(prefixes) / tokens, 4) if tokens else None,
        "matching_prefix_per_prompt": prefixes,
    }


# -- the servers -------------------------------------------------------------------------------
def _post(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def kvscale_greedy_tokens(base_url: str, prompt: list[int], n: int) -> list[str]:
    """Our server names no token ids; `logprobs` gives each token's text (tokenizer.decode([id]))."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
    return _post(base_url, "/v1/completions", body)["choices"][0]["logprobs"]["tokens"]


def llama_greedy_tokens(base_url: str, prompt: list[int], n: int) -> list[int]:
    """llama-server's own /completion endpoint returns the generated token ids."""
    body = {
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_tokens": True,
        "cache_prompt": False,
    }
    return _post(base_url, "/completion", body)["tokens"]


def llama_version(binary: str) -> str | None:
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else None


# -- the benchmark -----------------------------------------------------------------------------
def run(args) -> dict[str, Any]:
    problems = missing_inputs(args.llama_server, args.gguf)
    if problems:
        print(
            "bench peer needs llama.cpp: " + "; ".join(problems) + ". Build and conversion commands: "
            "docs/benchmarks.md, 'The llama.cpp peer (issue 19)'.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    import torch

    levels = _concurrency_levels(args.concurrency)
    threads = args.llama_threads or torch.get_num_threads()  # what our server's torch uses
    kvscale_extra, llama_extra = split_flags(args.kvscale_flag), split_flags(args.llama_flag)
    workload, info, _ = _offline(args, offline_engine_args(args, max(levels)), None, False)
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    log_dir = Path(args.server_log_dir or tempfile.mkdtemp(prefix="kvscale-bench-peer-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    def start_kvscale(c: int, tag: str):
        flags = [*server_flags(args, c), *kvscale_extra]
        return start_server(args.model, flags, log_dir / f"kvscale-{tag}.log")

    def start_llama(c: int, tag: str):
        port = free_port()
        context = llama_context_size(c, longest)
        cmd = llama_server_command(
            args.llama_server, args.gguf, port, c, threads, context, args.max_num_batched_tokens, llama_extra
        )
        return launch(cmd, port, log_dir / f"llama-{tag}.log", ready_path="/health")

    def run_one(c: int, r: int, engine: str) -> dict[str, Any]:
        tag = f"c{c}-r{r}"
        if engine == KVSCALE:
            return http_figures(measure_level(start_kvscale(c, tag), workload, c))
        if engine == LLAMA:
            return http_figures(measure_level(start_llama(c, tag), workload, c, force_close=True))
        figures = _offline(args, offline_engine_args(args, c), workload, True)[2]
        return {k: figures[k] for k in ("output_tokens_per_s", "elapsed_s", "steps")}

    result: dict[str, Any] = {
        "model": args.model,
        "gguf": args.gguf,
        "llama_server": args.llama_server,
        "llama_server_version": llama_version(args.llama_server),
        **info,
        "llama_threads": threads,
        "workload": describe_workload(workload, args.seed),
        "kvscale_flags": kvscale_extra,
        "llama_flags": llama_extra,
        "server_logs": str(log_dir),
    }
    if args.agreement_prompts:
        result["agreement"] = agreement(args, workload, start_kvscale, start_llama)

    engines = (KVSCALE, LLAMA) if args.skip_offline else (KVSCALE, LLAMA, OFFLINE)
    runs: dict[int, list[dict[str, dict[str, Any]]]] = {c: [] for c in levels}
    for c, r, engine in schedule(levels, args.rounds, engines):
        if len(runs[c]) < r:
            runs[c].append({})
        runs[c][r - 1][engine] = run_one(c, r, engine)
    result["levels"] = {str(c): summarize_level(rounds) for c, rounds in runs.items()}
    result["goals"] = evaluate_goals(result["levels"])
    return result


def agreement(args, workload: Workload, start_kvscale, start_llama) -> dict[str, Any]:
    """Greedy tokens of the first prompts from each server (one request at a time), compared as
    text per token: llama's ids decoded with the tokenizer our server decodes its tokens with."""
    from kvscale.worker.model.loader import load_tokenizer

    prompts = workload.prompts[: args.agreement_prompts]
    n = args.agreement_tokens
    server = start_kvscale(1, "agreement")
    try:
        ours = [kvscale_greedy_tokens(server.base_url, p, n) for p in prompts]
    finally:
        server.stop()
    server = start_llama(1, "agreement")
    try:
        theirs_ids = [llama_greedy_tokens(server.base_url, p, n) for p in prompts]
    finally:
        server.stop()
    tokenizer = load_tokenizer(args.model)
    theirs = [[tokenizer.decode([t]) for t in ids] for ids in theirs_ids]
    return {"tokens_per_prompt": n, **agreement_figures(ours, theirs)}


def add_parser(sub, parents: list) -> None:
    p = sub.add_parser(
        "peer",
        parents=parents,
        help="llama.cpp's llama-server against kvscale's server and offline engine, alternating rounds",
    )
    p.add_argument("--model", required=True, help="the Hugging Face folder kvscale serves")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (required)")
    p.add_argument("--gguf", default=None, help="the same model converted to GGUF (required)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument(
        "--concurrency", default="1,8,32,64", help="comma-separated streams in flight, runs at each"
    )
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per level (medians over them)")
    add_engine_flags(p, batched_tokens_help="also llama-server's -b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--llama-threads", type=int, default=None, help="llama-server's -t (default: torch's thread count)"
    )
    p.add_argument(
        "--kvscale-flag",
        action="append",
        default=[],
        help="an extra `kvscale-worker serve` flag, repeatable; the = form: --kvscale-flag='--block-size 32'",
    )
    p.add_argument(
        "--llama-flag", action="append", default=[], help="an extra llama-server flag, like --kvscale-flag"
    )
    p.add_argument("--skip-offline", action="store_true", help="only the two servers")
    p.add_argument("--agreement-prompts", type=int, default=8, help="0: no agreement check")
    p.add_argument("--agreement-tokens", type=int, default=128)
    p.add_argument("--server-log-dir", default=None, help="where server logs go (default: a temp dir)")
    p.set_defaults(func=run)
