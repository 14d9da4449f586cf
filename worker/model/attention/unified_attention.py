"""Attention as one opaque op, `torch.ops.kvscale.unified_attention`: write this step's K/V into the
layer's paged cache and attend, with whatever plan the backend made for the step.

Opaque to torch.compile on purpose: the backend's plan (length buckets, per-sequence prefill
loops) is data-dependent Python that would specialise or break a graph; everything around it
(norms, projections, RoPE, the MLP) compiles into a few fused kernels. The op reads the backend, its
metadata and the caches from the forward context (model/forward_context.py).
"""

from __future__ import annotations

import torch

from kvscale.worker.model.forward_context import get_forward_context


@torch.library.custom_op("kvscale::unified_attention", mutates_args=())
def unified_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    ctx = get_forward_context()
    k_cache, v_cache = ctx.kv_caches[layer_idx]
    out = ctx.backend.forward(query, key, value, k_cache, v_cache, ctx.attn_metadata, scale, sliding_window)
    return out.contiguous()  # what the fake below promises the compiler (a copy only for strided views)


@unified_attention.register_fake
def _(query, key, value, layer_idx, scale, sliding_window):
    return query.new_empty(query.shape)
