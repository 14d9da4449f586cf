"""The xgrammar backend (vLLM's and SGLang's default grammar library).

xgrammar converts a JSON schema to a grammar but silently ignores the keywords it cannot enforce
(it only logs a warning); `unsupported_json_schema_features` finds those first so the request is
refused instead of producing output that does not validate. The list below was found by compiling
one schema per keyword with xgrammar 0.2.9 and checking whether a violating string is accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import torch
import xgrammar as xgr

from kvscale.worker.sample.sampling_params import StructuredOutputsParams
from kvscale.worker.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from kvscale.worker.structured_output.bitmask import apply_bitmask_cpu
from kvscale.worker.structured_output.budget import check_constraint

# Keyword -> why it is refused. `uniqueItems: false` and a one-element `allOf` are fine.
UNSUPPORTED_KEYWORDS = {
    "uniqueItems": "uniqueItems is not enforced",
    "contains": "contains is not enforced",
    "minContains": "minContains is not enforced",
    "maxContains": "maxContains is not enforced",
    "not": "not is not enforced",
    "if": "if/then/else is not enforced",
    "then": "if/then/else is not enforced",
    "else": "if/then/else is not enforced",
    "dependentRequired": "dependentRequired is not enforced",
    "dependentSchemas": "dependentSchemas is not enforced",
    "dependencies": "dependencies is not enforced",
    "oneOf": "oneOf is not enforced (it would be read as anyOf); use anyOf",
    "allOf": "allOf with more than one schema is not enforced",
    "$dynamicRef": "$dynamicRef is not supported",
    "$recursiveRef": "$recursiveRef is not supported",
}
# Where a schema holds other schemas: a map of them, one, or a list.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "additionalProperties", "unevaluatedProperties", "propertyNames", "items", "additionalItems",
    "unevaluatedItems", "contains", "not", "if", "then", "else",
)  # fmt: skip
_SCHEMA_LISTS = ("prefixItems", "items", "anyOf", "oneOf", "allOf")

# JSON's free whitespace is bounded to this many characters per gap between tokens (", " and ": "
# as json.dumps writes them, or a newline and a space): a model that likes newlines, as a code model
# does, otherwise writes one per token until max_tokens (the fixture model wrote 16 per gap at 16).
MAX_JSON_WHITESPACE = 2

# xgrammar's C++ errors start with a log prefix: "[15:20:15] /project/cpp/file.cc:94: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def unsupported_json_schema_features(schema: object, path: str = "#") -> Iterator[str]:
    """Each keyword of `schema` (and its subschemas) that xgrammar would not enforce, with where."""
    if not isinstance(schema, dict):
        return
    for key, why in UNSUPPORTED_KEYWORDS.items():
        if key not in schema:
            continue
        value = schema[key]
        if (key == "uniqueItems" and value is False) or (key == "allOf" and len(value or []) <= 1):
            continue
        yield f"{path}: {why}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        yield f"{path}: only local $ref ('#/...') is supported, got {ref!r}"
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from unsupported_json_schema_features(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_ONE:
        yield from unsupported_json_schema_features(schema.get(key), f"{path}/{key}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from unsupported_json_schema_features(sub, f"{path}/{key}/{i}")


def _clean(error: Exception) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return _LOG_PREFIX.sub("", first)


def _choice_ebnf(choices: tuple[str, ...]) -> str:
    # JSON string literals are EBNF string literals (the same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _is_lark(grammar: str) -> bool:
    # GBNF-style EBNF defines rules with `::=`; Lark with `name:`.
    return "::=" not in grammar


class XgrammarMatcher(StructuredOutputGrammar):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # Our own cache (manager.py) holds compiled grammars; xgrammar's would hold them twice.
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def _grammar(self, params: StructuredOutputsParams) -> xgr.Grammar:
        """Parse the constraint into an xgrammar Grammar (raises on malformed input)."""
        kind = params.kind
        whitespace = dict(
            any_whitespace=not params.disable_any_whitespace,
            max_whitespace_cnt=None if params.disable_any_whitespace else MAX_JSON_WHITESPACE,
        )
        if kind == "json":
            try:
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            except (TypeError, RecursionError) as e:  # the offline API takes any dict
                raise ValueError(f"the JSON schema cannot be serialized: {e}") from None
            return xgr.Grammar.from_json_schema(schema, **whitespace)
        if kind == "json_object":
            # Any object: additional properties allowed, unlike the strict default for schemas.
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(params.choice))
        grammar = params.grammar
        return xgr.Grammar.from_lark(grammar) if _is_lark(grammar) else xgr.Grammar.from_ebnf(grammar)

    def validate(self, params: StructuredOutputsParams) -> None:
        """The budgets, then xgrammar's blind spots: no grammar is parsed here (compile does)."""
        spec = check_constraint(params.kind, getattr(params, params.kind))
        if params.kind == "json":
            if not isinstance(spec, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            problems = list(unsupported_json_schema_features(spec))  # depth bounded by the budget
            if problems:
                raise ValueError("unsupported JSON schema feature(s): " + "; ".join(problems))

    def parse(self, params: StructuredOutputsParams) -> xgr.Grammar:
        try:
            return self._grammar(params)
        except RecursionError:
            raise ValueError(f"invalid {params.kind} constraint: nested too deep") from None
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError from C++ for every parse error
            raise ValueError(f"invalid {params.kind} constraint: {_clean(e)}") from None

    def compile(self, params: StructuredOutputsParams, parsed: object = None) -> xgr.CompiledGrammar:
        grammar = self.parse(params) if parsed is None else parsed
        return self.compiler.compile_grammar(grammar)

    def memory_size_bytes(self, compiled: object) -> int:
        return int(getattr(compiled, "memory_size_bytes", 0))

    def new_matcher(self, compiled: object) -> XgrammarMatcher:
        assert isinstance(compiled, xgr.CompiledGrammar)
        return XgrammarMatcher(xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        if logits.device.type == "cpu":
            apply_bitmask_cpu(logits, bitmask, rows, self.vocab_size)
            return
        mask = bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=rows)
