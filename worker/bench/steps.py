"""One forward step at a time, on synthetic batches: the compiled CPU forward against the eager one,
in the same run (issue 19).

    python -m kvscale.worker.bench steps --model ../shared/models/tiny-code-target --json

For each mode (compiled, eager) one engine is built; for each case, a batch of SeqChunks is run
through `ModelRunner.forward_step` (inputs, forward, logits: what ModelRunner.launch does before
sampling) --iters times after a warm-up, and the median is reported, with the path the step took:
`graph` (attention inside the compiled graph), `backend_op` (the compiled graph around the
backend's attention op: length buckets, per-sequence prefill) or `eager`.
The cases are decode steps of one length (`b8_L300`: 8 sequences of 300 tokens), spread lengths,
lengths whose padding is past forward_batch.MAX_DECODE_PADDING, and one prefill chunk. The KV
contents are whatever the pool holds: timing does not depend on them. The modes run one after the
other, so a noisy machine shows as a drift between them: compare within one run, repeat the run.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

CASES: dict[str, list[int] | int] = {
    # decode steps: the context length of each sequence (one new token each)
    "b1_L300": [300],
    "b1_L1000": [1000],
    "b8_L300": [300] * 8,
    "b8_spread": [160, 190, 220, 260, 300, 350, 400, 450],
    "b32_L300": [300] * 32,
    "b32_spread": list(range(150, 470, 10)),
    "b64_spread": list(range(150, 470, 5)),
    "b64_one_long": [200] * 63 + [2000],  # padding ~8.5x the real work: length buckets
    "b64_halves": [200] * 32 + [800] * 32,
    # one prefill chunk of this many tokens
    "prefill_150": 150,
}
MODES = ("compiled", "eager")


def add_parser(sub, parents) -> None:
    p = sub.add_parser("steps", parents=parents, help="one forward step: compiled against eager (CPU)")
    p.add_argument("--model", required=True, help="a Hugging Face folder")
    p.add_argument("--iters", type=int, default=30, help="timed steps per case (median)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="the weights' and KV cache's dtype (auto: float32 on CPU)")
    p.set_defaults(func=run)


def case_chunks(case: list[int] | int, block_size: int) -> list:
    """The SeqChunks of a case; sequences get disjoint blocks, from block 1 on."""
    from kvscale.worker.model.forward_batch import SeqChunk

    lens = case if isinstance(case, list) else None
    chunks, next_block = [], 1
    for n in lens or [case]:
        blocks = list(range(next_block, next_block - (-n // block_size)))
        next_block += len(blocks)
        chunks.append(SeqChunk([5], n - 1, blocks) if lens else SeqChunk([5] * n, 0, blocks))
    return chunks


def step_path(runner, chunks) -> str:
    from kvscale.worker.model.forward_batch import build_forward_batch, in_graph_decode

    if getattr(runner.model, "compiled", None) is None:
        return "eager"
    common = build_forward_batch(chunks, runner.block_size, runner.device).common
    return "graph" if in_graph_decode(common) else "backend_op"


def time_step(runner, chunks, iters: int, warmup: int = 3) -> float:
    import torch

    num_logits = [1] * len(chunks)
    with torch.inference_mode():
        for _ in range(warmup):
            runner.forward_step(chunks, num_logits)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            runner.forward_step(chunks, num_logits)
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run(args) -> dict[str, Any]:
    import torch

    from kvscale.worker import LLM

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    # The engine's default block size (16) gives the most blocks any case needs.
    blocks_needed = 1 + max(case_chunks(CASES[c], 16)[-1].block_ids[-1] for c in cases)
    result: dict[str, Any] = {
        "torch_threads": torch.get_num_threads(), "dtype": args.dtype, "iters": args.iters, "modes": {},
    }  # fmt: skip
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        llm = LLM(
            args.model, device=args.device, dtype=args.dtype, enforce_eager=mode == "eager", max_num_seqs=64,
            compile_in_background=False,
            num_kv_blocks=max(4096, blocks_needed),
        )  # fmt: skip
        runner = llm.engine.runner
        rows = {}
        for name in cases:
            chunks = case_chunks(CASES[name], runner.block_size)
            rows[name] = {
                "ms": round(time_step(runner, chunks, args.iters), 3),
                "path": step_path(runner, chunks),
            }
        result["modes"][mode] = {"compile_s": runner.compile_seconds, "cases": rows}
        del llm, runner
        gc.collect()
    modes = result["modes"]
    if {"compiled", "eager"} <= modes.keys():  # above 1: the compiled forward is faster
        result["eager_over_compiled"] = {
            name: round(modes["eager"]["cases"][name]["ms"] / modes["compiled"]["cases"][name]["ms"], 2)
            for name in cases
        }
    return result
