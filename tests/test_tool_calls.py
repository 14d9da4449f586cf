"""Tool calls out of generated text (no model, no torch): the Hermes parser, named and required
calls; streamed in arbitrary chunkings, the deltas assemble (as OpenAI's client does) into the same
calls as the whole text gives, and nothing sent is taken back. The Hermes parser loses no text (a
block that is not a call is content), never returns arguments that are not a JSON object, and
costs linear time in the text however it is chunked."""

from __future__ import annotations

import itertools
import json
import random

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscale.worker.server.tool_calls import (
    NamedFunctionExtractor,
    RequiredExtractor,
    ToolCallStream,
    finish_reason,
    required_calls_schema,
)
from kvscale.worker.server.tool_parsers import HermesExtractor

HERMES_OUTPUT = (
    "Let me look both up.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <b>", "days": 12, '
    '"units": {"t": "C", "w": [1.5, -2e3, true, null]}, "note": "a \\"quote\\" }]"}}\n</tool_call>\n'
    '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
)
HERMES_CALLS = [
    (
        "get_weather",
        {
            "city": "Paris <b>",
            "days": 12,
            "units": {"t": "C", "w": [1.5, -2e3, True, None]},
            "note": 'a "quote" }]',
        },
    ),
    ("now", {}),
]


def whole(extractor, text: str):
    stream = ToolCallStream(extractor)
    stream.update(text, final=True)
    return stream.result()


def chunks(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def streamed(extractor, text: str, seed: int | None = None, cuts: list[int] | None = None):
    """Feeds the text in random chunks and assembles the deltas the way OpenAI's client does."""
    if cuts is None:
        rng = random.Random(seed)
        k = min(len(text) - 1, rng.randint(1, 40))
        cuts = rng.sample(range(1, len(text)), k=k) if k > 0 else []
    stream = ToolCallStream(extractor)
    content, calls = "", {}
    parts = chunks(text, cuts)
    for n, part in enumerate(parts):
        delta, tool_deltas = stream.update(part, final=n == len(parts) - 1)
        content += delta
        for d in tool_deltas:
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert call["id"] is None, "a call's id and name come once, in its first delta"
                call["id"], call["name"] = d["id"], d["function"]["name"]
            call["arguments"] += d["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def test_hermes_whole_text() -> None:
    content, calls = whole(HermesExtractor(), HERMES_OUTPUT)
    assert content.strip() == "Let me look both up."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == HERMES_CALLS
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("seed", range(40))
def test_hermes_streamed_in_any_chunking_assembles_into_the_same_calls(seed) -> None:
    content, calls = streamed(HermesExtractor(), HERMES_OUTPUT, seed)
    want_content, want_calls = whole(HermesExtractor(), HERMES_OUTPUT)
    assert content.strip() == want_content.strip()
    assert "<tool" not in content  # a tag's first characters are held back, never sent as content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in want_calls
    ]


def test_hermes_text_without_calls_is_content_and_a_lone_tag_start_is_sent_at_the_end() -> None:
    assert whole(HermesExtractor(), "x < y <tool") == ("x < y <tool", [])
    stream = ToolCallStream(HermesExtractor())
    assert stream.update("x <tool", final=False) == ("x ", [])
    assert stream.update("", final=True) == ("<tool", [])


def test_a_hermes_call_goes_out_whole_once_its_block_closes() -> None:
    # Its arguments are only known to be valid JSON then: nothing of it is sent before.
    stream = ToolCallStream(HermesExtractor())
    assert stream.update('<tool_call>{"name": "f", "arguments": {"a": [1, "xy', final=False) == ("", [])
    _, deltas = stream.update('z"]}}</tool_call>', final=True)
    assert deltas == [{"index": 0, "id": stream.calls[0].id, "type": "function",
                       "function": {"name": "f", "arguments": '{"a": [1, "xyz"]}'}}]  # fmt: skip


# Each failed on the old parser: an extra brace gave content null and no calls (the text lost), a
# missing one returned `{"a": 1` as arguments, deep nesting raised RecursionError (a 500).
@pytest.mark.parametrize(
    "body",
    [
        '{"name": "f", "arguments": {"a": 1}}}',  # an extra brace
        '{"name": "f", "arguments": {"a": 1}',  # a missing one
        '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}",  # past the parser's depth
        '{"name": "f", "arguments": [1, 2]}',  # not an object
        '{"name": 7, "arguments": {}}',  # no string name
        "not json at all",
    ],
)
def test_a_hermes_block_that_is_not_a_call_comes_back_as_content(body) -> None:
    text = f"Sure.\n<tool_call>{body}</tool_call>\nDone."
    assert whole(HermesExtractor(), text) == (text, [])
    stream = ToolCallStream(HermesExtractor())
    assert finish_reason("stop", stream) == "stop"
    content, calls = streamed(HermesExtractor(), text, seed=len(body))
    assert (content, calls) == (text, [])


def test_hermes_arguments_are_always_a_json_object_string() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'  # a string holding the object
        '<tool_call>{"name": "b", "parameters": {"y": [2]}}</tool_call>'
        '<tool_call>{"name": "c"}</tool_call>'  # no arguments: it takes none
    )
    _, calls = whole(HermesExtractor(), text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("a", {"x": 1}), ("b", {"y": [2]}), ("c", {})
    ]  # fmt: skip


def test_an_unclosed_block_at_the_end_is_a_call_if_it_parses_else_content() -> None:
    _, calls = whole(HermesExtractor(), '<tool_call>{"name": "f", "arguments": {}}')
    assert [c["function"]["name"] for c in calls] == ["f"]
    text = 'ok <tool_call>{"name": "f", "arguments": {"a": '
    assert whole(HermesExtractor(), text) == (text, [])


def test_parallel_tool_calls_false_keeps_the_first_call_only() -> None:
    content, calls = whole(HermesExtractor(max_calls=1), HERMES_OUTPUT)
    assert content.strip() == "Let me look both up."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    _, calls = streamed(HermesExtractor(max_calls=1), HERMES_OUTPUT, seed=3)
    assert [c["name"] for c in calls] == ["get_weather"]


# -- properties over generated texts ----------------------------------------------------------
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
_arguments = st.dictionaries(st.text(max_size=6), _json_values, max_size=4)
_names = st.from_regex(r"[a-z_]{1,12}", fullmatch=True)
_prose = st.lists(
    st.sampled_from([*'ab <>/{}"\n_', "<tool", "<tool_call", "</tool_call", "<tool_call>"]), max_size=12
).map("".join)


@st.composite
def _blocks(draw) -> str:
    name, args = draw(_names), draw(_arguments)
    body = json.dumps({"name": name, "arguments": args}, indent=draw(st.sampled_from([None, 1])))
    broken = draw(st.sampled_from(["", "extra", "missing", "garbage"]))
    body = {"": body, "extra": body + "}", "missing": body[:-1], "garbage": body + " x"}[broken]
    return f"<tool_call>{body}</tool_call>"


_texts = st.lists(st.one_of(_prose, _blocks()), max_size=6).map("".join)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=_texts, cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=30))
def test_hermes_loses_no_text_and_streams_what_the_whole_text_gives(text, cuts) -> None:
    extractor = HermesExtractor()
    stream = ToolCallStream(extractor)
    stream.update(text, final=True)
    content, calls = stream.result()
    # Nothing lost: the content is the text with the calls' blocks cut out, and each block holds
    # its call.
    rest, pos = [], 0
    for (start, end, kept), call in zip(extractor.spans, calls, strict=True):
        assert kept
        rest.append(text[pos:start])
        pos = end
        block = text[start:end]
        assert block.startswith("<tool_call>")
        body = block.removeprefix("<tool_call>").removesuffix("</tool_call>")
        obj = json.loads(body)
        assert call["function"]["name"] == obj["name"]
        assert json.loads(call["function"]["arguments"]) == obj["arguments"]
    rest.append(text[pos:])
    assert (content or "") == "".join(rest) or (content is None and not "".join(rest).strip())
    got_content, got_calls = streamed(HermesExtractor(), text, cuts=[c for c in cuts if c < len(text)])
    assert got_content == "".join(rest)
    assert [(c["name"], c["arguments"]) for c in got_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    items=st.lists(st.tuples(_names, _arguments), min_size=1, max_size=3),
    indent=st.sampled_from([None, 1]),
    cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=30),
)
def test_required_and_named_calls_stream_what_the_whole_text_gives(items, indent, cuts) -> None:
    text = json.dumps([{"name": n, "arguments": a} for n, a in items], indent=indent)
    _, want = whole(RequiredExtractor(), text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want] == items
    content, got = streamed(RequiredExtractor(), text, cuts=[c for c in cuts if c < len(text)])
    assert content == ""
    assert [(g["name"], g["arguments"]) for g in got] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in want
    ]
    args_text = json.dumps(items[0][1], indent=indent)
    _, want = whole(NamedFunctionExtractor("f"), args_text)
    assert json.loads(want[0]["function"]["arguments"]) == items[0][1]
    cuts = [c for c in cuts if c < len(args_text)]
    _, got_calls = streamed(NamedFunctionExtractor("f"), args_text, cuts=cuts)
    assert [g["arguments"] for g in got_calls] == [want[0]["function"]["arguments"]]


def test_named_or_required_text_cut_off_is_content_not_a_call() -> None:
    # The grammar did not finish (max_tokens): the non-streamed answer has no invalid arguments.
    cut_off = [
        (NamedFunctionExtractor("f"), '{"a": [1, "x'),
        (RequiredExtractor(), '[{"name": "f", "arguments": {"a": 1}}, {"name"'),
    ]
    for extractor, text in cut_off:
        stream = ToolCallStream(extractor)
        stream.update(text, final=True)
        assert stream.result() == (text, [])
        assert finish_reason("length", stream) == "length"


def _cost_of_streaming(make, words: int) -> tuple[int, int]:
    """(characters scanned, length of the text) for a call of `words` words fed a token (3
    characters) at a time."""
    args = {"text": "word " * words, "list": list(range(words // 4))}
    call = json.dumps({"name": "f", "arguments": args})
    text = {HermesExtractor: f"<tool_call>{call}</tool_call>", RequiredExtractor: f"[{call}]"}.get(
        make, json.dumps(args)
    )
    extractor = make()
    stream = ToolCallStream(extractor)
    for i in range(0, len(text), 3):
        stream.update(text[i : i + 3], final=i + 3 >= len(text))
    _, calls = stream.result()
    assert json.loads(calls[0]["function"]["arguments"]) == args
    return extractor.chars_scanned, len(text)


@pytest.mark.parametrize("make", [HermesExtractor, RequiredExtractor, lambda: NamedFunctionExtractor("f")])
def test_streamed_calls_cost_linear_time_in_their_length(make) -> None:
    # The old parser re-read the whole text at each delta: quadratic (~n^2/6 characters for n
    # here). Now a delta costs what it carries plus a tag's length: twice the text, twice the work.
    small, _ = _cost_of_streaming(make, 2000)
    large, n2 = _cost_of_streaming(make, 4000)
    assert large <= 2.1 * small
    assert large <= 8 * n2


SCHEMA = {
    "type": "object",
    "properties": {"q": {"type": "string"}, "n": {"type": "integer", "minimum": 0}},
    "required": ["q"],
}


@pytest.mark.parametrize("seed", range(10))
def test_named_function_text_is_its_arguments(seed) -> None:
    text = '{"q": "a b", "n": 42}'
    content, calls = streamed(NamedFunctionExtractor("search"), text, seed)
    assert content == "" and [c["name"] for c in calls] == ["search"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMA)
    _, want = whole(NamedFunctionExtractor("search"), text)
    assert calls[0]["arguments"] == want[0]["function"]["arguments"]


@pytest.mark.parametrize("seed", range(10))
def test_required_calls_are_an_array_of_name_and_arguments(seed) -> None:
    text = '[{"name": "search", "arguments": {"q": "x"}}, {"name": "now", "arguments": {}}]'
    content, calls = streamed(RequiredExtractor(), text, seed)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("search", {"q": "x"}), ("now", {})]


def test_required_schema_accepts_calls_of_the_tools_only() -> None:
    schema = required_calls_schema([("search", SCHEMA), ("now", None)], parallel=True)
    good = [{"name": "search", "arguments": {"q": "x"}}, {"name": "now", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "search", "arguments": {}}], [{"name": "now", "arguments": {"x": 1}}],
                [{"name": "other", "arguments": {}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_calls_schema([("now", None)], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "arguments": {}}] * 2, single)


def test_finish_reason_is_tool_calls_only_after_calls_that_stopped() -> None:
    stream = ToolCallStream(NamedFunctionExtractor("f"))
    assert finish_reason("stop", stream) == "stop"
    stream.update("{}", final=True)
    assert finish_reason("stop", stream) == "tool_calls"
    assert finish_reason("length", stream) == "length"
