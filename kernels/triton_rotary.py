"""Rotary position embedding ("neox" layout, partial rotary allowed) in Triton, same signature as
rotary.py. One program per token rotates every head of the query (or key) in one tile; inputs may
be strided views of a fused QKV projection, outputs are new contiguous tensors."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    out_ptr,
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cos,
    HALF: tl.constexpr,  # rotary_dim // 2
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
    first = offs_d < HALF
    rotated = offs_d < 2 * HALF
    # Each lane pairs with the lane HALF away; lanes past the rotary part pass through.
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    freq = tl.where(first, offs_d, offs_d - HALF)
    rot_mask = rotated & (offs_d < HEAD_DIM)
    cos = tl.load(cos_ptr + pos * stride_cos + freq, mask=rot_mask, other=1.0)
    sin = tl.load(sin_ptr + pos * stride_cos + freq, mask=rot_mask, other=0.0)
    sin = tl.where(first, -sin, sin)
    base = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh
    x = tl.load(base + offs_d[None, :], mask=mask, other=0.0)
    xp = tl.load(base + partner[None, :], mask=mask & rot_mask[None, :], other=0.0)
    # Like the reference, cos/sin are rounded to the activation dtype before use.
    cos = cos.to(x.dtype).to(tl.float32)
    sin = sin.to(x.dtype).to(tl.float32)
    y = x.to(tl.float32) * cos[None, :] + xp.to(tl.float32) * sin[None, :]
    y = tl.where(rotated[None, :], y, x.to(tl.float32))
    o = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rotate(positions, x, cos_cache, sin_cache) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    _rotary_kernel[(num_tokens,)](
        out, x, positions, cos_cache, sin_cache, num_heads,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_cache.stride(0),
        HALF=cos_cache.shape[-1], HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=min(8, max(1, block_h * block_d // 1024)),
    )  # fmt: skip
    return out


def apply_rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos_cache: torch.Tensor,  # [max_position, rotary_dim // 2] float32
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = positions.to(query.device)
    return _rotate(positions, query, cos_cache, sin_cache), _rotate(positions, key, cos_cache, sin_cache)
