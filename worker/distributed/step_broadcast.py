"""Each step's model inputs, from rank 0 to the other ranks, which run the same forward.

What travels is the forward's own input: the SeqChunks (token ids, start position, block ids) and
how many logit rows each needs. Every rank builds the same flat batch from them (forward_batch.py),
so nothing rank 0 decides (scheduling, sampling, speculation) has to run twice.

Two paths, chosen once at start-up (ring_ranks), the same on every rank:
- the ranks on rank 0's host read it from a shared-memory ring (shm_broadcast.py): one pickle, one
  copy, one event per rank, no socket;
- the ranks of other hosts get it pickled over gloo (`step_group`: rank 0 and those ranks), with
  torch.distributed's broadcast_object_list. Their own host-mates do not share a ring: simple, and
  the network is slower than a pickle anyway.
"""

from __future__ import annotations

import torch.distributed as dist

from kvscale.worker.distributed import shm_broadcast
from kvscale.worker.distributed.parallel_state import TensorParallelError, TensorParallelGroup
from kvscale.worker.distributed.shm_broadcast import PeerGone

STOP = None  # rank 0 is shutting down: followers leave their loop
# Rank 0 is idle: nothing to run, but a lost rank of another host shows (its socket is closed). It
# goes to the gloo ranks only: the launcher's monitor already sees a local rank exit.
PING = "ping"


def ring_ranks(ranks_per_node: int) -> int:
    """How many ranks, from 0, take the shared-memory path: rank 0's host, where shm works."""
    return ranks_per_node if shm_broadcast.supported() else 1


def broadcast_step(tp: TensorParallelGroup, step=STOP):
    """Rank 0 sends `step` (a (chunks, num_logits) pair, PING or STOP); other ranks get it back."""
    try:
        if not tp.is_driver:
            if tp.step_ring is not None:
                return tp.step_ring.read()
            return _gloo_broadcast(tp.step_group, None)
        if tp.step_ring is not None and step is not PING:
            tp.step_ring.write(step)
        if tp.step_group is not None:
            _gloo_broadcast(tp.step_group, step)
        return step
    except PeerGone as e:
        raise TensorParallelError(f"step broadcast failed: {e}") from e


def _gloo_broadcast(group, step):
    box = [step]
    try:
        dist.broadcast_object_list(box, src=0, group=group)
    except RuntimeError as e:  # DistBackendError too
        raise TensorParallelError(f"step broadcast failed: {e}") from e
    return box[0]
