"""How many tokens each request proposes this step: pure decisions from measured acceptance and
measured step costs (docs/speculative.md).

A proposal of k tokens whose tokens are each accepted with probability a (the longer the run, the
less likely it survives) yields E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens for one
verification. It costs the verification of k more tokens in the target's forward plus the
proposer's work. At small batches the target's forward is bound by reading its weights, so extra
query tokens are nearly free and long proposals pay; at large batches the forward is bound by
compute, every extra token costs about what a plain decode token costs, and since a^j < 1 the
best plan is no speculation at all. The planner maximises expected tokens per second of the whole
step, so it moves between those regimes on its own.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass

# Acceptance per request: decayed counts of accepted tokens and of rejections (a geometric model:
# each proposal runs until its first rejection), with a weak prior of a = 0.5.
ACCEPTANCE_DECAY = 0.8
PRIOR_ACCEPTED = 1.0
PRIOR_REJECTED = 1.0
# Speculate only when the plan is predicted to beat plain decoding by this margin (the cost model
# is measured, so it is noisy; a small loss is worse than a small missed gain).
MIN_GAIN = 0.05


def acceptance_rate(accepted: float, rejected: float) -> float:
    return (accepted + PRIOR_ACCEPTED) / (accepted + rejected + PRIOR_ACCEPTED + PRIOR_REJECTED)


def update_acceptance(
    accepted: float, rejected: float, num_proposed: int, num_accepted: int
) -> tuple[float, float]:
    """Fold one verification into the decayed counts."""
    rejected_now = 1.0 if num_accepted < num_proposed else 0.0
    return ACCEPTANCE_DECAY * accepted + num_accepted, ACCEPTANCE_DECAY * rejected + rejected_now


def idle_acceptance(accepted: float, rejected: float) -> tuple[float, float]:
    """A step without a proposal: evidence fades toward the prior, so a request that stopped
    speculating after a bad patch is probed again later."""
    return ACCEPTANCE_DECAY * accepted, ACCEPTANCE_DECAY * rejected


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verification of a k-token proposal yields (accepted run + the target's token)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear, extrapolating linearly past either end."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class StepCostModel:
    """Seconds per step, measured at start-up (spec_decode.profile_step_costs).

    target[b][j]: a target forward (with logits) over batch_sizes[b] sequences of 1 + lookaheads[j]
    tokens each. proposer[b]: one proposer round for batch_sizes[b] sequences (one draft-model
    forward per proposed position; for n-gram lookup, the whole lookup).
    """

    batch_sizes: list[int]
    lookaheads: list[int]
    target: list[list[float]]
    proposer: list[float]
    proposer_per_position: bool  # draft model: a round per proposed position; n-gram: one in all

    def target_time(self, num_seqs: int, extra_tokens: int) -> float:
        per_seq = extra_tokens / num_seqs
        at_sizes = [_interp(self.lookaheads, row, per_seq) for row in self.target]
        return _interp(self.batch_sizes, at_sizes, num_seqs)

    def proposer_time(self, counts_by_position: list[int]) -> float:
        """counts_by_position[j]: requests proposing at least j + 1 tokens."""
        rounds = counts_by_position if self.proposer_per_position else counts_by_position[:1]
        return sum(_interp(self.batch_sizes, self.proposer, n) for n in rounds if n > 0)


def plan_lookahead(
    acceptance: list[float], caps: list[int], budget: int, costs: StepCostModel, min_gain: float = MIN_GAIN
) -> list[int]:
    """Lookahead per decode request (0 = plain decode) that maximises expected tokens per second.

    Greedy by marginal value: the j-th proposed token of a request adds a^j expected tokens, so
    candidates are taken best first while the step's throughput improves, within each request's
    cap and the step's token budget.
    """
    num_seqs = len(acceptance)
    ks = [0] * num_seqs
    if num_seqs == 0 or budget <= 0:
        return ks
    counts = [0] * max(caps, default=0)
    plain = num_seqs / costs.target_time(num_seqs, 0)
    expected, extra = float(num_seqs), 0
    best = plain
    heap = [(-a, i) for i, (a, c) in enumerate(zip(acceptance, caps, strict=True)) if c > 0 and a > 0]
    heapq.heapify(heap)
    while heap and extra < budget:
        neg_gain, i = heapq.heappop(heap)
        counts[ks[i]] += 1
        value = (expected - neg_gain) / (costs.target_time(num_seqs, extra + 1) + costs.proposer_time(counts))
        if value <= best:
            counts[ks[i]] -= 1
            break  # later candidates add less and cost at least as much
        best, expected, extra = value, expected - neg_gain, extra + 1
        ks[i] += 1
        if ks[i] < caps[i]:
            heapq.heappush(heap, (neg_gain * acceptance[i], i))
    if best < plain * (1.0 + min_gain):
        return [0] * num_seqs
    return ks
