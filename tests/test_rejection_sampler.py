"""Sampling with speculation draws from exactly the target's distribution, and a wrong verifier is
caught by the same test.

Exact reference: the target's own next-token distributions, enumerated over every prefix the
samples can take (top-k keeps the tree small), multiplied out into the joint distribution of the
generated tokens. The samples come from the engine with speculation forced on; a chi-square
goodness-of-fit test at significance 0.001 compares the two.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import product

import pytest
import torch
from model_fixtures import DRAFT, TARGET

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.core.request import Request
from kvscale.worker.sample import rejection_sampler as rs
from kvscale.worker.sample.rejection_sampler import RejectionSampler, SpecDecodeRow

SIGNIFICANCE = 1e-3


def chi_square_p_value(observed: Counter, expected_probs: dict, n: int) -> float:
    """Goodness of fit; cells expecting fewer than 5 draws are pooled. Wilson–Hilferty approximation
    of the chi-square tail (accurate to a few percent at these degrees of freedom)."""
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for key, p in expected_probs.items():
        if n * p >= 5:
            cells.append((observed.get(key, 0), n * p))
        else:
            pooled_obs += observed.get(key, 0)
            pooled_exp += n * p
    pooled_obs += sum(c for k, c in observed.items() if k not in expected_probs)  # impossible outcomes
    if pooled_exp > 0 or pooled_obs > 0:
        cells.append((pooled_obs, max(pooled_exp, 1e-9)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


# -- the verifier alone, on fixed distributions --------------------------------------------------------
def _request(i: int, temperature: float = 1.0, seeded: bool = True) -> Request:
    """Seeded requests take the coupled path, unseeded ones rejection sampling."""
    seed = i if seeded else None
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=8)
    return Request(str(i), [0, 1, 2], params, seed=seed)


@pytest.mark.parametrize("seeded", [True, False], ids=["coupled", "rejection"])
@pytest.mark.parametrize("with_q", [True, False], ids=["draft-q", "point-mass-q"])
def test_first_token_follows_p_for_any_proposal_distribution(with_q, seeded):
    torch.manual_seed(0)
    vocab, n = 6, 6000
    p_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]] * 3)  # the target at positions 0, 1, 2
    q = torch.tensor([0.05, 0.05, 0.1, 0.5, 0.2, 0.1])  # a poor draft: mass where p has little
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        drafts = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
        rows.append(SpecDecodeRow(_request(i, seeded=seeded), drafts, q.expand(2, vocab) if with_q else None))
    out = RejectionSampler()(p_logits.repeat(n, 1), rows, vocab)
    first = Counter(t[0] for t in out.token_ids)
    p = p_logits[0].softmax(-1).tolist()
    assert chi_square_p_value(first, dict(enumerate(p)), n) > SIGNIFICANCE
    assert 0 < sum(out.num_accepted) < 2 * n


def test_greedy_rows_keep_the_argmax_run():
    vocab = 5
    logits = torch.zeros(4, vocab)
    for pos, tok in enumerate([3, 1, 4, 2]):
        logits[pos, tok] = 5.0
    out = RejectionSampler()(logits, [SpecDecodeRow(_request(0, temperature=0.0), [3, 1, 0])], vocab)
    assert out.token_ids == [[3, 1, 4]] and out.num_accepted == [2]
    out = RejectionSampler()(logits, [SpecDecodeRow(_request(0, temperature=0.0), [3, 1, 4])], vocab)
    assert out.token_ids == [[3, 1, 4, 2]] and out.num_accepted == [3]  # the bonus token


# -- the whole engine, on the trained pair --------------------------------------------------------------
# Repetitive, so n-gram lookup proposes; the draft often disagrees with the target here, so both
# acceptance and rejection are exercised.
PROMPT = "self.a = a\nself.b = b\nself.a = a\nself.b = b\nself."
TOP_K, LENGTH = 3, 4


@pytest.fixture(scope="module")
def exact_joint() -> tuple[list[int], dict[tuple[int, ...], float]]:
    """P(t1..t4) of the target under temperature 1, top-k 3, by enumerating every prefix."""
    if not (TARGET.is_dir() and DRAFT.is_dir()):
        pytest.skip("model pair missing")
    llm = LLM(str(TARGET), num_kv_blocks=1024)
    prompt = llm.get_tokenizer().encode(PROMPT)
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(LENGTH):
        prefixes = list(joint)
        outs = llm.generate(
            [prompt + list(p) for p in prefixes],
            SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP_K, ignore_eos=True),
        )
        nxt = {}
        for prefix, out in zip(prefixes, outs, strict=True):
            top = out.outputs[0].logprobs[0].top  # the raw distribution's TOP_K most likely tokens
            z = sum(math.exp(lp) for _, lp in top)
            for token, lp in top:
                nxt[(*prefix, token)] = joint[prefix] * math.exp(lp) / z
        joint = nxt
    return prompt, joint


def _sample(prompt: list[int], n: int, seeded: bool, **spec) -> Counter:
    """Seeded requests are verified by coupling, unseeded ones by rejection sampling (made
    deterministic by the global seed)."""
    llm = LLM(str(TARGET), num_kv_blocks=2048, max_num_seqs=256, max_num_batched_tokens=4096,
              num_speculative_tokens=LENGTH - 2, speculative_adaptive=False, **spec)  # fmt: skip
    params = [
        SamplingParams(
            temperature=1.0, top_k=TOP_K, max_tokens=LENGTH, seed=i if seeded else None, ignore_eos=True
        )
        for i in range(n)
    ]
    torch.manual_seed(0)
    outs = llm.generate([prompt] * n, params)
    assert sum(o.outputs[0].num_draft_tokens for o in outs) >= n  # every request speculated
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


SPEC = {"draft": dict(draft_model=str(DRAFT)), "ngram": dict(speculative_method="ngram")}
N = 2000


@pytest.mark.parametrize("seeded", [True, False], ids=["coupled", "rejection"])
@pytest.mark.parametrize("method", sorted(SPEC))
def test_speculative_sampling_matches_the_target(method, seeded, exact_joint):
    prompt, joint = exact_joint
    assert chi_square_p_value(_sample(prompt, N, seeded, **SPEC[method]), joint, N) > SIGNIFICANCE


@pytest.mark.parametrize("seeded", [True, False], ids=["coupled", "rejection"])
@pytest.mark.parametrize("method", sorted(SPEC))
def test_a_verifier_that_always_accepts_is_caught(method, seeded, exact_joint, monkeypatch):
    monkeypatch.setattr(rs, "accept_proposals", lambda p, q, u: torch.ones_like(p, dtype=torch.bool))
    monkeypatch.setattr(rs, "_verify_exact", lambda drafts, targets: [*drafts, targets[-1]])
    prompt, joint = exact_joint
    assert chi_square_p_value(_sample(prompt, N, seeded, **SPEC[method]), joint, N) < SIGNIFICANCE


def test_chi_square_helper_is_calibrated():
    """Draws from the reference itself pass; draws from a shifted distribution fail."""
    probs = {k: 1 / 27 for k in product(range(3), repeat=3)}
    gen = torch.Generator().manual_seed(1)
    draws = torch.randint(0, 27, (5000,), generator=gen).tolist()
    keys = list(probs)
    assert chi_square_p_value(Counter(keys[d] for d in draws), probs, 5000) > SIGNIFICANCE
    skewed = [min(d, 25) for d in draws]
    assert chi_square_p_value(Counter(keys[d] for d in skewed), probs, 5000) < SIGNIFICANCE
