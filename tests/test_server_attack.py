"""The attack suite for client programs (issue 26): generated JSON schemas, regexes, grammars,
choice lists and tool lists against a live worker.

For every generated request: a 2xx, or a 4xx in OpenAI's error shape, within the request budget
(`REQUEST_BUDGET_S`); never a 5xx. Throughout the module a prober in its own process GETs
`/health` every 20 ms: every probe answers 200, none past 3 s; the slowest three are printed with
the requests in flight then. Afterwards the KV cache is back to 0 blocks in use and the server's
log holds no unexpected error.

CI runs it derandomized (the same examples every time) with a small example count; by hand,
`KVSCALE_ATTACK_EXAMPLES=500 KVSCALE_ATTACK_SEED=random pytest tests/test_server_attack.py` runs
longer with fresh draws.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server_fuzz import UNEXPECTED, check_error, send

from kvscale.worker.bench.prober import Probe

pytestmark = pytest.mark.slow

REQUEST_BUDGET_S = 30.0  # a generated program past its compile deadline must still answer by then
# Issue 26's goal is p100 < 100 ms, measured on a quiet machine (docs/server.md, "Hostile clients,
# measured": each run prints its probes' p50/p99/p100). A shared CI machine's scheduler adds its
# own pauses (one run saw 1.5 s with no request in flight), so CI holds p100 to a bound that a
# stall of the loop (the 11 s schema) would break, and no timed goal.
HEALTH_P100_BOUND_S = 3.0
EXAMPLES = int(os.environ.get("KVSCALE_ATTACK_EXAMPLES", "25"))
RANDOM = os.environ.get("KVSCALE_ATTACK_SEED") == "random"


def attack_settings(max_examples: int = EXAMPLES):
    return settings(
        max_examples=max_examples,
        derandomize=not RANDOM,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


def in_flight_during(sent: float, latency: float, requests: list[tuple[float, float, str]]) -> list[str]:
    """The requests (start, end, head of body) whose time overlaps a probe's."""
    return [head for t0, t1, head in requests if t0 < sent + latency and t1 > sent]


@pytest.fixture(scope="module")
def attacked(target_model, tmp_path_factory):
    from server_fixtures import start_server

    server = start_server(target_model, tmp_path_factory.mktemp("attack"), "--num-kv-blocks", "512")
    # The prober runs in its own process, as the kubelet does: a thread here would share this
    # interpreter's GIL with hypothesis and with json.dumps of a 5000-property schema, and blame
    # the server for the client's pauses (the by-hand p100s of 225-786 ms, 2026-12-04, were such).
    prober = Probe(server.base_url, server.proc.pid)
    prober.start()
    server.requests = []  # (start, end, head of body), time.monotonic()
    try:
        time.sleep(2.0)  # the prober's interpreter starts
        yield server
    finally:
        prober.stop()
        status, metrics = server.get("/metrics")
        log = server.log()
        assert server.stop() == 0, log
    failures = prober.failures["/health"]
    assert not failures, failures[:5]
    ordered = sorted(prober.health)
    p50, p99, worst = ordered[len(ordered) // 2], ordered[int(len(ordered) * 0.99)], ordered[-1]
    slowest = sorted(zip(prober.health, prober.sent["/health"], strict=True), reverse=True)[:3]
    print(
        f"attack: {len(ordered)} /health probes, p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
        f"p100 {worst * 1000:.1f} ms; examples {EXAMPLES}, seed {'random' if RANDOM else 'fixed'}"
    )
    for latency, sent in slowest:
        print(f"  probe {latency * 1000:.0f} ms during {in_flight_during(sent, latency, server.requests)}")
    assert worst < HEALTH_P100_BOUND_S, (p99, worst)
    assert status == 200
    usage = [
        line for line in metrics.decode().splitlines() if line.startswith("kvscale_kv_cache_usage_ratio")
    ]
    assert usage and float(usage[0].rsplit(" ", 1)[1]) == 0.0, usage
    assert not [line for line in log.splitlines() if UNEXPECTED.search(line)], log[-3000:]


# -- generated programs ------------------------------------------------------------------------
NAMES = st.text("abcdefghij_", min_size=1, max_size=8)
BIG = st.sampled_from([0, 1, 3, 10, 1000, 10**6, 10**12])

scalars = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("string")},
        optional={
            "maxLength": BIG,
            "minLength": BIG,
            "pattern": st.sampled_from(["[a-z]+", "a{1,100000}", "(a|b)*c", "(", "\\d{3}-\\d{4}"]),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["integer", "number"])},
        optional={"minimum": st.integers(-(10**6), 0), "maximum": st.integers(0, 10**6)},
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["boolean", "null"])}),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(st.integers(), NAMES), min_size=1, max_size=600)}),
)


def containers(children):
    return st.one_of(
        st.builds(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props)[: len(props) // 2],
            },
            st.dictionaries(NAMES, children, max_size=6),
        ),
        st.fixed_dictionaries(
            {"type": st.just("array"), "items": children}, optional={"minItems": BIG, "maxItems": BIG}
        ),
        st.fixed_dictionaries({"anyOf": st.lists(children, min_size=1, max_size=4)}),
    )


schemas = st.recursive(scalars, containers, max_leaves=25)


def nested(depth: int, key: str = "a") -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "maxLength": 2}
    for _ in range(depth):
        schema = {"type": "object", "properties": {key: schema}, "required": [key]}
    return schema


@dataclass(frozen=True)
class Deep:
    """A schema nested `depth` levels, built only when the body is serialised: hypothesis prints
    (and compares) its examples recursively, which a 3000-level dict would overflow."""

    depth: int


def materialize(value: Any) -> Any:
    if isinstance(value, Deep):
        return nested(value.depth)
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [materialize(v) for v in value]
    return value


deep_schemas = st.builds(Deep, st.sampled_from([8, 64, 200, 400, 3000]))
wide_schemas = st.builds(
    lambda n, k: {
        "type": "object",
        "properties": {f"p{i}": {"enum": [f"v{i}_{j}" for j in range(k)]} for i in range(n)},
    },
    st.sampled_from([1, 50, 500, 5000]),
    st.sampled_from([1, 20, 300]),
)

REGEX_ATOMS = [
    "a",
    "[a-z]",
    "\\d",
    ".",
    "(a|b)",
    "(",
    ")",
    "[",
    "*",
    "+",
    "?",
    "{2,5}",
    "{1000,100000}",
    "{0,4294967295}",
    "|",
    "\\",
]
regexes = st.lists(st.sampled_from(REGEX_ATOMS), min_size=1, max_size=40).map("".join)
GRAMMAR_BODIES = [
    '"a"',
    '"a" root',
    "x*",
    "x{1000,100000}",
    "(x | y)*",
    '[a-z]+ "!"',
    "root root",
    '"',
    "x ::=",
]
grammars = st.builds(
    lambda body, rules: "root ::= " + body + "".join(f"\n{n} ::= {b}" for n, b in rules),
    st.sampled_from(GRAMMAR_BODIES),
    st.lists(st.tuples(st.sampled_from(["x", "y", "z"]), st.sampled_from(GRAMMAR_BODIES)), max_size=4),
)
choices = st.one_of(
    st.lists(st.text(min_size=0, max_size=40), min_size=0, max_size=300),
    st.builds(
        lambda n, w: [f"{i}" + "c" * w for i in range(n)],
        st.sampled_from([1, 256, 257, 2000]),
        st.sampled_from([1, 1000, 100000]),
    ),
)
tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.one_of(NAMES, st.text(max_size=80)),
                    "parameters": st.one_of(schemas, deep_schemas),
                }
            ),
        }
    ),
    min_size=0,
    max_size=140,
)

programs = st.one_of(
    st.builds(lambda s: ("json", s), st.one_of(schemas, deep_schemas, wide_schemas)),
    st.builds(lambda r: ("regex", r), regexes),
    st.builds(lambda g: ("grammar", g), grammars),
    st.builds(lambda c: ("choice", c), choices),
)


def check_bounded(r, path: str, elapsed: float) -> None:
    assert elapsed < REQUEST_BUDGET_S, f"{elapsed:.1f}s"
    assert r.status < 500, (r.status, r.data[:500])
    if r.status >= 400:
        check_error(r)
    else:
        assert r.status == 200, r.status
        body = json.loads(r.data)
        assert body["choices"], body


def dumps_deep(value: Any) -> str:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        return json.dumps(value)
    finally:
        sys.setrecursionlimit(limit)


def timed_post(server, path: str, body: dict[str, Any]):
    """POST `body` as JSON. Serialised with a raised recursion limit: the deepest generated
    schemas nest past Python's default (the server must refuse them, not the client)."""
    data = dumps_deep(materialize(body)).encode()
    t0 = time.monotonic()
    r = send(server, "POST", path, data, {"Content-Type": "application/json"})
    elapsed = time.monotonic() - t0
    server.requests.append((t0, t0 + elapsed, data[:200].decode(errors="replace")))
    return r, elapsed


@attack_settings()
@given(program=programs, endpoint=st.sampled_from(["completions", "chat"]))
def test_generated_programs(attacked, program, endpoint):
    kind, value = program
    base = {"max_tokens": 4, "temperature": 0, "structured_outputs": {kind: value}}
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "x"}]}
    else:
        path, body = "/v1/completions", {**base, "prompt": "x = "}
    r, elapsed = timed_post(attacked, path, body)
    check_bounded(r, path, elapsed)


@attack_settings()
@given(tool_list=tools, choice=st.sampled_from(["required", "auto", "none"]))
def test_generated_tool_lists(attacked, tool_list, choice):
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        "temperature": 0,
        "tools": tool_list,
        "tool_choice": choice,
    }
    r, elapsed = timed_post(attacked, "/v1/chat/completions", body)
    check_bounded(r, "/v1/chat/completions", elapsed)


@attack_settings(max_examples=max(5, EXAMPLES // 3))
@given(schema=st.one_of(schemas, deep_schemas, wide_schemas), as_text=st.booleans())
def test_generated_response_formats(attacked, schema, as_text):
    # Materialised once, by timed_post (again, a 3000-level dict would overflow the walk).
    if as_text:  # a string where OpenAI wants an object: a 400, never a 5xx
        schema = dumps_deep(materialize(schema))
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "response_format": fmt}
    r, elapsed = timed_post(attacked, "/v1/chat/completions", body)
    check_bounded(r, "/v1/chat/completions", elapsed)
