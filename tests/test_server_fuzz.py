"""Fuzzing the HTTP API (hypothesis, raw HTTP): whatever a client sends, the server never answers 5xx.

Every 4xx carries OpenAI's error shape, every 200 the shape of its endpoint (plain JSON or an SSE
stream ending in `data: [DONE]`), and no response holds non-standard JSON (NaN, Infinity). Bodies
are serialised by hand so they can carry what `json.dumps` never writes: raw `NaN` / `Infinity`
tokens, integers past Python's 4,300-digit limit, nesting past the parser's recursion limit,
lone surrogates, invalid UTF-8. Runs are derandomized, so CI sees the same examples every time.

Generated requests keep `max_tokens` small (<= 8) whenever they could be valid, so the whole file
stays around a minute on 2 cores, server start included.
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = [COMPLETIONS, CHAT]
VOCAB = 4096  # tiny-code-target
SMALL = 8  # the largest max_tokens any generated request may run with


def fuzz_settings(max_examples: int):
    return settings(
        max_examples=max_examples,
        derandomize=True,  # the same examples on every run: CI cannot flake on a new draw
        database=None,
        deadline=None,  # latency depends on the machine; only correctness is asserted
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


# -- raw HTTP ----------------------------------------------------------------------------------
@dataclass
class Response:
    status: int
    content_type: str
    data: bytes


def send(
    server, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> Response:
    conn = http_client(server)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return Response(r.status, r.getheader("Content-Type", ""), r.read())
    finally:
        conn.close()


def http_client(server) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)


def post(server, path: str, body: Any, ascii_only: bool = True) -> Response:
    return send(
        server,
        "POST",
        path,
        encode(body, ascii_only),
        {"Content-Type": "application/json"},
    )


# -- serialising anything ----------------------------------------------------------------------
@dataclass(frozen=True)
class Raw:
    """JSON text sent verbatim (what json.dumps will not write)."""

    text: str


RAW_TOKENS = [
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("1e400"),
    Raw("-1e400"),
    Raw("9" * 5000),  # past Python's 4,300-digit int limit
    Raw("-" + "9" * 5000),
    Raw("1" + "0" * 400),
    Raw("1E+2"),
    Raw("-0"),
    Raw("0." + "0" * 400 + "1"),
    Raw("[" * 5000 + "]" * 5000),  # past the parser's recursion limit
    Raw('{"a":' * 2000 + "1" + "}" * 2000),
]


def dumps(value: Any, ascii_only: bool = True) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        items = (
            json.dumps(k, ensure_ascii=ascii_only) + ":" + dumps(v, ascii_only) for k, v in value.items()
        )
        return "{" + ",".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(dumps(v, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)  # floats: NaN / Infinity as raw tokens


def encode(value: Any, ascii_only: bool = True) -> bytes:
    # A lone surrogate, written unescaped, becomes bytes that are not UTF-8.
    return dumps(value, ascii_only).encode("utf-8", errors="surrogatepass")


def strict_loads(data: bytes | str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"the response holds non-standard JSON: {constant}")

    return json.loads(data, parse_constant=refuse)


# -- response checks ---------------------------------------------------------------------------
def check_error(r: Response) -> dict[str, Any]:
    assert "application/json" in r.content_type, (r.status, r.content_type, r.data[:300])
    body = strict_loads(r.data)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str | int), err
    return err


def check_usage(usage: Any) -> dict[str, Any]:
    assert isinstance(usage, dict), usage
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert isinstance(usage[key], int) and usage[key] >= 0, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    return usage


@dataclass
class Result:
    num_choices: int
    usage: dict[str, Any] | None


def check_completion(r: Response, chat: bool) -> Result:
    assert "application/json" in r.content_type, r.content_type
    body = strict_loads(r.data)
    assert isinstance(body["id"], str) and isinstance(body["created"], int), body
    assert isinstance(body["model"], str), body
    assert body["object"] == ("chat.completion" if chat else "text_completion"), body
    choices = body["choices"]
    assert isinstance(choices, list) and choices, body
    assert sorted(c["index"] for c in choices) == list(range(len(choices))), choices
    for c in choices:
        assert c["finish_reason"] in ("stop", "length"), c
        assert "logprobs" in c, c
        if chat:
            assert c["message"]["role"] == "assistant", c
            assert isinstance(c["message"]["content"], str), c
        else:
            assert isinstance(c["text"], str), c
    return Result(len(choices), check_usage(body["usage"]))


def check_stream(r: Response, chat: bool) -> Result:
    text = r.data.decode()
    assert text.endswith("data: [DONE]\n\n"), text[-500:]
    events = text.split("\n\n")[:-2]  # drop [DONE] and the empty tail
    assert events, text
    finished: dict[int, int] = {}
    seen: set[int] = set()
    usage = None
    for n, line in enumerate(events):
        assert line.startswith("data: "), line
        chunk = strict_loads(line.removeprefix("data: "))
        assert "error" not in chunk, chunk  # a refusal must be a 4xx before the stream starts
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion"), chunk
        assert isinstance(chunk["id"], str) and isinstance(chunk["created"], int), chunk
        if not chunk["choices"]:  # the usage chunk: last, and only with include_usage
            assert n == len(events) - 1, events
            usage = check_usage(chunk["usage"])
            continue
        assert chunk.get("usage") is None, chunk
        for c in chunk["choices"]:
            assert isinstance(c["index"], int), c
            seen.add(c["index"])
            if chat:
                assert isinstance(c["delta"], dict), c
                assert isinstance(c["delta"].get("content", ""), str), c
            else:
                assert isinstance(c["text"], str), c
            if c["finish_reason"] is not None:
                assert c["finish_reason"] in ("stop", "length"), c
                finished[c["index"]] = finished.get(c["index"], 0) + 1
    assert seen == set(range(len(seen))), seen
    assert finished == dict.fromkeys(seen, 1), (finished, seen)  # each choice finishes exactly once
    return Result(len(seen), usage)


def check_post(r: Response, path: str) -> Result | None:
    """The invariant for any POST: 2xx with the endpoint's shape, or 4xx with OpenAI's error shape."""
    event(f"status {r.status}")  # --hypothesis-show-statistics tells how many got through validation
    assert r.status < 500, (r.status, r.data[:500])
    if r.status >= 400:
        check_error(r)
        return None
    assert r.status == 200, r.status
    chat = path == CHAT
    if "text/event-stream" in r.content_type:
        return check_stream(r, chat)
    return check_completion(r, chat)


# -- strategies --------------------------------------------------------------------------------
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
    "stream", "stream_options", "stop", "presence_penalty", "frequency_penalty", "seed", "user",
    "logit_bias", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "logprobs", "top_logprobs", "echo", "best_of",
    "suffix", "response_format", "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
    "role", "content", "type", "text", "include_usage", "name", "structured_outputs", "json_schema",
    "schema", "regex", "choice", "grammar", "json", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "prompt_logprobs", "chat_template_kwargs",
]  # fmt: skip

texts = st.text() | st.sampled_from(["", "\ud800", "\udfff", "\x00", "def f(x):", "é" * 50, "\U0001f600"])
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30, -1, 0])
    | st.floats(allow_nan=True, allow_infinity=True)
    | texts
    | st.sampled_from(RAW_TOKENS)
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), children, max_size=6)
    ),
    max_leaves=20,
)


def capped(body: Any) -> Any:
    """Whatever else a body holds, it may not ask for more than SMALL new tokens."""
    if isinstance(body, dict):
        body = {**body, "max_tokens": SMALL}
        body.pop("max_completion_tokens", None)
    return body


# Values a field may not take (wrong type, out of range, refused), and some odd ones it may.
HUGE = [2**31, 2**63, 2**70, -(2**63) - 1, Raw("9" * 5000)]
NONFINITE = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400")]
BAD_VALUES: dict[str, list[Any]] = {
    # no null and nothing in [9, limit): those are valid and would generate for long
    "max_tokens": [-1, 0, 2047, 4096, 1.5, "x", [], {}, [4], *HUGE, *NONFINITE, -(2**70)],
    "max_completion_tokens": [None, -1, 0, 2047, 4096, 2.5, "x", [3], *HUGE, *NONFINITE],
    "temperature": [-1, -1e-9, 2.0001, 3, "hot", None, [], 1e-300, 5e-324, *NONFINITE],
    "top_p": [0, -0.1, 1.01, 1e-300, "1", None, *NONFINITE],
    "n": [0, -1, 129, 128, 1.5, "two", None, True, *HUGE],
    "stop": [123, [1, 2], [""], "", [None], {"a": 1}, ["x"] * 5, ["a" * 1000], ["\ud800"], True, []],
    "stop_token_ids": [[-1], [2**70], [1.5], "x", [None], [0], [2**62], 5],
    "seed": [-(2**63) - 1, 2**63, 2**64, -1, 1.5, "1", Raw("9" * 5000), None],
    "stream": ["yes", 2, None, [], True],
    "stream_options": [{"include_usage": "x"}, {"include_usage": True}, [], "x", {"unknown": 1}, None],
    "logit_bias": [{"1": 5}, {"x": "y"}, [], {"1": Raw("NaN")}, {}],
    "top_k": [-2, 2**70, 1.5, "3", 10**6, -1],
    "min_p": [-0.1, 1.1, 1.0, *NONFINITE],
    "repetition_penalty": [0, -1, 1e-300, 1e300, *NONFINITE],
    "presence_penalty": [-2.1, 2.1, *NONFINITE],
    "frequency_penalty": [-2.1, 2.1, *NONFINITE],
    "min_tokens": [-1, SMALL + 1, 2**70, "1"],
    "model": [5, "nope", "", None, ["x"], "\ud800"],
    "echo": ["x", 2, None, []],
    "ignore_eos": ["x", 2, None, [], True],
    "skip_special_tokens": ["x", 2, None, False],
    "include_stop_str_in_output": ["x", None, True],
    "best_of": [0, 3, "x", None],
    "suffix": ["x", 5, ""],
    "user": [5, {}, None],
    "prompt": [
        "", [], [[]], [-1], [VOCAB], [2**31], [2**70], [[1, -1]], [[[1]]], [1, [2]], ["a", 1], [""],
        None, 5, {"a": 1}, [True], "\ud800", ["\ud800"], [[0] * 3000], "x" * 20000, ["a"] * 300,
        [1.5], ["a", [1]], [Raw("NaN")],
    ],
    "messages": [
        [], None, "hi", [None], [{}], [{"role": "wizard", "content": "x"}], [{"role": "user"}],
        [{"content": "x"}], [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": ["x"]}],
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        [{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}],
        [{"role": "user", "content": "\ud800"}], [{"role": "user", "content": "x" * 20000}],
        [{"role": "system", "content": None}], [{"role": "tool", "content": "x", "tool_call_id": 1}],
        [{"role": "user", "content": {"type": "text", "text": "x"}}], [{"role": None, "content": "x"}],
        [{"role": "user", "content": "x", "name": 5}],
        [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
          "function": {"name": "f", "arguments": "{not json"}}]}, {"role": "tool", "content": "1",
          "tool_call_id": "c"}],
        [{"role": "assistant", "tool_calls": "x"}], [{"role": "tool", "content": "1"}],
    ],
    "logprobs": [-1, 21, 2**70, "5", 1.5, None, True, 5],
    "top_logprobs": [-1, 21, 5, "x", 2**70],
    "response_format": [
        {"type": "json_object"}, {"type": 5}, {}, "text", {"type": "text"}, [], {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "maximum": 9}}},
        {"type": "json_schema", "json_schema": {"schema": {}}}, {"type": "text", "json_schema": {}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
    ],
    "structured_outputs": [
        {"regex": "[a-z"}, {"json": {"uniqueItems": True}}, {}, {"choice": []}, {"grammar": 5}, "x",
        {"json_object": True}, {"regex": "a", "choice": ["a"]}, {"structural_tag": {}},
        {"choice": ["a"] * 300},
        {"json": "{not json"}, {"json": {"$ref": "http://x"}}, {"grammar": 'root ::= "a" | "b"'},
        {"grammar": "start: /[0-9]+/"}, {"regex": "(?<=a)b"}, {"json_object": False},
    ],
    "guided_json": [{"oneOf": [{}]}, "x", 5, {"type": "integer", "maximum": 3, "minimum": 0}, True, []],
    "guided_regex": ["(", "", 5, "[0-9]", "\\"],
    "guided_choice": [[], [""], [5], "a", ["a"] * 300, ["yes"], ["\ud800"]],
    "guided_grammar": ["root ::= x", "", "start: 5", 'root ::= "a"', "::="],
    "guided_whitespace_pattern": [" ", None],
    "guided_decoding_backend": ["outlines", "xgrammar", 5],
    "tools": [
        [{"type": "function"}], {}, "x", [], [{"type": "function", "function": {"name": "f"}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"uniqueItems": True}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}] * 200,
        [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
    ],
    "tool_choice": ["auto", {"x": 1}, 5, "required", "none", {"type": "function", "function": {"name": "f"}}],
    "parallel_tool_calls": [1, "x", False, None],
    "add_generation_prompt": ["x", 2, None, False],
    "prompt_logprobs": [-1, 21, "x", 1.5, True, 2**70, 0, 3],
    "chat_template_kwargs": [{"tools": 1}, {"messages": []}, "x", [], {"enable_thinking": False},
                             {str(i): i for i in range(40)}],
}  # fmt: skip
COMMON = [f for f in BAD_VALUES if f not in ("prompt", "messages", "echo", "best_of", "suffix")]
ENDPOINT_FIELDS = {
    COMPLETIONS: [*COMMON, "prompt", "echo", "best_of", "suffix"],
    CHAT: [*COMMON, "messages"],
}
SMALL_JSON = st.recursive(scalars, lambda c: st.lists(c, max_size=3), max_leaves=4)


def could_be_a_count(value: Any) -> bool:
    """Whether pydantic may read `value` as an int (e.g. "100", 100.0), i.e. a valid, long max_tokens."""
    if isinstance(value, bool | int):
        return True
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return False
        return True
    return False


def bad_value(field: str) -> st.SearchStrategy:
    values = st.sampled_from(BAD_VALUES[field])
    if field == "max_tokens":  # never null either: it means "up to the context limit"
        return values | SMALL_JSON.filter(lambda v: v is not None and not could_be_a_count(v))
    if field == "max_completion_tokens":  # null is fine: max_tokens (small) applies
        return values | SMALL_JSON.filter(lambda v: not could_be_a_count(v))
    return values | SMALL_JSON


def valid_base(path: str) -> st.SearchStrategy:
    extras = st.fixed_dictionaries(
        {}, optional={"stream": st.booleans(), "temperature": st.sampled_from([0, 0.8]), "n": st.just(2)}
    )
    if path == COMPLETIONS:
        first = {
            "prompt": st.sampled_from(["def f(x):", [0, 486, 291], ["a", "b"]]),
            "max_tokens": st.just(4),
        }
    else:
        first = {"messages": st.just([{"role": "user", "content": "hi"}]), "max_tokens": st.just(4)}
    return st.tuples(st.fixed_dictionaries(first), extras).map(lambda t: {**t[0], **t[1]})


@st.composite
def mutated(draw, path: str) -> dict[str, Any]:
    body = draw(valid_base(path))
    fields = draw(st.lists(st.sampled_from(ENDPOINT_FIELDS[path]), min_size=1, max_size=3, unique=True))
    for field in fields:
        if field != "max_tokens" and draw(st.integers(0, 9)) == 0:
            body.pop(field, None)  # a missing field (required or not)
        else:
            body[field] = draw(bad_value(field))
    return body


PROMPTS = ["def f(x):", "import os\n", "class A:\n    ", "", "x = [", "# é ü 😀\n"]
words = st.text(alphabet="abc ():\n_=", min_size=1, max_size=3)


@st.composite
def valid_request(draw, path: str) -> tuple[dict[str, Any], int]:
    """A valid request with random sampling parameters, and the number of choices it asks for."""
    max_tokens = draw(st.integers(1, SMALL))
    body: dict[str, Any] = {
        "temperature": draw(st.none() | st.sampled_from([0.0, 2.0]) | st.floats(0.0, 2.0)),
        "top_p": draw(st.floats(0.01, 1.0)),
        "top_k": draw(st.sampled_from([-1, 0, 1, 5, 50, 5000])),
        "min_p": draw(st.floats(0.0, 1.0)),
        "presence_penalty": draw(st.floats(-2.0, 2.0)),
        "frequency_penalty": draw(st.floats(-2.0, 2.0)),
        "repetition_penalty": draw(st.floats(0.1, 3.0)),
        "n": draw(st.integers(1, 3)),
        "seed": draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
        "stop": draw(st.none() | words | st.lists(words, max_size=3)),
        "stop_token_ids": draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)),
        "ignore_eos": draw(st.booleans()),
        "min_tokens": draw(st.integers(0, max_tokens)),
        "include_stop_str_in_output": draw(st.booleans()),
        "skip_special_tokens": draw(st.booleans()),
        "stream": draw(st.booleans()),
    }
    body = {k: v for k, v in body.items() if draw(st.booleans()) or k in ("n", "stream")}
    if body["stream"] and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if path == COMPLETIONS:
        token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
        prompts = draw(
            st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=3)
            | st.lists(token_ids, min_size=1, max_size=3)
        )
        body["prompt"] = prompts[0] if len(prompts) == 1 else prompts
        body["max_tokens"] = max_tokens
        body["echo"] = draw(st.booleans())
        if draw(st.booleans()):
            body["logprobs"] = draw(st.integers(0, 5))
        return body, body["n"] * len(prompts)
    roles = st.sampled_from(["system", "developer", "user"])
    content = st.sampled_from(PROMPTS) | st.lists(
        st.builds(lambda t: {"type": "text", "text": t}, st.sampled_from(PROMPTS)), max_size=2
    )  # fmt: skip
    # Only an assistant message may leave its content out or null (OpenAI's rule).
    message = st.fixed_dictionaries({"role": roles, "content": content}) | st.fixed_dictionaries(
        {"role": st.just("assistant")}, optional={"content": st.none() | content}
    )
    body["messages"] = draw(st.lists(message, min_size=1, max_size=3))
    body["max_completion_tokens" if draw(st.booleans()) else "max_tokens"] = max_tokens
    if draw(st.booleans()):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 5))
    return body, body["n"]


# -- the tests ---------------------------------------------------------------------------------
# Our middleware's 500 path and a failed engine step.
UNEXPECTED = re.compile(r'"msg": "(unexpected error|engine step failed)"')


@pytest.fixture(scope="module")
def fuzz_server(server):
    """The session server; afterwards, its log may not hold an unexpected error from this module."""
    start = len(server.log_path.read_bytes())
    yield server
    with server.log_path.open("rb") as f:
        f.seek(start)
        new = f.read().decode(errors="replace")
    failures = [line[:2000] for line in new.splitlines() if UNEXPECTED.search(line)]
    assert not failures, "\n".join(failures[:5])


@pytest.mark.parametrize("path", ENDPOINTS)
@fuzz_settings(max_examples=300)
@given(body=json_values, ascii_only=st.booleans())
def test_arbitrary_json_bodies(fuzz_server, path, body, ascii_only):
    check_post(post(fuzz_server, path, capped(body), ascii_only), path)


@pytest.mark.parametrize("path", ENDPOINTS)
@fuzz_settings(max_examples=300)
@given(data=st.data())
def test_valid_requests_with_bad_fields(fuzz_server, path, data):
    body = data.draw(mutated(path))
    result = check_post(post(fuzz_server, path, body, data.draw(st.booleans())), path)
    if result is not None and result.usage is not None:
        assert result.usage["completion_tokens"] <= result.num_choices * SMALL, result


def test_known_bad_bodies(fuzz_server):
    """Each once, whatever hypothesis draws: the cases that once answered 500."""
    cases = [
        (COMPLETIONS, {"prompt": [[]], "max_tokens": 2}),
        (COMPLETIONS, {"prompt": [[]], "max_tokens": 2, "stream": True}),
        (COMPLETIONS, {"prompt": "\ud800", "max_tokens": 2}),
        (COMPLETIONS, {"prompt": ["ok", "\udfff"], "max_tokens": 2, "stream": True}),
        (COMPLETIONS, {"prompt": "a", "max_tokens": Raw("9" * 5000)}),
        (CHAT, Raw("[" * 100_000 + "]" * 100_000)),
    ]
    for path, body in cases:
        r = post(fuzz_server, path, body)
        assert r.status == 400, (body if not isinstance(body, Raw) else "raw", r.status, r.data[:300])
        check_error(r)
    r = send(fuzz_server, "POST", CHAT, b" " * (17 * 2**20), {"Content-Type": "application/json"})
    assert r.status == 413, (r.status, r.data[:300])  # over the server's 16 MiB client_max_size
    check_error(r)
    r = send(fuzz_server, "POST", CHAT, b"{}", {"Content-Type": "application/json; charset=nonexistent"})
    assert r.status == 400, (r.status, r.data[:300])
    check_error(r)
    r = send(fuzz_server, "POST", CHAT, b"\x1f\x8bgarbage", {"Content-Encoding": "gzip"})
    assert r.status == 400, (r.status, r.data[:300])
    check_error(r)


# The server runs aiohttp with auto_decompress=False (aiohttp 3.14.5 can hang on a deflate body that
# breaks only at its end): every encoded body reaches our handler undecoded and is refused there.
BAD_HEADERS = [
    {"Content-Type": "application/json"},
    {"Content-Type": "text/plain"},
    {},
    {"Content-Type": "application/json; charset=nonexistent"},
    {"Content-Type": "application/json; charset=utf-16"},
    {"Content-Type": "application/json; charset=latin-1"},
    {"Content-Type": "application/json", "Content-Encoding": "gzip"},
    {"Content-Type": "application/json", "Content-Encoding": "deflate"},
    {"Content-Type": "application/json", "Content-Encoding": "br"},
    {"Content-Type": "application/json", "Content-Encoding": "zstd"},
    {"Content-Type": "multipart/form-data; boundary=x"},
]


@pytest.mark.parametrize("path", ENDPOINTS)
@fuzz_settings(max_examples=150)
@given(
    raw=st.binary(max_size=300)
    | st.builds(
        lambda b: b'{"prompt": "' + b + b'", "messages": "' + b + b'", "max_tokens": 2}', st.binary()
    ),
    headers=st.sampled_from(BAD_HEADERS),
)
def test_raw_bytes(fuzz_server, path, raw, headers):
    r = send(fuzz_server, "POST", path, raw, headers)
    assert r.status < 500, (r.status, r.data[:500])
    if r.status >= 400:
        check_error(r)


@pytest.mark.parametrize("path", ENDPOINTS)
@fuzz_settings(max_examples=100)
@given(data=st.data())
def test_valid_requests(fuzz_server, path, data):
    body, num_choices = data.draw(valid_request(path))
    if body["stream"] and data.draw(st.integers(0, 4)) == 0:
        leave_early(fuzz_server, path, body)  # the client goes away mid-stream: its KV must come back
        return
    r = post(fuzz_server, path, body)
    assert r.status == 200, (body, r.status, r.data[:500])
    result = check_post(r, path)
    assert result is not None and result.num_choices == num_choices, (body, result)
    include_usage = body.get("stream_options", {}).get("include_usage", False)
    assert (result.usage is not None) == (include_usage or not body["stream"]), (body, result)
    if result.usage is not None:
        assert result.usage["completion_tokens"] <= num_choices * SMALL, result
        if body.get("ignore_eos") and not body.get("stop") and not body.get("stop_token_ids"):
            assert result.usage["completion_tokens"] == num_choices * body.get(
                "max_tokens", body.get("max_completion_tokens")
            ), (body, result)


def leave_early(server, path: str, body: dict[str, Any]) -> None:
    conn = http_client(server)
    try:
        conn.request("POST", path, body=encode(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.status
        r.fp.readline()  # the first event's data line, then hang up
    finally:
        conn.close()


GET_PATHS = ["/health", "/ready", "/metrics", "/v1/models", "/v1/completions", "/v1/nope", "/", "/v1/"]


@fuzz_settings(max_examples=150)
@given(
    path=st.sampled_from(GET_PATHS),
    query=st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=4).map(urllib.parse.urlencode)
    | st.text(alphabet="abc=&%+;?/#09fFzZ\x7f", max_size=30).map(
        lambda q: urllib.parse.quote(q, safe="=&%+;?/")
    ),
)
def test_get_with_random_query(fuzz_server, path, query):
    r = send(fuzz_server, "GET", f"{path}?{query}")
    assert r.status < 500, (path, query, r.status, r.data[:300])
    if path in ("/health", "/ready", "/metrics", "/v1/models"):
        assert r.status == 200, (path, query, r.status, r.data[:300])
    if path == "/v1/models":
        body = strict_loads(r.data)
        assert body["object"] == "list" and body["data"][0]["object"] == "model", body
    elif path.startswith("/v1/") and r.status >= 400 and "json" in r.content_type:
        check_error(r)


def kv_usage(server) -> float:
    status, data = server.get("/metrics")
    assert status == 200
    match = re.search(rb"^kvscale_kv_cache_usage_ratio(?:\{[^}]*\})? (\S+)$", data, re.M)
    assert match, data[:2000]
    return float(match.group(1))


def test_server_still_serves_and_frees_its_kv(fuzz_server):
    """Last in this module: after all of the above, a normal request works and no KV block is held."""
    r = post(fuzz_server, COMPLETIONS, {"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0})
    assert r.status == 200, r.data[:500]
    result = check_completion(r, chat=False)
    assert result.usage is not None and result.usage["completion_tokens"] == 4
    assert fuzz_server.proc.poll() is None, fuzz_server.log()
    deadline = time.monotonic() + 10
    while (usage := kv_usage(fuzz_server)) != 0.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert usage == 0.0, f"KV still held after every request ended: {usage}"
