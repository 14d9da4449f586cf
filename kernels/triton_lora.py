"""Multi-LoRA shrink and expand in Triton (Punica's BGMV): same signatures as lora.py.

One program per (token row, block of output columns). The row reads its adapter slot; a row with
no adapter (-1) loads nothing (every load is masked off) and writes zeros (shrink) or leaves its
output alone (expand). Each program gathers its own adapter's matrix block, so a batch that mixes
adapters costs what each row's own adapter costs, with no grouping on the host. Arithmetic is
float32; the shrunk activations are rounded to the activation dtype, as the reference's matmul
rounds them, and each expand adds its product into the output with one rounding.

BGMV re-reads an adapter's matrices for every row that uses it, which suits decode (one row per
sequence). Long prefill chunks of one adapter would be better served by SGMV (one tile of rows per
segment); that is the next step for prefill-heavy loads (docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscale.kernels.lora import Segments


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    y_ptr,
    K,
    N,
    stride_xt,
    stride_as,
    stride_an,
    stride_yt,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t)
    k_limit = tl.where(slot >= 0, K, 0)  # a row without an adapter loads nothing
    slot = tl.maximum(slot, 0).to(tl.int64)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_limit
        x = tl.load(x_ptr + t * stride_xt + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_as + offs_n[:, None] * stride_an + offs_k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(y_ptr + t * stride_yt + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _expand_kernel(
    y_ptr,
    b_ptr,
    slots_ptr,
    out_ptr,
    rank,
    y_col,
    out_offset,
    size,
    stride_yt,
    stride_bs,
    stride_bo,
    stride_ot,
    BLOCK_O: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_r = tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t)
    limit = tl.where(slot >= 0, size, 0)  # a row without an adapter is left alone
    slot = tl.maximum(slot, 0).to(tl.int64)
    mask_o = offs_o < limit
    mask_r = offs_r < rank
    y = tl.load(y_ptr + t * stride_yt + y_col + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    b = tl.load(
        b_ptr + slot * stride_bs + (out_offset + offs_o)[:, None] * stride_bo + offs_r[None, :],
        mask=mask_o[:, None] & mask_r[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * y[None, :], axis=1)
    out = out_ptr + t * stride_ot + out_offset + offs_o
    current = tl.load(out, mask=mask_o, other=0.0).to(tl.float32)
    tl.store(out, (current + delta).to(out_ptr.dtype.element_ty), mask=mask_o)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, segments: Segments | None = None
) -> torch.Tensor:
    """[T, n_slices * R]; `segments` is accepted for the reference's signature and not needed."""
    x = _rows(x)
    assert lora_a.stride(-1) == 1
    num_tokens, n = x.shape[0], lora_a.shape[1]
    y = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    if num_tokens:
        block_n = min(64, triton.next_power_of_2(n))
        block_k = min(128, triton.next_power_of_2(x.shape[1]))
        _shrink_kernel[(num_tokens, triton.cdiv(n, block_n))](
            x, lora_a, token_slots, y, x.shape[1], n,
            x.stride(0), lora_a.stride(0), lora_a.stride(1), y.stride(0),
            BLOCK_N=block_n, BLOCK_K=block_k,
        )  # fmt: skip
    return y


def lora_expand(
    out: torch.Tensor,
    y: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slices: list[tuple[int, int]],
    segments: Segments | None = None,
) -> torch.Tensor:
    assert out.stride(-1) == 1 and lora_b.stride(-1) == 1 and y.stride(-1) == 1
    rank = lora_b.shape[-1]
    num_tokens = out.shape[0]
    if num_tokens:
        block_r = triton.next_power_of_2(rank)
        for i, (offset, size) in enumerate(slices):
            block_o = min(64, triton.next_power_of_2(size))
            _expand_kernel[(num_tokens, triton.cdiv(size, block_o))](
                y, lora_b, token_slots, out, rank, i * rank, offset, size,
                y.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
                BLOCK_O=block_o, BLOCK_R=block_r,
            )  # fmt: skip
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
    """out += x @ A[slot].T @ B[slot].T per row, in place: one shrink, one expand per slice."""
    return lora_expand(out, lora_shrink(x, lora_a, token_slots), lora_b, token_slots, slices)
