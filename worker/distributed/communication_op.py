"""The collectives the sharded layers use; every failure is a TensorParallelError (a broken group)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvscale.worker.distributed.parallel_state import TensorParallelError, TensorParallelGroup


def tensor_model_parallel_all_reduce(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """Sum of x over the ranks, in place."""
    try:
        dist.all_reduce(x, group=tp.device_group)
    except RuntimeError as e:  # DistBackendError too
        raise TensorParallelError(f"all_reduce failed: {e}") from e
    return x


def tensor_model_parallel_gather(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor | None:
    """The ranks' x concatenated along the last dim, on rank 0; None on the others."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.world_size)] if tp.is_driver else None
    try:
        dist.gather(x, parts, dst=0, group=tp.device_group)
    except RuntimeError as e:  # DistBackendError too
        raise TensorParallelError(f"gather failed: {e}") from e
    return torch.cat(parts, dim=-1) if parts is not None else None


def min_over_ranks(value: int, tp: TensorParallelGroup) -> int:
    """The smallest of every rank's value (the KV block count all ranks can hold)."""
    t = torch.tensor([value], dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    except RuntimeError as e:  # DistBackendError too
        raise TensorParallelError(f"all_reduce MIN failed: {e}") from e
    return int(t.item())


def gather_objects(obj, tp: TensorParallelGroup) -> list:
    """Every rank's obj, in rank order, on every rank (start-up facts, e.g. each rank's KV bytes)."""
    out = [None] * tp.world_size
    try:
        dist.all_gather_object(out, obj, group=tp.cpu_group)
    except RuntimeError as e:  # DistBackendError too
        raise TensorParallelError(f"all_gather_object failed: {e}") from e
    return out
