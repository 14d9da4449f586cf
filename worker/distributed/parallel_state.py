"""The tensor-parallel group of this process (vLLM's name): who we are, and the two process groups.

`device_group` carries the activations (all-reduce, logits gather): NCCL on GPUs, gloo on CPUs. `cpu_group`
(always gloo) carries start-up agreements. Step inputs reach rank 0's own host through a shared-memory
ring (`step_ring`, shm_broadcast.py) and the ranks of other hosts through `step_group`, a gloo group of
rank 0 and those ranks (step_broadcast.py). The gloo groups have a long timeout because followers wait
in them while the server is idle. A rank that dies closes its sockets, so its peers' collectives fail
at once rather than waiting for a timeout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvscale.worker.distributed.shm_broadcast import ShmRingReader, ShmRingWriter

logger = logging.getLogger(__name__)

# A forward's collectives wait for the slowest rank's compute, never for a client.
STEP_TIMEOUT = timedelta(minutes=5)
# Followers block in the step broadcast while rank 0 has nothing to run.
IDLE_TIMEOUT = timedelta(days=365)


class TensorParallelError(RuntimeError):
    """The group is broken (a rank died or a collective failed): the engine cannot go on."""


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    device_group: object
    cpu_group: object
    # gloo, rank 0 and the ranks that do not read step_ring; None where there are none, and on
    # the ranks that read the ring.
    step_group: object | None = None
    step_ring: ShmRingWriter | ShmRingReader | None = None  # rank 0's writer, or this rank's reader

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and the sampler; the others only run forwards."""
        return self.rank == 0


def rank_device(device_type: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")


def init_tensor_parallel(
    rank: int,
    world_size: int,
    local_rank: int,
    device_type: str,
    master_addr: str,
    master_port: int,
    ring_ranks: int = 1,
    step_ring: ShmRingWriter | ShmRingReader | None = None,
) -> TensorParallelGroup:
    """Join the group (rank 0 hosts the rendezvous store at master_addr:master_port). Ranks below
    ring_ranks (rank 0's host, where the shared-memory ring works) get their steps from step_ring;
    every rank must pass the same ring_ranks."""
    device = rank_device(device_type, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=STEP_TIMEOUT,
    )
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    step_group = None
    if ring_ranks == 1:  # no ring: every other rank is on gloo
        step_group = cpu_group
    elif ring_ranks < world_size:  # new_group is collective: every rank creates it, its members keep it
        members = [0, *range(ring_ranks, world_size)]
        group = dist.new_group(members, backend="gloo", timeout=IDLE_TIMEOUT)
        step_group = group if rank in members else None
    logger.info("joined the tensor-parallel group", extra={"rank": rank, "world_size": world_size})
    return TensorParallelGroup(
        rank, world_size, local_rank, device, dist.group.WORLD, cpu_group, step_group, step_ring
    )


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
