"""What the sampler reports of a token's probability: a request keeps these per sampled token."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives, from the raw model distribution."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]
