"""Tensor-parallel linear layers (vLLM's names). Column-parallel layers hold a slice of the output
features and need no communication; row-parallel ones hold a slice of the input features and sum
their partial products over the ranks. With no group (tp=None) each is exactly our Linear.
"""

from __future__ import annotations

import torch
from torch import nn

from kvscale.worker.distributed.communication_op import tensor_model_parallel_all_reduce
from kvscale.worker.model.layers.linear import Linear


class ColumnParallelLinear(Linear):
    """out_features is this rank's share (the loader fills it with its slice); QKV and gate/up
    are this with fused shards."""


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp=None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(x)
        out = tensor_model_parallel_all_reduce(nn.functional.linear(x, self.weight), self.tp)
        return out if self.bias is None else out + self.bias  # once, after the sum
