"""Start this host's tensor-parallel ranks as child processes and watch them.

A rank that exits while the group is up (a crash, the OOM killer, a kill -9) breaks the group: the
monitor records the failure (group_failure(), which /health reads), stops the host's other ranks and
calls the on_failure hooks (the server exits). Nothing else is left: children die with their parent
(rank_worker.die_with_parent), and the step ring rank 0 shares with them has no name (no /dev/shm
entry): it is a memfd and eventfds handed over at spawn (shm_broadcast.py).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import wait

logger = logging.getLogger(__name__)

_failure: str | None = None
_failure_hooks: list[Callable[[str], None]] = []


def group_failure() -> str | None:
    """Why this process' tensor-parallel group broke (None: it has not)."""
    return _failure


def on_group_failure(hook: Callable[[str], None]) -> None:
    _failure_hooks.append(hook)


def record_group_failure(reason: str) -> None:
    global _failure
    if _failure is not None:
        return
    _failure = reason
    logger.error("tensor-parallel group broken: %s", reason)
    for hook in list(_failure_hooks):
        hook(reason)


def local_ranks(tensor_parallel_size: int, nnodes: int, node_rank: int) -> list[int]:
    """The global ranks node node_rank runs: a contiguous block of tensor_parallel_size / nnodes."""
    per_node = tensor_parallel_size // nnodes
    return list(range(node_rank * per_node, (node_rank + 1) * per_node))


class RankProcesses:
    """The ranks this process starts (rank_worker.rank_main each), and their monitor thread."""

    def __init__(self, args, ranks: list[int], step_readers: list | None = None) -> None:
        self.args, self.ranks = args, ranks
        # Rank 0's host: each rank's end of the shared-memory step ring (ShmRingHandle), in rank order.
        self.step_readers = step_readers or [None] * len(ranks)
        self.procs: list[multiprocessing.Process] = []
        self._ready = []
        self._stopping = False
        self.num_ready = 0
        self.exited: dict[str, int | None] = {}  # process name -> exit code, by the monitor
        self.finished = threading.Event()  # every rank has exited

    def start(self) -> None:
        from kvscale.worker.executor.rank_worker import rank_main

        if not self.ranks:  # node 0 of a group with one rank per node: rank 0 is all there is
            self.finished.set()
            return
        ctx = multiprocessing.get_context("spawn")
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        first = self.ranks[0] - self.ranks[0] % self.args.ranks_per_node
        for rank, step_reader in zip(self.ranks, self.step_readers, strict=True):
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=rank_main,
                args=(self.args, rank, rank - first, os.getpid(), send, level, step_reader),
                name=f"kvscale-tp-rank-{rank}",
                daemon=True,
            )
            proc.start()
            send.close()
            self.procs.append(proc)
            self._ready.append(receive)
        logger.info("started tensor-parallel ranks %s: pids %s", self.ranks, [p.pid for p in self.procs])
        threading.Thread(target=self._monitor, name="kvscale-tp-monitor", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def all_ready(self) -> bool:
        """Every rank has joined the group and loaded its shard."""
        for conn in list(self._ready):
            try:
                if conn.poll():
                    conn.recv()
                    self.num_ready += 1
                    self._ready.remove(conn)
            except (EOFError, OSError):
                self._ready.remove(conn)
        return self.num_ready == len(self.procs)

    def alive(self) -> bool:
        """No rank has exited (read off the monitor: only its thread reaps the children)."""
        return not self.exited

    def _monitor(self) -> None:
        pending = {p.sentinel: p for p in self.procs}
        while pending:
            for sentinel in wait(list(pending)):
                proc = pending.pop(sentinel)
                proc.join()
                self.exited[proc.name] = proc.exitcode
                # Exit code 0: the rank got rank 0's STOP (the group is shutting down), not a crash.
                if not self._stopping and proc.exitcode != 0:
                    self._kill_all()
                    record_group_failure(f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}")
        self.finished.set()

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.name not in self.exited:
                with contextlib.suppress(OSError, ValueError):  # already reaped
                    p.kill()

    def stop(self, timeout: float = 10.0) -> None:
        """After rank 0 broadcast STOP: wait for the ranks to leave, kill those that do not."""
        self._stopping = True
        if not self.finished.wait(timeout):
            self._kill_all()
            self.finished.wait(5.0)


class TensorParallelDriver:
    """Rank 0's side of the group, in the engine's process: the host's other ranks as children, and
    this process joined as rank 0 (which hosts the rendezvous store)."""

    def __init__(self, args) -> None:
        from kvscale.worker.distributed.parallel_state import init_tensor_parallel
        from kvscale.worker.distributed.shm_broadcast import ShmRingWriter
        from kvscale.worker.distributed.step_broadcast import ring_ranks
        from kvscale.worker.executor.rank_worker import cpu_threads_per_rank
        from kvscale.worker.model.model_runner import resolve_device

        device = resolve_device(args.device)
        if device.type == "cpu":
            import torch

            torch.set_num_threads(cpu_threads_per_rank(args.ranks_per_node))
        followers = local_ranks(args.tensor_parallel_size, args.nnodes, 0)[1:]
        on_ring = ring_ranks(args.ranks_per_node)
        ring = ShmRingWriter(on_ring - 1) if on_ring > 1 else None
        self.ranks = RankProcesses(args, followers, ring.handles if ring else None)
        self.ranks.start()
        try:
            if ring is not None:
                ring.watch(self.ranks.pids)
            self.tp = init_tensor_parallel(
                0, args.tensor_parallel_size, 0, device.type, args.master_addr, args.master_port,
                on_ring, ring,
            )  # fmt: skip
        except BaseException:
            self.ranks.stop(timeout=0)
            if ring is not None:
                ring.close()
            raise

    def ping(self) -> None:
        """An idle engine's check that every rank is still there (raises TensorParallelError)."""
        from kvscale.worker.distributed.parallel_state import TensorParallelError
        from kvscale.worker.distributed.step_broadcast import PING, broadcast_step

        try:
            broadcast_step(self.tp, PING)
        except TensorParallelError as e:
            record_group_failure(str(e))
            raise

    def shutdown(self) -> None:
        """Tell every rank to stop, wait for this host's, leave the group."""
        from kvscale.worker.distributed.parallel_state import TensorParallelError, destroy_tensor_parallel
        from kvscale.worker.distributed.step_broadcast import STOP, broadcast_step

        broken = group_failure() is not None
        if not broken:
            try:
                broadcast_step(self.tp, STOP)
            except TensorParallelError as e:
                logger.warning("could not tell the ranks to stop: %s", e)
                broken = True
        self.ranks.stop(timeout=0 if broken else 10.0)  # a broken group's ranks are killed at once
        if self.tp.step_ring is not None:
            self.tp.step_ring.close()
        destroy_tensor_parallel()
