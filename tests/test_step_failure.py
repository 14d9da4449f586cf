"""A step that fails as a whole (issue 26): it leaves nothing behind in the prefix cache (the blocks
it indexed when it was scheduled never got their KV), and under tensor parallelism it is fatal to
the worker (the other ranks' collectives would pair up out of step)."""

from __future__ import annotations

import pytest

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.engine.llm_engine import (
    MAX_CONSECUTIVE_FAILED_STEPS,
    RequestFailedError,
    fatal_step_failure,
)
from kvscale.worker.executor import launcher
from kvscale.worker.model.model_runner import LaunchedStep

ENGINE = dict(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=512)
# 5 full blocks of 16 tokens and a tail: a hit on a poisoned prefix would cover most of the prompt.
PROMPT = list(range(100, 190))
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def reference(target_model) -> list[int]:
    """The greedy tokens of a fresh engine, which never ran the prompt before."""
    return LLM(target_model, **ENGINE).generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def fail_launches(monkeypatch, runner, times: int = 1) -> None:
    """The forward raises for the next `times` launches (after the scheduler indexed the blocks)."""
    launch, left = runner.launch, [times]

    def failing(out):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected forward fault")
        return launch(out)

    monkeypatch.setattr(runner, "launch", failing)


def hits_of(engine) -> int:
    return engine.kv_cache_manager.prefix_cache_stats.hits


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_forward_leaves_no_block_in_the_prefix_index(
    target_model, reference, monkeypatch, async_scheduling
):
    llm = LLM(target_model, async_scheduling=async_scheduling, **ENGINE)
    engine = llm.engine
    fail_launches(monkeypatch, engine.runner)
    with pytest.raises(RequestFailedError, match="injected forward fault"):
        llm.generate([PROMPT], GREEDY)
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_indexed_blocks == 0 and pool.num_used_blocks == 0
    pool.check_invariants()
    before = hits_of(engine)
    out = llm.generate([PROMPT], GREEDY)[0]
    assert hits_of(engine) == before and out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == reference
    # The prompt, now computed, is indexed again and served from the cache.
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == reference
    assert hits_of(engine) > before


def test_a_step_failing_with_the_next_one_in_flight_fails_who_read_its_kv(
    target_model, reference, monkeypatch
):
    """Async scheduling: step N (A's prefill) fails when its tokens are read, after step N+1 was
    launched with B, which hit A's blocks of step N. B read KV never written: it fails too, and the
    blocks N+1 indexed for B leave the index with A's."""
    llm = LLM(target_model, async_scheduling=True, **ENGINE)
    engine = llm.engine
    launch, launched = engine.runner.launch, []

    def first_get_fails(out) -> LaunchedStep:
        step = launch(out)
        launched.append(step)
        if len(launched) == 1:

            def get():
                raise RuntimeError("injected device fault")

            step.get = get
        return step

    monkeypatch.setattr(engine.runner, "launch", first_get_fails)
    engine.add_request(PROMPT, GREEDY, request_id="a")
    assert engine.step() == []  # N launched
    # B shares A's 5 full blocks and adds 2 of its own, which N+1 indexes.
    engine.add_request(PROMPT + list(range(200, 232)), GREEDY, request_id="b")
    assert engine.step() == []  # N+1 launched (B hits A's blocks), then N fails
    assert hits_of(engine) == 5 * 16, "B must have hit A's blocks, or the test shows nothing"
    assert set(engine.take_failed()) == {"a", "b"}
    while engine.has_unfinished_requests():
        engine.step()
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_indexed_blocks == 0 and pool.num_used_blocks == 0
    before = hits_of(engine)
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == reference
    assert hits_of(engine) == before


# -- tensor parallelism: a failed step is fatal ------------------------------------------------


def test_the_decision_a_failed_step_under_tp_is_fatal():
    error = RuntimeError("sampler fault")
    assert fatal_step_failure(error, tensor_parallel=False, consecutive_failures=1) is None
    assert "in a row" in fatal_step_failure(
        error, tensor_parallel=False, consecutive_failures=MAX_CONSECUTIVE_FAILED_STEPS
    )
    reason = fatal_step_failure(error, tensor_parallel=True, consecutive_failures=1)
    assert "tensor parallel" in reason and "sampler fault" in reason


class _Driver:
    """What the engine needs of a TensorParallelDriver here: the ranks' collectives are what make
    the failure fatal, not anything this test could observe of them."""

    def ping(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_a_failed_step_under_tp_records_the_group_failure_and_the_server_exits(target_model, monkeypatch):
    """The first failed step raises (no request is failed alone) and records the group failure,
    whose hooks the server registers to exit 1 (api_server.exit_soon): /health answers 500 first."""
    llm = LLM(target_model, **ENGINE)
    engine = llm.engine
    monkeypatch.setattr(engine, "tp_driver", _Driver())
    monkeypatch.setattr(launcher, "_failure", None)
    reasons: list[str] = []
    monkeypatch.setattr(launcher, "_failure_hooks", [reasons.append])
    fail_launches(monkeypatch, engine.runner)
    engine.add_request(PROMPT, GREEDY, request_id="a")
    with pytest.raises(RuntimeError, match="injected forward fault"):
        engine.step()
    assert launcher.group_failure() is not None and "injected forward fault" in launcher.group_failure()
    assert reasons == [launcher.group_failure()]
    assert engine.take_failed() == {}


def test_under_tp_a_failure_before_the_launch_fails_its_requests_only(target_model, monkeypatch):
    """Rank 0's own preparation (here the grammar masks) failing never reached the other ranks: the
    group is in step, the requests fail alone and the worker goes on."""
    llm = LLM(target_model, **ENGINE)
    engine = llm.engine
    monkeypatch.setattr(engine, "tp_driver", _Driver())
    monkeypatch.setattr(launcher, "_failure", None)
    monkeypatch.setattr(launcher, "_failure_hooks", [])

    def broken(scheduled):
        raise RuntimeError("injected mask fault")

    monkeypatch.setattr(engine, "_structured_output", object())  # so step() builds the masks
    monkeypatch.setattr(engine, "_constrain_proposals", broken)
    engine.add_request(PROMPT, GREEDY, request_id="a")
    assert engine.step() == []
    assert set(engine.take_failed()) == {"a"} and launcher.group_failure() is None
