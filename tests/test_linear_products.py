"""layers/linear.py's product forms on the CPU: which one each row count takes, eagerly and inside
an exported graph (from the graph's bounds alone: an export that had to guard on the row count
would fail), and that each computes the same product."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from kvscale.worker.model.layers.linear import MIN_WEIGHT_ELEMENTS, Linear, product_kind

BIG = 2048 * 384


def test_product_kind_by_rows_weight_and_mode():
    assert product_kind(1, True, 2048, 384, BIG) == "reduce"
    assert product_kind(1, True, 384, 384, 384 * 384) == "reduce"  # in a graph every weight streams
    assert product_kind(1, False, 2048, 384, BIG) == "library"  # eagerly: a W-sized temporary
    assert product_kind(4, False, 2048, 384, BIG) == "weight_first"
    assert product_kind(4, False, 640, 384, 640 * 384) == "library"  # under MIN_WEIGHT_ELEMENTS, eager
    assert MIN_WEIGHT_ELEMENTS > 640 * 384
    assert product_kind(4, True, 640, 384, 640 * 384) == "weight_first"
    assert product_kind(4, True, 384, 1024, 384 * 1024) == "library"  # contracting
    assert product_kind(9, True, 2048, 384, BIG) == "library"
    # 16-bit weights: the library's kernel wins from 2 rows; one row in a graph still reduces
    assert product_kind(4, True, 2048, 384, BIG, torch.bfloat16) == "library"
    assert product_kind(4, False, 2048, 384, BIG, torch.float16) == "library"
    assert product_kind(1, True, 2048, 384, BIG, torch.bfloat16) == "reduce"


def _ops(batch: int, dim) -> set[str]:
    layer = Linear(384, 2048, bias=True)

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x)

    x = torch.randn(batch, 384)
    with torch.inference_mode():
        exported = torch.export.export(Wrap(), (x,), dynamic_shapes=({0: dim},) if dim else None)
        out = exported.module()(x)
    torch.testing.assert_close(
        out, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4
    )
    return {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize(
    ("batch", "dim", "expected", "absent"),
    [
        (1, None, "aten.sum.dim_IntList", "aten.linear.default"),  # static one row: a reduction
        (3, Dim("b", min=2, max=8), "aten.mm.default", "aten.linear.default"),  # bounded by 8: W @ x.T
        (10, Dim("b", min=9), "aten.linear.default", "aten.mm.default"),
        (3, Dim("b", min=2), "aten.linear.default", "aten.mm.default"),  # unbounded: not provable
    ],
)
def test_a_graph_takes_the_form_its_bounds_prove(batch, dim, expected, absent):
    ops = _ops(batch, dim)
    assert expected in ops and absent not in ops, ops
