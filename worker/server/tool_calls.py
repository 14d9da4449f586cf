"""Tool calls out of generated text, as OpenAI's `tool_calls` (whole) and its streamed deltas.

Three ways text holds calls: `tool_choice` a named function (the text is that function's
arguments, the grammar made it so), `required` (a JSON array of `{"name", "arguments"}` objects,
the grammar made it so) and `auto` (the model's own format, read by a tool-call parser:
tool_parsers.py). Each is an extractor fed the text delta by delta: it returns the content that
can be sent and `CallDelta`s (a call's name once, then fragments of its arguments' JSON), keeping
its own state so that a delta costs what it carries, not the text so far (`chars_scanned` counts
the work). `ToolCallStream` turns these into OpenAI's streamed shapes; the non-streamed answer is
the same stream fed the whole text at once, so both agree by construction.

Named and required calls are grammar-enforced: their arguments stream as the model writes them
(its raw JSON, spacing included). A text the grammar did not finish (cut by `max_tokens`) is not
valid JSON: the non-streamed answer then returns it as content and no call (`fallback_content`),
while a stream has already sent it (finish_reason `length` says so).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


def whole_json(text: str) -> tuple[bool, Any]:
    """(True, value) for a JSON text; (False, None) otherwise, also when it nests too deep for
    the parser (RecursionError: a client input, never a 500)."""
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass
class CallDelta:
    """Part of call `index`: its name (only in its first delta) and a fragment of its arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


class Extractor(Protocol):
    chars_scanned: int  # characters looked at so far (the cost: linear in the text)
    # Set at the end when the calls turned out not to be calls: the whole text, as content.
    fallback_content: str | None

    def feed(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        """(content that can be sent now, parts of calls) for the next `delta` of the text.
        `final`: the text ends with this delta."""
        ...


class _ValueScanner:
    """Reads a JSON text character by character, keeping only its state: inside a string or not,
    an escape pending, the open containers (an object's current key and whether a key or a value
    comes next; an array's index). O(1) per character (a key costs its length once, when whole);
    the extractors read the state to tell which value a character belongs to."""

    def __init__(self) -> None:
        self.stack: list[list[Any]] = []  # ["{", key, key_next] or ["[", index]
        self.in_string = False
        self.escape = False
        self.key_chars: list[str] | None = None  # the key string being read, quotes included

    def step(self, c: str) -> None:
        if self.in_string:
            if self.key_chars is not None:
                self.key_chars.append(c)
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.key_chars is not None:
                    ok, key = whole_json("".join(self.key_chars))
                    self.stack[-1][1] = key if ok else None
                    self.key_chars = None
            return
        top = self.stack[-1] if self.stack else None
        if c == '"':
            self.in_string = True
            if top is not None and top[0] == "{" and top[2]:
                self.key_chars = ['"']
        elif c in "{[":
            self.stack.append(["{", None, True] if c == "{" else ["[", 0])
        elif c in "}]":
            if self.stack:
                self.stack.pop()
        elif c == ":" and top is not None and top[0] == "{":
            top[2] = False
        elif c == "," and top is not None:
            if top[0] == "{":
                top[1], top[2] = None, True
            else:
                top[1] += 1


class NamedFunctionExtractor:
    """`tool_choice: {"type": "function", "function": {"name"}}`: the whole text is the arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.chars_scanned = 0
        self.fallback_content: str | None = None
        self._scanner = _ValueScanner()
        self._started = self._done = False
        self._opened = False
        self._text: list[str] = []

    def feed(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        self._text.append(delta)
        call = CallDelta(0, self.name if not self._opened else None)
        self._opened = True
        args: list[str] = []
        sc = self._scanner
        for c in delta:
            self.chars_scanned += 1
            if self._done:
                break
            if not self._started:
                if c.isspace():
                    continue
                self._started = True
            args.append(c)
            sc.step(c)
            if not sc.stack and not sc.in_string and c in "}]":
                self._done = True  # what follows the value is not part of it
        call.arguments = "".join(args)
        if final:
            text = "".join(self._text)
            self.chars_scanned += len(text)
            ok, value = whole_json(text)
            if not (ok and isinstance(value, dict)):
                self.fallback_content = text
        return "", [call] if call.name is not None or call.arguments else []


class RequiredExtractor:
    """`tool_choice: "required"`: the text is a JSON array of `{"name", "arguments"}` objects. Each
    item's name and the raw characters of its arguments are read as they come; arguments that
    come before the name wait for it."""

    def __init__(self) -> None:
        self.chars_scanned = 0
        self.fallback_content: str | None = None
        self._scanner = _ValueScanner()
        self._text: list[str] = []
        self._calls = 0  # calls whose name was sent
        self._name: list[str] | None = None  # the name string being read
        self._args: list[str] | None = None  # the arguments being read (not sent yet)
        self._args_depth = 0
        self._pending = ""  # arguments read before the item's name
        self._named = False  # the current item's name was sent

    def feed(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        self._text.append(delta)
        out: list[CallDelta] = []
        sc = self._scanner
        for c in delta:
            self.chars_scanned += 1
            depth_before = len(sc.stack)
            top = sc.stack[-1] if sc.stack else None
            # Inside an item (depth 2), a value starts after its key's colon.
            at_value = depth_before == 2 and top[0] == "{" and not top[2] and sc.key_chars is None
            if self._args is not None:
                self._args.append(c)
                sc.step(c)
                if len(sc.stack) == self._args_depth and not sc.in_string:
                    self._flush_args(out)
                    self._args = None
                continue
            if self._name is not None:
                self._name.append(c)
                sc.step(c)
                if not sc.in_string:
                    ok, name = whole_json("".join(self._name))
                    self._name = None
                    if ok and isinstance(name, str) and not self._named:
                        self._named = True
                        out.append(CallDelta(self._calls, name, self._pending))
                        self._calls += 1
                        self._pending = ""
                continue
            sc.step(c)
            if depth_before == 1 and len(sc.stack) == 2 and c == "{":  # the next item
                self._named, self._pending = False, ""
            elif at_value and not c.isspace() and c not in ",}":
                if top[1] == "arguments" and c in "{[":
                    self._args, self._args_depth = [c], 2
                elif top[1] == "name" and c == '"':
                    self._name = [c]
        if self._args:
            self._flush_args(out)
        if final:
            text = "".join(self._text)
            self.chars_scanned += len(text)
            ok, value = whole_json(text)
            good = ok and isinstance(value, list) and len(value) == self._calls
            if not (good and all(_is_call(v) for v in value)):
                self.fallback_content = text
        return "", _merge(out)

    def _flush_args(self, out: list[CallDelta]) -> None:
        """The arguments read so far go out (or wait for the name)."""
        text = "".join(self._args or [])
        if self._args:
            self._args.clear()
        if self._named:
            out.append(CallDelta(self._calls - 1, None, text))
        else:
            self._pending += text


def _is_call(item: Any) -> bool:
    if not isinstance(item, dict):
        return False
    return isinstance(item.get("name"), str) and isinstance(item.get("arguments"), dict)


def _merge(deltas: list[CallDelta]) -> list[CallDelta]:
    """Consecutive parts of one call as one."""
    merged: list[CallDelta] = []
    for d in deltas:
        if merged and merged[-1].index == d.index and d.name is None:
            merged[-1].arguments += d.arguments
        else:
            merged.append(d)
    return merged


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallStream:
    """Per choice: text deltas in, content and `tool_calls` deltas out (update), and the whole
    content and calls at the end (result)."""

    extractor: Extractor
    content: list[str] = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)

    def update(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content, parts = self.extractor.feed(delta, final)
        if content:
            self.content.append(content)
        deltas: list[dict[str, Any]] = []
        for part in parts:
            if part.name is not None:
                self.calls.append(_Call(id=f"call_{uuid.uuid4().hex[:24]}", name=part.name))
                call = self.calls[part.index]
                deltas.append(
                    {
                        "index": part.index,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": part.name, "arguments": part.arguments},
                    }
                )
            elif part.arguments:
                if deltas and deltas[-1]["index"] == part.index:
                    deltas[-1]["function"]["arguments"] += part.arguments
                else:
                    deltas.append({"index": part.index, "function": {"arguments": part.arguments}})
            self.calls[part.index].arguments += part.arguments
        return content, deltas

    def result(self) -> tuple[str | None, list[dict[str, Any]]]:
        """OpenAI's message fields: content (None when only whitespace) and tool_calls."""
        if self.extractor.fallback_content is not None:
            text = self.extractor.fallback_content
            return (text if text.strip() else None), []
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.calls
        ]
        content = "".join(self.content)
        return (content if content.strip() else None), calls

    @property
    def made_calls(self) -> bool:
        return bool(self.calls) and self.extractor.fallback_content is None


def finish_reason(reason: str | None, stream: ToolCallStream) -> str | None:
    """A choice that stopped after making calls finished for them (OpenAI's "tool_calls")."""
    return "tool_calls" if reason == "stop" and stream.made_calls else reason


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
