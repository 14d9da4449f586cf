"""The routing benchmark's arithmetic (worker/bench/route.py): deltas of the workers' counters,
percentiles, balance and the goals; the benchmark itself runs real workers (docs/benchmarks.md)."""

from __future__ import annotations

import json

from kvscale.worker.bench.route import ClientRun, TurnResult, compare, summarize, ttft_tail, write_trace


def _counters(q, h, n, p):
    return {
        "vllm:prefix_cache_queries": q,
        "vllm:prefix_cache_hits": h,
        "vllm:request_success": n,
        "vllm:prompt_tokens": p,
    }


def test_summarize_uses_counter_deltas_and_reports_balance():
    run = ClientRun(
        [TurnResult(0.0, 0.1, 1.0, 4), TurnResult(0.0, 0.3, 1.0, 4), TurnResult(error="HTTP 503")], 2.0
    )
    before = [_counters(100, 50, 1, 10), _counters(0, 0, 0, 0)]
    after = [_counters(300, 200, 4, 310), _counters(100, 10, 2, 100)]
    s = summarize(run, before, after, 0.5)
    assert s["prefix_cache_hit_rate"] == round(160 / 300, 4)
    assert [w["requests"] for w in s["per_worker"]] == [3, 2]
    assert s["per_worker"][0]["prefix_cache_hit_rate"] == 0.75
    assert s["load_balance_max_over_mean"] == 1.2
    assert s["errors"] == 1 and s["output_tokens"] == 8 and s["output_tokens_per_s"] == 4.0
    assert s["ttft_ms"]["p50"] == 200.0


def test_compare_meets_goals_only_when_clean():
    rr = {"prefix_cache_hit_rate": 0.2, "ttft_ms": {"p50": 1000.0}, "output_tokens_per_s": 10.0, "errors": 0}
    router = {
        "prefix_cache_hit_rate": 0.5,
        "ttft_ms": {"p50": 500.0},
        "output_tokens_per_s": 11.0,
        "errors": 0,
    }
    c = compare(router, rr)
    assert c["hit_rate_ratio"] == 2.5 and c["ttft_p50_reduction"] == 0.5 and c["throughput_ratio"] == 1.1
    assert all(g["met"] for g in c["goals"].values())
    assert not any(g["met"] for g in compare({**router, "errors": 1}, rr)["goals"].values())
    assert not compare({**router, "prefix_cache_hit_rate": 0.25}, rr)["goals"]["hit_rate_ratio"]["met"]


def test_compare_precise_holds_issue_31s_goals():
    from kvscale.worker.bench.route import compare_precise

    rr = {"prefix_cache_hit_rate": 0.3, "ttft_ms": {"p99": 500.0}, "output_tokens_per_s": 10.0, "errors": 0}
    approx = {**rr, "prefix_cache_hit_rate": 0.5}
    precise = {
        "prefix_cache_hit_rate": 0.65,
        "ttft_ms": {"p99": 450.0},
        "output_tokens_per_s": 10.5,
        "errors": 0,
        "replica_agreement": 0.8,
        "replica_agreement_on_cached": 0.97,
    }
    c = compare_precise(precise, approx, rr)
    assert c["hit_rate_over_approximate"] == 1.3 and c["ttft_p99_over_round_robin"] == 0.9
    assert all(g["met"] for g in c["goals"].values())
    slower = compare_precise({**precise, "ttft_ms": {"p99": 510.0}}, approx, rr)["goals"]
    assert not slower["ttft_p99_over_round_robin"]["met"] and slower["hit_rate_over_approximate"]["met"]
    apart = compare_precise({**precise, "replica_agreement_on_cached": 0.9}, approx, rr)["goals"]
    assert not apart["replica_agreement_on_cached"]["met"]
    assert not any(g["met"] for g in compare_precise(precise, {**approx, "errors": 2}, rr)["goals"].values())


def test_compare_precise_takes_the_median_pair_for_latency_and_throughput():
    from kvscale.worker.bench.route import compare_precise

    def run(p99, tps, hit=0.3, errors=0):
        return {
            "prefix_cache_hit_rate": hit,
            "ttft_ms": {"p99": p99},
            "output_tokens_per_s": tps,
            "errors": errors,
            "replica_agreement_on_cached": 1.0,
        }

    approx = run(600.0, 10.0, hit=0.1)
    pairs = [
        (run(500.0, 10.0), run(450.0, 11.0)),
        (run(500.0, 10.0), run(600.0, 9.0)),
        (run(500.0, 10.0), run(480.0, 10.5)),
    ]
    c = compare_precise(pairs[0][1], approx, pairs[0][0], pairs)
    assert c["ttft_p99_over_round_robin"] == 0.96 and c["throughput_ratio"] == 1.05  # the middle ones
    assert c["pairs"]["ttft_p99_over_round_robin"] == [0.9, 1.2, 0.96]
    assert c["goals"]["ttft_p99_over_round_robin"]["met"] and c["goals"]["throughput_ratio"]["met"]
    pairs[1] = (pairs[1][0], run(600.0, 9.0, errors=1))  # an error anywhere fails every goal
    assert not any(
        g["met"] for g in compare_precise(pairs[0][1], approx, pairs[0][0], pairs)["goals"].values()
    )


def test_ttft_tail_names_what_was_ahead_at_the_same_worker(tmp_path):
    def turn(start, first, end, endpoint, prompt=100, cached=0):
        return TurnResult(start, first, end, 4, None, endpoint, "r", prompt, cached)

    slow = turn(1.0, 3.0, 4.0, "w1", prompt=400, cached=256)
    turns = [
        turn(0.0, 1.5, 2.0, "w1", prompt=300, cached=100),  # prefill still ahead at 1.0
        turn(0.5, 0.8, 1.2, "w1"),  # first token before 1.0, still streaming
        turn(0.2, 0.4, 0.6, "w1"),  # done before 1.0
        turn(0.9, 5.0, 6.0, "w2"),  # another worker: slowest, but not ahead of the slow one
        slow,
        turn(2.0, 2.1, 2.5, "w1"),  # sent after it
    ]
    tail = ttft_tail(turns, n=2)
    assert [t["endpoint"] for t in tail] == ["w2", "w1"]
    assert tail[1] == {
        "ttft_ms": 2000.0,
        "endpoint": "w1",
        "prompt_tokens": 400,
        "cached_tokens": 256,
        "ahead": 1,
        "ahead_tokens": 200,
        "busy": 2,
    }
    path = write_trace(ClientRun(turns, 6.0), tmp_path, "precise")
    assert path.name == "trace-precise-0.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[4]["first"] == 3.0 and rows[4]["cached_tokens"] == 256
    assert write_trace(ClientRun(turns, 6.0), tmp_path, "precise").name == "trace-precise-1.jsonl"
