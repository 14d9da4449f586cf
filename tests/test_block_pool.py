"""Block pool and KV cache manager: reference counts, the free list, LRU eviction, prefix hits."""

from __future__ import annotations

import pytest

from kvscale.worker.core.block_pool import BlockPool
from kvscale.worker.core.kv_cache_manager import KVCacheManager
from kvscale.worker.core.request import Request
from kvscale.worker.sample.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=8))


def test_allocate_free_and_usage_are_exact():
    pool = BlockPool(10)
    blocks = pool.allocate(4)
    assert pool.num_used_blocks == 4 and pool.usage() == 0.4
    pool.touch(blocks[:2])
    pool.free(blocks)
    assert pool.usage() == pytest.approx(0.2)
    pool.free(blocks[:2])
    assert pool.usage() == 0.0
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks[:1])
    with pytest.raises(ValueError):
        pool.allocate(11)
    pool.check_invariants()


def test_cached_blocks_are_evicted_only_when_free_list_is_empty_and_in_lru_order():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h1")
    pool.cache_block(b, b"h2")
    pool.free([b, a])  # b becomes evictable first, so it is the least recently freed
    assert pool.num_indexed_blocks == 2
    fresh = pool.allocate(2)  # the two plain free blocks, cache untouched
    assert {x.block_id for x in fresh}.isdisjoint({a.block_id, b.block_id})
    assert pool.get_indexed_block(b"h1") is a
    (evicted,) = pool.allocate(1)
    assert evicted is b and pool.get_indexed_block(b"h2") is None
    assert pool.get_indexed_block(b"h1") is a
    pool.check_invariants()


def test_prefix_hits_share_blocks_and_leave_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(10)))
    assert kv.get_computed_blocks(first) == ([], 0)
    assert kv.allocate_slots(first, 10)
    # Same first 8 tokens: two full blocks hit, shared by reference.
    second = make_request("b", [*range(8), 42, 43])
    hits, num = kv.get_computed_blocks(second)
    assert num == 8 and [b.block_id for b in hits] == kv.get_block_ids("a")[:2]
    assert kv.allocate_slots(second, 2, hits)
    assert all(b.ref_cnt == 2 for b in hits)
    # An exact repeat of a block-aligned prompt still computes its last token.
    third = make_request("c", list(range(8)))
    _, num = kv.get_computed_blocks(third)
    assert num == 4
    kv.free(first)
    kv.free(second)
    assert kv.usage() == 0.0 and kv.block_pool.num_indexed_blocks == 2
    assert kv.prefix_cache_stats.hits == 0  # lookups count only when the scheduler admits
    kv.record_prefix_lookup(second, 8)
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (10, 8)
    kv.block_pool.check_invariants()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    req = make_request("a", list(range(20)))
    assert not kv.allocate_slots(req, 20)
    assert kv.usage() == 0.0 and kv.get_block_ids("a") == []
    assert kv.allocate_slots(req, 12)
    assert kv.usage() == 1.0
