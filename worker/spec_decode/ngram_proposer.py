"""N-gram prompt lookup: propose what followed the last time the request's latest tokens appeared.

No model: the request's own tokens (prompt and output) are the draft. Code, structured output and
edits of a given text repeat themselves, so a match is often a long run of correct tokens; where
nothing matches, nothing is proposed and the step costs what a plain decode costs.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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


class NgramProposer:
    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, token_ids: list[list[int]], num_tokens: list[int]) -> list[list[int]]:
        return [
            ngram_propose(ids, k, self.max_n, self.min_n) if k > 0 else []
            for ids, k in zip(token_ids, num_tokens, strict=True)
        ]
