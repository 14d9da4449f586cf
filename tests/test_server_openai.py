"""The OpenAI-compatible server driven by the real `openai` client: both endpoints, streaming, stop
sequences, sampling controls, and every error status in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from server_fixtures import start_server
from tokenizers import Tokenizer

PROMPT = "def fibonacci(n):\n"
MESSAGES = [{"role": "user", "content": "write a sort function"}]
ERROR_KEYS = {"message", "type", "param", "code"}


# -- helpers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(target_model) -> str:
    return target_model  # the shared server's default served name is its --model path


@pytest.fixture(scope="module")
def tokenizer(target_model) -> Tokenizer:
    """The raw tokenizer (not the server's code path): adds <s> and nothing else."""
    return Tokenizer.from_file(str(Path(target_model) / "tokenizer.json"))


def num_chat_tokens(tokenizer: Tokenizer, messages: list[dict]) -> int:
    """Renders the model's chat template (chat_template.jinja) by hand and counts its tokens."""
    text = "<s>" + "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def error_of(exc: pytest.ExceptionInfo, status: int) -> dict:
    """The error object of a failed call, after checking the status and OpenAI's exact shape."""
    e = exc.value
    assert e.status_code == status
    body = e.response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["message"]
    return body["error"]


def raw(base_url: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, body bytes) of a raw HTTP request; POST when there is a body."""
    req = urllib.request.Request(base_url + path, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def post_json(base_url: str, path: str, payload: object, **headers: str):
    return raw(base_url, path, json.dumps(payload).encode(), {"Content-Type": "application/json", **headers})


def stream_completion(client, **kwargs) -> list:
    return list(client.completions.create(stream=True, **kwargs))


def stream_chat(client, **kwargs) -> list:
    return list(client.chat.completions.create(stream=True, **kwargs))


def completion_text(chunks: list) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices)


def chat_text(chunks: list) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# -- completions -------------------------------------------------------------------------------


def test_completion_text_prompt_usage_matches_tokenizer(client, model, tokenizer):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    assert r.object == "text_completion" and r.model == model and r.id.startswith("cmpl-")
    [choice] = r.choices
    assert choice.index == 0 and choice.text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT).ids)
    assert r.usage.completion_tokens == len(choice.logprobs.tokens) == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_token_id_prompt_equals_text_prompt(client, model, tokenizer):
    ids = tokenizer.encode(PROMPT).ids
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_completion_list_of_prompts_gives_one_indexed_choice_each(client, model, tokenizer):
    prompts = [PROMPT, "import os\n"]
    r = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for prompt, choice in zip(prompts, r.choices, strict=True):
        alone = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        assert choice.text == alone.choices[0].text
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p).ids) for p in prompts)
    assert r.usage.completion_tokens == 12


def test_completion_echo_prepends_the_prompt(client, model):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage == plain.usage


def test_completion_logprobs_shape(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0
        assert len(top) == 2 and all(v <= 0.0 for v in top.values())
        # greedy: the chosen token is the most likely one
        assert top[token] == pytest.approx(logprob) == pytest.approx(max(top.values()))


def test_completion_finish_reason_length_at_max_tokens(client, model):
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


# -- chat --------------------------------------------------------------------------------------


def test_chat_message_role_and_usage(client, model, tokenizer):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == model and r.id.startswith("chatcmpl-")
    [choice] = r.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == num_chat_tokens(tokenizer, MESSAGES)
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_max_completion_tokens_bounds_the_completion(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_chat_logprobs_shape(client, model):
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.bytes == list(t.token.encode()) and t.logprob <= 0.0
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[1].logprob <= t.top_logprobs[0].logprob


def test_chat_content_as_text_parts_equals_string_content(client, model):
    parts = [{"type": "text", "text": "write a "}, {"type": "text", "text": "sort function"}]
    as_parts = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": parts}], max_tokens=8, temperature=0
    )
    as_string = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens


# -- streaming ---------------------------------------------------------------------------------


def test_completion_stream_matches_non_streamed_with_usage(client, model):
    args = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    full = client.completions.create(**args)
    chunks = stream_completion(client, stream_options={"include_usage": True}, **args)
    *content, last = chunks
    assert completion_text(chunks) == full.choices[0].text
    assert all(c.object == "text_completion" and c.usage is None for c in content)
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert last.choices == [] and last.usage == full.usage


def test_completion_stream_without_include_usage_has_no_usage_chunk(client, model):
    chunks = stream_completion(client, model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert all(c.choices and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_matches_non_streamed_with_usage(client, model):
    args = dict(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**args)
    chunks = stream_chat(client, stream_options={"include_usage": True}, **args)
    first, *content, last = chunks
    assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
    assert chat_text(chunks) == full.choices[0].message.content
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in [first, *content])
    assert all(c.choices[0].delta.role is None for c in content)
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert last.choices == [] and last.usage == full.usage


def test_chat_stream_without_include_usage_has_no_usage_chunk(client, model):
    chunks = stream_chat(client, model=model, messages=MESSAGES, max_tokens=6, temperature=0)
    assert all(c.choices and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def _stream_choices(chunks: list) -> dict[int, list]:
    by_index: dict[int, list] = {}
    for c in chunks:
        for ch in c.choices:
            by_index.setdefault(ch.index, []).append(ch)
    return by_index


@pytest.mark.parametrize("echo", [False, True])
def test_completion_stream_text_and_logprobs_equal_non_streamed(client, model, echo):
    """The stream's deltas (text, tokens, logprobs, running text_offset) add up to the plain
    response, for several prompts and n > 1, with a stop string that holds text back."""
    args = dict(
        model=model,
        prompt=[PROMPT, "import os\n"],
        max_tokens=24,
        temperature=0.8,
        seed=11,
        n=2,
        logprobs=2,
        stop=["\n\n"],
        echo=echo,
    )
    full = client.completions.create(**args)
    streamed = _stream_choices(stream_completion(client, **args))
    assert sorted(streamed) == [c.index for c in full.choices] == [0, 1, 2, 3]
    for want in full.choices:
        parts = streamed[want.index]
        assert "".join(p.text for p in parts) == want.text
        assert parts[-1].finish_reason == want.finish_reason
        got = [p.logprobs for p in parts if p.logprobs is not None]
        lp = want.logprobs
        assert [t for g in got for t in g.tokens] == lp.tokens
        # With echo, the prompt's tokens come first, the first of them without a logprob.
        assert (lp.token_logprobs[0] is None) == echo
        got_lps = [t for g in got for t in g.token_logprobs]
        assert [t is None for t in got_lps] == [t is None for t in lp.token_logprobs]
        assert [t for t in got_lps if t is not None] == pytest.approx(
            [t for t in lp.token_logprobs if t is not None], abs=1e-4
        )
        assert [t for g in got for t in g.text_offset] == lp.text_offset
        assert [sorted(t or {}) for g in got for t in g.top_logprobs] == [
            sorted(t or {}) for t in lp.top_logprobs
        ]


def test_chat_stream_text_and_logprobs_equal_non_streamed(client, model):
    args = dict(
        model=model,
        messages=MESSAGES,
        max_tokens=24,
        temperature=0.8,
        seed=5,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    full = client.chat.completions.create(**args)
    streamed = _stream_choices(stream_chat(client, **args))
    for want in full.choices:
        parts = streamed[want.index]
        assert "".join(p.delta.content or "" for p in parts) == want.message.content
        got = [t for p in parts if p.logprobs is not None for t in p.logprobs.content]
        assert [t.token for t in got] == [t.token for t in want.logprobs.content]
        assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want.logprobs.content], abs=1e-4)
        assert [t.bytes for t in got] == [t.bytes for t in want.logprobs.content]


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ],
)
def test_raw_stream_is_sse_ending_with_done(server, path, payload):
    body = {**payload, "max_tokens": 4, "temperature": 0, "stream": True}
    status, headers, data = post_json(server.base_url, path, body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = data.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert len(events) >= 3


# -- stop sequences ----------------------------------------------------------------------------


def pick_stop(text: str) -> tuple[str, str]:
    """A stop string from the middle of `text` and the text that must come back with it."""
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop, text
    return stop, text[: text.index(stop)]


def test_completion_stop_sequence_cuts_before_it(client, model):
    args = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    stop, expected = pick_stop(client.completions.create(**args).choices[0].text)
    r = client.completions.create(stop=[stop, "never-generated-\x07"], **args)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = stream_completion(client, stop=stop, **args)
    assert completion_text(chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"


def test_chat_stop_sequence_cuts_before_it(client, model):
    args = dict(model=model, messages=MESSAGES, max_tokens=24, temperature=0)
    stop, expected = pick_stop(client.chat.completions.create(**args).choices[0].message.content)
    r = client.chat.completions.create(stop=[stop], **args)
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    chunks = stream_chat(client, stop=[stop], **args)
    assert chat_text(chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"


# -- n / seed / temperature / max_tokens -------------------------------------------------------


def test_seeded_sampling_with_n_is_distinct_and_reproducible(client, model):
    args = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=1234)
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3
    assert [c.text for c in again.choices] == texts
    other_seed = client.completions.create(**{**args, "seed": 99})
    assert [c.text for c in other_seed.choices] != texts


def test_seeded_chat_with_n_is_reproducible(client, model):
    args = dict(model=model, messages=MESSAGES, max_tokens=8, temperature=1.0, n=2, seed=7)
    first = client.chat.completions.create(**args)
    again = client.chat.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]


def test_greedy_is_deterministic(client, model):
    args = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    texts = {client.completions.create(**args).choices[0].text for _ in range(3)}
    assert len(texts) == 1


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_bounds_completion_tokens(client, model, max_tokens):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=1.0, seed=3)
    assert 1 <= r.usage.completion_tokens <= max_tokens
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == max_tokens


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"suffix": "return x"}, "suffix"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"best_of": 2}, "best_of"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [0, 10**6]}, "prompt"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_completion_invalid_parameter_is_400_naming_it(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(**{"model": model, "prompt": PROMPT, "max_tokens": 4, **kwargs})
    error = error_of(exc, 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] is None


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"messages": []}, "messages"),
        ({"temperature": 2.5}, "temperature"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_chat_invalid_parameter_is_400_naming_it(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**{"model": model, "messages": MESSAGES, "max_tokens": 4, **kwargs})
    error = error_of(exc, 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'"a string"', b"\xff\xfe"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_or_non_object_body_is_400(server, path, body):
    status, _, data = raw(server.base_url, path, body, {"Content-Type": "application/json"})
    assert status == 400
    error = json.loads(data)["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error"


def test_prompt_over_max_model_len_is_context_length_exceeded(client, model):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt="x " * 2100, max_tokens=1)
    error = error_of(exc, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "2048" in error["message"]

    long_messages = [{"role": "user", "content": "x " * 2100}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=long_messages, max_tokens=1)
    error = error_of(exc, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


def test_prompt_plus_max_tokens_over_max_model_len_is_context_length_exceeded(client, model):
    for create, args in [
        (client.completions.create, {"prompt": PROMPT}),
        (client.chat.completions.create, {"messages": MESSAGES}),
    ]:
        with pytest.raises(openai.BadRequestError) as exc:
            create(model=model, max_tokens=2040, **args)
        error = error_of(exc, 400)
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"


def test_unknown_model_is_404_model_not_found(client):
    for create, args in [
        (client.completions.create, {"prompt": PROMPT}),
        (client.chat.completions.create, {"messages": MESSAGES}),
    ]:
        with pytest.raises(openai.NotFoundError) as exc:
            create(model="no-such-model", max_tokens=2, **args)
        error = error_of(exc, 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"


# -- models, probes, routes --------------------------------------------------------------------


def test_models_lists_the_served_name(client, model):
    [card] = client.models.list().data
    assert card.id == model and card.object == "model"
    assert card.model_extra["max_model_len"] == 2048


def test_probes_answer(server):
    assert server.get("/health")[0] == 200
    status, body = server.get("/ready")
    assert status == 200 and json.loads(body) == {"status": "ready"}
    status, body = server.get("/metrics")
    assert status == 200 and b"kvscale_requests_running" in body


def test_unknown_routes_are_404(server):
    assert server.get("/no-such-route")[0] == 404
    status, _, data = post_json(server.base_url, "/v1/no-such-route", {})
    assert status == 404 and set(json.loads(data)["error"]) == ERROR_KEYS
    status, headers, data = raw(server.base_url, "/v1/completions")  # GET on a POST route
    assert status == 405 and headers["Allow"] == "POST" and set(json.loads(data)["error"]) == ERROR_KEYS


# -- servers of our own: api key, queue limit --------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(target_model, tmp_path_factory):
    proc = start_server(
        target_model,
        tmp_path_factory.mktemp("keyed"),
        "--api-key",
        "secret",
        "--served-model-name",
        "keyed",
        "--num-kv-blocks",
        "256",
    )
    yield proc
    assert proc.stop() == 0, proc.log()


def test_api_key_required_on_v1_routes(keyed_server):
    url = keyed_server.base_url + "/v1"
    good = openai.OpenAI(base_url=url, api_key="secret", max_retries=0)
    assert [m.id for m in good.models.list().data] == ["keyed"]
    r = good.completions.create(model="keyed", prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2

    wrong = openai.OpenAI(base_url=url, api_key="not-the-key", max_retries=0)
    for call in (
        lambda: wrong.models.list(),
        lambda: wrong.completions.create(model="keyed", prompt=PROMPT, max_tokens=2),
        lambda: wrong.chat.completions.create(model="keyed", messages=MESSAGES, max_tokens=2),
    ):
        with pytest.raises(openai.AuthenticationError) as exc:
            call()
        error = error_of(exc, 401)
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"

    for path, body in [("/v1/models", None), ("/v1/completions", b'{"prompt": "x"}')]:
        status, _, data = raw(keyed_server.base_url, path, body, {"Content-Type": "application/json"})
        assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"


def test_probes_and_metrics_open_without_api_key(keyed_server):
    for path in ("/health", "/ready", "/metrics"):
        assert keyed_server.get(path)[0] == 200, path


@pytest.fixture(scope="module")
def queued_server(target_model, tmp_path_factory):
    """One sequence runs, at most two wait; the KV pool (64 blocks x 16 = 1024 tokens) is smaller
    than max_model_len (2048)."""
    proc = start_server(
        target_model,
        tmp_path_factory.mktemp("queued"),
        "--max-queued-requests",
        "2",
        "--max-num-seqs",
        "1",
        "--served-model-name",
        "queued",
        "--num-kv-blocks",
        "64",
    )
    yield proc
    assert proc.stop() == 0, proc.log()


def test_full_queue_is_429_with_retry_after(queued_server):
    async def fire(n: int) -> list:
        client = openai.AsyncOpenAI(base_url=queued_server.base_url + "/v1", api_key="x", max_retries=0)
        async with client:
            calls = [
                client.completions.create(
                    model="queued",
                    prompt=PROMPT,
                    max_tokens=64,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for _ in range(n)
            ]
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(fire(10))
    ok = [r for r in results if isinstance(r, openai.types.Completion)]
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(ok) + len(limited) == len(results), [r for r in results if r not in ok + limited]
    assert len(ok) >= 2 and limited
    assert all(r.usage.completion_tokens == 64 for r in ok)
    for e in limited:
        assert e.status_code == 429 and e.response.headers["Retry-After"] == "1"
        body = e.response.json()
        assert set(body["error"]) == ERROR_KEYS
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "rate_limit_exceeded"
    # the server recovers once the queue drains
    client = openai.OpenAI(base_url=queued_server.base_url + "/v1", api_key="x", max_retries=0)
    assert client.completions.create(model="queued", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("endpoint", "extra", "param", "fits"),
    [
        ("completions", {"n": 3}, "n", {"n": 2}),
        ("completions", {"prompt": [PROMPT, PROMPT], "n": 2}, "n", {"prompt": [PROMPT], "n": 2}),
        ("completions", {"prompt": [PROMPT, PROMPT, PROMPT]}, "prompt", {"prompt": [PROMPT, PROMPT]}),
        ("chat", {"n": 3}, "n", {"n": 2}),
    ],
)
def test_more_sequences_than_the_queue_holds_is_400_not_429(queued_server, endpoint, extra, param, fits):
    """The queue holds 2 sequences: 3 could never be admitted, even on this idle server, and a 429
    (with Retry-After) would be retried forever. 2 fit, so they are served."""
    client = openai.OpenAI(base_url=queued_server.base_url + "/v1", api_key="x", max_retries=0)
    if endpoint == "completions":
        body = {"model": "queued", "prompt": PROMPT, "max_tokens": 2, **extra}
        call = client.completions.create
    else:
        body = {"model": "queued", "messages": MESSAGES, "max_tokens": 2, **extra}
        call = client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as exc:
        call(**body)
    error = error_of(exc, 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "Retry-After" not in exc.value.response.headers
    assert "--max-queued-requests" in error["message"]
    assert len(call(**{**body, **fits}).choices) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_request_larger_than_kv_pool_is_400(queued_server, stream):
    """The pool holds 1024 tokens: start-up lowered max_model_len (2048) to that."""
    client = openai.OpenAI(base_url=queued_server.base_url + "/v1", api_key="x", max_retries=0)
    assert client.models.list().data[0].model_extra["max_model_len"] == 1024
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="queued", prompt=PROMPT, max_tokens=1500, stream=stream)
    error = error_of(exc, 400)
    assert error["code"] == "context_length_exceeded" and "1024" in error["message"]


def test_unbounded_non_streamed_answer_is_400_asking_for_a_stream(client, model):
    # 8 prompts x n=16 x 500 tokens x (1 + 20 logprobs) = 1.3M entries, past the default 2^20
    # (max_model_len 2048): before this change it was run and held to the end.
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt=[PROMPT] * 8, n=16, logprobs=20, max_tokens=500)
    error = error_of(exc, 400)
    assert error["param"] == "max_tokens" and "stream: true" in error["message"]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_does(client, model):
    # lm-eval's loglikelihood: echo the context + continuation with max_tokens 1 and read the
    # continuation's token logprobs. They must equal the logprobs of the same tokens generated.
    # Before this change echo + logprobs returned the generated token's logprobs only.
    gen = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    scored = client.completions.create(
        model=model, prompt=PROMPT + gen.choices[0].text, max_tokens=1, temperature=0, logprobs=2, echo=True
    )
    lp = scored.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    n_prompt = scored.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 1 and all(v <= 0 for v in lp.token_logprobs[1:])
    # The continuation's tokens sit after the context's (this text tokenizes the same way).
    context = gen.usage.prompt_tokens
    cont = lp.token_logprobs[context : context + 5]
    assert lp.tokens[context : context + 5] == gen.choices[0].logprobs.tokens
    assert cont == pytest.approx(gen.choices[0].logprobs.token_logprobs, abs=2e-3)


def test_prompt_logprobs_field_is_served(client, model):
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == r.usage.prompt_tokens and plp[0] is None
    for entry in plp[1:]:
        assert 1 <= len(entry) <= 3 and all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    plp = chat.model_extra["prompt_logprobs"]
    assert len(plp) == chat.usage.prompt_tokens and plp[0] is None and all(len(e) == 1 for e in plp[1:])


def test_prompt_logprobs_with_stream_is_400(client, model):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert error_of(exc, 400)["param"] == "prompt_logprobs"
