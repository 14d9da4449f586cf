"""The processes tests/test_shm_broadcast.py spawns around the step ring (a module of their own:
spawned children import their target by name)."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time

from kvscale.worker.distributed.shm_broadcast import PeerGone, ShmRingReader, ShmRingWriter

BIG = 100_000  # bytes: a step many times a test ring's slot


def message(i: int) -> tuple:
    """The i-th message of a run: mostly small and varied, every 97th far larger than a slot."""
    if i % 97 == 13:
        return i, bytes([i % 251]) * BIG
    return i, list(range(i % 50)), "x" * (i % 7)


def read_all(reader: ShmRingReader, results) -> None:
    """Read until STOP (None); report (messages read, index of the first wrong one or None)."""
    count, wrong = 0, None
    while (got := reader.read()) is not None:
        if wrong is None and got != message(count):
            wrong = count
        count += 1
    results.send((count, wrong, reader.received))


def read_forever(reader: ShmRingReader, results) -> None:
    """Report this pid, then each message read, until the writer is gone (exit 3)."""
    results.send(os.getpid())
    try:
        while True:
            results.send(reader.read())
    except PeerGone:
        os._exit(3)


def write_then_idle(results) -> None:
    """A writer (rank 0) whose reader is its child: report the reader's pid, write 3 messages,
    then idle until killed."""
    ring = ShmRingWriter(1, slot_bytes=4096, num_slots=4)
    child = multiprocessing.get_context("spawn").Process(target=read_forever, args=(ring.handles[0], results))
    child.start()
    ring.watch([child.pid])
    for i in range(3):
        ring.write(message(i))
    while True:
        time.sleep(60)


def digest(step) -> str:
    """A step in a few bytes: the ranks share one pipe, whose writes are atomic only when small."""
    return hashlib.sha256(repr(step).encode()).hexdigest()[:12]


def step_rank(rank: int, world: int, port: int, ring_ranks: int, reader, results) -> None:
    """A follower rank: join the group, take steps until STOP, report (rank, path, their digests)."""
    from kvscale.worker.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
    from kvscale.worker.distributed.step_broadcast import STOP, broadcast_step

    tp = init_tensor_parallel(rank, world, rank, "cpu", "127.0.0.1", port, ring_ranks, reader)
    steps = []
    while (step := broadcast_step(tp)) is not STOP:
        steps.append(digest(step))
    results.send((rank, "shm" if tp.step_ring is not None else "gloo", steps))
    destroy_tensor_parallel()


def step_rank0(world: int, port: int, ring_ranks: int, steps: list, results) -> None:
    """Rank 0: a ring for ranks 1 .. ring_ranks - 1 (its "host"), the others over gloo; send
    steps, a PING and STOP."""
    from kvscale.worker.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
    from kvscale.worker.distributed.step_broadcast import PING, STOP, broadcast_step

    ring = ShmRingWriter(ring_ranks - 1) if ring_ranks > 1 else None
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(1, world):
        reader = ring.handles[rank - 1] if rank < ring_ranks else None
        proc = ctx.Process(target=step_rank, args=(rank, world, port, ring_ranks, reader, results))
        proc.start()
        procs.append(proc)
    if ring is not None:
        ring.watch([p.pid for p in procs[: ring_ranks - 1]])
    tp = init_tensor_parallel(0, world, 0, "cpu", "127.0.0.1", port, ring_ranks, ring)
    for step in [*steps, PING, STOP]:
        broadcast_step(tp, step)
    for proc in procs:
        proc.join(60)
    destroy_tensor_parallel()
    results.send((0, [proc.exitcode for proc in procs]))
