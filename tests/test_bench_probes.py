"""`python -m kvscale.worker.bench probes` (issue 33, must-show 3's measure; figures in
docs/benchmarks.md): a small run that checks the streams kept the engine busy, both paths were
probed during it with no failure, and the goal is computed from the p99s it reports."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_probes_reports_health_and_metrics_latency_under_load(target_model, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "kvscale.worker.bench", "probes", "--json", "--model", target_model,
         "--streams", "4", "--max-tokens", "16", "--seconds", "4", "--enforce-eager"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["load"]["errors"] == [] and result["load"]["chunks_per_s"] > 0
    for path in ("/health", "/metrics"):
        probes = result["probes"][path]
        assert probes["probes"] >= 20 and probes["failures"] == 0  # every 20 ms for ~3 s, in turn
        assert 0 < probes["p50_ms"] <= probes["p99_ms"] <= probes["p100_ms"]
    met = all(p["p99_ms"] < 50 for p in result["probes"].values())
    assert result["goal"] == {"p99_ms_under": 50.0, "met": met}
