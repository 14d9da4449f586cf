"""The adaptive lookahead planner: pure decisions from acceptance and step costs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvscale.worker.spec_decode.lookahead import (
    StepCostModel,
    acceptance_rate,
    expected_tokens,
    plan_lookahead,
    update_acceptance,
)

SIZES, KS = [1, 4, 16, 64, 256], [0, 1, 2, 4, 8]


def costs(per_token: float, fixed: float = 0.004, draft: float = 0.0005, per_position: bool = True):
    """A forward costs `fixed` (reading the weights) plus `per_token` for each query token."""
    target = [[fixed + per_token * b * (1 + k) for k in KS] for b in SIZES]
    return StepCostModel(SIZES, KS, target, [draft + 1e-6 * b for b in SIZES], per_position)


WEIGHT_BOUND = costs(per_token=2e-6)  # extra query tokens are almost free
COMPUTE_BOUND = costs(per_token=4e-4, fixed=0.0)  # every token costs the same


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_acceptance_follows_evidence():
    a, r = 0.0, 0.0
    assert acceptance_rate(a, r) == 0.5  # the prior
    for _ in range(10):
        a, r = update_acceptance(a, r, num_proposed=4, num_accepted=4)
    assert acceptance_rate(a, r) > 0.9
    for _ in range(10):
        a, r = update_acceptance(a, r, num_proposed=4, num_accepted=0)
    assert acceptance_rate(a, r) < 0.4


def test_small_batches_speculate_long_when_acceptance_is_high():
    free_proposals = costs(per_token=2e-6, per_position=False)  # n-gram lookup
    assert plan_lookahead([0.8], [8], 100, free_proposals) == [8]
    # A draft forward per position: stop where one more position earns less than the average.
    assert 4 <= plan_lookahead([0.8], [8], 100, WEIGHT_BOUND)[0] < 8


def test_compute_bound_batches_do_not_speculate():
    assert plan_lookahead([0.8] * 64, [8] * 64, 4096, COMPUTE_BOUND) == [0] * 64


def test_poor_acceptance_does_not_speculate_even_when_cheap():
    slow_draft = costs(per_token=2e-6, draft=0.004)  # a draft forward as costly as the target's
    assert plan_lookahead([0.1], [8], 100, slow_draft) == [0]


def test_lookahead_grows_with_acceptance():
    low, high = plan_lookahead([0.3, 0.9], [8, 8], 100, WEIGHT_BOUND)
    assert high > low


def test_plan_respects_caps_and_budget():
    ks = plan_lookahead([0.9] * 4, [2, 0, 8, 8], 7, WEIGHT_BOUND)
    assert ks[1] == 0 and ks[0] <= 2
    assert sum(ks) <= 7


@given(
    rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40),
    cap=st.integers(0, 8),
    budget=st.integers(0, 200),
    per_token=st.sampled_from([2e-6, 5e-5, 4e-4]),
)
def test_plan_is_always_feasible_and_no_worse_than_plain(rates, cap, budget, per_token):
    model = costs(per_token)
    ks = plan_lookahead(rates, [cap] * len(rates), budget, model)
    assert all(0 <= k <= cap for k in ks) and sum(ks) <= max(budget, 0)
    n = len(rates)
    if any(ks):
        counts = [sum(k > j for k in ks) for j in range(max(ks))]
        value = sum(expected_tokens(a, k) for a, k in zip(rates, ks, strict=True)) / (
            model.target_time(n, sum(ks)) + model.proposer_time(counts)
        )
        assert value > n / model.target_time(n, 0)
