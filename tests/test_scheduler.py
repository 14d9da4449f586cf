"""Property tests: any interleaving of add / step / abort keeps the block pool consistent, never
exceeds the step limits, and ends with every block free once all requests are done.

The model is replaced by a deterministic token function (the scheduler never looks at logits);
everything else is the real scheduler, KV cache manager and block pool.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscale.worker.core.kv_cache_manager import KVCacheManager
from kvscale.worker.core.request import Request, RequestStatus
from kvscale.worker.core.scheduler import Scheduler, SchedulerConfig
from kvscale.worker.sample.sampling_params import SamplingParams

EOS = 1


def fake_token(request: Request) -> int:
    # A tiny vocabulary so that outputs repeat and prefixes collide in the cache.
    return 2 + (len(request.all_token_ids) * 7 + len(request.request_id)) % 5


def check_consistency(sched: Scheduler, kv: KVCacheManager) -> None:
    pool = kv.block_pool
    pool.check_invariants()
    holders = Counter(b for blocks in kv.req_to_blocks.values() for b in (x.block_id for x in blocks))
    for block in pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), "reference count differs from the holders"
        if block.ref_cnt > 1:
            assert block.block_hash is not None, "only prefix-cached blocks may be shared"
    running_ids = {r.request_id for r in sched.running}
    assert set(kv.req_to_blocks) <= running_ids, "a request off the running list holds blocks"
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        held = len(kv.get_block_ids(r.request_id)) * kv.block_size
        assert held >= r.num_computed_tokens
    assert pool.num_used_blocks == len(holders)


def run_step(sched: Scheduler, kv: KVCacheManager, cfg: SchedulerConfig) -> None:
    out = sched.schedule()
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    assert len({r.request_id for r in out.requests}) == len(out.requests)
    for r, n, ids in zip(out.requests, out.num_scheduled_tokens, out.block_ids, strict=True):
        assert n >= 1
        assert len(ids) * kv.block_size >= r.num_computed_tokens + n, "scheduled tokens lack KV slots"
    sampled = [
        [fake_token(r)] if r.num_computed_tokens + n == r.num_tokens else []
        for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)
    ]
    sched.update_from_output(out, sampled)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30), st.integers(0, 3)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(6, 24),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
)
def test_any_interleaving_never_leaks(ops, num_blocks, block_size, budget, max_seqs, caching):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64)
    sched = Scheduler(cfg, kv)
    added: list[Request] = []
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, group = op
            prompt = [0] + [10 + group] * (prompt_len - 1)  # shared prefixes within a group
            req = Request(
                request_id=f"r{len(added)}",
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=False),
                eos_token_ids=frozenset({EOS}),
                max_tokens=max_tokens,
            )
            try:
                sched.add_request(req)
            except ValueError:
                continue  # larger than the whole pool: refused at admission
            added.append(req)
        elif op[0] == "step":
            run_step(sched, kv, cfg)
        elif added:
            sched.finish_requests([added[op[1] % len(added)].request_id], RequestStatus.FINISHED_ABORTED)
        check_consistency(sched, kv)

    # Drain: every admitted request must finish in a bounded number of steps (no deadlock).
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            break
        run_step(sched, kv, cfg)
        check_consistency(sched, kv)
    assert not sched.has_unfinished_requests(), "the scheduler stopped making progress"
    assert kv.usage() == 0.0 and kv.block_pool.num_used_blocks == 0
    assert not kv.req_to_blocks
    assert all(r.is_finished for r in added)
    for r in added:
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert 1 <= r.num_output_tokens <= r.max_tokens


def test_decodes_run_before_new_prefills_and_budget_chunks_prompts():
    kv = KVCacheManager(64, 4)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=128)
    sched = Scheduler(cfg, kv)
    first = Request("a", list(range(6)), SamplingParams(max_tokens=5), max_tokens=5)
    sched.add_request(first)
    run_step(sched, kv, cfg)  # prefill of a
    second = Request("b", list(range(30)), SamplingParams(max_tokens=5), max_tokens=5)
    sched.add_request(second)
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert out.num_scheduled_tokens == [1, 9]  # a's decode first, then a 9-token chunk of b


def test_the_prefill_backlog_is_the_prompt_tokens_not_computed_yet():
    """stats().num_prefill_tokens (the worker's kvscale_prefill_tokens_pending, which the routers'
    prefill guard reads): every queued prompt token at first, then what chunked prefill has left,
    0 once only decodes run."""
    kv = KVCacheManager(64, 4)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=128)
    sched = Scheduler(cfg, kv)
    sched.add_request(Request("a", list(range(6)), SamplingParams(max_tokens=5), max_tokens=5))
    sched.add_request(Request("b", list(range(100, 130)), SamplingParams(max_tokens=5), max_tokens=5))
    assert sched.stats().num_prefill_tokens == 36
    backlog = []
    while sched.stats().num_prefill_tokens:
        run_step(sched, kv, cfg)
        backlog.append(sched.stats().num_prefill_tokens)
    assert backlog == [26, 17, 8, 0]  # 10 tokens a step; from the second, a's decode takes one


def test_preemption_takes_the_most_recently_admitted():
    kv = KVCacheManager(4, 4, enable_caching=False)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    sched = Scheduler(cfg, kv)
    reqs = [Request(f"r{i}", list(range(7)), SamplingParams(max_tokens=8), max_tokens=8) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    run_step(sched, kv, cfg)  # both prefilled: 2 blocks each, pool full
    assert kv.usage() == 1.0
    run_step(sched, kv, cfg)  # r0 decodes at position 7 (its second block), r1 too
    run_step(sched, kv, cfg)  # r0 needs a third block: r1, admitted last, is preempted
    assert reqs[1].num_preemptions == 1 and reqs[0].num_preemptions == 0
    assert sched.waiting[0] is reqs[1]


def test_admission_rejects_what_can_never_run():
    kv = KVCacheManager(4, 4)
    sched = Scheduler(SchedulerConfig(max_model_len=32), kv)
    with pytest.raises(ValueError, match="maximum model length"):
        sched.add_request(Request("long", list(range(33)), SamplingParams(), max_tokens=1))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(Request("big", list(range(10)), SamplingParams(max_tokens=10), max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("empty", [], SamplingParams()))
    assert not sched.has_unfinished_requests()


def test_prefix_lookups_count_once_per_admission():
    kv = KVCacheManager(4, 4)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    sched = Scheduler(cfg, kv)
    sched.add_request(Request("a", list(range(12)), SamplingParams(max_tokens=4), max_tokens=4))
    sched.add_request(Request("b", list(range(100, 112)), SamplingParams(max_tokens=4), max_tokens=4))
    for _ in range(3):  # b finds no room while a runs: its failed lookups must not count
        run_step(sched, kv, cfg)
    assert kv.prefix_cache_stats.queries == 12
    while sched.has_unfinished_requests():
        run_step(sched, kv, cfg)
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (24, 0)
    # A repeat of b hits b's two full blocks (its last prompt token is always recomputed).
    sched.add_request(Request("c", list(range(100, 112)), SamplingParams(max_tokens=4), max_tokens=4))
    run_step(sched, kv, cfg)
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (36, 8)


def test_max_tokens_is_decided_once_by_the_scheduler():
    """A request's max_tokens without one: up to the model length, clipped to what the whole pool
    holds (the engine's make_request and the server's validation both ask Scheduler.max_tokens_for,
    where each used to compute it); one that was asked for stands, the model length still ends it."""
    kv = KVCacheManager(8, 4)  # 32 tokens in the pool
    sched = Scheduler(SchedulerConfig(max_model_len=64), kv)
    assert sched.max_tokens_for(10, None) == 22  # the pool, not the model length
    assert Scheduler(SchedulerConfig(max_model_len=20), kv).max_tokens_for(10, None) == 10
    assert sched.max_tokens_for(40, None) == 1  # never 0: the prompt alone is refused at admission
    assert sched.max_tokens_for(10, 500) == 500
    long = Request("long", list(range(10)), SamplingParams(max_tokens=500), max_tokens=500)
    assert Scheduler(SchedulerConfig(max_model_len=20), kv).final_length(long) == 20
