"""The step broadcast: per-step latency of the shared-memory ring against gloo's broadcast_object_list.

    python -m kvscale.worker.bench broadcast --sizes 1,64,256 --steps 500 --followers 1 --json

Rank 0 (this process) and --followers spawned ranks join one gloo group and share one ring; both
paths are step_broadcast.broadcast_step itself, on a TensorParallelGroup set up for one path or the
other. A step is a decode step of --sizes sequences (one token each, --context tokens of context, so
context / 16 block ids) as the engine sends it. For each size and path, after a warm-up, rank 0
sends the step --steps times; each follower notes when it holds the unpickled step, and the step's
latency is the slowest follower's moment minus rank 0's just before it sent (CLOCK_MONOTONIC is one
clock for every process of the host). Rank 0 waits for every follower's answer before the next send,
so steps never queue. Also: rank 0's own time in broadcast_step (send), and the pickled size.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import statistics
import time
from typing import Any

BLOCK_SIZE = 16
PATHS = ("shm", "gloo")
WARMUP = 20


def decode_step(num_seqs: int, context: int) -> tuple[list, list[int]]:
    from kvscale.worker.model.forward_batch import SeqChunk

    blocks = -(-context // BLOCK_SIZE)
    chunks = [
        SeqChunk([1000 + i], context - 1, list(range(i * blocks, (i + 1) * blocks))) for i in range(num_seqs)
    ]
    return chunks, [1] * num_seqs


def _groups(rank: int, world: int, ring) -> dict[str, Any]:
    """One TensorParallelGroup per path, over the same process group."""
    import torch
    import torch.distributed as dist

    from kvscale.worker.distributed.parallel_state import TensorParallelGroup

    def group(step_group, step_ring):
        return TensorParallelGroup(rank, world, rank, torch.device("cpu"), None, None, step_group, step_ring)

    return {"shm": group(None, ring), "gloo": group(dist.group.WORLD, None)}


def _follower(
    rank: int, world: int, port: int, parent_pid: int, reader, plan: list[tuple[str, int]], answers
) -> None:
    from kvscale.worker.executor.rank_worker import die_with_parent

    die_with_parent(parent_pid)
    import torch
    import torch.distributed as dist

    from kvscale.worker.distributed.step_broadcast import broadcast_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    groups = _groups(rank, world, reader)
    for path, count in plan:
        for _ in range(count):
            broadcast_step(groups[path])
            answers.send(time.clock_gettime(time.CLOCK_MONOTONIC))
    dist.destroy_process_group()


def _us(values: list[float], q: float) -> float:
    return round(1e6 * statistics.quantiles(values, n=100)[int(100 * q) - 1], 1)


def run(args) -> dict[str, Any]:
    import torch.distributed as dist

    from kvscale.worker.bench.serve import free_port
    from kvscale.worker.distributed.shm_broadcast import ShmRingWriter
    from kvscale.worker.distributed.step_broadcast import broadcast_step

    sizes = [int(s) for s in args.sizes.split(",")]
    world, port = args.followers + 1, free_port()
    plan = [(path, WARMUP + args.steps) for _ in sizes for path in PATHS]
    ring = ShmRingWriter(args.followers)
    ctx = multiprocessing.get_context("spawn")
    procs, answers = [], []
    for rank in range(1, world):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_follower,
            args=(rank, world, port, os.getpid(), ring.handles[rank - 1], plan, send),
            daemon=True,
        )
        proc.start()
        send.close()
        procs.append(proc)
        answers.append(receive)
    ring.watch([p.pid for p in procs])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world)
    groups = _groups(0, world, ring)
    results: dict[str, Any] = {
        "followers": args.followers,
        "steps": args.steps,
        "context_tokens": args.context,
        "sizes": {},
    }
    try:
        for size in sizes:
            step = decode_step(size, args.context)
            row: dict[str, Any] = {"pickled_bytes": len(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))}
            for path in PATHS:
                latency, send = [], []
                for i in range(WARMUP + args.steps):
                    t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
                    broadcast_step(groups[path], step)
                    sent = time.clock_gettime(time.CLOCK_MONOTONIC)
                    arrived = max(a.recv() for a in answers)
                    if i >= WARMUP:
                        latency.append(arrived - t0)
                        send.append(sent - t0)
                row[path] = {
                    "latency_us_p50": round(1e6 * statistics.median(latency), 1),
                    "latency_us_p90": _us(latency, 0.9),
                    "send_us_p50": round(1e6 * statistics.median(send), 1),
                }
            row["gloo_over_shm_p50"] = round(row["gloo"]["latency_us_p50"] / row["shm"]["latency_us_p50"], 2)
            results["sizes"][str(size)] = row
    finally:
        for p in procs:
            p.join(30)
        dist.destroy_process_group()
        ring.close()
    return results


def add_parser(sub, parents: list) -> None:
    p = sub.add_parser(
        "broadcast", parents=parents, help="step broadcast: shared-memory ring against gloo, per-step latency"
    )
    p.add_argument("--sizes", default="1,64,256", help="sequences per step, comma-separated")
    p.add_argument("--steps", type=int, default=500, help="timed steps per size and path (median over them)")
    p.add_argument("--followers", type=int, default=1, help="ranks besides rank 0 (TP size - 1)")
    p.add_argument("--context", type=int, default=1024, help="tokens of context per sequence (its block ids)")
    p.set_defaults(func=run)
