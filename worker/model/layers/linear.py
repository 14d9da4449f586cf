"""nn.Linear with a faster CPU path for a few rows.

Speculative verification, small decode batches and short prefill chunks multiply a handful of
activation rows (2..8) by a large weight. On the CPU, `x @ W.T` for such shapes runs a GEMM kernel
that streams the weight at about half the speed of the same product computed as `W @ x.T` (the
weight as the long operand): measured 1.5-3x faster for this project's expanding projections
(qkv, gate/up, lm_head: out >= in), single-threaded, weights cold in cache (docs/benchmarks.md).
Contracting projections (out < in), small (cache-resident) weights and other row counts keep the
library's own choice, as does every non-CPU device and the compiled CPU forward (there F.linear
was faster at 2..8 rows: 401 against 362 tokens/s at 8 streams, and the graph needs no 2..8 split).
"""

from __future__ import annotations

import torch
from torch import nn

SMALL_ROWS = (2, 8)
MIN_WEIGHT_ELEMENTS = 1 << 18  # smaller weights stay in cache, where the library's kernel is fine


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if (
            not torch.compiler.is_compiling()  # compiled, F.linear measured faster (docs/engine.md)
            and x.device.type == "cpu"
            and SMALL_ROWS[0] <= rows <= SMALL_ROWS[1]
            and x.dim() == 2
            and self.out_features >= self.in_features
            and self.weight.numel() >= MIN_WEIGHT_ELEMENTS
        ):
            out = torch.mm(self.weight, x.T).T.contiguous()
            return out if self.bias is None else out + self.bias
        return nn.functional.linear(x, self.weight, self.bias)
