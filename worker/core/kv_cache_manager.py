"""Per-request block tables on top of the block pool, with automatic prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

from kvscale.common.block_hash import BlockHash, hash_block_tokens, root_hash
from kvscale.worker.core.block_pool import BlockPool, KVCacheBlock
from kvscale.worker.core.kv_events import KVEventRecorder
from kvscale.worker.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# (request id, block, the hash it was indexed under)
NewlyCached = tuple[str, KVCacheBlock, BlockHash]


@dataclass
class PrefixCacheStats:
    """Counted in tokens, like vLLM's prefix_cache_queries / prefix_cache_hits."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: KVEventRecorder | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.events = events  # told of every block indexed and removed (KV events, kv_events.py)
        self.block_pool = BlockPool(num_blocks, enable_caching, events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are already in the prefix-cache index.
        self.num_hashed_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Blocks indexed since the last take_newly_cached(): those the step being scheduled will
        # write, to take back out of the index if that step fails (uncache).
        self._newly_cached: list[NewlyCached] = []

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes over every full block of its known tokens (the chain starts
        from the request's cache salt and LoRA adapter)."""
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else root_hash(request.cache_salt, request.adapter_digest)
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks matching the request's leading tokens.

        At least one token is always left to compute: the forward pass must produce the logits
        of the last token.
        """
        if not self.enable_caching or request.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position: nothing cached is skipped.
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_indexed_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count a lookup once, when the request is admitted for the first time (a lookup that
        finds no room, or the recompute after a preemption, would inflate the hit rate)."""
        if self.enable_caching and request.num_preemptions == 0:
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> bool:
        """Make room for num_new_tokens more tokens after the computed ones. Returns False, changing
        nothing, when the pool cannot provide the blocks (the caller then preempts or waits)."""
        new_computed_blocks = new_computed_blocks or []
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        # Cached hits with ref_cnt 0 count as free but stop being so once we take them.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            return False

        if rid not in self.req_to_blocks:
            self.req_to_blocks[rid], self.req_to_block_ids[rid] = [], []
            self.num_hashed_blocks[rid] = 0
        blocks, block_ids = self.req_to_blocks[rid], self.req_to_block_ids[rid]
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            block_ids.extend(b.block_id for b in new_computed_blocks)
            self.num_hashed_blocks[rid] += len(new_computed_blocks)
        if num_new_blocks > 0:
            new_blocks = self.block_pool.allocate(num_new_blocks)
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
        # Index the blocks that this step's forward will complete. Only known tokens are hashed,
        # so a block holding unverified (e.g. speculative) tokens is never indexed.
        self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return True

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid, bs = request.request_id, self.block_size
        start, end = self.num_hashed_blocks[rid], num_tokens // bs
        if end <= start:
            return
        self._update_block_hashes(request)
        blocks, hashes = self.req_to_blocks[rid], request.block_hashes
        stored: list[int] = []  # the blocks indexed now, for the KV events
        for i in range(start, end):
            if self.block_pool.cache_block(blocks[i], hashes[i]):
                self._newly_cached.append((rid, blocks[i], hashes[i]))
                stored.append(i)
        self.num_hashed_blocks[rid] = end
        if self.events is not None and stored:
            self._record_stored(request, stored)

    def _record_stored(self, request: Request, indices: list[int]) -> None:
        """One BlockStored per run of consecutive blocks (a block another request indexed first
        is not this request's to announce, and splits the run)."""
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        lora_id = request.lora_request.lora_int_id if request.lora_request is not None else None
        run_start = indices[0]
        for k, i in enumerate(indices):
            if k + 1 < len(indices) and indices[k + 1] == i + 1:
                continue
            parent = hashes[run_start - 1] if run_start > 0 else None
            self.events.stored(
                hashes[run_start : i + 1], parent, tokens[run_start * bs : (i + 1) * bs], lora_id
            )
            if k + 1 < len(indices):
                run_start = indices[k + 1]

    def take_newly_cached(self) -> list[NewlyCached]:
        """The blocks indexed since the last call (the scheduler hands them to its step)."""
        taken, self._newly_cached = self._newly_cached, []
        return taken

    def uncache(self, entries: list[NewlyCached]) -> None:
        """Take blocks whose KV a failed step should have written out of the prefix index."""
        self.block_pool.uncache_blocks([(block, block_hash) for _, block, block_hash in entries])

    def free_excess_blocks(self, request: Request) -> None:
        """Return blocks beyond what the request's tokens need: slots reserved for proposed tokens
        that were rejected. Such blocks hold no verified full block, so none is in the prefix index."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        keep = self.blocks_needed(request.num_tokens)
        if len(blocks) > keep:
            excess = blocks[keep:]
            del blocks[keep:]
            del self.req_to_block_ids[rid][keep:]
            self.block_pool.free(list(reversed(excess)))

    def free(self, request: Request) -> None:
        """Give back every block the request holds (tail first, see BlockPool.free)."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.req_to_block_ids.pop(rid, None)
        self.num_hashed_blocks.pop(rid, None)
        if blocks:
            self.block_pool.free(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_block_ids.get(request_id, [])
