"""KV pool sizing: the pure arithmetic of model/kv_cache.py, and one engine built from a byte budget."""

from __future__ import annotations

import pytest
import torch

from kvscale.worker import LLM
from kvscale.worker.model.kv_cache import (
    CPU_DEFAULT_KV_BYTES,
    GiB,
    bytes_per_block,
    free_memory_bytes,
    num_blocks_for,
)

MiB = 1 << 20
BLOCK = 64 * 1024  # bytes of one block in the tests below


def blocks(**overrides) -> int:
    kwargs = dict(
        block_bytes=BLOCK,
        device_type="cpu",
        free_bytes=64 * GiB,
        activation_reserve=0,
        max_useful_blocks=10**9,
    )
    kwargs.update(overrides)
    return num_blocks_for(**kwargs)


@pytest.mark.parametrize(("dtype", "element"), [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
def test_bytes_per_block_counts_k_and_v_of_every_layer(dtype: torch.dtype, element: int) -> None:
    assert bytes_per_block(6, 16, 2, 64, dtype) == 2 * 6 * 16 * 2 * 64 * element
    assert bytes_per_block(1, 8, 1, 32, dtype) == 2 * 8 * 32 * element


def test_explicit_block_count_wins_over_everything() -> None:
    for device in ("cpu", "cuda"):
        got = blocks(
            device_type=device,
            num_kv_blocks=7,
            kv_cache_memory_bytes=100 * BLOCK,
            kv_cache_memory_fraction=0.5,
            free_bytes=0,
            max_useful_blocks=3,
        )
        assert got == 7


def test_byte_budget_wins_over_fraction_and_ignores_free_memory_and_caps() -> None:
    for device in ("cpu", "cuda"):
        got = blocks(
            device_type=device,
            kv_cache_memory_bytes=100 * BLOCK + BLOCK - 1,
            kv_cache_memory_fraction=0.01,
            free_bytes=BLOCK,
            activation_reserve=10 * GiB,
            max_useful_blocks=3,
        )
        assert got == 100


def test_fraction_of_free_memory_minus_the_activation_reserve() -> None:
    free, reserve = 1000 * BLOCK, 100 * BLOCK
    for device in ("cpu", "cuda"):
        got = blocks(
            device_type=device,
            kv_cache_memory_fraction=0.5,
            free_bytes=free,
            activation_reserve=reserve,
            max_useful_blocks=3,
        )
        assert got == (int(0.5 * free) - reserve) // BLOCK == 400


def test_cuda_default_takes_ninety_percent_of_free_after_activations() -> None:
    free, reserve = 1000 * BLOCK, 50 * BLOCK
    got = blocks(device_type="cuda", free_bytes=free, activation_reserve=reserve, max_useful_blocks=3)
    assert got == (int(0.9 * free) - reserve) // BLOCK == 850


def test_cpu_default_is_four_gib_at_most_half_the_free_memory() -> None:
    assert blocks(free_bytes=64 * GiB) == CPU_DEFAULT_KV_BYTES // BLOCK
    assert blocks(free_bytes=2 * GiB + BLOCK) == (GiB + BLOCK // 2) // BLOCK
    assert blocks(free_bytes=10 * BLOCK) == 5


def test_cpu_default_never_exceeds_what_the_sequences_can_use() -> None:
    assert blocks(free_bytes=64 * GiB, max_useful_blocks=123) == 123
    assert blocks(free_bytes=10 * BLOCK, max_useful_blocks=123) == 5


@pytest.mark.parametrize(
    "overrides",
    [
        dict(kv_cache_memory_bytes=BLOCK - 1),
        dict(kv_cache_memory_fraction=0.5, free_bytes=10 * BLOCK, activation_reserve=5 * BLOCK),
        dict(device_type="cuda", free_bytes=GiB, activation_reserve=GiB),
        dict(free_bytes=BLOCK),  # CPU default: half of the free memory holds no block
    ],
)
def test_a_budget_without_room_for_one_block_raises(overrides: dict) -> None:
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        blocks(**overrides)


def test_free_memory_is_reported_on_cpu() -> None:
    assert free_memory_bytes(torch.device("cpu")) > 0


def test_engine_sized_by_a_byte_budget(random_model_factory) -> None:
    budget = 3 * MiB + 12345
    llm = LLM(random_model_factory("llama-gqa"), kv_cache_memory_bytes=budget, block_size=8)
    runner = llm.engine.runner
    spec = runner.spec
    block_bytes = bytes_per_block(spec.num_layers, 8, spec.num_kv_heads, spec.head_dim, runner.dtype)
    expected = budget // block_bytes
    assert expected > 1
    assert llm.engine.kv_cache_manager.num_blocks == runner.num_blocks == expected
    assert len(runner.kv_caches) == spec.num_layers
    for k, v in runner.kv_caches:
        assert k.shape == v.shape == (spec.num_kv_heads, expected, 8, spec.head_dim)
    assert sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer) <= budget
