"""The bound on a non-streamed answer (prompts x n x max_tokens x (1 + logprobs) token entries,
held until the end and serialized at once): normal requests fit the default, a given max_tokens
past it is a 400 asking for a stream, a default one is lowered to fit."""

from __future__ import annotations

import pytest

from kvscale.common.errors import APIError
from kvscale.worker.server.openai_serving import (
    bound_unstreamed,
    default_unstreamed_budget,
    unstreamed_entries,
)


@pytest.mark.parametrize("max_model_len", [2048, 32768, 131072])
def test_the_default_serves_one_sequence_with_logprobs_5_over_the_whole_context(max_model_len) -> None:
    budget = default_unstreamed_budget(max_model_len)
    assert bound_unstreamed([max_model_len], 1, 5, True, budget, "max_tokens") == [max_model_len]
    # Eight whole-context sequences without logprobs too.
    assert bound_unstreamed([max_model_len] * 8, 1, 0, True, budget, "max_tokens") == [max_model_len] * 8


@pytest.mark.parametrize("max_model_len", [2048, 32768, 131072])
def test_the_issue_s_request_is_a_400_that_asks_for_a_stream(max_model_len) -> None:
    # 16 prompts x n=16 x logprobs 20 x a long max_tokens: gigabytes of JSON before.
    budget = default_unstreamed_budget(max_model_len)
    assert unstreamed_entries([max_model_len // 2] * 16, 16, 20) > budget
    with pytest.raises(APIError) as exc:
        bound_unstreamed([max_model_len // 2] * 16, 16, 20, True, budget, "max_tokens")
    assert exc.value.status == 400 and exc.value.param == "max_tokens"
    assert "stream: true" in str(exc.value.body())


def test_a_default_max_tokens_is_lowered_to_fit_not_refused() -> None:
    budget = 1000
    assert bound_unstreamed([900, 50], 2, 4, False, budget, "max_tokens") == [50, 50]
    assert unstreamed_entries([50, 50], 2, 4) <= budget
    assert bound_unstreamed([10**6], 1, 0, False, 10, "max_tokens") == [10]
