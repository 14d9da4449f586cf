"""Write new tokens' keys and values into their paged-cache slots.

Cache layout (one layer, K or V): `[num_kv_heads, num_blocks, block_size, head_dim]`, head-major,
so that gathering a sequence's blocks for one KV head yields its keys contiguous in token order:
one copy feeds the attention matmuls directly (about 2.5x faster decode attention on CPU than
the token-major layout, which needs a second, transposing copy).
"""

import torch


def write_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset
) -> None:
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))
