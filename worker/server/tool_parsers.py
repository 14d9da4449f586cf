"""Tool-call parsers for `tool_choice: "auto"`, chosen by `--tool-call-parser`: they read calls in
the model's own format out of its text (the model may also just answer).

hermes: NousResearch Hermes 2 Pro / Qwen 2.5 / Qwen 3: each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, text outside the tags is content.
"""

from __future__ import annotations

from typing import Any

from kvscale.worker.server.tool_calls import CallDelta, dumps, whole_json


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (not sent yet)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as a JSON object string) of a block's body, or None when it is not a call:
    not JSON (an extra or a missing brace), nested past the parser's depth, no string name, or
    arguments that are not an object. Some Hermes-format models write "parameters" for
    "arguments", or the arguments as a string holding the object; a call without them takes none."""
    ok, obj = whole_json(body)
    if not ok or not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        ok, args = whole_json(args)
    if not isinstance(args, dict):
        return None
    try:
        return obj["name"], dumps(args)
    except (ValueError, RecursionError):
        return None


class HermesExtractor:
    """Text outside `<tool_call>` blocks streams as content, holding back a tail that could be the
    start of a tag. A block goes out as one call once closed (its arguments can only be known to be
    valid JSON then); a block that is not a call goes out as content, tags and all, so no text is
    lost. Only the new delta (plus a tag's length of what came before) is searched for tags, and a
    block's body is parsed once: the cost is linear in the text. `max_calls` (1 with
    `parallel_tool_calls: false`): calls past it are dropped, as vLLM does.

    `spans`: where each call's block lies in the text (start, end, kept), for tests and logs."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.chars_scanned = 0
        self.fallback_content: str | None = None
        self.spans: list[tuple[int, int, bool]] = []
        self._calls = 0
        self._pos = 0  # characters of the text fed so far
        self._pending = ""  # outside a block: the held-back tail
        self._in_block = False
        self._block_start = 0
        self._body: list[str] = []
        self._body_len = 0
        self._body_tail = ""  # the body's last len(END) - 1 characters

    def feed(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        calls: list[CallDelta] = []
        start_of_delta = self._pos
        self._pos += len(delta)
        text, at = delta, start_of_delta  # `at`: where `text` starts in the whole text
        while True:
            if not self._in_block:
                s = self._pending + text
                s_at = at - len(self._pending)
                self.chars_scanned += len(s)
                i = s.find(self.START)
                if i < 0:
                    hold = 0 if final else _held_back(s, self.START)
                    content.append(s[: len(s) - hold])
                    self._pending = s[len(s) - hold :]
                    break
                content.append(s[:i])
                self._pending = ""
                self._in_block, self._block_start = True, s_at + i
                self._body, self._body_len, self._body_tail = [], 0, ""
                text, at = s[i + len(self.START) :], s_at + i + len(self.START)
                continue
            k = len(self._body_tail)
            s = self._body_tail + text
            self.chars_scanned += len(s)
            j = s.find(self.END)
            if j < 0:
                self._body.append(text)
                self._body_len += len(text)
                self._body_tail = s[-(len(self.END) - 1) :]
                if final:  # an unclosed block at the end: a call if its body is one
                    body = "".join(self._body)
                    self._close(body, self.START + body, self._pos, content, calls)
                break
            whole = "".join(self._body) + text
            cut = self._body_len - k + j  # where END starts in `whole`
            body = whole[:cut]
            end = at - self._body_len + cut + len(self.END)  # in the whole text
            self._close(body, self.START + body + self.END, end, content, calls)
            text, at = whole[cut + len(self.END) :], end
        return "".join(content), calls

    def _close(self, body: str, raw: str, end: int, content: list[str], calls: list[CallDelta]) -> None:
        self._in_block = False
        self.chars_scanned += len(body)  # parsed once
        call = hermes_call(body)
        if call is None:
            content.append(raw)
            return
        kept = self.max_calls is None or self._calls < self.max_calls
        self.spans.append((self._block_start, end, kept))
        if kept:
            calls.append(CallDelta(self._calls, call[0], call[1]))
            self._calls += 1


TOOL_CALL_PARSERS = {"hermes": HermesExtractor}
