"""Tensor parallelism on torch.distributed: the process group, step broadcast and rank processes."""
