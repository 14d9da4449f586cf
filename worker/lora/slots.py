"""The device's adapter slots and one step's view of them.

`LoRASlotTable`: per layer and fused projection, the stacked A and B of `max_loras` adapters at rank
`max_lora_rank` (kernels/lora.py's layout), allocated once at start-up (before the KV cache is
sized, so that it is counted). Writing an adapter into a slot zeroes what its previous tenant left
and copies the new one in, padded to the table's rank with zeros (exact: padding adds zeros).

`LoRABatch`: a step's per-token slot indices, the rows of each adapter present and how they run
(kernels/lora.plan_rows: computed once per step, read by every layer), applied after each
projection: `out += x @ A[slot].T @ B[slot].T`.

`PackedLoRA`: the same products inside the compiled LoRA graphs (model/aot_package.py's
`decode_lora` and `chunk_lora`), from tensors alone: the packed rows and the slot tables of their
window, which `LoRASlotTable.graph_inputs` lays out flat, as the graphs take them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvscale.kernels.dispatch import add_lora
from kvscale.kernels.lora import (
    StepRows,
    add_lora_packed_graph,
    block_diagonal,
    long_runs,
    pack_rows,
    plan_rows,
)
from kvscale.worker.lora.adapter import LoRAAdapter, ProjectionShape, projection_shapes


class LoRASlotTable:
    def __init__(self, spec, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.shapes = projection_shapes(spec)
        self.max_loras = max_loras
        self.rank = max_rank
        self.device = device
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for _ in range(spec.num_layers):
            self.a.append(
                {
                    p: torch.zeros(
                        max_loras, len(s.slices) * max_rank, s.in_features, dtype=dtype, device=device
                    )
                    for p, s in self.shapes.items()
                }
            )
            self.b.append(
                {
                    p: torch.zeros(max_loras, s.out_features, max_rank, dtype=dtype, device=device)
                    for p, s in self.shapes.items()
                }
            )
        # On the CPU, B also block-diagonal (kernels/lora.block_diagonal), for the packed path's
        # single expand per projection: n_slices x B's memory, rank-sized (a few % of the model).
        self.b_bd: list[dict[str, torch.Tensor]] | None = None
        if device.type == "cpu":
            self.b_bd = [
                {
                    p: torch.zeros(max_loras, len(s.slices) * max_rank, s.out_features, dtype=dtype)
                    for p, s in self.shapes.items()
                }
                for _ in range(spec.num_layers)
            ]
        # Per slot: the (layer, projection) pairs its adapter targets (the others stay zero).
        self.targets: list[frozenset[tuple[int, str]]] = [frozenset()] * max_loras
        self.eager_steps = 0  # steps whose adapter rows ran on the eager forward (`batch`)

    @property
    def nbytes(self) -> int:
        tables = (*self.a, *self.b, *(self.b_bd or ()))
        return sum(t.numel() * t.element_size() for layer in tables for t in layer.values())

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer, projection in self.targets[slot]:
            self.a[layer][projection][slot].zero_()
            self.b[layer][projection][slot].zero_()
            if self.b_bd is not None:
                self.b_bd[layer][projection][slot].zero_()
        rank, non_blocking = adapter.rank, self.device.type == "cuda"
        for (layer, projection), (a, b) in adapter.weights.items():
            shape = self.shapes[projection]
            slices = len(shape.slices)
            dst = self.a[layer][projection][slot].view(slices, self.rank, -1)
            dst[:, :rank].copy_(a.view(slices, rank, -1), non_blocking=non_blocking)
            self.b[layer][projection][slot][:, :rank].copy_(b, non_blocking=non_blocking)
            if self.b_bd is not None:
                table = self.b[layer][projection][slot : slot + 1]
                self.b_bd[layer][projection][slot] = block_diagonal(table, list(shape.slices))[0]
        self.targets[slot] = frozenset(adapter.weights)

    def batch(self, token_slots: np.ndarray) -> LoRABatch:
        """A step's view for the eager forward: token_slots[t] is row t's slot (-1: the base model)."""
        self.eager_steps += 1
        return LoRABatch(self, plan_rows(token_slots, self.device))

    def graph_inputs(self, token_slots: np.ndarray) -> list[torch.Tensor] | None:
        """A step's adapter rows as the compiled LoRA graphs take them (PackedLoRA reads them back):
        the rows' gather and inverse, then per layer and projection the window's A and
        block-diagonal B, views of the tables (no copy). None when packing would not pay
        (kernels/lora.pack_rows), and for long runs of rows (prefill chunks), which run faster in
        place, eagerly (kernels/lora.long_runs)."""
        if long_runs(token_slots) is not None:
            return None
        packed = pack_rows(token_slots, self.device, for_graph=True)
        if packed is None:
            return None
        w = packed.window
        flat = [packed.gather, packed.inverse]
        assert self.b_bd is not None  # the compiled graphs are the CPU's
        for a, b_bd in zip(self.a, self.b_bd, strict=True):
            for p in self.shapes:
                flat += (a[p][w], b_bd[p][w])
        return flat


@dataclass
class LoRABatch:
    table: LoRASlotTable
    rows: StepRows  # the rows of each slot present, and how they run (kernels/lora.plan_rows)

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
        """Add the LoRA products of `projection` in `layer` into its output, in place."""
        t = self.table

        def targeted(slot: int) -> bool:
            return (layer, projection) in t.targets[slot]

        if not any(targeted(slot) for slot, _ in self.rows.segments):
            return
        add_lora(
            out, x, t.a[layer][projection], t.b[layer][projection],
            t.b_bd[layer][projection] if t.b_bd is not None else None,
            self.rows, list(t.shapes[projection].slices), targeted,
        )  # fmt: skip


class PackedLoRA:
    """The LoRA products inside the compiled LoRA graphs: every projection's from the packed rows
    (kernels/lora.add_lora_packed_graph) and its window of the slot tables, all graph inputs. An
    adapter without a projection has zero tables there: it adds zeros, as the eager packed path does."""

    def __init__(self, flat: list[torch.Tensor], shapes: dict[str, ProjectionShape]) -> None:
        self.gather, self.inverse = flat[0], flat[1]
        per_layer = 2 * len(shapes)
        self.tables = [
            {p: (flat[i + 2 * j], flat[i + 2 * j + 1]) for j, p in enumerate(shapes)}
            for i in range(2, len(flat), per_layer)
        ]

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
        a, b_bd = self.tables[layer][projection]
        add_lora_packed_graph(out, x, a, b_bd, self.gather, self.inverse)
