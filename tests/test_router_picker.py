"""The router's picking function, prefix index and state (kvscale.router): pure, no I/O. Adapter
affinity too: a LoRA adapter's request goes where it is resident, else where a slot is free, never
past the load bound, and a base-model request is not moved by adapters at all."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvscale.router.picker import Candidate, PickerConfig, load_bound, pick, pick_round_robin
from kvscale.router.prefix_index import (
    PrefixIndex,
    block_hashes,
    chat_prefix_text,
    prompt_prefix_text,
)
from kvscale.router.state import RouterState, WorkerMetrics

ENDPOINTS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
SYSTEM = "You are a careful Python reviewer. " * 40  # ~1,400 characters: 21 blocks
text = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=300)


def state(*endpoints: str, **kw) -> RouterState:
    s = RouterState(**kw)
    s.set_endpoints(endpoints or ENDPOINTS)
    return s


# -- hashing --------------------------------------------------------------------------------------
def test_block_hashes_are_chained_per_model_and_skip_a_partial_block():
    a = block_hashes("m", "x" * 64 * 3 + "tail", block_chars=64)
    assert len(a) == 3
    assert block_hashes("m", "x" * 64 * 2, block_chars=64) == a[:2]
    assert block_hashes("other", "x" * 64 * 3, block_chars=64)[0] != a[0]  # per model
    # Chained: a block equal to an earlier one still hashes differently at another position.
    assert len(set(a)) == 3
    assert block_hashes("m", "y" + "x" * 64 * 3, block_chars=64)[1:] != a[1:]


@given(text, text)
def test_a_text_extending_another_keeps_its_hashes(first, more):
    assert block_hashes("m", first + more, 8)[: len(first) // 8] == block_hashes("m", first, 8)


def test_chat_serialization_extends_with_the_conversation():
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert chat_prefix_text(turn2).startswith(chat_prefix_text(turn1))
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert chat_prefix_text(parts) == chat_prefix_text([{"role": "user", "content": "ab"}])
    # role and content are delimited: moving text from one into the other changes the string
    assert chat_prefix_text([{"role": "user", "content": "x"}]) != chat_prefix_text([{"role": "userx"}])


def test_prompt_text_of_strings_ids_and_batches():
    assert prompt_prefix_text("abc") == "abc"
    assert prompt_prefix_text(["abc", "def"]) == "abc"
    assert prompt_prefix_text([1, 22, 3]) == "1,22,3,"
    assert prompt_prefix_text([1, 22, 3, 4]).startswith(prompt_prefix_text([1, 22, 3]))
    assert prompt_prefix_text([[5, 6], [7]]) == "5,6,"
    assert prompt_prefix_text(None) == ""


# -- the index ------------------------------------------------------------------------------------
def test_index_match_stops_at_the_first_miss_and_evicts_tails_first():
    idx = PrefixIndex(default_capacity=4)
    idx.record("a", [1, 2, 3])
    assert idx.match_length("a", [1, 2, 3, 4]) == 3
    assert idx.match_length("a", [1, 9, 3]) == 1
    assert idx.match_length("b", [1]) == 0
    idx.record("a", [7, 8])  # over capacity: the oldest (the tail of the first prompt) goes
    assert idx.size("a") == 4
    assert idx.match_length("a", [1, 2, 3]) == 2
    assert idx.match_length("a", [7, 8]) == 2
    idx.set_capacity("a", 2)
    assert idx.size("a") == 2 and idx.match_length("a", [7, 8]) == 2


# -- affinity ---------------------------------------------------------------------------------------
def _hashes(s: str) -> list[int]:
    return block_hashes("tiny", s)


def test_a_shared_prefix_with_different_suffixes_goes_to_the_same_endpoint():
    s = state()
    first = s.choose(_hashes(SYSTEM + "Review this: def f(): pass"))
    s.release(first)
    for suffix in ("Review that: class A: ...", "And this one: import os" * 3, "x" * 500):
        chosen = s.choose(_hashes(SYSTEM + suffix))
        assert chosen == first
        s.release(chosen)


def test_a_prompt_extending_an_earlier_one_goes_where_it_went_even_under_even_load():
    s = state()
    # Every endpoint busy with 3 requests of its own prefix; the conversation's next turn still
    # goes where its first turn went.
    for i in range(9):
        s.choose(_hashes(f"unrelated prompt number {i} " * 20))
    assert sorted(s.in_flight.values()) == [3, 3, 3]
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "explain decorators"}]
    where = s.choose(_hashes(chat_prefix_text(turn1)))
    s.release(where)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "a decorator wraps " * 10},
        {"role": "user", "content": "?"},
    ]
    assert s.choose(_hashes(chat_prefix_text(turn2))) == where


def test_new_prefixes_spread_over_idle_endpoints():
    s = state()
    picked = set()
    for i in range(30):
        e = s.choose(_hashes(f"conversation {i}: " + "q" * 200))
        picked.add(e)
        s.release(e)
    assert picked == set(ENDPOINTS)


def test_kv_usage_and_queue_steer_away_from_a_loaded_endpoint():
    cands = [
        Candidate("a", kv_usage=0.9, waiting=3, running=8),
        Candidate("b", kv_usage=0.1, waiting=0, running=1),
    ]
    assert pick(cands, 4) == "b"


def test_a_busier_home_keeps_its_prefix_until_requests_queue_there():
    # The home holds the request's prefix (9 of 10 blocks) and batches more, with more KV in use.
    home = Candidate("home", kv_usage=0.6, running=3, in_flight=3, prefix_match=9)
    other = Candidate("other", kv_usage=0.2, running=1, in_flight=1)
    third = Candidate("third", kv_usage=0.5, running=3, in_flight=3)
    assert pick([home, other, third], 10) == "home"
    # Once requests wait there, scraped or sent since the last scrape (in flight beyond running),
    # the queue score moves it; all three are under the load bound (ceil(1.25 x 8 / 3) = 4).
    waiting = Candidate("home", kv_usage=0.6, running=3, waiting=4, in_flight=3, prefix_match=9)
    unseen = Candidate("home", kv_usage=0.6, running=1, in_flight=3, prefix_match=9)
    assert pick([waiting, other, third], 10) == "other"
    assert pick([unseen, other, third], 10) == "other"


def test_with_the_prefill_guard_a_cold_prompt_goes_where_the_least_prefill_is_ahead():
    """The route benchmark's slowest first tokens were prompts cached nowhere, sent behind another
    cold prompt's prefill while a worker had none ahead (its KV usage a little higher). With the
    prefill guard the queue score weighs the prefill work ahead (pending + this request's cost)."""
    guard = PickerConfig(prefill_factor=2.0, prefill_slack=1000)  # wide: every one passes the guard
    behind = Candidate("behind", kv_usage=0.10, pending_prefill=457, prefill_cost=457, prefix_blocks=28)
    free = Candidate("free", kv_usage=0.30, pending_prefill=0, prefill_cost=457, prefix_blocks=28)
    assert pick([behind, free], 28, config=guard) == "free"
    assert pick([behind, free], 28) == "behind"  # without the guard: requests queued, then KV
    # A warm prompt still goes home: its cost there is small, and the prefix score is there too.
    home = Candidate(
        "home", kv_usage=0.30, pending_prefill=457, prefill_cost=73, prefix_match=24, prefix_blocks=28
    )
    assert pick([home, free], 28, config=guard) == "home"


def test_an_endpoint_at_its_limit_takes_nothing_and_none_when_all_are():
    config = PickerConfig(max_waiting=4, max_kv_usage=0.95)
    full_queue = Candidate("a", waiting=4, prefix_match=10)
    full_kv_waiting = Candidate("b", kv_usage=0.97, waiting=1, prefix_match=10)
    full_kv_idle_queue = Candidate("c", kv_usage=0.97, waiting=0)
    assert pick([full_queue, full_kv_waiting, full_kv_idle_queue], 10, config=config) == "c"
    assert pick([full_queue, full_kv_waiting], 10, config=config) is None
    assert pick([], 10) is None
    assert pick_round_robin([full_queue, full_kv_waiting], 0, config) is None


def test_the_guard_spills_a_hot_prefix():
    s = state()
    hot = _hashes(SYSTEM)
    counts: dict[str, int] = {}
    for _ in range(30):  # 30 concurrent requests of one prefix: no endpoint takes over ceil(1.25*30/3)
        e = s.choose(hot)
        counts[e] = counts.get(e, 0) + 1
    assert max(counts.values()) <= math.ceil(1.25 * 30 / 3)
    assert len(counts) == 3


# -- the bounded-load guard holds under any sequence of arrivals ------------------------------------
events = st.lists(
    st.tuples(
        st.booleans(),  # arrival (True) or a completion
        st.integers(0, 5),  # which prefix (arrival) / which endpoint (completion)
        st.integers(0, 1000),  # metrics seed
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(events, st.integers(1, 6), st.sampled_from([1.0, 1.1, 1.25, 2.0]))
def test_bounded_load_guard_holds_under_any_sequence(seq, n, c):
    names = [f"http://e{i}" for i in range(n)]
    s = RouterState(PickerConfig(load_factor=c, max_waiting=10**9))
    s.set_endpoints(names)
    prefixes = [_hashes(f"prefix {p} " * 30) for p in range(6)]
    for arrival, which, seed in seq:
        for i, name in enumerate(names):  # arbitrary scraped metrics
            s.update_metrics(
                name, WorkerMetrics(kv_usage=((seed + 37 * i) % 100) / 100, running=(seed + i) % 7)
            )
        if arrival:
            total = sum(s.in_flight.values())
            chosen = s.choose(prefixes[which])
            assert chosen is not None  # somebody is always under the bound
            # it was under c x the mean load counting this request, as was required of it
            assert s.in_flight[chosen] - 1 < math.ceil(c * (total + 1) / n)
        else:
            name = names[which % n]
            if s.in_flight.get(name):
                s.release(name)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=80), st.integers(1, 6), st.sampled_from([1.0, 1.25, 2.0]))
def test_arrivals_alone_never_load_an_endpoint_past_the_bound(seq, n, c):
    s = RouterState(PickerConfig(load_factor=c))
    s.set_endpoints(f"http://e{i}" for i in range(n))
    for k, p in enumerate(seq, start=1):
        s.choose(_hashes(f"prefix {p} " * 30))
        assert max(s.in_flight.values()) <= math.ceil(c * k / n)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1), st.integers(0, 5)), max_size=120),
    st.integers(1, 6),
    st.sampled_from([1.0, 1.25, 2.0]),
)
def test_two_routers_load_an_endpoint_at_most_one_request_past_one_routers_bound(seq, n, c):
    """Two replicas, each with its own in-flight counts, the arrivals split between them in any
    way (a Service balances connections, not requests): after k arrivals in all, no endpoint
    holds more than ceil(c x k / n) + 1 of them (one router's bound, plus one). Each router keeps
    its own share under ceil(c x k_r / n) < c x k_r / n + 1, and the shares add up: N routers
    add at most N - 1 per endpoint, not a factor of N."""
    names = [f"http://e{i}" for i in range(n)]
    routers = [RouterState(PickerConfig(load_factor=c)) for _ in range(2)]
    for r in routers:
        r.set_endpoints(names)
    worst = 0
    for k, (which, p) in enumerate(seq, start=1):
        routers[which].choose(_hashes(f"prefix {p} " * 30))
        combined = max(sum(r.in_flight.get(e, 0) for r in routers) for e in names)
        assert combined <= math.ceil(c * k / n) + 1
        worst = max(worst, combined - math.ceil(c * k / n))
    assert worst <= 1


def test_two_routers_can_reach_the_extra_one():
    """The +1 is attained, not slack in the proof: two endpoints, c = 1, one request of the same
    prefix at each router. Each sees an idle pool and picks the same endpoint by the same
    tie-break: 2 there, where one router taking both would have put 1 (ceil(1 x 2 / 2))."""
    names = ["http://e0", "http://e1"]
    routers = [RouterState(PickerConfig(load_factor=1.0)) for _ in range(2)]
    for r in routers:
        r.set_endpoints(names)
    hot = _hashes("the same prefix " * 30)
    chosen = [r.choose(hot) for r in routers]  # each sees an idle pool: the same tie-break
    assert chosen[0] == chosen[1]
    assert math.ceil(1.0 * 2 / 2) + 1 == 2 == sum(r.in_flight[chosen[0]] for r in routers)


def test_load_bound_is_chwbl_capacity():
    assert load_bound(0, 3, 1.25) == 1
    assert load_bound(11, 3, 1.25) == 5


# -- endpoints leaving and restarting -----------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.sampled_from(["kv-prefix", "round-robin"]))
def test_an_endpoint_leaving_the_set_gets_nothing_more(seq, policy):
    s = state(policy=policy)
    prefixes = [_hashes(f"prefix {p} " * 30) for p in range(6)]
    for p in range(6):
        s.choose(prefixes[p])  # every prefix has a home, some on the one about to leave
    gone = ENDPOINTS[1]
    s.set_endpoints([ENDPOINTS[0], ENDPOINTS[2]])
    assert s.index.size(gone) == 0
    for p in seq:
        assert s.choose(prefixes[p]) != gone
    s.release(gone)  # its requests still in flight finish without harm


def test_a_restarted_worker_forgets_its_prefixes_and_its_pool_bounds_the_index():
    s = state()
    e = s.choose(_hashes(SYSTEM))
    s.update_metrics(e, WorkerMetrics(prefix_queries=100, prefix_hits=40, kv_blocks=1000))
    assert s.index.match_length(e, _hashes(SYSTEM)) == len(_hashes(SYSTEM))
    s.update_metrics(e, WorkerMetrics(prefix_queries=500, prefix_hits=60, kv_blocks=1000))
    assert s.index.size(e) > 0
    s.update_metrics(e, WorkerMetrics(prefix_queries=5, prefix_hits=0, kv_blocks=1000))  # counters reset
    assert s.index.size(e) == 0
    s.choose(_hashes(SYSTEM), exclude=[x for x in ENDPOINTS if x != e])
    s.update_metrics(e, WorkerMetrics(prefix_queries=6, prefix_hits=0, kv_blocks=4))
    assert s.index.size(e) == 4


# -- LoRA adapter affinity ---------------------------------------------------------------------------
def lora_worker(**kw) -> WorkerMetrics:
    """A scraped worker serving base model "tiny" with two LoRA slots (unless told)."""
    return WorkerMetrics(served_model="tiny", **{"max_lora": 2, **kw})


def test_two_adapters_taking_turns_on_two_one_slot_workers_each_keep_a_worker():
    """An empty slot beats an idle adapter's: whichever worker the hash would favour for both, the
    second adapter goes to the empty one, and from then on each is resident where it went (no
    eviction at every request, as when an idle adapter's slot counted as free as an empty one)."""
    for turn in range(16):  # prefixes vary the tie-break
        s = state(*ENDPOINTS[:2])
        for e in ENDPOINTS[:2]:
            s.update_metrics(e, lora_worker(max_lora=1, lora_free_slots=1))
        holder: dict[str, str] = {}
        for i in range(6):
            model = ("sql", "doc")[i % 2]
            e = s.choose(_hashes(f"{turn} {model} prompt " * 20), model=model)
            if i >= 2:
                assert e == holder[model] and s.affinity(e, model) == "resident"
            holder.setdefault(model, e)
            s.release(e)
            s.update_metrics(e, lora_worker(max_lora=1, lora_free_slots=1, adapters=frozenset({model})))
        assert holder["sql"] != holder["doc"]


def test_an_adapters_holder_wins_over_any_kv_and_queue_difference():
    # The holder at the worst kv usage and queue an endpoint can have and still take requests; the
    # others at the best. Affinity decides; kv and queue only order endpoints of one tier.
    holder = Candidate("holder", kv_usage=0.94, waiting=31, in_flight=1, has_adapter=True)
    room = Candidate("room", in_flight=1, adapter_room=True)
    none = Candidate("none", in_flight=1)
    assert pick([holder, room, none], 4) == "holder"
    worst_room = Candidate("room", kv_usage=0.94, waiting=31, in_flight=1, adapter_room=True)
    assert pick([worst_room, none], 4) == "room"  # a free slot beats none, where it would wait
    fuller = Candidate("fuller", kv_usage=0.5, in_flight=1, adapter_room=True)
    assert pick([room, fuller], 4) == "room"  # within a tier, kv and queue decide


def test_which_model_names_an_adapter():
    s = state()
    assert s.adapter_of("sql") is None  # nothing scraped: no affinity, as before
    s.update_metrics(ENDPOINTS[0], WorkerMetrics(served_model="tiny"))
    assert s.adapter_of("sql") is None  # no worker has LoRA slots (a 404 wherever it goes)
    s.update_metrics(ENDPOINTS[1], lora_worker())
    assert s.adapter_of("sql") == "sql"
    assert s.adapter_of("tiny") is None  # the base model's served name


def test_an_adapter_goes_where_it_is_resident_and_spills_to_a_free_slot_past_the_bound():
    s = state()
    holder, room, full = ENDPOINTS
    s.update_metrics(holder, lora_worker(adapters=frozenset({"sql"}), lora_free_slots=1))
    s.update_metrics(room, lora_worker(lora_free_slots=2, kv_usage=0.5))
    s.update_metrics(full, lora_worker(adapters=frozenset({"a", "b"}), lora_free_slots=0))
    hot = _hashes(SYSTEM)
    for _ in range(5):  # one at a time: always the holder, whatever the others' kv usage
        e = s.choose(hot, model="sql")
        assert e == holder and s.affinity(e, "sql") == "resident"
        s.release(e)
    # Seven at once: the holder takes up to the bound (ceil(1.25 x k / 3) after k), the spill goes
    # to the free slot first (it loads the adapter there), and to `full` only when both are at it.
    picks = [s.choose(hot, model="sql") for _ in range(7)]
    assert picks == [holder, room, holder, room, holder, room, full]
    assert [s.affinity(e, "sql") for e in (holder, room, full)] == ["resident", "empty", "none"]


def test_an_adapter_goes_only_where_it_is_served_while_any_worker_serves_it():
    """A new pod the operator has not loaded the adapter into yet (it serves none: the best kv and
    an empty slot) gets none of its requests; a worker that does not say (vLLM) may; an adapter no
    worker serves, and the base model, go anywhere."""
    s = state()
    holder, new_pod, vllm = ENDPOINTS
    s.update_metrics(holder, lora_worker(served_adapters=frozenset({"sql"}), kv_usage=0.9, waiting=20))
    s.update_metrics(new_pod, lora_worker(served_adapters=frozenset(), lora_free_slots=2))
    s.update_metrics(vllm, lora_worker(lora_free_slots=0, kv_usage=0.9, waiting=20))
    assert s.serving("sql") == {holder, vllm}
    picks = []
    for i in range(12):
        e = s.choose(_hashes(f"{i} sql " * 40), model="sql")
        picks.append(e)
    assert new_pod not in picks and set(picks) == {holder, vllm}  # over the bound, both take some
    assert s.serving("nope") is None and s.serving(None) is None
    for i in range(3):
        assert s.choose(_hashes(f"{i} base " * 40), model="tiny") is not None
    assert s.choose(_hashes("x " * 40), model="nope") == new_pod  # anywhere: the best scores


def test_a_base_model_request_is_not_moved_by_adapters_or_slots():
    """Where each base-model request goes without LoRA, it goes with every other endpoint holding
    adapters, free slots, even an adapter named like the base model: it names no adapter."""
    for i in range(12):
        hashes = _hashes(f"conversation {i}: " + "q" * 200)
        plain = state()
        for e in ENDPOINTS:
            plain.update_metrics(e, WorkerMetrics(served_model="tiny"))
        where = plain.choose(hashes, model="tiny")
        lora = state()
        for e in ENDPOINTS:
            held = frozenset() if e == where else frozenset({"tiny", "sql"})
            lora.update_metrics(e, lora_worker(adapters=held, lora_free_slots=0 if e == where else 2))
        assert lora.choose(hashes, model="tiny") == where
        assert lora.affinity(where, "tiny") is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**12)), max_size=80),
    st.integers(1, 5),
    st.sampled_from([1.0, 1.25, 2.0]),
)
def test_adapter_affinity_never_loads_an_endpoint_past_the_bound(seq, n, c):
    names = [f"http://e{i}" for i in range(n)]
    s = RouterState(PickerConfig(load_factor=c))
    s.set_endpoints(names)
    models = ["tiny", "sql", "doc", "w3"]
    for k, (m, seed) in enumerate(seq, start=1):
        for i, name in enumerate(names):  # arbitrary adapters and slots
            held = frozenset(a for j, a in enumerate(models[1:]) if (seed >> (3 * i + j)) & 1)
            s.update_metrics(name, lora_worker(adapters=held, lora_free_slots=(seed + i) % 3))
        s.choose(_hashes(f"prefix {m} " * 30), model=models[m])
        assert max(s.in_flight.values()) <= math.ceil(c * k / n)


def test_round_robin_cycles_over_those_that_can_take():
    s = state(policy="round-robin")
    assert [s.choose([]) for _ in range(6)] == sorted(ENDPOINTS) * 2
