"""vLLM's `allowed_token_ids` and `bad_words` (issue 26: they were silently ignored): served by the
sampler, under async scheduling too, and accepted (or refused by name) by the server."""

from __future__ import annotations

import json

import openai
import pytest
from test_server_openai import ERROR_KEYS, post_json

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.engine.llm_engine import bad_words_token_ids
from kvscale.worker.sample.sampler import bad_word_completions
from kvscale.worker.server.protocol import MAX_BAD_WORDS

ENGINE = dict(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=512)
PROMPT = "def fibonacci(n):"
NEW = 24


@pytest.fixture(scope="module")
def llms(target_model):
    return LLM(target_model, **ENGINE), LLM(target_model, async_scheduling=True, **ENGINE)


@pytest.fixture(scope="module")
def reference(llms) -> list[int]:
    return llms[0].generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=NEW))[0].outputs[0].token_ids


def contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i : i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def bad_word_in(llm, reference: list[int], multi: bool) -> tuple[str, list[list[int]]]:
    """A word whose tokenization (as bad_words reads it) occurs in the reference output: of one
    token, or of several."""
    tok = llm.engine.tokenizer
    for length in (2, 3) if multi else (1,):
        for i in range(2, len(reference) - length):
            word = tok.decode(reference[i : i + length]).strip()
            if not word:
                continue
            seqs = bad_words_token_ids(tok, [word])
            if any(contains(reference, s) for s in seqs) and all((len(s) > 1) == multi for s in seqs):
                return word, seqs
    # The reference is greedy on a fixed model: a miss means the model or its tokenizer changed.
    kind = "multi" if multi else "single"
    pytest.fail(f"no {kind}-token word in the reference output: pick another PROMPT")


def test_bad_word_completions_is_vllms_rule():
    words = [[5], [7, 8, 9], [3, 4]]
    assert bad_word_completions(words, []) == {5}
    assert bad_word_completions(words, [1, 7, 8]) == {5, 9}
    assert bad_word_completions(words, [3]) == {5, 4}
    assert bad_word_completions(words, [8, 3, 7]) == {5}


def test_allowed_token_ids_bound_every_sampled_token(llms, reference):
    sync, overlapped = llms
    allowed = sorted(set(reference[NEW // 2 :]) | {11, 12, 13})  # not what greedy picks first
    for params in (
        SamplingParams(temperature=0.0, max_tokens=NEW, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=3, max_tokens=NEW, allowed_token_ids=allowed, ignore_eos=True),
    ):
        want = sync.generate(PROMPT, params)[0].outputs[0].token_ids
        assert want and set(want) <= set(allowed), want
        assert overlapped.generate(PROMPT, params)[0].outputs[0].token_ids == want
    assert want != reference


@pytest.mark.parametrize("multi", [False, True], ids=["one-token", "multi-token"])
def test_bad_words_never_appear_and_async_scheduling_agrees(llms, reference, multi):
    sync, overlapped = llms
    word, seqs = bad_word_in(sync, reference, multi)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, bad_words=[word])
    want = sync.generate(PROMPT, params)[0].outputs[0].token_ids
    assert want != reference
    assert not any(contains(want, s) for s in seqs), (word, seqs, want)
    # Beside a plain request, which runs ahead in every step (a multi-token bad word's row sits
    # out the steps launched while its token is pending: its mask needs that token).
    plain = SamplingParams(temperature=0.0, max_tokens=NEW)
    other = "import numpy as np\n"
    before = overlapped.engine.num_async_steps
    outs = overlapped.generate([PROMPT, other], [params, plain])
    assert outs[0].outputs[0].token_ids == want
    assert outs[1].outputs[0].token_ids == sync.generate(other, plain)[0].outputs[0].token_ids
    assert overlapped.engine.num_async_steps - before >= NEW - 1


def test_the_server_serves_both_fields_and_refuses_bad_ones_by_name(target_model, llms, reference):
    from test_server_hostile import in_process_server

    sync, _ = llms
    word, _ = bad_word_in(sync, reference, multi=True)
    allowed = sorted(set(reference[NEW // 2 :]))
    fields = {"allowed_token_ids": allowed, "bad_words": [word]}
    vocab = sync.engine.vocab_size
    with in_process_server(target_model, **ENGINE) as (base_url, _):
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        for name, value in fields.items():
            params = SamplingParams(temperature=0.0, max_tokens=NEW, **{name: value})
            want = sync.generate(PROMPT, params)[0].outputs[0].text
            got = client.completions.create(
                model=target_model, prompt=PROMPT, max_tokens=NEW, temperature=0.0, extra_body={name: value}
            )
            assert got.choices[0].text == want, name
        body = {"model": target_model, "prompt": PROMPT, "max_tokens": 2}
        chat = {"model": target_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for extra, param in (
            ({"allowed_token_ids": [vocab]}, "allowed_token_ids"),
            ({"allowed_token_ids": []}, "allowed_token_ids"),
            ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
            ({"allowed_token_ids": [True]}, "allowed_token_ids"),
            ({"bad_words": ["  "]}, "bad_words"),
            ({"bad_words": ["x" * 65]}, "bad_words"),
            ({"bad_words": ["x"] * (MAX_BAD_WORDS + 1)}, "bad_words"),
        ):
            for path, base in (("/v1/completions", body), ("/v1/chat/completions", chat)):
                status, _, data = post_json(base_url, path, {**base, **extra})
                error = json.loads(data)["error"]
                assert status == 400 and set(error) == ERROR_KEYS, (extra, status, data[:300])
                assert error["param"].split(".")[0] == param, (extra, error)
