"""The prefix cache's block hashes: SHA-256, chained from a root (the cache salt, the LoRA adapter)
over each block's token ids. The worker's block pool indexes blocks by them
(worker/core/block_pool.py says why SHA-256); the router's precise index (router/kv_index.py)
computes the same ones from a request's token ids, so that it matches the digests the workers'
KV events carry without any key of its own.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes  # a 32-byte SHA-256 digest


def root_hash(cache_salt: str | None, adapter_digest: str | None = None) -> BlockHash:
    """The parent hash of a request's first block. A salt gives a chain of its own: requests with
    different salts (or one with and one without) share no block, even for the same prompt. So does
    a LoRA adapter (the digest of its weights): its KV never serves the base model or another one."""
    if cache_salt is None:
        root = hashlib.sha256(b"kvscale-prefix-root").digest()
    else:
        root = hashlib.sha256(b"kvscale-prefix-salt\0" + cache_salt.encode("utf-8", "surrogatepass")).digest()
    if adapter_digest is None:
        return root
    return hashlib.sha256(b"kvscale-prefix-lora\0" + adapter_digest.encode() + b"\0" + root).digest()


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """SHA-256 of the parent's digest (fixed 32 bytes) and the block's token ids as int64s: equal
    only if the whole prefix up to this block, salt included, is equal."""
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids))
    return h.digest()
