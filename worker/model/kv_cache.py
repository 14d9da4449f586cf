"""The KV cache tensors: how many blocks the pool gets (pure arithmetic plus one function that reads
free memory) and their allocation."""

from __future__ import annotations

from pathlib import Path

import torch

GiB = 1 << 30
CPU_DEFAULT_KV_BYTES = 4 * GiB  # the same default as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE)


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """K and V, every layer, one block."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def num_blocks_for(
    *,
    block_bytes: int,
    device_type: str,
    free_bytes: int,
    activation_reserve: int,
    max_useful_blocks: int,
    num_kv_blocks: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    kv_cache_memory_fraction: float | None = None,
) -> int:
    """An explicit count wins, then an explicit byte budget, then a fraction of free memory.

    Without any, CUDA takes 90% of what is free after weights and activations; the CPU takes
    4 GiB (at most half of what is available) but never more blocks than max_num_seqs sequences of
    max_model_len could use, since zeroing a huge host buffer only costs start-up time.
    """
    if num_kv_blocks is not None:
        return num_kv_blocks
    cap = None
    if kv_cache_memory_bytes is not None:
        budget = kv_cache_memory_bytes
    elif kv_cache_memory_fraction is not None:
        budget = int(kv_cache_memory_fraction * free_bytes) - activation_reserve
    elif device_type == "cuda":
        budget = int(0.9 * free_bytes) - activation_reserve
    else:
        budget = min(CPU_DEFAULT_KV_BYTES, free_bytes // 2)
        cap = max_useful_blocks
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache: budget {budget} bytes, one block needs {block_bytes}; "
            "give the engine more memory or a smaller max_num_batched_tokens"
        )
    return blocks if cap is None else min(blocks, cap)


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory now (after the weights are loaded); host MemAvailable on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 8 * GiB


def allocate_kv_cache(
    spec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K and V per layer, head-major `[num_kv_heads, num_blocks, block_size, head_dim]`. Zeroed, not
    empty: padded attention reads stale slots (masked out), and 0 * NaN would leak."""
    shape = (spec.num_kv_heads, num_blocks, block_size, spec.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(spec.num_layers)
    ]
