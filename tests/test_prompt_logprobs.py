"""Prompt logprobs (vLLM's `prompt_logprobs`, and completions' `echo` + `logprobs`): the logprob
of each prompt token after the first, computed over every prompt position, equal to what the
engine reports for the same tokens when it generates them, whatever the chunking and whether the
prefix is cached."""

from __future__ import annotations

import math

import pytest
from model_fixtures import TARGET

from kvscale.worker import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not TARGET.is_dir(), reason="model missing")

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
N = 12


@pytest.mark.parametrize(("chunk", "async_scheduling"), [(None, False), (16, False), (16, True)])
def test_prompt_logprobs_equal_the_logprobs_of_the_same_tokens_generated(chunk, async_scheduling) -> None:
    extra = {} if chunk is None else {"max_num_batched_tokens": chunk, "max_num_seqs": 4}
    llm = LLM(str(TARGET), num_kv_blocks=128, async_scheduling=async_scheduling, **extra)
    gen = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, logprobs=3))
    prompt_ids, out = gen[0].prompt_token_ids, gen[0].outputs[0]
    full = prompt_ids + out.token_ids
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    # Twice: the second run finds the prefix cached, and must compute it anyway.
    for _ in range(2):
        scored = llm.generate([full], params)[0]
        lps = scored.prompt_logprobs
        assert lps is not None and len(lps) == len(full) and lps[0] is None
        assert [lp.token_id for lp in lps[1:]] == full[1:]
        for mine, want in zip(lps[len(prompt_ids) :], out.logprobs, strict=True):
            assert math.isclose(mine.logprob, want.logprob, abs_tol=2e-3), (mine, want)
            assert mine.rank == want.rank == 1  # greedy: the generated token was the most likely
            assert [t for t, _ in mine.top] == [t for t, _ in want.top]
        assert all(lp.logprob <= 0 and len(lp.top) == 3 for lp in lps[1:])
    assert llm.generate([full], SamplingParams(max_tokens=1))[0].prompt_logprobs is None
    # In one batch with plain requests (their logit rows beside all of its prompt's), n=2: the
    # plain ones generate what they did alone, and the prompt's logprobs come once, the same.
    greedy = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    batch = llm.generate(
        [PROMPT, full, PROMPT],
        [greedy, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, n=2), greedy],
    )
    assert batch[0].outputs[0].token_ids == batch[2].outputs[0].token_ids == out.token_ids
    assert [lp and lp.token_id for lp in batch[1].prompt_logprobs] == [None, *full[1:]]
    assert [lp.logprob for lp in batch[1].prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in lps[1:]], abs=2e-3
    )
