"""Requests that cannot hurt others (issue 14, part 4): the event loop stays free while a huge
prompt is refused, every request's work is bounded, a step that fails for one request fails only
that request, types are as strict as OpenAI's, unimplemented OpenAI fields are refused by name,
and a KV pool smaller than the model's context never turns every request into a 400."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import openai
import pytest
from aiohttp import web
from server_fixtures import free_port, start_server
from test_server_openai import ERROR_KEYS, MESSAGES, PROMPT, error_of, post_json, raw

from kvscale.worker.config import EngineArgs, fit_max_model_len
from kvscale.worker.engine.async_llm import AsyncLLM
from kvscale.worker.engine.llm_engine import MAX_CONSECUTIVE_FAILED_STEPS, LLMEngine, RequestFailedError
from kvscale.worker.llm import LLM
from kvscale.worker.model.model_runner import ModelRunner
from kvscale.worker.sample.sampling_params import SamplingParams
from kvscale.worker.server.api_server import ServerConfig, build_app, engine_stuck, freeze_startup_heap
from kvscale.worker.server.protocol import (
    MAX_CONTENT_PARTS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
)


def bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    return error_of(exc, 400)


# -- the event loop is never blocked by one request --------------------------------------------

PROBE_SCRIPT = """
import http.client, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
worst, n = 0.0, 0
print("started", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    for path in ("/health", "/ready"):
        t = time.monotonic()
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        assert r.status == 200, (path, r.status)
        worst, n = max(worst, time.monotonic() - t), n + 1
    time.sleep(0.005)
print(f"{worst} {n}", flush=True)
"""


def probe_while_refused(server, client, model, endpoint: str, huge: str) -> tuple[float, int, float]:
    """(the worst probe latency, probes sent, seconds to the refusal) while `huge` is sent and
    refused."""
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE_SCRIPT, str(server.port), "4"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert probe.stdout.readline().strip() == "started"
        time.sleep(0.2)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as exc:
            if endpoint == "completions":
                client.completions.create(model=model, prompt=huge, max_tokens=1)
            else:
                messages = [{"role": "user", "content": huge}]
                client.chat.completions.create(model=model, messages=messages, max_tokens=1)
        refused_in = time.monotonic() - started
        out, _ = probe.communicate(timeout=60)
    finally:
        probe.kill()
    assert probe.returncode == 0, out
    assert exc.value.status_code in (400, 413)
    error = error_of(exc, exc.value.status_code)
    assert error["code"] in ("context_length_exceeded", "request_too_large"), error
    worst, n = out.split()
    return float(worst), int(n), refused_in


# What a stall of the loop by this request would cost: tokenizing the 15 MB prompt there takes
# 13.6 s on this VM (parsing its JSON 27 ms, under any budget a loaded machine can hold). 300 ms is
# 45x under the first and over the scheduling hiccups of this 2-core VM under the full test run
# (117-228 ms seen); the quiet-machine figure (/health p100 under 100 ms) is the hostile
# benchmark's (docs/server.md), not a timed test's.
PROBE_BUDGET_S = 0.3


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_probes_answer_within_300ms_while_a_15mb_prompt_is_refused(server, client, model, endpoint):
    """The probes run in their own process (this one is busy serialising 15 MB), probing while the
    prompt is sent and refused; the worst latency they saw bounds the event loop's stall. A stall
    happens on every try, a scheduling hiccup not: the budget must hold in one of two tries."""
    huge = "x " * (15 * 2**20 // 2)
    tries = []
    for _ in range(2):
        worst, n, refused_in = probe_while_refused(server, client, model, endpoint, huge)
        assert n > 20, n
        tries.append((round(worst, 3), round(refused_in, 2)))
        if worst < PROBE_BUDGET_S:
            break
    else:
        pytest.fail(
            f"worst probe latency over {PROBE_BUDGET_S} s in both tries (worst s, refused in s): {tries}"
        )
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


# -- bounded work per request ------------------------------------------------------------------


def _limit_cases(model: str) -> list[tuple[str, dict, str]]:
    """(endpoint, body, the param the 400 must name): each one past its documented limit."""
    chat = {"model": model, "messages": MESSAGES, "max_tokens": 2}
    cmpl = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    cases = []
    for base, path in ((cmpl, "/v1/completions"), (chat, "/v1/chat/completions")):
        cases += [
            (path, {**base, "stop": ["s"] * (MAX_STOP + 1)}, "stop"),
            (path, {**base, "stop": "s" * (MAX_STOP_CHARS + 1)}, "stop"),
            (path, {**base, "stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
            (path, {**base, "n": MAX_N + 1}, "n"),
            (path, {**base, "logit_bias": {"5": 1.0}}, "logit_bias"),
        ]
    cases += [
        ("/v1/completions", {**cmpl, "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ("/v1/completions", {**cmpl, "prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt"),
        (
            "/v1/chat/completions",
            {**chat, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {**chat, "messages": MESSAGES * (MAX_MESSAGES + 1)}, "messages"),
        (
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 65}]},
            "messages.0.content",
        ),
    ]
    assert MAX_CONTENT_PARTS == 64
    return cases


def test_requests_past_each_limit_are_400_naming_the_field(server, model):
    for path, body, param in _limit_cases(model):
        status, _, data = post_json(server.base_url, path, body)
        error = json.loads(data)["error"]
        assert status == 400 and set(error) == ERROR_KEYS, (path, param, status, data[:300])
        assert error["type"] == "invalid_request_error" and error["param"] == param, (path, error)


def test_requests_at_each_limit_are_served(client, model):
    stop = [(f"zq{i:02d}" * MAX_STOP_CHARS)[:MAX_STOP_CHARS] for i in range(MAX_STOP)]
    assert len(stop[0]) == MAX_STOP_CHARS
    r = client.completions.create(
        model=model,
        prompt=[PROMPT] * MAX_PROMPTS,
        max_tokens=2,
        stop=stop,
        logprobs=MAX_LOGPROBS,
        extra_body={"stop_token_ids": list(range(5, 5 + MAX_STOP_TOKEN_IDS))},
    )
    assert len(r.choices) == MAX_PROMPTS
    r = client.chat.completions.create(
        model=model,
        messages=MESSAGES * 4,
        max_tokens=2,
        n=MAX_N,
        stop=stop,
        logprobs=True,
        top_logprobs=MAX_LOGPROBS,
    )
    assert len(r.choices) == MAX_N
    # MAX_MESSAGES messages pass validation; on this model (2048 tokens) they are too long to run.
    many = [{"role": "user", "content": ""}] * MAX_MESSAGES
    error = bad_request(lambda: client.chat.completions.create(model=model, messages=many, max_tokens=2))
    assert error["code"] == "context_length_exceeded", error


# -- types as strict as OpenAI's ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "5"),
        ("stream", "yes"),
        ("stream", 1),
        ("n", "2"),
        ("temperature", "0.5"),
        ("seed", "1"),
        ("logprobs", 1),  # chat: a boolean
        ("ignore_eos", "true"),
    ],
)
def test_wrongly_typed_fields_are_400(server, model, field, value):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 2, field: value}
    status, _, data = post_json(server.base_url, "/v1/chat/completions", body)
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == field, (status, error)


@pytest.mark.parametrize("role", ["system", "developer", "user"])
def test_null_or_missing_content_is_400_except_for_the_assistant(client, model, role):
    for message in ({"role": role, "content": None}, {"role": role}):
        error = bad_request(
            lambda m=message: client.chat.completions.create(model=model, messages=[m], max_tokens=2)
        )
        assert error["param"] == "messages.0.content", error
    messages = [*MESSAGES, {"role": "assistant", "content": None}, *MESSAGES]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert r.choices[0].message.role == "assistant"


def test_every_unknown_path_is_404_and_wrong_method_405_in_openai_shape(server):
    for method, path in [
        ("GET", "/nope"),
        ("GET", "/"),
        ("POST", "/health/x"),
        ("GET", "/v1/nope"),
        ("POST", "/v2/chat"),
    ]:
        status, headers, data = raw(server.base_url, path, b"{}" if method == "POST" else None)
        assert status == 404, (method, path, status)
        assert headers["Content-Type"].startswith("application/json"), (path, headers)
        error = json.loads(data)["error"]
        assert set(error) == ERROR_KEYS and error["code"] == "not_found", (path, error)
    for path, allow in [("/health", "GET"), ("/metrics", "GET"), ("/v1/chat/completions", "POST")]:
        status, headers, data = raw(server.base_url, path, b"{}" if allow == "GET" else None)
        error = json.loads(data)["error"]
        assert status == 405 and allow in headers["Allow"] and error["code"] == "method_not_allowed", (
            path,
            data,
        )


# -- OpenAI fields we do not implement are refused by name -------------------------------------

UNSUPPORTED_CHAT_FIELDS = {
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "prediction": {"type": "content", "content": "x"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "web_search_options": {},
    "reasoning_effort": "low",
    "verbosity": "low",
    "store": True,
    "service_tier": "flex",
}


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_CHAT_FIELDS))
def test_unimplemented_chat_fields_are_400_naming_them(client, model, field):
    error = bad_request(
        lambda: client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=2, extra_body={field: UNSUPPORTED_CHAT_FIELDS[field]}
        )
    )
    assert error["param"] == field and "not supported" in error["message"], error


def test_no_op_values_of_unimplemented_fields_are_accepted(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=2,
        tool_choice="none",
        extra_body={"modalities": ["text"], "store": False, "service_tier": "auto", "tools": None},
    )
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            {"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}},
            "messages.1.function_call",
        ),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}, None),
    ],
)
def test_function_calls_and_non_text_parts_in_messages_are_400_not_dropped(client, model, message, param):
    error = bad_request(
        lambda: client.chat.completions.create(model=model, messages=[*MESSAGES, message], max_tokens=2)
    )
    assert error["param"].startswith(param or "messages.1.content"), error


# -- a step that fails for one request fails that request alone --------------------------------


@contextmanager
def in_process_server(model: str, server_config: ServerConfig | None = None, **engine_args):
    """The real app (AsyncLLM + aiohttp) on a loop in a thread of this process, so a test can
    monkeypatch the engine's code; yields (base_url, llm)."""
    args = EngineArgs(model=model, **engine_args)
    port = free_port()
    loop = asyncio.new_event_loop()
    started: dict = {}
    ready = threading.Event()

    async def start() -> None:
        llm = AsyncLLM(args, model)
        app = build_app(llm, args, server_config or ServerConfig())
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await llm.start()
        started.update(llm=llm, runner=runner)

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
        finally:
            ready.set()
        loop.run_forever()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    ready.wait(300)
    assert "llm" in started, "the in-process server did not start"
    # As the real server does once loaded: without it, a full collection over everything this test
    # process holds (earlier tests' models: millions of objects) held the loop 0.28 s in CI.
    freeze_startup_heap()

    async def stop() -> None:
        await started["runner"].cleanup()
        await started["llm"].shutdown()

    try:
        yield f"http://127.0.0.1:{port}", started["llm"]
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(60)
        gc.unfreeze()  # what this server held can be collected again


def all_blocks_free(llm: AsyncLLM, timeout: float = 10.0) -> bool:
    """Every KV block is back in the pool (aborts land in the engine's next iteration)."""
    pool = llm.engine.kv_cache_manager.block_pool
    deadline = time.monotonic() + timeout
    while pool.num_free_blocks != pool.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    return pool.num_free_blocks == pool.num_blocks


FAULTY_SEED = 666  # the marker of the request whose steps raise


@pytest.fixture
def faulty_detokenizer(monkeypatch):
    """Detokenizing raises for the request with seed FAULTY_SEED once it has 3 tokens."""
    real = LLMEngine._detokenize

    def detokenize(self, parent, i, request):
        if request.sampling_params.seed == FAULTY_SEED and request.num_output_tokens >= 3:
            raise RuntimeError("injected detokenizer fault")
        return real(self, parent, i, request)

    monkeypatch.setattr(LLMEngine, "_detokenize", detokenize)


def test_a_request_whose_step_raises_fails_alone(target_model, faulty_detokenizer):
    with in_process_server(target_model, num_kv_blocks=256) as (base_url, llm):

        async def run() -> list:
            client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120)
            async with client:

                async def healthy(stream: bool):
                    kwargs = dict(model=target_model, prompt=PROMPT, max_tokens=24, temperature=0)
                    if not stream:
                        return (
                            await client.completions.create(**kwargs, extra_body={"ignore_eos": True})
                        ).usage
                    chunks = await client.completions.create(
                        **kwargs,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True},
                    )
                    return [c async for c in chunks][-1].usage

                async def faulty(stream: bool):
                    kwargs = dict(
                        model=target_model,
                        messages=MESSAGES,
                        max_tokens=24,
                        temperature=0.8,
                        seed=FAULTY_SEED,
                    )
                    if not stream:
                        return await client.chat.completions.create(**kwargs)
                    return [c async for c in await client.chat.completions.create(**kwargs, stream=True)]

                calls = [
                    healthy(False),
                    healthy(True),
                    faulty(False),
                    faulty(True),
                    healthy(True),
                    healthy(False),
                ]
                return await asyncio.gather(*calls, return_exceptions=True)

        results = asyncio.run(run())
        for i in (0, 1, 4, 5):
            assert not isinstance(results[i], BaseException), results[i]
            assert results[i].completion_tokens == 24, results[i]
        assert isinstance(results[2], openai.InternalServerError), results[2]
        assert results[2].response.json()["error"]["code"] == "request_failed"
        assert isinstance(results[3], openai.APIError) and "injected" in str(results[3]), results[3]
        assert llm.dead is None and all_blocks_free(llm)
        # The engine goes on serving.
        c = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        assert (
            c.completions.create(model=target_model, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
        )
        status, _, _ = raw(base_url, "/health")
        assert status == 200


def test_a_step_that_raises_as_a_whole_fails_its_batch_and_the_engine_goes_on(target_model, monkeypatch):
    """The forward or the sampler raising: the requests in that step fail, later ones are served;
    only MAX_CONSECUTIVE_FAILED_STEPS failed steps in a row kill the engine."""
    real = ModelRunner.launch

    def launch(self, scheduled):
        if any(r.sampling_params.seed == FAULTY_SEED for r in scheduled.requests):
            raise RuntimeError("injected sampler fault")
        return real(self, scheduled)

    monkeypatch.setattr(ModelRunner, "launch", launch)
    with in_process_server(target_model, num_kv_blocks=64) as (base_url, llm):
        c = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        for _ in range(MAX_CONSECUTIVE_FAILED_STEPS + 1):  # apart, never consecutive: never dead
            with pytest.raises(openai.InternalServerError) as exc:
                c.completions.create(model=target_model, prompt=PROMPT, max_tokens=4, seed=FAULTY_SEED)
            assert exc.value.response.json()["error"]["code"] == "request_failed"
            assert (
                c.completions.create(model=target_model, prompt=PROMPT, max_tokens=3).usage.completion_tokens
                == 3
            )
        assert llm.dead is None and raw(base_url, "/health")[0] == 200
        assert all_blocks_free(llm)


def test_offline_generate_raises_for_a_failing_request_and_the_engine_goes_on(
    target_model, faulty_detokenizer
):
    llm = LLM(target_model, num_kv_blocks=64)
    bad = SamplingParams(max_tokens=8, temperature=0.8, seed=FAULTY_SEED)
    with pytest.raises(RequestFailedError, match="injected"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=8), bad])
    assert not llm.engine.has_unfinished_requests()
    assert (
        len(llm.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))[0].outputs[0].token_ids) == 5
    )


def test_only_consecutive_failed_steps_kill_the_engine(target_model, monkeypatch):
    """A device that fails every step (a sticky CUDA error) must not leave a live-looking engine
    that fails every request: after MAX_CONSECUTIVE_FAILED_STEPS in a row the step raises."""

    def broken(self, scheduled):
        raise RuntimeError("injected device fault")

    llm = LLM(target_model, num_kv_blocks=64)
    monkeypatch.setattr(ModelRunner, "launch", broken)
    engine = llm.engine
    for i in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4), request_id=f"r{i}")
        assert engine.step() == [] and set(engine.take_failed()) == {f"r{i}"}
        assert not engine.has_unfinished_requests()
    engine.add_request(PROMPT, SamplingParams(max_tokens=4), request_id="last")
    with pytest.raises(RuntimeError, match="injected device fault"):
        engine.step()


# -- a KV pool smaller than the model's context -------------------------------------------------

LONG_CONTEXT = 131072
SMALL_POOL_BLOCKS = 8  # x 16 tokens = 128 tokens


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory, target_model) -> str:
    """A random model with a 128 Ki context and the target's tokenizer (skips where it is missing)."""
    from kvscale.worker.testing.tiny_model import build_tiny_model

    path = tmp_path_factory.mktemp("long-context")
    built = build_tiny_model(path, max_position_embeddings=LONG_CONTEXT, tokenizer_from=target_model, seed=3)
    return str(built)


@pytest.mark.parametrize("explicit", [False, True])
def test_small_pool_requests_without_max_tokens_run_to_the_pool(long_context_model, tmp_path, explicit):
    """Default max_model_len: lowered to the pool at start-up. An explicit one is kept, and requests
    without max_tokens are clipped to the pool (today both are a 400 for every chat request)."""
    flags = ["--max-model-len", str(LONG_CONTEXT)] if explicit else []
    server = start_server(long_context_model, tmp_path, "--num-kv-blocks", str(SMALL_POOL_BLOCKS), *flags)
    try:
        pool = SMALL_POOL_BLOCKS * 16
        c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert c.models.list().data[0].model_extra["max_model_len"] == (LONG_CONTEXT if explicit else pool)
        r = c.chat.completions.create(
            model=long_context_model, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == pool, r.usage
        chunks = list(
            c.chat.completions.create(
                model=long_context_model,
                messages=MESSAGES,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks[-1].usage.total_tokens == pool
        r = c.completions.create(
            model=long_context_model, prompt=PROMPT, max_tokens=None, extra_body={"ignore_eos": True}
        )
        assert r.usage.total_tokens == pool
        # The whole log: the line is from start-up, and log() keeps only the tail.
        assert (
            "cannot hold one sequence" if explicit else "max_model_len lowered from 131072 to 128"
        ) in server.log_path.read_text()
    finally:
        assert server.stop() == 0, server.log()


def test_offline_api_lowers_max_model_len_to_the_pool(long_context_model, caplog):
    with caplog.at_level(logging.WARNING):
        llm = LLM(long_context_model, num_kv_blocks=SMALL_POOL_BLOCKS)
    assert llm.engine.max_model_len == SMALL_POOL_BLOCKS * 16
    assert "max_model_len lowered from 131072" in caplog.text
    [out] = llm.generate(PROMPT, SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == SMALL_POOL_BLOCKS * 16


def test_fit_max_model_len() -> None:
    assert fit_max_model_len(2048, 1024, 16, explicit=False) == 2048
    assert fit_max_model_len(2048, 128, 16, explicit=False) == 2048
    assert fit_max_model_len(131072, 8, 16, explicit=False) == 128
    assert fit_max_model_len(131072, 8, 16, explicit=True) == 131072  # kept; requests clip to the pool


# -- the largest stop list costs the other streams nothing measurable ---------------------------


def test_stop_string_checks_look_only_at_a_bounded_tail(target_model, monkeypatch):
    """The cost model behind MAX_STOP x MAX_STOP_CHARS: per new token the detokenizer examines at
    most (new text + MAX_STOP_CHARS - 1) characters per stop string, however long the output is."""
    from transformers import AutoTokenizer

    from kvscale.worker.engine.detokenizer import IncrementalDetokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_model)
    stop = [(f"zq{i:02d}" * MAX_STOP_CHARS)[:MAX_STOP_CHARS] for i in range(MAX_STOP)]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), stop=stop)
    looked: list[int] = []
    real = IncrementalDetokenizer._suffix
    monkeypatch.setattr(IncrementalDetokenizer, "_suffix", lambda self, n: looked.append(n) or real(self, n))
    ids = tokenizer.encode("    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 200)[1:]
    longest_token = max(len(tokenizer.decode([t])) for t in ids)
    for token_id in ids:
        assert detok.update([token_id]) is None
        detok.get_next_output_text(finished=False, delta=True)
    assert len(detok.output_text) > 100 * MAX_STOP_CHARS
    assert max(looked) <= longest_token + MAX_STOP_CHARS - 1, max(looked)


def _median_step_seconds(llm: LLM, stop: list[str], num_streams: int, num_tokens: int) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    for i in range(num_streams):
        engine.add_request(PROMPT, params, request_id=f"other-{i}")
    engine.add_request(
        PROMPT, SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True, stop=stop)
    )
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    decode = sorted(times[2:])  # the prefill steps aside
    return decode[len(decode) // 2]


def _stop_check_seconds_per_token(tokenizer, ids: list[int], stop: list[str]) -> float:
    """Best of 5: a detokenizer's time per token (update + streamed text), with these stop strings."""
    from kvscale.worker.engine.detokenizer import IncrementalDetokenizer

    best = float("inf")
    for _ in range(5):
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), stop=stop)
        t = time.perf_counter()
        for token_id in ids:
            detok.update([token_id])
            detok.get_next_output_text(finished=False, delta=True)
        best = min(best, (time.perf_counter() - t) / len(ids))
    return best


def test_largest_stop_list_slows_other_streams_by_under_10_percent(target_model):
    """What one request with the largest stop list allowed (16 x 64 characters, never matching)
    adds to every step, the others' inter-token time: its extra detokenizer work per token, against
    the median step of 9 streams. Both are timed on this machine, so a busy neighbour stretches
    both; the A/B inter-token times (8 streams beside a 9th without, then with, the stop list;
    interleaved, best median per arm) are printed for docs/benchmarks.md but not asserted, being
    noise-dominated on a shared 2-core machine."""
    llm = LLM(target_model, num_kv_blocks=256)
    tokenizer = llm.get_tokenizer()
    largest = [(f"zq{i:02d}" * MAX_STOP_CHARS)[:MAX_STOP_CHARS] for i in range(MAX_STOP)]
    ids = tokenizer.encode("    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 20)[1:]
    extra = _stop_check_seconds_per_token(tokenizer, ids, largest) - _stop_check_seconds_per_token(
        tokenizer, ids, []
    )
    arms: dict[str, list[float]] = {"no_stop": [], "largest_stop_list": []}
    _median_step_seconds(llm, [], 8, 8)  # warm-up
    for _ in range(2):
        arms["no_stop"].append(_median_step_seconds(llm, [], 8, 32))
        arms["largest_stop_list"].append(_median_step_seconds(llm, largest, 8, 32))
    step = min(arms["no_stop"])
    print(
        json.dumps(
            {
                "stop_check_extra_s_per_step": extra,
                "median_step_s": step,
                "cost_ratio": round(1 + extra / step, 4),
                "ab_median_itl_s": {k: min(v) for k, v in arms.items()},
                "ab_ratio": round(min(arms["largest_stop_list"]) / step, 4),
            }
        )
    )
    assert extra < 0.10 * step, (extra, step)


# -- a stuck engine thread fails liveness --------------------------------------------------------


def complete_in_background(base_url: str, **request) -> threading.Thread:
    """A completion sent from a daemon thread (it may wait on a stuck engine); the thread, started."""
    c = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    thread = threading.Thread(target=c.completions.create, kwargs=request, daemon=True)
    thread.start()
    return thread


def assert_health_turns_stuck(base_url: str, why_not: str) -> None:
    """/health turns 500 {"status": "stuck"} within 30 s (the tests' timeout is 1 s)."""
    deadline, status, body = time.monotonic() + 30, 200, b""
    while status == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
        status, _, body = raw(base_url, "/health")
    assert status == 500, why_not
    assert json.loads(body) == {"status": "stuck"}


def test_engine_stuck_is_a_loop_pass_outliving_the_timeout() -> None:
    assert not engine_stuck(None, now=100.0, timeout=60.0)  # idle, waiting for work
    assert not engine_stuck(50.0, now=100.0, timeout=60.0)
    assert engine_stuck(30.0, now=100.0, timeout=60.0)
    assert not engine_stuck(0.0, now=100.0, timeout=0.0)  # 0: the check is off


def test_health_fails_while_the_engine_thread_is_stuck_and_recovers(target_model, monkeypatch):
    """A step that never returns (a hung kernel, a deadlock) leaves the process serving HTTP; only
    /health turning red lets the kubelet's liveness probe restart the pod."""
    release = threading.Event()
    real = ModelRunner.launch

    def launch(self, scheduled):
        if any(r.sampling_params.seed == FAULTY_SEED for r in scheduled.requests):
            release.wait(120)
        return real(self, scheduled)

    monkeypatch.setattr(ModelRunner, "launch", launch)
    config = ServerConfig(engine_iteration_timeout=1.0)
    with in_process_server(target_model, server_config=config, num_kv_blocks=64) as (base_url, llm):
        assert raw(base_url, "/health")[0] == 200
        stuck = complete_in_background(
            base_url, model=target_model, prompt=PROMPT, max_tokens=2, seed=FAULTY_SEED
        )
        try:
            assert_health_turns_stuck(base_url, "/health stayed green with the engine thread stuck")
        finally:
            release.set()
        stuck.join(60)
        deadline = time.monotonic() + 30
        while raw(base_url, "/health")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert raw(base_url, "/health")[0] == 200 and llm.dead is None


def test_health_fails_while_the_engine_thread_hangs_outside_a_step(target_model, monkeypatch):
    """Stuck is stuck wherever the engine loop hangs: here taking a new request off the command
    queue never returns, with no step running (a check timing only steps stays green)."""
    release = threading.Event()
    real = LLMEngine.add_prepared

    def add_prepared(self, parent):
        if any(c.sampling_params.seed == FAULTY_SEED for c in parent.children):
            release.wait(120)
        return real(self, parent)

    monkeypatch.setattr(LLMEngine, "add_prepared", add_prepared)
    config = ServerConfig(engine_iteration_timeout=1.0)
    with in_process_server(target_model, server_config=config, num_kv_blocks=64) as (base_url, _llm):
        stuck = complete_in_background(
            base_url, model=target_model, prompt=PROMPT, max_tokens=2, seed=FAULTY_SEED
        )
        try:
            assert_health_turns_stuck(base_url, "/health green: engine stuck between steps")
        finally:
            release.set()
        stuck.join(60)


class _LostWakeUp:
    """An Event whose set() never reaches the engine thread: the thread sleeps on while work waits
    (until release())."""

    def __init__(self) -> None:
        self._never = threading.Event()

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        return self._never.wait(timeout)

    def release(self) -> None:
        self._never.set()


def test_health_fails_while_the_engine_thread_sleeps_on_work_it_never_takes(target_model):
    """A thread hung while idle never starts a loop pass; the adds it does not take show it."""
    config = ServerConfig(engine_iteration_timeout=1.0)
    with in_process_server(target_model, server_config=config, num_kv_blocks=64) as (base_url, llm):
        deadline = time.monotonic() + 30
        while llm.busy_since is not None and time.monotonic() < deadline:  # idle after warm-up
            time.sleep(0.05)
        real_wake, lost = llm._wake, _LostWakeUp()
        llm._wake = lost
        waiting = complete_in_background(base_url, model=target_model, prompt=PROMPT, max_tokens=2)
        try:
            assert_health_turns_stuck(base_url, "/health green: an add waits on a sleeping engine")
        finally:
            llm._wake = real_wake
            lost.release()  # whichever of the two the thread sleeps on
            real_wake.set()
        waiting.join(60)
        assert raw(base_url, "/health")[0] == 200


def test_shutdown_gives_up_on_a_stuck_engine_thread(target_model, monkeypatch):
    """SIGTERM on a worker whose engine thread hangs still exits (after the drain), instead of
    waiting for the kubelet's SIGKILL at the end of the grace period."""
    release, entered = threading.Event(), threading.Event()
    real = ModelRunner.launch

    def launch(self, scheduled):
        if any(r.sampling_params.seed == FAULTY_SEED for r in scheduled.requests):
            entered.set()
            release.wait(120)
        return real(self, scheduled)

    monkeypatch.setattr(ModelRunner, "launch", launch)

    threads: list[threading.Thread] = []

    async def main() -> float:
        llm = AsyncLLM(EngineArgs(model=target_model, num_kv_blocks=64), target_model)
        await llm.start()
        params = SamplingParams(max_tokens=2, seed=FAULTY_SEED)
        gen = llm.generate(PROMPT, params, request_id="stuck")
        waiter = asyncio.create_task(anext(aiter(gen)))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 60)
        t0 = time.monotonic()
        await llm.shutdown(timeout=1.0)
        took = time.monotonic() - t0
        waiter.cancel()
        threads.append(llm._thread)
        return took

    # The hang ends after 20 s at the latest, so a shutdown that waits for it fails, not hangs.
    timer = threading.Timer(20.0, release.set)
    timer.start()
    try:
        took = asyncio.run(main())
    finally:
        release.set()
        timer.cancel()
        for thread in threads:  # let the released engine thread end before the test does
            thread.join(30)
    assert took < 5.0, f"shutdown waited {took:.1f} s for a stuck engine thread"
