"""Each step's model inputs, from rank 0 to the other ranks, which run the same forward.

What travels is the forward's own input: the SeqChunks (token ids, start position, block ids) and
how many logit rows each needs. Every rank builds the same flat batch from them (forward_batch.py),
so nothing rank 0 decides (scheduling, sampling, speculation) has to run twice. It goes as a pickled
object over the gloo `cpu_group` with torch.distributed's broadcast, for ranks on one host and across
hosts alike (no shared-memory fast path yet: docs/parallelism.md).
"""

from __future__ import annotations

import torch.distributed as dist

from kvscale.worker.distributed.parallel_state import TensorParallelError, TensorParallelGroup

STOP = None  # rank 0 is shutting down: followers leave their loop
PING = "ping"  # rank 0 is idle: nothing to run, but a lost rank shows (its socket is closed)


def broadcast_step(tp: TensorParallelGroup, step=STOP):
    """Rank 0 sends `step` (a (chunks, num_logits) pair, PING or STOP); other ranks get it back."""
    box = [step if tp.is_driver else None]
    try:
        dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    except RuntimeError as e:  # DistBackendError too
        raise TensorParallelError(f"step broadcast failed: {e}") from e
    return box[0]
