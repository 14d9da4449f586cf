"""The engine in a process of its own (--engine-process; engine/core_proc.py, engine/core_client.py):
the same tokens as transformers over the process boundary, with and without async scheduling;
refusals, aborts, constraints and adapters cross it; a dead engine process ends the worker at once
and a dead worker leaves no engine behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
from process_fixtures import alive, descendants, wait_gone
from server_fixtures import start_server
from test_engine_vs_hf import assert_greedy_matches, hf_greedy, mixed_prompts

from kvscale.worker.config import EngineArgs
from kvscale.worker.engine.async_llm import METRICS_INTERVAL, stats_due
from kvscale.worker.engine.core_client import MPAsyncLLM
from kvscale.worker.sample.sampling_params import SamplingParams, StructuredOutputsParams


def run_with_engine_process(scenario, **engine_args):
    """scenario(llm) on a started MPAsyncLLM, then its shutdown; returns what it returned."""

    async def main():
        llm = MPAsyncLLM(EngineArgs(**engine_args), "target")
        await llm.start()
        try:
            return await scenario(llm)
        finally:
            await llm.shutdown()
            assert llm.pid is not None and not alive(llm.pid)

    return asyncio.run(main())


async def tokens_of(llm, prompt, params: SamplingParams, request_id: str) -> list[int]:
    ids: list[int] = []
    async for out in llm.generate(prompt, params, request_id):
        ids += out.outputs[0].token_ids
    return ids


def metric_value(llm, name: str) -> float:
    value = llm.metrics.registry.get_sample_value(name, {"model_name": "target"})
    return 0.0 if value is None else value


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_greedy_over_the_process_boundary_matches_transformers(target_model, async_scheduling):
    prompts = mixed_prompts(vocab_size=4096, n=8, seed=7)
    max_new = [24, 5, 17, 1, 32, 9, 24, 12]

    async def scenario(llm):
        params = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_new]
        results = await asyncio.gather(
            *(tokens_of(llm, p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params, strict=True)))
        )
        await asyncio.sleep(0.2)  # the idle engine's last stats
        return results, metric_value(llm, "kvscale_async_scheduled_steps_total")

    results, async_steps = run_with_engine_process(
        scenario, model=target_model, async_scheduling=async_scheduling
    )
    references = hf_greedy(target_model, prompts, max_new)
    for ours, (ref_tokens, ref_logits) in zip(results, references, strict=True):
        assert_greedy_matches(ours, ref_tokens, ref_logits)
    # The steps really overlapped across the boundary when asked to (and never when not).
    assert (async_steps > 0) == async_scheduling


def test_refusals_aborts_constraints_and_metrics_cross_the_boundary(target_model):
    async def scenario(llm):
        # Refused by the engine (it can never run): a ValueError from the stream, before any output.
        with pytest.raises(ValueError, match="maximum model length"):
            await tokens_of(llm, [1] * (llm.info.max_model_len + 1), SamplingParams(max_tokens=1), "long")
        # An abort (the client left) frees the request's blocks in the engine process.
        gen = llm.generate([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=400), "left")
        await gen.__anext__()
        await gen.aclose()
        deadline = time.monotonic() + 10
        while llm.num_waiting or metric_value(llm, "kvscale_kv_cache_usage_ratio") > 0:
            assert time.monotonic() < deadline, "the aborted request kept its blocks"
            llm.publish_metrics_soon()
            await asyncio.sleep(0.05)
        # A constraint compiles in the engine process; its tokens follow it.
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        params = SamplingParams(
            temperature=0.0,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True),
        )
        grammar = await llm.prepare_grammar(params)
        text = ""
        async for out in llm.generate("x", params, "json", grammar):
            text += out.outputs[0].text
        # A bad constraint is refused through the call, as in-process.
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
        with pytest.raises(ValueError):
            await llm.prepare_grammar(bad)
        return text

    text = run_with_engine_process(scenario, model=target_model)
    assert isinstance(json.loads(text)["a"], int)


def test_steps_without_outputs_are_reported_only_for_a_change_or_the_stats():
    state = (3, 2, 0)  # adds taken, running, waiting
    assert not stats_due((0.0, state), METRICS_INTERVAL / 2, state)
    assert stats_due((0.0, state), 0.0, (4, 2, 0))  # it took an add: the API's num_waiting moves
    assert stats_due((0.0, state), 0.0, (3, 1, 1))  # a preemption: the autoscaler's gauges move
    assert stats_due((0.0, state), METRICS_INTERVAL, state)


def test_under_stream_interval_the_engine_process_sends_fewer_messages_than_steps(target_model):
    """Each message wakes the API process; a step whose deltas all wait sends none unless its stats
    are due. What the client gets is the same 1, 4, 4, ... deltas as in-process."""

    async def scenario(llm):
        messages: list[int] = []
        handle = llm._handle

        def counted(message: tuple) -> None:
            if message[0] == "step":
                messages.append(len(message[1]) + len(message[2]))
            handle(message)

        llm._handle = counted
        start = time.monotonic()
        params = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
        deltas = [len(o.outputs[0].token_ids) async for o in llm.generate([1, 2, 3], params, "r")]
        return deltas, messages, time.monotonic() - start

    deltas, messages, seconds = run_with_engine_process(scenario, model=target_model, stream_interval=4)
    assert deltas == [1, 4, 4, 4, 4, 4]
    empty = messages.count(0)
    # Empty ones only when the stats fell due (every METRICS_INTERVAL, an add, a count change).
    assert empty <= seconds / METRICS_INTERVAL + 2, (messages, seconds)


def engine_pid(server) -> int:
    for pid in descendants(server.proc.pid):
        with contextlib.suppress(FileNotFoundError):
            if b"kvscale.worker.engine.core_proc" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise AssertionError("no engine process under the worker")


def test_a_killed_engine_process_ends_the_worker_within_two_seconds(target_model, tmp_path):
    server = start_server(target_model, tmp_path, "--engine-process")
    try:
        engine = engine_pid(server)
        # Only the engine and what it started (a compile behind would outlive it on purpose).
        tree = {engine, *descendants(engine)}
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        code = server.proc.wait(timeout=10)
        took = time.monotonic() - killed
        assert code != 0 and took < 2.0, (code, took, server.log())
        wait_gone(tree, 2.0)
        assert "the engine process died" in server.whole_log()
    finally:
        server.stop()


def test_a_killed_worker_leaves_no_engine_process(target_model, tmp_path):
    server = start_server(target_model, tmp_path, "--engine-process")
    try:
        engine = engine_pid(server)
        tree = {engine, *descendants(engine)}
        server.proc.kill()
        server.proc.wait(timeout=10)
        wait_gone(tree, 2.0)  # the engine process did not outlive its worker
    finally:
        server.stop()


def test_a_frozen_engine_process_fails_health_while_the_api_answers(target_model, tmp_path):
    """The engine process stopped mid-work (SIGSTOP: a hang in a kernel, as it looks from outside):
    the API process goes on answering, /health says `stuck` once the engine has owed progress for
    --engine-iteration-timeout, and Ready again once it moves."""
    server = start_server(target_model, tmp_path, "--engine-process", "--engine-iteration-timeout", "1")
    engine = engine_pid(server)

    async def scenario() -> tuple[float, tuple[int, bytes], tuple[int, bytes]]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            body = {"prompt": [0, 5, 6, 7], "max_tokens": 600, "ignore_eos": True, "stream": True}
            async with session.post(server.base_url + "/v1/completions", json=body) as response:
                await response.content.readline()  # streaming: the engine is mid-work
                os.kill(engine, signal.SIGSTOP)
                stopped = time.monotonic()
                try:
                    loop = asyncio.get_running_loop()
                    while True:
                        status = await loop.run_in_executor(None, server.get, "/health")
                        if status[0] == 500 or time.monotonic() - stopped > 10:
                            break
                        await asyncio.sleep(0.1)
                    took = time.monotonic() - stopped
                finally:
                    os.kill(engine, signal.SIGCONT)
                async for _ in response.content:  # the stream resumes and ends
                    pass
            return took, status, await loop.run_in_executor(None, server.get, "/health")

    try:
        took, stuck, after = asyncio.run(scenario())
        assert stuck[0] == 500 and b"stuck" in stuck[1], stuck
        assert 1.0 <= took < 5.0, took  # not before the timeout, and within a few probes of it
        assert after[0] == 200, after
    finally:
        server.stop()
