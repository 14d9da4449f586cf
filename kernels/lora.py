"""Many LoRA adapters over one flat batch (S-LoRA / Punica): the reference in plain torch.

The base projection runs once for every token; each token row then adds the low-rank product of
its own adapter, `x @ A[slot].T @ B[slot].T`, where `slot` is the row's entry in `token_slots`
(-1: no adapter, the row is left alone). Adapters are never merged into the base weights, so one
batch mixes any of the resident adapters and the base model.

Layout of a projection's slot table (worker/lora/slots.py fills it):
- `lora_a` [S, n_slices * R, in]: per slot, the A matrices of the projection's slices stacked
  (Q, K, V for the fused QKV projection; gate, up for gate/up; one slice elsewhere), each padded
  to the table's rank R with zero rows;
- `lora_b` [S, out, R]: per slot, the B matrices (scaling folded in), output rows in the fused
  projection's order; slice i's rows multiply the shrunk activations' columns [i * R, (i + 1) * R).
- `slices`: (output offset, output size) of each slice.

Punica's two steps: *shrink* (x [T, in] -> [T, n_slices * R]) and *expand* (-> added into each
slice's columns of the projection's output). Here they run per segment: the rows of each adapter
present in the batch are gathered and multiplied by that adapter's matrices alone, so the work is
that of the rows' own ranks (not every resident adapter's), at one small matmul pair per adapter.
The Triton version (triton_lora.py) gathers per row instead (BGMV), with the same signature.
"""

from __future__ import annotations

import torch

# (slot, the rows of the flat batch that use it); rows None: every row of the batch.
Segments = list[tuple[int, torch.Tensor | None]]


def segments_of(token_slots: torch.Tensor) -> Segments:
    """The rows of each adapter slot present in token_slots (slot -1, no adapter, is left out)."""
    slots = token_slots.tolist()
    present = sorted({s for s in slots if s >= 0})
    if len(present) == 1 and all(s == present[0] for s in slots):
        return [(present[0], None)]
    return [(s, torch.nonzero(token_slots == s).flatten()) for s in present]


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, segments: Segments | None = None
) -> torch.Tensor:
    """[T, n_slices * R]: each row's x times its adapter's stacked A matrices; 0 for rows without one."""
    y = x.new_zeros(x.shape[0], lora_a.shape[1])
    for slot, rows in segments_of(token_slots) if segments is None else segments:
        if rows is None:
            y = x @ lora_a[slot].T
        else:
            y[rows] = x.index_select(0, rows) @ lora_a[slot].T
    return y


def lora_expand(
    out: torch.Tensor,
    y: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slices: list[tuple[int, int]],
    segments: Segments | None = None,
) -> torch.Tensor:
    """Add each row's shrunk activations times its adapter's B into `out` (in place), slice by slice."""
    rank = lora_b.shape[-1]
    for slot, rows in segments_of(token_slots) if segments is None else segments:
        ys = y if rows is None else y.index_select(0, rows)
        for i, (offset, size) in enumerate(slices):
            delta = ys[:, i * rank : (i + 1) * rank] @ lora_b[slot, offset : offset + size].T
            if rows is None:
                out[:, offset : offset + size] += delta
            else:
                out[:, offset : offset + size].index_add_(0, rows, delta)
    return out


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slices: list[tuple[int, int]],
    segments: Segments | None = None,
) -> torch.Tensor:
    """out += x @ A[slot].T @ B[slot].T per row (in place; returns out). `segments`: segments_of
    token_slots, when the caller has them (computed once per step, used by every layer)."""
    segments = segments_of(token_slots) if segments is None else segments
    rank = lora_b.shape[-1]
    for slot, rows in segments:
        xs = x if rows is None else x.index_select(0, rows)
        y = xs @ lora_a[slot].T  # shrink: [rows, n_slices * R]
        for i, (offset, size) in enumerate(slices):  # expand, one slice at a time
            delta = y[:, i * rank : (i + 1) * rank] @ lora_b[slot, offset : offset + size].T
            if rows is None:
                out[:, offset : offset + size] += delta
            else:
                out[:, offset : offset + size].index_add_(0, rows, delta)
    return out
