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
that of the rows' own ranks (not every resident adapter's). On a CPU a step picks one of three
ways, once for every layer (`plan_rows`, measured in docs/benchmarks.md):
- `runs`: few long runs of consecutive rows with one adapter (the prefill chunks: a sequence's rows
  are consecutive): each a view, a shrink and an in-place addmm_ per slice, no gather or scatter;
- `packed`: many short rows (decode of a batch mixing adapters), where ~20 small ops per adapter
  per layer cost more than their arithmetic: the rows grouped by slot and padded to the longest
  group, one bmm shrinks every adapter's rows and one expands them into every slice (B kept
  block-diagonal for it: `block_diagonal`), one index_add_ adds them (SGMV's segments as a padded
  batch; the slot tables are read in place, never gathered);
- `segments` otherwise (a long chunk beside many decode rows): the per-adapter loop of `add_lora`.
The Triton version (triton_lora.py) gathers per row instead (BGMV), with add_lora's signature.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
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


@dataclass(frozen=True)
class Packed:
    """A step's adapter rows grouped by slot: slots [lo, lo + S), each group padded to L rows (a
    slot in the range with no row is all padding). Padded positions gather a zero row and so add
    zeros, into row 0."""

    lo: int
    gather: torch.Tensor  # [S, L] the row of each position; padding: T (the appended zero row)
    scatter: torch.Tensor  # [S, L] the row of each position; padding: 0
    inverse: torch.Tensor  # [T] each row's position; rows without an adapter: S * L (a zero row)

    @property
    def window(self) -> slice:
        """The slots it covers, as a slice of the slot tables' first dimension."""
        return slice(self.lo, self.lo + self.gather.shape[0])


# Packing pays while the padded positions are few: at most this many, or half the rows. A long
# prefill chunk beside one decode row of another adapter would pad that one to the chunk's length.
MAX_PADDING_ROWS = 64


def pack_rows(
    token_slots: np.ndarray, device: torch.device | str = "cpu", for_graph: bool = False
) -> Packed | None:
    """The rows of each slot in token_slots as one padded batch, or None when that would not pay:
    fewer than two slots present (one matmul pair does it; but `for_graph`, the compiled LoRA
    graphs, have no other way), or too much padding (for_graph: MAX_GRAPH_PADDING)."""
    rows = np.flatnonzero(token_slots >= 0)
    if rows.size == 0:
        return None
    slots = token_slots[rows]
    lo, hi = int(slots.min()), int(slots.max()) + 1
    counts = np.bincount(slots - lo, minlength=hi - lo)
    length = int(counts.max())
    if not for_graph and np.count_nonzero(counts) < 2:
        return None
    padding = (hi - lo) * length - rows.size
    if padding > max(MAX_PADDING_ROWS, int(rows.size * (MAX_GRAPH_PADDING if for_graph else 0.5))):
        return None
    order = np.argsort(slots, kind="stable")
    rows, slots = rows[order], slots[order] - lo
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    position = slots * length + (np.arange(rows.size) - starts[slots])
    gather = np.full((hi - lo) * length, token_slots.shape[0], dtype=np.int64)
    scatter = np.zeros((hi - lo) * length, dtype=np.int64)
    gather[position] = scatter[position] = rows
    inverse = np.full(token_slots.shape[0], (hi - lo) * length, dtype=np.int64)
    inverse[rows] = position
    as_tensor = lambda a: torch.from_numpy(a.reshape(hi - lo, length)).to(device)  # noqa: E731
    return Packed(lo, as_tensor(gather), as_tensor(scatter), torch.from_numpy(inverse).to(device))


def block_diagonal(lora_b: torch.Tensor, slices: list[tuple[int, int]]) -> torch.Tensor:
    """[S, n_slices * R, out]: each slot's B transposed, slice i's block at rows [i * R, (i + 1) * R)
    and its output columns, zeros elsewhere, so that one matmul expands every slice at once."""
    num_slots, out_features, rank = lora_b.shape
    bd = lora_b.new_zeros(num_slots, len(slices) * rank, out_features)
    for i, (offset, size) in enumerate(slices):
        bd[:, i * rank : (i + 1) * rank, offset : offset + size] = lora_b[
            :, offset : offset + size
        ].transpose(1, 2)
    return bd


def add_lora_packed(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b_bd: torch.Tensor,
    gather: torch.Tensor,
    scatter: torch.Tensor,
) -> torch.Tensor:
    """add_lora over packed rows (a Packed's gather and scatter), with the tables of its window's
    slots alone and B as block_diagonal gives it: one bmm shrinks every adapter's rows, one expands
    them into every slice, one index_add_ adds them to their rows (5 ops whatever the number of
    adapters: the eager CPU path's way)."""
    return out.index_add_(0, scatter.flatten(), _packed_products(x, lora_a, lora_b_bd, gather))


def _packed_products(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b_bd: torch.Tensor, gather: torch.Tensor
) -> torch.Tensor:
    """[S * L, out]: every packed position's x @ A.T @ B.T (zeros for padding, which gathers an
    appended zero row): one bmm shrinks, one expands every slice."""
    s, length = gather.shape
    xs = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, gather.flatten()).view(s, length, -1)
    y = torch.bmm(xs, lora_a.transpose(1, 2))  # [S, L, n_slices * R]
    return torch.bmm(y, lora_b_bd).view(s * length, -1)


# Graph padding: inside a compiled graph a padded row costs its rank-sized products alone, while a
# step that does not pack runs the whole forward eagerly (10-25 % slower on a CPU), so more pays.
MAX_GRAPH_PADDING = 1.0  # x the rows


def add_lora_packed_graph(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b_bd: torch.Tensor,
    gather: torch.Tensor,
    inverse: torch.Tensor,
) -> torch.Tensor:
    """add_lora_packed for a compiled graph: the products brought back to their rows by a gather
    (`inverse`), which inductor fuses into the base projection's addmm as its bias, rather than a
    scatter, whose padding positions (all into row 0) its loop would add one by one. B stays
    block-diagonal: at decode sizes a bmm call costs more than the zeros it multiplies (measured:
    one bmm per slice made the decode steps slower). lora_a, lora_b_bd: the packed window's slots."""
    delta = _packed_products(x, lora_a, lora_b_bd, gather)
    return out.add_(torch.cat([delta, delta.new_zeros(1, delta.shape[1])]).index_select(0, inverse))


# (slot, first row, end row) of each run of consecutive rows with one adapter (-1 left out).
Runs = list[tuple[int, int, int]]


def runs_of(token_slots: np.ndarray) -> Runs:
    """The runs of consecutive rows with the same adapter slot: a sequence's rows are consecutive in
    the flat batch, so a prefill chunk is one run."""
    if token_slots.size == 0:
        return []
    edges = np.flatnonzero(np.diff(token_slots)) + 1
    starts = np.concatenate(([0], edges))
    ends = np.concatenate((edges, [token_slots.size]))
    return [
        (int(token_slots[a]), int(a), int(b))
        for a, b in zip(starts, ends, strict=True)
        if token_slots[a] >= 0
    ]


def add_lora_runs(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    runs: Runs,
    slices: list[tuple[int, int]],
) -> torch.Tensor:
    """add_lora over runs of rows, each a view: no gather, no scatter, a shrink and one in-place
    addmm_ per slice for each run (for few long runs: the prefill chunks of a step, where the
    arithmetic counts and a block-diagonal B would multiply n_slices times the zeros)."""
    rank = lora_b.shape[-1]
    for slot, start, end in runs:
        y = x[start:end] @ lora_a[slot].T
        for i, (offset, size) in enumerate(slices):
            b = lora_b[slot, offset : offset + size]
            out[start:end, offset : offset + size].addmm_(y[:, i * rank : (i + 1) * rank], b.T)
    return out


# Rows per run from which runs beat packing (a prefill chunk: ~100s; decode: 1).
LONG_RUN = 16


@dataclass(frozen=True)
class StepRows:
    """A step's adapter rows as every layer reads them (plan_rows): the per-row slots, the rows of
    each slot, and at most one of the faster ways on the CPU."""

    token_slots: torch.Tensor  # [T] on the device
    segments: Segments
    runs: Runs | None = None
    packed: Packed | None = None


def plan_rows(token_slots: np.ndarray, device: torch.device) -> StepRows:
    """How this step's adapter rows run (see the module's docstring); on CUDA, Triton's gather."""
    slots = torch.from_numpy(token_slots).to(device)
    present = np.unique(token_slots[token_slots >= 0]).tolist()
    if len(present) == 1 and (token_slots == present[0]).all():  # one matmul pair does it
        return StepRows(slots, [(present[0], None)])
    segments = [(s, torch.from_numpy(np.flatnonzero(token_slots == s)).to(device)) for s in present]
    if device.type != "cpu" or not present:
        return StepRows(slots, segments)
    runs = long_runs(token_slots)
    if runs is not None:
        return StepRows(slots, segments, runs=runs)
    return StepRows(slots, segments, packed=pack_rows(token_slots, device))


def long_runs(token_slots: np.ndarray) -> Runs | None:
    """The step's runs of adapter rows when they are long (LONG_RUN rows on average: prefill
    chunks), else None. Long runs are best added in place, run by run (`add_lora_runs`): on a CPU
    that beats packing them, even inside a compiled graph, where gathering the rows and bringing
    the products back costs more than the products (docs/benchmarks.md)."""
    runs = runs_of(token_slots)
    return runs if np.count_nonzero(token_slots >= 0) >= LONG_RUN * len(runs) else None


def add_lora_step(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_b_bd: torch.Tensor | None,
    rows: StepRows,
    slices: list[tuple[int, int]],
    targeted: Callable[[int], bool] = lambda slot: True,
) -> torch.Tensor:
    """add_lora the way `rows` planned; `targeted(slot)`: whether that slot's adapter has this
    projection (the packed path multiplies the others' zero tables rather than regroup)."""
    if rows.runs is not None:
        return add_lora_runs(out, x, lora_a, lora_b, [r for r in rows.runs if targeted(r[0])], slices)
    if rows.packed is not None and lora_b_bd is not None:
        p = rows.packed
        return add_lora_packed(out, x, lora_a[p.window], lora_b_bd[p.window], p.gather, p.scatter)
    segments = [(s, r) for s, r in rows.segments if targeted(s)]
    return add_lora(out, x, lora_a, lora_b, rows.token_slots, slices, segments) if segments else out


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
