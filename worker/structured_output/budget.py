"""Budgets on the programs clients send: JSON schemas, regexes, grammars and choice lists.

A constraint is compiled before its request runs, and compile cost grows faster than its size
with some shapes (xgrammar 0.2.9 on the 4,096-token fixture vocabulary: a schema nested 200 levels
took 1.3 s, 400 levels ~11 s; 1,024 optional properties in one object 12.6 s; `{1,4096}` in a
schema `pattern` 1.2 s; 256 choices of 1,000 characters 3.2 s and 67 MB). Each budget below sits
where the measured cost of the largest accepted program stays under ~0.3 s (docs/server.md, Limits).

The walkers are pure, iterative (a 10,000-level document cannot exhaust the stack) and stop at the
first budget passed, so their own cost is bounded by the budgets, not by the body.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

# JSON schemas (response_format json_schema, structured_outputs.json / guided_json, tool parameters).
MAX_SCHEMA_BYTES = 64 * 1024  # serialized compactly
# JSON nesting of the schema document: each object-schema level is 2 ({"properties": {"a": ...}}).
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 8192  # objects, arrays and scalars in the document
MAX_OBJECT_PROPERTIES = 256  # in one `properties` (optional ones cost superlinearly: 1,024 took 12.6 s)
MAX_SCHEMA_PROPERTIES = 1024  # in the whole schema
MAX_SCHEMA_BRANCHES = 256  # anyOf / oneOf / allOf entries in the whole schema
MAX_ENUM_VALUES = 1024  # enum entries in the whole schema
MAX_COUNT_BOUND = 10_000  # minItems / maxItems / minLength / maxLength / minProperties / maxProperties
MAX_TOOL_SCHEMA_BYTES = 16 * 1024  # one tool's parameters
# Regexes (structured_outputs.regex, and a schema's `pattern`s).
MAX_REGEX_CHARS = 4096
MAX_REGEX_ALTERNATIVES = 1024  # `|`
MAX_REPEAT = 1024  # the product of nested `{m,n}` upper bounds (`{1,4096}` in a pattern: 1.2 s)
MAX_REGEX_DEPTH = 64  # nested groups
# A schema's patterns together: the sum of each one's repetition product squared (a pattern's
# parse grows about with its square: {1,1024} 0.07 s, {1,4096} 1.2 s; 16 x {1,1024} took 4 s).
MAX_PATTERN_WEIGHT = MAX_REPEAT**2
# Grammars (EBNF / Lark).
MAX_GRAMMAR_CHARS = 32 * 1024
MAX_GRAMMAR_ALTERNATIVES = 4096
# Choice lists (the count is MAX_CHOICES in server/protocol.py).
MAX_CHOICE_CHARS = 256  # one choice
MAX_CHOICES_TOTAL_CHARS = 16 * 1024  # all of them

_COUNT_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_BRANCH_KEYWORDS = ("anyOf", "oneOf", "allOf")


class BudgetError(ValueError):
    """A client program over a budget; `where` points into it (a JSON pointer for schemas)."""

    def __init__(self, message: str, where: str = "") -> None:
        shown = where if len(where) <= 100 else f"{where[:40]}...{where[-40:]}"
        super().__init__(message + (f" (at {shown})" if where else ""))
        self.where = where


@dataclass
class _SchemaTally:
    nodes: int = 0
    properties: int = 0
    branches: int = 0
    enum_values: int = 0
    pattern_weight: int = 0


def _schema_nodes(doc: object) -> Iterator[tuple[object, str, int]]:
    """Every value in a JSON document, depth first without recursion: (value, pointer, depth).
    A container wider than the node budget is refused before its children are stacked."""
    stack: list[tuple[object, str, int]] = [(doc, "#", 1)]
    while stack:
        value, where, depth = stack.pop()
        yield value, where, depth
        if isinstance(value, (dict, list)) and len(stack) + len(value) > MAX_SCHEMA_NODES:
            raise BudgetError(f"the JSON schema has more than {MAX_SCHEMA_NODES} values", where)
        if isinstance(value, dict):
            stack.extend((v, f"{where}/{k}", depth + 1) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}/{i}", depth + 1) for i, v in enumerate(value))


def check_json_schema(schema: object, max_bytes: int = MAX_SCHEMA_BYTES) -> None:
    """Raise BudgetError for a schema document over a budget. Counts keywords wherever they appear
    (also under a property that happens to be named `enum`): an over-count errs on refusing."""
    tally = _SchemaTally()
    for value, where, depth in _schema_nodes(schema):
        tally.nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise BudgetError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep", where)
        if tally.nodes > MAX_SCHEMA_NODES:
            raise BudgetError(f"the JSON schema has more than {MAX_SCHEMA_NODES} values", where)
        if isinstance(value, str) and len(value) > max_bytes:
            raise BudgetError(f"the JSON schema is over {max_bytes} bytes", where)
        if not isinstance(value, dict):
            continue
        props = value.get("properties")
        if isinstance(props, dict):
            if len(props) > MAX_OBJECT_PROPERTIES:
                raise BudgetError(
                    f"an object schema may have at most {MAX_OBJECT_PROPERTIES} properties, got {len(props)}",
                    where,
                )
            tally.properties += len(props)
            if tally.properties > MAX_SCHEMA_PROPERTIES:
                raise BudgetError(f"the JSON schema has more than {MAX_SCHEMA_PROPERTIES} properties", where)
        for name in _BRANCH_KEYWORDS:
            if isinstance(value.get(name), list):
                tally.branches += len(value[name])
        if tally.branches > MAX_SCHEMA_BRANCHES:
            raise BudgetError(
                f"the JSON schema has more than {MAX_SCHEMA_BRANCHES} anyOf/oneOf/allOf entries", where
            )
        if isinstance(value.get("enum"), list):
            tally.enum_values += len(value["enum"])
            if tally.enum_values > MAX_ENUM_VALUES:
                raise BudgetError(f"the JSON schema has more than {MAX_ENUM_VALUES} enum values", where)
        for name in _COUNT_KEYWORDS:
            bound = value.get(name)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound > MAX_COUNT_BOUND:
                raise BudgetError(f"{name} may be at most {MAX_COUNT_BOUND}, got {bound}", where)
        pattern = value.get("pattern")
        if isinstance(pattern, str):
            try:
                tally.pattern_weight += check_regex(pattern) ** 2
            except BudgetError as e:
                raise BudgetError(f"pattern: {e}", f"{where}/pattern") from None
            if tally.pattern_weight > MAX_PATTERN_WEIGHT:
                raise BudgetError(
                    f"the schema's patterns repeat too much together (the sum of each one's {{m,n}} "
                    f"bound squared may be at most {MAX_PATTERN_WEIGHT})",
                    f"{where}/pattern",
                )
    # Depth and node count bound the document, so this dump is bounded and cannot recurse too deep.
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    if size > max_bytes:
        raise BudgetError(f"the JSON schema is {size} bytes, over the {max_bytes}-byte budget")


def load_json_schema(text: str) -> object:
    """A schema sent as JSON text: size first, then parsed (a RecursionError is a bad schema)."""
    if len(text) > MAX_SCHEMA_BYTES:  # characters: at most its bytes
        raise BudgetError(f"the JSON schema is over {MAX_SCHEMA_BYTES} bytes")
    try:
        return json.loads(text)
    except RecursionError:
        raise BudgetError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep") from None
    except ValueError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None


def _scan_repetitions(text: str, *, quotes: bool, max_depth: int) -> tuple[int, int]:
    """(the largest product of nested `{m,n}` / `{m,}` / `{n}` upper bounds, the number of `|`) in
    a regex (quotes=False) or an EBNF/Lark grammar (quotes=True: "..." literals are skipped).
    Character classes and escapes are skipped. Unbounded `*`/`+` are free: they compile to loops."""
    stack = [1]  # per open group: the largest repetition product found inside it so far
    last = 1  # the product of the atom just closed (a group's inner product, or 1)
    best, bars, i, n = 1, 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            last = 1
            continue
        if c == "[":  # a class: up to its unescaped `]` (a `]` first in it is literal)
            i += 2 if text[i + 1 : i + 2] == "]" else 1
            while i < n and text[i] != "]":
                i += 2 if text[i] == "\\" else 1
            i += 1
            last = 1
            continue
        if quotes and c in "\"'":
            i += 1
            while i < n and text[i] != c:
                i += 2 if text[i] == "\\" else 1
            i += 1
            last = 1
            continue
        if c == "(":
            stack.append(1)
            if len(stack) - 1 > max_depth:  # stack[0] is the top level, not a group
                raise BudgetError(f"groups are nested more than {max_depth} levels deep")
            i += 1
            continue
        if c == ")":
            last = stack.pop() if len(stack) > 1 else 1
            stack[-1] = max(stack[-1], last)
            i += 1
            continue
        if c == "|":
            bars += 1
        if c == "{":
            end = text.find("}", i)
            bound = _repeat_bound(text[i + 1 : end]) if end != -1 else None
            if bound is not None:
                product = last * bound
                if product > MAX_REPEAT:
                    raise BudgetError(
                        f"repetition bounds ({{m,n}}, nested ones multiplied) may reach at most "
                        f"{MAX_REPEAT}, got {product}"
                    )
                stack[-1] = max(stack[-1], product)
                best = max(best, product)
                last = product
                i = end + 1
                continue
        last = 1
        i += 1
    return max(best, *stack), bars


def _repeat_bound(inner: str) -> int | None:
    """The upper bound of a `{...}` quantifier's inside ("3", "2,5", "2," -> its lower bound), or
    None when it is not one (a literal brace)."""
    parts = [p.strip() for p in inner.split(",")]
    if len(parts) > 2 or not parts[0].isdigit() or not all(p.isdigit() or p == "" for p in parts):
        return None
    return max(int(p) for p in parts if p)


def check_regex(regex: str) -> int:
    """Raise BudgetError past a regex budget; else its largest repetition product."""
    if len(regex) > MAX_REGEX_CHARS:
        raise BudgetError(f"a regex may have at most {MAX_REGEX_CHARS} characters, got {len(regex)}")
    product, bars = _scan_repetitions(regex, quotes=False, max_depth=MAX_REGEX_DEPTH)
    if bars + 1 > MAX_REGEX_ALTERNATIVES:
        raise BudgetError(f"a regex may have at most {MAX_REGEX_ALTERNATIVES} alternatives, got {bars + 1}")
    return product


def check_grammar(grammar: str) -> None:
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise BudgetError(f"a grammar may have at most {MAX_GRAMMAR_CHARS} characters, got {len(grammar)}")
    _, bars = _scan_repetitions(grammar, quotes=True, max_depth=MAX_REGEX_DEPTH)
    if bars + 1 > MAX_GRAMMAR_ALTERNATIVES:
        raise BudgetError(
            f"a grammar may have at most {MAX_GRAMMAR_ALTERNATIVES} alternatives, got {bars + 1}"
        )


def check_choices(choices: list[str] | tuple[str, ...]) -> None:
    total = 0
    for i, choice in enumerate(choices):
        if isinstance(choice, str):
            if len(choice) > MAX_CHOICE_CHARS:
                raise BudgetError(f"a choice may have at most {MAX_CHOICE_CHARS} characters", f"{i}")
            total += len(choice)
    if total > MAX_CHOICES_TOTAL_CHARS:
        raise BudgetError(
            f"the choices may have at most {MAX_CHOICES_TOTAL_CHARS} characters in all, got {total}"
        )


def check_constraint(kind: str, spec: object) -> object:
    """Check one constraint against its budget (kind: json | regex | choice | grammar | json_object);
    a JSON schema given as text comes back parsed, anything else as it is."""
    if kind == "json":
        schema = load_json_schema(spec) if isinstance(spec, str) else spec
        check_json_schema(schema)
        return schema
    if kind == "regex" and isinstance(spec, str):
        check_regex(spec)
    elif kind == "grammar" and isinstance(spec, str):
        check_grammar(spec)
    elif kind == "choice" and isinstance(spec, (list, tuple)):
        check_choices(spec)
    return spec
