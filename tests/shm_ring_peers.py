"""The processes tests/test_shm_broadcast.py spawns around the step ring (a module of their own:
spawned children import their target by name)."""

from __future__ import annotations

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
