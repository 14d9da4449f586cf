"""The compiled CPU forward (worker/model/compilation.py): when it is used, that it compiles at
start-up only, and that it changes no token. The engine-vs-transformers tests run it too."""

from __future__ import annotations

import pytest
import torch

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.model import compilation
from kvscale.worker.model.compilation import CompiledForward, compile_decision
from kvscale.worker.model.forward_batch import SeqChunk, build_forward_batch

CPU = torch.device("cpu")


def test_compile_decision():
    assert compile_decision(CPU, tensor_parallel=False, enforce_eager=False) is None
    assert "enforce_eager" in compile_decision(CPU, tensor_parallel=False, enforce_eager=True)
    assert "CUDA graphs" in compile_decision(torch.device("cuda"), tensor_parallel=False, enforce_eager=False)
    assert "tensor parallelism" in compile_decision(CPU, tensor_parallel=True, enforce_eager=False)
    assert "triton" in compile_decision(CPU, False, False, attention_backend="triton")


def test_no_compiler_means_eager():
    reason = compile_decision(CPU, tensor_parallel=False, enforce_eager=False, cxx="no-such-c++-compiler")
    assert "no C++ compiler" in reason


def test_enforce_eager_default_reads_the_environment(monkeypatch):
    from kvscale.worker.config import EngineArgs

    monkeypatch.setenv("KVSCALE_ENFORCE_EAGER", "0")
    assert EngineArgs().enforce_eager is False
    monkeypatch.setenv("KVSCALE_ENFORCE_EAGER", "1")
    assert EngineArgs().enforce_eager is True


@pytest.fixture(scope="module")
def engines(target_model):
    kwargs = dict(num_kv_blocks=256, max_num_seqs=32, max_num_batched_tokens=256)
    eager = LLM(target_model, enforce_eager=True, **kwargs)
    compiled = LLM(target_model, enforce_eager=False, **kwargs)
    return eager, compiled


def test_the_compiled_engine_compiles_at_start_up(engines):
    _, compiled = engines
    runner = compiled.engine.runner
    assert isinstance(runner.model.compiled, CompiledForward) and runner.model.compiled.ready
    assert runner.compile_seconds is not None and runner.compile_seconds > 0


def generate(llm: LLM, prompts, **params) -> list[list[int]]:
    out = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, **params))
    return [o.outputs[0].token_ids for o in out]


def test_every_step_shape_runs_a_graph_compiled_at_start_up(engines):
    """One stream, 8 streams (2..8 tokens a step), 20 streams with chunked prefill (9+), and greedy
    tokens equal to the eager engine's; no step fell back to eager or compiled anything new."""
    eager, compiled = engines
    forward = compiled.engine.runner.model.compiled
    calls = []
    real = forward.compiled
    forward.compiled = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    try:
        for prompts in ([[0, 11, 12, 13]], [[0, *range(20 + i, 60 + i)] for i in range(8)]):
            assert generate(compiled, prompts, max_tokens=24) == generate(eager, prompts, max_tokens=24)
        prompts = [[0, *range(100 + 3 * i, 130 + 7 * i)] for i in range(20)]
        assert generate(compiled, prompts, max_tokens=16) == generate(eager, prompts, max_tokens=16)
    finally:
        forward.compiled = real
    assert {1, 8} <= set(calls) and max(calls) > 8
    assert forward.eager_fallbacks == 0


def test_speculative_verify_steps_match_eager(target_model):
    """n-gram speculation verifies 1 + k tokens per request in one forward: those shapes too."""
    kwargs = dict(num_kv_blocks=128, speculative_method="ngram", num_speculative_tokens=4)
    prompt = [[0, *([7, 8, 9, 10] * 12)]]
    want = generate(LLM(target_model, enforce_eager=True, **kwargs), prompt, max_tokens=40)
    llm = LLM(target_model, enforce_eager=False, **kwargs)
    assert generate(llm, prompt, max_tokens=40) == want
    assert llm.engine.runner.model.compiled.eager_fallbacks == 0


def test_a_shape_no_graph_covers_runs_eagerly_instead_of_compiling(engines, monkeypatch):
    """Warm up the 1-token graph only: a 3-token step must not compile mid-serving; it runs the
    eager forward (same result) and is counted."""
    _, compiled = engines
    model = compiled.engine.runner.model
    monkeypatch.setattr(compilation, "WARM_UP_TOKENS", (1,))
    torch._dynamo.reset()  # graphs are cached per function: forget the engines' 3-token graph
    fresh = CompiledForward(model.forward_tokens)
    runner = compiled.engine.runner
    monkeypatch.setattr(model, "compiled", fresh)
    with torch.inference_mode():
        fresh.warm_up(runner._dummy_forward)
        ids, positions = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
        batch = build_forward_batch([SeqChunk([5, 6, 7], 0, [1])], runner.block_size, runner.device)
        metadata = runner.backend.prepare(batch.common)
        got = model(ids, positions, runner.kv_caches, runner.backend, metadata)
        monkeypatch.setattr(model, "compiled", None)
        want = model(ids, positions, runner.kv_caches, runner.backend, metadata)
    assert fresh.eager_fallbacks == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
