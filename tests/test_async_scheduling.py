"""Async scheduling (LLMEngine.step, docs/engine.md): each step is scheduled and launched before the
previous one's tokens reach the host, its pending tokens fed in from the device. On a CPU nothing
overlaps, but every piece of the bookkeeping runs: these tests check that it changes no token, no
stop and no finish reason against the synchronous engine, that steps really were launched ahead,
and that a request stopped or aborted with a step in flight gives all its KV blocks back."""

from __future__ import annotations

import pytest

from kvscale.worker import LLM, SamplingParams

ENGINE = dict(num_kv_blocks=128, max_num_seqs=16, max_num_batched_tokens=512)
PROMPTS = [
    "def fibonacci(n):",
    "import numpy as np\n\n",
    "class Stack:\n    def __init__(self):",
    "# sort a list of numbers\n",
    "SELECT name FROM users WHERE",
    "for i in range(10):",
]


@pytest.fixture(scope="module")
def engines(target_model):
    return LLM(target_model, **ENGINE), LLM(target_model, async_scheduling=True, **ENGINE)


def summary(outputs) -> list[list[tuple]]:
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs]
        for out in outputs
    ]


def generate_both(engines, prompts, params) -> tuple[list, list]:
    sync, overlapped = engines
    before = overlapped.engine.num_async_steps
    want, got = sync.generate(prompts, params), overlapped.generate(prompts, params)
    assert overlapped.engine.num_async_steps > before, "no step was launched ahead of its predecessor"
    assert sync.engine.num_async_steps == 0
    return summary(want), summary(got)


def test_greedy_tokens_and_finish_reasons_are_unchanged(engines):
    # Different lengths, so requests finish (on max_tokens) while others' steps are in flight.
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 7 * i) for i in range(len(PROMPTS))]
    want, got = generate_both(engines, PROMPTS, params)
    assert got == want


def test_a_stop_on_a_token_in_flight_drops_the_step_after_it(engines):
    sync, _ = engines
    free = SamplingParams(temperature=0.0, max_tokens=24)
    reference = sync.generate(PROMPTS, free)
    # Stop each request on its 6th token (an id) or on text from the middle of its output: the step
    # after the stop is already launched when the host sees it, and its token must not appear.
    params = []
    for i, out in enumerate(reference):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        if i % 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[ids[5]]))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=24, stop=[text[len(text) // 2 :][:4]]))
    want, got = generate_both(engines, PROMPTS, params)
    assert got == want
    assert all(out[0][2] == "stop" for out in got)


def test_seeded_sampling_min_tokens_n_and_logprobs_are_unchanged(engines):
    # Seeded noise is a function of the output position: a pending token must count in it.
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, n=2, min_tokens=4, logprobs=2)
    want, got = generate_both(engines, PROMPTS[:3], params)
    assert got == want


def test_chunked_prefill_and_preemption_are_unchanged(target_model):
    # A pool too small for every request at once (preemptions) and prompts split into chunks.
    small = dict(num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=32)
    prompts = [p * 4 for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    sync, overlapped = LLM(target_model, **small), LLM(target_model, async_scheduling=True, **small)
    want, got = summary(sync.generate(prompts, params)), summary(overlapped.generate(prompts, params))
    assert got == want
    assert overlapped.engine.scheduler.num_preemptions > 0, "the test must preempt"
    assert overlapped.engine.num_async_steps > 0
    assert overlapped.engine.kv_cache_manager.usage() == 0.0


def test_penalties_count_the_pending_token_on_the_device(engines):
    # A penalised request's pending token is counted where it was sampled: same tokens as the
    # synchronous engine, the penalised one's included.
    params = [SamplingParams(temperature=0.0, max_tokens=16) for _ in PROMPTS]
    params[2] = SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5)
    want, got = generate_both(engines, PROMPTS, params)
    assert got == want


# -- per row: a penalty or a grammar does not turn async scheduling off for the others ---------

BATCH = dict(num_kv_blocks=320, max_num_seqs=64, max_num_batched_tokens=1024)
BATCH_PROMPTS = [f"{PROMPTS[i % len(PROMPTS)]} # {i}\n" for i in range(64)]


@pytest.fixture(scope="module")
def batch_engines(target_model):
    return LLM(target_model, **BATCH), LLM(target_model, async_scheduling=True, **BATCH)


def count_launches(monkeypatch, llm) -> list[int]:
    runner, launch, launches = llm.engine.runner, llm.engine.runner.launch, [0]

    def counted(out):
        launches[0] += 1
        return launch(out)

    monkeypatch.setattr(runner, "launch", counted)
    return launches


def generate_counted(batch_engines, monkeypatch, prompts, params) -> tuple[list, list, int, int]:
    """(sync outputs, async outputs, the async engine's launches, its steps launched ahead)."""
    sync, overlapped = batch_engines
    launches = count_launches(monkeypatch, overlapped)
    before = overlapped.engine.num_async_steps
    want, got = summary(sync.generate(prompts, params)), summary(overlapped.generate(prompts, params))
    return want, got, launches[0], overlapped.engine.num_async_steps - before


def test_one_penalty_row_in_a_batch_of_64_leaves_every_step_async(batch_engines, monkeypatch):
    """Issue 26: one request with penalties used to make every step synchronous while it ran. Its
    pending token is counted on the device now: every launch but the first has one in flight, and
    greedy output (the penalised row's, which the penalties do change, included) is unchanged."""
    params = [SamplingParams(temperature=0.0, max_tokens=12) for _ in BATCH_PROMPTS]
    penalised = SamplingParams(
        temperature=0.0, max_tokens=16, presence_penalty=0.01, frequency_penalty=1.0, repetition_penalty=1.3
    )
    params[5] = penalised
    want, got, launches, ahead = generate_counted(batch_engines, monkeypatch, BATCH_PROMPTS, params)
    assert got == want
    assert ahead == launches - 1 and launches >= 16, (ahead, launches)
    unpenalised = batch_engines[0].generate(BATCH_PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=16))
    assert unpenalised[0].outputs[0].token_ids != want[5][0][0], "the penalties must change the tokens"


def test_one_grammar_row_sits_out_steps_alone(batch_engines, monkeypatch):
    """A grammar's next mask needs the pending token on the host: that row runs every other step
    while the other 63 run ahead in every one; outputs unchanged and the grammar's held to."""
    from kvscale.worker.sample.sampling_params import StructuredOutputsParams

    params = [SamplingParams(temperature=0.0, max_tokens=24) for _ in BATCH_PROMPTS]
    grammar = StructuredOutputsParams(regex="[a-z]+( [a-z]+)*")
    params[7] = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=grammar)
    want, got, launches, ahead = generate_counted(batch_engines, monkeypatch, BATCH_PROMPTS, params)
    assert got == want
    assert ahead == launches - 1 and launches >= 24, (ahead, launches)
    import re

    assert re.fullmatch("[a-z]+( [a-z]+)*", got[7][0][1]), got[7][0][1]


def test_a_generation_config_repetition_penalty_leaves_async_scheduling_on(
    target_model, tmp_path, monkeypatch
):
    """A model whose generation_config.json sets repetition_penalty (Qwen2.5-Instruct: 1.05) gives
    every request a penalty: every step still runs ahead, with the synchronous engine's tokens."""
    import json
    from pathlib import Path

    for f in Path(target_model).iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").unlink()
    config = {
        **json.loads((Path(target_model) / "generation_config.json").read_text()),
        "repetition_penalty": 1.3,
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    engines = LLM(str(tmp_path), **ENGINE), LLM(str(tmp_path), async_scheduling=True, **ENGINE)
    assert engines[1].engine.default_sampling_params == {"repetition_penalty": 1.3}
    params = SamplingParams(temperature=0.0, max_tokens=16)
    want, got, launches, ahead = generate_counted(engines, monkeypatch, PROMPTS, params)
    assert got == want
    assert ahead == launches - 1 and launches >= 16, (ahead, launches)
    plain = LLM(target_model, **ENGINE).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in plain] != [out[0][0] for out in want], "the default must apply"


def test_an_abort_with_a_step_in_flight_frees_every_block(engines):
    _, overlapped = engines
    engine = overlapped.engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None, "a step must be in flight when the abort comes"
    engine.abort_request(ids)
    while engine.has_unfinished_requests():  # the step in flight is processed: nothing comes of it
        assert engine.step() == []
    assert engine.kv_cache_manager.usage() == 0.0
    assert all(r.num_pending_tokens == 0 for r in engine.scheduler.requests.values())


def test_max_tokens_is_known_before_the_token_no_step_runs_past_it(engines, monkeypatch):
    # max_tokens=1: the prefill samples the only token, and scheduling ahead must not add a decode
    # step for it (nor a KV slot past the request's end).
    launches = {}
    for llm in engines:
        runner = llm.engine.runner
        launch = runner.launch

        def counted(out, runner=runner, launch=launch):
            launches[runner] = launches.get(runner, 0) + 1
            return launch(out)

        monkeypatch.setattr(runner, "launch", counted)
    sync, overlapped = engines
    for llm in engines:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1))
        assert all(len(o.outputs[0].token_ids) == 1 for o in outputs)
    assert launches[overlapped.engine.runner] == launches[sync.engine.runner] == 1
    want, got = generate_both(engines, PROMPTS, SamplingParams(temperature=0.0, max_tokens=3))
    assert got == want and all(len(out[0][0]) == 3 for out in got)
    assert launches[overlapped.engine.runner] == launches[sync.engine.runner] == 1 + 3


def test_the_server_streams_the_same_text_and_a_client_leaving_mid_stream_frees_its_blocks(
    engines, target_model
):
    # The real app and the openai client, async scheduling on: the stream's text is the synchronous
    # engine's, and a client that closes its stream with a step in flight leaves no block held.
    import openai
    from test_server_hostile import all_blocks_free, in_process_server

    sync, _ = engines
    want = sync.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].text
    with in_process_server(target_model, async_scheduling=True, **ENGINE) as (base_url, llm):
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(
            model=target_model, prompt=PROMPTS[0], max_tokens=24, temperature=0.0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want
        stream = client.completions.create(
            model=target_model, prompt=PROMPTS[1], max_tokens=500, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        assert all_blocks_free(llm)
        assert llm.engine.num_async_steps > 0
