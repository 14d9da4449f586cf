"""Structured outputs with speculative decoding (n-gram and the draft model): every output is valid,
greedy output is token-identical to constrained decoding without speculation, and the proposals
are cut where the grammar refuses one, the matcher rolled back.

One engine per method and module, one batch each: the 2-core machine is shared."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from model_fixtures import DRAFT
from test_structured_output import CHOICES, PROMPT, REGEX, SCHEMAS, constrained

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.core.request import Request
from kvscale.worker.sample.sampling_params import StructuredOutputsParams
from kvscale.worker.structured_output.manager import StructuredOutputManager
from kvscale.worker.structured_output.xgrammar_backend import XgrammarBackend

NAMES = ["nested", "enums", "refs", "array_of_objects", "number_ranges"]
GREEDY = [
    *[constrained(0.0, json=SCHEMAS[n]) for n in NAMES],
    constrained(0.0, regex=REGEX),
    constrained(0.0, choice=CHOICES),
]
SAMPLED = [
    *[constrained(1.0, json=SCHEMAS[n], disable_any_whitespace=True) for n in NAMES],  # rejection sampling
    *[constrained(1.0, seed=i, json=SCHEMAS[n], disable_any_whitespace=True) for i, n in enumerate(NAMES)],
    constrained(1.0, regex=REGEX),
    constrained(1.0, seed=4, choice=CHOICES),
]
CHECKS = [*[SCHEMAS[n] for n in NAMES], "regex", "choice"]
ENGINE = dict(num_kv_blocks=512, max_model_len=256, max_num_seqs=40, dtype="float32")
PROPOSERS = {
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=4),
    "draft": dict(draft_model=str(DRAFT), num_speculative_tokens=4),
}


def check(kind, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        jsonschema.validate(json.loads(text), kind)


@pytest.fixture(scope="module")
def reference(target_model: str):
    """Constrained greedy decoding without speculation."""
    llm = LLM(target_model, **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate([PROMPT] * len(GREEDY), GREEDY)]


@pytest.mark.parametrize("method", sorted(PROPOSERS))
def test_speculating_constrained_outputs_are_valid_and_greedy_is_identical(target_model, reference, method):
    llm = LLM(target_model, **ENGINE, **PROPOSERS[method], speculative_adaptive=False)
    params = [*GREEDY, *SAMPLED, SamplingParams(temperature=0.0, max_tokens=24)]  # and an unconstrained one
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params)]
    greedy, sampled = outs[: len(GREEDY)], outs[len(GREEDY) : -1]
    assert [o.token_ids for o in greedy] == reference
    for kind, out in zip([*CHECKS, *CHECKS[:-2], *CHECKS], [*greedy, *sampled], strict=True):
        assert out.finish_reason == "stop", out
        check(kind, out.text)
    constrained_outs = [*greedy, *sampled]
    proposed = sum(o.num_draft_tokens for o in constrained_outs)
    accepted = sum(o.num_accepted_tokens for o in constrained_outs)
    assert proposed > 0 and accepted > 0  # speculation ran on the constrained requests
    assert llm.engine.kv_cache_manager.block_pool.num_used_blocks == 0


@pytest.fixture(scope="module")
def manager(target_model: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_model)
    backend = XgrammarBackend(tokenizer, 4096, [tokenizer.eos_token_id])
    yield StructuredOutputManager(backend), tokenizer
    # the pool's threads end with the process


def request_with(manager: StructuredOutputManager, **kwargs) -> Request:
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=32))
    request.structured_output = manager.init_request(StructuredOutputsParams(**kwargs))
    request.structured_output.compiled.result(timeout=60)
    return request


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = bitmask[row].to(torch.int64)
    return {w * 32 + b for w in range(bits.shape[0]) for b in range(32) if (int(bits[w]) >> b) & 1}


def test_proposals_are_cut_after_the_first_refused_one_and_the_matcher_rolls_back(manager) -> None:
    manager, tokenizer = manager
    request = request_with(manager, choice=["abc", "abd"])
    ids = [tokenizer.convert_tokens_to_ids(t) for t in "abcd"]
    a, b, c, d = ids
    plain = request_with(manager, regex="x+")  # no proposals: no rows
    kept, mask = manager.constrain_proposals([request, plain], [[a, b, d, c, c], []])
    # a, b, d spell a choice; c cannot follow it: refused, kept as the last proposal.
    assert kept == [[a, b, d, c], []]
    assert mask.rows == [0, 1, 2, 3]  # position 4 follows the refused proposal: unmasked
    assert mask.bitmask.shape[0] == 5
    assert a in allowed(mask.bitmask, 0) and b not in allowed(mask.bitmask, 0)
    assert {c, d} <= allowed(mask.bitmask, 2) and a not in allowed(mask.bitmask, 2)
    assert allowed(mask.bitmask, 3) == {tokenizer.eos_token_id}  # after "abd": only the end
    # Rolled back: the matcher still stands at the start, where only "a" may come.
    matcher = request.structured_output.matcher
    assert not matcher.accept_token(b) and matcher.accept_token(a)


def test_a_proposal_that_ends_the_grammar_is_the_last_one(manager) -> None:
    manager, tokenizer = manager
    request = request_with(manager, regex="ab")
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in "ab")
    eos = tokenizer.eos_token_id
    kept, mask = manager.constrain_proposals([request], [[a, b, eos, a]])
    assert kept == [[a, b, eos]]
    assert mask.rows == [0, 1, 2]  # the position after the grammar's end is never emitted
    assert allowed(mask.bitmask, 2) == {eos}


def test_unconstrained_speculation_gets_no_mask(manager) -> None:
    manager, _ = manager
    request = Request("u", [1, 2, 3], SamplingParams(max_tokens=8))
    assert manager.constrain_proposals([request], [[5, 6]]) == ([[5, 6]], None)
