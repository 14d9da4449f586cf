"""The KV block pool: free list, reference counts and the prefix-cache index.

Blocks are fixed-size pages of `block_size` token slots in every layer's K/V tensors. A block is in
exactly one of three states:

- used: ref_cnt > 0, held by one or more requests (shared prefixes have ref_cnt > 1);
- evictable: ref_cnt == 0 but it is in the prefix-cache index (it carries a block hash), so a
  later request with the same prefix can take it back (a prefix-cache hit); kept in LRU order and
  evicted only when no plain free block is left;
- free: ref_cnt == 0 and no hash.

Occupancy (what the autoscaler watches) is used / total, maintained as a counter: exact and O(1).

Block hashes are SHA-256, chained: block i's hash covers block i-1's hash and block i's token ids,
so it stands for the whole prefix up to and including the block (and the request's cache salt,
which seeds the chain). A hit on the hash alone is therefore a hit on the whole prefix: nothing
short of a SHA-256 collision can serve one prefix's KV to another (vLLM made the same move after
CVE-2025-25183, where Python's 64-bit `hash()` could be collided on purpose).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvscale.common.block_hash import BlockHash
from kvscale.worker.core.kv_events import KVEventRecorder


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is in the prefix-cache index: the hash of the prefix it ends.
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, events: KVEventRecorder | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Plain free blocks, handed out first. Order is irrelevant, so a deque is enough.
        self._free: deque[KVCacheBlock] = deque(self.blocks)
        # Indexed blocks with ref_cnt == 0, least recently freed first (the eviction order).
        self._evictable: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self._index: dict[BlockHash, KVCacheBlock] = {}  # the prefix-cache index
        self._num_used = 0
        self.events = events  # told of every hash leaving the index (KV events, kv_events.py)

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: plain free plus evictable ones."""
        return self.num_blocks - self._num_used

    @property
    def num_indexed_blocks(self) -> int:
        return len(self._index)

    def usage(self) -> float:
        """KV-cache occupancy in [0, 1]: blocks held by requests over all blocks."""
        return self._num_used / self.num_blocks

    def get_indexed_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding the prefix `block_hash` stands for, or None. No token comparison: the
        chained hash already covers the whole prefix, which comparing this block's own tokens and
        parent could not (a collision earlier in the chain would pass that check)."""
        return self._index.get(block_hash)

    # -- state changes -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks (ref_cnt 1 each): plain free ones first, then evict evictable ones LRU."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                _, block = self._evictable.popitem(last=False)
                self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        self._num_used += n
        return out

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take another reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._evictable[block.block_id]
                self._num_used += 1
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference on each block. Pass a request's blocks tail first: the tail of a
        sequence is the least likely to be shared, so it should be evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._num_used -= 1
                if block.block_hash is not None:
                    self._evictable[block.block_id] = block
                else:
                    self._free.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Index a full, computed block under its hash. Returns False when another block already
        holds that content (computed concurrently); that copy is then simply not indexed."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._index:
            return False
        block.block_hash = block_hash
        self._index[block_hash] = block
        return True

    def uncache_blocks(self, entries: Sequence[tuple[KVCacheBlock, BlockHash]]) -> None:
        """Take blocks out of the prefix-cache index whose KV was never written (their step failed):
        a later request must not hit them. An entry whose block has since left the index, or been
        indexed again for other content, is skipped. Held blocks go to the plain free list when
        freed; an evictable one goes there now."""
        for block, block_hash in entries:
            if block.block_hash != block_hash:
                continue
            self._uncache(block)
            if block.ref_cnt == 0:
                del self._evictable[block.block_id]
                self._free.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every indexed block that no request holds (e.g. after a weight reload)."""
        while self._evictable:
            _, block = self._evictable.popitem(last=False)
            self._uncache(block)
            self._free.append(block)

    def _uncache(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self._index[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
        block.block_hash = None

    def check_invariants(self) -> None:
        """Exhaustive consistency check, for tests."""
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert used == self._num_used, (used, self._num_used)
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        free_ids = {b.block_id for b in self._free}
        assert len(free_ids) == len(self._free), "a block is twice in the free list"
        evictable_ids = set(self._evictable)
        assert not free_ids & evictable_ids
        assert all(self.blocks[i].ref_cnt == 0 and self.blocks[i].block_hash is None for i in free_ids)
        assert all(
            self.blocks[i].ref_cnt == 0 and self.blocks[i].block_hash is not None for i in evictable_ids
        )
        assert len(free_ids) + len(evictable_ids) + used == self.num_blocks
        assert all(self._index[b.block_hash] is b for b in self.blocks if b.block_hash is not None)
