"""Logprobs: exactly one entry per emitted token under speculative decoding, whatever ends the run."""

from __future__ import annotations

import pytest
from model_fixtures import DRAFT, TARGET

from kvscale.worker import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not (TARGET.is_dir() and DRAFT.is_dir()), reason="model pair missing")

# Repetitive code: n-gram lookup and the draft both get long accepted runs.
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
PROPOSERS = {"draft": dict(draft_model=str(DRAFT)), "ngram": dict(speculative_method="ngram")}
N = 40


@pytest.fixture(scope="module")
def reference() -> list[int]:
    llm = LLM(str(TARGET), num_kv_blocks=128)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True))
    return out[0].outputs[0].token_ids


def _first_new_positions(tokens: list[int]) -> list[int]:
    """Positions (after the first few) where a token appears for the first time: stopping on that
    token id ends the output exactly there."""
    seen: set[int] = set()
    out = []
    for k, t in enumerate(tokens):
        if t not in seen and k >= 3:
            out.append(k)
        seen.add(t)
    return out


@pytest.mark.parametrize("method", sorted(PROPOSERS))
def test_one_logprob_per_token_when_a_stop_ends_an_accepted_run(method, reference):
    llm = LLM(
        str(TARGET),
        num_kv_blocks=512,
        **PROPOSERS[method],
        num_speculative_tokens=4,
        speculative_adaptive=False,
    )
    base = dict(temperature=0.0, logprobs=2)
    cases: list[tuple[SamplingParams, int]] = []  # params, expected output length
    for m in range(2, 20):  # max_tokens at every offset of the runs
        cases.append((SamplingParams(**base, max_tokens=m, ignore_eos=True), m))
    stops = _first_new_positions(reference)[:8]
    assert len(stops) >= 4
    for k in stops:  # a stop token inside a run; the stop token is emitted, its logprob too
        cases.append(
            (SamplingParams(**base, max_tokens=N, stop_token_ids=[reference[k]], ignore_eos=True), k + 1)
        )
    outputs = llm.generate([PROMPT] * len(cases), [p for p, _ in cases])

    # EOS inside a run: the engine's EOS set is read when a request is made.
    eos_pos = stops[len(stops) // 2]
    llm.engine.eos_token_ids = frozenset({reference[eos_pos]})
    eos_out = llm.generate([PROMPT], SamplingParams(**base, max_tokens=N))[0]
    outputs.append(eos_out)
    cases.append((SamplingParams(**base), eos_pos + 1))

    accepted = 0
    for out, (params, length) in zip(outputs, cases, strict=True):
        c = out.outputs[0]
        assert c.token_ids == reference[:length], params
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids), (params, len(c.logprobs))
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
        assert all(len(lp.top) == 2 for lp in c.logprobs)
        accepted += c.num_accepted_tokens
    assert accepted > 0  # speculation really ran


@pytest.mark.parametrize("method", sorted(PROPOSERS))
def test_one_logprob_per_token_when_a_stop_string_ends_an_accepted_run(method, reference):
    llm = LLM(
        str(TARGET),
        num_kv_blocks=512,
        **PROPOSERS[method],
        num_speculative_tokens=4,
        speculative_adaptive=False,
    )
    tok = llm.engine.tokenizer
    texts = [tok.decode(reference[: k + 1]) for k in range(len(reference))]
    # Stop strings that first occur at different lengths of the reference text.
    cases = []
    for k in (6, 9, 13, 17):
        piece = tok.decode([reference[k]])
        if piece.strip() and piece not in texts[k - 1]:
            cases.append(
                SamplingParams(temperature=0.0, logprobs=1, max_tokens=N, stop=[piece], ignore_eos=True)
            )
    assert cases
    for out in llm.generate([PROMPT] * len(cases), cases):
        c = out.outputs[0]
        assert c.finish_reason == "stop"
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        assert [lp.token_id for lp in c.logprobs] == c.token_ids == reference[: len(c.token_ids)]


# -- formatting: chat `bytes`, completion `top_logprobs` ------------------------------------------
TEXT = "héllo → 日本 🙂 def f(x):\n\treturn x"


@pytest.fixture(scope="module")
def serving():
    from types import SimpleNamespace

    from kvscale.worker.model.loader import load_tokenizer
    from kvscale.worker.server.openai_serving import OpenAIServing

    tokenizer = load_tokenizer(str(TARGET))
    return OpenAIServing(SimpleNamespace(tokenizer=tokenizer), None)  # what it reads of AsyncLLM


def test_chat_logprob_bytes_are_the_tokens_own_bytes(serving):
    from kvscale.worker.sample.logprobs import TokenLogprobs

    tok = serving.tokenizer
    ids = tok.encode(TEXT)[1:]  # without <s>
    partial = [i for i in ids if tok.decode([i]) == "\ufffd"]
    assert len(partial) >= 4  # byte-level BPE splits the multi-byte characters
    entries = [serving.chat_logprob(TokenLogprobs(i, -0.5, 1, [(i, -0.5), (ids[0], -1.0)]), 2) for i in ids]
    # Concatenated, the tokens' bytes are the text's UTF-8: a half character gives its real byte(s).
    assert b"".join(bytes(e["bytes"]) for e in entries) == TEXT.encode()
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in entries)
    for i in partial:
        raw = serving.token_bytes(i)
        assert raw != "\ufffd".encode() and not raw.decode("utf-8", errors="ignore")
    # Special tokens are their text.
    assert serving.token_bytes(tok.convert_tokens_to_ids("</s>")) == b"</s>"


def test_completion_top_logprobs_keep_tokens_that_share_a_text(serving):
    from kvscale.worker.sample.logprobs import TokenLogprobs

    tok = serving.tokenizer
    a, b = [i for i in tok.encode(TEXT)[1:] if tok.decode([i]) == "\ufffd"][:2]
    assert a != b
    plain = tok.encode("x = 1")[1]
    lps = [TokenLogprobs(a, -0.2, 1, [(a, -0.2), (b, -1.5), (plain, -2.0)])]
    top = serving.completion_logprobs(lps, 0)["top_logprobs"][0]
    assert len(top) == 3  # no entry merged away
    assert top["\ufffd"] == -0.2  # the most likely keeps the text key
    assert top[f"token_id:{b}"] == -1.5
    assert top[tok.decode([plain])] == -2.0


def test_token_bytes_of_a_sentencepiece_byte_fallback_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from kvscale.worker.server.openai_serving import _decoder_kinds, token_bytes

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({"▁h": 259, "llo": 260, "▁": 261, "h": 262, "l": 263, "o": 264, "ll": 265})
    model = models.BPE(vocab=vocab, merges=[("l", "l"), ("ll", "o"), ("▁", "h")], byte_fallback=True)
    spm = Tokenizer(model)
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    spm.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=spm, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    kinds = _decoder_kinds(tok)
    ids = tok.encode("hllo é", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[-2:] == ["<0xC3>", "<0xA9>"]  # é as two byte tokens
    # The word marker is a space (the decoder strips the very first one from the text).
    assert b"".join(token_bytes(tok, i, kinds) for i in ids) == " hllo é".encode()
    assert token_bytes(tok, 2, kinds) == b"</s>"
