"""Prefix affinity without a tokenizer: chained hashes of a prompt's leading blocks of characters,
and an approximate per-endpoint LRU of the hashes each endpoint was sent.

The router cannot tokenize (no tokenizer, no torch), so a block is `block_chars` characters of the
prompt text, or of the chat messages serialized canonically (`chat_prefix_text`). The hashes are
chained, h_i = xxh3_64(h_{i-1} || block_i), rooted at the model's name: equal h_i means equal
model and equal first i blocks, so a match length is the count of leading hashes an endpoint has
(the first miss ends it). The index is approximate: it records what the router sent, not what the
worker still holds. It is kept honest three ways: each endpoint's LRU holds no more blocks than
the worker's KV pool has (`set_capacity`, from its scraped `kvscale_kv_cache_blocks`), an endpoint
whose prefix-cache counters went backwards (a restarted worker, an empty cache) is cleared, and an
endpoint that leaves the set is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import xxhash

DEFAULT_BLOCK_CHARS = 64  # ~16 tokens of code or English: about one KV block of the worker
DEFAULT_MAX_BLOCKS = 256  # hash at most this many leading blocks (16k characters)
DEFAULT_CAPACITY = 8192  # blocks per endpoint until its KV pool size is known


def chat_prefix_text(messages: Sequence[object]) -> str:
    """The messages in one canonical string: role, then content, each ended by a NUL, message after
    message. A conversation's next turn only appends messages, so its text extends the previous
    turn's, as the chat template's rendering does; JSON of the whole body would not (its key order,
    spacing and sampling fields vary between clients and turns). Content parts are joined in order."""
    out: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append(f"{m.get('role', '')}\0{content if isinstance(content, str) else ''}\0")
    return "".join(out)


def prompt_prefix_text(prompt: object) -> str:
    """A completion's prompt as text: a string as is; token ids as their decimal numbers (they hash
    the same whenever the ids are the same); of a batch, its first prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt if isinstance(t, int)) + ","
    return ""


def block_hashes(
    model: str, text: str, block_chars: int = DEFAULT_BLOCK_CHARS, max_blocks: int = DEFAULT_MAX_BLOCKS
) -> list[int]:
    """The chained hashes of the text's full leading blocks (a partial last block is not hashed:
    the worker caches only full KV blocks too)."""
    parent = xxhash.xxh3_64_intdigest(model.encode("utf-8", "surrogatepass"))
    hashes = []
    for i in range(min(len(text) // block_chars, max_blocks)):
        block = text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + block)
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Per endpoint, an LRU of the block hashes the router sent there."""

    def __init__(self, default_capacity: int = DEFAULT_CAPACITY) -> None:
        self.default_capacity = default_capacity
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def match_length(self, endpoint: str, hashes: Sequence[int]) -> int:
        """How many leading hashes the endpoint holds (chained: the first miss ends the match)."""
        held = self._blocks.get(endpoint)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def record(self, endpoint: str, hashes: Iterable[int]) -> None:
        """The request with these hashes was sent to the endpoint: they are its most recent."""
        held = self._blocks.setdefault(endpoint, OrderedDict())
        # Last block first, so that a prompt's first block is its most recent: eviction then eats a
        # prefix from its tail, never leaves a tail whose head is gone (the worker frees a finished
        # request's blocks in the same order).
        for h in reversed(list(hashes)):
            held[h] = None
            held.move_to_end(h)
        self._evict(endpoint)

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        if blocks > 0:
            self._capacity[endpoint] = blocks
            self._evict(endpoint)

    def clear(self, endpoint: str) -> None:
        """The endpoint's cache is empty (its worker restarted): nothing matches there any more."""
        self._blocks.pop(endpoint, None)

    def remove(self, endpoint: str) -> None:
        self._blocks.pop(endpoint, None)
        self._capacity.pop(endpoint, None)

    def size(self, endpoint: str) -> int:
        return len(self._blocks.get(endpoint, ()))

    def _evict(self, endpoint: str) -> None:
        held = self._blocks.get(endpoint)
        if held is None:
            return
        limit = self._capacity.get(endpoint, self.default_capacity)
        while len(held) > limit:
            held.popitem(last=False)
