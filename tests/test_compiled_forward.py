"""The compiled CPU forward (worker/model/compilation.py): when it is used, that it compiles at
start-up only, and that it changes no token. The engine-vs-transformers tests run it too."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from kvscale.kernels.kv_cache import write_kv_cache
from kvscale.kernels.paged_attention import paged_decode_attention, paged_decode_attention_unwritten
from kvscale.worker import LLM, SamplingParams
from kvscale.worker.model import compilation
from kvscale.worker.model.compilation import CompiledForward, compile_decision
from kvscale.worker.model.forward_batch import (
    MAX_DECODE_PADDING,
    SeqChunk,
    build_forward_batch,
    in_graph_decode,
)

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


def test_a_cache_directory_inductor_cannot_load_from_means_eager(tmp_path, monkeypatch):
    assert compile_decision(CPU, False, False, cache_dir=str(tmp_path / "cache")) is None
    assert (tmp_path / "cache").is_dir()
    blocked = tmp_path / "file"
    blocked.write_text("")
    reason = compile_decision(CPU, False, False, cache_dir=str(blocked / "cache"))
    assert "cannot be made" in reason
    # docker's --tmpfs is noexec unless told otherwise: the built libraries would not load
    statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=statvfs(p).f_flag | os.ST_NOEXEC))
    assert "noexec" in compile_decision(CPU, False, False, cache_dir=str(tmp_path / "cache"))


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
    calls = []  # (tokens, attention in the graph)
    real = forward.compiled
    forward.compiled = lambda *a: calls.append((a[0].shape[0], a[2] is not None)) or real(*a)
    try:
        for prompts in ([[0, 11, 12, 13]], [[0, *range(20 + i, 60 + i)] for i in range(8)]):
            assert generate(compiled, prompts, max_tokens=24) == generate(eager, prompts, max_tokens=24)
        prompts = [[0, *range(100 + 3 * i, 130 + 7 * i)] for i in range(20)]
        assert generate(compiled, prompts, max_tokens=16) == generate(eager, prompts, max_tokens=16)
    finally:
        forward.compiled = real
    sizes = {n for n, _ in calls}
    assert {1, 8} <= sizes and max(sizes) > 8
    # Decode-only steps of one and of 8 streams ran attention inside the graph.
    assert {(1, True), (8, True)} <= set(calls)
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


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_compiled_decode_attention_reads_the_paged_cache_like_the_eager_kernel(sliding_window):
    """The compiled form of paged_decode_attention_unwritten (broadcast products over the indexed
    cache, no gather) against writing the token's K/V and running the eager paged kernel: GQA,
    lengths spread over many blocks (the padding reads block 0), scattered block tables."""
    torch.manual_seed(0)
    kv_heads, heads, dim, block, num_blocks = 2, 6, 16, 16, 64
    lens = [1, 17, 33, 90, 200]
    k_cache = torch.randn(kv_heads, num_blocks, block, dim)
    v_cache = torch.randn(kv_heads, num_blocks, block, dim)
    width = -(-max(lens) // block)
    perm = torch.randperm(num_blocks - 1) + 1  # block 0 is the padding
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    seq_lens = torch.tensor(lens)
    q, k, v = (
        torch.randn(len(lens), heads, dim),
        torch.randn(len(lens), kv_heads, dim),
        torch.randn(len(lens), kv_heads, dim),
    )
    compiled = torch.compile(paged_decode_attention_unwritten, fullgraph=True, dynamic=True)
    got = compiled(q, k, v, k_cache, v_cache, tables, seq_lens, dim**-0.5, sliding_window)
    positions = seq_lens - 1
    slots = tables.gather(1, (positions // block)[:, None]).squeeze(1) * block + positions % block
    write_kv_cache(k, v, k_cache, v_cache, slots)
    want = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, dim**-0.5, sliding_window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_decode_steps_take_the_graph_attention_unless_padding_would_cost_too_much():
    def common(lens, prefill=False):
        chunks = [SeqChunk([1], n - 1, list(range(-(-n // 16)))) for n in lens]
        if prefill:
            chunks.append(SeqChunk([1, 2, 3], 0, [0]))
        return build_forward_batch(chunks, 16, CPU).common

    assert in_graph_decode(common([300]))
    assert in_graph_decode(common([100, 200, 400, 800]))  # 4 x 50 blocks for 97 real: 2.1x
    wide = [32] * 15 + [32 * 16 * int(MAX_DECODE_PADDING)]  # 16 x 64 blocks for 94 real: 10.9x
    assert not in_graph_decode(common(wide))
    assert not in_graph_decode(common([300, 300], prefill=True))  # a prefill chunk: the backend's op
