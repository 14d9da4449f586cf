"""The device's adapter slots and one step's view of them.

`LoRASlotTable`: per layer and fused projection, the stacked A and B of `max_loras` adapters at rank
`max_lora_rank` (kernels/lora.py's layout), allocated once at start-up (before the KV cache is
sized, so that it is counted). Writing an adapter into a slot zeroes what its previous tenant left
and copies the new one in, padded to the table's rank with zeros (exact: padding adds zeros).

`LoRABatch`: a step's per-token slot indices and the rows of each adapter present (computed once
per step, read by every layer), applied after each projection: `out += x @ A[slot].T @ B[slot].T`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvscale.kernels.dispatch import add_lora
from kvscale.kernels.lora import Segments
from kvscale.worker.lora.adapter import LoRAAdapter, projection_shapes


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
        # Per slot: the (layer, projection) pairs its adapter targets (the others stay zero).
        self.targets: list[frozenset[tuple[int, str]]] = [frozenset()] * max_loras

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in (*self.a, *self.b) for t in layer.values())

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer, projection in self.targets[slot]:
            self.a[layer][projection][slot].zero_()
            self.b[layer][projection][slot].zero_()
        rank, non_blocking = adapter.rank, self.device.type == "cuda"
        for (layer, projection), (a, b) in adapter.weights.items():
            slices = len(self.shapes[projection].slices)
            dst = self.a[layer][projection][slot].view(slices, self.rank, -1)
            dst[:, :rank].copy_(a.view(slices, rank, -1), non_blocking=non_blocking)
            self.b[layer][projection][slot][:, :rank].copy_(b, non_blocking=non_blocking)
        self.targets[slot] = frozenset(adapter.weights)

    def batch(self, token_slots: np.ndarray) -> LoRABatch:
        """A step's view: token_slots[t] is row t's slot (-1: the base model alone)."""
        slots = torch.from_numpy(token_slots).to(self.device)
        present = np.unique(token_slots[token_slots >= 0]).tolist()
        if len(present) == 1 and (token_slots == present[0]).all():
            segments: Segments = [(present[0], None)]
        else:
            segments = [
                (s, torch.from_numpy(np.flatnonzero(token_slots == s)).to(self.device)) for s in present
            ]
        return LoRABatch(self, slots, segments)


@dataclass
class LoRABatch:
    table: LoRASlotTable
    token_slots: torch.Tensor  # [T] on the device
    segments: Segments  # the rows of each slot present

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
        """Add the LoRA products of `projection` in `layer` into its output, in place."""
        targets = self.table.targets
        segments = [(s, rows) for s, rows in self.segments if (layer, projection) in targets[s]]
        if not segments:
            return
        add_lora(
            out, x, self.table.a[layer][projection], self.table.b[layer][projection], self.token_slots,
            list(self.table.shapes[projection].slices), segments,
        )  # fmt: skip
