"""Streaming detokenization: deltas add up to a full decode, stop strings cut exactly, windows stay small."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvscale.worker.engine.detokenizer import IncrementalDetokenizer

TINY_CODE = Path("/work/shared/models/tiny-code-target")
MULTIBYTE = "é中😀ñ€ß日本"
CODE = 'def foo(x):\n    """Return x doubled — café 中文 😀."""\n    return x * 2\n\n\nclass Bar:\n    pass\n'


@functools.cache
def _tokenizer(name: str) -> PreTrainedTokenizerFast:
    if name == "tiny-code":
        if not TINY_CODE.exists():
            pytest.skip(f"{TINY_CODE} not present")
        return AutoTokenizer.from_pretrained(TINY_CODE)
    # A byte-level BPE trained here on non-ASCII text, so that some merged tokens hold a whole character plus
    # the first bytes of the next one: the window must cope with partial characters inside tokens too.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CODE, "héllo wörld 中文日本語 😀😀 ñandú €5 straße"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


TOKENIZER_NAMES = ["tiny-code", "trained"]


def _ids_strategy(tokenizer: PreTrainedTokenizerFast) -> st.SearchStrategy[int]:
    multibyte = sorted({i for ch in MULTIBYTE for i in tokenizer.encode(ch + ch, add_special_tokens=False)})
    return st.one_of(
        st.sampled_from(multibyte),  # pieces of multi-byte characters, in any order
        st.sampled_from(tokenizer.all_special_ids),
        st.integers(0, len(tokenizer) - 1),
    )


def _stream(detok: IncrementalDetokenizer, steps: list[list[int]]) -> list[str]:
    """Feed each step, collecting streamed deltas; stops feeding once a stop string matched."""
    deltas = []
    for ids in steps:
        stopped = detok.update(ids) is not None
        deltas.append(detok.get_next_output_text(finished=stopped, delta=True))
        if stopped:
            return deltas
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas


def test_tiny_code_tokenizer_splits_multibyte_characters() -> None:
    tok = _tokenizer("tiny-code")
    for ch in "é中😀":
        ids = tok.encode(ch, add_special_tokens=False)
        assert len(ids) > 1 and all("\ufffd" in tok.decode([i]) for i in ids)
        assert tok.decode(ids) == ch


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_real_text_one_token_at_a_time(name: str) -> None:
    tok = _tokenizer(name)
    prompt = tok.encode("# 中文 prompt\n", add_special_tokens=True)
    ids = tok.encode(CODE, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = _stream(detok, [[i] for i in ids])
    assert "".join(deltas) == detok.output_text == CODE
    assert not any("\ufffd" in d for d in deltas)  # never a partial character
    if name == "tiny-code":  # the trained tokenizer has seen CODE and merged its characters whole
        assert sum(d == "" for d in deltas) > 3  # some steps had to wait for the rest of a character


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_deltas_add_up_to_full_decode(name: str, data: st.DataObject, skip_special_tokens: bool) -> None:
    tok = _tokenizer(name)
    token = _ids_strategy(tok)
    prompt = data.draw(st.lists(token, max_size=8), label="prompt")
    steps = data.draw(st.lists(st.lists(token, min_size=1, max_size=3), max_size=40), label="steps")
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    streamed = []
    for ids in steps:
        assert detok.update(ids) is None
        streamed.append(detok.get_next_output_text(finished=False, delta=True))
        # The non-delta view is everything streamed so far.
        assert detok.get_next_output_text(finished=False, delta=False) == "".join(streamed)
    streamed.append(detok.get_next_output_text(finished=True, delta=True))
    output_ids = [i for ids in steps for i in ids]
    expected = tok.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(streamed) == detok.output_text == expected


def test_skip_special_tokens() -> None:
    tok = _tokenizer("tiny-code")
    ids = [*tok.encode("x = 1", add_special_tokens=False), tok.eos_token_id]
    assert "".join(_stream(IncrementalDetokenizer(tok, [], skip_special_tokens=True), [ids])) == "x = 1"
    assert "".join(_stream(IncrementalDetokenizer(tok, [], skip_special_tokens=False), [ids])) == "x = 1</s>"


# --- stop strings ----------------------------------------------------------------------------------------


def _run_stop(
    text: str, stop: list[str], include: bool = False, name: str = "tiny-code"
) -> tuple[IncrementalDetokenizer, list[str | None], list[str]]:
    """Stream `text` one token at a time; return the detokenizer, update() results and streamed deltas."""
    tok = _tokenizer(name)
    detok = IncrementalDetokenizer(tok, tok.encode("# p\n"), stop=stop, include_stop_str_in_output=include)
    results, deltas = [], []
    for i in tok.encode(text, add_special_tokens=False):
        results.append(detok.update([i]))
        deltas.append(detok.get_next_output_text(finished=results[-1] is not None, delta=True))
        if results[-1] is not None:
            break
    return detok, results, deltas


def test_stop_truncates_exactly_before_stop_string() -> None:
    detok, results, deltas = _run_stop(CODE, ["return"])
    assert results[-1] == "return" and results[:-1] == [None] * (len(results) - 1)
    assert detok.output_text == "".join(deltas) == CODE[: CODE.index("return")]
    assert detok.stop_reason == "return"
    assert detok.update([5, 6]) is None and detok.output_text == CODE[: CODE.index("return")]


def test_stop_straddling_tokens_and_earlier_steps() -> None:
    tok = _tokenizer("tiny-code")
    stop = 'oo(x):\n    """Ret'  # spans many tokens, starting inside the token "oo"
    assert len(tok.encode(stop, add_special_tokens=False)) > 4
    detok, results, _ = _run_stop(CODE, [stop])
    assert results[-1] == stop
    assert detok.output_text == "def f"
    # A stop string made of a multi-byte character split over three tokens.
    detok, results, _ = _run_stop(CODE, ["中"])
    assert results[-1] == "中" and detok.output_text == CODE[: CODE.index("中")]


def test_include_stop_str_in_output() -> None:
    detok, _, deltas = _run_stop(CODE, ["café"], include=True)
    assert detok.output_text == "".join(deltas) == CODE[: CODE.index("café") + len("café")]


def test_earliest_stop_string_wins() -> None:
    detok, results, _ = _run_stop(CODE, ["class", "x * 2", "Return"])
    assert results[-1] == "Return" and detok.output_text == CODE[: CODE.index("Return")]
    # "bc" completes before "abcd" even though "abcd" starts first: streaming sees "bc" first.
    detok = IncrementalDetokenizer(_tokenizer("tiny-code"), [], stop=["abcd", "bc"])
    assert detok.update(_tokenizer("tiny-code").encode("xabcde", add_special_tokens=False)) == "bc"
    assert detok.output_text == "xa"


def test_held_back_text_is_released_when_finished() -> None:
    tok = _tokenizer("tiny-code")
    detok = IncrementalDetokenizer(tok, [], stop=["x = 12"])
    assert detok.update(tok.encode("y = 3\nx = 1", add_special_tokens=False)) is None
    # "x = 1" may still turn into the stop string, so it is held back.
    assert detok.get_next_output_text(finished=False, delta=True) == "y = 3\n"
    assert detok.get_next_output_text(finished=False, delta=False) == "y = 3\n"
    assert detok.get_next_output_text(finished=True, delta=True) == "x = 1"
    assert detok.output_text == "y = 3\nx = 1"


def test_unrelated_text_is_not_held_back() -> None:
    tok = _tokenizer("tiny-code")
    detok = IncrementalDetokenizer(tok, [], stop=["\n\n\n\n"])
    detok.update(tok.encode("a = 1\nb", add_special_tokens=False))
    assert detok.get_next_output_text(finished=False, delta=True) == "a = 1\nb"


def _expected_stop(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    found = [(text.index(s) + len(s), text.index(s), s) for s in stop if s in text]
    if not found:
        return text, None
    end, start, s = min(found)
    return text[: end if include else start], s


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), include=st.booleans())
def test_stop_strings_property(name: str, data: st.DataObject, include: bool) -> None:
    tok = _tokenizer(name)
    alphabet = "ab \né中😀"
    text = data.draw(st.text(alphabet, max_size=40), label="text")
    stops = st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=3)
    stop = data.draw(stops, label="stop")
    ids = tok.encode(text, add_special_tokens=False)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(ids) - 1, 1))), label="cuts") - {len(ids)})
    steps = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True) if ids[a:b]]
    detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    expected, reason = _expected_stop(tok.decode(ids), stop, include)
    streamed, got = "", None
    for step in steps:
        got = detok.update(step)
        streamed += detok.get_next_output_text(finished=got is not None, delta=True)
        # Nothing streamed is ever taken back: it is all part of the final text.
        assert expected.startswith(streamed)
        if got is not None:
            break
    streamed += detok.get_next_output_text(finished=True, delta=True)
    assert (got, streamed, detok.output_text) == (reason, expected, expected)


# --- cost ------------------------------------------------------------------------------------------------


class _CountingTokenizer:
    """Delegates to a tokenizer, recording how many ids each decode call was given."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self._tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids: list[int], **kwargs: object) -> str:
        self.decoded_lengths.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("kind", ["text", "garbage"])
def test_decode_window_stays_bounded(kind: str) -> None:
    tok = _tokenizer("tiny-code")
    if kind == "text":
        ids = (tok.encode(CODE, add_special_tokens=False) * 100)[:2000]
    else:
        # A lead byte over and over never forms a character: every step's text ends in U+FFFD.
        ids = [tok.encode("😀", add_special_tokens=False)[0]] * 2000
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, tok.encode("# p\n"), stop=["never appears"])
    streamed = ""
    for i in ids:
        assert detok.update([i]) is None
        streamed += detok.get_next_output_text(finished=False, delta=True)
    streamed += detok.get_next_output_text(finished=True, delta=True)
    assert streamed == tok.decode(ids)
    assert max(counting.decoded_lengths) <= 16
    assert len(counting.decoded_lengths) <= 4 * len(ids)
