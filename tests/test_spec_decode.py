"""Speculative decoding keeps greedy output token-identical, for both proposers, in every batch shape
the engine builds: mixed batches, chunked prefill, prefix-cache hits, forced preemption."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_fixtures import DRAFT, TARGET

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.bench.workload import code_workload
from kvscale.worker.config import EngineArgs
from kvscale.worker.model.loader import load_tokenizer
from kvscale.worker.spec_decode.ngram_proposer import NgramIndex, ngram_propose

pytestmark = pytest.mark.skipif(not (TARGET.is_dir() and DRAFT.is_dir()), reason="model pair missing")

PROPOSERS = {
    "draft": dict(draft_model=str(DRAFT)),
    "ngram": dict(speculative_method="ngram"),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    wl = code_workload(load_tokenizer(str(TARGET)), 10, seed=3, prompt_len=(48, 8, 160), code_only=True)
    # Two requests share a long prefix, so prefix caching serves one from the other.
    return [*wl.prompts, wl.prompts[0] + wl.prompts[1][1:20]]


def _params(n: int) -> list[SamplingParams]:
    # Different lengths, so requests finish (and speculation caps) at different steps.
    return [SamplingParams(temperature=0.0, max_tokens=24 + 7 * (i % 5), ignore_eos=True) for i in range(n)]


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    llm = LLM(str(TARGET), num_kv_blocks=512, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _params(len(prompts)))]


@pytest.mark.parametrize("method", sorted(PROPOSERS))
@pytest.mark.parametrize(
    "shape",
    [
        dict(num_kv_blocks=512),  # everything at once, prefix caching on (the default)
        dict(num_kv_blocks=40, max_num_batched_tokens=64),  # chunked prefill and forced preemption
        dict(num_kv_blocks=512, max_num_seqs=3, enable_prefix_caching=False),  # requests join as slots free
    ],
    ids=["batched", "preempting", "joining"],
)
def test_greedy_token_identical(method, shape, prompts, reference):
    llm = LLM(str(TARGET), **shape, **PROPOSERS[method], num_speculative_tokens=4, speculative_adaptive=False)
    outputs = llm.generate(prompts, _params(len(prompts)))
    assert [o.outputs[0].token_ids for o in outputs] == reference
    engine = llm.engine
    proposed = sum(o.outputs[0].num_draft_tokens for o in outputs)
    accepted = sum(o.outputs[0].num_accepted_tokens for o in outputs)
    assert proposed > 0 and 0 < accepted < proposed  # speculation ran, and was partly rejected
    if shape["num_kv_blocks"] == 40:
        assert engine.scheduler.num_preemptions > 0
    if shape["num_kv_blocks"] == 512 and shape.get("enable_prefix_caching", True):
        assert engine.kv_cache_manager.prefix_cache_stats.hits > 0
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0  # nothing leaked


def test_mixed_batch_with_and_without_speculation(prompts, reference):
    """Sampled and greedy requests, long and one-token ones, share a speculating batch."""
    llm = LLM(str(TARGET), num_kv_blocks=512, draft_model=str(DRAFT), speculative_adaptive=False)
    params = _params(len(prompts))
    params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30)
    params[2] = SamplingParams(temperature=0.0, max_tokens=1)  # nothing to speculate
    outputs = llm.generate(prompts, params)
    for i, out in enumerate(outputs):
        if i not in (1, 2):
            assert out.outputs[0].token_ids == reference[i]
    assert outputs[2].outputs[0].token_ids == reference[2][:1]
    assert outputs[2].outputs[0].num_draft_tokens == 0
    assert len(outputs[1].outputs[0].token_ids) == 30


@pytest.mark.parametrize("method", sorted(PROPOSERS))
def test_sampling_parameters_keep_their_meaning(method, prompts):
    """Penalties, min_tokens, logprobs and stop strings inside an accepted run: same as without."""
    plain = LLM(str(TARGET), num_kv_blocks=512)
    spec = LLM(str(TARGET), num_kv_blocks=512, **PROPOSERS[method], speculative_adaptive=False)
    base = plain.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    # A stop string that first appears in the middle of the text, likely inside a multi-token run.
    text = base[3].outputs[0].text
    stop_text = text[len(text) // 2 : len(text) // 2 + 3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_text], ignore_eos=True),
    ]
    want = plain.generate(prompts[:4], params)
    got = spec.generate(prompts[:4], params)
    for w, g in zip(want, got, strict=True):
        w0, g0 = w.outputs[0], g.outputs[0]
        assert g0.token_ids == w0.token_ids
        assert g0.text == w0.text
        assert (g0.finish_reason, g0.stop_reason) == (w0.finish_reason, w0.stop_reason)
    assert got[3].outputs[0].stop_reason == stop_text
    for lw, lg in zip(want[2].outputs[0].logprobs, got[2].outputs[0].logprobs, strict=True):
        assert lg.token_id == lw.token_id and lg.rank == lw.rank
        assert lg.logprob == pytest.approx(lw.logprob, abs=1e-3)
        assert [t for t, _ in lg.top] == [t for t, _ in lw.top]
    assert sum(o.outputs[0].num_accepted_tokens for o in got) > 0


def test_stats_count_proposals_and_acceptance(prompts):
    llm = LLM(str(TARGET), num_kv_blocks=512, draft_model=str(DRAFT), num_speculative_tokens=3,
              speculative_adaptive=False)  # fmt: skip
    outputs = llm.generate(prompts[:3], _params(3))
    stats = llm.engine.take_stats()
    assert stats.num_draft_tokens == sum(o.outputs[0].num_draft_tokens for o in outputs)
    assert stats.num_accepted_tokens == sum(o.outputs[0].num_accepted_tokens for o in outputs)
    assert len(stats.accepted_per_position) == 3
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    # A token at position j is only accepted after every position before it.
    assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)
    assert stats.num_drafts >= stats.accepted_per_position[0]


def test_adaptive_engine_profiles_costs_and_stays_identical(prompts, reference):
    llm = LLM(str(TARGET), num_kv_blocks=512, speculative_method="ngram", num_speculative_tokens=6)
    costs = llm.engine.spec_decoder.costs
    assert costs is not None and costs.lookaheads[0] == 0 and costs.lookaheads[-1] == 6
    assert all(t > 0 for row in costs.target for t in row)
    outputs = llm.generate(prompts, _params(len(prompts)))
    assert [o.outputs[0].token_ids for o in outputs] == reference


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(speculative_method="medusa"), "speculative_method must be draft or ngram"),
        (dict(speculative_method="draft"), "needs draft_model"),
        (
            dict(speculative_method="ngram", num_speculative_tokens=0),
            r"num_speculative_tokens must be in \[1, 16\]",
        ),
        (dict(speculative_method="ngram", draft_model="x"), "only used with speculative_method 'draft'"),
        (dict(speculative_method="ngram", ngram_prompt_lookup_min=5), "ngram_prompt_lookup_min"),
    ],
)
def test_bad_speculative_args_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="m", **kwargs)


def test_draft_model_alone_implies_the_draft_method():
    args = EngineArgs(model="m", draft_model="d")
    assert (args.speculative_method, args.num_speculative_tokens) == ("draft", 4)


def test_draft_with_another_vocabulary_is_refused(random_model_factory, tmp_path):
    from kvscale.worker.testing.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "other-vocab", seed=2)  # its own locally trained tokenizer
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(TARGET), num_kv_blocks=64, draft_model=str(other))


@pytest.mark.parametrize(
    ("tokens", "k", "want"),
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),  # the longest suffix (1 2 3) matched
        ([1, 2, 3, 9, 2, 3, 8, 2, 3], 2, [8, 2]),  # the most recent occurrence wins
        ([1, 2, 3, 4], 3, []),  # nothing repeats
        ([5, 6, 5, 6], 8, [5, 6]),  # a proposal never runs past the known tokens
        ([7], 3, []),
    ],
)
def test_ngram_propose(tokens, k, want):
    assert ngram_propose(tokens, k, max_n=4, min_n=2) == want


def test_server_flags_and_metrics(tmp_path):
    """The CLI flags reach the engine, completions match plain greedy, and /metrics counts the
    proposals under our names and vLLM's."""
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from server_fixtures import start_server

    plain = LLM(str(TARGET), num_kv_blocks=256)
    prompt = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument("
    want = plain.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))[0]
    flags = ["--num-kv-blocks", "256", "--speculative-method", "draft", "--draft-model", str(DRAFT),
             "--num-speculative-tokens", "3", "--no-speculative-adaptive"]  # fmt: skip
    server = start_server(str(TARGET), tmp_path, *flags)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        got = client.completions.create(
            model=str(TARGET), prompt=prompt, max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == want.outputs[0].text
        details = got.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
        status, body = server.get("/metrics")
        assert status == 200
        samples = {
            (s.name, s.labels.get("position")): s.value
            for f in text_string_to_metric_families(body.decode())
            for s in f.samples
        }
        for ours, vllm in [
            ("kvscale_spec_decode_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
            ("kvscale_spec_decode_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"),
            ("kvscale_spec_decode_drafts_total", "vllm:spec_decode_num_drafts_total"),
        ]:
            assert samples[(ours, None)] == samples[(vllm, None)] > 0
        per_pos = [
            samples[("kvscale_spec_decode_accepted_tokens_per_position_total", str(j))] for j in range(3)
        ]
        assert sum(per_pos) == samples[("kvscale_spec_decode_accepted_tokens_total", None)]
    finally:
        assert server.stop() == 0, server.log()


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=20),
    k=st.integers(1, 5),
)
def test_ngram_index_proposes_what_a_full_scan_does(tokens, cuts, k):
    """The incremental index (extended with the new tokens at each step, rebuilt if the sequence
    shrinks) proposes exactly what scanning the whole history does."""
    index = NgramIndex(max_n=4, min_n=2)
    end = 0
    for cut in cuts:
        end = min(len(tokens), end + cut)
        assert index.propose(tokens[:end], k) == ngram_propose(tokens[:end], k, max_n=4, min_n=2)
    shorter = tokens[: max(1, end // 2)]
    assert index.propose(shorter, k) == ngram_propose(shorter, k, max_n=4, min_n=2)


PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)


def test_greedy_with_penalties_matches_recounting_with_and_without_speculation(prompts):
    """Penalties from the engine's incremental device counts give the tokens that recounting every
    request's whole output each step gives (the engine's former way), with speculation on too
    (the verifier's and the draft's rows count the proposals before them)."""
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, **PENALTIES)] * 4

    def run(recount: bool, **spec) -> list[list[int]]:
        llm = LLM(str(TARGET), num_kv_blocks=512, **spec)
        runner = llm.engine.runner
        if recount:  # no state: SamplingMetadata counts each row's output list afresh
            runner.penalty_state = None
            if runner.draft is not None:
                runner.draft.penalty_state = None
        return [o.outputs[0].token_ids for o in llm.generate(prompts[:4], params)]

    reference = run(recount=True)
    assert run(recount=False) == reference
    spec = dict(num_speculative_tokens=4, speculative_adaptive=False)
    for method in sorted(PROPOSERS):
        assert run(recount=False, **PROPOSERS[method], **spec) == reference
    sampled = [SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True, **PENALTIES)]
    draft = dict(**PROPOSERS["draft"], **spec)
    a = LLM(str(TARGET), num_kv_blocks=512, **draft).generate(prompts[:1], sampled)
    llm = LLM(str(TARGET), num_kv_blocks=512, **draft)
    llm.engine.runner.penalty_state = llm.engine.runner.draft.penalty_state = None
    b = llm.generate(prompts[:1], sampled)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
