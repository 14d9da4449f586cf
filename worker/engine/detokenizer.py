"""Streaming detokenization with stop strings.

Each step decodes only a small window of ids around the new tokens (the prefix_offset/read_offset technique):
`prefix` = ids[prefix_offset:read_offset] were already turned into text, and the new text is what decoding
ids[prefix_offset:] adds to decoding the prefix alone. The prefix gives the decoder context (SentencePiece
decoders drop a leading space at the start of a decode). While the window's text ends in U+FFFD the last
tokens hold part of a character, so nothing is emitted until more bytes arrive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"
# Prompt tokens that seed the window, so the first output token is decoded in context.
_PROMPT_CONTEXT_TOKENS = 5
# Bytes that never form a character (garbage from a broken model) would make the window grow without bound;
# past this many unread tokens we commit the part of the text that later tokens can no longer change.
_MAX_UNREAD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns a request's output token ids into text as they arrive, and watches for stop strings."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop or [] if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # The stop string that ended the output; no more text is taken after it.
        self.stop_reason: str | None = None

        seed = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if seed and self._decode(seed).endswith(_REPLACEMENT):
            # The prompt ends inside a character: the diff against it would be misaligned. Decode the output
            # on its own instead, exactly as decoding the output ids alone would.
            seed = []
        # The seed plus every output id; the offsets index this list.
        self._ids = seed
        self._prefix_offset = 0
        self._read_offset = len(seed)
        # Committed output text as chunks, joined lazily: `text += new` would copy all of it every step.
        self._chunks: list[str] = []
        self._len = 0
        # Characters already handed out by get_next_output_text.
        self._sent = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string that matched (the request must finish), else None."""
        if self.stop_reason is not None or not new_token_ids:
            return None
        self._ids.extend(new_token_ids)
        return self._append(self._decode_new())

    def flush(self) -> str | None:
        """The output is complete: commit text still waiting for the rest of a character (it decodes to
        U+FFFD, as in a full decode). Returns the stop string if the flushed text completes one."""
        if self.stop_reason is not None or self._read_offset == len(self._ids):
            return None
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._advance(len(self._ids))
        return self._append(text[len(prefix_text) :])

    @property
    def output_text(self) -> str:
        """All output text so far, truncated at a stop string once matched; a partial character comes
        only after flush()."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text safe to stream: all of it (delta=False) or what is new since the last call (delta=True).

        Until finished, a tail that could be the start of a stop string is held back: if the stop string then
        completes, that text is cut from the output and must never have been sent. finished=True flushes."""
        if finished:
            self.flush()
        if finished or self.stop_reason is not None:
            safe = self._len
        else:
            safe = max(self._sent, self._len - self._held_back())
        if delta:
            text = self._suffix(self._len - self._sent)[: safe - self._sent]
            self._sent = safe
            return text
        self._sent = safe
        return self.output_text[:safe]

    def _decode(self, ids: list[int]) -> str:
        # Clean-up rewrites spaces around punctuation by neighbours, so it is not stable across windows.
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _advance(self, read_offset: int) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, read_offset

    def _decode_new(self) -> str:
        """Text added by the unread ids that can no longer change; moves the window past it."""
        end = len(self._ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        unread = end - self._read_offset
        if not text.endswith(_REPLACEMENT):
            # Skipped special tokens add nothing; keep them in the window (context) unless it grows too long.
            if len(text) > len(prefix_text) or unread >= _MAX_UNREAD_TOKENS:
                self._advance(end)
                return text[len(prefix_text) :]
            return ""
        if unread < _MAX_UNREAD_TOKENS:
            return ""  # The last tokens may hold the start of a character; wait for the rest.
        # Stuck on bytes that may never form a character. Lossy UTF-8 decoding turns an unfinished character
        # into one trailing U+FFFD, so a shorter window whose text is a proper prefix of `text` ends before it
        # and is final. Commit the longest one.
        for cut in range(end - 1, self._read_offset, -1):
            head = self._decode(self._ids[self._prefix_offset : cut])
            if len(prefix_text) <= len(head) < len(text) and text.startswith(head):
                self._advance(cut)
                return head[len(prefix_text) :]
        return ""

    def _append(self, new_text: str) -> str | None:
        """Commit new text; on a stop string, truncate the output there and return it."""
        if not new_text:
            return None
        self._chunks.append(new_text)
        self._len += len(new_text)
        if not self.stop:
            return None
        # Only occurrences that end in the new text are new; they start at most max_len - 1 chars before it.
        region = self._suffix(len(new_text) + self._max_stop_len - 1)
        old = len(region) - len(new_text)
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = region.find(s, max(0, old - len(s) + 1))
            # The first stop string to complete wins (what token-by-token streaming would see); on a tie the
            # longer one, which starts earlier.
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is None:
            return None
        end, start, s = best
        self._truncate(self._len - len(region) + (end if self.include_stop_str_in_output else start))
        self.stop_reason = s
        return s

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        tail = self._suffix(self._max_stop_len - 1)
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(tail)), held, -1):
                if tail.endswith(s[:k]):
                    held = k
                    break
        return held

    def _suffix(self, n: int) -> str:
        """The last n characters of the output text, touching only the chunks that hold them."""
        if n <= 0:
            return ""
        parts: list[str] = []
        need = n
        for chunk in reversed(self._chunks):
            parts.append(chunk[-need:] if len(chunk) > need else chunk)
            need -= len(chunk)
            if need <= 0:
                break
        return "".join(reversed(parts))

    def _truncate(self, length: int) -> None:
        while self._chunks and self._len - len(self._chunks[-1]) >= length:
            self._len -= len(self._chunks.pop())
        if self._len > length:
            self._chunks[-1] = self._chunks[-1][: length - self._len]
            self._len = length
        self._sent = min(self._sent, length)
