"""The multi-LoRA kernels: Triton's shrink/expand (BGMV) against the plain-torch reference on the
CPU under the Triton interpreter, and the reference against a row-by-row loop. Rows without an
adapter (-1) must be left exactly as they were; outputs the kernels allocate start as NaN."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated

import pytest
import torch

pytest.importorskip("triton")

from kvscale.kernels import lora, triton_lora

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def tables(num_slots, rank, in_features, slices, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out_features = sum(size for _, size in slices)
    # Scaled so that products are O(1), where bfloat16's rounding is what the tolerance allows for.
    a = (torch.randn(num_slots, len(slices) * rank, in_features, generator=g) * in_features**-0.5).to(dtype)
    b = (torch.randn(num_slots, out_features, rank, generator=g) * rank**-0.5).to(dtype)
    return a, b


def row_by_row(out, x, a, b, slots, slices):
    """The definition: every row on its own, with its own adapter's matrices."""
    out = out.clone().float()
    rank = b.shape[-1]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        y = x[t].float() @ a[slot].float().T
        for i, (offset, size) in enumerate(slices):
            out[t, offset : offset + size] += (
                b[slot, offset : offset + size].float() @ y[i * rank : (i + 1) * rank]
            )
    return out


QKV = [(0, 24), (24, 8), (32, 8)]  # Q, K, V slices of a fused projection (GQA)
CASES = [
    ("qkv-mixed", QKV, [0, 2, -1, 1, 0, 2, 2, -1, 3]),
    ("one-slice-one-adapter", [(0, 40)], [1, 1, 1, 1]),
    ("gate-up-base-only", [(0, 20), (20, 20)], [-1, -1, -1]),
    ("single-row", QKV, [3]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,slices,slots", CASES, ids=[c[0] for c in CASES])
def test_triton_lora_matches_reference(name, slices, slots, dtype):
    rank, in_features = 8, 48
    a, b = tables(4, rank, in_features, slices, dtype)
    token_slots = torch.tensor(slots, dtype=torch.int64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(slots), in_features, generator=g).to(dtype)
    base = torch.randn(len(slots), sum(s for _, s in slices), generator=g).to(dtype)
    want = lora.add_lora(base.clone(), x, a, b, token_slots, slices)
    got = triton_lora.add_lora(base.clone(), x, a, b, token_slots, slices)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    untouched = token_slots < 0
    assert torch.equal(got[untouched], base[untouched])  # base rows: bit for bit as they were
    # The shrink alone: rows without an adapter are zeros, not what the allocation held (NaN).
    y = triton_lora.lora_shrink(x, a, token_slots)
    assert not y.isnan().any() and not y[untouched].any()
    torch.testing.assert_close(y.float(), lora.lora_shrink(x, a, token_slots).float(), **TOL[dtype])


@pytest.mark.parametrize("name,slices,slots", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_row_by_row(name, slices, slots):
    a, b = tables(4, 8, 48, slices, torch.float32, seed=3)
    token_slots = torch.tensor(slots, dtype=torch.int64)
    x = torch.randn(len(slots), 48)
    base = torch.randn(len(slots), sum(s for _, s in slices))
    got = lora.add_lora(base.clone(), x, a, b, token_slots, slices)
    torch.testing.assert_close(got, row_by_row(base, x, a, b, token_slots, slices), **TOL[torch.float32])
    # The shrink/expand split gives the same as the fused reference.
    split = lora.lora_expand(base.clone(), lora.lora_shrink(x, a, token_slots), b, token_slots, slices)
    torch.testing.assert_close(split, got, **TOL[torch.float32])


def test_padded_rank_is_exact():
    """An adapter of rank 3 in a table of rank 8 (zero-padded A rows and B columns) gives what the
    unpadded matrices give: the padding adds exact zeros."""
    g = torch.Generator().manual_seed(5)
    a3, b3 = torch.randn(3, 16, generator=g), torch.randn(12, 3, generator=g)
    a = torch.zeros(1, 8, 16)
    b = torch.zeros(1, 12, 8)
    a[0, :3], b[0, :, :3] = a3, b3
    x = torch.randn(5, 16, generator=g)
    out = lora.add_lora(torch.zeros(5, 12), x, a, b, torch.zeros(5, dtype=torch.int64), [(0, 12)])
    torch.testing.assert_close(out, x @ a3.T @ b3.T)


PACKED_CASES = [
    ("qkv-mixed", QKV, [0, 2, -1, 1, 0, 2, 2, -1, 3]),
    ("gap-in-the-slot-range", QKV, [1, 3, 3, -1, 1]),  # slot 2 absent: all padding
    ("uneven-groups", [(0, 20), (20, 20)], [0, 0, 0, 1, 2, 2, 0, 1]),
]


@pytest.mark.parametrize("name,slices,slots", PACKED_CASES, ids=[c[0] for c in PACKED_CASES])
def test_packed_matches_row_by_row_and_leaves_base_rows_alone(name, slices, slots):
    """The CPU's one-bmm-for-all-adapters path: the same sums as the definition; rows without an
    adapter (and row 0, where padding lands) get exactly what they should."""
    a, b = tables(4, 8, 48, slices, torch.float32, seed=7)
    token_slots = torch.tensor(slots, dtype=torch.int64)
    packed = lora.pack_rows(token_slots.numpy())
    assert packed is not None
    x = torch.randn(len(slots), 48)
    base = torch.randn(len(slots), sum(s for _, s in slices))
    bd = lora.block_diagonal(b, slices)
    for packed in (lora.pack_rows(token_slots.numpy()), lora.pack_rows(token_slots.numpy(), for_graph=True)):
        assert packed is not None
        w = packed.window
        for got in (
            lora.add_lora_packed(base.clone(), x, a[w], bd[w], packed.gather, packed.scatter),
            lora.add_lora_packed_graph(base.clone(), x, a[w], bd[w], packed.gather, packed.inverse),
        ):
            torch.testing.assert_close(
                got, row_by_row(base, x, a, b, token_slots, slices), **TOL[torch.float32]
            )
            untouched = token_slots < 0
            assert torch.equal(got[untouched], base[untouched])


@pytest.mark.parametrize("slots", [[2], [3, 3, -1], [0, -1, 0, 0], [1, 2]])
def test_packed_for_the_graph_takes_one_adapter_and_one_row_too(slots):
    """The compiled LoRA graphs' packing: one slot and one row are packed too (a 1 x 1 batch); their
    gather-back gives the same sums."""
    slices = QKV
    a, b = tables(4, 8, 48, slices, torch.float32, seed=3)
    token_slots = torch.tensor(slots, dtype=torch.int64)
    packed = lora.pack_rows(token_slots.numpy(), for_graph=True)
    assert packed is not None and packed.window == slice(min(set(slots) - {-1}), max(slots) + 1)
    x = torch.randn(len(slots), 48)
    base = torch.randn(len(slots), sum(s for _, s in slices))
    w = packed.window
    bd = lora.block_diagonal(b, slices)[w]
    got = lora.add_lora_packed_graph(base.clone(), x, a[w], bd, packed.gather, packed.inverse)
    torch.testing.assert_close(got, row_by_row(base, x, a, b, token_slots, slices), **TOL[torch.float32])


@pytest.mark.parametrize("name,slices,slots", PACKED_CASES, ids=[c[0] for c in PACKED_CASES])
def test_runs_match_row_by_row_and_leave_base_rows_alone(name, slices, slots):
    """The CPU's runs path (each run of rows a view, addmm_ in place): the same sums."""
    a, b = tables(4, 8, 48, slices, torch.float32, seed=9)
    token_slots = torch.tensor(slots, dtype=torch.int64)
    x = torch.randn(len(slots), 48)
    base = torch.randn(len(slots), sum(s for _, s in slices))
    got = lora.add_lora_runs(base.clone(), x, a, b, lora.runs_of(token_slots.numpy()), slices)
    torch.testing.assert_close(got, row_by_row(base, x, a, b, token_slots, slices), **TOL[torch.float32])
    assert torch.equal(got[token_slots < 0], base[token_slots < 0])


def test_each_step_picks_its_way():
    """Prefill chunks (few long runs) run as views, a decode batch mixing adapters is packed, one
    adapter on every row is one matmul pair, and a long chunk beside one short row falls back."""
    import numpy as np

    cpu = torch.device("cpu")
    prefill = lora.plan_rows(np.repeat([0, 3, 1, -1], [120, 200, 90, 50]), cpu)
    assert prefill.runs == [(0, 0, 120), (3, 120, 320), (1, 320, 410)] and prefill.packed is None
    decode = lora.plan_rows(np.arange(64) % 8, cpu)
    assert decode.runs is None and decode.packed is not None and decode.packed.gather.shape == (8, 8)
    single = lora.plan_rows(np.full(10, 2), cpu)
    assert single.segments == [(2, None)] and single.runs is None and single.packed is None
    mixed = lora.plan_rows(np.concatenate([np.zeros(600, dtype=np.int64), np.arange(40) % 8]), cpu)
    assert mixed.runs is not None  # 640 rows in 40 runs (the first decode row extends the chunk's run)


def test_packing_is_declined_where_it_would_not_pay():
    import numpy as np

    assert lora.pack_rows(np.array([-1, -1])) is None  # no adapter rows
    assert lora.pack_rows(np.array([2, 2, 2, -1])) is None  # one adapter: one matmul pair does it
    # A 512-row prefill chunk of slot 0 beside one decode row of slot 1: padding would double the work.
    assert lora.pack_rows(np.array([0] * 512 + [1])) is None
    assert lora.pack_rows(np.array([0, 1] * 32)).gather.shape == (2, 32)
    assert lora.pack_rows(np.array([0] * 40 + [1])).gather.shape == (2, 40)  # 39 padded rows: still pays
