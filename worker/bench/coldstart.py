"""Cold start: from a fresh process to serving, and to compiled steps (issue 29).

    python -m kvscale.worker.bench coldstart --model ../shared/models/tiny-code-target --json

Each run is a new Python process that builds the engine (`LLM`) at --threads torch threads and
takes one token a step until 200 steps ran the compiled forward. Reported per mode: seconds from
the process' start to the engine built (what /ready waits for) and to the first compiled step,
and the median step of each forward (eager ones ran while the build took the cores it could get:
--nice decides how many).
Modes: `package` (the compile cache holds this model's AOTInductor package: it is loaded at
start), `cold` (an empty compile cache: eager steps while `kvscale-worker compile` builds the
package behind at --nice) and `eager` (--enforce-eager: the eager step with no build beside it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
from kvscale.worker import LLM, SamplingParams
llm = LLM(sys.argv[1], enforce_eager=sys.argv[6] == "eager", compile_cache_dir=sys.argv[2],
          compile_nice=int(sys.argv[4]), compile_reserve_core=sys.argv[5] == "1", num_kv_blocks=256)
ready = time.time()
engine = llm.engine
eager, compiled = [], []
while len(compiled) < 200:
    if not engine.has_unfinished_requests():  # one stream, for as long as it takes
        engine.add_request([0, 5, 6, 7], SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
    engine.step()
    for kind, seconds in engine.take_stats().step_times:
        (compiled if kind == "compiled" else eager).append(seconds)
    if len(compiled) == 1:
        at = time.time()
    if sys.argv[6] == "eager" and len(eager) >= 200:
        at = time.time()
        break
    if sys.argv[6] != "eager" and engine.runner.compiler is None and engine.runner.forward_kind == "eager":
        raise SystemExit("the compiled forward was not built")
ms = lambda xs: round(1e3 * sorted(xs)[len(xs) // 2], 3) if xs else None
print(json.dumps({"ready": ready, "compiled": at, "eager_steps": len(eager), "eager_step_ms": ms(eager),
                  "compiled_step_ms": ms(compiled)}))
"""


def add_parser(sub, parents) -> None:
    p = sub.add_parser("coldstart", parents=parents, help="process start to Ready and to compiled steps")
    p.add_argument("--model", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--nice", type=int, default=10, help="the build's niceness in `cold` runs")
    p.add_argument("--modes", default="package,cold")
    p.add_argument(
        "--reserve-core",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serving leaves the build a core (EngineArgs.compile_reserve_core)",
    )
    p.set_defaults(func=run)


def one_run(
    model: str, cache: Path, threads: int, nice: int, reserve: bool = True, mode: str = "cold"
) -> dict[str, float]:
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(cache), str(threads), str(nice), str(int(reserve)), mode],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "to_ready_s": round(out["ready"] - started, 2),
        "to_compiled_s": round(out["compiled"] - started, 2),
        # One stream's decode steps: their median while the build runs behind, and once compiled.
        "eager_steps": out["eager_steps"],
        "eager_step_ms": out["eager_step_ms"],
        "compiled_step_ms": out["compiled_step_ms"],
    }


def run(args) -> dict[str, Any]:
    result: dict[str, Any] = {
        "model": args.model, "threads": args.threads, "nice": args.nice, "reserve_core": args.reserve_core,
        "modes": {},
    }  # fmt: skip
    scratch = Path(tempfile.mkdtemp(prefix="kvscale-coldstart-"))
    try:
        filled = scratch / "filled"
        for mode in args.modes.split(","):
            runs = []
            for i in range(args.runs):
                if mode in ("cold", "eager"):
                    cache = scratch / f"{mode}-{i}"
                else:
                    cache = filled
                    if not filled.exists():  # built once, outside the timed runs
                        one_run(args.model, filled, args.threads, 0)
                runs.append(one_run(args.model, cache, args.threads, args.nice, args.reserve_core, mode))
            result["modes"][mode] = {
                "runs": runs,
                "median_to_ready_s": statistics.median(r["to_ready_s"] for r in runs),
                "median_to_compiled_s": statistics.median(r["to_compiled_s"] for r in runs),
            }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result
