"""`python -m kvscale.worker.bench load`: the loader against cat on a locally made checkpoint (issue 29;
the figures on the 1B-shaped one are in docs/benchmarks.md). Here a 1-layer, small-vocabulary one,
warm page cache only (dropping the cache needs root and slows everyone else)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_load_reports_each_reader_against_cat(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "kvscale.worker.bench", "load", "--json", "--checkpoint",
         str(tmp_path / "ckpt"), "--layers", "1", "--vocab-size", "512", "--caches", "warm", "--runs", "1",
         "--threads", "2"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["files"] == 2 and result["bytes"] > 100e6  # 1 layer of the 1B shape: ~130 MB
    assert set(result["gb_per_s"]) == {"cat_warm", "mapped_t2_warm", "staged_warm"}
    assert all(row["median"] > 0 for row in result["gb_per_s"].values())
