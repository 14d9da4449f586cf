"""Every Triton kernel against its plain-torch reference, on the CPU under the Triton interpreter.

TRITON_INTERPRET must be set before the kernels are decorated (at import), hence the assignment
above the imports. Outputs the kernels allocate are poisoned (NaN) by the `poison` fixture, and
caller-provided outputs are NaN-filled too, so an element a kernel forgets to write fails the
comparison. Shapes are tiny: the interpreter runs each program in numpy.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from kvscale.kernels import (
    kv_cache,
    norm,
    paged_attention,
    rotary,
    triton_kv_cache,
    triton_norm,
    triton_paged_attention,
    triton_rotary,
)
from kvscale.worker.model.attention.backend import CommonAttentionMetadata
from kvscale.worker.model.attention.selector import get_attention_backend
from kvscale.worker.model.attention.torch_backend import TorchAttentionBackend
from kvscale.worker.model.attention.triton_backend import TritonAttentionBackend

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Tensors allocated with torch.empty/empty_like start as NaN (ints as -7)."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not actual.isnan().any(), "unwritten (NaN-poisoned) elements in the output"
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[expected.dtype])


def make_cache(num_kv_heads, num_blocks, block_size, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def make_block_tables(seq_lens, block_size, num_blocks, seed=0, dtype=torch.int64):
    """Scattered, distinct blocks per sequence; padding entries point at arbitrary valid blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks, generator=g)
    width = max(need) + 1
    tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=g)
    offset = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[offset : offset + n]
        offset += n
    return tables.to(dtype)


# -- KV-cache write -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(8, 2, 32), (16, 1, 24), (64, 4, 16)])
def test_write_kv_cache(dtype, block_size, num_kv_heads, head_dim):
    num_blocks, num_tokens = 5, 13
    g = torch.Generator().manual_seed(1)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_ref, v_ref = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    kv_cache.write_kv_cache(key, value, k_ref, v_ref, slots)
    # A negative slot (CUDA-graph padding) writes nothing.
    padded = torch.cat([slots, torch.tensor([-1])])
    triton_kv_cache.write_kv_cache(
        torch.cat([key, key[:1]]), torch.cat([value, value[:1]]), k_tri, v_tri, padded
    )
    assert torch.equal(k_tri.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_tri.nan_to_num(7.0), v_ref.nan_to_num(7.0))


# -- norms and rotary -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 32)])  # a hidden state; per-head q/k norm
def test_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    assert_close(triton_norm.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))
    out, res = triton_norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    out_ref, res_ref = norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_close(res, res_ref)
    assert_close(out, out_ref)


def test_rms_norm_strided_rows():
    x = torch.randn(6, 160)[:, 16:112]  # a column slice: rows strided, not contiguous
    weight = torch.randn(96)
    assert_close(triton_norm.rms_norm(x, weight, 1e-5), norm.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_half", [(32, 16), (32, 12), (24, 12)])  # full and partial
def test_rotary(dtype, head_dim, rotary_half):
    num_tokens, num_heads, num_kv_heads = 7, 4, 2
    g = torch.Generator().manual_seed(3)
    # Q and K as the model has them: strided views of one fused QKV projection.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    positions = torch.tensor([0, 1, 2, 17, 30, 31, 5])
    angles = torch.arange(32)[:, None] * torch.rand(rotary_half, generator=g)[None, :]
    cos, sin = angles.cos(), angles.sin()
    q_out, k_out = triton_rotary.apply_rotary_embedding(positions, q, k, cos, sin)
    q_ref, k_ref = rotary.apply_rotary_embedding(positions, q, k, cos, sin)
    assert_close(q_out, q_ref)
    assert_close(k_out, k_ref)


# -- paged attention ------------------------------------------------------------------------------
DECODE_CASES = [
    # block_size, num_heads, num_kv_heads, head_dim, seq_lens, sliding_window, partition_size
    pytest.param(16, 4, 4, 32, [1, 15, 16, 17, 40], None, None, id="mha-bs16-one-partition"),
    pytest.param(8, 4, 2, 32, [9, 1, 33, 70], None, 16, id="gqa2-bs8-splitk"),
    pytest.param(32, 8, 2, 64, [100, 31, 32, 64], None, 32, id="gqa4-bs32-splitk"),
    pytest.param(64, 4, 1, 16, [3, 64, 65, 130], None, 64, id="gqa4-bs64-splitk"),
    pytest.param(16, 4, 2, 32, [5, 20, 21, 47], 20, 16, id="gqa2-sliding-window-splitk"),
    pytest.param(8, 6, 2, 24, [7, 8, 25], None, None, id="gqa3-odd-head-dim"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "block_size,num_heads,num_kv_heads,head_dim,seq_lens,sliding_window,partition_size", DECODE_CASES
)
def test_paged_decode_attention(
    dtype, block_size, num_heads, num_kv_heads, head_dim, seq_lens, sliding_window, partition_size
):
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k_cache, v_cache = make_cache(num_kv_heads, num_blocks, block_size, head_dim, dtype)
    tables = make_block_tables(seq_lens, block_size, num_blocks, dtype=torch.int32)
    lens = torch.tensor(seq_lens)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(4)).to(
        dtype
    )
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    triton_paged_attention.paged_decode_attention(
        query, k_cache, v_cache, tables, lens, scale, sliding_window, partition_size=partition_size, out=out
    )
    expected = paged_attention.paged_decode_attention(
        query, k_cache, v_cache, tables.long(), lens, scale, sliding_window
    )
    assert_close(out, expected)


def test_decode_grid_sized_for_a_longer_context():
    """A grid sized for max_model_len (CUDA graphs): partitions past each context stay unused."""
    k_cache, v_cache = make_cache(2, 12, 8, 16, torch.float32)
    lens = torch.tensor([3, 17])
    tables = make_block_tables([3, 17], 8, 12)
    query = torch.randn(2, 4, 16)
    out = triton_paged_attention.paged_decode_attention(
        query, k_cache, v_cache, tables, lens, 0.25, max_seq_len=90, partition_size=16
    )
    assert_close(out, paged_attention.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.25))


def test_choose_partition_size():
    choose = triton_paged_attention.choose_partition_size
    assert choose(1) == choose(4096) == 512
    assert choose(64 * 512) == 512
    assert choose(64 * 512 + 1) == 1024
    assert choose(131072) == 2048


PREFILL_CASES = [
    # block_size, num_heads, num_kv_heads, head_dim, (cached prefix, query tokens) per sequence, window
    pytest.param(16, 4, 2, 32, [(0, 20), (5, 3), (16, 1), (31, 17)], None, id="gqa2-bs16-cached-prefixes"),
    pytest.param(8, 4, 4, 16, [(0, 9), (7, 2), (0, 1)], None, id="mha-bs8"),
    pytest.param(32, 8, 2, 64, [(40, 4), (70, 4), (99, 5)], None, id="gqa4-bs32-spec-verify"),
    pytest.param(64, 4, 1, 16, [(10, 70), (0, 33)], None, id="gqa4-bs64-several-query-tiles"),
    pytest.param(8, 4, 2, 32, [(0, 30), (12, 6), (25, 1)], 10, id="gqa2-sliding-window"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,chunks,sliding_window", PREFILL_CASES)
def test_paged_prefill_attention(
    dtype, block_size, num_heads, num_kv_heads, head_dim, chunks, sliding_window
):
    seq_lens = [c + q for c, q in chunks]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    k_cache, v_cache = make_cache(num_kv_heads, num_blocks, block_size, head_dim, dtype, seed=5)
    tables = make_block_tables(seq_lens, block_size, num_blocks, seed=5)
    qsl = torch.tensor([0] + [q for _, q in chunks]).cumsum(0)
    lens = torch.tensor(seq_lens)
    query = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=torch.Generator().manual_seed(6)).to(
        dtype
    )
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    triton_paged_attention.paged_prefill_attention(
        query, k_cache, v_cache, tables, qsl, lens, scale, sliding_window, out=out
    )
    expected = paged_attention.paged_prefill_attention(
        query, k_cache, v_cache, tables, qsl, lens, scale, sliding_window
    )
    assert_close(out, expected)


# -- the backend ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sliding_window", [None, 12])
def test_triton_backend_matches_torch_backend(sliding_window):
    """A mixed step (decodes sorted by length, then a prefill chunk over a cached prefix and a
    fresh prompt): same cache contents and same attention output through both backends."""
    block_size, num_heads, num_kv_heads, head_dim, num_blocks = 8, 4, 2, 16, 24
    # (context before this step, tokens this step); decodes first, ascending, as the runner orders.
    chunks = [(3, 1), (9, 1), (30, 1), (12, 5), (0, 11)]
    seq_lens = [c + n for c, n in chunks]
    tables = make_block_tables(seq_lens, block_size, num_blocks, seed=7)
    slots = [
        int(tables[i, p // block_size]) * block_size + p % block_size
        for i, (c, n) in enumerate(chunks)
        for p in range(c, c + n)
    ]
    num_tokens = len(slots)
    common = CommonAttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0] + [n for _, n in chunks]).cumsum(0),
        seq_lens=torch.tensor(seq_lens),
        block_tables=tables,
        num_decodes=3,
        block_size=block_size,
    )
    g = torch.Generator().manual_seed(8)
    q, k, v = (
        torch.randn(num_tokens, h, head_dim, generator=g) for h in (num_heads, num_kv_heads, num_kv_heads)
    )
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        k_cache, v_cache = make_cache(num_kv_heads, num_blocks, block_size, head_dim, torch.float32, seed=9)
        outs.append(
            backend.forward(
                q, k, v, k_cache, v_cache, backend.prepare(common), head_dim**-0.5, sliding_window
            )
        )
        caches.append((k_cache, v_cache))
    assert_close(outs[1], outs[0])
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])


def test_backend_selection_on_cpu():
    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu).name == "torch"
    assert get_attention_backend("torch", cpu).name == "torch"
    assert get_attention_backend("triton", cpu).name == "triton"  # the interpreter is on here


def test_kernels_compile_for_a_gpu():
    """The interpreter accepts code the real compiler rejects: lower each kernel to a cubin for
    sm_90 (no GPU needed) in a process without TRITON_INTERPRET."""
    import triton

    # The toolchain is triton's own (the wheel bundles ptxas): without it there is nothing to
    # compile with; with it, anything but the report (a crash, an import error) is a failure.
    ptxas = os.environ.get("TRITON_PTXAS_PATH") or str(
        pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    )
    if not os.access(ptxas, os.X_OK):
        pytest.skip(f"no CUDA compile toolchain here: {ptxas} is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "kvscale.kernels.aot_check", "--arch", "90", "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"aot_check gave no report (rc {result.returncode}): {result.stderr[-2000:]}")
    failed = {name: r["error"] for name, r in report["kernels"].items() if not r["ok"]}
    assert not failed, failed
