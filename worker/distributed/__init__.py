"""Tensor parallelism on torch.distributed: the process groups, the collectives the model's layers
call, and each forward's inputs broadcast from rank 0 (the rank processes are in executor/)."""
