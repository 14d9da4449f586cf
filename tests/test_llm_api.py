"""The offline API end to end: `LLM(model).generate(prompts, params)` on the trained target model.

Covers seeded sampling, stop conditions, n > 1, abort, logprobs, error handling, metrics, prompt
forms and dtype. One engine per module keeps the file fast on a 2-core CPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvscale.worker import LLM, RequestOutput, SamplingParams

# A prompt after which the target model greedily emits </s> at once.
EOS_PROMPT = "if __name__ == '__main__':\n    main()\n"
EOS_ID = 1
CODE_PROMPTS = ["import os\n", "def add(a, b):\n", "class Foo:\n    def __init__(self):\n", "x = 1\n"]


@pytest.fixture(scope="module")
def llm(target_model: str) -> LLM:
    # float32 so that logprobs can be compared with transformers on any device.
    return LLM(target_model, num_kv_blocks=256, dtype="float32")


@pytest.fixture(scope="module")
def hf_model(target_model: str):
    return AutoModelForCausalLM.from_pretrained(target_model, dtype=torch.float32).eval()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def tokens(out: RequestOutput) -> list[int]:
    return out.outputs[0].token_ids


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(4, 4096) for _ in range(length - 1)]


@torch.no_grad()
def hf_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each position that produced an output token."""
    logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(output_ids)].log_softmax(-1)


def assert_greedy_consistent(hf_model, prompt_ids: list[int], output_ids: list[int]) -> None:
    """Every greedy token is transformers' argmax (up to float ties)."""
    lp = hf_logprobs(hf_model, prompt_ids, output_ids)
    for j, t in enumerate(output_ids):
        gap = (lp[j].max() - lp[j, t]).item()
        assert gap <= 1e-4, f"token {j}: {t} is not the argmax (gap {gap})"


def assert_engine_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.num_unfinished_requests == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv_cache_manager.usage() == 0.0
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


# -- 1. seeded sampling -----------------------------------------------------------------------
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=24)


def test_seeded_sampling_reproduces_alone_and_in_any_batch_position(llm: LLM) -> None:
    prompt = "def add(a, b):\n"
    first = tokens(llm.generate(prompt, SEEDED)[0])
    assert len(first) == 24
    assert tokens(llm.generate(prompt, SEEDED)[0]) == first

    others = [SamplingParams(temperature=1.0, max_tokens=20), greedy(10)]
    batch = llm.generate([CODE_PROMPTS[0], prompt, CODE_PROMPTS[2]], [others[0], SEEDED, others[1]])
    assert tokens(batch[1]) == first
    batch = llm.generate([prompt, CODE_PROMPTS[3], CODE_PROMPTS[1]], [SEEDED, others[1], others[0]])
    assert tokens(batch[0]) == first


def test_different_seeds_give_different_samples(llm: LLM) -> None:
    prompt = "def add(a, b):\n"
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=24) for s in range(123, 127)]
    outs = llm.generate([prompt] * len(params), params)
    assert len({tuple(tokens(o)) for o in outs}) >= 3


def test_unseeded_sampling_differs_across_calls(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=24)
    runs = {tuple(tokens(llm.generate("import os\n", params)[0])) for _ in range(3)}
    assert len(runs) > 1


# -- 2. stop conditions -----------------------------------------------------------------------
def test_stop_string_truncates_text_before_its_first_occurrence(llm: LLM) -> None:
    prompt = "import os\n"
    ref = llm.generate(prompt, greedy(48))[0].outputs[0]
    text = ref.text
    k = next(i for i in range(15, len(text) - 3) if text.find(text[i : i + 3]) == i)
    stop = text[k : k + 3]
    later = next(text[i : i + 3] for i in range(k + 5, len(text) - 3) if text.find(text[i : i + 3]) == i)
    params = [
        greedy(48, stop=[stop]),
        greedy(48, stop=[stop], include_stop_str_in_output=True),
        greedy(48, stop=[later, stop]),  # the earliest occurrence wins, whatever the list order
        greedy(48, stop=["this string never appears"]),
    ]
    plain, incl, two, absent = (o.outputs[0] for o in llm.generate([prompt] * 4, params))

    assert plain.text == text[:k]
    assert (plain.finish_reason, plain.stop_reason) == ("stop", stop)
    assert plain.token_ids == ref.token_ids[: len(plain.token_ids)]
    assert len(plain.token_ids) < len(ref.token_ids)
    assert incl.text == text[: k + 3] and incl.text.endswith(stop)
    assert (incl.finish_reason, incl.stop_reason) == ("stop", stop)
    assert (two.text, two.stop_reason) == (text[:k], stop)
    assert (absent.text, absent.finish_reason, absent.stop_reason) == (text, "length", None)


def test_stop_string_completed_by_the_last_allowed_token_reports_stop(llm: LLM) -> None:
    prompt = "import os\n"
    ref = tokens(llm.generate(prompt, greedy(24))[0])
    texts = [o.outputs[0].text for o in llm.generate([prompt] * 6, [greedy(n) for n in range(3, 9)])]
    # The token that reaches max_tokens is also the one that completes the stop string.
    n, text = next((n, t) for n, t in zip(range(3, 9), texts, strict=True) if t[-3:].strip())
    stop = text[-3:]
    assert text.find(stop) == len(text) - 3
    out = llm.generate(prompt, greedy(n, stop=[stop]))[0].outputs[0]
    assert out.token_ids == ref[:n]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:-3], "stop", stop)


def test_stop_token_id_ends_output_and_is_excluded_from_text(llm: LLM) -> None:
    prompt = "class Foo:\n    def __init__(self):\n"
    ref = tokens(llm.generate(prompt, greedy(32))[0])
    i = next(j for j in range(4, len(ref)) if ref[j] not in ref[:j])  # the 5th token, if new
    stop_id = ref[i]
    out, prefix = (
        o.outputs[0] for o in llm.generate([prompt] * 2, [greedy(32, stop_token_ids=[stop_id]), greedy(i)])
    )
    assert out.token_ids == ref[: i + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.text == prefix.text  # the text of the tokens before the stop token


def test_eos_finishes_with_stop_unless_ignored(llm: LLM) -> None:
    eos, ignored = (
        o.outputs[0] for o in llm.generate([EOS_PROMPT] * 2, [greedy(16), greedy(5, ignore_eos=True)])
    )
    assert eos.token_ids == [EOS_ID]
    assert (eos.finish_reason, eos.stop_reason, eos.text) == ("stop", None, "")
    assert len(ignored.token_ids) == 5 and ignored.finish_reason == "length"


def test_max_tokens_finishes_with_length(llm: LLM) -> None:
    outs = llm.generate(CODE_PROMPTS, [greedy(n, ignore_eos=True) for n in (1, 7, 16, 33)])
    for out, n in zip(outs, (1, 7, 16, 33), strict=True):
        assert len(tokens(out)) == n
        assert out.outputs[0].finish_reason == "length"


def test_min_tokens_delays_eos_and_stop_token_ids(llm: LLM) -> None:
    prompt = "print("
    ref = tokens(llm.generate(prompt, greedy(16))[0])
    # A token greedy emits within the first three and keeps emitting later on.
    stop_id = next(t for t in ref[:3] if t != EOS_ID and t in ref[5:])
    early = llm.generate(prompt, greedy(16, stop_token_ids=[stop_id]))[0].outputs[0]
    assert len(early.token_ids) <= 3 and early.finish_reason == "stop"

    params = [greedy(16, stop_token_ids=[stop_id], min_tokens=5), greedy(16, min_tokens=5)]
    delayed, eos_delayed = (o.outputs[0] for o in llm.generate([prompt, EOS_PROMPT], params))
    assert len(delayed.token_ids) >= 5
    assert delayed.token_ids.index(stop_id) == len(delayed.token_ids) - 1  # no earlier occurrence
    assert (delayed.finish_reason, delayed.stop_reason) == ("stop", stop_id)
    assert len(eos_delayed.token_ids) >= 5
    assert EOS_ID not in eos_delayed.token_ids[:5]


# -- 3. n > 1 -----------------------------------------------------------------------------------
def test_n_sampled_completions_are_distinct_and_finished(llm: LLM) -> None:
    out = llm.generate("def add(a, b):\n", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert out.finished and all(c.finish_reason is not None for c in out.outputs)
    again = llm.generate("def add(a, b):\n", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_n_greedy_completions_are_identical(llm: LLM) -> None:
    out = llm.generate("import os\n", SamplingParams(n=2, temperature=0.0, max_tokens=12))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    a, b = out.outputs
    assert a.token_ids == b.token_ids and a.text == b.text and len(a.token_ids) == 12


def test_n_siblings_share_the_prompt_through_the_prefix_cache(llm: LLM, hf_model) -> None:
    stats = llm.engine.kv_cache_manager.prefix_cache_stats
    before = stats.hits
    prompt = random_prompt(seed=41, length=100)  # 6 full blocks of 16, never seen before
    out = llm.generate(prompt, SamplingParams(n=4, temperature=0.0, max_tokens=8))[0]
    assert stats.hits - before >= 3 * 96  # siblings 1..3 each reuse the 6 full prompt blocks
    first = out.outputs[0].token_ids
    assert all(c.token_ids == first for c in out.outputs)
    assert_greedy_consistent(hf_model, prompt, first)
    assert_engine_idle(llm)


# -- 4. abort -----------------------------------------------------------------------------------
def test_abort_frees_everything_and_engine_keeps_serving(target_model: str, llm: LLM) -> None:
    small = LLM(target_model, num_kv_blocks=64, max_num_seqs=2, dtype="float32")
    engine = small.engine
    ids = [
        engine.add_request(random_prompt(seed=i, length=20 + 7 * i), greedy(40, ignore_eos=True))
        for i in range(4)
    ]
    ids.append(engine.add_request("import os\n", SamplingParams(n=2, temperature=1.0, max_tokens=40)))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.running and engine.scheduler.waiting
    assert engine.kv_cache_manager.block_pool.num_used_blocks > 0

    engine.abort_request([*ids, "no-such-request"])
    engine.abort_request("no-such-request")
    assert_engine_idle(small)
    assert engine.step() == []

    prompt = random_prompt(seed=99, length=30)
    after = small.generate(prompt, greedy(20, ignore_eos=True))[0]
    assert tokens(after) == tokens(llm.generate(prompt, greedy(20, ignore_eos=True))[0])
    assert_engine_idle(small)


# -- 5. logprobs --------------------------------------------------------------------------------
def test_logprobs_match_transformers(llm: LLM, hf_model) -> None:
    out = llm.generate("def add(a, b):\n", greedy(12, logprobs=3))[0]
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    ref = hf_logprobs(hf_model, out.prompt_token_ids, completion.token_ids)
    for j, (t, lp) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert lp.token_id == t and lp.rank == 1
        assert len(lp.top) == 3 and lp.top[0][0] == t
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert lp.logprob == pytest.approx(ref[j, t].item(), abs=1e-4)
        for tid, v in lp.top:
            assert v == pytest.approx(ref[j, tid].item(), abs=1e-4)
        assert [tid for tid, _ in lp.top] == ref[j].topk(3).indices.tolist()


def test_no_logprobs_unless_asked(llm: LLM) -> None:
    assert llm.generate("x = 1\n", greedy(4))[0].outputs[0].logprobs is None


# -- 6. errors ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def short_llm(target_model: str) -> LLM:
    # 4 blocks of 8 tokens: a request may grow to 32 tokens; the model takes 64.
    return LLM(target_model, max_model_len=64, num_kv_blocks=4, block_size=8)


def test_prompt_longer_than_max_model_len_is_rejected(short_llm: LLM) -> None:
    with pytest.raises(ValueError, match="maximum model length of 64"):
        short_llm.generate(random_prompt(seed=1, length=65), greedy(1))
    ok = random_prompt(seed=2, length=10)
    with pytest.raises(ValueError, match="maximum model length"):
        short_llm.generate([ok, random_prompt(seed=3, length=80), ok], greedy(4))
    assert_engine_idle(short_llm)
    assert len(tokens(short_llm.generate(ok, greedy(4, ignore_eos=True))[0])) == 4


def test_request_larger_than_the_kv_pool_is_rejected(short_llm: LLM) -> None:
    with pytest.raises(ValueError, match="KV blocks"):
        short_llm.generate(random_prompt(seed=4, length=20), greedy(30))
    assert_engine_idle(short_llm)


@pytest.mark.parametrize("bad", [[0, 4096], [0, -1], [0, 5, 100_000]])
def test_out_of_vocab_token_ids_are_rejected(llm: LLM, bad: list[int]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(bad, greedy(2))
    assert_engine_idle(llm)


def test_empty_prompt_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.engine.add_request([], greedy(2))
    assert_engine_idle(llm)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(n=0), "n must"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=100), "logprobs"),
        (dict(min_tokens=8, max_tokens=4), "min_tokens"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_a_bad_prompt_of_any_kind_leaves_nothing_queued(llm: LLM) -> None:
    with pytest.raises(TypeError):
        llm.generate(["import os\n", None], greedy(4))  # type: ignore[list-item]
    assert_engine_idle(llm)


def test_explicit_and_automatic_request_ids_never_collide(llm: LLM) -> None:
    engine = llm.engine
    upcoming = str(int(engine.add_request("x = 1\n", greedy(2))) + 1)
    engine.add_request("x = 1\n", greedy(2), request_id=upcoming)  # the id the counter gives next
    engine.add_request("x = 1\n", greedy(2), request_id="dup#1")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x = 1\n", greedy(2), request_id=upcoming)
    # Its second sequence would be called dup#1: nothing of the n=2 request may stay queued.
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x = 1\n", SamplingParams(n=2, max_tokens=2), request_id="dup")
    assert len(engine.scheduler.requests) == 3
    assert len(llm.generate(["import os\n", "x = 1\n"], greedy(3))) == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_idle(llm)


def test_mismatched_params_list_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [greedy(2)])


def test_unknown_engine_argument_is_a_type_error(target_model: str) -> None:
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(target_model, max_num_sequences=4)


def test_missing_model_folder_is_file_not_found(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "no-such-model"))


# -- 7. metrics -------------------------------------------------------------------------------
def test_completion_metrics_are_consistent(llm: LLM) -> None:
    params = [greedy(10), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6), greedy(16, stop=["\n"])]
    outs = llm.generate([*CODE_PROMPTS[:2], EOS_PROMPT], params)
    completions = [c for o in outs for c in o.outputs]
    assert len(completions) == 4
    for c in completions:
        m = c.metrics
        assert c.finished
        assert m.time_to_first_token is not None and m.time_to_first_token > 0
        assert len(m.token_times) == len(c.token_ids)
        assert all(a <= b for a, b in zip(m.token_times, m.token_times[1:], strict=False))
        assert len(m.inter_token_latencies) == len(c.token_ids) - 1
        assert all(x >= 0 for x in m.inter_token_latencies)
        assert m.e2e_latency is not None and m.e2e_latency >= m.time_to_first_token
        assert m.queue_time is not None and 0 <= m.queue_time <= m.time_to_first_token


def test_num_cached_tokens_reports_a_shared_prefix(llm: LLM) -> None:
    shared = random_prompt(seed=123, length=64)
    first = llm.generate([*shared, 7, 8, 9], greedy(4))[0]
    assert first.num_cached_tokens == 0
    second = llm.generate([*shared, 10, 11], greedy(4))[0]
    assert second.num_cached_tokens == 64


# -- 8. prompt forms ----------------------------------------------------------------------------
def test_string_and_token_id_prompts_agree(llm: LLM) -> None:
    text = "def add(a, b):\n"
    ids = llm.get_tokenizer().encode(text)
    assert ids[0] == 0  # the tokenizer adds <s>
    by_text, by_ids = llm.generate([text, ids], greedy(12))
    assert by_text.prompt_token_ids == ids and by_ids.prompt_token_ids == ids
    assert (by_text.prompt, by_ids.prompt) == (text, None)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == by_ids.outputs[0].text

    single_text = llm.generate(text, greedy(12))
    single_ids = llm.generate(ids, greedy(12))
    assert len(single_text) == len(single_ids) == 1
    assert tokens(single_text[0]) == tokens(single_ids[0]) == tokens(by_text)


def test_outputs_come_back_in_prompt_order(llm: LLM) -> None:
    # Different lengths finish in a different order than they were submitted.
    outs = llm.generate(CODE_PROMPTS, [greedy(n, ignore_eos=True) for n in (20, 3, 11, 1)])
    assert [o.prompt for o in outs] == CODE_PROMPTS
    assert [len(tokens(o)) for o in outs] == [20, 3, 11, 1]
    assert llm.generate([]) == []


# -- 9. dtype -------------------------------------------------------------------------------------
def test_bfloat16_weights_and_kv_cache(random_model_factory) -> None:
    llm = LLM(random_model_factory("llama-gqa"), dtype="bfloat16", num_kv_blocks=32)
    runner = llm.engine.runner
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert {t.dtype for layer in runner.kv_caches for t in layer} == {torch.bfloat16}
    out = llm.generate([[0, 5, 6, 7], "import os\n"], greedy(9, ignore_eos=True))
    assert [len(tokens(o)) for o in out] == [9, 9]
    assert all(o.outputs[0].finish_reason == "length" for o in out)


# -- 8. deltas --------------------------------------------------------------------------------
def test_step_outputs_carry_only_new_tokens_and_add_up_to_generate(llm: LLM) -> None:
    """engine.step hands back deltas: each sequence's new tokens, logprobs, token times and text
    only (so a step costs what it produces, not the whole output so far), and the deltas of a
    request add up to exactly what LLM.generate returns for it."""
    prompts = [CODE_PROMPTS[0], CODE_PROMPTS[2]]
    params = [
        greedy(20, logprobs=2, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=16, logprobs=1, stop=["\n\n"]),
    ]
    whole = llm.generate(prompts, params)
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    deltas: dict[tuple[str, int], list] = {}
    finished: set[str] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finished
            finished |= {out.request_id} if out.finished else set()
            for c in out.outputs:
                assert len(c.token_ids) == 1  # one new token per decode step (no speculation)
                assert c.logprobs is not None and len(c.logprobs) == 1
                assert len(c.metrics.token_times) == 1
                deltas.setdefault((out.request_id, c.index), []).append(c)
    assert finished == set(ids)
    for rid, out in zip(ids, whole, strict=True):
        for c in out.outputs:
            parts = deltas[(rid, c.index)]
            assert [t for d in parts for t in d.token_ids] == c.token_ids
            assert "".join(d.text for d in parts) == c.text
            assert [lp for d in parts for lp in d.logprobs] == c.logprobs
            assert parts[-1].finish_reason == c.finish_reason and c.finish_reason is not None
            assert all(d.finish_reason is None for d in parts[:-1])
            assert len(c.metrics.token_times) == len(c.token_ids)
            assert c.metrics.first_token_time == c.metrics.token_times[0]
            assert all(d.metrics.first_token_time == parts[0].metrics.token_times[0] for d in parts)
    assert_engine_idle(llm)


def test_stream_interval_gathers_tokens_into_fewer_deltas_that_add_up_to_the_same(llm: LLM) -> None:
    """With stream_interval 4 a sequence's first token comes alone, then deltas of 4 tokens, then
    its last (shorter, or cut by a stop string whose held-back text never went out); together
    they are exactly LLM.generate's output, text and logprobs included."""
    prompts = [CODE_PROMPTS[0], CODE_PROMPTS[2], CODE_PROMPTS[1]]
    params = [
        greedy(22, logprobs=2, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=16, logprobs=1, stop=["\n\n"]),
        greedy(30, stop=["):"], include_stop_str_in_output=False),
    ]
    whole = llm.generate(prompts, params)
    engine = llm.engine
    engine.args.stream_interval = 4
    try:
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        deltas: dict[tuple[str, int], list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    deltas.setdefault((out.request_id, c.index), []).append(c)
    finally:
        engine.args.stream_interval = 1
    for rid, out in zip(ids, whole, strict=True):
        for c in out.outputs:
            parts = deltas[(rid, c.index)]
            sizes = [len(d.token_ids) for d in parts]
            assert sizes[0] == 1 and all(n == 4 for n in sizes[1:-1]), sizes
            assert len(parts) == 1 or 1 <= sizes[-1] <= 4, sizes
            assert [t for d in parts for t in d.token_ids] == c.token_ids
            assert "".join(d.text for d in parts) == c.text
            assert [lp for d in parts for lp in d.logprobs or []] == (c.logprobs or [])
            assert sum(len(d.metrics.token_times) for d in parts) == len(c.token_ids)
            assert parts[-1].finish_reason == c.finish_reason and c.finish_reason is not None
            assert all(d.finish_reason is None for d in parts[:-1])
    assert_engine_idle(llm)


def test_stream_interval_below_one_is_refused() -> None:
    from kvscale.worker.config import EngineArgs

    with pytest.raises(ValueError, match="stream_interval must be at least 1, got 0"):
        EngineArgs(model="m", stream_interval=0)
