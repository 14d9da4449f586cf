"""No KV leak under speculation: random request mixes with many rejections, aborts and forced
preemption, checked after every step and at the end (hypothesis).

A random draft model (same tokenizer, untrained) disagrees with the target almost always, so
most proposals are rejected and their reserved blocks must go back every step.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_fixtures import TARGET

from kvscale.common.block_hash import hash_block_tokens, root_hash
from kvscale.worker import LLM, SamplingParams
from kvscale.worker.core.kv_cache_manager import cdiv

pytestmark = pytest.mark.skipif(not TARGET.is_dir(), reason="model pair missing")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from kvscale.worker.testing.tiny_model import build_tiny_model

    draft = build_tiny_model(tmp_path_factory.mktemp("bad-draft"), tokenizer_from=TARGET, seed=5)
    common = dict(num_kv_blocks=24, block_size=8, max_num_seqs=6, max_num_batched_tokens=48,
                  num_speculative_tokens=5, speculative_adaptive=False)  # fmt: skip
    return {
        "draft": LLM(str(TARGET), draft_model=str(draft), **common).engine,
        "ngram": LLM(str(TARGET), speculative_method="ngram", ngram_prompt_lookup_min=1, **common).engine,
    }


def check_invariants(engine) -> None:
    kv, pool = engine.kv_cache_manager, engine.kv_cache_manager.block_pool
    held = {b.block_id for blocks in kv.req_to_blocks.values() for b in blocks}
    assert pool.num_used_blocks == len(held)  # every used block belongs to a live request
    for request in engine.scheduler.running:
        blocks = kv.req_to_blocks[request.request_id]
        # No reservation for rejected proposals survives the step.
        assert len(blocks) <= cdiv(request.num_tokens, kv.block_size)
        # The prefix index only ever holds blocks of verified tokens: each hashed block's hash is
        # the chain over the request's own known tokens.
        bs, parent = kv.block_size, root_hash(request.cache_salt)
        for i in range(kv.num_hashed_blocks[request.request_id]):
            parent = hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs])
            if blocks[i].block_hash is not None:
                assert blocks[i].block_hash == parent
    for request in engine.scheduler.waiting:
        assert request.request_id not in kv.req_to_blocks


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 24), st.sampled_from([0.0, 1.0])),
        st.tuples(st.just("abort"), st.integers(0, 20)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=3,
    max_size=25,
)


@pytest.mark.parametrize("method", ["draft", "ngram"])
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(script=ops, seed=st.integers(0, 1000))
def test_no_kv_leak_with_rejections_and_aborts(engines, method, script, seed):
    engine = engines[method]
    ids: list[str] = []
    base = [(seed * 7 + i) % 50 + 4 for i in range(40)]
    for op in script:
        if op[0] == "add":
            _, prompt_len, max_tokens, temperature = op
            prompt = (base[:prompt_len] * 2)[:prompt_len]  # repeats, so n-gram lookup proposes
            params = SamplingParams(
                temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=True
            )
            ids.append(engine.add_request([0, *prompt], params))
        elif op[0] == "abort" and ids:
            engine.abort_request(ids[op[1] % len(ids)])
        else:
            for _ in range(op[1]):
                engine.step()
                check_invariants(engine)
    engine.abort_request(ids[::3])
    while engine.has_unfinished_requests():
        engine.step()
        check_invariants(engine)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    assert engine.kv_cache_manager.req_to_blocks == {}
    assert engine.num_unfinished_requests == 0
