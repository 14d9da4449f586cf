"""nn.Linear with faster CPU paths for a few rows.

On the CPU the BLAS GEMM (`x @ W.T`) multiplies a handful of activation rows by a large weight
streaming it far below the machine's read bandwidth. Measured on this project's 2-core VM, a
2048x384 float32 weight cold in cache: 9.6 GB/s at 1 row, 5.8 at 2, 8.5 at 8 (docs/benchmarks.md,
"One-stream decode at the memory limit"). So, for large weights (not cache-resident):

- **one row, compiled** (the one-stream decode graph, whose batch of 1 is static): the product as
  `(W * x).sum(-1)`, which inductor turns into one vectorised, threaded reduction (31 GB/s). Eagerly
  the same expression would materialise a W-sized product: the library's kernel stays.
- **2..8 rows** (speculative verification, small decode batches, short chunks; eagerly, and in the
  compiled decode graph of 2..8 sequences, whose batch is bounded by 8): `W @ x.T`, the weight as
  the long operand (37 GB/s at 2 rows, 16 at 8), for expanding projections (out >= in: qkv,
  gate/up, lm_head). Contracting ones keep the library's choice.
- everything else, including the graphs whose batch is unbounded (at 32-64 rows `W @ x.T` won in
  isolation but lost inside the decode graph: 27 against 24 ms a step at 64 sequences), and every
  non-CPU device: `F.linear`.

**Packed weights** (`pack_weights`, after loading, on the CPU without tensor parallelism): each
weight is replaced by oneDNN's blocked copy of itself (`mkldnn._reorder_linear_weight`), and every
product takes `mkldnn._linear_pointwise`, at any row count, eagerly and in the graphs (AOTInductor
calls it through its C shim). The library's product of a plain weight re-lays the
weight out on every call, which is most of its cost at a few rows: all 25 weights of the fixture
model at 8 rows, bfloat16, eagerly: 2.29 -> 1.08 ms (docs/benchmarks.md, "Packed bfloat16 weights"). Same
memory: the packed copy replaces the plain one (a tied LM head gets its own, the embedding keeps
the plain table). bfloat16 only (`packs`).

In a graph, the row count is a symbol: a path is taken only where it is provable from the graph's
bounds (`statically_known_true`), so choosing one never adds a guard the export would refuse.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

SMALL_ROWS = (2, 8)
MIN_WEIGHT_ELEMENTS = 1 << 18  # smaller weights stay in cache, where the library's kernel is fine


def packs(dtype: torch.dtype) -> bool:
    """Whether CPU weights of this dtype are packed (`pack_weights`). bfloat16 only: packed
    float32 weights win from 8 rows up too, but lose the one-row graph's fused reduction (2.4-2.6
    against 1.6-2.2 ms a step, docs/benchmarks.md), and a plain copy beside the packed one would
    double the weights' memory. float16: oneDNN's kernels need CPU features we cannot count on."""
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and not weight.is_mkldnn and packs(weight.dtype)


def pack_weights(model: nn.Module) -> int:
    """Replace every packable Linear's weight by its oneDNN-packed copy, one at a time (the plain
    one is freed unless tied elsewhere, as the LM head is to the embedding). For a model served
    without tensor parallelism: a row-parallel layer's all-reduce takes the plain weight.
    Returns how many were packed."""
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear) and getattr(module, "tp", None) is None and can_pack(module.weight):
            module.pack()
            packed += 1
    return packed


def product_kind(
    rows, compiling: bool, out_features: int, in_features: int, numel: int, dtype: torch.dtype = torch.float32
) -> str:
    """How a CPU Linear multiplies `rows` rows (an int, or a graph's symbol): "reduce" (W * x summed),
    "weight_first" (W @ x.T) or "library" (F.linear). Pure: no guard is added on a symbol. Eagerly
    a weight under MIN_WEIGHT_ELEMENTS keeps the library's kernel (it stays in cache between calls);
    inside a graph every weight streams from memory once a step, and all take the faster form.
    `W @ x.T` is for float32 weights only (the library wins on 16-bit ones)."""
    if compiling and statically_known_true(rows == 1):
        return "reduce"
    small = statically_known_true(rows >= SMALL_ROWS[0]) and statically_known_true(rows <= SMALL_ROWS[1])
    expanding = out_features >= in_features and (compiling or numel >= MIN_WEIGHT_ELEMENTS)
    if small and expanding and dtype == torch.float32:
        return "weight_first"
    return "library"


class Linear(nn.Linear):
    def pack(self) -> None:
        plain = self.weight.detach()
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(plain), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        kind = "library"
        if x.device.type == "cpu" and x.dim() == 2:
            kind = product_kind(
                x.shape[0], torch.compiler.is_compiling(), self.out_features, self.in_features,
                self.weight.numel(), self.weight.dtype,
            )  # fmt: skip
        if kind == "library":
            return nn.functional.linear(x, self.weight, self.bias)
        if kind == "reduce":
            out = (self.weight * x).sum(-1)[None]
        else:
            out = torch.mm(self.weight, x.T).T.contiguous()
        return out if self.bias is None else out + self.bias
