"""Metrics: EngineMetrics moves by exactly what the engine reports and exports it under ours and
vLLM's names alike; a real Prometheus scraping a loaded worker sees the KV cache fill and drain and
every generated token; the Grafana dashboard only queries metrics the worker exports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from model_fixtures import REPO
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import free_port, start_server

from kvscale.worker.config import EngineArgs
from kvscale.worker.engine import async_llm
from kvscale.worker.engine.async_llm import AsyncLLM, publish_due
from kvscale.worker.engine.outputs import RequestOutput
from kvscale.worker.metrics.prometheus import EngineMetrics
from kvscale.worker.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
from kvscale.worker.sample.sampling_params import SamplingParams

MODEL = "tiny"
DASHBOARD = REPO / "docs" / "grafana-dashboard.json"

# Our family -> the same value under vLLM's names (what vLLM dashboards, KEDA and the Gateway API
# inference extension query).
TWINS = {
    "kvscale_kv_cache_usage_ratio": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    "kvscale_requests_running": ["vllm:num_requests_running"],
    "kvscale_requests_waiting": ["vllm:num_requests_waiting"],
    "kvscale_prompt_tokens": ["vllm:prompt_tokens"],
    "kvscale_generation_tokens": ["vllm:generation_tokens"],
    "kvscale_prefix_cache_query_tokens": ["vllm:prefix_cache_queries"],
    "kvscale_prefix_cache_hit_tokens": ["vllm:prefix_cache_hits"],
    "kvscale_preemptions": ["vllm:num_preemptions"],
    "kvscale_requests_finished": ["vllm:request_success"],
    "kvscale_time_to_first_token_seconds": ["vllm:time_to_first_token_seconds"],
    "kvscale_inter_token_latency_seconds": [
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ],
    "kvscale_e2e_request_latency_seconds": ["vllm:e2e_request_latency_seconds"],
    "kvscale_request_queue_time_seconds": ["vllm:request_queue_time_seconds"],
    "kvscale_spec_decode_drafts": ["vllm:spec_decode_num_drafts"],
    "kvscale_spec_decode_draft_tokens": ["vllm:spec_decode_num_draft_tokens"],
    "kvscale_spec_decode_accepted_tokens": ["vllm:spec_decode_num_accepted_tokens"],
    "kvscale_spec_decode_accepted_tokens_per_position": ["vllm:spec_decode_num_accepted_tokens_per_pos"],
}

Samples = dict[tuple[str, frozenset], float]


def families(metrics: EngineMetrics) -> list:
    """The exposition's families, without prometheus_client's `_created` timestamps."""
    parsed = text_string_to_metric_families(metrics.render().decode())
    return [f for f in parsed if not f.name.endswith("_created")]


def scrape(metrics: EngineMetrics) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value for f in families(metrics) for s in f.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def assert_twins_agree(samples: Samples) -> None:
    suffixes = ("", "_total", "_bucket", "_count", "_sum")
    for ours, theirs in TWINS.items():
        own = {(sfx, ls): v for (n, ls), v in samples.items() for sfx in suffixes if n == ours + sfx}
        for twin in theirs:
            mirrored = {(suffix, ls): samples.get((twin + suffix, ls)) for suffix, ls in own}
            assert mirrored == own, (ours, twin)


def iteration() -> IterationStats:
    return IterationStats(
        num_prompt_tokens=7,
        num_generation_tokens=5,
        time_to_first_tokens=[0.02, 0.3],
        inter_token_latencies=[0.01, 0.012, 0.05],
        finished=[
            FinishedRequestStats(
                "length", 1.2, 0.1, num_prompt_tokens=7, num_generation_tokens=5, lora_name="a"
            ),
            FinishedRequestStats("abort", 0.4, None, num_prompt_tokens=3, num_generation_tokens=0),
        ],
        num_preemptions=2,
        prefix_cache_queries=32,
        prefix_cache_hits=16,
        num_drafts=3,
        num_draft_tokens=9,
        num_accepted_tokens=4,
        accepted_per_position=[3, 1, 0],
        lora_prompt_tokens={"a": 7},
        lora_generation_tokens={"a": 5},
        lora_resident=["a"],
    )


def test_record_moves_metrics_by_exactly_the_iteration_stats():
    metrics = EngineMetrics(MODEL)
    metrics.record(iteration(), SchedulerStats(4, 1, 0.75, 2, 32, 16), num_blocks=64)
    metrics.record(iteration(), SchedulerStats(3, 2, 0.5, 4, 64, 32), num_blocks=64)
    metrics.record(IterationStats(), SchedulerStats(3, 2, 0.5, 4, 64, 32), num_blocks=64)  # an idle step
    samples = scrape(metrics)
    expected = {
        ("kvscale_kv_cache_usage_ratio", ()): 0.5,
        ("kvscale_kv_cache_blocks", ()): 64,
        ("kvscale_requests_running", ()): 3,
        ("kvscale_requests_waiting", ()): 2,
        ("kvscale_prompt_tokens_total", ()): 14,
        ("kvscale_generation_tokens_total", ()): 10,
        ("kvscale_prefix_cache_query_tokens_total", ()): 64,
        ("kvscale_prefix_cache_hit_tokens_total", ()): 32,
        ("kvscale_preemptions_total", ()): 4,
        ("kvscale_requests_finished_total", (("finished_reason", "stop"),)): 0,
        ("kvscale_requests_finished_total", (("finished_reason", "length"),)): 2,
        ("kvscale_requests_finished_total", (("finished_reason", "abort"),)): 2,
        ("kvscale_time_to_first_token_seconds_count", ()): 4,
        ("kvscale_time_to_first_token_seconds_sum", ()): 2 * 0.32,
        ("kvscale_time_to_first_token_seconds_bucket", (("le", "0.02"),)): 2,
        ("kvscale_inter_token_latency_seconds_count", ()): 6,
        ("kvscale_inter_token_latency_seconds_sum", ()): 2 * 0.072,
        ("kvscale_e2e_request_latency_seconds_count", ()): 4,
        ("kvscale_e2e_request_latency_seconds_sum", ()): 2 * 1.6,
        ("kvscale_request_queue_time_seconds_count", ()): 2,  # an abort before scheduling has none
        ("kvscale_request_queue_time_seconds_sum", ()): 2 * 0.1,
        ("kvscale_spec_decode_drafts_total", ()): 6,
        ("kvscale_spec_decode_draft_tokens_total", ()): 18,
        ("kvscale_spec_decode_accepted_tokens_total", ()): 8,
        ("kvscale_spec_decode_accepted_tokens_per_position_total", (("position", "0"),)): 6,
        ("kvscale_spec_decode_accepted_tokens_per_position_total", (("position", "1"),)): 2,
        ("kvscale_spec_decode_accepted_tokens_per_position_total", (("position", "2"),)): 0,
    }
    for (name, labels), want in expected.items():
        assert math.isclose(value(samples, name, **dict(labels)), want), name
    assert_twins_agree(samples)
    # A state, not a counter: adapter a was resident after the first two steps, not after the last.
    assert not [n for n, _ in samples if n == "kvscale_lora_adapter_resident"]


def test_publish_due_batches_steps_but_never_a_finish():
    def out(finished: bool) -> RequestOutput:
        return RequestOutput("r", None, [1], [], finished)

    interval = async_llm.METRICS_INTERVAL
    counts = (2, 1)  # running, waiting
    assert not publish_due((0.0, counts), interval / 2, counts, [out(False), out(False)])
    assert publish_due((0.0, counts), interval, counts, [out(False)])
    assert publish_due((0.0, counts), interval, counts, [])
    assert publish_due((0.0, counts), 0.0, counts, [out(False), out(True)])
    assert publish_due((0.0, counts), 0.0, (3, 0), [out(False)])  # admitted: the gauges never lag


def test_a_request_is_counted_by_the_time_its_stream_ends(target_model, monkeypatch):
    """The engine thread publishes at most every METRICS_INTERVAL while it steps, but always after a
    step that finished a request: a client holding its whole answer finds it in /metrics, even
    while other requests keep the engine busy. The interval is made an hour here, so that only
    the short request's admission and its finish can have published."""
    monkeypatch.setattr(async_llm, "METRICS_INTERVAL", 3600.0)

    async def scenario() -> None:
        llm = AsyncLLM(EngineArgs(model=target_model, device="cpu", num_kv_blocks=64), MODEL)
        records = 0
        record = llm.metrics.record

        def counted(*args) -> None:
            nonlocal records
            records += 1
            record(*args)

        llm.metrics.record = counted
        await llm.start()
        try:
            busy = llm.generate("long", SamplingParams(max_tokens=400, ignore_eos=True), "busy")
            await anext(busy)  # the engine now steps until it ends, never idle
            before = records
            short = [o async for o in llm.generate("x", SamplingParams(max_tokens=20, ignore_eos=True), "s")]
            assert short[-1].finished
            samples = scrape(llm.metrics)
            assert value(samples, "kvscale_requests_finished_total", finished_reason="length") == 1
            assert value(samples, "kvscale_generation_tokens_total") >= 20
            assert records - before <= 2, "published on steps that changed nothing"
            await busy.aclose()
        finally:
            await llm.shutdown()

    asyncio.run(scenario())


def test_structured_output_metrics_move_by_the_iteration_stats():
    metrics = EngineMetrics(MODEL)
    assert value(scrape(metrics), "kvscale_structured_output_requests_total") == 0
    for _ in range(2):
        stats = IterationStats(
            num_structured_requests=3, grammar_compile_times=[0.004, 0.2], grammar_mask_times=[0.0003]
        )
        metrics.record(stats, SchedulerStats(0, 0, 0.0, 0, 0, 0), num_blocks=64)
    samples = scrape(metrics)
    assert value(samples, "kvscale_structured_output_requests_total") == 6
    assert value(samples, "kvscale_structured_output_compile_seconds_count") == 4
    assert math.isclose(value(samples, "kvscale_structured_output_compile_seconds_sum"), 2 * 0.204)
    assert value(samples, "kvscale_structured_output_compile_seconds_bucket", le="0.005") == 2
    assert value(samples, "kvscale_structured_output_mask_seconds_count") == 2
    assert value(samples, "kvscale_structured_output_mask_seconds_bucket", le="0.0005") == 2


def test_cold_start_metrics_show_both_phases_and_the_switch():
    """Issue 29: step seconds by the forward they ran, and the switch to the compiled forward."""
    metrics = EngineMetrics(MODEL)
    samples = scrape(metrics)
    assert value(samples, "kvscale_forward_compiled") == 0
    assert value(samples, "kvscale_engine_step_seconds_count", forward="compiled") == 0  # exported at 0
    idle = SchedulerStats(0, 0, 0.0, 0, 0, 0)
    metrics.record(IterationStats(step_times=[("eager", 0.03), ("eager", 0.05)]), idle, num_blocks=64)
    samples = scrape(metrics)
    assert value(samples, "kvscale_engine_step_seconds_count", forward="eager") == 2
    assert (
        value(samples, "kvscale_forward_compiled") == 0
        and value(samples, "kvscale_forward_compile_seconds") == 0
    )
    switched = IterationStats(step_times=[("compiled", 0.004)], forward="compiled", compile_seconds=41.5)
    metrics.record(switched, idle, num_blocks=64)
    samples = scrape(metrics)
    assert value(samples, "kvscale_engine_step_seconds_count", forward="compiled") == 1
    assert value(samples, "kvscale_engine_step_seconds_bucket", forward="compiled", le="0.005") == 1
    assert math.isclose(value(samples, "kvscale_engine_step_seconds_sum", forward="eager"), 0.08)
    assert value(samples, "kvscale_forward_compiled") == 1
    assert value(samples, "kvscale_forward_compile_seconds") == 41.5


def test_names_follow_prometheus_conventions():
    metrics = EngineMetrics(MODEL)
    metrics.record(iteration(), SchedulerStats(1, 0, 0.1, 0, 0, 0), num_blocks=64)
    found = families(metrics)
    ours = {f.name: f for f in found if f.name.startswith("kvscale_")}
    assert {f.name for f in found} - set(ours) == {twin for names in TWINS.values() for twin in names}
    assert set(TWINS) <= set(ours)
    for f in found:
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", f.name), f.name
        assert f.documentation, f.name
        assert all(s.labels.get("model_name") == MODEL for s in f.samples), f.name
    for name, f in ours.items():
        assert ":" not in name, "colons are for recording rules"
        assert not re.search(r"_(total|count|sum|bucket|created)$", name), name
        if f.type == "counter":
            assert {s.name for s in f.samples} <= {name + "_total"}, name
        elif f.type == "histogram":
            assert name.endswith("_seconds"), "durations are in seconds"
        else:
            assert f.type == "gauge", name
    assert ours["kvscale_kv_cache_usage_ratio"].type == "gauge"  # a 0-1 fraction is a _ratio
    assert not [n for n in ours if re.search("perc", n)]


def test_cache_config_and_lora_info_gauges_are_what_the_inference_gateway_reads():
    """The Gateway API inference extension's picker reads the pool's size and block size from
    `vllm:cache_config_info`'s labels, and LoRA affinity from `vllm:lora_requests_info`."""
    metrics = EngineMetrics(MODEL)
    before = time.time()
    metrics.cache_config(block_size=16, num_blocks=512, enable_prefix_caching=True)
    found = {f.name: f for f in families(metrics)}
    (config,) = found["vllm:cache_config_info"].samples
    assert config.value == 1 and config.labels == {
        "block_size": "16",
        "num_gpu_blocks": "512",
        "enable_prefix_caching": "True",
    }
    (lora,) = found["vllm:lora_requests_info"].samples
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert before <= lora.value <= time.time()  # when it was last updated, as vLLM exports it


def test_labelled_series_exist_before_their_first_event():
    """rate() and increase() only see an increment from a series that already existed at zero."""
    samples = scrape(EngineMetrics(MODEL))
    for reason in ("stop", "length", "abort"):
        assert value(samples, "kvscale_requests_finished_total", finished_reason=reason) == 0
    for reason in ("queue_full", "draining", "loading", "engine_dead", "invalid"):
        assert value(samples, "kvscale_requests_rejected_total", reason=reason) == 0


def test_a_scrape_never_sees_half_a_record():
    """The engine thread records while the server renders: the twins must never disagree."""
    metrics = EngineMetrics(MODEL)
    stop = threading.Event()

    def engine_thread() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            sched = SchedulerStats(step % 5, step % 7, (step % 11) / 11, 0, 0, 0)
            metrics.record(IterationStats(num_generation_tokens=1, num_prompt_tokens=step % 3), sched, 64)

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, even inside a render
    thread = threading.Thread(target=engine_thread)
    thread.start()
    try:
        for _ in range(50):
            assert_twins_agree(scrape(metrics))
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch_interval)


# -- the Grafana dashboard ---------------------------------------------------------------------


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    variables = dashboard["templating"]["list"]
    return exprs + [v["query"]["query"] for v in variables if v["type"] == "query"]


def referenced_metrics(query: str) -> set[str]:
    return set(re.findall(r"\b(?:kvscale_|vllm:)[a-zA-Z0-9_:]*", query))


def test_dashboard_queries_only_exported_metrics():
    metrics = EngineMetrics(MODEL)
    metrics.record(iteration(), SchedulerStats(1, 0, 0.1, 0, 0, 0), num_blocks=64)
    metrics.set_served_adapters({"a": "0" * 64})
    exported = {name for name, _ in scrape(metrics)}
    queries = dashboard_queries()
    used = set().union(*map(referenced_metrics, queries))
    assert used <= exported, f"the dashboard queries metrics the worker does not export: {used - exported}"
    # ...and it charts every metric we export.
    suffix = re.compile(r"_(total|bucket|sum|count)$")
    ours = {f.name for f in families(metrics) if f.name.startswith("kvscale_")}
    assert ours <= {suffix.sub("", name) for name in used}
    assert all('model_name=~"$model_name"' in q for q in queries if "label_values" not in q)


# -- a real Prometheus scraping a loaded worker --------------------------------------------------

PROMETHEUS_CONFIG = """\
global:
  scrape_interval: 200ms
  scrape_timeout: 200ms
  evaluation_interval: 200ms
scrape_configs:
  - job_name: kvscale
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


class Prometheus:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        params = {"query": promql} | ({} if at is None else {"time": f"{at:.3f}"})
        url = f"{self.base_url}/api/v1/query?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{promql}: {e.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]["result"]

    def samples(self, name: str, since: float, at: float | None = None) -> dict[float, float]:
        """The raw scraped samples of one series from `since` (or a little earlier) to `at`
        (default: now), as {scrape timestamp: value}."""
        window = math.ceil((at or time.time()) - since) + 1
        (series,) = self.query(f"{name}[{window}s]", at)
        return {float(t): float(v) for t, v in series["values"]}


@contextlib.contextmanager
def prometheus_scraping(binary: str, port: int, tmp_path: Path) -> Iterator[Prometheus]:
    config = tmp_path / "prometheus.yml"
    config.write_text(PROMETHEUS_CONFIG.format(port=port))
    listen = f"127.0.0.1:{free_port()}"
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address={listen}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prometheus = Prometheus(f"http://{listen}")
    try:
        wait_until(lambda: ready(prometheus.base_url + "/-/ready"), 20, "Prometheus is not ready", proc)
        yield prometheus
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until(condition, timeout: float, message: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, f"{message}: exited with {proc.returncode}"
        assert time.monotonic() < deadline, message
        time.sleep(0.1)


async def stream_tokens(session: aiohttp.ClientSession, base_url: str, max_tokens: int) -> int:
    """Stream one completion; returns how many tokens reached the client (from per-token logprobs)."""
    body = {
        "prompt": "def fibonacci(n):\n",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    received = 0
    async with session.post(base_url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: {"):
                event = json.loads(line.removeprefix(b"data: "))
                received += sum(len(c["logprobs"]["tokens"]) for c in event["choices"])
                if event.get("usage"):
                    assert event["usage"]["completion_tokens"] == received
    return received


@pytest.mark.slow
def test_prometheus_scrapes_the_worker_under_load(target_model, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not installed (Debian/Ubuntu: apt-get install prometheus)")
    max_num_seqs, num_requests, max_tokens = 4, 8, 300  # 4 x 20 blocks wanted, 64 there: preemptions
    worker = start_server(
        target_model, tmp_path, "--num-kv-blocks", "64", "--max-num-seqs", str(max_num_seqs)
    )
    try:
        with prometheus_scraping(binary, worker.port, tmp_path) as prometheus:
            wait_until(lambda: prometheus.query('up{job="kvscale"} == 1'), 10, "no successful scrape")
            started = time.time()

            async def load() -> list[int]:
                async with aiohttp.ClientSession() as session:
                    requests = [
                        stream_tokens(session, worker.base_url, max_tokens) for _ in range(num_requests)
                    ]
                    return await asyncio.gather(*requests)

            received = asyncio.run(load())
            ended = time.time()
            assert received == [max_tokens] * num_requests

            # Wait for a scrape of the idle engine after the load, then read everything as of then.
            def late_scrape() -> bool:
                return max(prometheus.samples("kvscale_kv_cache_usage_ratio", started)) > ended

            wait_until(late_scrape, 10, "no scrape after the load")
            at = time.time()

            def series(name: str) -> dict[float, float]:
                return prometheus.samples(name, started, at)

            usage, running, waiting = (
                series(n)
                for n in (
                    "kvscale_kv_cache_usage_ratio",
                    "kvscale_requests_running",
                    "kvscale_requests_waiting",
                )
            )
            during = [t for t in usage if started <= t <= ended]
            assert len(during) >= 10, "Prometheus barely scraped during the load"
            assert max(usage[t] for t in during) > 0.5, "the load should fill most of the 64 blocks"
            assert 0 < max(running[t] for t in during) <= max_num_seqs
            assert max(waiting[t] for t in during) > 0
            last = max(usage)
            assert (usage[last], running[last], waiting[last]) == (0, 0, 0)

            # vLLM's names carry our values, scrape by scrape.
            for ours, theirs in [
                ("kvscale_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
                ("kvscale_kv_cache_usage_ratio", "vllm:gpu_cache_usage_perc"),
                ("kvscale_requests_running", "vllm:num_requests_running"),
                ("kvscale_requests_waiting", "vllm:num_requests_waiting"),
                ("kvscale_generation_tokens_total", "vllm:generation_tokens_total"),
                ("kvscale_prompt_tokens_total", "vllm:prompt_tokens_total"),
            ]:
                assert series(ours) == series(theirs), (ours, theirs)

            generated = series("kvscale_generation_tokens_total")
            assert generated[max(generated)] == sum(received)
            (preemptions,) = prometheus.query('kvscale_preemptions_total{job="kvscale"}')
            assert float(preemptions["value"][1]) > 0
            (config,) = prometheus.query('vllm:cache_config_info{job="kvscale"}')
            assert config["metric"]["num_gpu_blocks"] == "64" and config["metric"]["block_size"] == "16"

            # Every dashboard query is valid PromQL with series to draw, but two kinds: speculative
            # decoding's per-position series and the per-adapter LoRA series, which appear with the
            # first draft or the first adapter request (this worker runs neither). The adapter-free
            # LoRA moves (slot loads, ...) are counters that exist from the start: they must draw.
            for query in dashboard_queries():
                if not query.startswith("label_values"):
                    promql = query.replace("$model_name", ".+").replace("$__rate_interval", "5s")
                    result = prometheus.query(promql, at)
                    per_series = "per_position" in promql or "by (lora_name)" in promql
                    assert result or per_series, f"no data for {promql}"
            # Over the whole load, as of `at`: a fixed [1m] window evaluated later saw no increase
            # (NaN) whenever the test ran slower than that on a loaded machine.
            window = f"{int(at - started) + 1}s"
            buckets = f"rate(kvscale_time_to_first_token_seconds_bucket[{window}])"
            (ttft_p50,) = prometheus.query(f"histogram_quantile(0.5, sum by (le) ({buckets}))", at)
            assert float(ttft_p50["value"][1]) > 0
    finally:
        exit_code = worker.stop()
    assert exit_code == 0, worker.log()
