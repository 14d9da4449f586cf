"""One tensor-parallel rank other than 0, in its own process: join the group, load this rank's shard,
then run every forward rank 0 broadcasts until it says stop.

Started by launcher.RankProcesses with multiprocessing's spawn (never fork: a forked torch with
threads, or CUDA, is not safe). The process dies with its parent (PR_SET_PDEATHSIG), so a killed
worker never leaves a rank behind holding its memory or its port.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits (Linux); exits now if the parent already has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def cpu_threads_per_rank(num_local_ranks: int) -> int:
    """The host's cores shared between its ranks (each rank's torch would otherwise take them all)."""
    return max(1, len(os.sched_getaffinity(0)) // num_local_ranks)


def rank_main(
    args, rank: int, local_rank: int, parent_pid: int, ready, log_level: str, step_reader=None
) -> None:
    """step_reader: this rank's end of rank 0's shared-memory step ring (a ShmRingReader, attached
    when the process started), or None where steps come over gloo."""
    die_with_parent(parent_pid)
    from kvscale.common.json_logging import configure_logging

    configure_logging(log_level, "json")
    import torch

    from kvscale.worker.distributed.parallel_state import (
        TensorParallelError,
        destroy_tensor_parallel,
        init_tensor_parallel,
    )
    from kvscale.worker.distributed.step_broadcast import PING, STOP, broadcast_step, ring_ranks
    from kvscale.worker.model.model_runner import ModelRunner, resolve_device

    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(args.ranks_per_node))
    try:
        tp = init_tensor_parallel(
            rank, args.tensor_parallel_size, local_rank, device.type, args.master_addr, args.master_port,
            ring_ranks(args.ranks_per_node), step_reader,
        )  # fmt: skip
        runner = ModelRunner(args, tp=tp)
        ready.send(rank)
        ready.close()
        with torch.inference_mode():
            while (step := broadcast_step(tp)) is not STOP:
                if step != PING:
                    runner.forward_step(*step)
    except TensorParallelError as e:
        logger.error("tensor-parallel rank %d: the group broke: %s", rank, e)
        os._exit(1)
    destroy_tensor_parallel()
    # The tests read how the steps came (a silent fall-back to gloo would fail them).
    via = f"{step_reader.received} over shared memory" if step_reader is not None else "over gloo"
    logger.info("tensor-parallel rank %d stopped (steps %s)", rank, via)
