"""Sampler: filters and penalties against plain per-row references, seeding, distribution, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvscale.worker.core.request import Request, RequestStatus
from kvscale.worker.sample.sampler import (
    PenaltyState,
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    argmax_rows,
    token_counts,
)
from kvscale.worker.sample.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 1


def make_request(i: int, prompt: list[int] | None = None, seed: int | None = None, **params) -> Request:
    req = Request(
        request_id=f"r{i}",
        prompt_token_ids=prompt if prompt is not None else [2, 3, 4],
        sampling_params=SamplingParams(seed=seed, **params),
        eos_token_ids=frozenset({EOS}),
        seed=seed,
    )
    return req


def random_logits(seed: int, batch: int, vocab: int) -> torch.Tensor:
    # Continuous random values: ties have probability zero.
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * 3


def kept(row: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(row.tolist()) if v != -math.inf}


def softmax64(values: list[float]) -> list[float]:
    finite = [v for v in values if v != -math.inf]
    top = max(finite)
    exps = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def reference_top_k_top_p(row: list[float], k: int, p: float) -> set[int]:
    vocab = len(row)
    order = sorted(range(vocab), key=lambda i: row[i], reverse=True)
    keep = set(order[:k]) if 0 < k < vocab else set(order)
    if p >= 1.0:
        return keep
    probs = softmax64([row[i] if i in keep else -math.inf for i in range(vocab)])
    mass, result = 0.0, set()
    for i in order:
        if i not in keep:
            break
        # Float32 in the sampler vs float64 here: skip cases that sit on the boundary.
        assume(abs(mass - p) > 1e-5)
        if mass >= p:
            break
        result.add(i)
        mass += probs[i]
    return result


def reference_min_p(row: list[float], min_p: float) -> set[int]:
    probs = softmax64(row)
    top = max(probs)
    threshold = min_p * top
    # The most likely token always survives (min_p <= 1); skip others that sit on the float boundary.
    assume(all(abs(q - threshold) > 1e-6 * top for q in probs if q != top))
    return {i for i, q in enumerate(probs) if q >= threshold}


row_settings = st.tuples(
    st.integers(-1, 40),  # top_k: -1 / 0 / >= vocab are "off"
    st.one_of(st.just(1.0), st.floats(0.01, 1.0)),  # top_p
)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 30),
    rows=st.lists(row_settings, min_size=1, max_size=6),
)
def test_top_k_top_p_matches_reference(seed: int, vocab: int, rows: list[tuple[int, float]]) -> None:
    logits = random_logits(seed, len(rows), vocab)
    top_k = torch.tensor([k for k, _ in rows], dtype=torch.int64)
    top_p = torch.tensor([p for _, p in rows], dtype=torch.float32)
    out = apply_top_k_top_p(logits, top_k, top_p)
    for r, (k, _) in enumerate(rows):
        expected = reference_top_k_top_p(logits[r].tolist(), k, float(top_p[r]))
        assert kept(out[r]) == expected
        # Survivors keep their values exactly.
        for i in expected:
            assert out[r, i] == logits[r, i]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 30),
    ks=st.lists(st.integers(-1, 40), min_size=1, max_size=5),
)
def test_top_k_alone_and_top_p_alone(seed: int, vocab: int, ks: list[int]) -> None:
    logits = random_logits(seed, len(ks), vocab)
    out = apply_top_k_top_p(logits, torch.tensor(ks), None)
    for r, k in enumerate(ks):
        assert kept(out[r]) == reference_top_k_top_p(logits[r].tolist(), k, 1.0)
    top_p = torch.linspace(0.05, 1.0, len(ks))
    out = apply_top_k_top_p(logits, None, top_p)
    for r in range(len(ks)):
        assert kept(out[r]) == reference_top_k_top_p(logits[r].tolist(), 0, float(top_p[r]))
    assert apply_top_k_top_p(logits, None, None) is logits


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 30),
    min_ps=st.lists(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)), min_size=1, max_size=6),
)
def test_min_p_matches_reference(seed: int, vocab: int, min_ps: list[float]) -> None:
    logits = random_logits(seed, len(min_ps), vocab)
    min_p = torch.tensor(min_ps, dtype=torch.float32)
    out = apply_min_p(logits, min_p)
    for r in range(len(min_ps)):
        expected = reference_min_p(logits[r].tolist(), float(min_p[r]))
        assert kept(out[r]) == expected
        assert int(logits[r].argmax()) in expected


def test_tiny_top_p_keeps_exactly_the_most_likely_token() -> None:
    # 1 - 1e-9 rounds to 1.0 in float32, so without the "always keep the top token" rule every token
    # of the row would be dropped.
    logits = random_logits(5, 3, 5000)
    logits[2, 7] = -200.0  # probability underflows to 0 in float32; p == 1 must still keep it
    out = apply_top_k_top_p(logits, None, torch.tensor([1e-9, 1e-3, 1.0]))
    assert kept(out[0]) == {int(logits[0].argmax())}
    assert int(logits[1].argmax()) in kept(out[1])
    assert kept(out[2]) == set(range(5000))


def reference_penalties(
    row: list[float],
    prompt: list[int],
    output: list[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> list[float]:
    row = list(row)
    for t in set(prompt) | set(output):
        row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
    for t in set(output):
        row[t] -= frequency * output.count(t) + presence
    return row


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), data=st.data())
def test_penalties_match_reference(seed: int, data: st.DataObject) -> None:
    vocab = data.draw(st.integers(2, 20))
    batch = data.draw(st.integers(1, 5))
    token = st.integers(0, vocab - 1)
    prompts = [data.draw(st.lists(token, max_size=8)) for _ in range(batch)]
    outputs = [data.draw(st.lists(token, max_size=8)) for _ in range(batch)]
    presence = [data.draw(st.sampled_from([0.0, 0.5, -1.0, 2.0])) for _ in range(batch)]
    frequency = [data.draw(st.sampled_from([0.0, 0.3, -0.7, 2.0])) for _ in range(batch)]
    repetition = [data.draw(st.sampled_from([1.0, 1.3, 0.8, 2.0])) for _ in range(batch)]
    logits = random_logits(seed, batch, vocab)
    out = apply_penalties(
        logits,
        token_counts(prompts, vocab, CPU) > 0,
        token_counts(outputs, vocab, CPU),
        torch.tensor(presence),
        torch.tensor(frequency),
        torch.tensor(repetition),
    )
    for r in range(batch):
        expected = reference_penalties(
            logits[r].tolist(), prompts[r], outputs[r], presence[r], frequency[r], repetition[r]
        )
        assert out[r].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_penalties_through_from_requests() -> None:
    vocab = 12
    reqs = [
        make_request(0, prompt=[2, 3], temperature=0.0, repetition_penalty=1.5),
        make_request(1, prompt=[5, 5], temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25),
        make_request(2, prompt=[7], temperature=0.0),
    ]
    reqs[0].output_token_ids = [3, 4]
    reqs[1].output_token_ids = [6, 6, 8]
    md = SamplingMetadata.from_requests(reqs, vocab, CPU)
    assert not md.no_penalties and md.prompt_mask is not None and md.output_token_counts is not None
    logits = random_logits(7, 3, vocab)
    out = apply_penalties(
        logits,
        md.prompt_mask,
        md.output_token_counts,
        md.presence_penalties,
        md.frequency_penalties,
        md.repetition_penalties,
    )
    for r, req in enumerate(reqs):
        p = req.sampling_params
        expected = reference_penalties(
            logits[r].tolist(),
            req.prompt_token_ids,
            req.output_token_ids,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        assert out[r].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    # Greedy sampling sees the penalised logits.
    tokens = Sampler()(logits, md).sampled_token_ids
    assert tokens.tolist() == out.argmax(dim=-1).tolist()


def test_all_greedy_fast_path() -> None:
    reqs = [make_request(i, temperature=0.0) for i in range(64)]
    md = SamplingMetadata.from_requests(reqs, 50, CPU)
    assert md.all_greedy and not md.all_random and md.no_penalties
    assert md.top_k is None and md.top_p is None and md.min_p is None and md.prompt_mask is None
    assert md.max_num_logprobs is None and not md.noise_seeds and not md.min_tokens
    logits = random_logits(1, 64, 50).to(torch.bfloat16)
    out = Sampler()(logits, md)
    assert out.logprobs is None
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.float().argmax(dim=-1).tolist()


def test_greedy_rows_ignore_filters_and_mix_with_random_rows() -> None:
    vocab = 40
    reqs = [
        make_request(0, temperature=0.0, top_k=3, top_p=0.1, min_p=0.9, seed=5),
        make_request(1, temperature=1.0, top_k=1),
        make_request(2, temperature=0.0),
        make_request(3, temperature=0.7, top_p=0.5),
    ]
    md = SamplingMetadata.from_requests(reqs, vocab, CPU)
    assert not md.all_greedy and not md.all_random
    assert set(md.noise_seeds) == set()  # the seeded row is greedy: no noise needed
    logits = random_logits(3, 4, vocab)
    logits_before = logits.clone()
    tokens = Sampler()(logits, md).sampled_token_ids.tolist()
    argmax = logits.argmax(dim=-1).tolist()
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]
    assert tokens[1] == argmax[1]  # top_k=1 leaves only the argmax
    assert torch.equal(logits, logits_before)  # the caller's logits are untouched


def test_sampled_tokens_stay_inside_the_filters() -> None:
    vocab, batch = 30, 6
    reqs = [
        make_request(0, temperature=1.0, top_k=4),
        make_request(1, temperature=0.5, top_p=0.6),
        make_request(2, temperature=2.0, min_p=0.3),
        make_request(3, temperature=1.3, top_k=6, top_p=0.8, min_p=0.1),
        make_request(4, temperature=1.0, seed=11, top_k=2),
        make_request(5, temperature=1.0),
    ]
    logits = random_logits(9, batch, vocab)
    md = SamplingMetadata.from_requests(reqs, vocab, CPU)
    scaled = logits / md.temperature.unsqueeze(1)
    allowed = apply_min_p(apply_top_k_top_p(scaled, md.top_k, md.top_p), md.min_p)
    # Many copies of each row in one batch (the seeded row's copies with seeds of their own: copies
    # with one seed at one position would all draw the same noise).
    copies = 300
    copied = [r for r in reqs for _ in range(copies)]
    copied[4 * copies : 5 * copies] = [
        make_request(4, temperature=1.0, seed=11 + c, top_k=2) for c in range(copies)
    ]
    md = SamplingMetadata.from_requests(copied, vocab, CPU)
    torch.manual_seed(0)
    tokens = Sampler()(logits.repeat_interleave(copies, dim=0), md).sampled_token_ids.view(batch, copies)
    assert bool((allowed.gather(1, tokens) != -math.inf).all())
    # Not trivially passing: most rows drew several distinct allowed tokens.
    assert all(len(set(row)) == len(kept(allowed[r])) for r, row in enumerate(tokens.tolist()) if r in (0, 4))


def test_seeded_rows_reproduce_and_ignore_batch_neighbours() -> None:
    vocab = 100
    row = random_logits(4, 1, vocab)

    def run(seed_neighbours: int, batch: int, position: int) -> list[int]:
        reqs = [make_request(i, temperature=1.0) for i in range(batch)]
        reqs[position] = make_request(position, temperature=0.9, top_p=0.95, seed=1234)
        logits = random_logits(seed_neighbours, batch, vocab)
        logits[position] = row[0]
        torch.manual_seed(seed_neighbours)
        sampler = Sampler()
        out = []
        for _ in range(20):
            md = SamplingMetadata.from_requests(reqs, vocab, CPU)
            tokens = sampler(logits, md).sampled_token_ids.tolist()
            for req, token in zip(reqs, tokens, strict=True):
                req.append_output_token(token, 0.0)  # the next step samples the next position
            out.append(tokens[position])
        return out

    first = run(seed_neighbours=1, batch=3, position=0)
    assert run(seed_neighbours=1, batch=3, position=0) == first
    assert run(seed_neighbours=2, batch=5, position=3) == first
    assert run(seed_neighbours=3, batch=1, position=0) == first
    assert len(set(first)) > 1  # it really sampled


def test_unseeded_sampling_follows_the_distribution() -> None:
    # One batch of many identical rows over a tiny vocabulary. With a fixed torch seed the run is
    # deterministic; the bound is the chi-square critical value at p = 1e-6, far above what a correct
    # sampler produces, while a wrong one (e.g. temperature or top-k ignored) lands in the thousands.
    draws = 40_000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    cases = [
        (dict(temperature=1.0), base.softmax(-1)),
        (dict(temperature=0.5), (base / 0.5).softmax(-1)),
        (dict(temperature=1.0, top_k=3), base[:3].softmax(-1).tolist() + [0.0] * 3),
    ]
    torch.manual_seed(1234)
    for params, expected in cases:
        expected = torch.as_tensor(expected, dtype=torch.float64)
        reqs = [make_request(0, **params)] * draws
        md = SamplingMetadata.from_requests(reqs, len(base), CPU)
        tokens = Sampler()(base.expand(draws, -1), md).sampled_token_ids
        counts = torch.bincount(tokens, minlength=len(base)).double()
        support = expected > 0
        assert counts[~support].sum() == 0
        want = expected[support] * draws
        chi2 = float(((counts[support] - want) ** 2 / want).sum())
        assert chi2 < 35.9, (params, counts.tolist(), want.tolist())  # df <= 5, p = 1e-6


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    vocab = 10
    logits = torch.full((3, vocab), -5.0)
    logits[:, EOS] = 10.0  # eos wins unless masked
    logits[:, 7] = 9.0
    logits[:, 4] = 8.0
    reqs = [
        make_request(0, temperature=0.0, min_tokens=2, max_tokens=5),
        make_request(1, temperature=0.0, min_tokens=2, max_tokens=5, stop_token_ids=[7]),
        make_request(2, temperature=0.0, min_tokens=2, max_tokens=5),
    ]
    reqs[2].output_token_ids = [3, 3]  # reached min_tokens
    md = SamplingMetadata.from_requests(reqs, vocab, CPU)
    assert md.min_tokens == {0: {EOS}, 1: {EOS, 7}}
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [7, 4, EOS]


def test_logprobs_raw_values_rank_and_top() -> None:
    vocab = 25
    reqs = [
        make_request(0, temperature=1.0, logprobs=3, top_k=5, seed=3),
        make_request(1, temperature=0.0),
        make_request(2, temperature=0.0, logprobs=0, repetition_penalty=2.0),
        make_request(3, temperature=2.0, logprobs=5),
    ]
    md = SamplingMetadata.from_requests(reqs, vocab, CPU)
    assert md.max_num_logprobs == 5
    logits = random_logits(21, 4, vocab)
    raw = logits.log_softmax(dim=-1)
    out = Sampler()(logits, md)
    assert out.logprobs is not None and len(out.logprobs) == 4
    assert out.logprobs[1] is None
    for r, req in enumerate(reqs):
        lp = out.logprobs[r]
        if lp is None:
            continue
        token = int(out.sampled_token_ids[r])
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(raw[r, token]), abs=1e-6)  # unprocessed logits
        assert lp.rank == 1 + int((raw[r] > raw[r, token]).sum())
        descending = raw[r].argsort(descending=True).tolist()
        assert lp.rank == descending.index(token) + 1
        n = req.sampling_params.logprobs
        assert [i for i, _ in lp.top] == descending[:n]
        assert [v for _, v in lp.top] == pytest.approx(raw[r, descending[:n]].tolist(), abs=1e-6)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_logprobs_larger_than_vocab_and_empty_batch() -> None:
    reqs = [make_request(0, temperature=0.0, logprobs=20)]
    md = SamplingMetadata.from_requests(reqs, 4, CPU)
    out = Sampler()(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), md)
    assert out.logprobs is not None and out.logprobs[0] is not None
    assert [i for i, _ in out.logprobs[0].top] == [1, 3, 2, 0]
    assert out.logprobs[0].rank == 1

    md = SamplingMetadata.from_requests([], 4, CPU)
    out = Sampler()(torch.empty(0, 4), md)
    assert out.sampled_token_ids.shape == (0,)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_penalty_state_counts_match_recounting_every_step(data: st.DataObject) -> None:
    """The engine's incremental device counts (new tokens only, rows reused after a request
    finishes, recount after a truncation) equal counting each row's whole output afresh, also
    for speculative rows that add proposed tokens on top."""
    vocab = 9
    state = PenaltyState(vocab, CPU)
    live: list[Request] = []
    for step in range(data.draw(st.integers(1, 12))):
        if not live or data.draw(st.booleans()):
            live.append(
                make_request(
                    step,
                    prompt=data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=5)),
                    repetition_penalty=data.draw(st.sampled_from([1.0, 1.5])),
                    frequency_penalty=data.draw(st.sampled_from([0.0, 0.5])),
                )
            )
        for req in live:
            action = data.draw(st.sampled_from(["grow", "grow", "truncate", "finish"]))
            if action == "grow":
                for t in data.draw(st.lists(st.integers(0, vocab - 1), max_size=3)):
                    req.append_output_token(t, 0.0)
            elif action == "truncate" and req.output_token_ids:
                req.truncate_output(len(req.output_token_ids) - 1)
            elif action == "finish":
                req.status = RequestStatus.FINISHED_STOPPED
        live = [r for r in live if not r.is_finished]
        if not live:
            continue
        extra = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=2)) for _ in live]
        with_state = SamplingMetadata.from_requests(live, vocab, CPU, extra, state)
        afresh = SamplingMetadata.from_requests(live, vocab, CPU, extra)
        assert (with_state.output_token_counts is None) == (afresh.output_token_counts is None)
        if afresh.output_token_counts is None:
            continue
        assert state.num_tracked <= len(live)  # finished requests gave their rows back
        # Rows without a penalty may differ: their counts are never used.
        rows = [
            i
            for i, r in enumerate(live)
            if r.sampling_params.frequency_penalty or r.sampling_params.repetition_penalty != 1.0
        ]
        assert torch.equal(with_state.output_token_counts[rows], afresh.output_token_counts[rows])
        want = [[*live[i].output_token_ids, *extra[i]] for i in rows]
        assert torch.equal(afresh.output_token_counts[rows], token_counts(want, vocab, CPU))
        if afresh.prompt_mask is not None:
            assert with_state.prompt_mask is not None
            rep = [i for i in rows if live[i].sampling_params.repetition_penalty != 1.0]
            assert torch.equal(with_state.prompt_mask[rep], afresh.prompt_mask[rep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows", [1, 2, 8, 64])
def test_argmax_rows_is_torchs_argmax_ties_and_nan_included(dtype, rows):
    # The numpy path (several rows on the CPU) must pick what torch picks: the first maximum, and a
    # NaN over any number.
    gen = torch.Generator().manual_seed(rows)
    x = torch.randint(-3, 4, (rows, 4096), generator=gen).to(dtype)  # small integers: many ties
    x[0, 17] = 9
    x[0, 4000] = 9  # a tie for the maximum: the first wins
    if rows > 1:
        x[1, 5] = float("nan")
        x[1, 6] = float("nan")
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[0] == 17 and (rows == 1 or got[1] == 5)
