"""KV-cache write in Triton: scatter each new token's keys and values into its paged slot.

Same signature as kv_cache.write_kv_cache. One program per (token, KV head) moves one head_dim
vector of K and one of V. A negative slot means "no slot" (a padded row of a CUDA-graph batch)
and is skipped, so padded decode batches never touch the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kch,
    stride_kcb,
    stride_kct,
    stride_vch,
    stride_vcb,
    stride_vct,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_d < HEAD_DIM) & ((slot + offs_d * 0) >= 0)  # broadcast: the interpreter rejects scalar masks
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + offs_d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + offs_d, mask=mask)
    k_dst = k_cache_ptr + head * stride_kch + block * stride_kcb + offset * stride_kct
    v_dst = v_cache_ptr + head * stride_vch + block * stride_vcb + offset * stride_vct
    tl.store(k_dst + offs_d, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + offs_d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int: block_id * block_size + offset; < 0 skips the token
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv_cache needs a unit stride on head_dim")
    _write_kv_cache_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping.to(key.device),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[2],
        num_warps=1,
    )  # fmt: skip
