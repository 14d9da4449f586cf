"""N-gram prompt lookup: propose what followed the last time the request's latest tokens appeared.

No model: the request's own tokens (prompt and output) are the draft. Code, structured output and
edits of a given text repeat themselves, so a match is often a long run of correct tokens; where
nothing matches, nothing is proposed and the step costs what a plain decode costs.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvscale.worker.core.request import Request


def ngram_propose(token_ids: list[int] | np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    (max_n down to min_n tokens) that occurs earlier; [] when none does."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: total - 1], n)  # windows ending before the last token
        hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the most recent occurrence: the nearest context usually fits best
            return tokens[start : start + k].tolist()
    return []


class NgramIndex:
    """The most recent start of every n-gram (min_n..max_n tokens) of one growing token sequence.

    Extended with the new tokens at each lookup, so a proposal costs O(new tokens + max_n) instead
    of a scan of the whole history; it proposes exactly what ngram_propose does. Memory: one dict
    entry per distinct n-gram (at most max_n - min_n + 1 per token)."""

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n
        self._last_start: dict[tuple[int, ...], int] = {}
        self._end = 0  # every n-gram ending at or before this position is indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        total = len(tokens)
        limit = total - 1  # occurrences must end before the last token, as in ngram_propose
        if limit < self._end:  # the sequence shrank: start over
            self._last_start.clear()
            self._end = 0
        last = self._last_start
        for end in range(self._end + 1, limit + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                last[tuple(tokens[end - n : end])] = end - n
        self._end = max(self._end, limit)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = last.get(tuple(tokens[total - n :]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []


class NgramProposer:
    """Prompt lookup over each request's own tokens, with an NgramIndex per running request
    (dropped once the request finishes)."""

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n
        self._indexes: dict[int, tuple[Request, NgramIndex]] = {}  # id(request) -> its index

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        for key in [key for key, (r, _) in self._indexes.items() if r.is_finished]:
            del self._indexes[key]
        drafts = []
        for request, k in zip(requests, num_tokens, strict=True):
            if k <= 0:
                drafts.append([])
                continue
            entry = self._indexes.get(id(request))
            if entry is None:
                entry = self._indexes[id(request)] = (request, NgramIndex(self.max_n, self.min_n))
            drafts.append(entry[1].propose(request.all_token_ids, k))
        return drafts
