"""Tool calls out of generated text (no model, no torch): the Hermes parser, named and required
calls; streamed in arbitrary chunkings, the deltas assemble (as OpenAI's client does) into the same
calls as the whole text gives, and nothing sent is taken back."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

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


def streamed(extractor, text: str, seed: int):
    """Feeds the text in random chunks and assembles the deltas the way OpenAI's client does."""
    rng = random.Random(seed)
    stream = ToolCallStream(extractor)
    content, calls = "", {}
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 40))))
    for end in [*cuts, len(text)]:
        delta, tool_deltas = stream.update(text[:end], final=end == len(text))
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
    assert stream.update("x <tool", final=True) == ("<tool", [])


def test_a_call_cut_off_streams_only_what_is_final() -> None:
    stream = ToolCallStream(HermesExtractor())
    _, deltas = stream.update('<tool_call>{"name": "f", "arguments": {"a": [1, "xy', final=False)
    assert deltas == [{"index": 0, "id": stream.calls[0].id, "type": "function",
                       "function": {"name": "f", "arguments": '{"a": [1'}}]  # fmt: skip
    _, deltas = stream.update('<tool_call>{"name": "f", "arguments": {"a": [1, "xyz"]}}', final=True)
    assert deltas == [{"index": 0, "function": {"arguments": ', "xyz"]}'}}]


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
