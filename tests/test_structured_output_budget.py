"""Budgets on client programs (structured_output/budget.py), the fair compile pool
(compile_pool.py) and the manager's byte-bounded, cancellable compile cache: pure and in-process,
no model (a counting stand-in backend)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict, deque

import pytest
import torch

from kvscale.worker.sample.sampling_params import StructuredOutputsParams
from kvscale.worker.structured_output import budget as b
from kvscale.worker.structured_output.backend import StructuredOutputBackend
from kvscale.worker.structured_output.compile_pool import CompilePool, PoolFull, pick_client
from kvscale.worker.structured_output.manager import StructuredOutputManager


def nested_schema(levels: int) -> dict:
    """An object schema `levels` object levels deep: 2 JSON levels each, plus the leaf."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def refused(check, *args) -> str:
    with pytest.raises(b.BudgetError) as e:
        check(*args)
    return str(e.value)


# -- JSON schemas --------------------------------------------------------------------------------
def test_the_400_level_24kb_schema_is_refused_in_milliseconds() -> None:
    schema = nested_schema(400)
    assert 23_000 < len(json.dumps(schema)) < 25_000
    start = time.perf_counter()
    assert "nested more than 64 levels" in refused(b.check_json_schema, schema)
    assert time.perf_counter() - start < 0.05
    # As JSON text too, and 10,000 levels deep: a 400, never a RecursionError.
    deep = "[" * 10_000 + "]" * 10_000
    assert "nested" in refused(b.check_constraint, "json", '{"const": ' + deep + "}")
    value: list = []
    for _ in range(10_000):
        value = [value]
    assert "nested" in refused(b.check_json_schema, {"const": value})


def test_schema_depth_budget() -> None:
    # 31 object levels: 63 JSON levels with the leaf's value; 32: 65.
    b.check_json_schema(nested_schema(31))
    refused(b.check_json_schema, nested_schema(32))


def _props(n: int, prefix: str = "p") -> dict:
    return {f"{prefix}{i}": {"type": "integer"} for i in range(n)}


def test_schema_size_budget() -> None:
    under = {"type": "string", "description": "x" * (b.MAX_SCHEMA_BYTES - 100)}
    b.check_json_schema(under)
    over = {"type": "string", "description": "x" * b.MAX_SCHEMA_BYTES}
    assert "bytes" in refused(b.check_json_schema, over)
    assert "bytes" in refused(b.check_constraint, "json", json.dumps(over))


def test_schema_properties_per_object_budget() -> None:
    b.check_json_schema({"type": "object", "properties": _props(b.MAX_OBJECT_PROPERTIES)})
    message = refused(
        b.check_json_schema, {"type": "object", "properties": _props(b.MAX_OBJECT_PROPERTIES + 1)}
    )
    assert "at most 256 properties" in message


def test_schema_total_properties_budget() -> None:
    # Three objects of 255 plus the 4 of the root: 769; four of 255 + 5: 1025.
    def schema(n: int) -> dict:
        objects = {f"o{j}": {"type": "object", "properties": _props(255)} for j in range(n)}
        return {"type": "object", "properties": objects}

    b.check_json_schema(schema(4))  # 4 * 255 + 4 = 1024
    assert "more than 1024 properties" in refused(
        b.check_json_schema, {"allOf": [schema(4), {"properties": _props(1)}]}
    )


def test_schema_branch_and_enum_budgets() -> None:
    b.check_json_schema({"anyOf": [{"type": "integer"}] * b.MAX_SCHEMA_BRANCHES})
    assert "anyOf" in refused(
        b.check_json_schema, {"anyOf": [{"type": "integer"}] * (b.MAX_SCHEMA_BRANCHES + 1)}
    )
    split = {"anyOf": [{"type": "integer"}] * 200, "properties": {"x": {"oneOf": [{"type": "null"}] * 57}}}
    refused(b.check_json_schema, split)  # counted across the whole schema
    b.check_json_schema({"enum": list(range(b.MAX_ENUM_VALUES))})
    assert "enum" in refused(b.check_json_schema, {"enum": list(range(b.MAX_ENUM_VALUES + 1))})


@pytest.mark.parametrize("keyword", ["minItems", "maxItems", "minLength", "maxLength", "maxProperties"])
def test_schema_count_bounds(keyword: str) -> None:
    b.check_json_schema({keyword: b.MAX_COUNT_BOUND})
    assert keyword in refused(b.check_json_schema, {keyword: b.MAX_COUNT_BOUND + 1})


def test_schema_node_budget_refuses_a_wide_document_before_walking_it() -> None:
    b.check_json_schema({"const": list(range(b.MAX_SCHEMA_NODES - 3))})
    wide = {"const": list(range(1_000_000))}
    start = time.perf_counter()
    refused(b.check_json_schema, wide)
    assert time.perf_counter() - start < 0.05


def test_a_schemas_patterns_share_one_repetition_budget() -> None:
    def schema(n: int, bound: int) -> dict:
        return {"properties": {f"p{i}": {"type": "string", "pattern": f"^a{{1,{bound}}}$"} for i in range(n)}}

    b.check_json_schema(schema(16, 256))  # 16 x 256^2 = 1024^2
    assert "patterns repeat too much" in refused(b.check_json_schema, schema(17, 256))
    refused(b.check_json_schema, schema(16, 1024))  # 4 s of parsing, measured


def test_a_pattern_in_a_schema_has_the_regex_budget() -> None:
    b.check_json_schema({"type": "string", "pattern": "^[a-z]{1,1024}$"})
    message = refused(
        b.check_json_schema, {"properties": {"s": {"type": "string", "pattern": "^[a-z]{1,1025}$"}}}
    )
    assert "#/properties/s/pattern" in message and "1025" in message


# -- regexes, grammars, choices ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("under", "over"),
    [
        ("[a-z]{1,1024}", "[a-z]{1,1025}"),
        ("a{1024}", "a{1025,}"),
        ("(([a-z]{1,32}){1,32})", "(([a-z]{1,32}){1,33})"),  # nested bounds multiply
        ("(a|b){2}{512}", "(a|b){2}{513}"),  # so do stacked ones
        ("|".join(["w"] * b.MAX_REGEX_ALTERNATIVES), "|".join(["w"] * (b.MAX_REGEX_ALTERNATIVES + 1))),
        ("(" * 64 + "a" + ")" * 64, "(" * 65 + "a" + ")" * 65),
        ("a" * b.MAX_REGEX_CHARS, "a" * (b.MAX_REGEX_CHARS + 1)),
    ],
)
def test_regex_budgets(under: str, over: str) -> None:
    b.check_regex(under)
    refused(b.check_regex, over)


def test_regex_braces_that_are_not_quantifiers_cost_nothing() -> None:
    for regex in (r"\{1,5000}", "[{]a{1,2}", "x{a}", r"\d{3}-\d{4}", "[]{]{2}"):
        b.check_regex(regex)


def test_grammar_budgets() -> None:
    b.check_grammar('root ::= [a-z]{1,1024} "{1,9999}"')  # a literal's braces are text
    refused(b.check_grammar, "root ::= [a-z]{1,1025}")
    b.check_grammar("root ::= " + " | ".join(['"a"'] * b.MAX_GRAMMAR_ALTERNATIVES))
    refused(b.check_grammar, "root ::= " + " | ".join(['"a"'] * (b.MAX_GRAMMAR_ALTERNATIVES + 1)))
    b.check_grammar("start: " + '"x" ' * ((b.MAX_GRAMMAR_CHARS - 7) // 4))
    refused(b.check_grammar, "start: " + "x" * b.MAX_GRAMMAR_CHARS)


def test_choice_budgets() -> None:
    b.check_choices(["x" * b.MAX_CHOICE_CHARS])
    refused(b.check_choices, ["x" * (b.MAX_CHOICE_CHARS + 1)])
    per = b.MAX_CHOICES_TOTAL_CHARS // 64
    b.check_choices([f"{i:03d}".ljust(per, "x") for i in range(64)])
    assert "in all" in refused(b.check_choices, [f"{i:03d}".ljust(per, "x") for i in range(65)])


# -- the compile pool ----------------------------------------------------------------------------
def test_pick_client_is_round_robin_within_each_clients_share() -> None:
    queued = OrderedDict(a=deque([1, 2]), b=deque([3]), c=deque())
    assert pick_client(queued, {}, 1) == "a"
    assert pick_client(queued, {"a": 1}, 1) == "b"
    assert pick_client(queued, {"a": 1, "b": 1}, 1) is None  # c has nothing queued
    assert pick_client(queued, {"a": 1}, 2) == "a"


def _blocking(gate: threading.Event, started: list, name: str):
    def job():
        started.append(name)
        assert gate.wait(10)
        return name

    return job


def test_one_client_cannot_occupy_the_pool() -> None:
    pool = CompilePool(workers=2)  # each client: 1 of the 2 threads
    gate, started = threading.Event(), []
    try:
        hostile = [pool.submit(_blocking(gate, started, f"h{i}"), "hostile") for i in range(4)]
        deadline = time.monotonic() + 5
        while not started and time.monotonic() < deadline:
            time.sleep(0.01)
        polite = pool.submit(lambda: "polite", "polite")
        assert polite.result(timeout=5) == "polite"  # while the hostile client's compiles still block
        assert started == ["h0"] and pool.running("hostile") == 1
        gate.set()
        assert [f.result(timeout=5) for f in hostile] == ["h0", "h1", "h2", "h3"]
    finally:
        gate.set()
        pool.shutdown()


def test_queues_are_bounded_per_client_and_in_all() -> None:
    pool = CompilePool(workers=1, max_queued_per_client=2, max_queued=3)
    gate, started = threading.Event(), []
    try:
        pool.submit(_blocking(gate, started, "run"), "a")
        deadline = time.monotonic() + 5
        while not started and time.monotonic() < deadline:
            time.sleep(0.01)
        pool.submit(lambda: 1, "a")
        pool.submit(lambda: 1, "a")
        with pytest.raises(PoolFull, match="this client"):
            pool.submit(lambda: 1, "a")
        pool.submit(lambda: 1, "b")
        with pytest.raises(PoolFull, match="already waiting"):
            pool.submit(lambda: 1, "c")
        pool.submit(lambda: 1, "c", bounded=False)  # the offline API waits for what it queues
    finally:
        gate.set()
        pool.shutdown()


def test_a_cancelled_queued_job_never_runs() -> None:
    pool = CompilePool(workers=1)
    gate, started = threading.Event(), []
    try:
        first = pool.submit(_blocking(gate, started, "first"), "a")
        deadline = time.monotonic() + 5
        while not started and time.monotonic() < deadline:
            time.sleep(0.01)
        gone = pool.submit(_blocking(gate, started, "gone"), "b")
        assert gone.cancel() and pool.num_queued == 0
        gate.set()
        assert first.result(timeout=5) == "first"
        after = pool.submit(lambda: "after", "c")
        assert after.result(timeout=5) == "after" and started == ["first"]
    finally:
        gate.set()
        pool.shutdown()


# -- the manager: one compile per constraint, a byte-bounded cache, cancellation ------------------
class CountingBackend(StructuredOutputBackend):
    """Compiles to a bytes blob of the constraint's `size`; counts parses and compiles."""

    def __init__(self, size: int = 100) -> None:
        self.size = size
        self.parses = 0
        self.compiles = 0
        self.gate = threading.Event()
        self.gate.set()

    def validate(self, params):
        b.check_constraint(params.kind, getattr(params, params.kind))

    def parse(self, params):
        self.parses += 1
        return params

    def compile(self, params, parsed=None):
        if parsed is None:
            parsed = self.parse(params)
        assert self.gate.wait(10)
        self.compiles += 1
        return b"x" * self.size

    def memory_size_bytes(self, compiled):
        return len(compiled)

    def new_matcher(self, compiled):
        raise NotImplementedError

    def allocate_bitmask(self, num_rows):
        return torch.zeros(num_rows, 1, dtype=torch.int32)

    def apply_bitmask(self, logits, bitmask, rows):
        raise NotImplementedError


def test_each_distinct_constraint_is_parsed_and_compiled_once() -> None:
    backend = CountingBackend()
    manager = StructuredOutputManager(backend, max_workers=2)
    try:
        handles = [
            manager.prepare(StructuredOutputsParams(choice=[f"c{i % 3}", "x"]), f"client{i}")
            for i in range(12)
        ]
        for h in handles:
            h.future.result(timeout=5)
        # The same schema as a dict and as its text, twice each: one entry.
        for spec in ({"type": "integer"}, '{"type":"integer"}') * 2:
            manager.prepare(StructuredOutputsParams(json=spec)).future.result(timeout=5)
        assert (backend.parses, backend.compiles) == (4, 4)
    finally:
        manager.shutdown()


def test_the_cache_is_bounded_in_bytes() -> None:
    backend = CountingBackend(size=1000)
    manager = StructuredOutputManager(backend, cache_bytes=3500)
    try:
        for i in range(10):
            manager.prepare(StructuredOutputsParams(regex=f"a{i}")).future.result(timeout=5)
        assert manager.cached_bytes == 3000 and manager.num_cached == 3
        # The least recently used went first: the last three are still cached.
        assert [manager.is_cached(StructuredOutputsParams(regex=f"a{i}")) for i in (6, 7, 8, 9)] == [
            False, True, True, True,
        ]  # fmt: skip
    finally:
        manager.shutdown()


def test_a_compile_whose_clients_all_left_is_not_run() -> None:
    backend = CountingBackend()
    manager = StructuredOutputManager(backend, max_workers=1)
    backend.gate.clear()
    try:
        running = manager.prepare(StructuredOutputsParams(regex="first"), "a")
        deadline = time.monotonic() + 5
        while manager.pool.running("a") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        params = StructuredOutputsParams(regex="left")
        one, two = manager.prepare(params, "b"), manager.prepare(params, "c")
        assert one.future is two.future
        one.release()
        assert not two.future.cancelled()  # another client still waits for it
        two.release()
        assert two.future.cancelled() and not manager.is_cached(params)
        running.release()  # running: it completes and is cached
        backend.gate.set()
        running.future.result(timeout=5)
        assert backend.compiles == 1 and manager.is_cached(StructuredOutputsParams(regex="first"))
    finally:
        backend.gate.set()
        manager.shutdown()


def test_a_failed_compile_is_not_cached() -> None:
    backend = CountingBackend()
    manager = StructuredOutputManager(backend)
    try:
        backend.compile = lambda params, parsed=None: (_ for _ in ()).throw(ValueError("invalid regex"))
        params = StructuredOutputsParams(regex="x")
        with pytest.raises(ValueError, match="invalid regex"):
            manager.prepare(params).future.result(timeout=5)
        assert not manager.is_cached(params)
    finally:
        manager.shutdown()


def test_compiles_run_at_a_lower_priority_than_the_loop_and_the_engine() -> None:
    # The loop and the engine thread keep their priority; a burst of compiles takes what they leave.
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    pool = CompilePool(workers=1, nice=7)
    try:
        assert pool.submit(niceness).result(timeout=5) == min(19, niceness() + 7)  # 19: the lowest
    finally:
        pool.shutdown()
