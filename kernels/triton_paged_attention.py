"""Paged attention in Triton: split-K decode (flash-decoding) and causal prefill over paged context.

Same signatures as the plain-torch references in paged_attention.py, plus keyword-only knobs the
engine uses to avoid host syncs (`max_seq_len`, `max_query_len`) and to write into a slice of a
larger output (`out`). Cache layout per layer: `[num_kv_heads, num_blocks, block_size, head_dim]`.

Decode is memory-bound: every byte of every sequence's K/V is read once per step. One program
owns (sequence, KV head, partition of the context) and computes *all* query heads of the GQA group
against each KV tile, so a K/V byte is loaded once, not once per query head. Long contexts are
split into partitions (split-K) so that even a batch of one fills the GPU; a second small kernel
merges the partitions' (max, sum, unnormalised output) triples. Keys are addressed token by token
through the block table, so one tile (BLOCK_N tokens) may span several cache blocks, or part of
one: any block size works with any tile size.

Accumulation is float32 throughout; probabilities are cast to the cache dtype for the P @ V
product, as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DEFAULT_PARTITION_SIZE = 512  # tokens per split-K partition: 8 tiles of 64, ~256 KiB of bf16 K+V
MAX_PARTITIONS = 64  # beyond this, partitions grow instead: bounds the float32 scratch of split-K
DECODE_BLOCK_N = 64  # keys per inner tile
PREFILL_BLOCK_M = 64  # (query token, head) rows per prefill program
PREFILL_BLOCK_N = 64
_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    # The interpreter multiplies bfloat16 tiles as their raw uint16 bits: upcast there only.
    if DOT_PRECISION == "interpret":
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION: tl.constexpr):
    """One flash-attention update with a row max that may still be -inf (fully masked rows)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [B, H, D] (used when not USE_PARTITIONS)
    tmp_out_ptr,  # [B, H, P, D] float32: unnormalised partial outputs
    max_logits_ptr,  # [B, H, P] float32 (log2 domain)
    exp_sums_ptr,  # [B, H, P] float32
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    scale_log2,  # softmax scale * log2(e)
    sliding_window,  # 0: none
    num_heads,
    num_partitions,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kh,
    stride_kb,
    stride_kt,
    stride_vh,
    stride_vb,
    stride_vt,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    USE_PARTITIONS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_start = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
    lo = tl.maximum(part * PARTITION_SIZE, ctx_start)
    hi = tl.minimum((part + 1) * PARTITION_SIZE, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_base + (block * stride_kb + slot * stride_kt)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_base + (block * stride_vb + slot * stride_vt)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = _dot(q, tl.trans(k), DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION)

    if USE_PARTITIONS:
        # Partitions past the context (a grid sized for the longest sequence, or for a whole
        # CUDA graph) store nothing: the reduce kernel never reads them.
        row = (seq * num_heads + heads).to(tl.int64) * num_partitions + part
        written = g_mask & ((offs_g * 0 + lo) < hi)  # broadcast: the interpreter rejects scalar masks
        tl.store(max_logits_ptr + row, m_i, mask=written)
        tl.store(exp_sums_ptr + row, l_i, mask=written)
        tl.store(
            tmp_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=written[:, None] & d_mask[None, :],
        )
    else:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr,
    tmp_out_ptr,
    max_logits_ptr,
    exp_sums_ptr,
    seq_lens_ptr,
    sliding_window,
    num_heads,
    num_partitions,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,  # >= the number of partitions
    CHUNK_P: tl.constexpr,  # partitions merged per load of partial outputs
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_start = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
    first = ctx_start // PARTITION_SIZE
    last = tl.cdiv(seq_len, PARTITION_SIZE)
    row = (seq * num_heads + head).to(tl.int64) * num_partitions

    # Only partitions [first, last) ran over keys; the others hold stale values and are masked.
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = (offs_p >= first) & (offs_p < last)
    m = tl.load(max_logits_ptr + row + offs_p, mask=p_mask, other=float("-inf"))
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    sums = tl.load(exp_sums_ptr + row + offs_p, mask=p_mask, other=0.0)
    denom = tl.sum(tl.exp2(m - m_max) * sums, axis=0)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for p0 in range(first, last, CHUNK_P):
        offs_c = p0 + tl.arange(0, CHUNK_P)
        c_mask = offs_c < last
        w = tl.exp2(tl.load(max_logits_ptr + row + offs_c, mask=c_mask, other=float("-inf")) - m_max)
        part = tl.load(
            tmp_out_ptr + (row + offs_c)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=c_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(part * w[:, None], axis=0)
    acc = acc / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
        acc.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@triton.jit
def _paged_prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    sliding_window,  # 0: none
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kh,
    stride_kb,
    stride_kt,
    stride_vh,
    stride_vb,
    stride_vt,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows = (query token, head of the group) pairs
    BLOCK_Q: tl.constexpr,  # query tokens per program: BLOCK_M // GROUP
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    num_q = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_len = seq_len - num_q  # cached prefix: query token i sits at absolute position ctx_len + i
    q0 = tile * BLOCK_Q

    # All heads of one GQA group share each K/V tile: rows are (token, head) pairs, token-major.
    rows = tl.arange(0, BLOCK_M)
    tok = q0 + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < num_q)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr
        + (q_start + tok).to(tl.int64)[:, None] * stride_qt
        + heads[:, None] * stride_qh
        + offs_d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = ctx_len + tok

    lo = tl.where(sliding_window > 0, tl.maximum(ctx_len + q0 - sliding_window + 1, 0), 0)
    hi = tl.minimum(seq_len, ctx_len + q0 + BLOCK_Q)
    hi = tl.where(q0 < num_q, hi, lo)  # programs past this sequence's chunk do nothing
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_base + (block * stride_kb + slot * stride_kt)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_base + (block * stride_vb + slot * stride_vt)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = _dot(q, tl.trans(k), DOT_PRECISION) * scale_log2
        keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if sliding_window > 0:
            keep = keep & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(keep, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION)

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr
        + (q_start + tok).to(tl.int64)[:, None] * stride_ot
        + heads[:, None] * stride_oh
        + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )


def _dot_precision(dtype: torch.dtype) -> str:
    if triton.knobs.runtime.interpret:
        return "interpret"
    # float32 caches (tests, debugging) must not silently drop to TF32 on tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out) -> None:
    if any(t is not None and t.stride(-1) != 1 for t in (query, k_cache, v_cache, out)):
        raise ValueError("paged attention needs a unit stride on head_dim (query, caches, out)")
    if query.shape[1] % k_cache.shape[0] != 0:
        raise ValueError(f"{query.shape[1]} query heads do not group over {k_cache.shape[0]} KV heads")


def choose_partition_size(max_seq_len: int) -> int:
    """512 tokens per partition (enough work per program to stream at full bandwidth, enough
    programs for a batch of one at 4k context), growing in powers of two past MAX_PARTITIONS."""
    size = DEFAULT_PARTITION_SIZE
    while triton.cdiv(max_seq_len, size) > MAX_PARTITIONS:
        size *= 2
    return size


def paged_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64 on the device
    seq_lens: torch.Tensor,  # [B] int32/int64
    scale: float,
    sliding_window: int | None = None,
    *,
    max_seq_len: int | None = None,  # an upper bound of seq_lens; sizes the grid without a sync
    partition_size: int | None = None,  # tokens per split-K partition; None: choose_partition_size
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_layout(query, k_cache, v_cache, out)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    device = query.device
    block_tables = block_tables.to(device)
    seq_lens = seq_lens.to(device)
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    if partition_size is None:
        partition_size = choose_partition_size(max_seq_len)
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    block_n = min(DECODE_BLOCK_N, partition_size)
    num_partitions = max(1, triton.cdiv(max_seq_len, partition_size))
    use_partitions = num_partitions > 1
    if use_partitions:
        tmp_out = torch.empty(
            num_seqs, num_heads, num_partitions, head_dim, dtype=torch.float32, device=device
        )
        max_logits = torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32, device=device)
        exp_sums = torch.empty_like(max_logits)
    else:
        tmp_out = max_logits = exp_sums = out  # unused by the kernel
    block_d = max(16, triton.next_power_of_2(head_dim))
    window = sliding_window or 0
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out, tmp_out, max_logits, exp_sums, query, k_cache, v_cache, block_tables, seq_lens,
        scale * _LOG2E, window, num_heads, num_partitions,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, PARTITION_SIZE=partition_size,
        USE_PARTITIONS=use_partitions, DOT_PRECISION=_dot_precision(k_cache.dtype),
        num_warps=4,
    )  # fmt: skip
    if use_partitions:
        block_p = triton.next_power_of_2(num_partitions)
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out, tmp_out, max_logits, exp_sums, seq_lens, window, num_heads, num_partitions,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, PARTITION_SIZE=partition_size,
            BLOCK_P=block_p, CHUNK_P=min(16, block_p),
            num_warps=4,
        )  # fmt: skip
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    query_start_loc: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,  # sizes the grid without a sync when given
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_layout(query, k_cache, v_cache, out)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    device = query.device
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    block_m = max(PREFILL_BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (triton.cdiv(max_query_len, block_q), num_kv_heads, num_seqs)
    block_tables = block_tables.to(device)
    _paged_prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables, query_start_loc.to(device), seq_lens.to(device),
        scale * _LOG2E, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=PREFILL_BLOCK_N,
        DOT_PRECISION=_dot_precision(k_cache.dtype),
        num_warps=4,
    )  # fmt: skip
    return out
