"""Tool-call parsers for `tool_choice: "auto"`, chosen by `--tool-call-parser`: they read calls in
the model's own format out of its text (the model may also just answer).

hermes: NousResearch Hermes 2 Pro / Qwen 2.5 / Qwen 3: each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, text outside the tags is content.
"""

from __future__ import annotations

from kvscale.worker.server.tool_calls import CallSnapshot, partial_json, whole_json


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (not sent yet)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesExtractor:
    START, END = "<tool_call>", "</tool_call>"

    def snapshot(self, text: str, final: bool) -> tuple[str, list[CallSnapshot]]:
        content: list[str] = []
        calls: list[CallSnapshot] = []
        pos = 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                tail = text[pos:]
                hold = 0 if final else _held_back(tail, self.START)
                content.append(tail[: len(tail) - hold])
                break
            content.append(text[pos:start])
            body_at = start + len(self.START)
            end = text.find(self.END, body_at)
            body = text[body_at : end if end >= 0 else len(text)]
            calls.append(self._call(body, closed=end >= 0 or final))
            if end < 0:
                break
            pos = end + len(self.END)
        return "".join(content), calls

    @staticmethod
    def _call(body: str, closed: bool) -> CallSnapshot:
        ok, value = whole_json(body) if closed else (False, None)
        obj = value if ok else partial_json(body)
        if not isinstance(obj, dict):
            return CallSnapshot(None, None, False)
        name = obj.get("name") if isinstance(obj.get("name"), str) else None  # a partial one is left out
        # Some Hermes-format models write "parameters" for "arguments".
        args = obj.get("arguments", obj.get("parameters"))
        return CallSnapshot(name, args, ok)


TOOL_CALL_PARSERS = {"hermes": HermesExtractor}
