"""Structured outputs in the engine: xgrammar constraints on the fixture model (trained on Python
source, not JSON: its content is odd, its structure is the grammar's), the refusals, the compile
cache and the WAITING_FOR_GRAMMAR state, and the sampler's mask on CPU logits.

One engine per module, one batch for the ten schemas: the 2-core machine is shared."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.core.request import Request, RequestStatus
from kvscale.worker.sample.sampler import Sampler, SamplingMetadata
from kvscale.worker.sample.sampling_params import StructuredOutputsParams
from kvscale.worker.structured_output.request import GrammarCompileTimeout
from kvscale.worker.structured_output.xgrammar_backend import (
    XgrammarBackend,
    unsupported_json_schema_features,
)

INT = {"type": "integer", "minimum": 0, "maximum": 99}
SHORT = {"type": "string", "maxLength": 6}
POINT = {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {"id": INT, "name": SHORT}, "required": ["id", "name"]}
        },
        "required": ["user"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M"]},
        },
        "required": ["color", "size"],
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
    },
    "refs": {
        "$defs": {"point": POINT},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    },
    "optional": {
        "type": "object",
        "properties": {"id": INT, "note": SHORT, "flag": {"type": "boolean"}},
        "required": ["id"],
    },
    "number_ranges": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 10, "maximum": 20},
            "ratio": {"type": "number", "minimum": -1, "maximum": 1},
        },
        "required": ["count", "ratio"],
    },
    "patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
            "mail": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"},
        },
        "required": ["code", "mail"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 3}, "v": INT},
            "required": ["k", "v"],
        },
        "minItems": 2,
        "maxItems": 2,
    },
    "nullable": {
        "type": "object",
        "properties": {"value": {"anyOf": [INT, {"type": "null"}]}, "kind": {"const": "item"}},
        "required": ["value", "kind"],
    },
    "closed_object": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "word": {"type": "string", "minLength": 2, "maxLength": 5}},
        "required": ["ok", "word"],
        "additionalProperties": False,
    },
}
REGEX = r"[a-z]{2,4}-\d{2}"
CHOICES = ["yes", "no", "maybe so"]
PROMPT = "def load(path):\n    "
UNCONSTRAINED = ["import os\n", "class Foo:\n    def __init__(self):\n"]
MAX_TOKENS = 96  # enough for every schema above, in tokens of a code tokenizer


def constrained(temperature: float, seed: int | None = None, **kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(**kwargs),
    )


# Greedy with JSON's free whitespace; sampled rows compact, as a small model sampled at T=1 can
# otherwise spend its tokens on whitespace.
CASES = [
    *[(f"{name}/greedy", constrained(0.0, json=s)) for name, s in SCHEMAS.items()],
    *[
        (f"{name}/t1", constrained(1.0, seed=i, json=s, disable_any_whitespace=True))
        for i, (name, s) in enumerate(SCHEMAS.items())
    ],
    ("regex/greedy", constrained(0.0, regex=REGEX)),
    ("regex/t1", constrained(1.0, seed=1, regex=REGEX)),
    ("choice/greedy", constrained(0.0, choice=CHOICES)),
    ("choice/t1", constrained(1.0, seed=2, choice=CHOICES)),
    ("json_object/t1", constrained(1.0, seed=3, json_object=True, disable_any_whitespace=True)),
]
PLAIN = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def llm(target_model: str) -> LLM:
    return LLM(target_model, num_kv_blocks=512, max_model_len=256, max_num_seqs=40, dtype="float32")


@pytest.fixture(scope="module")
def mixed_batch(llm: LLM):
    """Every constrained case and two unconstrained prompts in one continuous batch."""
    prompts = [PROMPT] * len(CASES) + UNCONSTRAINED
    outs = llm.generate(prompts, [p for _, p in CASES] + [PLAIN] * len(UNCONSTRAINED))
    return {name: out.outputs[0] for (name, _), out in zip(CASES, outs, strict=False)}, outs[len(CASES) :]


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("mode", ["greedy", "t1"])
def test_every_schema_output_parses_and_validates(mixed_batch, name: str, mode: str) -> None:
    out = mixed_batch[0][f"{name}/{mode}"]
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    jsonschema.validate(json.loads(out.text), SCHEMAS[name])


def test_regex_choice_and_json_object_outputs_conform(mixed_batch) -> None:
    outs = mixed_batch[0]
    for mode in ("greedy", "t1"):
        assert re.fullmatch(REGEX, outs[f"regex/{mode}"].text), outs[f"regex/{mode}"].text
        assert outs[f"choice/{mode}"].text in CHOICES
        assert outs[f"regex/{mode}"].finish_reason == outs[f"choice/{mode}"].finish_reason == "stop"
    assert isinstance(json.loads(outs["json_object/t1"].text), dict)


def test_unconstrained_requests_in_the_batch_are_token_identical_to_a_run_without_constraints(
    llm: LLM, mixed_batch
) -> None:
    alone = llm.generate(UNCONSTRAINED, PLAIN)
    for with_constrained, without in zip(mixed_batch[1], alone, strict=True):
        assert with_constrained.outputs[0].token_ids == without.outputs[0].token_ids
        assert with_constrained.outputs[0].finish_reason == "length"  # really unconstrained, 24 tokens


def test_sampling_modes_with_filters_still_obey_the_grammar(llm: LLM) -> None:
    params = [
        SamplingParams(
            temperature=t, top_k=k, top_p=p, seed=s, max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(json=SCHEMAS["refs"], disable_any_whitespace=True),
        )
        for s, (t, k, p) in enumerate([(0.7, 5, 1.0), (1.0, 0, 0.8), (1.5, 20, 0.95)])
    ]  # fmt: skip
    for out in llm.generate([PROMPT] * len(params), params):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["refs"])


def test_seeded_constrained_sampling_reproduces(llm: LLM) -> None:
    params = constrained(1.0, seed=11, json=SCHEMAS["nested"], disable_any_whitespace=True)
    first, again = llm.generate([PROMPT, PROMPT], [params, params])
    assert first.outputs[0].token_ids == again.outputs[0].token_ids


def test_grammar_end_stops_the_request_even_with_ignore_eos(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["done"]),
    )
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("done", "stop")


def test_a_preempted_request_resumes_its_grammar_where_it_was(target_model: str) -> None:
    """A pool too small for four at once: requests are preempted and recomputed, their matchers
    keep their place (recompute does not re-sample), and every output still validates."""
    # 6 blocks of 16: each request's worst case (prompt + 64) fits alone; four of ~30 tokens do not.
    small = LLM(target_model, num_kv_blocks=6, max_model_len=256, max_num_seqs=4, dtype="float32")
    schema = SCHEMAS["array_of_objects"]
    params = [
        dataclasses.replace(constrained(1.0, seed=i, json=schema, disable_any_whitespace=True), max_tokens=64)
        for i in range(4)
    ]
    outs = small.generate([PROMPT] * 4, params)
    assert small.engine.scheduler.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


# -- refusals, before anything is queued ---------------------------------------------------------
@pytest.mark.parametrize(
    "params, message",
    [
        (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (StructuredOutputsParams(json={"properties": {"a": {"oneOf": [INT, SHORT]}}}), "#/properties/a"),
        (StructuredOutputsParams(json={"$ref": "https://example.com/s.json"}), "local \\$ref"),
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (StructuredOutputsParams(regex="[a-z"), "invalid regex constraint"),
        (StructuredOutputsParams(grammar="root ::= missing"), "invalid grammar constraint"),
    ],
)
def test_unenforceable_constraints_are_refused_before_queueing(llm: LLM, params, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request(PROMPT, SamplingParams(structured_outputs=params))
    assert not llm.engine.has_unfinished_requests()


def test_min_tokens_with_a_grammar_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        llm.engine.add_request(
            PROMPT, SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(choice=["a"]))
        )


def test_params_need_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    # A schema as a dict and as its JSON text is one cache entry.
    assert (
        StructuredOutputsParams(json={"b": 1, "a": 2}).key
        == StructuredOutputsParams(json='{"a":2,"b":1}').key
    )


def test_unsupported_features_are_found_in_subschemas_and_not_in_property_names() -> None:
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "integer"},
            "items": {"type": "array", "items": {"not": {"type": "null"}}},
        },
        "$defs": {"d": {"anyOf": [{"type": "string"}, {"if": {"type": "string"}}]}},
        "allOf": [{"type": "object"}],
    }
    assert sorted(unsupported_json_schema_features(schema)) == [
        "#/$defs/d/anyOf/1: if/then/else is not enforced",
        "#/properties/items/items: not is not enforced",
    ]
    assert list(unsupported_json_schema_features({"uniqueItems": False, "allOf": [INT]})) == []


# -- the compile: cached, off the step loop ------------------------------------------------------
class GatedBackend(XgrammarBackend):
    """The real backend, whose compile waits for a gate (a stand-in for a slow compile) and can be
    made to fail."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.fail = False

    def compile(self, params, parsed=None):
        assert self.gate.wait(30)
        if self.fail:
            raise RuntimeError("compile failed on purpose")
        return super().compile(params, parsed)


@pytest.fixture
def gated(llm: LLM):
    engine = llm.engine
    manager = engine.structured_output
    real = manager.backend
    manager.backend = GatedBackend(engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))
    manager.take_compile_times()
    yield manager.backend
    manager.backend.gate.set()
    manager.backend = real


def test_a_request_waits_for_its_grammar_without_blocking_the_others(llm: LLM, gated) -> None:
    engine = llm.engine
    schema = {"type": "object", "properties": {"w": {"type": "string", "maxLength": 3}}, "required": ["w"]}
    slow = engine.add_request(PROMPT, constrained(0.0, json=schema))
    fast = engine.add_request("import os\n", SamplingParams(temperature=0.0, max_tokens=4))
    waiting = engine.scheduler.requests[slow]
    assert waiting.status == RequestStatus.WAITING_FOR_GRAMMAR
    done: dict[str, str] = {}
    for _ in range(6):  # the unconstrained request, behind it in line, runs to its end meanwhile
        done.update({o.request_id: o.outputs[0].finish_reason for o in engine.step() if o.finished})
    assert done == {fast: "length"}
    assert waiting.status == RequestStatus.WAITING_FOR_GRAMMAR and waiting.num_computed_tokens == 0
    gated.gate.set()
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            text += o.outputs[0].text
    jsonschema.validate(json.loads(text), schema)
    assert len(engine.structured_output.take_compile_times()) == 1


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(llm: LLM, gated) -> None:
    engine = llm.engine
    gated.fail = True
    gated.gate.set()
    bad = engine.add_request(PROMPT, constrained(0.0, regex="never-compiled-[0-9]"))
    good = engine.add_request("import os\n", SamplingParams(temperature=0.0, max_tokens=3))
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {good}
    failed = engine.take_failed()
    assert set(failed) == {bad} and "compile failed on purpose" in str(failed[bad])
    assert engine.kv_cache_manager.usage() == 0.0


def test_an_offline_compile_past_its_deadline_fails_its_request_and_is_cached_for_a_retry(
    llm: LLM, gated, monkeypatch
) -> None:
    """Issue 26: offline (no server waited for the compile), a request in WAITING_FOR_GRAMMAR
    gives up at grammar_compile_timeout instead of waiting forever; the others run; the compile
    runs on and a retry is served from the cache."""
    engine = llm.engine
    monkeypatch.setattr(engine.args, "grammar_compile_timeout", 0.3)
    regex = "deadline-[0-9]"
    slow = engine.add_request(PROMPT, constrained(0.0, regex=regex))
    good = engine.add_request("import os\n", SamplingParams(temperature=0.0, max_tokens=3))
    finished, started = set(), time.monotonic()
    while engine.has_unfinished_requests() and time.monotonic() - started < 20:
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {good} and not engine.has_unfinished_requests()
    failed = engine.take_failed()
    assert set(failed) == {slow}
    assert isinstance(failed[slow].__cause__, GrammarCompileTimeout), failed[slow]
    assert engine.kv_cache_manager.usage() == 0.0
    gated.gate.set()  # the compile finishes late, into the cache
    retry = llm.generate(PROMPT, constrained(0.0, regex=regex))[0].outputs[0]
    assert re.fullmatch(regex, retry.text), retry.text


def test_the_compile_cache_serves_one_grammar_to_every_request_with_it(llm: LLM) -> None:
    manager = llm.engine.structured_output
    manager.take_compile_times()
    schema = {"type": "object", "properties": {"z": {"type": "boolean"}}, "required": ["z"]}
    params = [
        constrained(0.0, json=schema),
        constrained(1.0, json=json.dumps(schema)),
        constrained(0.0, json=schema),
    ]
    outs = llm.generate([PROMPT] * 3, params)
    assert all(json.loads(o.outputs[0].text)["z"] in (True, False) for o in outs)
    assert len(manager.take_compile_times()) == 1


def test_the_engine_reports_constrained_requests_compiles_and_mask_times(llm: LLM) -> None:
    llm.engine.take_stats()
    schema = {"type": "object", "properties": {"q": {"enum": [1, 2]}}, "required": ["q"]}
    outs = llm.generate([PROMPT] * 3, [constrained(0.0, json=schema)] * 2 + [PLAIN])
    stats = llm.engine.take_stats()
    assert stats.num_structured_requests == 2
    assert len(stats.grammar_compile_times) == 1 and stats.grammar_compile_times[0] > 0
    # One mask per step in which a constrained request sampled: each of its tokens.
    assert len(stats.grammar_mask_times) == len(outs[0].outputs[0].token_ids)
    assert all(t > 0 for t in stats.grammar_mask_times)


# -- the mask in the sampler ---------------------------------------------------------------------
def test_the_mask_touches_constrained_rows_only_in_every_sampling_mode(llm: LLM) -> None:
    backend = llm.engine.structured_output.backend
    compiled = backend.compile(StructuredOutputsParams(choice=["yes", "no"]))
    bitmask = backend.allocate_bitmask(4)
    backend.new_matcher(compiled).fill_bitmask(bitmask, 1)
    backend.new_matcher(compiled).fill_bitmask(bitmask, 3)
    allowed = set(torch.isfinite(_masked(backend, bitmask)[1]).nonzero().flatten().tolist())
    assert 0 < len(allowed) < 8
    tokenizer = llm.get_tokenizer()
    assert all(any(w.startswith(tokenizer.decode([t])) for w in ("yes", "no")) for t in allowed)
    vocab = llm.engine.vocab_size
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    modes = [dict(temperature=0.0), dict(temperature=1.0, seed=1), dict(temperature=0.8, top_k=50, seed=2),
             dict(temperature=1.2, top_p=0.5, min_p=0.01, seed=3)]  # fmt: skip
    for mode in modes:
        requests = [Request(f"r{i}", [0, 5], SamplingParams(**mode), seed=mode.get("seed")) for i in range(4)]
        metadata = SamplingMetadata.from_requests(requests, vocab, torch.device("cpu"))
        plain = Sampler()(logits, metadata).sampled_token_ids.tolist()
        masked = Sampler()(
            logits, metadata, mask_logits=lambda lg: backend.apply_bitmask(lg, bitmask, [1, 3])
        ).sampled_token_ids.tolist()
        assert masked[0] == plain[0] and masked[2] == plain[2], mode  # unconstrained rows: unchanged
        assert masked[1] in allowed and masked[3] in allowed, mode


def _masked(backend, bitmask: torch.Tensor) -> torch.Tensor:
    logits = torch.zeros(4, backend.vocab_size)
    backend.apply_bitmask(logits, bitmask, [1, 3])
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    return logits
