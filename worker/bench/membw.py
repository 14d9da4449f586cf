"""This machine's weight-read limit, and one-stream decode steps against it (issue 33).

    python -m kvscale.worker.bench membw --model ../shared/models/tiny-code-target --json

A decode step at one stream reads every weight the step multiplies by once: each layer's
projections, the norms and the LM head (the embedding table only for the one row it looks up,
unless the LM head is the same tensor). Its time cannot go under those bytes over the memory
read bandwidth. Measured here, in the same run:

- **read bandwidth**: a tensor far bigger than the caches summed (`sum()`: reads only; median of
  --iters passes, on torch's threads as the engine uses them), and a copy (`copy_`: reads and
  writes, counted as both) for comparison with the usual STREAM-style figure;
- **bytes per token**: the weights a one-stream decode step reads, from the model the engine
  loaded (dtype as served);
- **the limit**: bytes per token / read bandwidth, against the compiled one-stream decode step
  (`bench steps`' `b1_L300`, its median) and the eager one.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from kvscale.worker.bench.steps import CASES, case_chunks, step_path, time_step


def add_parser(sub, parents) -> None:
    p = sub.add_parser("membw", parents=parents, help="the weight-read limit of one-stream decode (CPU)")
    p.add_argument("--model", required=True, help="a Hugging Face folder")
    p.add_argument("--mib", type=int, default=512, help="size of the bandwidth test's tensor")
    p.add_argument("--iters", type=int, default=30, help="timed passes (median)")
    p.add_argument("--case", default="b1_L300", choices=[c for c in CASES if c.startswith("b1_")])
    p.add_argument("--modes", default="compiled,eager")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run)


def _median_s(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth(mib: int, iters: int) -> dict[str, float]:
    """GB/s (1e9 bytes) of reading a `mib` MiB float32 tensor, and of copying it (read + write)."""
    import torch

    n = mib * 2**20 // 4
    src = torch.rand(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    size = src.numel() * src.element_size()
    read_s = _median_s(lambda: src.sum(), iters)
    copy_s = _median_s(lambda: dst.copy_(src), iters)
    return {
        "read_gb_s": round(size / read_s / 1e9, 2),
        "copy_gb_s": round(2 * size / copy_s / 1e9, 2),
        "bytes": size,
    }


def decode_bytes_per_token(model) -> int:
    """The weight bytes one decode step reads: every parameter, less the embedding table (one row
    of it is read) unless the LM head shares it (a tied head packed for the CPU is a copy of its own)."""
    params = dict(model.named_parameters(remove_duplicate=True))
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = next((p for name, p in params.items() if "embed_tokens" in name), None)
    head = next((p for name, p in params.items() if name.endswith("lm_head.weight")), None)
    if embed is not None and head is not None and head is not embed:
        total -= embed.numel() * embed.element_size() - embed.shape[-1] * embed.element_size()
    return total


def run(args) -> dict[str, Any]:
    import torch

    from kvscale.worker import LLM

    result: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "iters": args.iters}
    result["case"] = args.case
    result["bandwidth"] = bw = bandwidth(args.mib, args.iters)
    chunks_case = CASES[args.case]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    result["modes"] = {}
    for mode in modes:
        llm = LLM(
            args.model, device=args.device, enforce_eager=mode == "eager", max_num_seqs=8,
            compile_in_background=False,
        )  # fmt: skip
        runner = llm.engine.runner
        if "bytes_per_token" not in result:
            result["bytes_per_token"] = decode_bytes_per_token(runner.model)
            result["limit_ms"] = round(1e3 * result["bytes_per_token"] / (bw["read_gb_s"] * 1e9), 3)
        chunks = case_chunks(chunks_case, runner.block_size)
        ms = time_step(runner, chunks, args.iters)
        result["modes"][mode] = {
            "step_ms": round(ms, 3),
            "over_limit": round(ms / result["limit_ms"], 2),
            "path": step_path(runner, chunks),
        }
        del llm, runner
        gc.collect()
    return result
