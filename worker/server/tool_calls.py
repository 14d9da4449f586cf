"""Tool calls out of generated text, as OpenAI's `tool_calls` (whole) and its streamed deltas.

Three ways text holds calls: `tool_choice` a named function (the text is that function's
arguments, the grammar made it so), `required` (a JSON array of `{"name", "arguments"}` objects,
the grammar made it so) and `auto` (the model's own format, read by a tool-call parser:
tool_parsers.py). Each is an extractor: accumulated text -> content so far and the calls so far,
their arguments partially parsed (partial-json-parser). `ToolCallStream` turns successive
snapshots into deltas the way OpenAI's client assembles them: a call's first delta carries its
index, id, type and name; then `function.arguments` fragments whose concatenation is the
arguments' JSON. A fragment is only ever the stable prefix of the partial arguments (containers
may be open, strings and numbers must be complete), so nothing sent is ever taken back, and the
streamed arguments equal the non-streamed ones.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import partial_json_parser
from partial_json_parser import Allow

# Only containers may be incomplete: a partial string or number (or true/null) is left out until
# it is whole, since its serialized form could still change.
_CONTAINERS = Allow.OBJ | Allow.ARR


def partial_json(text: str) -> Any:
    """The value a JSON prefix holds so far, or None when it holds nothing parseable yet."""
    text = text.strip()
    if not text:
        return None
    try:
        return partial_json_parser.loads(text, _CONTAINERS)
    except Exception:  # MalformedJSON and friends: not JSON (yet)
        return None


def whole_json(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass
class CallSnapshot:
    """One call as far as the text goes: its name once complete, its arguments parsed so far, and
    whether its JSON is complete (then its arguments are final)."""

    name: str | None
    arguments: Any
    complete: bool


class Extractor(Protocol):
    def snapshot(self, text: str, final: bool) -> tuple[str, list[CallSnapshot]]:
        """(content that can be sent, the calls so far) of the text generated so far. `final`: the
        text is all there is."""
        ...


class NamedFunctionExtractor:
    """`tool_choice: {"type": "function", "function": {"name"}}`: the whole text is the arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def snapshot(self, text: str, final: bool) -> tuple[str, list[CallSnapshot]]:
        ok, value = whole_json(text) if final else (False, None)
        return "", [CallSnapshot(self.name, value if ok else partial_json(text), ok)]


class RequiredExtractor:
    """`tool_choice: "required"`: the text is a JSON array of `{"name", "arguments"}` objects."""

    def snapshot(self, text: str, final: bool) -> tuple[str, list[CallSnapshot]]:
        ok, value = whole_json(text) if final else (False, None)
        items = value if ok else partial_json(text)
        if not isinstance(items, list):
            return "", []
        calls = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                continue
            # Items before the last are behind the parser: whole.
            complete = ok or i < len(items) - 1
            name = item.get("name") if isinstance(item.get("name"), str) else None
            calls.append(CallSnapshot(name, item.get("arguments"), complete))
        return "", calls


@dataclass
class _Call:
    id: str
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCallStream:
    """Per choice: accumulated text in, content and `tool_calls` deltas out (update), and the
    whole content and calls at the end (result)."""

    extractor: Extractor
    content: str = ""
    calls: list[_Call] = field(default_factory=list)

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content, snapshots = self.extractor.snapshot(text, final)
        content_delta = ""
        if content.startswith(self.content) and len(content) > len(self.content):
            content_delta, self.content = content[len(self.content) :], content
        deltas = []
        for index, snap in enumerate(snapshots):
            if snap.name is None:
                break  # calls are sent in order, each once its name is whole
            if index == len(self.calls):
                self.calls.append(_Call(id=f"call_{uuid.uuid4().hex[:24]}", name=snap.name))
                deltas.append(
                    {
                        "index": index,
                        "id": self.calls[index].id,
                        "type": "function",
                        "function": {"name": snap.name, "arguments": ""},
                    }
                )
            fragment = self._arguments_fragment(self.calls[index], snap)
            if fragment:
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += fragment
                else:
                    deltas.append({"index": index, "function": {"arguments": fragment}})
        return content_delta, deltas

    @staticmethod
    def _arguments_fragment(call: _Call, snap: CallSnapshot) -> str:
        if snap.arguments is None:
            return ""
        text = dumps(snap.arguments)
        if not snap.complete:
            # Open containers were closed by the parser: what precedes those closers is final.
            text = text.rstrip("]}")
        if not text.startswith(call.arguments) or len(text) <= len(call.arguments):
            return ""
        fragment, call.arguments = text[len(call.arguments) :], text
        return fragment

    def result(self) -> tuple[str | None, list[dict[str, Any]]]:
        """OpenAI's message fields: content (None when only whitespace) and tool_calls."""
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.calls
        ]
        return (self.content if self.content.strip() else None), calls


def finish_reason(reason: str | None, stream: ToolCallStream) -> str | None:
    """A choice that stopped after making calls finished for them (OpenAI's "tool_calls")."""
    return "tool_calls" if reason == "stop" and stream.calls else reason


# -- the grammar of required / named calls -----------------------------------------------------
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI: a function without `parameters` takes none."""
    return parameters if parameters is not None else _NO_PARAMETERS


def required_calls_schema(tools: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    """`tool_choice: "required"`: an array of one call (several with parallel_tool_calls) of any of
    the tools, each `{"name": <the tool's>, "arguments": <its parameters>}`."""
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters_schema(params)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, params in tools
        ]
    }
    return {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
