"""Seeded sampling: the same seed gives the same tokens whatever shares the batch, with speculative
decoding on or off (the noise for output position t is a function of the seed and t alone)."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import DRAFT, TARGET

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.core.request import Request
from kvscale.worker.sample.sampler import Sampler, SamplingMetadata, noise_seed, random_sample

CPU = torch.device("cpu")


# -- the sampler alone -------------------------------------------------------------------------------
def test_noise_depends_on_seed_and_position_only():
    probs = torch.rand(1, 500).softmax(-1)
    seed = noise_seed(42, 7)
    alone = random_sample(probs, {0: seed})
    torch.manual_seed(1)
    batch = random_sample(torch.cat([torch.rand(3, 500).softmax(-1), probs]), {3: seed, 1: noise_seed(5, 0)})
    assert int(batch[3]) == int(alone[0])
    assert len({noise_seed(s, t) for s in range(50) for t in range(50)}) == 2500


def test_a_seeded_row_ignores_its_neighbours_and_the_steps_before():
    """Sampled token at each position: alone, step by step, equals the same request sampled among
    others (greedy, unseeded, other seeds) and after other requests consumed randomness."""
    vocab, steps = 64, 12
    logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(3)) * 2

    def run(neighbours: list[SamplingParams], position: int) -> list[int]:
        params = [*neighbours]
        params.insert(position, SamplingParams(temperature=0.9, top_k=20, seed=77))
        reqs = [Request(f"r{i}", [1, 2], p, seed=p.seed) for i, p in enumerate(params)]
        out = []
        for t in range(steps):
            md = SamplingMetadata.from_requests(reqs, vocab, CPU)
            rows = torch.randn(len(reqs), vocab)
            rows[position] = logits[t]
            tokens = Sampler()(rows, md).sampled_token_ids.tolist()
            for r, tok in zip(reqs, tokens, strict=True):
                r.append_output_token(tok, 0.0)
            out.append(tokens[position])
        return out

    alone = run([], 0)
    assert len(set(alone)) > 3
    torch.manual_seed(9)
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(seed=5)]
    assert run(mixed, 2) == alone
    assert run(mixed[:1], 0) == alone


# -- the engine -------------------------------------------------------------------------------------
pair = pytest.mark.skipif(not (TARGET.is_dir() and DRAFT.is_dir()), reason="model pair missing")
PROMPT = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def "
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=2024, max_tokens=32, ignore_eos=True)
NEIGHBOURS = [
    ("import os\nimport sys\n\n\ndef main(argv):\n" * 3, SamplingParams(temperature=1.0, max_tokens=40)),
    ("def add(a, b):\n    return a + b\n", SamplingParams(temperature=0.0, max_tokens=30)),
    ("for i in range(10):\n", SamplingParams(temperature=1.0, seed=1, max_tokens=25)),
    ("x = [1, 2, 3]\n" * 8, SamplingParams(temperature=0.7, max_tokens=35, ignore_eos=True)),
]


def _seeded_tokens(llm: LLM, batched: bool) -> list[int]:
    if not batched:
        return llm.generate(PROMPT, SEEDED)[0].outputs[0].token_ids
    prompts = [p for p, _ in NEIGHBOURS]
    params = [sp for _, sp in NEIGHBOURS]
    prompts.insert(2, PROMPT)
    params.insert(2, SEEDED)
    return llm.generate(prompts, params)[2].outputs[0].token_ids


@pytest.fixture(scope="module")
def plain_tokens() -> list[int]:
    llm = LLM(str(TARGET), num_kv_blocks=512)
    alone = _seeded_tokens(llm, batched=False)
    assert _seeded_tokens(llm, batched=True) == alone
    return alone


@pair
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_output_is_the_same_alone_in_a_batch_and_with_speculation(method, plain_tokens):
    spec = dict(speculative_method="ngram") if method == "ngram" else dict(draft_model=str(DRAFT))
    # A small token budget: in a batch, the neighbours' prefill and decodes leave the seeded request
    # fewer proposals than alone, so the number of draws per step differs between the two runs.
    llm = LLM(
        str(TARGET),
        num_kv_blocks=512,
        max_num_batched_tokens=64,
        num_speculative_tokens=5,
        speculative_adaptive=False,
        **spec,
    )
    alone = _seeded_tokens(llm, batched=False)
    batched = _seeded_tokens(llm, batched=True)
    assert batched == alone
    assert alone == plain_tokens  # and what plain decoding samples
    stats = llm.engine.take_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # speculation really ran
