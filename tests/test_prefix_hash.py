"""Prefix-cache hashes: SHA-256 chained over the whole prefix, so a crafted collision of the old
64-bit tuple hash serves nobody another prefix's KV; `cache_salt` keeps tenants' KV apart."""

from __future__ import annotations

import sys
import uuid

import numpy as np
import openai
import pytest

from kvscale.common.block_hash import hash_block_tokens, root_hash
from kvscale.worker.core.kv_cache_manager import KVCacheManager
from kvscale.worker.core.request import Request
from kvscale.worker.sample.sampling_params import SamplingParams

BLOCK = 16

# CPython's tuple hash (xxHash-style, Objects/tupleobject.c), 64-bit.
_P1, _P2, _P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
_U64 = np.uint64


def _lane(acc: np.ndarray, lane: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        acc = acc + lane * _U64(_P2)
        acc = (acc << _U64(31)) | (acc >> _U64(33))
        return acc * _U64(_P1)


def _mix(i: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = i * _U64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def craft_tuple_hash_collision(vocab: int = 2**20, log_samples: int = 22) -> tuple[list[int], list[int]]:
    """Two different blocks of token ids (< vocab) with equal `hash((None, tuple(block)))`, the
    old first-block hash. The last lane is added as `acc + t * P2` before a bijective mix, so two
    15-token prefixes whose states differ by d * P2 with 0 <= d < vocab collide once one ends in d
    and the other in 0. Multiplying the states by P2^-1 turns that into "differ by less than vocab":
    sort 2**22 pseudo-random prefixes and look at neighbours (a birthday search over the 2**64 /
    vocab buckets; about a second of numpy)."""
    n = 2**log_samples
    fixed = [7 * k + 1 for k in range(BLOCK - 4)]
    acc = np.full(n, _P5, dtype=np.uint64)
    for t in fixed:
        acc = _lane(acc, _U64(t))

    def free_lanes(i: np.ndarray) -> list[np.ndarray]:
        h = _mix(i)
        return [(h >> _U64(s)) & _U64(vocab - 1) for s in (0, 20, 40)]

    for lane in free_lanes(np.arange(n, dtype=np.uint64)):
        acc = _lane(acc, lane)
    with np.errstate(over="ignore"):
        u = acc * _U64(pow(_P2, -1, 2**64))
    order = np.argsort(u)
    gaps = np.diff(u[order])
    close = np.flatnonzero(gaps < _U64(vocab))
    assert len(close), "no collision among these samples"
    k = int(close[0])
    lo, hi, d = int(order[k]), int(order[k + 1]), int(gaps[k])

    def block(i: int, last: int) -> list[int]:
        return [*fixed, *(int(x[0]) for x in free_lanes(np.array([i], dtype=np.uint64))), last]

    return block(lo, d), block(hi, 0)


cpython64 = pytest.mark.skipif(
    sys.implementation.name != "cpython" or sys.hash_info.width != 64, reason="CPython's 64-bit tuple hash"
)


@pytest.fixture(scope="module")
def collision() -> tuple[list[int], list[int]]:
    a, b = craft_tuple_hash_collision()
    assert a != b and hash((None, tuple(a))) == hash((None, tuple(b)))
    return a, b


def _request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, cache_salt=salt))


def _run(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """Admit the request as the scheduler does (prefix lookup, then slots for the rest); returns the
    block ids it got from the prefix cache and how many tokens they cover."""
    hits, num = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num, hits)
    request.num_computed_tokens = request.num_tokens
    return [b.block_id for b in hits], num


@cpython64
def test_a_collision_of_the_old_hash_is_not_one_of_the_new(collision):
    a, b = collision
    root = root_hash(None)
    assert hash_block_tokens(root, a) != hash_block_tokens(root, b)
    # And the collision propagates in the old chain (the next block's hash is equal too).
    tail = tuple(range(BLOCK))
    assert hash((hash((None, tuple(a))), tail)) == hash((hash((None, tuple(b))), tail))


@cpython64
def test_a_prefix_colliding_in_the_old_scheme_gets_no_hit_from_the_other(collision):
    """W caches [A, w]; X caches [B, T] where hash(B) == hash(A) in the old scheme, so X's block T
    was indexed under the chain that A + T would have; V = [A, T, ...] must hit A (W's, correct)
    and must not get X's T block, whose KV was computed after B."""
    a, b = collision
    t = list(range(1000, 1000 + BLOCK))
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    w = _request("w", [*a, *range(2000, 2000 + BLOCK), 7])
    x = _request("x", [*b, *t, 7])
    v = _request("v", [*a, *t, 7])
    assert _run(kv, w) == ([], 0)
    x_hits, _ = _run(kv, x)
    assert x_hits == []  # B is not A
    x_t_block = kv.get_block_ids("x")[1]
    v_hits, num = _run(kv, v)
    assert x_t_block not in v_hits
    assert v_hits == kv.get_block_ids("w")[:1] and num == BLOCK
    kv.block_pool.check_invariants()


def test_hash_covers_the_whole_prefix_and_the_salt():
    root = root_hash(None)
    block0, block0b, block1 = [1] * BLOCK, [2] * BLOCK, [3] * BLOCK
    h1 = hash_block_tokens(hash_block_tokens(root, block0), block1)
    assert h1 != hash_block_tokens(hash_block_tokens(root, block0b), block1)
    assert len(h1) == 32  # SHA-256
    assert hash_block_tokens(root, block0) == hash_block_tokens(root_hash(None), list(block0))
    roots = {root, root_hash("a"), root_hash("b"), root_hash("kvscale-prefix-root")}
    assert len(roots) == 4
    # Token ids are encoded at a fixed width: [1, 256] and [256, 1] or [65536] do not alias.
    assert len({hash_block_tokens(root, t) for t in ([1, 256], [256, 1], [65536], [1, 0, 1])}) == 4


def test_cache_salt_separates_the_prefix_cache():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK)
    prompt = list(range(3 * BLOCK + 1))
    assert _run(kv, _request("a1", prompt, "tenant-a")) == ([], 0)
    assert _run(kv, _request("b1", prompt, "tenant-b"))[1] == 0  # another salt: no hit
    assert _run(kv, _request("n1", prompt))[1] == 0  # no salt: no hit either
    assert _run(kv, _request("a2", prompt, "tenant-a"))[1] == 3 * BLOCK  # the same salt: hit
    assert _run(kv, _request("n2", prompt))[1] == 3 * BLOCK  # the unsalted cache works as before
    kv.block_pool.check_invariants()


@pytest.mark.parametrize("salt", ["", 5])
def test_cache_salt_must_be_a_non_empty_string(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt=salt)


# -- through the HTTP API ------------------------------------------------------------------------


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_cache_salt_over_http(client):
    model = client.models.list().data[0].id
    # A prompt no other test sends (the session's server keeps its cache), several blocks long.
    prompt = f"# {uuid.uuid4().hex}\n" + "def f(x):\n    return x * 2\n" * 6

    def complete(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else None
        r = client.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body=extra)
        return _cached(r.usage)

    assert complete("alice") == 0
    assert complete("bob") == 0
    assert complete(None) == 0
    assert complete("alice") > 0
    assert complete(None) > 0

    messages = [{"role": "user", "content": prompt}]

    def chat(salt: str) -> int:
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=1, extra_body={"cache_salt": salt}
        )
        return _cached(r.usage)

    assert chat("carol") == 0
    assert chat("dave") == 0
    assert chat("carol") > 0

    for bad in ("", 7):
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            client.completions.create(
                model=model, prompt=prompt, max_tokens=1, extra_body={"cache_salt": bad}
            )
